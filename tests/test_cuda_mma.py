"""The CUDA mma lowering (mlir/cuda_attention.py: one hand-written FlashAttention-2-class dispatch
a dense call, ``Target("cuda", lowering="mma")``), checked without a GPU: its IR, its PTX (cp.async,
ldmatrix, mma.sync; registers and spills with ptxas), and its numerics by running the PTX in the
interpreter (pipeline/ptx_emulator.py) against the float64 reference through the error model.
The mutations show the interpreter sees what a GPU would get wrong: a missing barrier, a missing
cp.async wait, a wrong swizzle."""

import numpy as np
import pytest

from iree.compiler.dialects import nvvm

from linalg_prefill.mlir import (
    DecodeSpec, MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
    build_mma_module, cuda_attention, cuda_decode,
)
from linalg_prefill.pipeline import Target, compile_spec, ptx_emulator
from linalg_prefill.pipeline.compiler import compile_ir, keyed_ir
from linalg_prefill.pipeline.targets import structure_problems
from linalg_prefill.pipeline.tuning import apply_tuning, tuned_ir
from linalg_prefill.pipeline.vm_structure import (
    disassembly, dispatch_sites, loop_bodies, ptx_modules, ptxas_kernels, ptxas_tool,
)
from linalg_prefill.runtime.examples import example_inputs
from support import NUMPY_DTYPE, assert_matches_reference, spec_id, structure, with_arguments

MMA = Target("cuda", "sm_80", lowering="mma")

#: (spec, (B, q_len, kv_len), valid_lens): GQA and not, both head dims and dtypes, every mask;
#: odd lengths (partial query and key tiles), more keys than queries and fewer (causal rows that
#: see no key), padded entries of different lengths.
CASES = [
    (SequencePrefillSpec(4, 2, 64, "float16", causal=True, sm_scale=0.125), (1, 100, 150), None),
    (SequencePrefillSpec(2, 1, 128, "bfloat16", causal=True, sm_scale=128 ** -0.5), (1, 150, 100), None),
    (MaskedSequencePrefillSpec(4, 2, 64, "bfloat16", mask_mode="padded", sm_scale=0.125), (2, 70, 70), [70, 23]),
    (MaskedSequencePrefillSpec(2, 1, 128, "float16", mask_mode="causal_padded_left", sm_scale=0.1), (2, 90, 90),
     [90, 41]),
    # gpt-oss's sinks: each head's in the denominator, rows that see no key still 0 and -5e4
    (SequencePrefillSpec(4, 2, 64, "bfloat16", causal=True, sm_scale=0.125, head_sinks=True), (1, 70, 50), None),
]
#: test_cuda_compile's dense d 128 spec: its fused artifact is built there.
FUSED_TWIN = SequencePrefillSpec(32, 8, 128, "float16", causal=True, sm_scale=128 ** -0.5)
pytestmark = pytest.mark.compiles(*(spec for spec, _, _ in CASES), FUSED_TWIN, backends=[MMA])


def _call(spec, shape, valid_lens, seed=0):
    """The seed-ABI call of ``spec``: q scaled up so that scores are peaked (a wrong scale, mask or
    index moves the output well past its bound)."""
    batch, q_len, kv_len = shape
    rng = np.random.default_rng(seed)
    args = example_inputs(spec, rng, [(q_len, kv_len)] * batch)
    dtype = NUMPY_DTYPE[spec.dtype]
    q = (rng.standard_normal(args[0].shape) * 3).astype(dtype)
    given = {"q": q}
    if valid_lens is not None:
        given["valid_lens"] = np.asarray(valid_lens, np.int32)
    return with_arguments(spec, args, **given)


def _ptx(vmfb: bytes) -> str:
    (ptx,) = ptx_modules(vmfb)
    return ptx


def _emulated(spec, vmfb, call):
    return ptx_emulator.emulate_sequence_prefill(_ptx(vmfb), *call)


def test_the_record_takes_mma_where_it_builds_the_spec():
    dense = CASES[0][0]
    assert MMA.lowering_of(dense) == "mma"
    assert MMA.lowering_of(SequencePrefillSpec(4, 2, 64, "float32", causal=True, sm_scale=0.1)) == "fused"
    assert MMA.lowering_of(PagedPrefillSpec(4, 2, 64, "float16", page_size=16)) == "mma"
    assert MMA.lowering_of(PagedPrefillSpec(4, 2, 64, "float16", page_size=16, logits_soft_cap=30.0)) == "fused"
    assert MMA.lowering_of(MlaPagedPrefillSpec(16, 512, 64, "float16", page_size=16)) == "fused"
    assert Target("cuda").lowering_of(dense) == "fused"   # the default until the GPU sweep says
    with pytest.raises(ValueError, match="d=80"):
        build_mma_module(SequencePrefillSpec(4, 2, 80, "float16", causal=True, sm_scale=0.1))
    with pytest.raises(ValueError, match="runs on cuda"):
        Target("llvm-cpu", lowering="mma")


@pytest.mark.parametrize("spec", [case[0] for case in CASES[:2]], ids=spec_id)
def test_the_ir_is_one_hand_written_dispatch_with_warp_level_ops(spec):
    module = build_mma_module(spec)
    text = str(module)
    tree = structure(module)
    assert tree.find("iree_linalg_ext.online_attention") == []
    assert text.count("flow.dispatch @cuda_attention::@attend") == 1
    for op in ("nvvm.cp.async.shared.global", "nvvm.ldmatrix", "nvvm.mma.sync", "nvvm.shfl.sync"):
        assert op in text, op
    assert "#iree_gpu" not in text and "linalg_prefill.dispatch = {threads = 128" in text
    assert "workgroup_size = [128, 1, 1] subgroup_size = 32" in tuned_ir(spec, MMA)   # the record's


#: The cases as single parameters: a spec parameter of a test that takes the cache would declare
#: its llvm-cpu artifact too (tests/conftest.py: compiled_by); these compile for MMA only.
CASE_PARAMS = [pytest.param(case, id=spec_id(case[0])) for case in CASES]


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_the_ptx_has_the_fa2_instructions_and_the_structure_checks_pass(case, cache, tmp_path):
    spec = case[0]
    vmfb = compile_spec(spec, MMA, cache=cache)
    path = tmp_path / "kernel.vmfb"
    path.write_bytes(vmfb)
    assert structure_problems(spec, MMA, path) == []
    ptx = _ptx(vmfb)
    tiles = cuda_attention.MMA_TILING.kv_block // 16 * spec.d // 16   # 16 x 16 blocks of a K tile
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == tiles
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == tiles
    assert ptx.count("mma.sync.aligned.m16n8k16") == 4 * tiles
    assert ptx.count("cp.async.cg.shared.global") >= 2 * cuda_attention.MMA_TILING.kv_block * spec.d // 8 // 128
    assert ptx.count("ex2.approx") > 0


@pytest.mark.compiles(FUSED_TWIN, backends=[Target("cuda", "sm_80")])
def test_a_call_is_one_dispatch_where_the_fused_lowering_loops_over_bands(cache, tmp_path):
    """The whole call (every query tile, head and entry) is one launch: the GPU runs all its
    workgroups at once; the fused lowering dispatches a band at a time in a host loop."""
    found = {}
    for target in (MMA, Target("cuda", "sm_80")):
        path = tmp_path / f"{target.tag}.vmfb"
        path.write_bytes(compile_spec(FUSED_TWIN, target, cache=cache))
        found[target.lowering] = dispatch_sites(disassembly(path), FUSED_TWIN.symbol)
    assert found["mma"] == (1, 0)
    assert found["fused"][1] >= 1


@pytest.mark.skipif(ptxas_tool() is None, reason="no ptxas (CUDA toolkit)")
@pytest.mark.parametrize("case", CASE_PARAMS[:3])
def test_the_kernel_fits_its_registers_on_an_h200(case, cache):
    spec = case[0]
    (kernel,) = ptxas_kernels([_ptx(compile_spec(spec, MMA, cache=cache))])
    assert kernel.registers <= 255 and kernel.spill_bytes <= 16, kernel


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_the_ptx_matches_the_reference(case, cache):
    spec, shape, valid_lens = case
    call = _call(spec, shape, valid_lens)
    got = _emulated(spec, compile_spec(spec, MMA, cache=cache), call)
    assert_matches_reference(spec.name, got, spec, call)


def _mutated_vmfb(spec, request) -> bytes:
    keyed_ir.cache_clear()
    request.addfinalizer(keyed_ir.cache_clear)
    return compile_ir(tuned_ir(spec, MMA), MMA)


#: Three KV tiles (both stages reused) of a causal call.
MUTATED = CASES[0][0]
MUTATED_SHAPE = (1, 64, 190)


def test_a_missing_barrier_is_a_race(monkeypatch, request):
    monkeypatch.setattr(cuda_attention._Workgroup, "_release_stage", staticmethod(lambda: None))
    vmfb = _mutated_vmfb(MUTATED, request)
    with pytest.raises(ptx_emulator.PtxRace, match="no barrier"):
        _emulated(MUTATED, vmfb, _call(MUTATED, MUTATED_SHAPE, None))


def test_a_missing_wait_reads_stale_tiles(monkeypatch, request):
    original = nvvm.cp_async_wait_group
    monkeypatch.setattr(nvvm, "cp_async_wait_group", lambda n: original(n + 1))
    call = _call(MUTATED, MUTATED_SHAPE, None)
    got = _emulated(MUTATED, _mutated_vmfb(MUTATED, request), call)
    with pytest.raises(AssertionError, match="bound"):
        assert_matches_reference("one wait short", got, MUTATED, call)


def test_a_wrong_swizzle_reads_the_wrong_keys(monkeypatch, request):
    def unswizzled(self, stage_base, key, chunk):
        return cuda_attention._gep(3, self.shared, cuda_attention._add(
            stage_base, cuda_attention._mul(key, self.row_bytes), cuda_attention._mul(chunk, cuda_attention.CHUNK)))

    monkeypatch.setattr(cuda_attention._Workgroup, "_matrix_address", unswizzled)
    call = _call(MUTATED, MUTATED_SHAPE, None)
    got = _emulated(MUTATED, _mutated_vmfb(MUTATED, request), call)
    with pytest.raises(AssertionError, match="bound"):
        assert_matches_reference("reads unswizzled", got, MUTATED, call)


# ---- the serving passes (mlir/cuda_decode.py): chunks of each entry's keys, merged by their maxima

#: A pass of the mma lowering as the runtime loads it (the shared gather, the chunks, the merge).
PASS = DecodeSpec(PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16, sliding_window=True), 4)


def test_the_record_takes_mma_passes_for_the_paged_and_ragged_caches():
    paged = PagedPrefillSpec(32, 8, 128, "float16", page_size=16)
    assert [p.queries for p in MMA.serving_passes(paged)] == [1, 4, 16]
    assert {MMA.lowering_of(p) for p in MMA.serving_passes(paged)} == {"mma"}
    assert MMA.lowering_of(paged) == "mma"
    mla = MlaPagedPrefillSpec(16, 512, 64, "float16", page_size=16)
    assert {MMA.lowering_of(p) for p in MMA.serving_passes(mla)} == {"fused"}


#: A KV-cache prefill of the mma lowering: RoPE (llama3), an 8-bit cache, a sliding window.
PREFILL = PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16, sliding_window=True, kv_dtype="float8_e4m3fn",
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


@pytest.mark.compiles(PASS, PREFILL, backends=[MMA])
@pytest.mark.parametrize("kernel", [(PASS, "attend_chunks"), (PREFILL, "attend_entries")], ids=["pass", "prefill"])
def test_a_kv_cache_kernel_runs_no_host_loop_and_fits_its_registers(kernel, cache, tmp_path):
    """A call is a fixed sequence of dispatches (the fused KV-cache kernel loops over entries and
    bands on the host); the attention dispatch keeps its registers on an H200."""
    spec, entry = kernel
    vmfb = compile_spec(spec, MMA, cache=cache)
    path = tmp_path / "kernel.vmfb"
    path.write_bytes(vmfb)
    assert structure_problems(spec, MMA, path) == []
    assert loop_bodies(disassembly(path), function=spec.symbol) == []
    assert any(f".entry {entry}" in ptx for ptx in ptx_modules(vmfb))
    if ptxas_tool() is not None:
        kernels = {kernel.name: kernel for kernel in ptxas_kernels(ptx_modules(vmfb))}
        assert kernels[entry].registers <= 255 and kernels[entry].spill_bytes == 0

def _chunks_module(spec):
    """A module whose function is the pass's chunk dispatch alone, on its gathered operands:
    ``chunks(q_padded, keys, values, geometry, causal, sm_scale) -> (acc, max, sum)``."""
    from linalg_prefill.mlir.cuda_decode import attend_chunks
    from linalg_prefill.mlir.ir import DYN, element_type, f32, func_d, i32, ir, module_context, tensor_type

    h, d, padded = spec.base.h_kv, spec.d_qk, cuda_decode.padded_rows(spec)
    with module_context() as module:
        elem = element_type(spec.dtype)
        args = [tensor_type([DYN, h, padded, d], elem), tensor_type([DYN, DYN, h, 64, d], elem),
                tensor_type([DYN, DYN, h, 64, d], elem), tensor_type([DYN, 4], i32()), i32(), f32()]
        results = [tensor_type([DYN, DYN, h, spec.rows, d], f32()), *[tensor_type([DYN, DYN, h, spec.rows], f32())] * 2]
        with ir.InsertionPoint(module.body):
            fn = func_d.FuncOp("chunks", (args, results))
            with ir.InsertionPoint(fn.add_entry_block()):
                func_d.ReturnOp(attend_chunks(spec, *fn.arguments, fn))
        module.operation.verify()
        return str(apply_tuning(module, MMA))


#: (pass spec, entries as (kv_len, qo_len), causal): a 4-query pass over entries of 1 to 700 keys
#: (three chunks of 256), GQA 4; a 1-query bf16 pass of d 128, not causal.
PASS_CASES = [
    (DecodeSpec(PagedPrefillSpec(8, 2, 64, "float16", page_size=16), 4), [(700, 4), (5, 4), (256, 3)], 1),
    (DecodeSpec(PagedPrefillSpec(4, 1, 128, "bfloat16", page_size=16), 1), [(300, 1), (1, 1)], 0),
]


@pytest.mark.parametrize("spec, entries, causal", PASS_CASES, ids=[spec_id(case[0]) for case in PASS_CASES])
def test_a_pass_s_chunks_merged_match_the_reference(spec, entries, causal):
    """Each chunk's (acc, max, sum) from the PTX, merged by their maxima (decode.merge_chunks'
    formula), against each entry as a dense call (token = row // G, query head h G + row % G)."""
    ptx = _ptx(compile_ir(_chunks_module(spec), MMA))
    base, rng = spec.base, np.random.default_rng(3)
    sm_scale = spec.d_qk ** -0.5          # a pass's sm_scale is the call's
    h, group, d, rows, padded = base.h_kv, base.group_size, spec.d_qk, spec.rows, cuda_decode.padded_rows(spec)
    dtype = NUMPY_DTYPE[spec.dtype]
    tiles = -(-max(kv for kv, _ in entries) // 64)
    n = len(entries)
    q = (rng.standard_normal((n, h, padded, d)) * 3).astype(dtype)
    keys = rng.standard_normal((n, tiles * 64, h, d)).astype(dtype)
    values = rng.standard_normal((n, tiles * 64, h, d)).astype(dtype)
    for e, (kv_len, _) in enumerate(entries):
        keys[e, kv_len:], values[e, kv_len:] = 0, 0          # the gather's zero rows
    as_tiles = lambda x: np.ascontiguousarray(x.reshape(n, tiles, 64, h, d).transpose(0, 1, 3, 2, 4))  # noqa: E731
    geometry = np.array([[kv, 0, 0, qo] for kv, qo in entries], np.int32)
    chunks = -(-tiles // cuda_decode.CHUNK_TILES)
    outputs = [(np.float32, (n, chunks, h, rows, d)), *[(np.float32, (n, chunks, h, rows))] * 2]
    scalars = [("index", n), ("index", tiles), ("index", chunks), ("index", causal),
               ("f32", np.float32(sm_scale) * np.float32(1.4426950408889634))]
    acc, best, total = ptx_emulator.run_dispatch(ptx, [q, as_tiles(keys), as_tiles(values), geometry], outputs,
                                                  scalars, (chunks, h, n), cuda_decode._tiling(spec).shared_bytes(d))
    top = best.max(axis=1, keepdims=True)
    weight = np.exp2(best - top)
    summed = (weight * total).sum(axis=1)                                     # [n, h, R]
    merged = (weight[..., None] * acc).sum(axis=1) / np.where(summed > 0, summed, 1)[..., None]
    lse = np.where(summed > 0, top[:, 0] + np.log2(np.where(summed > 0, summed, 1)), -5e4)
    for e, (kv_len, qo_len) in enumerate(entries):
        dense = SequencePrefillSpec(h * group, h, d, spec.dtype, causal=bool(causal), sm_scale=sm_scale)
        as_rows = lambda x: x[e, :, :qo_len * group].reshape(h, qo_len, group, *x.shape[3:]).swapaxes(0, 1)  # noqa: E731
        call = (as_rows(q).reshape(1, qo_len, h * group, d), keys[e:e + 1, :kv_len], values[e:e + 1, :kv_len])
        got = (as_rows(merged).reshape(1, qo_len, h * group, d), as_rows(lse).reshape(1, qo_len, h * group))
        assert_matches_reference(f"{spec.name} entry {e}", got, dense, call)


# ---- the KV-cache prefills (mlir/cuda_kv_cache.py): every entry's query tiles in one dispatch

def _entries_module(spec):
    """A module whose function is the prefill's dispatch alone, on its gathered operands:
    ``entries(q, keys, values, table, causal, sm_scale) -> (out, lse)``."""
    from linalg_prefill.mlir.cuda_kv_cache import attend_entries
    from linalg_prefill.mlir.ir import DYN, element_type, f32, func_d, i32, ir, module_context, tensor_type

    shapes = cuda_attention.KernelShapes(spec.h_q, spec.h_kv, spec.d_qk, spec.dtype, "kv_cache", 0.0,
                                         sinks=spec.head_sinks)
    with module_context() as module:
        elem = element_type(spec.dtype)
        args = [tensor_type([DYN, spec.h_q, spec.d_qk], elem), *[tensor_type([DYN, spec.h_kv, 64, spec.d_qk], elem)] * 2,
                tensor_type([DYN, 4], i32()), i32(), f32(), *([tensor_type([spec.h_q], f32())] if spec.head_sinks else [])]
        results = [tensor_type([DYN, spec.h_q, spec.d_qk], elem), tensor_type([DYN, spec.h_q], f32())]
        with ir.InsertionPoint(module.body):
            fn = func_d.FuncOp("entries", (args, results))
            with ir.InsertionPoint(fn.add_entry_block()):
                func_d.ReturnOp(attend_entries(shapes, *fn.arguments[:6], fn, *fn.arguments[6:]))
        module.operation.verify()
        return str(apply_tuning(module, MMA))


#: (spec, entries as (qo_len, kv_len), causal): ragged GQA 4 (one KV head) d 64 f16 with an entry of two query
#: tiles and a partial one, causal rows that see no key, an entry without keys, one of 1 query; a
#: paged bf16 d 128 batch, not causal.
PREFILL_CASES = [
    (RaggedPrefillSpec(4, 1, 64, 64, "float16"), [(150, 170), (5, 3), (1, 70), (3, 0)], 1),
    (PagedPrefillSpec(4, 2, 128, "bfloat16", page_size=16), [(70, 90), (2, 130)], 0),
    (RaggedPrefillSpec(4, 2, 64, 64, "bfloat16", head_sinks=True), [(70, 100), (3, 0), (1, 5)], 1),
]


@pytest.mark.parametrize("spec, entries, causal", PREFILL_CASES, ids=[spec_id(case[0]) for case in PREFILL_CASES])
def test_a_kv_cache_prefill_s_entries_match_the_reference(spec, entries, causal):
    """The dispatch's PTX on a batch of entries (their keys at tile boundaries of one buffer, as
    the shared gather lays them out), each entry against its own dense call."""
    ptx = _ptx(compile_ir(_entries_module(spec), MMA))
    rng = np.random.default_rng(5)
    h_q, h, d, dtype, sm_scale = spec.h_q, spec.h_kv, spec.d_qk, NUMPY_DTYPE[spec.dtype], spec.d_qk ** -0.5
    q_starts = np.cumsum([0] + [qo for qo, _ in entries])
    first_tiles = np.cumsum([0] + [-(-kv // 64) + 1 for _, kv in entries])   # gaps, as tile_offset leaves
    tiles = int(first_tiles[-1])
    q = (rng.standard_normal((int(q_starts[-1]), h_q, d)) * 3).astype(dtype)
    keys = np.zeros((tiles, h, 64, d), dtype)
    values = np.zeros((tiles, h, 64, d), dtype)
    per_entry = []
    for e, (qo_len, kv_len) in enumerate(entries):
        k, v = (rng.standard_normal((kv_len, h, d)).astype(dtype) for _ in range(2))
        rows = np.zeros((-(-kv_len // 64) * 64, h, d), dtype)
        for target, source in ((keys, k), (values, v)):
            rows[:kv_len] = source
            span = rows.reshape(-1, 64, h, d).transpose(0, 2, 1, 3)
            target[first_tiles[e]:first_tiles[e] + len(span)] = span
        per_entry.append((k, v))
    table = np.array([[q_starts[e], qo, kv, first_tiles[e]] for e, (qo, kv) in enumerate(entries)], np.int32)
    sinks = (rng.standard_normal(h_q) * 3).astype(np.float32) if spec.head_sinks else None
    slots = len(q) // 64 + len(entries)
    out, lse = ptx_emulator.run_dispatch(
        ptx, [q, keys, values, table, *([sinks] if spec.head_sinks else [])], [(dtype, q.shape), (np.float32, q.shape[:2])],
        [("index", len(q)), ("index", len(entries)), ("index", tiles), ("index", causal),
         ("f32", np.float32(sm_scale) * np.float32(1.4426950408889634))],
        (slots, h_q, 1), cuda_attention.MMA_TILING.shared_bytes(d))
    for e, ((qo_len, kv_len), (k, v)) in enumerate(zip(entries, per_entry)):
        dense = SequencePrefillSpec(h_q, h, d, spec.dtype, causal=bool(causal), sm_scale=sm_scale,
                                    head_sinks=spec.head_sinks)
        rows = slice(q_starts[e], q_starts[e] + qo_len)
        assert_matches_reference(f"{spec.name} entry {e}", (out[None, rows], lse[None, rows]), dense,
                                 (q[None, rows], k[None], v[None], *([sinks] if spec.head_sinks else [])))
