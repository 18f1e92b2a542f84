"""Results written into the caller's arrays: ``kernel(..., out=, lse=)`` and ``wrapper.run(...,
out=, lse=)``.

A caller that keeps its own output buffers (an engine's activation arena, a preallocated torch
tensor) passes them as ``out`` (the output's shape and the spec's dtype) and ``lse`` (float32,
the output's shape without its last axis); the call writes its results there, once, and returns
the caller's objects as they were given. Either may be left out (a new array is made for it).
Both are checked before any kernel runs (InputError naming the argument). On the CPU drivers a
kernel writes straight into an array at a 64-byte boundary (its function takes storage for its
results: runtime/module.py), and through one copy into any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..mlir.abi import argument_names
from .checks import NUMPY_DTYPES, as_array
from .errors import InputError
from .module import ResultShapes


@dataclass(frozen=True)
class Outputs:
    """The arrays a call writes its results into: ``arrays`` (output, lse) as numpy views of the
    caller's memory, ``given`` the objects the call returns (the caller's own where it gave them,
    numpy arrays for the rest)."""

    arrays: tuple[np.ndarray, np.ndarray]
    given: tuple

    def store(self, output: np.ndarray, lse: np.ndarray) -> tuple:
        """Copies a call's results into the caller's arrays (not where the call wrote them there
        already: LoadedKernel.consume's ``into``); returns :attr:`given`."""
        for mine, result in zip(self.arrays, (output, lse)):
            if result.ctypes.data != mine.ctypes.data or result.size != mine.size:
                np.copyto(mine, result.reshape(mine.shape))
        return self.given


def result_shapes(spec) -> ResultShapes:
    """How a call of ``spec`` (a variant or a serving pass) shapes its (output, lse) from its
    arguments (mlir/abi.py: result_dims): q's shape with d_v columns in the spec's dtype, and
    without its last axis in float32."""
    return ResultShapes(argument_names(spec).index("q"), spec.d_v, NUMPY_DTYPES[spec.dtype])


def caller_outputs(spec, q_shape: tuple, out, lse) -> Outputs | None:
    """The :class:`Outputs` of a call with query ``q_shape`` given ``out`` and ``lse`` (either may
    be None), or None when neither is given. InputError naming ``out`` or ``lse`` for a buffer of
    another shape or dtype, or one the call cannot write in place (read-only or not C-contiguous)."""
    if out is None and lse is None:
        return None
    shapes = ((*q_shape[:-1], spec.d_v), tuple(q_shape[:-1]))
    dtypes = (NUMPY_DTYPES[spec.dtype], np.dtype(np.float32))
    arrays, given = [], []
    for name, value, shape, dtype in zip(("out", "lse"), (out, lse), shapes, dtypes):
        if value is None:
            value = np.empty(shape, dtype)
        array = _writable(name, value, shape, dtype)
        arrays.append(array)
        given.append(value)
    return Outputs(tuple(arrays), tuple(given))


def _writable(name: str, value, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """``value`` (a numpy array or a CPU torch tensor) as a numpy view of its memory, checked."""
    if not isinstance(value, np.ndarray) and not (hasattr(value, "detach") and hasattr(value, "data_ptr")):
        raise InputError(f"{name}: expected a numpy array or a CPU torch tensor, got {type(value).__name__}")
    if getattr(getattr(value, "device", None), "type", "cpu") != "cpu":
        raise InputError(f"{name}: on {value.device}; the results are written from the host")
    array = as_array(name, value)
    if array.dtype != dtype:
        raise InputError(f"{name}: expected dtype {dtype.name}, got {array.dtype}")
    if tuple(array.shape) != shape:
        raise InputError(f"{name}: expected shape {list(shape)}, got {list(array.shape)}")
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise InputError(f"{name}: must be C-contiguous and writeable to take the results in place")
    return array
