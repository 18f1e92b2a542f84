"""The library never configures the host program's logging (issue: a good citizen)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from linalg_prefill.mlir import SequencePrefillSpec

SPEC = SequencePrefillSpec(4, 4, 64, "float32", causal=True, sm_scale=0.125)
#: Opens SPEC (from the session's pre-built cache, or compiled in a cache of its own when argv[2] is
#: "compile"), runs it, then configures the root logger as an application would.
PROGRAM = """
import logging
from linalg_prefill.mlir import SequencePrefillSpec
from linalg_prefill.pipeline import ArtifactCache
from linalg_prefill.runtime import open_kernel
import numpy as np, sys
spec = SequencePrefillSpec(4, 4, 64, "float32", causal=True, sm_scale=0.125)
kernel = open_kernel(spec, cache=ArtifactCache(sys.argv[1], enabled=False) if sys.argv[2] == "compile" else None)
q = np.zeros((1, 3, 4, 64), np.float32)
kernel(q, q, q)
assert logging.getLogger().handlers == [], logging.getLogger().handlers
logging.basicConfig(level=logging.INFO, format="APP %(name)s %(message)s")
logging.getLogger("linalg_prefill.pipeline.compiler").info("from the library")
"""


def _run(tmp_path, env_extra, how="cached"):
    import os
    env = dict(os.environ, **env_extra)
    env.pop("LINALG_PREFILL_LOG", None) if "LINALG_PREFILL_LOG" not in env_extra else None
    return subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path), how], capture_output=True, text=True, env=env)


@pytest.mark.compiles(SPEC)
def test_the_root_logger_stays_unconfigured_and_the_application_configures_it(tmp_path):
    run = _run(tmp_path, {})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stderr.count("APP linalg_prefill.pipeline.compiler from the library") == 1


def test_library_log_lines_print_once_with_linalg_prefill_log(tmp_path):
    run = _run(tmp_path, {"LINALG_PREFILL_LOG": "info"}, how="compile")
    assert run.returncode == 0, run.stderr[-2000:]
    compiled = [line for line in run.stderr.splitlines() if "compiling batch_sequence_prefill_kv" in line]
    assert len(compiled) == 1 and compiled[0].startswith("linalg_prefill INFO")
    assert "APP" not in run.stderr.replace("APP linalg_prefill", "")  # nothing else reached the root
