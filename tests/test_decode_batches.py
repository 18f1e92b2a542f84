"""Serving-shaped calls: the short entries of a KV-cache call run in one pass per query count
(runtime/decode.py), in both lowerings: llvm-cpu's linalg pass (mlir/decode.py) and the fused
pass CUDA runs (mlir/fused_decode.py, checked here on llvm-cpu and on CUDA when there is a GPU).

Layer (a): the decode modules have no loop, so their dispatches do not grow with the batch (the
CUDA artifacts' structure: tests/test_cuda_compile.py). Layer (b): the passes against the float64
reference for every KV-cache variant, in batches that mix decode entries (KV shorter and longer
than one 128-column chunk) with prefill entries; an entry's result bitwise the same alone, among
decode entries and in a mixed batch; which entries take the pass; NaN in a cache's unused rows.
"""

from __future__ import annotations

import dataclasses

import iree.runtime as rt
import numpy as np
import pytest

from conftest import BACKENDS, assert_matches_reference, uniform
from support import serving_call
from linalg_prefill.mlir import (
    DecodeSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, build_fused_module, build_module,
)
from linalg_prefill.pipeline import Target, compiler, target_for
from linalg_prefill.pipeline.cpu_tiles import CPU_GENERIC_TILINGS
from linalg_prefill.pipeline.tuning import apply_tuning
from linalg_prefill.runtime import open_kernel, reference
from linalg_prefill.mlir.abi import argument_names
from linalg_prefill.mlir.decode import NARROW_PASS_VECTORS, ROW_VECTOR, WIDE_PASS_VECTORS
from linalg_prefill.mlir.ir import TILING_MARKER, ir, tiling_mark
from linalg_prefill.runtime.compare import reference_call
from linalg_prefill.runtime.decode import (
    DECODE_PASSES, bucket_tiles, decode_calls, decode_schedule, kv_lengths, pass_queries,
)

# (qo_len, kv_len): single-query entries with 1 to 700 keys, 2-4 query entries (one with more
# queries than keys: rows without a key under the causal mask), prefill entries, an entry with
# one query and no KV (not a pass entry), an entry with no queries.
MIXED = [(1, 37), (5, 20), (1, 300), (1, 1), (0, 3), (3, 260), (1, 700), (1, 0), (4, 2), (17, 40), (1, 256), (2, 9)]


class _CountingPasses:
    """Counts the kernel's decode-pass and per-entry launches."""

    def __init__(self, kernel, monkeypatch):
        self.decode = self.rest = 0
        run_decode, run_rest = kernel._run_decode, kernel._run_rest

        def counted_decode(*args, **kwargs):
            self.decode += 1
            return run_decode(*args, **kwargs)

        def counted_rest(*args, **kwargs):
            self.rest += 1
            return run_rest(*args, **kwargs)

        monkeypatch.setattr(kernel, "_run_decode", counted_decode)
        monkeypatch.setattr(kernel, "_run_rest", counted_rest)


WINDOW = [(3, 2), (0, 0), (40, 4), (0, 0), (0, 0), (9, 1), (5, 5), (0, 0), (0, 0), (16, 0), (7, 3), (2, 2)]
CASES = {
    "paged-f32": (PagedPrefillSpec(8, 2, 64, "float32", page_size=16), None),
    "paged-window-bf16-softcap": (PagedPrefillSpec(8, 2, 64, "bfloat16", page_size=8, sliding_window=True,
                                                   logits_soft_cap=30.0), WINDOW),
    "ragged-f16-dqk-ne-dv": (RaggedPrefillSpec(8, 2, 64, 32, "float16"), None),
    # few heads: the 4-query pass's scores stay within its scratch bound over these narrow rows
    "mla-f32": (MlaPagedPrefillSpec(8, 64, 16, "float32", page_size=16), None),
    "mla-window-bf16": (MlaPagedPrefillSpec(4, 64, 16, "bfloat16", page_size=32, sliding_window=True), WINDOW),
}


#: The cases' kernels and the passes MIXED takes, on each test's backend: built before the tests
#: run (tests/conftest.py).
pytestmark = pytest.mark.compiles(*(spec for spec, _ in CASES.values()), passes=MIXED)


def _mixed_pass_calls(spec, backend, args) -> int:
    """Calls of the passes on MIXED (the variant's own kernel takes the rest in one call). linalg
    and x86: one call per (pass, band of pieces, blocks per chunk) among its entries, the passes the 1-, 4- and
    16-query ones (without the 16-query one where its scores would pass the scratch bound, d 64
    in 16-bit: then (5, 20) and (17, 40) join the rest; else (17, 40) runs in two pieces, each in
    a call of its own). fused: one call per (query count, KV bucket): 1 query
    vs 37 / 300 / 1 / 700 / 256 keys is 1 / 5 / 1 / 11 / 4 tiles in buckets 1, 6, 12 and 4 (4
    calls); 2-4 queries vs 260 / 2 / 9 keys in buckets 6 and 1 (2 calls); 5 queries, the
    16-query pass (1)."""
    if _lowering(backend) == "fused":
        return 7
    passes = target_for(backend).decode_passes(spec)   # linalg's, or x86's on a CPU with AMX
    usable = passes.usable(spec)
    calls = set()
    largest = max(passes.queries)
    for (qo_len, _), kv_len in zip(MIXED, kv_lengths(spec, args)):
        in_pieces = largest in usable and kv_len <= passes.pieces_up_to  # (17, 40)
        own = min((queries for queries in passes.queries if queries >= qo_len), default=largest if in_pieces else 0)
        taken = passes.taken(own, usable) if qo_len >= 1 and kv_len >= 1 and own else 0
        for first in range(0, qo_len, taken) if taken else ():  # a piece of tokens [first, first + n)
            pass_spec = DecodeSpec(spec, taken)
            n = min(taken, qo_len - first)  # it sees (causal) and its table holds kv_len - qo_len + first + n keys
            keys = kv_len if pass_spec.sliding_window else max(kv_len - qo_len + first + n, 1)
            band = first // (taken * passes.pieces_per_call(pass_spec))  # pieces of one call
            calls.add((taken, band, passes.chunk_blocks(pass_spec, -(-keys // pass_spec.block))))
    return len(calls)


#: The lowerings' passes: llvm-cpu's own, the fused (CUDA's) on llvm-cpu, and CUDA with a GPU.
PASS_BACKENDS = BACKENDS


def _lowering(backend) -> str:
    return target_for(backend).lowering


@pytest.mark.parametrize("backend", PASS_BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_pass_matches_the_reference(case, backend, cache, monkeypatch):
    spec, window = CASES[case]
    kernel = open_kernel(spec, backend, cache=cache)
    rng = np.random.default_rng(1)
    args = serving_call(spec, rng, MIXED, window)
    calls = _CountingPasses(kernel, monkeypatch)
    got = kernel(*args)
    assert (calls.decode, calls.rest) == (_mixed_pass_calls(spec, backend, args), 1)
    assert_matches_reference(case, got, spec, args)


@pytest.mark.parametrize("backend", PASS_BACKENDS)
@pytest.mark.parametrize("case", ["paged-window-bf16-softcap", "ragged-f16-dqk-ne-dv"])
def test_device_results_are_the_host_results(case, backend, cache):
    """With ``to_host=False`` a split call writes the passes' and the variant's rows into arrays
    on the device (on the CPU drivers mapped device buffers, filled in place): the same rows,
    bitwise, as its numpy results, padding rows and query-less entries included."""
    spec, window = CASES[case]
    kernel = open_kernel(spec, backend, cache=cache)
    args = serving_call(spec, np.random.default_rng(8), MIXED, window)
    host = kernel(*args)
    device = kernel(*args, to_host=False)
    assert all(isinstance(result, rt.DeviceArray) for result in device)
    for want, got in zip(host, device):
        assert np.array_equal(np.asarray(got.to_host()), want, equal_nan=True)


@pytest.mark.parametrize("backend", PASS_BACKENDS)
@pytest.mark.parametrize("case", ["paged-window-bf16-softcap", "ragged-f16-dqk-ne-dv", "mla-window-bf16"])
def test_each_pass_call_matches_the_reference_of_its_own_arguments(case, backend, cache):
    """reference.decode_entries (what the GPU bundle checks a pass call against) agrees with the
    passes call by call, padding query rows included."""
    spec, window = CASES[case]
    kernel = open_kernel(spec, backend, cache=cache)
    rng = np.random.default_rng(6)
    args = serving_call(spec, rng, MIXED, window)
    passes = target_for(backend).decode_passes(spec)
    calls = decode_calls(spec, args, pass_queries(spec, args, passes), passes)
    assert len(calls) == _mixed_pass_calls(spec, backend, args)
    for call in calls:
        name, kwargs = reference_call(call.spec)
        want = getattr(reference, name)(*call.args, **kwargs)
        got = kernel._run_decode(call.spec.queries, *call.args)
        assert_matches_reference(f"{case} {call.spec.name} x {len(call.rows)}", got, call.spec, call.args, want)


@pytest.mark.parametrize("queries, entry", [(4, (3, 200)), (16, (9, 100)), (1, (1, 200))])
def test_an_entry_of_one_chunk_has_the_same_bits_with_padded_chunks(queries, entry, cache):
    """A 4- or 16-query pass call of one chunk per entry skips the chunk merge (mlir/decode.py:
    _one_chunk_or_merged); merged among padded chunks (table blocks -1), an entry's one real
    chunk weighs exactly 1, so its rows are bitwise the same either way (the 1-query pass always
    merges: the same check holds there)."""
    spec = PagedPrefillSpec(8, 2, 64, "float32", page_size=16)
    kernel = open_kernel(spec, "llvm-cpu", cache=cache)
    args = serving_call(spec, np.random.default_rng(9), [entry])
    passes = DECODE_PASSES["linalg"]
    (call,) = decode_calls(spec, args, pass_queries(spec, args, passes), passes)
    assert call.spec.queries == queries and call.args[2].shape[1] == 1  # one chunk
    q, pages, table, *rest = call.args
    padded = np.concatenate([table, np.full_like(table, -1), np.full_like(table, -1)], axis=1)
    alone, merged = kernel._run_decode(queries, *call.args), kernel._run_decode(queries, q, pages, padded, *rest)
    assert np.array_equal(alone[0], merged[0]) and np.array_equal(alone[1], merged[1])


@pytest.mark.parametrize("backend", PASS_BACKENDS)
@pytest.mark.parametrize("entry", [(1, 300), (3, 200)])
def test_pass_entry_is_bitwise_the_same_alone_among_short_entries_and_in_a_mixed_batch(entry, backend, cache):
    spec = PagedPrefillSpec(8, 2, 64, "float32", page_size=16)
    kernel = open_kernel(spec, backend, cache=cache)
    rng = np.random.default_rng(2)
    queries, keys = entry
    batches = {"alone": [entry], "short": [(1, 5), entry, (2, 1000), (1, 17)],
               "mixed": [(9, 40), entry, (1, 3), (70, 150)]}
    cache_rows = uniform(rng, (keys, 2, 2, 64), spec.dtype)  # the entry's K/V rows [kv, k|v, h_kv, d]
    query = uniform(rng, (queries, 8, 64), spec.dtype)
    results = {}
    for name, entries in batches.items():
        args = list(serving_call(spec, rng, entries))
        position = entries.index(entry)
        ids = args[4][args[3][position] + np.arange(keys) // 16]
        args[2].transpose(0, 3, 1, 2, 4)[ids, np.arange(keys) % 16] = cache_rows
        rows = slice(args[1][position], args[1][position] + queries)
        args[0][rows] = query
        out, lse = kernel(*args)
        results[name] = out[rows], lse[rows]
    for name in ("short", "mixed"):
        np.testing.assert_array_equal(results[name][0], results["alone"][0], err_msg=name)
        np.testing.assert_array_equal(results[name][1], results["alone"][1], err_msg=name)


def test_a_decode_step_in_order_takes_q_and_results_as_they_are(cache, monkeypatch):
    """A call of one query an entry whose entries share a pass call runs it on q as it is and
    returns its results reshaped (runtime/decode.py: _in_order): the same rows, bitwise, as the
    general path (the same step with a 2-query entry after it: two pass calls, q built and results
    scattered), host and device results alike, and the reference's."""
    spec = PagedPrefillSpec(8, 2, 64, "float32", page_size=16)
    kernel = open_kernel(spec, "llvm-cpu", cache=cache)
    step = [(1, 100), (1, 97), (1, 112), (1, 105)]  # 7 blocks each: one call, in batch order
    rng = np.random.default_rng(11)
    args = serving_call(spec, rng, step)
    assert decode_schedule(spec, args, DECODE_PASSES["linalg"]).in_order
    calls = _CountingPasses(kernel, monkeypatch)
    out, lse = kernel(*args)
    assert (calls.decode, calls.rest) == (1, 0)
    assert_matches_reference("in-order decode step", (out, lse), spec, args)
    device = kernel(*args, to_host=False)
    for want, got in zip((out, lse), device):
        assert np.array_equal(np.asarray(got.to_host()), want)

    longer = serving_call(spec, rng, step + [(2, 50)])
    named = dict(zip(argument_names(spec), longer))
    named["q"][:len(step)], named["pages"][...] = args[0], 0  # the same queries over the same K/V rows
    for b in range(len(step)):
        own = args[4][args[3][b]:args[3][b + 1]]
        theirs = named["page_values"][named["page_indptr"][b]:named["page_indptr"][b + 1]]
        named["pages"][theirs] = args[2][own]
    assert not decode_schedule(spec, longer, DECODE_PASSES["linalg"]).in_order
    general = kernel(*longer)
    for want, got in zip((out, lse), general):
        np.testing.assert_array_equal(got[:len(step)], want)


def test_a_planned_in_order_step_runs_on_its_plans_lane(cache):
    """A wrapper's planned step that is one in-order pass call runs on its plan's PassLane
    (runtime/pass_lane.py, Kernel.lane): one lane a plan, the wrapper's rows those of the call
    without a plan, bitwise, and the reference's; the lane run straight on another layer's q and
    pages gives the wrapper's rows for them, also written into an array given for the output;
    a plan of more than one pass call has no lane."""
    from linalg_prefill.runtime import PagedPrefillWrapper
    from linalg_prefill.runtime.module import aligned_empty

    spec = PagedPrefillSpec(8, 2, 64, "float32", page_size=16)
    kernel = open_kernel(spec, "llvm-cpu", cache=cache)
    wrapper = PagedPrefillWrapper(spec, kernel=kernel)
    rng = np.random.default_rng(13)

    def planned(entries):
        args = serving_call(spec, rng, entries)
        named = dict(zip(argument_names(spec), args))
        plan = wrapper.plan(named["q_indptr"], named["page_indptr"], named["page_values"], named["length_info"],
                            causal=bool(named["causal"]), sm_scale=float(named["sm_scale"]))
        return args, named, plan

    args, named, plan = planned([(1, 100), (1, 97), (1, 112), (1, 105)])
    out, lse = wrapper.run(named["q"], named["pages"])
    lane = kernel.lane(plan)
    assert lane is not None and kernel.lane(plan) is lane
    assert_matches_reference("planned in-order step", (out, lse), spec, args)
    for want, got in zip(kernel(*args), (out, lse)):
        np.testing.assert_array_equal(got, want)
    q, pages = uniform(rng, named["q"].shape, spec.dtype), uniform(rng, named["pages"].shape, spec.dtype)
    want = wrapper.run(q, pages)
    got = lane.run(q, (pages,))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)
    assert lane.run(q, (pages,), with_lse=False)[1] is None
    out = aligned_empty(want[0].shape, want[0].dtype)
    written, _ = lane.run(q, (pages,), with_lse=False, out=out)
    assert written is not None and np.shares_memory(written, out)
    np.testing.assert_array_equal(out, want[0])
    _, _, mixed = planned([(1, 100), (1, 97), (2, 50)])
    assert kernel.lane(mixed) is None


def test_a_call_without_a_plan_reuses_the_schedule_of_the_same_index_arrays(cache, monkeypatch):
    """Kernel.__call__ works a call's schedule out again only when its index arrays or scalars
    change (runtime/decode.py: schedule_key): a second call with the same ones (the next layer)
    reuses it, with other lengths it is made anew, and every call matches the reference."""
    import linalg_prefill.runtime.kernels as kernels

    spec = PagedPrefillSpec(8, 2, 64, "float32", page_size=16)
    kernel = open_kernel(spec, "llvm-cpu", cache=cache)
    made = []
    monkeypatch.setattr(kernels, "decode_schedule", lambda *a: made.append(1) or decode_schedule(*a))
    rng = np.random.default_rng(12)
    first = serving_call(spec, rng, [(1, 37), (4, 100), (20, 60)])
    layer = list(first)
    layer[0] = uniform(rng, first[0].shape, spec.dtype)  # another layer's queries and K/V
    layer[2] = uniform(rng, first[2].shape, spec.dtype)
    other = serving_call(spec, rng, [(1, 38), (4, 100), (20, 60)])
    for args, schedules in ((first, 1), (layer, 1), (other, 2), (first, 3)):
        assert_matches_reference("plan-less call", kernel(*args), spec, args)
        assert len(made) == schedules


def test_pass_entries_cut_into_calls_by_scratch_give_the_same_rows(cache, monkeypatch):
    """A pass's entries in calls of their own (``call_scratch`` of one byte): one call per pass
    entry (MIXED: five 1-query, three 2-4 query entries, (5, 20) and, where the passes take long
    entries in pieces (the linalg passes; not the x86 ones), the two pieces of (17, 40)), each
    row bitwise what the single calls give."""
    spec = PagedPrefillSpec(8, 2, 64, "float32", page_size=16)
    kernel = open_kernel(spec, "llvm-cpu", cache=cache)
    args = serving_call(spec, np.random.default_rng(3), MIXED)
    whole = kernel(*args)
    monkeypatch.setattr(kernel, "_decode_passes", dataclasses.replace(kernel._decode_passes, call_scratch=1))
    calls = _CountingPasses(kernel, monkeypatch)
    cut = kernel(*args)
    pieces = 2 if kernel._decode_passes.pieces_up_to >= 40 else 0
    assert (calls.decode, calls.rest) == (9 + pieces, 1)
    np.testing.assert_array_equal(cut[0], whole[0])
    np.testing.assert_array_equal(cut[1], whole[1])


#: Entries of more queries than the 16-query pass: up to 256 keys in pieces of 16 queries (the
#: first two pieces of (40, 10) see no key under the causal mask), more in the variant's kernel.
LONG = [(40, 10), (64, 200), (17, 30), (20, 257), (5, 20), (33, 256)]


@pytest.mark.parametrize("causal", [1, 0])
def test_long_entries_over_short_caches_run_in_pieces_of_the_largest_pass(causal, cache, monkeypatch):
    spec = PagedPrefillSpec(8, 2, 64, "float32", page_size=16)
    kernel = open_kernel(spec, "llvm-cpu", cache=cache)
    args = list(serving_call(spec, np.random.default_rng(10), LONG))
    args[argument_names(spec).index("causal")] = causal
    assert pass_queries(spec, args).tolist() == [16, 16, 16, 0, 16, 16]
    for call in decode_calls(spec, args, pass_queries(spec, args), DECODE_PASSES["linalg"]):
        table, geometry = call.args[2], call.args[3]  # a piece's table holds the keys it sees
        used = (table.reshape(len(table), -1) != -1).sum(axis=1)
        assert used.tolist() == (-(-np.maximum(geometry[:, 0], 1) // 16)).tolist()
    calls = _CountingPasses(kernel, monkeypatch)
    got = kernel(*args)
    assert calls.rest == 1
    assert_matches_reference(f"pieces, causal {causal}", got, spec, args)


def test_a_call_holds_as_many_pieces_of_an_entry_as_the_scratch_bound_allows():
    """h 32/8 d 128 f32: the 16-query pass's scratch per key equals the K/V's, so a call holds
    two pieces of each entry (2x, the bound): two 64-query entries (non-causal, so every piece
    sees all 200 keys and takes one chunk size) in two calls of four pieces."""
    spec = PagedPrefillSpec(32, 8, 128, "float32", page_size=16)
    args = list(serving_call(spec, np.random.default_rng(11), [(64, 200), (64, 200)]))
    args[argument_names(spec).index("causal")] = 0
    calls = decode_calls(spec, args, pass_queries(spec, args), DECODE_PASSES["linalg"])
    assert [len(call.rows) for call in calls] == [4, 4]
    assert sorted(row for call in calls for row in call.rows.ravel()) == list(range(128))


def _op_names(module) -> list[str]:
    names = []
    module.operation.walk(lambda op: names.append(op.name) or 0)
    return names


@pytest.mark.parametrize("queries", [1, 4])
@pytest.mark.parametrize("head_sinks", [False, True])
def test_decode_module_has_no_loop(queries, head_sinks):
    """Every call of the pass runs the same dispatches, however many entries it has: no loop; a
    pass of 16 or more rows (here 4 queries x 4 heads) without sinks has one host-side branch (a
    call of one chunk per entry skips the chunk merge)."""
    spec = DecodeSpec(PagedPrefillSpec(8, 2, 64, "float32", head_sinks=head_sinks), queries)
    names = _op_names(build_module(spec))
    branch = queries == 4 and not head_sinks
    assert sorted(n for n in names if n.startswith("scf.")) == (["scf.if", "scf.yield", "scf.yield"] if branch else [])
    assert names.count("linalg.generic") >= 5


def _tiled_generics(module) -> list:
    """(number of results, compilation_info text) of each generic the builder marked with a role,
    as llvm-cpu tiles it (pipeline/cpu_tiles.py: the ``tune_generic`` hook)."""
    apply_tuning(module, Target("llvm-cpu"))
    found = []

    def visit(op):
        if op.name == "linalg.generic" and "compilation_info" in op.attributes:
            found.append((len(op.results), str(op.attributes["compilation_info"])))
        return 0

    module.operation.walk(visit)
    return found


def _marked_tilings(module) -> dict[str, list]:
    """role -> [(number of results, the role's llvm-cpu tile lists over all its loops, the unit
    loops the op was built without)] of each generic the builder marked (mlir.ir.mark_tiling)."""
    found = {}

    def visit(op):
        if op.name == "linalg.generic" and TILING_MARKER in op.attributes:
            role, sizes, unit = tiling_mark(op)
            found.setdefault(role, []).append((len(op.results), CPU_GENERIC_TILINGS[role](**sizes), unit))
        return 0

    module.operation.walk(visit)
    return found


@pytest.mark.parametrize("base, queries, head_dim_vector, row_vector, columns", [
    (PagedPrefillSpec(8, 2, 64, "float32"), 1, 64, 4, 8), (PagedPrefillSpec(8, 2, 64, "float32"), 4, 64, 16, 8),
    (RaggedPrefillSpec(64, 4, 64, 24, "float16"), 1, 64, 16, 8), (MlaPagedPrefillSpec(16, 64, 16, "float32"), 4, 16, 16, 8),
    (PagedPrefillSpec(6, 6, 80, "float32"), 1, 16, 1, 8), (PagedPrefillSpec(8, 1, 36, "bfloat16"), 1, 4, 8, 6)])
def test_wide_vectors_dot_the_head_dim_and_broadcast_values_over_the_query_rows(base, queries, head_dim_vector,
                                                                               row_vector, columns):
    """AVX-512's pass vectors: the scores reduce each key row's head dim in one vector of up to
    128 lanes; probs x values broadcasts each value element into a vector of up to 16 query rows,
    with J head-dim columns a key in J outputs (docs/performance.md, decode passes)."""
    marked = _marked_tilings(build_module(DecodeSpec(base, queries), pass_vectors=WIDE_PASS_VECTORS))
    (_, scores, _), = marked["pass.scores.dots"]
    assert scores["vector_reduction"] == [0] * 6 + [head_dim_vector]
    (results, values, _), = marked["pass.probs_values"]
    assert results == columns
    assert values["vector_common_parallel"] == [1, 1, 1, 1, row_vector, 0, 0]


@pytest.mark.parametrize("base, queries, unit", [
    (MlaPagedPrefillSpec(16, 64, 16, "float32"), 4, {"scores": (2,), "values": (2,)}),
    (PagedPrefillSpec(8, 1, 36, "bfloat16"), 1, {"scores": (2,), "values": (2,)}),
    (PagedPrefillSpec(6, 6, 80, "float32"), 1, {"scores": (5,), "values": (4,)}),
    (PagedPrefillSpec(8, 2, 64, "float32"), 4, {"scores": (), "values": ()})])
def test_the_tiled_pass_ops_have_no_unit_loops_for_iree_to_fold(base, queries, unit):
    """A KV head (MLA, MQA) or one query row makes a loop of extent 1; IREE 3.13 folds such a dim
    and drops the op's tiling with it (the 4-query MLA pass then took 44 s to compile, 4.7 s
    tiled). The scores and probs x values ops are built without those loops, and their tilings
    list the other loops only."""
    module = build_module(DecodeSpec(base, queries), pass_vectors=WIDE_PASS_VECTORS)
    marked = _marked_tilings(module)
    assert marked["pass.scores.dots"][0][2] == unit["scores"]
    assert marked["pass.probs_values"][0][2] == unit["values"]
    apply_tuning(module, Target("llvm-cpu"))

    def visit(op):
        if op.name == "linalg.generic" and "compilation_info" in op.attributes:
            loops = len(ir.ArrayAttr(op.attributes["iterator_types"]))
            info = str(op.attributes["compilation_info"])
            listed = info.split("distribution = [")[1].split("]")[0].count(",") + 1
            assert listed == loops, info
        return 0

    module.operation.walk(visit)


@pytest.mark.parametrize("base, queries, by_rows", [
    (PagedPrefillSpec(8, 2, 64, "float32"), 1, False), (PagedPrefillSpec(8, 2, 64, "float32"), 4, True),
    (RaggedPrefillSpec(64, 4, 64, 32, "float16"), 1, True), (MlaPagedPrefillSpec(16, 64, 16, "float32"), 4, False)])
def test_narrow_vectors_take_the_scores_of_paged_and_ragged_passes_with_16_rows_along_them(base, queries, by_rows):
    """Other CPUs' (AVX2) pass vectors: such passes transpose q to [n, h, d_qk, R] in a dispatch
    of its own (fused into the contraction, q would be read one strided element at a time) and
    broadcast each key element over 16 rows; the others dot 16-lane head-dim vectors. (Every
    pass masks its scores in a dispatch of its own and takes its exp2 and sum in one more:
    test_chunk_softmax_keeps_its_tiles.)"""
    spec = DecodeSpec(base, queries)
    assert NARROW_PASS_VECTORS.by_rows(spec) == by_rows and not WIDE_PASS_VECTORS.by_rows(spec)
    module = build_module(spec, pass_vectors=NARROW_PASS_VECTORS)
    assert _op_names(module).count("flow.dispatch.region") == 2 + int(by_rows)
    (_, scores, _), = _marked_tilings(module)["pass.scores.rows" if by_rows else "pass.scores.dots"]
    assert scores["vector_reduction"] == [0] * 6 + [1 if by_rows else 16]


@pytest.mark.parametrize("base, queries", [(PagedPrefillSpec(32, 8, 128, "float32"), 1),
                                           (RaggedPrefillSpec(12, 2, 64, 32, "bfloat16"), 2),
                                           (PagedPrefillSpec(8, 8, 64, "float16", page_size=8), 1),
                                           (PagedPrefillSpec(32, 8, 128, "float32"), 4),
                                           (PagedPrefillSpec(32, 8, 128, "float32"), 16),
                                           (MlaPagedPrefillSpec(16, 64, 16, "bfloat16"), 16)])
def test_chunk_softmax_keeps_its_tiles(base, queries):
    """The chunk max, exp2 and sum keep the tiles the builder gives them (IREE 3.13 drops them
    when it collapses a generic's dims, and then ran them on short vectors or one scalar at a
    time: the 16-query pass's softmax 8.05 -> 5.10 ms on 31 entries of 1040 keys, the 1-query
    pass's 72 -> 14 us on 8 entries of 129). Passes of fewer than 16 rows a KV head (R) keep
    their masked scores row-major: the sum takes [R, 16 keys] tiles (at most a block of keys),
    which the exp2 op writes transposed; key-major scores are reduced in vectors of up to 64 rows,
    a key at a time (the max and the sum)."""
    spec = DecodeSpec(base, queries)
    tiled = [info for _, info in _tiled_generics(build_module(spec, pass_vectors=WIDE_PASS_VECTORS))]
    if spec.rows < ROW_VECTOR:
        keys = min(16, spec.block)
        want, count = f"vector_common_parallel = [1, {spec.rows}, 0], vector_reduction = [0, 0, {keys}]", 1
    else:
        want, count = f"vector_common_parallel = [1, {min(spec.rows, 64)}, 0], vector_reduction = [0, 0, 1]", 2
    assert sum(want in info for info in tiled) == count


@pytest.mark.parametrize("queries", [1, 4, 16])
def test_fused_decode_module_is_one_attention_op_without_a_loop(queries):
    spec = DecodeSpec(MlaPagedPrefillSpec(16, 64, 16, "bfloat16", page_size=16, sliding_window=True), queries)
    names = _op_names(build_fused_module(spec))
    assert not [n for n in names if n.startswith("scf.")], names
    assert names.count("iree_linalg_ext.online_attention") == 1


@pytest.mark.parametrize("backend", PASS_BACKENDS)
@pytest.mark.parametrize("entries", [8, 64])
def test_a_batch_of_decode_entries_takes_a_fixed_number_of_launches(entries, backend, cache, monkeypatch):
    """Launches bounded whatever the batch: linalg, at least one per chunk size P (blocks per
    chunk, under 2T) and at most one per (P, chunk count) (1 to 600 keys: at most 5 chunks);
    x86, one (every entry's chunks of 1024 columns: 1 to 600 keys are one chunk); fused, one per
    KV bucket (1 to 600 keys fall in at most the 7 buckets of 1-12 tiles)."""
    spec = PagedPrefillSpec(8, 2, 64, "float32", page_size=16)
    kernel = open_kernel(spec, backend, cache=cache)
    rng = np.random.default_rng(3)
    kv_lens = rng.integers(1, 600, entries)
    args = serving_call(spec, rng, [(1, int(n)) for n in kv_lens])  # the 1-query pass
    calls = _CountingPasses(kernel, monkeypatch)
    got = kernel(*args)
    if _lowering(backend) == "fused":
        assert calls.decode == len(np.unique(bucket_tiles(-(-kv_lens // 64)))) <= 7
    else:
        pass_spec, passes = DecodeSpec(spec, 1), target_for(backend).decode_passes(spec)
        sizes = {(chunk_blocks := passes.chunk_blocks(pass_spec, blocks), -(-blocks // chunk_blocks))
                 for blocks in -(-kv_lens // 16)}
        assert len({size for size, _ in sizes}) <= calls.decode <= len(sizes)
        if passes.chunk_columns:
            assert calls.decode == 1
    assert calls.rest == 0
    assert_matches_reference("decode batch", got, spec, args)


def test_chunks_widen_where_one_sequences_kv_heads_fill_the_workers():
    """x86 passes take chunks of 4096 columns where h_kv >= 2 x the device's workers (one
    sequence then gives each worker two workgroups), 1024 otherwise; the other lowerings' passes
    do not depend on the workers."""
    spec = PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16)
    x86 = DECODE_PASSES["x86"]
    assert [x86.for_workers(spec, workers).chunk_columns for workers in (1, 2, 4, 5, 64)] == [4096] * 3 + [1024] * 2
    for lowering in ("linalg", "fused"):
        assert DECODE_PASSES[lowering].for_workers(spec, 1) is DECODE_PASSES[lowering]


@pytest.mark.parametrize("workers", [1, 64])
def test_a_kernel_chunks_its_entries_for_its_devices_workers(workers, cache, monkeypatch):
    """A kernel's passes are the target's for its CPU's workers (runtime/devices.py: cpu_workers):
    on 1 worker the x86 passes split an entry of 4100 keys into two chunks of 4096 columns (256
    blocks each), on 64 into five of 1024; the rows match the reference either way."""
    import linalg_prefill.runtime.kernels as kernels

    monkeypatch.setattr(kernels, "cpu_workers", lambda: workers)
    spec = PagedPrefillSpec(8, 2, 64, "float32", page_size=16)
    kernel = open_kernel(spec, "llvm-cpu", cache=cache)
    expected = target_for("llvm-cpu").decode_passes(spec).for_workers(spec, workers)
    assert dataclasses.replace(kernel._decode_passes, loaded=None) == expected
    args = serving_call(spec, np.random.default_rng(21), [(1, 4100), (1, 17), (1, 1500)])
    if expected.chunk_columns:
        calls = kernel._decode_schedule(args, None).calls
        assert {call.table.shape[2] * 16 for call in calls} == {4096 if workers == 1 else 1024}
        assert max(call.table.shape[1] for call in calls) == (2 if workers == 1 else 5)   # chunks of 4100 keys
    assert_matches_reference("chunks for the workers", kernel(*args), spec, args)


def test_bucket_widths_pad_by_less_than_half():
    tiles = np.arange(1, 5000)
    widths = bucket_tiles(tiles)
    assert (widths >= tiles).all() and (widths < 1.5 * tiles + 1).all()
    assert len(np.unique(widths)) <= 2 * np.log2(5000) + 1
    assert bucket_tiles(np.array([1, 2, 3, 4, 5, 6, 7, 9, 12, 13])).tolist() == [1, 2, 3, 4, 6, 6, 8, 12, 12, 16]


@pytest.mark.parametrize("lowering", sorted(DECODE_PASSES))
def test_which_entries_take_the_pass(lowering):
    spec = PagedPrefillSpec(8, 2, 64, "float32", page_size=16)
    passes = DECODE_PASSES[lowering]
    args = serving_call(spec, np.random.default_rng(4), MIXED)
    largest = max(passes.queries)
    expected = [min(q for q in passes.queries if q >= qo) if 1 <= qo <= largest and kv > 0 else
                largest if qo > largest and kv <= passes.pieces_up_to else 0 for qo, kv in MIXED]
    assert pass_queries(spec, args, passes).tolist() == expected
    # (5, 20) takes the 16-query pass; (17, 40) too, in pieces, where pieces_up_to allows (linalg, x86)
    assert expected.count(0) == (2 if passes.pieces_up_to else 3)
    with_rope = list(args)
    with_rope[9] = 1  # rotary_mode: keys need inline RoPE, which the pass does not do
    assert not pass_queries(spec, tuple(with_rope), passes).any()


def test_a_kernel_opened_without_serving_passes_runs_every_entry_itself(cache, monkeypatch):
    spec = CASES["paged-f32"][0]
    kernel = open_kernel(spec, cache=cache, serving_passes=False)
    args = serving_call(spec, np.random.default_rng(7), MIXED)
    calls = _CountingPasses(kernel, monkeypatch)
    got = kernel(*args)
    assert (calls.decode, calls.rest) == (0, 0)  # no split: one launch of the variant's kernel
    assert_matches_reference("without serving passes", got, spec, args)


def test_a_kernel_loads_its_passes_at_open_and_a_call_compiles_nothing(cache, monkeypatch):
    """``serving_passes=[1, 4]`` loads those two at open; a call then compiles nothing (IREE is
    made to fail), and the entries of 5-16 queries run in the variant's kernel. A query count
    the target has no pass of is an error naming the argument."""
    spec = CASES["paged-f32"][0]
    kernel = open_kernel(spec, cache=cache, serving_passes=[4, 1])
    assert kernel.serving_passes == (1, 4)

    def no_compile(*_, **__):
        raise AssertionError("a call compiled")

    monkeypatch.setattr(compiler, "compile_ir", no_compile)
    args = serving_call(spec, np.random.default_rng(11), MIXED)
    calls = _CountingPasses(kernel, monkeypatch)
    got = kernel(*args)
    assert calls.decode >= 2 and calls.rest == 1
    assert_matches_reference("passes 1 and 4 only", got, spec, args)
    with pytest.raises(ValueError, match="^serving_passes: .* no pass of \\[2\\] queries"):
        open_kernel(spec, cache=cache, serving_passes=[2])


@pytest.mark.parametrize("backend", PASS_BACKENDS)
def test_nan_in_unused_cache_rows_stays_out(backend, cache):
    """Slots past an entry's rows (and unused pages) hold NaN: the pass weighs them 0 without
    multiplying them (0 * NaN would be NaN)."""
    spec = PagedPrefillSpec(8, 2, 64, "float32", page_size=16)
    kernel = open_kernel(spec, backend, cache=cache)
    args = serving_call(spec, np.random.default_rng(5), [(1, 37), (1, 300), (1, 1)], fill_unused=np.nan)
    got = kernel(*args)
    assert np.isfinite(got[0]).all()
    assert_matches_reference("NaN in unused rows", got, spec, args)


#: Many query heads over one narrow latent row (R = 64 rows per query): the 1-query pass's
#: scores fit the scratch bound, the 4-query pass's do not.
MANY_HEADS = MlaPagedPrefillSpec(64, 128, 32, "float32", page_size=16)


def test_a_pass_whose_scores_outweigh_the_cache_is_not_used():
    linalg = DECODE_PASSES["linalg"]
    assert linalg.usable(MANY_HEADS) == (1,)
    assert linalg.usable(CASES["mla-f32"][0]) == (1, 4)
    assert DECODE_PASSES["fused"].usable(MANY_HEADS) == (1, 4, 16)  # its scores stay in tiles
    args = serving_call(MANY_HEADS, np.random.default_rng(8), MIXED)
    expected = [1 if 1 <= qo <= 4 and kv > 0 else 0 for qo, kv in MIXED]
    assert pass_queries(MANY_HEADS, args, linalg).tolist() == expected


#: The linalg passes on any host: an AVX2 CPU's (on an AMX or AVX-512 CPU this f32 cache's passes
#: are x86 ones, which have no scratch bound).
LINALG_CPU = Target("llvm-cpu", "znver3")


@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.compiles(MANY_HEADS, passes=True, backends=[LINALG_CPU])
def test_entries_of_a_pass_that_is_not_used_run_one_query_at_a_time(causal, cache, monkeypatch):
    """Their queries become 1-query entries with the keys each row sees (bottom-right causal:
    none for a row past the keys), their tables holding those keys: one launch of the 1-query
    pass per token and chunk size (no two entries here share one with chunk counts 1.5x apart);
    entries shorter than, equal to and longer than one chunk."""
    kernel = open_kernel(MANY_HEADS, LINALG_CPU, cache=cache)
    entries = [(1, 700), (3, 260), (4, 2), (2, 9), (1, 5), (17, 40), (4, 256)]
    args = list(serving_call(MANY_HEADS, np.random.default_rng(9), entries))
    args[6] = causal
    calls = _CountingPasses(kernel, monkeypatch)
    got = kernel(*args)
    pass_spec = DecodeSpec(MANY_HEADS, 1)
    seen = [(token, max(kv_len - qo_len + token + 1 if causal else kv_len, 1))
            for qo_len, kv_len in entries if qo_len <= 4 for token in range(qo_len)]
    launches = {(token, pass_spec.chunk_blocks(-(-keys // pass_spec.block))) for token, keys in seen}
    assert (calls.decode, calls.rest) == (len(launches), 1)
    assert_matches_reference(f"MLA h64 one query at a time, causal {causal}", got, MANY_HEADS, args)
