"""runtime/worker_placement.py: the first IREE worker kept off the calling thread's CPU, and the
caller waiting for the workers as SCHED_BATCH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from linalg_prefill.mlir import SequencePrefillSpec
from linalg_prefill.runtime import open_kernel, worker_placement
from linalg_prefill.runtime.examples import example_inputs
from linalg_prefill.runtime.worker_placement import WorkerPlacement, iree_workers, waiting_as_batch

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
#: IREE's own placement. Before it pins the caller it waits until both workers have named
#: themselves and set their CPUs, calls once more (which puts back a worker that set its own CPU
#: after a move), and pins the caller where the placement keeps the first worker: a full suite's
#: run once saw no swap with the placement active, which is what pinning the caller to a CPU a
#: late worker had just set itself on gives (played by hand: 0 swaps; the placement then put the
#: worker back, away from the caller).
PROGRAM = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from linalg_prefill.mlir import SequencePrefillSpec
    from linalg_prefill.runtime import open_kernel
    from linalg_prefill.runtime.examples import example_inputs
    from linalg_prefill.runtime.worker_placement import BATCH_WAIT, MIN_SWAP_INTERVAL_S, PLACEMENT, iree_workers

    spec = SequencePrefillSpec(4, 2, 64, "float32", causal=True, sm_scale=0.125)
    kernel = open_kernel(spec, serving_passes=False)
    args = example_inputs(spec, np.random.default_rng(0))
    first = kernel(*args)
    cpus = lambda: {index: sorted(os.sched_getaffinity(tid)) for tid, index in iree_workers()}
    deadline = time.monotonic() + 5   # under load a worker's thread may not have named itself or set its CPU yet
    while not (len(cpus()) >= 2 and all(len(c) == 1 for c in cpus().values())) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2 * MIN_SWAP_INTERVAL_S)
    kernel(*args)   # a worker whose thread started after the first call's move has set its CPU: put back
    before, swaps = cpus(), PLACEMENT.swaps   # the first call may have moved it already
    # the caller on the first worker's CPU, where the placement keeps it (a worker's thread that
    # starts late sets its own CPU, which the next call puts back)
    os.sched_setaffinity(0, {PLACEMENT.first_worker_cpu} if PLACEMENT.first_worker_cpu is not None else set(before[0]))
    time.sleep(2 * MIN_SWAP_INTERVAL_S)   # past the interval of a move at the first call
    outputs = [kernel(*args) for _ in range(3)]
    same = all(np.array_equal(a, b) for out in outputs for a, b in zip(first, out))
    print(json.dumps(dict(active=PLACEMENT.active, swaps=PLACEMENT.swaps - swaps, before=before, after=cpus(),
                          found=PLACEMENT.first_worker_cpu is not None,
                          caller=sorted(os.sched_getaffinity(0)), same=same, batch_wait=BATCH_WAIT)))
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
    assert got["active"] and got["swaps"] == 1 and got["same"], got
    assert got["batch_wait"] == (os.environ.get("LINALG_PREFILL_BATCH_WAIT", "1") != "0")
    before, after = ({int(k): v for k, v in got[key].items()} for key in ("before", "after"))
    assert after[0] != got["caller"] and after[0] == before[max(before)] and after[max(after)] == before[0]
    assert sorted(map(tuple, after.values())) == sorted(map(tuple, before.values()))   # the same CPUs


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: one IREE worker, nothing to place")
@pytest.mark.compiles(SPEC)
def test_the_environment_switches_it_off(cache):
    """LINALG_PREFILL_WORKER_PLACEMENT=0: no placement; LINALG_PREFILL_BATCH_WAIT=0: no batch
    wait (on by default: test_the_first_worker_leaves_the_callers_cpu_once_and_the_results_stay)."""
    got = _run(cache, LINALG_PREFILL_WORKER_PLACEMENT="0", LINALG_PREFILL_BATCH_WAIT="0")
    assert not got["active"] and got["swaps"] == 0 and got["same"] and got["after"] == got["before"]
    assert got["batch_wait"] is False


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
        clock[0] += 2 * worker_placement.MIN_SWAP_INTERVAL_S
        caller[0] = cpus[0]
        placement.before_call()   # swapped again; then the first "worker" sets its own CPU, as an
        os.sched_setaffinity(tids[0], {cpus[0]})   # IREE worker starting late does: both on one CPU
        caller[0] = cpus[1]
        placement.before_call()   # within the interval, no swap: the placement is put back
        assert placement.swaps == 3 and os.sched_getaffinity(tids[0]) == {cpus[1]}
        assert os.sched_getaffinity(tids[1]) == {cpus[0]}
    finally:
        stop.set()
        for thread in threads:
            thread.join()


LINUX_POLICIES = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="no Linux scheduling policies here")


@LINUX_POLICIES
def test_a_call_waits_as_batch_and_the_caller_is_put_back(monkeypatch):
    monkeypatch.setattr(worker_placement, "BATCH_WAIT", True)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    seen = []
    assert waiting_as_batch(lambda: seen.append(os.sched_getscheduler(0)) or 7) == 7
    assert seen == [os.SCHED_BATCH] and os.sched_getscheduler(0) == os.SCHED_OTHER
    with pytest.raises(ZeroDivisionError):
        waiting_as_batch(lambda: 1 / 0)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


@LINUX_POLICIES
def test_a_caller_under_another_policy_or_switched_off_stays_as_it_is(monkeypatch):
    monkeypatch.setattr(worker_placement, "BATCH_WAIT", True)
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))   # the caller's own choice
    try:
        assert waiting_as_batch(lambda: os.sched_getscheduler(0)) == os.SCHED_BATCH
        assert os.sched_getscheduler(0) == os.SCHED_BATCH   # not put to SCHED_OTHER after
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    monkeypatch.setattr(worker_placement, "BATCH_WAIT", False)
    assert waiting_as_batch(lambda: os.sched_getscheduler(0)) == os.SCHED_OTHER


@LINUX_POLICIES
@pytest.mark.compiles(SPEC)
def test_a_cpu_kernel_call_after_a_long_one_waits_as_batch(cache, monkeypatch):
    """The wiring in runtime/module.py: after a call of BATCH_WAIT_FROM_S or more the loaded
    function runs inside waiting_as_batch, after a shorter one as the caller is; the results are
    the same either way."""
    from linalg_prefill.runtime import module

    monkeypatch.setattr(worker_placement, "BATCH_WAIT", True)
    monkeypatch.setattr(module, "BATCH_WAIT_FROM_S", 60.0)   # every real call here is shorter
    kernel = open_kernel(SPEC, cache=cache, serving_passes=False)
    args = example_inputs(SPEC, np.random.default_rng(0))
    loaded, seen = kernel._loaded, []
    function = loaded._function

    def recorded(*call_args):
        seen.append(os.sched_getscheduler(0))
        return function(*call_args)

    monkeypatch.setattr(loaded, "_function", recorded)
    loaded._last_call_s = 60.0   # as after a long call
    after_long = kernel(*args)
    assert 0 < loaded._last_call_s < 60.0
    after_short = kernel(*args)
    assert seen == [os.SCHED_BATCH, os.SCHED_OTHER] and os.sched_getscheduler(0) == os.SCHED_OTHER
    assert all(np.array_equal(a, b) for a, b in zip(after_long, after_short))


