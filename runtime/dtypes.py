"""The dtypes the kernels take, the host half of their records (the IR half is ``mlir/dtypes.py``,
one record per name): the numpy dtype of an array, the torch dtype, IREE's element type and the
unit roundoff the error model (runtime/error_model.py) charges a rounding to it.

This module needs numpy only (ml_dtypes for bfloat16, imported when asked), so the GPU bundle's
reference package carries it (bench/gpu_bundle.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HostDType:
    """``name``: how specs spell it; ``unit_roundoff``: u = 2^-p of its p-bit significand;
    ``torch``: the torch dtype's name; ``iree``: the ``iree.runtime.HalElementType`` member;
    ``numpy_from``: the module whose scalar type of ``name`` numpy arrays use."""

    name: str
    unit_roundoff: float
    torch: str
    iree: str
    numpy_from: str = "numpy"

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype of an array of it."""
        return np.dtype(getattr(importlib.import_module(self.numpy_from), self.name))


#: Every dtype by name (mlir/dtypes.py: IR_DTYPES has the same names).
HOST_DTYPES: dict[str, HostDType] = {dtype.name: dtype for dtype in (
    HostDType("float32", 2.0 ** -24, torch="float32", iree="FLOAT_32"),
    HostDType("float16", 2.0 ** -11, torch="float16", iree="FLOAT_16"),
    HostDType("bfloat16", 2.0 ** -8, torch="bfloat16", iree="BFLOAT_16", numpy_from="ml_dtypes"),
    HostDType("float8_e4m3fn", 2.0 ** -4, torch="float8_e4m3fn", iree="FLOAT_8_E4M3_FN", numpy_from="ml_dtypes"),
    HostDType("float8_e5m2", 2.0 ** -3, torch="float8_e5m2", iree="FLOAT_8_E5M2", numpy_from="ml_dtypes"),
    HostDType("float8_e4m3fnuz", 2.0 ** -4, torch="float8_e4m3fnuz", iree="FLOAT_8_E4M3_FNUZ", numpy_from="ml_dtypes"),
    HostDType("float8_e5m2fnuz", 2.0 ** -3, torch="float8_e5m2fnuz", iree="FLOAT_8_E5M2_FNUZ", numpy_from="ml_dtypes"),
)}
