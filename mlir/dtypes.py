"""The dtypes the kernels take, the IR half of their records (the host half, numpy, torch, IREE
and the error model's unit roundoff, is ``runtime/dtypes.py``, one record per name).

    IR_DTYPES["bfloat16"].element_type()   # bf16, in an open MLIR context
    IR_DTYPES["float16"].itemsize          # 2

A new dtype is one record here and one there (tests/test_dtypes.py checks both halves). The
8-bit float formats are KV-cache dtypes only (``compute=False``): a spec's ``kv_dtype``, never its
``dtype`` (queries, outputs and the arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import ir


@dataclass(frozen=True)
class IrDType:
    """``name``: how specs spell it; ``itemsize``: bytes an element; ``mlir``: the MLIR builtin
    type's class name; ``matrix_units``: GPU tensor cores (CUDA) and matrix cores (ROCm) take its
    operands, so a GPU artifact must use them (pipeline/vm_structure.py); ``compute``: a spec's
    ``dtype`` may be it (False: a KV-cache dtype only, widened as the kernels read it)."""

    name: str
    itemsize: int
    mlir: str
    matrix_units: bool
    compute: bool = True

    def element_type(self) -> ir.Type:
        """The MLIR element type, in an open context."""
        return getattr(ir, self.mlir).get()


#: Every dtype by name: the compute dtypes in the order specs list them (mlir/specs.py: DTYPES),
#: then the KV-cache-only ones (KV_DTYPES there).
IR_DTYPES: dict[str, IrDType] = {dtype.name: dtype for dtype in (
    IrDType("float32", 4, "F32Type", matrix_units=False),
    IrDType("float16", 2, "F16Type", matrix_units=True),
    IrDType("bfloat16", 2, "BF16Type", matrix_units=True),
    IrDType("float8_e4m3fn", 1, "Float8E4M3FNType", matrix_units=False, compute=False),
    IrDType("float8_e5m2", 1, "Float8E5M2Type", matrix_units=False, compute=False),
    # the 8-bit formats of AMD's gfx942 (MI300): no negative zero or inf, one more exponent bias
    IrDType("float8_e4m3fnuz", 1, "Float8E4M3FNUZType", matrix_units=False, compute=False),
    IrDType("float8_e5m2fnuz", 1, "Float8E5M2FNUZType", matrix_units=False, compute=False),
)}


def ir_dtype(name: str) -> IrDType:
    """The IR half of dtype ``name``; ValueError naming the known ones otherwise."""
    try:
        return IR_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(IR_DTYPES)}, got {name!r}") from None


def kv_dtype_of(spec) -> str:
    """The dtype of the KV cache ``spec`` (a variant or its serving pass) reads: its ``kv_dtype``
    where it has one, else its ``dtype``."""
    base = getattr(spec, "base", spec)
    return getattr(base, "kv_dtype", None) or base.dtype


def quantized_kv(spec) -> bool:
    """Whether ``spec`` (a variant or its serving pass) reads an 8-bit KV cache through scales."""
    return kv_dtype_of(spec) != getattr(spec, "base", spec).dtype
