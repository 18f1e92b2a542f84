"""The x86 KV-cache prefill kernels (mlir/x86_kv_cache.py): which specs and CPUs get them, their IR
on every machine, and where the record picks them (AMX tiles; without, the dtypes the CPU has an
engine for: an AMD Zen 4 all of them) their numerics against the float64 reference: the five
cache specs of the x86 passes (ragged NHD and HND, paged HND and NHD, the sliding window's sink
and window rows; e4m3 and e5m2 caches; head sinks; a soft cap; GQA 1 to 8; both dtypes) on
batches whose entries are longer than any pass (more queries than keys, no key, no query,
hundreds of keys), with inline RoPE on and off, causal and not, peaked scores, and NaN in every
unused page slot."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import NUMPY_DTYPE, assert_matches_reference
from linalg_prefill.mlir import MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, build_x86_module
from linalg_prefill.pipeline import Target
from linalg_prefill.pipeline.tuning import tuned_ir
from linalg_prefill.runtime import open_kernel
from support import AMX_CPU, serving_call, spec_id, with_arguments
from test_x86_decode import ALL_SPECS, SPECS, WIDE_SPECS

#: (qo_len, kv_len): prefill entries of the kernel (17 to 300 queries over 0 to 700 keys, one with
#: more queries than keys: rows without a key under the causal mask), an entry without queries,
#: and decode entries that the passes take in the same call.
ENTRIES = [(40, 300), (1, 37), (17, 5), (0, 9), (100, 0), (300, 300), (3, 260), (64, 700), (20, 20)]
#: (sink tokens, window offset) per entry of the sliding-window spec.
WINDOW = [(3, 2), (0, 0), (2, 1), (0, 0), (0, 0), (40, 4), (9, 1), (5, 5), (7, 3)]



def _x86_here(spec) -> bool:
    """Whether this host builds the kernel of ``spec`` in the x86 lowering, where its numerics run."""
    return Target("llvm-cpu").lowering_of(spec) == "x86"


def _where_x86(names) -> list:
    """``names`` (of ALL_SPECS) as parameters, each skipped where this host builds its kernel in
    another lowering."""
    return [pytest.param(name, marks=pytest.mark.skipif(not _x86_here(ALL_SPECS[name]), reason="no x86 kernel here"))
            for name in names]


#: What the numerics tests compile, declared where they run: elsewhere the module's IR tests need
#: no artifact (docs/test-suite.md, twentieth session).
pytestmark = [pytest.mark.compiles(*(spec for spec in ALL_SPECS.values() if _x86_here(spec)), passes=ENTRIES)]


@pytest.mark.parametrize("name", sorted(SPECS) + sorted(WIDE_SPECS))
def test_the_record_builds_these_kv_cache_kernels_in_x86_where_an_engine_is(name):
    """AMX CPUs; AVX-512 without AMX: f32 and f16 on the FMA blocks, bf16 (8-bit caches under it
    included: their rows dequantised as packed) where avx512_bf16 is (Zen 4, Cooper Lake)."""
    spec = ALL_SPECS[name]
    for arch in ("sapphirerapids", "graniterapids", "znver4", "cooperlake"):
        assert Target("llvm-cpu", arch).lowering_of(spec) == "x86"
    bf16 = spec.dtype == "bfloat16"
    assert Target("llvm-cpu", "skylake-avx512").lowering_of(spec) == ("linalg" if bf16 else "x86")
    assert Target("llvm-cpu", "x86-64-v3").lowering_of(spec) == "linalg"   # no AVX-512


@pytest.mark.parametrize("spec, why", [
    (MlaPagedPrefillSpec(8, 64, 16, "bfloat16"), "d_qk=80, d_v=64"),
    (RaggedPrefillSpec(8, 2, 64, 48, "float32"), "d_qk=64, d_v=48"),
    (PagedPrefillSpec(8, 2, 80, "bfloat16"), "multiple of 32"),
    (PagedPrefillSpec(8, 2, 2048, "float32"), "stack budget"),
    (RaggedPrefillSpec(8, 2, 64, 64, "bfloat16", custom_mask=True), "causal mask only"),
], ids=lambda x: x if isinstance(x, str) else spec_id(x))
def test_kv_cache_specs_without_an_x86_kernel_keep_the_linalg_lowering(spec, why):
    assert AMX_CPU.lowering_of(spec) == "linalg"
    with pytest.raises(ValueError, match=why):
        build_x86_module(spec)


def test_the_kernel_ir_reads_its_index_arrays_on_the_host_and_writes_in_place():
    """One entry dispatch, its output and state tied to the carried buffers (no copy per
    entry), q_indptr and the page table's arrays host-readable (no wait per entry), tiles for
    bf16 only."""
    bf16 = tuned_ir(SPECS["paged-hnd-bf16-gqa4"], AMX_CPU)
    dispatch = next(line for line in bf16.splitlines() if "flow.dispatch @x86_kv_cache::@attend_entry" in line)
    assert dispatch.count("->") == 1 and "-> (%" in dispatch   # both results are tied operands
    assert bf16.count("hal.buffer.load") >= 2 and "llvm.x86.tdpbf16ps.internal" in bf16
    f32 = tuned_ir(SPECS["paged-nhd-f32-gqa8-sinks"], AMX_CPU)
    assert "flow.dispatch @x86_kv_cache::@attend_entry" in f32 and "llvm.x86.t" not in f32


def test_a_cache_in_the_kernels_dtype_is_gathered_by_the_row_packing_dispatch():
    """K and V of a bf16 or f32 cache packed by the hand-written row gather (keys that the call
    rotates by a generic, in the RoPE branch); an 8-bit cache's rows dequantised by generics."""
    for name in ("paged-hnd-bf16-gqa4", "paged-nhd-f32-gqa8-sinks", "mla-bf16-h16"):
        kernel = tuned_ir(ALL_SPECS[name], AMX_CPU)
        assert kernel.count("flow.dispatch @x86_pack_k_rows::@pack_k_rows") == 1
        assert kernel.count("flow.dispatch @x86_pack_v_rows::@pack_v_rows") == 1
    assert "x86_pack_" not in tuned_ir(SPECS["paged-window-e4m3-bf16"], AMX_CPU)


def _call(name, seed, entries=ENTRIES, **scalars):
    spec = ALL_SPECS[name]
    window = WINDOW if getattr(spec, "sliding_window", False) else None
    return spec, with_arguments(spec, serving_call(spec, np.random.default_rng(seed), entries, window), **scalars)


@pytest.mark.parametrize("rotary_mode", [0, 1])
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("name", _where_x86(sorted(SPECS)))
def test_x86_kv_cache_kernels_match_the_reference(name, causal, rotary_mode, cache):
    spec, args = _call(name, 1, causal=causal, rotary_mode=rotary_mode)
    assert_matches_reference(f"{name} causal {causal} rope {rotary_mode}", open_kernel(spec, cache=cache)(*args),
                             spec, args)


@pytest.mark.parametrize("name", _where_x86(sorted(SPECS)))
def test_x86_kv_cache_kernels_on_peaked_scores(name, cache):
    """q x 40 with inline RoPE: each row's weight sits on a few keys, so a wrong scale, rotation,
    mask, sink or row address shows rather than averaging out."""
    spec, args = _call(name, 2, rotary_mode=1)
    args = list(args)
    args[0] = (args[0].astype(np.float32) * 40.0).astype(NUMPY_DTYPE[spec.dtype])
    assert_matches_reference(name, open_kernel(spec, cache=cache)(*args), spec, args)


@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("name", _where_x86(sorted(WIDE_SPECS)))
def test_x86_kv_cache_kernels_with_d_v_apart_match_the_reference(name, causal, cache):
    """MLA's latent cache (values the first d_latent columns of the key rows; no RoPE inside) and
    a ragged cache of d_v 128 under d_qk 192, on the long entries, and with q x 20 (peaked)."""
    spec, args = _call(name, 3, causal=causal)
    kernel = open_kernel(spec, cache=cache)
    assert_matches_reference(f"{name} causal {causal}", kernel(*args), spec, args)
    args = list(args)
    args[0] = (args[0].astype(np.float32) * 20.0).astype(NUMPY_DTYPE[spec.dtype])
    assert_matches_reference(f"{name} causal {causal} peaked", kernel(*args), spec, args)


#: f16 (the FMA blocks, widened as packed; its passes stay linalg): paged, and ragged over an e4m3 cache.
F16_SPECS = [PagedPrefillSpec(8, 2, 64, "float16", page_size=16),
             RaggedPrefillSpec(8, 2, 128, 128, "float16", kv_dtype="float8_e4m3fn")]


@pytest.mark.compiles(*(spec for spec in F16_SPECS if _x86_here(spec)))
@pytest.mark.parametrize("rotary_mode", [0, 1])
@pytest.mark.parametrize("spec", [pytest.param(spec, id=spec_id(spec), marks=pytest.mark.skipif(
    not _x86_here(spec), reason="no x86 kernel here")) for spec in F16_SPECS])
def test_x86_kv_cache_kernels_in_float16_match_the_reference(spec, rotary_mode, cache):
    args = list(with_arguments(spec, serving_call(spec, np.random.default_rng(6), ENTRIES), rotary_mode=rotary_mode))
    args[0] = (args[0].astype(np.float32) * 10.0).astype(np.float16)
    kernel = open_kernel(spec, cache=cache, serving_passes=False)
    assert_matches_reference(f"f16 rope {rotary_mode}", kernel(*args), spec, args)


@pytest.mark.skipif(not _x86_here(SPECS["paged-hnd-bf16-gqa4"]), reason="no x86 kernel here")
def test_x86_kv_cache_kernels_never_read_a_cache_slot_past_an_entry(cache):
    """Every unused page slot holds NaN: a kernel that reads one (0 x NaN is NaN) fails."""
    spec = SPECS["paged-hnd-bf16-gqa4"]
    args = serving_call(spec, np.random.default_rng(5), [(40, 37), (17, 300), (33, 1), (100, 100)],
                        fill_unused=np.nan)
    got = open_kernel(spec, cache=cache)(*args)
    assert not np.isnan(np.asarray(got[0], np.float32)).any()
    assert_matches_reference("nan-unused", got, spec, args)
