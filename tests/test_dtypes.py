"""The dtype records (mlir/dtypes.py, runtime/dtypes.py): one per name in each half, agreeing with
numpy, ml_dtypes, MLIR, IREE and torch about what the dtype is."""

from __future__ import annotations

import iree.runtime as rt
import ml_dtypes
import numpy as np
import pytest
from iree.runtime.array_interop import map_dtype_to_element_type

from linalg_prefill.mlir.dtypes import IR_DTYPES, ir_dtype
from linalg_prefill.mlir.ir import module_context
from linalg_prefill.mlir.specs import DTYPES, KV_DTYPES
from linalg_prefill.runtime.dtypes import HOST_DTYPES


def test_both_halves_have_every_dtype_in_the_specs_order():
    assert tuple(IR_DTYPES) == tuple(HOST_DTYPES) == DTYPES + KV_DTYPES
    assert DTYPES == ("float32", "float16", "bfloat16")
    assert KV_DTYPES == ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    with pytest.raises(ValueError, match="dtype must be one of"):
        ir_dtype("float8_e4m3b11fnuz")


@pytest.mark.parametrize("name", list(IR_DTYPES))
def test_a_record_agrees_with_numpy_mlir_iree_and_torch(name):
    ir_half, host = IR_DTYPES[name], HOST_DTYPES[name]
    assert host.numpy.itemsize == ir_half.itemsize
    info = ml_dtypes.finfo(host.numpy) if host.numpy_from == "ml_dtypes" else np.finfo(host.numpy)
    assert host.unit_roundoff == float(info.eps) / 2  # u = 2^-p: half the gap after 1
    assert map_dtype_to_element_type(host.numpy) == getattr(rt.HalElementType, host.iree)
    with module_context():
        assert str(ir_half.element_type()) == {"float32": "f32", "float16": "f16", "bfloat16": "bf16",
                                               "float8_e4m3fn": "f8E4M3FN", "float8_e5m2": "f8E5M2",
                                               "float8_e4m3fnuz": "f8E4M3FNUZ", "float8_e5m2fnuz": "f8E5M2FNUZ"}[name]
    torch = pytest.importorskip("torch")
    assert getattr(torch, host.torch).itemsize == ir_half.itemsize
    assert ir_half.matrix_units == (name in ("float16", "bfloat16"))
    assert ir_half.compute == (name in DTYPES)
