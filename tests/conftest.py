"""Shared fixtures: an isolated artifact cache per session, backend parameters, GPU detection."""

from __future__ import annotations

import hashlib
import itertools
import os
import pickle

import ml_dtypes
import numpy as np
import pytest

from linalg_prefill.pipeline import ArtifactCache, Target
from linalg_prefill.pipeline.targets import BACKENDS as TARGET_BACKENDS, LOWERINGS
from linalg_prefill.runtime import examples
from linalg_prefill.runtime.devices import backend_available
from linalg_prefill.runtime.examples import uniform as _uniform
from linalg_prefill.runtime.compare import error_bound, reference_for
from linalg_prefill.runtime.reference import EMPTY_ROW_LSE

NUMPY_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}

#: Every numerics test runs on each backend of pipeline/targets.py: BACKENDS: llvm-cpu (its linalg
#: lowering), then, for a backend on the host CPU, its other lowerings (the fused lowering CUDA
#: uses compiled for llvm-cpu: same IR structure, so a wrong mask or index shows up without a
#: GPU), and CUDA itself (marked ``device``) where a device exists.
BACKENDS = []
#: The same without the host backends' other lowerings, for two kinds of test:
#: - query/key head dims above 128: IREE 3.13's llvm-cpu code for online_attention tiles the head
#:   dim of Q.K^T and treats each partial dot product as a score (measured: ragged d_qk 160, 192,
#:   256, 320 and 576 off by 0.24-0.39 in the output, 96 and 128 exact; reproducer:
#:   docs/iree-cpu-attention-bug.md), so the fused lowering cannot be checked there; the CUDA
#:   configuration keeps the head dim whole;
#: - the float32 grids of the dense and ragged kernels, whose fused runs repeat what the other
#:   tests check (they kept the suite near 20 minutes on 2 cores).
BACKENDS_WITHOUT_FUSED_CPU = []
for _name, _record in TARGET_BACKENDS.items():
    if _record.on_host:
        BACKENDS += [_name, *(pytest.param(Target(_name, lowering=lowering), id=f"{_name}-{lowering}")
                              for lowering in LOWERINGS if lowering != _record.lowering)]
        BACKENDS_WITHOUT_FUSED_CPU.append(_name)
    else:
        _param = pytest.param(_name, marks=[pytest.mark.device, pytest.mark.skipif(
            not backend_available(_name), reason=f"no {_record.driver} device")])
        BACKENDS.append(_param)
        BACKENDS_WITHOUT_FUSED_CPU.append(_param)


def pytest_addoption(parser):
    parser.addoption("--run-expensive", action="store_true", help="run the large grids")


def pytest_collection_modifyitems(config, items):
    """Large runs (marked ``expensive``) are deselected, not skipped, unless --run-expensive."""
    if config.getoption("--run-expensive"):
        return
    expensive = [item for item in items if "expensive" in item.keywords]
    if expensive:
        config.hook.pytest_deselected(items=expensive)
        items[:] = [item for item in items if "expensive" not in item.keywords]


RECORD_DIR = os.environ.get("LINALG_PREFILL_RECORD_CASES")
_RECORDED = itertools.count()
# id(array) -> (array, how ``uniform`` drew it), kept while recording: a recorded call stores the
# draw (PCG64 state, shape, dtype) instead of the array, so a replay bundle stays small.
_UNIFORM_DRAWS: dict[int, tuple] = {}


def _recorded_argument(value):
    """A kernel argument as recorded: ("uniform", draw + sha1 of the array's bytes now) for arrays
    drawn by ``uniform`` (the replay redraws them and keeps the draw only when the bytes match),
    else ("value", value)."""
    drawn = _UNIFORM_DRAWS.get(id(value))
    if drawn is not None and drawn[0] is value:
        return "uniform", dict(drawn[1], sha1=hashlib.sha1(value.tobytes()).hexdigest())
    return "value", value


@pytest.fixture(autouse=True)
def record_backend_cases(request, monkeypatch):
    """With ``LINALG_PREFILL_RECORD_CASES=DIR``, every llvm-cpu kernel call of a test parametrized
    over BACKENDS is pickled into DIR as ``{test, spec, args}`` (``args``: see
    ``_recorded_argument``), so that
    ``bench/gpu_bundle.py --recorded DIR`` can replay the same calls on CUDA on a GPU machine, where
    the compiler these tests need cannot be installed (and check them against their error bound,
    runtime/error_model.py)."""
    directory = RECORD_DIR
    callspec = getattr(request.node, "callspec", None)
    if not directory or callspec is None or callspec.params.get("backend") != "llvm-cpu" \
            or not hasattr(request.module, "open_kernel"):
        return
    os.makedirs(directory, exist_ok=True)
    monkeypatch.setattr(examples, "uniform", uniform)  # the draws of runtime/examples.py are recorded too
    real_open_kernel = request.module.open_kernel

    def recording_open_kernel(spec, *args, **kwargs):
        kernel = real_open_kernel(spec, *args, **kwargs)

        def call(*call_args):
            case = dict(test=request.node.nodeid, spec=spec, args=[_recorded_argument(a) for a in call_args])
            with open(os.path.join(directory, f"case-{os.getpid()}-{next(_RECORDED):05d}.pkl"), "wb") as f:
                pickle.dump(case, f)
            return kernel(*call_args)

        return call

    monkeypatch.setattr(request.module, "open_kernel", recording_open_kernel)


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> ArtifactCache:
    """One cache for the session: each spec compiles once however many tests use it."""
    return ArtifactCache(tmp_path_factory.mktemp("artifacts"))


def uniform(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    """runtime/examples.py's inputs in [-1, 1) in the kernel dtype, their draws recorded when
    recording."""
    state = rng.bit_generator.state if RECORD_DIR else None
    drawn = _uniform(rng, shape, dtype)
    if RECORD_DIR and isinstance(rng.bit_generator, np.random.PCG64):
        _UNIFORM_DRAWS[id(drawn)] = (drawn, dict(state=state, shape=list(np.shape(drawn)), dtype=dtype))
    return drawn


def assert_matches_reference(name: str, got, spec, args, want=None) -> None:
    """(output, lse) of the call ``args`` of ``spec`` against its float64 reference (``want``, or
    computed): rows with a visible key within the call's error bound (runtime/error_model.py),
    the rows without one (reference lse -5e4, semantics §11.3) exactly output 0 and lse -5e4."""
    want = reference_for(spec, args) if want is None else want
    bound = error_bound(spec, args, want)
    (out, lse), (want_out, want_lse) = (np.asarray(x, np.float64) for x in got), want
    assert out.shape == np.shape(want_out) and lse.shape == np.shape(want_lse), f"{name}: shapes differ"
    if not bound.holds((out, lse), want):
        out_ratio, lse_ratio = bound.ratio((out, lse), want)
        raise AssertionError(f"{name}: output error {out_ratio:.3g}, lse error {lse_ratio:.3g} x its bound "
                             f"({spec.dtype})")
    empty = ~bound.valid
    assert np.all(out[empty] == 0.0), f"{name}: empty rows must be 0"
    assert np.all(lse[empty] == EMPTY_ROW_LSE), f"{name}: empty rows must have lse -5e4"


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
