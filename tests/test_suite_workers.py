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
