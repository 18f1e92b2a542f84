"""The KV-step tile layouts of the linalg lowering (mlir/score_tiles.py), chosen per CPU and dtype
in pipeline/cpu_tiles.py: which one each CPU gets, what the IR then holds, and the row tiles'
numerics on a CPU that gets them (the host's own layout runs in every dense test)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from linalg_prefill.mlir import MaskedSequencePrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec
from linalg_prefill.mlir.score_tiles import ROW_TILES, PackedTiles
from linalg_prefill.pipeline import Target
from linalg_prefill.mlir.decode import NARROW_PASS_VECTORS, WIDE_PASS_VECTORS, DecodeSpec
from linalg_prefill.pipeline.cpu_tiles import (
    HIDDEN_FEATURES_VARIABLE, NAMED_CPU_FEATURES, READ_FEATURES, cpu_features, cpu_pass_vectors, cpu_score_tiles,
    cpu_spec_lowering, features_to_hide, host_cpu_features, proc_cpu_flags,
)
from linalg_prefill.pipeline.tuning import tuned_ir
from support import run_against_reference, spec_id

AVX512_BF16, AVX512, AVX2 = "znver4", "skylake-avx512", "znver3"


@pytest.mark.parametrize("arch, dtype, want", [
    (AVX512_BF16, "bfloat16", PackedTiles(dtype="bfloat16", m0=16, n0=16, k0=2)),
    (AVX512_BF16, "float32", PackedTiles(dtype="float32", m0=16, n0=16, k0=1)),
    (AVX512_BF16, "float16", PackedTiles(dtype="float32", m0=16, n0=16, k0=1)),
    (AVX512, "bfloat16", PackedTiles(dtype="float32", m0=16, n0=16, k0=1)),
    (AVX2, "bfloat16", ROW_TILES), (AVX2, "float32", ROW_TILES), (AVX2, "float16", ROW_TILES),
    ("a-cpu-llvm-does-not-name", "bfloat16", ROW_TILES),
])
def test_each_cpu_gets_the_layout_measured_fastest_on_it(arch, dtype, want):
    assert cpu_score_tiles(arch, dtype) == want


@pytest.mark.parametrize("arch, want", [(AVX512_BF16, WIDE_PASS_VECTORS), (AVX512, WIDE_PASS_VECTORS),
                                        (AVX2, NARROW_PASS_VECTORS), ("a-cpu-llvm-does-not-name", NARROW_PASS_VECTORS)])
def test_each_cpu_gets_the_serving_pass_vectors_measured_fastest_on_it(arch, want):
    """And the pass's IR for that CPU carries them (the scores' head-dim vector of a 1-query pass
    over a cache the x86 passes an AVX-512 CPU gets do not read: e5m2fnuz)."""
    assert cpu_pass_vectors(arch) == want
    spec = DecodeSpec(PagedPrefillSpec(8, 2, 128, "bfloat16", kv_dtype="float8_e5m2fnuz"))
    ir_text = tuned_ir(spec, Target("llvm-cpu", arch))
    assert f"vector_reduction = [0, 0, 0, 0, 0, 0, {want.head_dim}]" in ir_text


def test_the_host_is_read_from_proc_cpuinfo():
    assert cpu_features("host") == host_cpu_features()
    with open("/proc/cpuinfo") as info:
        flags = next(line for line in info if line.startswith("flags")).split(":", 1)[1].split()
    assert proc_cpu_flags() == frozenset(flags)
    hidden = {name.strip() for name in os.environ.get(HIDDEN_FEATURES_VARIABLE, "").split(",")}
    assert host_cpu_features() == frozenset(flags) - hidden


def test_hidden_features_are_not_the_hosts_and_amx_hidden_keeps_the_linalg_lowering():
    """LINALG_PREFILL_HIDE_CPU_FEATURES (a new process reads it): AMX and AVX-512 BF16 hidden, a
    bf16 paged spec the x86 lowering builds with either keeps the linalg lowering, as on a
    Skylake-SP Xeon."""
    code = ("from linalg_prefill.mlir import PagedPrefillSpec\n"
            "from linalg_prefill.pipeline.cpu_tiles import cpu_spec_lowering, host_cpu_features\n"
            "spec = PagedPrefillSpec(8, 2, 64, 'bfloat16', page_size=16)\n"
            "print(sorted(f for f in host_cpu_features() if f.startswith('amx') or f == 'avx2'),"
            " cpu_spec_lowering('host', spec, 'linalg'))\n")
    env = {**os.environ, HIDDEN_FEATURES_VARIABLE: "amx_tile, amx_bf16,amx_int8,avx512_bf16"}
    hidden = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    shown = "['avx2']" if "avx2" in proc_cpu_flags() else "[]"
    assert hidden.stdout.split() == [shown, "linalg"]


@pytest.fixture
def host_features_read_again():
    """host_cpu_features read again under the test's environment, and again after it."""
    host_cpu_features.cache_clear()
    yield
    host_cpu_features.cache_clear()


def test_the_host_chooses_as_a_named_cpu_with_its_features_to_hide(monkeypatch, host_features_read_again):
    """``make test-as CPU=...``: with features_to_hide(arch) hidden, this host chooses as ``arch``
    does (tiles, pass vectors, lowering) for every named CPU whose features it has; an unknown
    CPU, or one with a feature the host lacks, is an error naming it."""
    dense_f32 = SequencePrefillSpec(8, 2, 64, "float32", causal=True, sm_scale=0.125)
    host_read = READ_FEATURES & proc_cpu_flags()
    covered = [arch for arch, features in NAMED_CPU_FEATURES.items() if features <= host_read]
    assert "x86-64-v3" in covered or "avx2" not in host_read
    for arch in covered:
        monkeypatch.setenv(HIDDEN_FEATURES_VARIABLE, features_to_hide(arch))
        host_cpu_features.cache_clear()
        assert cpu_features("host") & READ_FEATURES == NAMED_CPU_FEATURES[arch], arch
        assert cpu_pass_vectors("host") == cpu_pass_vectors(arch), arch
        for dtype in ("float32", "float16", "bfloat16"):
            assert cpu_score_tiles("host", dtype) == cpu_score_tiles(arch, dtype), (arch, dtype)
        for spec in (DENSE_BF16, dense_f32):
            lowering = cpu_spec_lowering(arch, spec, "linalg")
            assert cpu_spec_lowering("host", spec, "linalg") == lowering, (arch, spec.dtype)
    with pytest.raises(ValueError, match="'pentium'"):
        features_to_hide("pentium")
    for arch in set(NAMED_CPU_FEATURES) - set(covered):   # hiding cannot add a feature
        with pytest.raises(ValueError, match="this host has not"):
            features_to_hide(arch)


DENSE_BF16 = SequencePrefillSpec(8, 2, 64, "bfloat16", causal=True, sm_scale=0.125)
#: With head sinks: a dense spec the x86 lowering has no kernel of, the linalg one on every CPU.
LINALG_DENSE_BF16 = SequencePrefillSpec(8, 2, 64, "bfloat16", causal=True, sm_scale=0.125, head_sinks=True)


def test_packed_tiles_contract_bf16_operands_with_mmt4d():
    packed = tuned_ir(LINALG_DENSE_BF16, Target("llvm-cpu", AVX512_BF16))
    # queries [h_kv, rows / 16, d / 2, 16, 2], keys [h_kv, 256 / 16, d / 2, 16, 2] -> f32 scores
    assert "linalg.batch_mmt4d ins(%" in packed
    assert "tensor<2x64x32x16x2xbf16>, tensor<2x16x32x16x2xbf16>) outs(" in packed
    assert "flow.tensor.bitcast" in packed  # the weights' transpose as 32-bit words
    assert "linalg.batch_mmt4d" not in tuned_ir(LINALG_DENSE_BF16, Target("llvm-cpu", AVX2))


def test_the_kv_cache_variants_pack_too_and_a_shape_the_tiles_do_not_divide_keeps_the_row_tiles():
    target = Target("llvm-cpu", AVX512_BF16)
    paged = tuned_ir(PagedPrefillSpec(8, 2, 80, "bfloat16"), target)   # d 80: no x86 kernel
    assert "linalg.batch_mmt4d" in paged and "x16x2xbf16>" in paged
    for spec in (SequencePrefillSpec(4, 4, 72, "bfloat16", causal=True, sm_scale=0.125),  # 72 % 16
                 PagedPrefillSpec(4, 4, 64, "float32", q_tile=8)):  # an 8-row query tile
        assert "linalg.batch_mmt4d" not in tuned_ir(spec, target)


#: The dense row tiles, as an AVX2 CPU runs them (this machine runs znver3 code too), and the
#: KV-cache kernels' linalg lowering (on an AVX-512 CPU the x86 one: tests/test_x86_kv_cache.py).
ROW_TILE_SPECS = [SequencePrefillSpec(8, 2, 64, "float32", causal=True, sm_scale=0.125),
                  SequencePrefillSpec(4, 4, 128, "bfloat16", causal=False, sm_scale=128 ** -0.5),
                  MaskedSequencePrefillSpec(4, 2, 64, "float16", mask_mode="causal_padded_left", sm_scale=0.125),
                  PagedPrefillSpec(8, 2, 64, "bfloat16", page_size=16),
                  RaggedPrefillSpec(4, 2, 64, 32, "float32", kv_order="hnd")]


@pytest.mark.parametrize("backend", [pytest.param(Target("llvm-cpu", AVX2), id="llvm-cpu-znver3")])
@pytest.mark.parametrize("spec", ROW_TILE_SPECS, ids=spec_id)
def test_the_row_tiles_match_the_reference(spec, backend, cache):
    for batch, qo_len, kv_len in [(2, 300, 300), (1, 129, 5), (3, 17, 40)]:
        calls = [dict(valid_lens=np.array([min(qo_len, kv_len) // 2 + i for i in range(batch)], np.int32))] \
            if isinstance(spec, MaskedSequencePrefillSpec) else [{}]
        run_against_reference(spec, backend, cache=cache, entries=[(qo_len, kv_len)] * batch, calls=calls)


def test_show_config_names_the_host_tiles_of_each_dtype(capsys):
    from linalg_prefill.cli import main
    from linalg_prefill.mlir.specs import DTYPES

    assert main(["show-config"]) == 0
    shown = capsys.readouterr().out
    for dtype in DTYPES:
        assert f"llvm-cpu host {dtype:<9} {cpu_score_tiles('host', dtype).describe()}" in shown
    assert "row tiles" in ROW_TILES.describe() and "16x16x2 bfloat16" in cpu_score_tiles(AVX512_BF16, "bfloat16").describe()


#: bf16 on an AVX-512 CPU without avx512_bf16: widened to f32 operands in the packed tiles (this
#: machine runs skylake-avx512 code too).
WIDENED_BF16 = [SequencePrefillSpec(8, 2, 64, "bfloat16", causal=True, sm_scale=0.125),
                PagedPrefillSpec(8, 2, 64, "bfloat16", page_size=16)]


@pytest.mark.skipif("avx512f" not in host_cpu_features(), reason="the host CPU cannot run AVX-512 code")
@pytest.mark.parametrize("backend", [pytest.param(Target("llvm-cpu", AVX512), id="llvm-cpu-skylake-avx512")])
@pytest.mark.parametrize("spec", WIDENED_BF16, ids=spec_id)
def test_bf16_widened_to_f32_packed_tiles_matches_the_reference(spec, backend, cache):
    assert "linalg.batch_mmt4d" in tuned_ir(spec, backend) and "x16x2xbf16" not in tuned_ir(spec, backend)
    entries = [(300, 300)] * 2 if spec.kv_layout == "dense" else [(100, 300), (1, 40), (37, 37)]
    run_against_reference(spec, backend, cache=cache, entries=entries, serving_passes=False)
