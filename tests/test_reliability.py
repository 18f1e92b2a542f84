"""Reliability under a server: concurrent callers, concurrent builders, long contexts.

The long-context memory runs go through ``bench/long_context_memory.py`` in a child process, whose
peak RSS is its own: the bound (issue "performance") is a peak-RSS growth during the call under
2x the bytes of q + k + v + output + lse, which no L x L buffer could meet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from conftest import uniform
from linalg_prefill.mlir import SequencePrefillSpec
from linalg_prefill.pipeline.artifacts import load_manifest, verify_artifact
from linalg_prefill.runtime import open_kernel

ROOT = Path(__file__).resolve().parents[1]


def test_eight_threads_fifty_calls_each_match_serial_calls(cache):
    """8 threads x 50 calls through one shared kernel: every result bitwise equal to the serial one."""
    spec = SequencePrefillSpec(4, 2, 32, "float32", causal=True, sm_scale=32 ** -0.5)
    kernel = open_kernel(spec, cache=cache)
    rng = np.random.default_rng(0)
    calls = [tuple(uniform(rng, (1, n, h, 32), "float32") for h in (4, 2, 2)) for n in (1, 7, 33, 64, 130)]
    serial = [kernel(*call) for call in calls]

    def worker(thread: int) -> int:
        for i in range(50):
            which = (thread * 7 + i) % len(calls)
            out, lse = kernel(*calls[which])
            assert np.array_equal(out, serial[which][0]) and np.array_equal(lse, serial[which][1])
        return 50

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(worker, range(8))) == 400


def test_two_processes_build_one_artifact_set_with_one_compile_each(tmp_path):
    """Two `linalg-prefill build` processes on the same model (two of its variants: the dense
    ones, three kernels without serving passes), output folder and empty cache: both succeed,
    every kernel is compiled exactly once in total, the manifest verifies."""
    env = dict(os.environ, LINALG_PREFILL_CACHE_DIR=str(tmp_path / "cache"), LINALG_PREFILL_CACHE="1",
               LINALG_PREFILL_LOG="info")
    command = [sys.executable, "-m", "linalg_prefill.cli", "build", "--model",
               str(ROOT / "configs" / "tiny.toml"), "--backends", "llvm-cpu", "--out", str(tmp_path / "out"),
               "--jobs", "1", "--variants", "batch_sequence_prefill_kv,batch_sequence_prefill_kv_masked"]
    builders = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                for _ in range(2)]
    logs = [builder.communicate(timeout=600) for builder in builders]
    assert [b.returncode for b in builders] == [0, 0], logs
    manifest = load_manifest(tmp_path / "out")
    compiled = [line for _, err in logs for line in err.splitlines() if "INFO: compiling " in line]
    assert sorted(line.split("compiling ")[1].split(" for ")[0] for line in compiled) == \
        sorted(entry["variant"] for entry in manifest["artifacts"])
    for entry in manifest["artifacts"]:
        verify_artifact(entry, tmp_path / "out")


def _peak_memory(*args: str) -> dict:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "long_context_memory.py"), *args],
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


#: Dense L 8192 at h 8/2, d 64 (a kernel other tests pre-build): one head's L x L f32 scores (256
#: MiB) would be six times the bound (2 x 40 MiB of q, k, v, output and lse), the call an eighth of
#: h 32/8 d 128's (3.6 s on 2 cores of an AMD EPYC).
@pytest.mark.parametrize("args", [("--length", "8192", "--h-q", "8", "--h-kv", "2", "--d", "64"),
                                  ("--entries", "64", "--length", "256")], ids=["dense-8192", "ragged-64x256"])
def test_peak_memory_stays_under_twice_the_io(args):
    figures = _peak_memory(*args)
    assert figures["ratio"] < 2.0, figures


@pytest.mark.expensive
def test_peak_memory_at_32768_tokens():
    """L=32768, h_q=32, h_kv=8, d=128 f32 causal: about 6 minutes on 2 cores."""
    figures = _peak_memory("--length", "32768")
    assert figures["ratio"] < 2.0, figures
