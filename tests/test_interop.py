"""What calls return for what they get (runtime/interop.py): numpy -> numpy, torch -> torch
(bfloat16 as torch.bfloat16, sharing memory), IREE DeviceArrays -> DeviceArrays."""

from __future__ import annotations

import sys
import types

import iree.runtime as rt
import ml_dtypes
import numpy as np
import pytest

from conftest import TensorLike
from linalg_prefill.mlir import RaggedPrefillSpec, SequencePrefillSpec
from linalg_prefill.runtime import RaggedPrefillWrapper, open_kernel
from linalg_prefill.runtime.examples import example_inputs

SPEC = SequencePrefillSpec(4, 2, 64, "bfloat16", causal=True, sm_scale=0.125)
pytestmark = pytest.mark.compiles(SPEC, RaggedPrefillSpec(8, 2, 64, 64, "float32"))  # tests/conftest.py


class _StandInTensor(TensorLike):
    """conftest's TensorLike, named as a torch tensor is (interop.is_torch), with the ``view`` the
    bfloat16 paths call, for machines without torch."""

    __module__ = "torch"

    def view(self, dtype=None):
        viewed = _StandInTensor(self._array)
        viewed.dtype = dtype
        return viewed


@pytest.fixture
def stand_in_torch(monkeypatch):
    """A module named ``torch`` with from_numpy, int16 and bfloat16 (the calls to_torch makes)."""
    module = types.ModuleType("torch")
    module.int16, module.bfloat16 = "torch.int16", "torch.bfloat16"
    module.from_numpy = lambda array: _StandInTensor(array)
    monkeypatch.setitem(sys.modules, "torch", module)
    return module


def test_torch_in_gives_torch_out_sharing_memory(stand_in_torch, cache):
    kernel = open_kernel(SPEC, cache=cache)
    q, k, v = example_inputs(SPEC, np.random.default_rng(0))
    want_out, want_lse = kernel(q, k, v)
    out, lse = kernel(_StandInTensor(q), _StandInTensor(k), _StandInTensor(v))
    assert out.dtype == "torch.bfloat16" and out.numpy().dtype == np.int16  # bf16 through an int16 view
    assert np.array_equal(out.numpy().view(ml_dtypes.bfloat16), want_out)
    assert isinstance(lse, _StandInTensor) and np.array_equal(lse.numpy(), want_lse)


def test_numpy_in_numpy_out_and_device_in_device_out(cache):
    kernel = open_kernel(SPEC, cache=cache)
    q, k, v = example_inputs(SPEC, np.random.default_rng(0))
    out, _ = kernel(q, k, v)
    assert isinstance(out, np.ndarray)
    on_device = [rt.asdevicearray(kernel.device, x) for x in (q, k, v)]
    device_out, device_lse = kernel(*on_device)
    assert isinstance(device_out, rt.DeviceArray) and isinstance(device_lse, rt.DeviceArray)
    assert np.array_equal(device_out.to_host(), out)
    assert isinstance(kernel(*on_device, to_host=True)[0], np.ndarray)
    empty = kernel(*[rt.asdevicearray(kernel.device, x[:, :0]) for x in (q, k, v)])  # no query rows
    assert isinstance(empty[0], rt.DeviceArray) and empty[0].shape == [q.shape[0], 0, 4, 64]


def test_wrappers_return_like_their_tensors(stand_in_torch, cache):
    spec = RaggedPrefillSpec(8, 2, 64, 64, "float32")
    wrapper = RaggedPrefillWrapper(spec, cache=cache)
    indptr = np.array([0, 5, 12])
    wrapper.plan(indptr.tolist(), indptr.astype(np.int64), causal=True)  # lists and int64 indices
    rng = np.random.default_rng(1)
    q, k, v = (rng.uniform(-1, 1, (12, h, 64)).astype(np.float32) for h in (8, 2, 2))
    want = wrapper.run(q, k, v)
    got = wrapper.run(_StandInTensor(q), k, v)
    assert isinstance(got[0], _StandInTensor) and np.array_equal(got[0].numpy(), want[0])


def test_with_real_torch(cache):
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[bench]')")
    kernel = open_kernel(SPEC, cache=cache)
    q, k, v = example_inputs(SPEC, np.random.default_rng(0))
    as_torch = [torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16) for x in (q, k, v)]
    out, lse = kernel(*as_torch)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert np.array_equal(out.float().numpy(), kernel(q, k, v)[0].astype(np.float32))
