"""runtime/worker_placement.py: the first IREE worker kept off the calling thread's CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from linalg_prefill.mlir import SequencePrefillSpec
from linalg_prefill.runtime.worker_placement import WorkerPlacement, iree_workers

SPEC = SequencePrefillSpec(4, 2, 64, "float32", causal=True, sm_scale=0.125)


def _task(root: Path, tid: int, name: str) -> None:
    (root / str(tid)).mkdir()
    (root / str(tid) / "comm").write_text(name + "\n")


def test_the_workers_are_found_by_name_in_index_order(tmp_path):
    for tid, name in [(10, "python"), (14, "iree-worker-1"), (12, "iree-worker-10"), (11, "iree-worker-0"),
                      (13, "iree-poller"), (15, "iree-worker-x")]:
        _task(tmp_path, tid, name)
    assert iree_workers(tmp_path) == [(11, 0), (14, 1), (12, 10)]
    assert iree_workers(tmp_path / "missing") == []


def test_a_switched_off_placement_does_nothing():
    placement = WorkerPlacement(enabled=False)
    placement.before_call()
    assert not placement.active and placement.swaps == 0


#: A fresh interpreter (IREE's default topology: a worker on each CPU of the process; the test
#: workers pin theirs, tests/conftest.py): after a first call the caller is put on the first
#: worker's CPU; the next call (past the interval of a move the first call may have made) moves
#: that worker away, the others find it moved; the results are the same bit for bit as with
#: IREE's own placement.
PROGRAM = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from linalg_prefill.mlir import SequencePrefillSpec
    from linalg_prefill.runtime import open_kernel
    from linalg_prefill.runtime.examples import example_inputs
    from linalg_prefill.runtime.worker_placement import MIN_SWAP_INTERVAL_S, PLACEMENT, iree_workers

    spec = SequencePrefillSpec(4, 2, 64, "float32", causal=True, sm_scale=0.125)
    kernel = open_kernel(spec, serving_passes=False)
    args = example_inputs(spec, np.random.default_rng(0))
    first = kernel(*args)
    cpus = lambda: {index: sorted(os.sched_getaffinity(tid)) for tid, index in iree_workers()}
    before, swaps = cpus(), PLACEMENT.swaps   # the first call may have moved it already
    os.sched_setaffinity(0, set(before[0]))   # the caller on the first worker's CPU
    time.sleep(2 * MIN_SWAP_INTERVAL_S)   # past the interval of a move at the first call
    outputs = [kernel(*args) for _ in range(3)]
    same = all(np.array_equal(a, b) for out in outputs for a, b in zip(first, out))
    print(json.dumps(dict(active=PLACEMENT.active, swaps=PLACEMENT.swaps - swaps, before=before, after=cpus(),
                          caller=sorted(os.sched_getaffinity(0)), same=same)))
""")


def _run(cache, **env) -> dict:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LINALG_PREFILL_CACHE_DIR": str(cache.root), **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: one IREE worker, nothing to place")
@pytest.mark.compiles(SPEC)
def test_the_first_worker_leaves_the_callers_cpu_once_and_the_results_stay(cache):
    got = _run(cache)
    assert got["active"] and got["swaps"] == 1 and got["same"]
    before, after = ({int(k): v for k, v in got[key].items()} for key in ("before", "after"))
    assert after[0] != got["caller"] and after[0] == before[max(before)] and after[max(after)] == before[0]
    assert sorted(map(tuple, after.values())) == sorted(map(tuple, before.values()))   # the same CPUs


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: one IREE worker, nothing to place")
@pytest.mark.compiles(SPEC)
def test_the_environment_switches_it_off(cache):
    got = _run(cache, LINALG_PREFILL_WORKER_PLACEMENT="0")
    assert not got["active"] and got["swaps"] == 0 and got["same"] and got["after"] == got["before"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to swap")
def test_callers_on_two_cpus_swap_the_workers_at_most_once_an_interval(monkeypatch):
    """Two threads stand in for the workers (pinned to two CPUs); a caller reported on the first
    one's CPU swaps them, the next call (now on the other's) within MIN_SWAP_INTERVAL_S does not,
    one after it does."""
    import threading

    from linalg_prefill.runtime import worker_placement

    cpus = sorted(os.sched_getaffinity(0))[:2]
    stop, tids, ready = threading.Event(), [], threading.Barrier(3)

    def idle():
        tids.append(threading.get_native_id())
        ready.wait()
        stop.wait()

    threads = [threading.Thread(target=idle) for _ in cpus]
    for thread in threads:
        thread.start()
    ready.wait()
    try:
        for tid, cpu in zip(tids, cpus):
            os.sched_setaffinity(tid, {cpu})
        clock = [1000.0]
        monkeypatch.setattr(worker_placement.time, "monotonic", lambda: clock[0])
        monkeypatch.setattr(worker_placement, "iree_workers", lambda: [(tids[0], 0), (tids[1], 1)])
        placement = WorkerPlacement()
        if not placement.active:
            pytest.skip("no sched_getcpu in this C library")
        caller = [cpus[0]]
        placement._getcpu = lambda: caller[0]
        placement.before_call()   # the caller on the first worker's CPU: swapped
        assert placement.swaps == 1 and os.sched_getaffinity(tids[0]) == {cpus[1]}
        assert os.sched_getaffinity(tids[1]) == {cpus[0]}
        caller[0] = cpus[1]   # another caller, on the first worker's new CPU, at once: no swap
        placement.before_call()
        assert placement.swaps == 1 and os.sched_getaffinity(tids[0]) == {cpus[1]}
        clock[0] += 2 * worker_placement.MIN_SWAP_INTERVAL_S
        placement.before_call()   # after the interval: swapped back
        assert placement.swaps == 2 and os.sched_getaffinity(tids[0]) == {cpus[0]}
    finally:
        stop.set()
        for thread in threads:
            thread.join()
