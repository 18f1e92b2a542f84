"""Host-side input checks (semantics §11.8): run before any kernel, raise InputError naming the arg.

Each check returns the normalised value (a C-contiguous numpy array of the expected dtype) so a
caller can pass it straight to the kernel. Non-contiguous arrays are accepted and copied.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import iree.runtime as rt
import ml_dtypes
import numpy as np

from ..mlir.specs import KV_DTYPES
from .dtypes import HOST_DTYPES
from .errors import InputError

INT32_MAX = int(np.iinfo(np.int32).max)

#: The numpy dtype of each spec dtype (runtime/dtypes.py).
NUMPY_DTYPES = {name: dtype.numpy for name, dtype in HOST_DTYPES.items()}


def on_host(value):
    """``value`` with an IREE DeviceArray copied to the host (anything else as it is)."""
    return value.to_host() if isinstance(value, rt.DeviceArray) else value


def as_array(name: str, value) -> np.ndarray:
    """``value`` as a numpy array (numpy, torch CPU tensors via __array__/DLPack, lists)."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor without importing torch
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            return value.view(dtype=_torch_int16()).numpy().view(ml_dtypes.bfloat16)
        if str(value.dtype) in _TORCH_8_BIT:  # an 8-bit KV cache's (semantics §15): the same bytes
            return value.view(dtype=_torch_uint8()).numpy().view(_TORCH_8_BIT[str(value.dtype)])
        return value.numpy()
    try:
        return np.asarray(value)
    except Exception as err:  # noqa: BLE001 - any conversion failure is a bad argument
        raise InputError(f"{name}: cannot be read as an array ({err})") from None


#: torch's 8-bit float dtypes (by their str) as ml_dtypes, which numpy reads them as.
_TORCH_8_BIT = {f"torch.{name}": getattr(ml_dtypes, name) for name in KV_DTYPES}


def _torch_uint8():
    import torch

    return torch.uint8


def _torch_int16():
    import torch

    return torch.int16


def check_tensor(name: str, value, *, dtype: str, shape: Sequence[int | None]):
    """An array of dtype ``dtype`` and rank ``len(shape)``; ``None`` entries match any size.

    An IREE ``DeviceArray`` is checked by its dtype and shape and returned as it is (no copy to
    the host); anything else comes back as a C-contiguous numpy array.
    """
    expected = NUMPY_DTYPES[dtype]
    if isinstance(value, rt.DeviceArray):
        if str(value.dtype) != expected.name:
            raise InputError(f"{name}: expected dtype {dtype}, got {value.dtype}")
        _check_shape(name, tuple(value.shape), shape)
        return value
    array = as_array(name, value)
    if array.dtype != expected:
        raise InputError(f"{name}: expected dtype {dtype}, got {array.dtype}")
    _check_shape(name, array.shape, shape)
    return np.ascontiguousarray(array)


def check_f32(name: str, value, *, shape: Sequence[int | None]) -> np.ndarray:
    """A float32 array of the given shape whose every value is finite (the ABI's ``f32`` kind:
    float32 whatever the spec's dtype, e.g. ``sinks``); an IREE ``DeviceArray`` is read back (these
    arguments are small). Another dtype is an error, never cast."""
    array = as_array(name, on_host(value))
    if array.dtype != np.float32:
        raise InputError(f"{name}: expected dtype float32, got {array.dtype}")
    _check_shape(name, array.shape, shape)
    if not np.all(np.isfinite(array)):
        raise InputError(f"{name}: values must be finite, found {array[~np.isfinite(array)][0]}")
    return np.ascontiguousarray(array)


def check_scale(name: str, value, *, shape: Sequence[int | None]) -> np.ndarray:
    """:func:`check_f32` whose values must also be positive (the ABI's ``scale`` kind: the
    per-KV-head scales of an 8-bit KV cache, semantics §15). One scale for every head, as vLLM and
    FlashInfer take a per-tensor scale, is a Python number, a float32 scalar, shape [] or [1]: it
    is repeated to ``shape`` (``[h_kv]``)."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):   # numpy's scalars too
        value = np.float32(value)
    array = as_array(name, on_host(value))
    if array.shape in ((), (1,)) and len(shape) == 1 and shape[0] is not None:
        array = np.broadcast_to(array.reshape(1), tuple(shape))
    array = check_f32(name, array, shape=shape)
    if not np.all(array > 0):
        raise InputError(f"{name}: scales must be positive, found {array[~(array > 0)][0]}")
    return array


def check_one_scale(spec, k_scale: np.ndarray, v_scale: np.ndarray) -> None:
    """For a layout whose keys and values are the same 8-bit elements (``one_scale``: MLA's latent
    rows), checked ``k_scale`` and ``v_scale`` must be equal (semantics §15); InputError naming
    v_scale otherwise."""
    if getattr(spec, "base", spec).layout.one_scale and not np.array_equal(v_scale, k_scale):
        raise InputError(f"v_scale: {spec.name}'s keys and values are the same 8-bit elements, so v_scale must "
                         f"equal k_scale (got {v_scale.tolist()} and {k_scale.tolist()})")


INT32 = np.iinfo(np.int32)


def check_int32(name: str, value, *, shape: Sequence[int | None]) -> np.ndarray:
    """An int32 index array of the given shape. Other integer arrays, tensors and Python lists
    are converted when every value fits int32; floats, bools and out-of-range values are errors."""
    array = as_array(name, value)
    if array.dtype != np.int32:
        integers = array.dtype != np.bool_ and np.issubdtype(array.dtype, np.integer)
        empty_list = array.size == 0 and not isinstance(value, np.ndarray)  # np.asarray([]) is float64
        if not integers and not empty_list:
            raise InputError(f"{name}: expected integers (int32, or int64 within int32), got {array.dtype}")
        outside = array[(array < INT32.min) | (array > INT32.max)] if integers else array[:0]
        if outside.size:
            raise InputError(f"{name}: values must fit int32, found {outside[0]}")
        array = array.astype(np.int32)
    _check_shape(name, array.shape, shape)
    return np.ascontiguousarray(array)


def check_mask(name: str, value, *, shape: Sequence[int | None]) -> np.ndarray:
    """A custom mask (semantics §14): bool or uint8 values 0 or 1 of the given shape, returned as
    a C-contiguous int8 array (the kernels' i8 operand, which a checked call passes again). An
    IREE DeviceArray is read back first."""
    array = as_array(name, on_host(value))
    if array.dtype not in (np.bool_, np.uint8, np.int8):
        raise InputError(f"{name}: expected dtype bool or uint8, got {array.dtype}")
    _check_shape(name, array.shape, shape)
    if array.dtype != np.bool_ and array.size and (array.min() < 0 or array.max() > 1):
        bad = array[(array < 0) | (array > 1)][0]
        raise InputError(f"{name}: values must be 0 or 1, found {bad}")
    return np.ascontiguousarray(array.astype(np.int8))


def _check_shape(name: str, got_shape: tuple, shape: Sequence[int | None]) -> None:
    if len(got_shape) != len(shape):
        raise InputError(f"{name}: expected rank {len(shape)} with shape {_spell(shape)}, got shape {got_shape}")
    for axis, (got, want) in enumerate(zip(got_shape, shape)):
        if want is not None and got != want:
            raise InputError(f"{name}: expected shape {_spell(shape)}, got {got_shape} (axis {axis})")


def _spell(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def check_same(name: str, got: int, other: str, want: int) -> None:
    if got != want:
        raise InputError(f"{name}: size {got} must equal {other} ({want})")


def check_on_device(name: str, value, device: rt.HalDevice) -> None:
    """An IREE ``DeviceArray`` must live on ``device`` (the kernel's); host arrays always pass."""
    if isinstance(value, rt.DeviceArray) and value._device is not device:
        raise InputError(f"{name}: is an IREE device array on another device than the kernel's; upload it "
                         "with iree.runtime.asdevicearray(kernel.device, array) or pass a numpy array")


def check_range(name: str, array: np.ndarray, low: int, high: int) -> None:
    """Every element in [low, high]."""
    if array.size and (array.min() < low or array.max() > high):
        bad = array[(array < low) | (array > high)][0]
        raise InputError(f"{name}: values must lie in [{low}, {high}], found {bad}")


def check_indptr(name: str, value, batch: int | None, total: int, total_name: str) -> np.ndarray:
    """A CSR offset array, int32 [B+1]: starts at 0, non-decreasing, ends at ``total``.

    ``batch=None`` accepts any B >= 0 (the array defines B); otherwise the length must be B+1.
    """
    indptr = check_int32(name, value, shape=(None if batch is None else batch + 1,))
    if indptr.shape[0] == 0:
        raise InputError(f"{name}: expected length B+1 >= 1, got an empty array")
    if indptr[0] != 0:
        raise InputError(f"{name}: expected to start at 0, found {indptr[0]}")
    steps = np.diff(indptr.astype(np.int64))
    if np.any(steps < 0):
        at = int(np.argmax(steps < 0))
        raise InputError(
            f"{name}: expected non-decreasing values, found {indptr[at]} then {indptr[at + 1]} "
            f"at index {at}")
    if indptr[-1] != total:
        raise InputError(f"{name}: expected to end at {total_name} = {total}, found {indptr[-1]}")
    return indptr
