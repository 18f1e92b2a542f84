"""The x86 serving passes (mlir/x86_decode.py): which passes and CPUs get them, their IR and objects
on every machine, and on CPUs with AMX or AVX-512 (where the record picks them: AMX tiles for bf16
on the first, the FMA blocks for every dtype on the second) their numerics against the float64
reference: every cache layout they read (ragged NHD and HND, paged HND and NHD, the sliding
window's sink and window rows), 8-bit caches (e4m3, e5m2), head sinks, a soft cap, GQA 1 to 8,
bf16, f32 and f16 (widened as staged), the 1-, 4- and 16-query passes on batches that mix them
with prefill entries, peaked scores, NaN in a cache's unused rows."""

from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import NUMPY_DTYPE, assert_matches_reference
from linalg_prefill.mlir import DecodeSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, x86_unsupported
from linalg_prefill.mlir.decode import DECODE_PASSES
from linalg_prefill.mlir.x86_attention import (
    STACK_BUDGET, WORKER_STACK_BYTES, XEON_WITH_AMX, AmxEngine, FmaEngine, X86Cpu, workgroup_bytes,
)
from linalg_prefill.mlir.x86_decode import (
    HEAD_GROUPS_FROM, ByteKeysDotEngine, DotEngine, InPlaceValues, InPlaceWidenedValues, KeyRowsEngine, pass_blocks,
    pass_engine_type, pass_heads,
)
from linalg_prefill.pipeline import Target, compile_spec
from linalg_prefill.pipeline.tuning import tuned_ir
from linalg_prefill.runtime import open_kernel
from support import AMX_CPU, serving_call, spec_id

#: What the x86 passes may use on a Zen 4: no AMX tiles, VBMI, AVX-512 BF16.
ZEN_4 = X86Cpu(amx=False, vbmi=True, bf16_dot=True)

#: The layouts, dtypes, groups, 8-bit formats and head sinks of the x86 passes (d a multiple of 32:
#: 32 to 128, d_v up to 4 x d_qk), five specs for the suite's compile time.
SPECS = {
    "paged-hnd-bf16-gqa4": PagedPrefillSpec(16, 4, 128, "bfloat16", page_size=16),
    "paged-nhd-f32-gqa8-sinks": PagedPrefillSpec(16, 2, 64, "float32", page_size=8, kv_order="nhd", head_sinks=True),
    "ragged-nhd-e5m2-f32-gqa1": RaggedPrefillSpec(4, 4, 96, 96, "float32", kv_dtype="float8_e5m2"),
    # d_v 4 x d_qk: a key past the entry reads a zero row as wide as its value row
    "ragged-hnd-f16-gqa2-cap-wide-v": RaggedPrefillSpec(8, 4, 32, 128, "float16", kv_order="hnd",
                                                        logits_soft_cap=30.0),
    "paged-window-e4m3-bf16": PagedPrefillSpec(8, 2, 64, "bfloat16", page_size=8, sliding_window=True,
                                               kv_dtype="float8_e4m3fn"),
}
#: (qo_len, kv_len): 1-query entries of 1 to 1500 keys (one chunk and many), 2-16 query entries
#: (one with more queries than keys: rows without a key), prefill entries, an entry with one
#: query and no KV, one without queries, 16 queries over several chunks.
ENTRIES = [(1, 37), (5, 20), (1, 300), (1, 1), (0, 3), (3, 260), (1, 1500), (1, 0), (4, 2), (17, 40), (16, 333),
           (2, 9)]
#: (sink tokens, window offset) per entry of the sliding-window spec.
WINDOW = [(3, 2), (0, 0), (40, 4), (0, 0), (0, 0), (9, 1), (5, 5), (0, 0), (0, 0), (16, 0), (7, 3), (2, 2)]

#: Head dims apart (d_v != d_qk) and wide: MLA's latent cache at DeepSeek's dims (16 heads of 576
#: key columns, the first 512 the values; workgroup buffers of ~250 KiB, twice IREE's default
#: worker stack: runtime/devices.py gives the workers more), MLA over an e4m3 cache with a
#: sliding window in f32, and a ragged cache of d_qk 192 and d_v 128 (DeepSeek's prefill heads).
WIDE_SPECS = {
    "mla-bf16-h16": MlaPagedPrefillSpec(16, 512, 64, "bfloat16", page_size=16),
    "mla-window-e4m3-f32": MlaPagedPrefillSpec(8, 128, 32, "float32", page_size=8, sliding_window=True,
                                               kv_dtype="float8_e4m3fn"),
    "ragged-dv128-bf16-gqa4": RaggedPrefillSpec(8, 2, 192, 128, "bfloat16"),
}
ALL_SPECS = {**SPECS, **WIDE_SPECS}


def _x86_here(name: str) -> bool:
    """Whether this host builds the passes of spec ``name`` in the x86 lowering (a CPU with AMX
    or AVX-512: pipeline/cpu_tiles.py), where their numerics run."""
    return Target("llvm-cpu").lowering_of(DecodeSpec(ALL_SPECS[name], 1)) == "x86"


def _where_x86(names) -> list:
    """``names`` as parameters, each skipped where this host builds its passes in another lowering."""
    return [pytest.param(name, marks=pytest.mark.skipif(not _x86_here(name), reason="no x86 passes on this CPU"))
            for name in names]


#: What the numerics tests compile, declared where they run (_x86_here): elsewhere the module's IR
#: tests need no artifact (docs/test-suite.md, twentieth session).
pytestmark = pytest.mark.compiles(*(spec for name, spec in ALL_SPECS.items() if _x86_here(name)), passes=ENTRIES)


@pytest.mark.parametrize("name", sorted(SPECS) + sorted(WIDE_SPECS))
def test_the_record_builds_the_passes_of_these_caches_in_x86_on_avx512_cpus(name):
    spec = ALL_SPECS[name]
    for queries in (1, 4, 16):
        assert AMX_CPU.lowering_of(DecodeSpec(spec, queries)) == "x86"
        # a Zen 4: x86 passes on DotEngine or the FMA blocks (AVX-512, no AMX); an AVX2 CPU the linalg ones
        assert Target("llvm-cpu", "znver4").lowering_of(DecodeSpec(spec, queries)) == "x86"
        assert Target("llvm-cpu", "znver3").lowering_of(DecodeSpec(spec, queries)) == "linalg"
    assert AMX_CPU.decode_passes(spec) == DECODE_PASSES["x86"]
    assert [p.queries for p in AMX_CPU.serving_passes(spec)] == [1, 4, 16]   # no scratch bound leaves one out
    assert Target("llvm-cpu", "znver4").decode_passes(spec) == DECODE_PASSES["x86"]


@pytest.mark.parametrize("base, why", [
    (MlaPagedPrefillSpec(8, 64, 16, "bfloat16"), "d_qk=80, d_v=64"),
    (PagedPrefillSpec(8, 2, 64, "bfloat16", kv_dtype="float8_e5m2fnuz"), "8-bit KV float8_e5m2fnuz"),
    (RaggedPrefillSpec(8, 2, 64, 48, "float32"), "d_qk=64, d_v=48"),
    (PagedPrefillSpec(8, 2, 2048, "float32"), "stack budget"),
], ids=lambda x: x if isinstance(x, str) else spec_id(x))
def test_passes_without_an_x86_kernel_keep_the_linalg_lowering(base, why):
    spec = DecodeSpec(base, 4)
    assert why in x86_unsupported(spec)
    assert AMX_CPU.lowering_of(spec) == "linalg"


def test_the_pass_ir_gathers_with_prefetches_and_runs_tiles_for_bf16_only():
    bf16 = tuned_ir(DecodeSpec(SPECS["paged-hnd-bf16-gqa4"], 4), AMX_CPU)
    assert "flow.dispatch @x86_serving_pass_q4::@stream_chunks_q4" in bf16   # named as its pass (mlir/bundle.py)
    assert "llvm.x86.tdpbf16ps.internal" in bf16 and "llvm.intr.prefetch" in bf16
    # 1 query x G 4 = 4 rows and 4 x 4 = 16: one row tile, the keys as A tiles of their rows
    # (where the cache holds 16 of them at one stride, else staged); 16 queries x 4 = 64 rows:
    # pairs of row tiles
    base = SPECS["paged-hnd-bf16-gqa4"]
    assert [pass_engine_type(DecodeSpec(base, q)) for q in (1, 4, 16)] == [KeyRowsEngine, KeyRowsEngine, AmxEngine]
    assert pass_blocks(DecodeSpec(base, 1)) == (16, KeyRowsEngine.KV_BLOCK) == (16, 32)
    few_rows = tuned_ir(DecodeSpec(base, 1), AMX_CPU)
    assert "llvm.x86.tdpbf16ps.internal" in few_rows and "llvm.x86.avx512bf16.dpbf16ps.512" not in few_rows
    assert "llvm.ptrtoint" in few_rows   # 16 keys at one stride are loaded where the cache holds them
    e4m3 = tuned_ir(DecodeSpec(SPECS["paged-window-e4m3-bf16"], 1), AMX_CPU)
    assert "llvm.x86.avx512.vpermi2var.qi.512" in e4m3 and "llvm.ptrtoint" not in e4m3   # widened by table, copied
    f32 = tuned_ir(DecodeSpec(SPECS["paged-nhd-f32-gqa8-sinks"], 1), AMX_CPU)
    assert "flow.dispatch @x86_serving_pass::@stream_chunks" in f32 and "llvm.x86.t" not in f32
    assert "math.fma" in f32


def test_f32_passes_read_values_in_place_and_every_pass_fits_the_workers_stack():
    """f32 values are read where the cache holds them (no staged copy); 8-bit values are widened
    into a staged copy, as bf16 ones are interleaved for the AMX engines or widened for the FMA
    blocks (a CPU without AMX). The workgroup buffers of every pass, MLA's 576-column keys and
    512-column values included, fit STACK_BUDGET, which leaves the dispatch half the stack the
    runtime gives the workers."""
    f32 = PagedPrefillSpec(32, 8, 128, "float32", page_size=16)
    assert pass_engine_type(DecodeSpec(f32, 16)) is InPlaceValues
    e4m3 = PagedPrefillSpec(32, 8, 128, "float32", page_size=16, kv_dtype="float8_e4m3fn")
    assert pass_engine_type(DecodeSpec(e4m3, 16)) is FmaEngine
    bf16 = PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16)
    f16 = PagedPrefillSpec(32, 8, 128, "float16", page_size=16)
    # without AMX: bf16 on pair dot products where the CPU has them, else (f16 too) values widened
    # where the cache holds them for 4 rows (1 query x G 4), staged for 64
    assert [pass_engine_type(DecodeSpec(bf16, q), ZEN_4) for q in (1, 16)] == [DotEngine, DotEngine]
    for spec, cpu in ((f16, ZEN_4), (bf16, X86Cpu(amx=False, vbmi=False, bf16_dot=False))):
        assert [pass_engine_type(DecodeSpec(spec, q), cpu) for q in (1, 16)] == [InPlaceWidenedValues, FmaEngine]
    assert STACK_BUDGET <= WORKER_STACK_BYTES // 2
    e4m3_bf16 = PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16, kv_dtype="float8_e4m3fn")
    for base in (f32, e4m3, bf16, e4m3_bf16, *WIDE_SPECS.values()):
        for queries in (1, 4, 16):
            for cpu in (XEON_WITH_AMX, ZEN_4):
                spec = DecodeSpec(base, queries)
                rows, keys = pass_blocks(spec, cpu)
                engine = pass_engine_type(spec, cpu)
                staged = (base.d_qk if engine.keys_staged else 0) + (0 if engine.values_in_place else base.d_v)
                heads = pass_heads(spec, cpu)   # each head's q rows, acc, state and tables beside the rest
                own = rows * (base.d_qk * engine.OPERAND_BYTES + base.d_v * 4 + 8) + 512
                assert workgroup_bytes(engine.OPERAND_BYTES, rows, keys, base.d_qk, base.d_v) \
                    + keys * staged * engine.OPERAND_BYTES + (heads * own if heads > 1 else 0) <= STACK_BUDGET


#: An AVX-512 CPU without AMX, VBMI or avx512_bf16 (Skylake-SP): the oldest that the rule gives
#: the x86 passes (pipeline/cpu_tiles.py: FMA_PASS_FEATURES). An f32 cache's and a bf16 one's
#: over e4m3 (bf16 queries widened, K and V widened through f16 and rounded to bf16 in integer ops).
SKYLAKE_SP = Target("llvm-cpu", "skylake-avx512")
SKYLAKE_PASSES = [DecodeSpec(PagedPrefillSpec(8, 2, 64, "float32", page_size=16), 4),
                  DecodeSpec(PagedPrefillSpec(8, 2, 64, "bfloat16", page_size=16, kv_dtype="float8_e4m3fn"), 1)]


@pytest.mark.compiles(*SKYLAKE_PASSES, backends=[SKYLAKE_SP])
def test_passes_for_an_avx512_cpu_without_amx_are_x86_and_compile_for_it(cache):
    """The passes use no instruction such a CPU lacks: no AMX, avx512_bf16 or VBMI intrinsic in
    their IR, and LLVM selects every instruction for skylake-avx512."""
    for spec in SKYLAKE_PASSES:
        assert SKYLAKE_SP.lowering_of(spec) == "x86"
        ir_text = tuned_ir(spec, SKYLAKE_SP)
        assert "stream.executable" in ir_text and "math.fma" in ir_text   # the hand-written dispatch
        for intrinsic in ("llvm.x86.t", "avx512bf16", "vpermi2var"):
            assert intrinsic not in ir_text
        assert compile_spec(spec, SKYLAKE_SP, cache=cache)[:2] == b"PK"


#: An AVX-512 CPU with avx512_bf16 but neither AMX nor VBMI (Cooper Lake): a bf16 cache's pass
#: on the pair dot products (DotEngine), found nowhere else in a suite on an AMX Xeon.
COOPER_LAKE = Target("llvm-cpu", "cooperlake")
COOPER_LAKE_PASS = DecodeSpec(PagedPrefillSpec(8, 2, 64, "bfloat16", page_size=16), 1)


@pytest.mark.compiles(COOPER_LAKE_PASS, backends=[COOPER_LAKE])
def test_a_bf16_pass_without_amx_runs_pair_dot_products_and_compiles_for_a_cpu_with_them(cache):
    """vdpbf16ps for Q.K^T and P.V, no AMX or VBMI intrinsic; LLVM selects every instruction for
    cooperlake."""
    assert COOPER_LAKE.lowering_of(COOPER_LAKE_PASS) == "x86"
    ir_text = tuned_ir(COOPER_LAKE_PASS, COOPER_LAKE)
    assert "llvm.x86.avx512bf16.dpbf16ps.512" in ir_text
    assert "llvm.x86.t" not in ir_text and "vpermi2var" not in ir_text
    assert compile_spec(COOPER_LAKE_PASS, COOPER_LAKE, cache=cache)[:2] == b"PK"


def test_a_bf16_pass_over_an_8_bit_cache_without_amx_widens_through_the_byte_tables_where_vbmi_is():
    """A Zen 4 (VBMI, AVX-512 BF16): bf16(f32(x) x scale) from the head's tables, 64 elements a
    lookup, then the pair dot products; a Skylake-SP (no VBMI, above): f16 moves and integer
    rounding, the FMA blocks."""
    spec = DecodeSpec(SPECS["paged-window-e4m3-bf16"], 1)
    zen4 = tuned_ir(spec, Target("llvm-cpu", "znver4"))
    assert "llvm.x86.avx512.vpermi2var.qi.512" in zen4 and "llvm.x86.avx512bf16.dpbf16ps.512" in zen4
    assert "llvm.x86.t" not in zen4


def test_a_one_query_pass_over_an_8_bit_cache_without_amx_takes_its_scores_as_it_widens_the_keys():
    """On a Zen 4 a pass of at most 4 rows (1 query x G 4 or fewer) over an 8-bit cache of a head
    dim of a multiple of 64 scores each 16 keys as it widens them (ByteKeysDotEngine): no K staged,
    q's four dims broadcast as one 64-bit word. More rows, d 96, an AMX Xeon: the staged keys."""
    e4m3 = PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16, kv_dtype="float8_e4m3fn")
    assert [pass_engine_type(DecodeSpec(e4m3, q), ZEN_4) for q in (1, 4)] == [ByteKeysDotEngine, DotEngine]
    assert pass_engine_type(DecodeSpec(e4m3, 1)) is KeyRowsEngine
    narrow = PagedPrefillSpec(32, 8, 96, "bfloat16", page_size=16, kv_dtype="float8_e4m3fn")
    assert pass_engine_type(DecodeSpec(narrow, 1), ZEN_4) is DotEngine
    wide_group = PagedPrefillSpec(32, 4, 128, "bfloat16", page_size=16, kv_dtype="float8_e4m3fn")
    assert pass_engine_type(DecodeSpec(wide_group, 1), ZEN_4) is DotEngine
    fused, staged = (tuned_ir(DecodeSpec(e4m3, q), Target("llvm-cpu", "znver4")) for q in (1, 4))
    assert "vector.broadcast" in fused and "vector<8xi64>" in fused
    assert "vector<8xi64>" not in staged


def _call(name, rng, entries=ENTRIES):
    spec = ALL_SPECS[name]
    return spec, serving_call(spec, rng, entries, WINDOW if getattr(spec, "sliding_window", False) else None)


@pytest.mark.parametrize("name", _where_x86(sorted(SPECS) + sorted(WIDE_SPECS)))
def test_x86_passes_match_the_reference(name, cache):
    spec, args = _call(name, np.random.default_rng(1))
    kernel = open_kernel(spec, cache=cache)
    assert kernel.serving_passes == (1, 4, 16)
    assert_matches_reference(name, kernel(*args), spec, args)


@pytest.mark.parametrize("name", _where_x86(["paged-hnd-bf16-gqa4", "paged-nhd-f32-gqa8-sinks",
                                             "ragged-nhd-e5m2-f32-gqa1", "paged-window-e4m3-bf16",
                                             "ragged-hnd-f16-gqa2-cap-wide-v", *sorted(WIDE_SPECS)]))
def test_x86_passes_on_peaked_scores(name, cache):
    """q x 40: each row's weight sits on a few keys, so a wrong scale, max, mask or row address
    shows rather than averaging out (over the e4m3 cache's exact zeros some outputs are 1e-38,
    which f32 weights flush to 0: the error model's t32 term)."""
    spec, args = _call(name, np.random.default_rng(2))
    args = list(args)
    args[0] = (args[0].astype(np.float32) * 40.0).astype(NUMPY_DTYPE[spec.dtype])
    assert_matches_reference(name, open_kernel(spec, cache=cache)(*args), spec, args)


def test_the_passes_of_few_rows_on_amx_take_every_kv_head_of_a_chunk_in_calls_of_many_entries():
    """KeyRowsEngine's passes (bf16 and 8-bit caches, at most 16 rows, AMX) take every KV head of
    their chunk in a workgroup where the call has HEAD_GROUPS_FROM such workgroups or more (the IR
    chooses, from the table's dims); the others, MLA's one head and a CPU without AMX, one head."""
    e4m3 = PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16, kv_dtype="float8_e4m3fn")
    assert [pass_heads(DecodeSpec(e4m3, q)) for q in (1, 4, 16)] == [8, 8, 1]
    assert pass_heads(DecodeSpec(e4m3, 1), ZEN_4) == 1
    assert pass_heads(DecodeSpec(PagedPrefillSpec(32, 8, 128, "float32", page_size=16), 1)) == 1
    assert pass_heads(DecodeSpec(WIDE_SPECS["mla-bf16-h16"], 1)) == 1
    ir_text = tuned_ir(DecodeSpec(e4m3, 1), AMX_CPU)   # heads a workgroup: 8 where the one-head ones are 16 x 8
    assert f"arith.constant {HEAD_GROUPS_FROM * 8} : index" in ir_text and "arith.cmpi uge" in ir_text
    assert re.search(r"arith.divui %c8\w*, %\w+ : index", ir_text)   # the grid's heads axis: h_kv / heads


#: 1-query entries of 0 to 1500 keys, twenty: every KV head of a chunk in one workgroup for the
#: passes of few rows on AMX (their one-head workgroups number h_kv x HEAD_GROUPS_FROM or more).
MANY_ENTRIES = [(1, kv_len) for kv_len in (1, 0, 37, 300, 1500, 16, 17, 64, 65, 2, 129, 700, 31, 33, 1024, 5, 250,
                                           100, 48, 999)]


@pytest.mark.parametrize("name", _where_x86(["paged-hnd-bf16-gqa4", "paged-window-e4m3-bf16",
                                             "ragged-dv128-bf16-gqa4"]))
def test_x86_passes_taking_every_kv_head_of_a_chunk_match_the_reference(name, cache):
    """Peaked scores (q x 40) over twenty entries: a head's rows read with another's q rows, acc,
    state or 8-bit scales (each head's own, drawn apart) show."""
    spec = ALL_SPECS[name]
    assert len(MANY_ENTRIES) >= HEAD_GROUPS_FROM and pass_heads(DecodeSpec(spec, 1)) == spec.h_kv > 1
    window = [(k % 7, k % 3) for k in range(len(MANY_ENTRIES))] if getattr(spec, "sliding_window", False) else None
    args = list(serving_call(spec, np.random.default_rng(7), MANY_ENTRIES, window))
    args[0] = (args[0].astype(np.float32) * 40.0).astype(NUMPY_DTYPE[spec.dtype])
    assert_matches_reference(name, open_kernel(spec, cache=cache)(*args), spec, args)


@pytest.mark.parametrize("name", _where_x86(["paged-hnd-bf16-gqa4", "paged-nhd-f32-gqa8-sinks"]))
def test_x86_passes_never_read_a_cache_slot_past_an_entry(name, cache):
    """Every unused page slot holds NaN: a pass that reads one (0 x NaN is NaN) fails."""
    spec = SPECS[name]
    args = serving_call(spec, np.random.default_rng(5), [(1, 37), (1, 300), (1, 1), (16, 100), (4, 33)],
                        fill_unused=np.nan)
    got = open_kernel(spec, cache=cache)(*args)
    assert not np.isnan(np.asarray(got[0], np.float32)).any()
    assert_matches_reference("nan-unused", got, spec, args)
