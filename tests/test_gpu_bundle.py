"""The GPU check's tooling, run for the CPU: record test calls, bundle them, replay them.

A GPU machine here has no registry and cannot install the compiler, so the CUDA layer of the
numerics tests runs there as a replay: ``LINALG_PREFILL_RECORD_CASES`` records the llvm-cpu calls
of the backend-parametrized tests (tests/conftest.py), ``bench/gpu_bundle.py`` compiles their specs
and stores the calls, and ``bench/gpu_runner.py`` runs them against the reference it computes
there, with the serving passes' own calls (bench/gpu_bundle.py: serving_cases). This test makes
the same bundle for llvm-cpu and runs it with the local-task driver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from linalg_prefill.mlir import DecodeSpec, PagedPrefillSpec
from linalg_prefill.pipeline.model_config import load_model_config, specs_for_model
from linalg_prefill.runtime.decode import DECODE_PASSES
from support import spec_id
from test_sequence_prefill import DENSE_CASES

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from gpu_bundle import bench_cases  # noqa: E402
import gpu_runner  # noqa: E402

#: Two recorded tests: dense causal float32 on llvm-cpu (B=2, 300 x 300 included) and ragged with
#: RoPE on and off.
DENSE = next(spec for spec, lowering in DENSE_CASES if lowering == "linalg" and spec.dtype == "float32" and spec.causal)
RECORDED_TESTS = [
    f"tests/test_sequence_prefill.py::test_sequence_prefill[{spec_id(DENSE)}-llvm-cpu]",
    "tests/test_kv_cache_prefill.py::test_ragged_half[hq8_hkv2_dqk64_dv64_bfloat16_rope-llama3-b14df0cb_qt64_kt128-"
    "llvm-cpu]",
]
#: What the bundle below compiles, built before the tests run (tests/conftest.py) into the
#: session's cache, which the bundle's pytest and bench/gpu_bundle.py use too: the recorded
#: tests' specs (they run in the session as well), tiny.toml's, the timed cases' and the serving
#: passes of paged-f16.
SERVED = PagedPrefillSpec(32, 8, 128, "float16", page_size=16)
BUNDLE_SPECS = [*specs_for_model(load_model_config(ROOT / "configs" / "tiny.toml")),
                *(spec for _, spec, _, _ in bench_cases([256])),
                *(DecodeSpec(SERVED, queries) for queries in DECODE_PASSES["linalg"].usable(SERVED))]


def _run(command, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, **kwargs)


def _runner(bundle: Path, *options: str) -> subprocess.CompletedProcess:
    return _run([sys.executable, str(bundle / "gpu_runner.py"), "--driver", "local-task", "--repeat", "1", *options])


def test_the_runner_gives_cpu_workers_the_librarys_stack():
    """The runner stands alone (no import of the package): its CPU workers' stack is a copy of
    the library's, which the x86 kernels' buffers are sized by."""
    from linalg_prefill.mlir.x86_attention import WORKER_STACK_BYTES
    assert gpu_runner.WORKER_STACK_BYTES == WORKER_STACK_BYTES


@pytest.mark.compiles(*BUNDLE_SPECS)
def test_recorded_calls_replay_from_a_bundle(tmp_path, cache):
    recorded, bundle = tmp_path / "recorded", tmp_path / "bundle"
    env = dict(os.environ, LINALG_PREFILL_RECORD_CASES=str(recorded), LINALG_PREFILL_TEST_CACHE=str(cache.root),
               LINALG_PREFILL_CACHE_DIR=str(cache.root))
    tests = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *RECORDED_TESTS], env=env)
    assert tests.returncode == 0, tests.stdout[-2000:]
    calls = len(list(recorded.glob("*.pkl")))
    assert calls == 6 + 4, f"expected 6 dense and 4 ragged calls, recorded {calls}"

    build = _run([sys.executable, "bench/gpu_bundle.py", "--backend", "llvm-cpu", "--models", "tiny.toml",
                  "--recorded", str(recorded), "--no-wheels", "--bench-lengths", "256", "--serving-variants", "paged-f16",
                  "--serving-rows", "4x1", "--out", str(bundle)])
    assert build.returncode == 0, build.stderr[-2000:]
    cases = sorted(bundle.glob("cases/*.npz"))
    # The recorded inputs travel as PCG64 draws, not arrays: the bundle stays small.
    assert sum(path.stat().st_size for path in cases if path.name.startswith("test-")) < 50_000

    run = _runner(bundle)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    checked = sum(1 for path in cases if not path.name.startswith("bench-"))  # bench-* cases are timed
    assert f"{checked} of {checked} checked cases within their error bounds" in run.stdout
    # the serving passes' own calls (runtime/decode.py) are checked and timed too
    assert sum(1 for path in cases if path.name.startswith("serving-paged-f16-")) >= 2
    assert "bench-serving-4x1-vs-1024-float16:" in run.stdout  # a small row: its pool drawn twice

    # A case whose reference disagrees with the kernel (causal flipped) must fail the run (of the
    # dense test's cases alone).
    dense = [p for p in cases if "test_sequence_prefill" in p.name]
    path = next(p for p in dense if "-00005-" in p.name)
    with np.load(path) as data:
        arrays = dict(data)
    meta = json.loads(str(arrays.pop("meta")))
    meta["reference"][1]["causal"] = not meta["reference"][1]["causal"]
    np.savez_compressed(path, meta=json.dumps(meta), **arrays)
    run = _runner(bundle, "--only", "test_sequence_prefill")
    assert run.returncode == 1
    assert "OUT OF BOUND" in run.stdout and f"{len(dense) - 1} of {len(dense)} checked" in run.stdout


def test_a_session_s_folders_over_a_device_call_s_carry_are_refused_here(tmp_path, capsys):
    """`make gpu-session` ends with bench/carry_size.py: the repository's files and the two folders
    must fit the 64 MiB a device call carries, or the call is refused there. The bundle ships the
    IREE runtime and ml_dtypes wheels only (numpy's 15.7 MB took the two folders over)."""
    import carry_size
    from gpu_bundle import WHEELS

    small, large = tmp_path / "small", tmp_path / "large"
    small.mkdir()
    large.mkdir()
    (small / "case.npz").write_bytes(b"x" * 4096)
    with open(large / "artifact.vmfb", "wb") as f:
        f.truncate((carry_size.LIMIT_MIB + 1) * 2 ** 20)   # sparse: its size without the disk
    assert carry_size.main([str(small)]) == 0
    assert "fits the 64 MiB" in capsys.readouterr().out
    assert carry_size.main([str(small), str(large)]) == 1
    assert "over the 64 MiB" in capsys.readouterr().out
    assert not any(wheel.split("=")[0] == "numpy" for wheel in WHEELS)
