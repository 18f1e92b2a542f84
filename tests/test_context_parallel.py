"""Context-parallel prefill (issue 45; linalg_prefill/distributed.py): the shard plan and the
pairs each ring step attends on the host, then 2 ranks over gloo (``torchrun --standalone``,
loopback) whose assembled output and lse equal the float64 reference of the whole batch within
the one-call error bound plus the merges' (runtime/error_model.py) and the partial outputs'
rounding. Cases: tests/context_parallel_ranks.py (odd lengths, an empty chunk, GQA, RoPE at
global positions, f32/bf16, ragged and dense, zig-zag and contiguous, causal and not)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from context_parallel_ranks import CASES, DENSE_BF16, DENSE_F32, RAGGED_BF16, RAGGED_F32
from linalg_prefill.distributed import ContextParallelPrefill, ShardPlan, _blocks, _ragged_calls, rank_cpus
from linalg_prefill.mlir import SequencePrefillSpec
from linalg_prefill.runtime import InputError
from linalg_prefill.runtime.compare import error_bound, reference_for
from linalg_prefill.runtime.devices import get_device, pin_cpu_threads
from linalg_prefill.runtime.error_model import UNIT_ROUNDOFF, merge_bound

pytest.importorskip("torch")  # CI installs the test extra: this never skips there

#: One xdist worker runs the module, so the 2-rank run (a module fixture) happens once.
pytestmark = pytest.mark.xdist_group("context_parallel")
WORLD = 2
TWINS = [SequencePrefillSpec(s.h_q, s.h_kv, s.d, s.dtype, causal=False, sm_scale=s.sm_scale)
         for s in (DENSE_F32, DENSE_BF16)]


# ----------------------------------------------------------------------------- the plan, on the host


@pytest.mark.parametrize("lengths, world", [((53,), 2), ((3, 41, 18), 2), ((0, 7), 3), ((100,), 4), ((5,), 1)])
@pytest.mark.parametrize("split", ["zigzag", "contiguous"])
def test_every_row_is_on_exactly_one_rank(lengths, world, split):
    plan = ShardPlan.of(lengths, world, split)
    rows = np.concatenate([plan.rows(r) for r in range(world)])
    assert np.array_equal(np.sort(rows), np.arange(sum(lengths)))
    for seq in range(len(lengths)):  # each sequence's chunks as even as possible
        sizes = [c.size for r in range(world) for c in plan.chunks(r) if c.seq == seq]
        assert max(sizes) - min(sizes) <= 1


def test_zigzag_balances_the_causal_work():
    plan = ShardPlan.of([1000], 4)
    work = [sum(c.size * (c.start + c.stop) / 2 for c in plan.chunks(r)) for r in range(4)]
    assert max(work) / min(work) < 1.01
    contiguous = ShardPlan.of([1000], 4, "contiguous")
    work = [sum(c.size * (c.start + c.stop) / 2 for c in contiguous.chunks(r)) for r in range(4)]
    assert max(work) / min(work) > 6


@pytest.mark.parametrize("lengths, world, split, causal", [
    ((53,), 2, "zigzag", True), ((3, 41, 18), 2, "zigzag", True), ((29, 6), 2, "contiguous", True),
    ((100, 1, 9), 3, "zigzag", True), ((7,), 4, "zigzag", True), ((1, 37), 2, "zigzag", False),
    ((40, 23), 3, "contiguous", False)])
def test_the_ring_steps_attend_each_visible_pair_once(lengths, world, split, causal):
    """Over all ranks and steps, the packed calls' entries cover each (query, key) pair that the
    mask lets through exactly once, and nothing else; entries of a call take disjoint rows."""
    plan = ShardPlan.of(lengths, world, split)
    seen = {}
    for rank in range(world):
        q_rows = plan.rows(rank)
        for step in range(world):
            source = (rank - step) % world
            kv_rows = plan.rows(source)
            for call in _ragged_calls(_blocks(plan, rank, source, causal)):
                assert 0 <= call.q_indptr[0] and call.q_indptr[-1] <= len(q_rows)
                assert np.all(np.diff(call.q_indptr) >= 0) and np.all(np.diff(call.kv_indptr) >= 0)
                for b in range(len(call.k_offsets)):
                    qs, ks = range(*call.q_indptr[b:b + 2]), range(*call.kv_indptr[b:b + 2])
                    for i, j in itertools.product(qs, ks):
                        # bottom-right causal within the entry, as the kernel masks it
                        if call.causal and j - ks.start > i - qs.start + len(ks) - len(qs):
                            continue
                        pair = (int(q_rows[i]), int(kv_rows[j]))
                        seen[pair] = seen.get(pair, 0) + 1
                        assert call.k_offsets[b] + (j - ks.start) == _position(plan, kv_rows[j])
    want = {(i, j) for i, j in itertools.product(range(sum(lengths)), repeat=2)
            if _seq(plan, i) == _seq(plan, j) and (not causal or j <= i)}
    assert set(seen) == want and set(seen.values()) == {1}


def _seq(plan, row):
    return int(np.searchsorted(np.cumsum(plan.lengths), row, side="right"))


def _position(plan, row):
    return int(row - np.concatenate([[0], np.cumsum(plan.lengths)])[_seq(plan, row)])


@pytest.mark.parametrize("build, match", [
    (lambda: ShardPlan.of([10], 0), "world"),
    (lambda: ShardPlan.of([10, -1], 2), "lengths"),
    (lambda: ShardPlan.of([10], 2, "striped"), "split"),
    (lambda: ShardPlan.of([10], 2).chunks(2), "rank"),
    (lambda: ContextParallelPrefill(DENSE_F32, ShardPlan.of([4, 5], 2), 0), "plan"),
    (lambda: ContextParallelPrefill(RAGGED_F32, ShardPlan.of([4], 2), 3), "rank"),
    (lambda: ContextParallelPrefill(SequencePrefillSpec(4, 4, 64, "float32", True, 0.125, head_sinks=True),
                                    ShardPlan.of([4], 2), 0), "spec"),
    (lambda: ContextParallelPrefill(RAGGED_F32, ShardPlan.of([4], 2), 1), "group"),  # no torch.distributed here
])
def test_bad_arguments_are_named(build, match):
    with pytest.raises(InputError, match=match):
        build()


def test_each_rank_gets_its_share_of_the_cpus():
    assert [rank_cpus(r, 2, [0, 1, 2, 3]) for r in range(2)] == [[0, 1], [2, 3]]
    assert [rank_cpus(r, 3, [4, 5, 6, 7, 8]) for r in range(3)] == [[4], [5, 6], [7, 8]]
    assert [rank_cpus(r, 3, [0, 1]) for r in range(3)] == [[0], [1], [0]]  # more ranks than CPUs
    with pytest.raises(InputError, match="local_rank"):
        rank_cpus(2, 2, [0, 1])


def test_pinning_after_a_device_exists_is_refused():
    with pytest.raises(InputError, match="cpu_ids"):
        pin_cpu_threads([-1])
    get_device("local-task")
    with pytest.raises(RuntimeError, match="before the first kernel opens"):
        pin_cpu_threads([0])


# ----------------------------------------------------------------------------- two ranks over gloo


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every case run on 2 ranks (one torchrun): {case name: [rank 0's npz, rank 1's]}."""
    out = tmp_path_factory.mktemp("context-parallel")
    program = Path(__file__).with_name("context_parallel_ranks.py")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                          str(WORLD), str(program), str(out)], capture_output=True, text=True, timeout=600,
                         cwd=program.parent, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr[-4000:]
    runs = {case.name: [np.load(out / f"{case.name}-rank{r}.npz") for r in range(WORLD)] for case in CASES}
    return dict(runs, threads=[np.load(out / f"threads-rank{r}.npz") for r in range(WORLD)])


@pytest.mark.compiles(RAGGED_F32, RAGGED_BF16, DENSE_F32, DENSE_BF16, *TWINS)
def test_each_rank_runs_its_kernel_threads_on_its_own_cpus(ranks):
    """pin_rank_threads: IREE's workers of rank r run on rank_cpus(r) only (without it, both
    ranks' on the host's first CPU); a plan for another number of ranks is refused by name."""
    for rank, threads in enumerate(ranks["threads"]):
        assert list(threads["pinned"]) == rank_cpus(rank, WORLD)
        assert sorted(threads["workers"].ravel()) == list(threads["pinned"])
        assert str(threads["refusal"]).startswith(f"group: the plan is for {WORLD + 1} ranks")


@pytest.mark.compiles(RAGGED_F32, RAGGED_BF16, DENSE_F32, DENSE_BF16, *TWINS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_two_ranks_give_the_whole_attention(case, ranks):
    plan = ShardPlan.of(case.lengths, WORLD, case.split)
    got_out, got_lse, bound_out, bound_lse, want, bound = _assembled(case, plan, ranks[case.name])
    assert np.all(np.abs(got_out - want[0]) <= bound.output + bound_out)
    assert np.all(np.abs(got_lse - want[1]) <= bound.lse + bound_lse)
    if case.name == "ragged-f32-rope":  # the check can fail: each rank's own shard alone is off
        own = [npz["partial_out"][0] for npz in ranks[case.name]], [npz["partial_lse"][0] for npz in ranks[case.name]]
        partial = _place(plan, own[0], False), _place(plan, own[1], False)
        assert np.any(np.abs(partial[0] - want[0]) > bound.output + bound_out)
    calls = [npz["calls"] for npz in ranks[case.name]]
    assert all(len(c) == WORLD for c in calls)  # a step per rank's shard


def _assembled(case, plan, npzs):
    """The ranks' rows put back in order with their merge bounds, and the reference and bound of
    one call over the whole batch."""
    dense = isinstance(case.spec, SequencePrefillSpec)
    got_out = _place(plan, [n["out"] for n in npzs], dense)
    got_lse = _place(plan, [n["lse"] for n in npzs], dense)
    bounds = [merge_bound(list(n["partial_out"]), list(n["partial_lse"])) if len(n["partial_out"])
              else (np.zeros_like(n["out"], np.float64), np.zeros_like(n["lse"], np.float64)) for n in npzs]
    rounding = [UNIT_ROUNDOFF[case.spec.dtype] * np.max(np.abs(n["partial_out"]), axis=0, initial=0) for n in npzs]
    bound_out = _place(plan, [b[0] + r for b, r in zip(bounds, rounding)], dense)
    bound_lse = _place(plan, [b[1] for b in bounds], dense)
    q, k, v = case.inputs()
    if dense:
        args = (q, k, v)
    else:
        indptr = np.concatenate([[0], np.cumsum(case.lengths)]).astype(np.int32)
        positions = np.concatenate([np.arange(n) for n in case.lengths]).astype(np.int32)
        zeros = np.zeros(len(case.lengths), np.int32)
        rope = case.rope or {}
        args = (q, indptr, k, v, indptr, positions, zeros, int(case.causal), int(case.rope is not None),
                1.0, float(rope.get("rope_theta", 1e4)), case.spec.d_qk ** -0.5)
    want = reference_for(case.spec, args)
    return got_out, got_lse, bound_out, bound_lse, want, error_bound(case.spec, args, want)


def _place(plan, parts, dense):
    """Rank r's arrays (rows on axis 1 if ``dense``, else 0) at their global rows."""
    axis = 1 if dense else 0
    shape = list(parts[0].shape)
    shape[axis] = sum(plan.lengths)
    whole = np.zeros(shape, np.float64)
    for rank, part in enumerate(parts):
        index = (slice(None), plan.rows(rank)) if dense else (plan.rows(rank),)
        whole[index] = part
    return whole
