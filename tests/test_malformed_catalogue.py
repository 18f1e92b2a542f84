"""The malformed-call catalogue (``malformed_catalogue.py``) in a child process: every bad call
raises the library's own ValueError naming the argument before any kernel launches, every valid
control call reaches the launch, and the process exits normally (no crash, no hang)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import test_kv_checks as kv
from linalg_prefill.mlir import MaskedSequencePrefillSpec, SequencePrefillSpec

CATALOGUE = Path(__file__).resolve().parent / "malformed_catalogue.py"
#: The catalogue's kernels (malformed_catalogue.SEQ, MASKED and test_kv_checks' small specs) and
#: the serving passes its child process opens them with, built before the tests run
#: (tests/conftest.py); one worker runs the catalogue under xdist.
pytestmark = [pytest.mark.compiles(SequencePrefillSpec(4, 2, 32, "float32", causal=True, sm_scale=32 ** -0.5),
                                   MaskedSequencePrefillSpec(4, 2, 32, "float32", mask_mode="padded",
                                                             sm_scale=32 ** -0.5),
                                   *(kv.make_spec(variant) for variant in kv.VARIANTS), passes=True),
              pytest.mark.xdist_group("malformed_catalogue")]


@pytest.fixture(scope="module")
def outcomes(cache) -> list[dict]:
    env = dict(os.environ, LINALG_PREFILL_CACHE_DIR=str(cache.root), LINALG_PREFILL_CACHE="1")
    run = subprocess.run([sys.executable, str(CATALOGUE)], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "Traceback" not in run.stderr, run.stderr[-4000:]
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert lines[-1] == {"done": len(lines) - 1}, "the catalogue stopped early"
    return lines[:-1]


def test_catalogue_size(outcomes):
    malformed = [o for o in outcomes if o["argument"]]
    assert len(malformed) >= 100
    levels = {o["id"].split("-")[0] for o in malformed}
    assert levels == {"abi", "wrap", "spec"}
    assert sum(o["id"].startswith("wrap-") for o in malformed) >= 25


def test_every_malformed_call_is_rejected_by_name_before_launch(outcomes):
    wrong = []
    for o in outcomes:
        if not o["argument"]:
            continue
        named = any(o["message"].startswith(o["argument"] + sep) for sep in (":", ".", " ", "["))
        own = o["error"] not in (None, "KernelLaunched") and o["value_error"] and o["module"].startswith("linalg_prefill.")
        if not (named and own):
            wrong.append(o)
    assert not wrong, "\n".join(json.dumps(o) for o in wrong)


def test_valid_controls_reach_the_launch(outcomes):
    controls = [o for o in outcomes if not o["argument"]]
    assert len(controls) >= 10
    assert all(o["error"] == "KernelLaunched" for o in controls), [o for o in controls if o["error"] != "KernelLaunched"]
