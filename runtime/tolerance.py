"""How close a kernel's results must be to the float64 reference: the one table the tests,
``compare_backends`` (and ``linalg-prefill check``), the demo and the GPU bundle use.

A result element ``got`` is within ``(atol, rtol)`` of ``want`` when
``|got - want| <= atol + rtol * |want|``. Inputs are in [-1, 1].

* float32: 1e-4 absolute (DEVELOPERS.md). float16: FlashInfer's 1e-3 / 1e-3. bfloat16 keeps 8
  significant bits, so rounding the output alone costs up to 2^-9 relative: rtol 8e-3 (4 ulp),
  atol 2e-3. lse is float32 for every dtype: 1e-4 absolute.
* Calls that rotate q and k in a half dtype (RoPE on) round the rotated values to the dtype, as
  the seed does, and f32 cos/sin (kernel) against f64 ones (reference) round some elements to
  the neighbouring value, one ulp apart (2^-8 relative in bf16), which moves scores by up to
  ~1e-3 each. Measured (60 random ragged calls, positions < 500, d=32, bf16): lse error 6e-7
  with RoPE off and 2.8e-3 to 4.5e-3 with it on; fp16 3.6e-4; 1000-draw fuzzing found 1.2e-2 at
  |lse| ~ 2-4 (bf16, yarn). Hence ``ROTATED_TOLERANCE``.
"""

from __future__ import annotations

import numpy as np

from ..mlir.abi import position

Tolerance = tuple[float, float]  # (atol, rtol)

TOLERANCE: dict[str, Tolerance] = {"float32": (1e-4, 0.0), "float16": (1e-3, 1e-3), "bfloat16": (2e-3, 8e-3)}
LSE_TOLERANCE = 1e-4
#: (output, lse) tolerances of calls that apply RoPE in the kernel.
ROTATED_TOLERANCE: dict[str, tuple[Tolerance, Tolerance]] = {
    "float32": (TOLERANCE["float32"], (LSE_TOLERANCE, 0.0)),
    "float16": ((1e-3, 1e-3), (1e-3, 1e-3)),
    "bfloat16": ((5e-3, 8e-3), (1e-2, 4e-3)),
}


def tolerances(dtype: str, rotated: bool = False) -> tuple[Tolerance, Tolerance]:
    """(output, lse) tolerances of a call in ``dtype``; ``rotated``: it applies RoPE."""
    return ROTATED_TOLERANCE[dtype] if rotated else (TOLERANCE[dtype], (LSE_TOLERANCE, 0.0))


def applies_rope(spec, args) -> bool:
    """Whether a seed-ABI call rotates q and k in the kernel (its ``rotary_mode`` is 1)."""
    at = position(spec, "rotary_mode")
    return at is not None and int(args[at]) == 1


def excess(got, want, tolerance: Tolerance) -> float:
    """max(|got - want| - (atol + rtol |want|)): at most 0 when every element is within
    ``tolerance``; -inf for empty arrays."""
    atol, rtol = tolerance
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want) - (atol + rtol * np.abs(want)), initial=-np.inf))
