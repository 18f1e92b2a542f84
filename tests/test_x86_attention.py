"""The x86 lowering (mlir/x86_attention.py: bf16 on AMX tiles, f32 and f16 in FMA blocks): which
specs and CPUs get it, the structure of its IR and objects on every machine, its numerics against
the float64 reference where the record picks it for this CPU (AMX: every dtype; AVX-512 without
AMX, a Zen 4: f32 and f16)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from conftest import NUMPY_DTYPE, assert_matches_reference, uniform
from linalg_prefill.mlir import (
    MaskedSequencePrefillSpec, PagedPrefillSpec, SequencePrefillSpec, build_x86_module, x86_uses_amx,
)
from linalg_prefill.mlir.amx import EXP2_COEFFICIENTS
from linalg_prefill.pipeline import Target
from linalg_prefill.pipeline.compiler import compile_ir
from linalg_prefill.pipeline.cpu_tiles import AMX_FEATURES, NAMED_CPU_FEATURES, host_cpu_features, proc_cpu_flags
from linalg_prefill.pipeline.tuning import tuned_ir
from linalg_prefill.runtime import kernels, open_kernel
from support import AMX_CPU, HOST_HAS_AMX, run_against_reference, spec_id

#: An AVX-512 CPU without AMX (a Zen 4) builds the f32 and f16 dense kernels in the x86 lowering.
HOST_HAS_AVX512 = "avx512f" in host_cpu_features()
TILE_INTRINSICS = ("llvm.x86.tileloadd64.internal", "llvm.x86.tdpbf16ps.internal", "llvm.x86.tilestored64.internal")


def _dense(h_q=8, h_kv=2, d=64, dtype="bfloat16", causal=True, **extra):
    return SequencePrefillSpec(h_q, h_kv, d, dtype, causal=causal, sm_scale=d ** -0.5, **extra)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_the_record_picks_x86_for_dense_specs_on_amx_cpus_and_for_f32_and_f16_on_avx512_ones(dtype):
    spec = _dense(dtype=dtype)
    assert AMX_CPU.lowering_of(spec) == "x86"
    assert Target("llvm-cpu", "graniterapids").lowering_of(spec) == "x86"
    # AVX-512 without AMX: f32 and f16 on the FMA blocks, bf16 on pair dot products (avx512_bf16)
    fma = dtype != "bfloat16"
    for arch in ("znver4", "cooperlake", "skylake-avx512"):
        has_engine = fma or "avx512_bf16" in NAMED_CPU_FEATURES[arch]
        assert Target("llvm-cpu", arch).lowering_of(spec) == ("x86" if has_engine else "linalg")
    assert Target("llvm-cpu", "x86-64-v3").lowering_of(spec) == "linalg"   # no AVX-512
    x86_here = HOST_HAS_AMX or HOST_HAS_AVX512 and (fma or "avx512_bf16" in host_cpu_features())
    assert Target("llvm-cpu", "host").lowering_of(spec) == ("x86" if x86_here else "linalg")
    assert Target("llvm-cpu", "sapphirerapids", lowering="fused").lowering_of(spec) == "fused"
    assert x86_uses_amx(spec) == (dtype == "bfloat16")
    # the KV-cache prefills likewise (tests/test_x86_kv_cache.py)
    paged = PagedPrefillSpec(8, 2, 64, dtype, page_size=16)
    assert AMX_CPU.lowering_of(paged) == "x86" and Target("llvm-cpu", "znver4").lowering_of(paged) == "x86"


def _masked(mode, h_q=8, h_kv=2, d=64, dtype="bfloat16"):
    return MaskedSequencePrefillSpec(h_q, h_kv, d, dtype, mask_mode=mode, sm_scale=d ** -0.5)


@pytest.mark.parametrize("spec", [_dense(d=80), _dense(head_sinks=True), _masked("custom")], ids=spec_id)
def test_specs_without_an_x86_kernel_keep_the_linalg_lowering(spec):
    assert AMX_CPU.lowering_of(spec) == "linalg"
    with pytest.raises(ValueError, match="no x86 lowering"):
        build_x86_module(spec)


def test_x86_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="runs on llvm-cpu"):
        Target("cuda", lowering="x86")
    with pytest.raises(ValueError, match="amx_bf16"):   # bf16 without AMX or avx512_bf16
        Target("llvm-cpu", "skylake-avx512", lowering="x86").lowering_of(_dense())
    with pytest.raises(ValueError, match="amx_bf16"):   # AVX2 only: no x86 kernel at all
        Target("llvm-cpu", "x86-64-v3", lowering="x86").lowering_of(_dense(dtype="float32"))
    assert Target("llvm-cpu", "znver4", lowering="x86").lowering_of(_dense()) == "x86"


def test_x86_ir_has_tile_contractions_for_bf16_only():
    spec = _dense()
    amx_ir = tuned_ir(spec, AMX_CPU)
    assert all(name in amx_ir for name in TILE_INTRINSICS)
    assert "stream.executable" in amx_ir and "flow.dispatch @x86_attention::@attend" in amx_ir
    fma_ir = tuned_ir(_dense(dtype="float32"), AMX_CPU)
    assert "flow.dispatch @x86_attention::@attend" in fma_ir and "math.fma" in fma_ir and "llvm.x86.t" not in fma_ir
    zen4_ir = tuned_ir(spec, Target("llvm-cpu", "znver4"))   # bf16 without AMX: pair dot products
    assert "flow.dispatch @x86_attention::@attend" in zen4_ir and "llvm.x86.avx512bf16.dpbf16ps.512" in zen4_ir
    for other in (Target("llvm-cpu", "znver4"), Target("llvm-cpu", "sapphirerapids", lowering="fused")):
        assert "llvm.x86.t" not in tuned_ir(spec, other)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_x86_kv_is_packed_by_a_dispatch_of_vectors(dtype):
    """K and V reach the attention through the packing dispatch (mlir/x86_packing.py: 64-byte
    vector loads, shuffles and stores), not a generic reading them element by element."""
    text = tuned_ir(_dense(dtype=dtype), AMX_CPU)
    packing = text[text.index("stream.executable private @x86_pack_kv"):text.index("func.func @batch_sequence")]
    kernel = text[text.index("func.func @batch_sequence"):]
    assert "vector.shuffle" in packing and "linalg" not in packing
    assert "flow.dispatch @x86_pack_kv::@pack" in kernel and "](%arg1, %arg2, " in kernel   # k and v as given
    assert kernel.count("linalg.generic") == 1   # the lse from the rows' (max, sum), no K/V generic


def _assembly(spec, target, tmp_path) -> str:
    dump = tmp_path / target.tag
    dumping = Target(target.backend, target.arch, (f"--iree-hal-dump-executable-intermediates-to={dump}",),
                     target.lowering)
    compile_ir(tuned_ir(spec, target), dumping, spec.name)
    return "\n".join(path.read_text() for path in dump.glob("*.s"))


def test_x86_objects_have_tile_instructions_for_bf16_and_the_others_none(tmp_path):
    """Compiled for sapphirerapids (no AMX CPU needed to compile): LLVM configured the tiles
    (ldtilecfg) and runs the products on them; the f32 kernel runs 512-bit FMAs and no tile
    instruction; the bf16 spec for a CPU without AMX has none."""
    amx = _assembly(_dense(), AMX_CPU, tmp_path)
    for instruction in ("ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilerelease"):
        assert instruction in amx, instruction
    fma = _assembly(_dense(dtype="float32"), AMX_CPU, tmp_path / "f32")
    assert "vfmadd231ps\t%zmm" in fma or "vfmadd231ps\t(" in fma
    assert "ldtilecfg" not in fma and "tdpbf16ps" not in fma
    other = _assembly(_dense(), Target("llvm-cpu", "cooperlake"), tmp_path)
    assert other and "tdpbf16ps" not in other and "ldtilecfg" not in other


def test_loading_an_amx_kernel_asks_for_the_tile_state_first(monkeypatch):
    asked = []
    monkeypatch.setattr(kernels, "request_amx_state", lambda: asked.append(True))
    kernels.ready_to_load(_dense(), Target("llvm-cpu", "znver4"))
    kernels.ready_to_load(_dense(dtype="float32"), AMX_CPU)   # the FMA kernel: no tiles
    assert asked == []
    kernels.ready_to_load(_dense(), AMX_CPU)
    assert asked == [True]


def test_the_tile_state_request_names_the_feature_when_refused():
    """A process where Linux refuses XTILEDATA (here: any request on a CPU without AMX; on an AMX
    CPU the request succeeds): the error names amx_tile."""
    code = ("from linalg_prefill.runtime.amx import request_amx_state, AmxUnavailable\n"
            "try:\n    request_amx_state(); request_amx_state(); print('granted')\n"
            "except AmxUnavailable as error:\n    print('refused', error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    if AMX_FEATURES <= proc_cpu_flags():   # the hardware's, whatever LINALG_PREFILL_HIDE_CPU_FEATURES hides
        assert result.strip() == "granted"
    else:
        assert result.startswith("refused") and "amx_tile" in result


def test_exp2_polynomial_is_within_half_an_ulp_on_zero_to_one():
    f = np.linspace(0.0, 1.0, 100001)
    approx = np.polyval(list(reversed(EXP2_COEFFICIENTS)), f)
    assert EXP2_COEFFICIENTS[0] == 1.0
    assert np.max(np.abs(approx / np.exp2(f) - 1.0)) < 2.0 ** -24


def _where_x86(specs) -> list:
    """``specs`` as parameters, each skipped where this host builds it in another lowering (bf16
    without AMX: the CPUs the record picks the x86 lowering on)."""
    return [pytest.param(spec, id=spec_id(spec), marks=pytest.mark.skipif(
        Target("llvm-cpu").lowering_of(spec) != "x86", reason="no x86 kernel of it on this CPU")) for spec in specs]


#: Heads (GQA groups 1, 4, 8), head dims, both masks, the three dtypes (f16 in the FMA blocks):
#: the x86 kernels' grid.
X86_SPECS = [_dense(32, 8, 128, causal=True), _dense(16, 2, 96, causal=True), _dense(8, 1, 256, causal=False),
             _dense(8, 8, 32, causal=True), _dense(32, 8, 128, "float32", causal=False),
             _dense(16, 2, 96, "float32", causal=True), _dense(8, 2, 64, "float16", causal=True)]
#: (B, qo_len, kv_len): one row block and many, odd lengths, a KV block and a partial one, more
#: queries than keys (causal rows that see no key), no key and no query.
AMX_SHAPES = [(1, 1, 1), (2, 37, 100), (1, 300, 333), (2, 129, 5), (1, 9, 0), (1, 0, 7)]


@pytest.mark.parametrize("spec", _where_x86(X86_SPECS))
def test_x86_kernels_match_the_reference(spec, cache):
    assert Target("llvm-cpu").lowering_of(spec) == "x86"
    for batch, qo_len, kv_len in AMX_SHAPES:
        run_against_reference(spec, "llvm-cpu", cache=cache, entries=[(qo_len, kv_len)] * batch)


#: Both padded masks, both dtypes, GQA 4 and 1; (B, qo_len, kv_len): valid_lens, with 0 and the
#: full length, over several row blocks (64 rows: 16 tokens of GQA 4) and KV steps.
MASKED_SPECS = [_masked("padded"), _masked("causal_padded_left", 4, 4, 128), _masked("padded", 4, 4, 96, "float32"),
                _masked("causal_padded_left", 8, 2, 64, "float32")]
MASKED_LENS = {(4, 33, 33): [0, 33, 10, 1], (3, 32, 48): [32, 0, 17], (2, 70, 300): [70, 45],
               (2, 200, 200): [130, 199]}


@pytest.mark.parametrize("spec", _where_x86(MASKED_SPECS))
def test_x86_masked_kernels_match_the_reference(spec, cache):
    """Rows past (padded) or before (left-padded) the valid ones see no key: output 0, lse -5e4."""
    assert Target("llvm-cpu").lowering_of(spec) == "x86"
    for (batch, qo_len, kv_len), lens in MASKED_LENS.items():
        run_against_reference(spec, "llvm-cpu", cache=cache, entries=[(qo_len, kv_len)] * batch,
                              calls=[dict(valid_lens=np.array(lens, np.int32))])


#: Peaked scores, and a soft cap of 30 (Gemma 2's attention cap is 50) that they cross by far.
PEAKED = [_dense(8, 2, 128, causal=True), _dense(8, 2, 128, "float32", causal=True),
          _dense(8, 2, 128, causal=True, logits_soft_cap=30.0), _dense(8, 2, 128, "float32", logits_soft_cap=30.0)]


@pytest.mark.parametrize("spec", _where_x86(PEAKED))
def test_x86_kernels_on_peaked_scores(spec, cache):
    """Large scores (q scaled by 40): each row's weight sits on a few keys, so a wrong scale, max,
    mask or cap shows in the output rather than averaging out; 257 keys leave a partial KV block."""
    rng = np.random.default_rng(3)
    q = (uniform(rng, (2, 257, 8, 128), "float32") * 40.0).astype(NUMPY_DTYPE[spec.dtype])
    k, v = (uniform(rng, (2, 257, 2, 128), spec.dtype) for _ in range(2))
    assert_matches_reference("peaked", open_kernel(spec, cache=cache)(q, k, v), spec, (q, k, v))
