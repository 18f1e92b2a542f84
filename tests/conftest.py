"""Shared fixtures: an isolated artifact cache per session, backend parameters, GPU detection."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from linalg_prefill.pipeline import ArtifactCache
from linalg_prefill.runtime import cuda_available

# (atol, rtol). fp32 on inputs in [-1, 1]: 1e-4 absolute (DEVELOPERS.md). fp16: FlashInfer's
# 1e-3/1e-3 (peers-and-iree.md §7). bf16 keeps 8 significant bits, so rounding the output alone
# costs up to 2^-9 relative: rtol 8e-3 (4 ulp), atol 2e-3. lse is float32 for every dtype.
TOLERANCE = {"float32": (1e-4, 0.0), "float16": (1e-3, 1e-3), "bfloat16": (2e-3, 8e-3)}
LSE_TOLERANCE = 1e-4
NUMPY_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}

BACKENDS = [
    "llvm-cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not cuda_available(), reason="no CUDA device")),
]


def pytest_addoption(parser):
    parser.addoption("--run-expensive", action="store_true", help="run the large grids")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-expensive"):
        return
    skip = pytest.mark.skip(reason="large grid: pass --run-expensive")
    for item in items:
        if "expensive" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> ArtifactCache:
    """One cache for the session: each spec compiles once however many tests use it."""
    return ArtifactCache(tmp_path_factory.mktemp("artifacts"))


def uniform(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    """Inputs in [-1, 1) in the kernel dtype."""
    return rng.uniform(-1.0, 1.0, size=shape).astype(NUMPY_DTYPE[dtype])


def assert_close(name: str, got, want, dtype: str) -> None:
    """|got - want| <= atol + rtol * |want| elementwise, with the dtype's tolerance."""
    atol, rtol = TOLERANCE[dtype]
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    excess = np.abs(got - want) - (atol + rtol * np.abs(want))
    worst = float(np.max(excess, initial=-np.inf))
    assert worst <= 0, f"{name}: max error {max_error(got, want):.3g} exceeds tolerance ({dtype})"


def max_error(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)), initial=0.0))


class TensorLike:
    """The part of a torch CPU tensor that ``runtime.checks.as_array`` reads (detach, cpu, numpy,
    dtype): lets the torch adapter be tested without torch, which the test extra does not install."""

    def __init__(self, array):
        self._array = array
        self.dtype = f"torch.{array.dtype}"

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self._array
