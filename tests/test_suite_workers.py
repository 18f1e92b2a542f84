"""The test run's own setup (tests/conftest.py): xdist's workers, one per core, run torch and
OpenBLAS on one thread each."""

from __future__ import annotations

import os

import conftest


def test_one_math_thread_per_worker_keeps_a_callers_setting(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    conftest.one_math_thread_per_worker()
    assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["OPENBLAS_NUM_THREADS"] == "4"


def test_workers_of_a_parallel_run_inherit_one_math_thread(request):
    """A worker of a run of several (``make test``: one per core) got the setting from the
    controller before it started: torch's pool is as wide as it says."""
    worker = conftest.xdist_worker(request.config)
    if worker is None or worker[1] == 1:  # one test process (`make test JOBS=0`): the libraries use every core
        return
    import torch

    assert "OMP_NUM_THREADS" in os.environ and "OPENBLAS_NUM_THREADS" in os.environ
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])


def test_a_worker_replacing_a_crashed_one_takes_a_share_of_the_cores():
    """xdist starts a worker that replaces a crashed one with the next id (gw2 of 2 workers): it
    takes a rank within the run's workers (its configure pins its IREE workers by that rank, which
    refused rank 2 of 2 and ended the run in an internal error instead of a rerun)."""
    from types import SimpleNamespace

    from linalg_prefill.distributed import rank_cpus

    for workerid, want in (("gw0", 0), ("gw1", 1), ("gw2", 0), ("gw3", 1)):
        worker = conftest.xdist_worker(SimpleNamespace(workerinput={"workerid": workerid, "workercount": "2"}))
        assert worker == (want, 2)
        assert rank_cpus(*worker)
