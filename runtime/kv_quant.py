"""8-bit KV caches on the host (semantics §15): quantising a cache into float8 pages with per-KV-head
scales, and the dequantised call the reference and the error model evaluate.

An element ``x`` of an 8-bit cache of a spec of compute dtype ``dtype`` stands for
``dtype(float32(x) * float32(scale[head]))``: the kernels widen each element as they read it
(mlir/kv_layouts.py: ``dequantized``), and :func:`dequantized_call` rounds the same way, so the
reference of a quantised call is the reference of its dequantised cache, and its error bound
the compute dtype's on those inputs (runtime/error_model.py).

    pages8, k_scale, v_scale = quantize_pages(pages, "float8_e4m3fn")      # numpy or torch
    kernel = open_kernel(PagedPrefillSpec(32, 8, 128, "bfloat16", kv_dtype="float8_e4m3fn"))
    out, lse = kernel(q, q_indptr, pages8, ..., sm_scale, k_scale, v_scale)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..mlir.abi import argument_names, ordered
from ..mlir.decode import DecodeSpec
from ..mlir.kv_layouts import PAGED_ORDERS
from ..mlir.specs import KV_DTYPES
from .checks import NUMPY_DTYPES
from .errors import InputError

__all__ = ["dequantized_call", "quantize_pages", "PAGE_HEAD_AXIS"]

#: The KV-head axis of one half (K or V, ``pages[:, which]``) of each paged layout's pages.
PAGE_HEAD_AXIS = {"paged": 1, "paged_nhd": 2}


def _finite_max(kv_dtype: str) -> float:
    import ml_dtypes

    return float(ml_dtypes.finfo(NUMPY_DTYPES[kv_dtype]).max)


def quantize_pages(pages, kv_dtype: str, *, kv_order: str = "hnd", per: str = "head"):
    """(pages in ``kv_dtype``, k_scale [h_kv] f32, v_scale [h_kv] f32) for pages [P, 2, h_kv,
    page_size, d] (``kv_order="nhd"``: [P, 2, page_size, h_kv, d]) of any float dtype, numpy or
    torch (the results are the same kind). ``per="head"``: a scale per KV head and per K or V,
    ``"tensor"``: one for all K and one for all V (repeated over the heads). Each scale maps its
    largest magnitude to the format's largest finite value (a scale of 1 where every element is
    0), and every element rounds to the nearest representable value (saturating)."""
    if kv_dtype not in KV_DTYPES:
        raise InputError(f"kv_dtype: expected one of {KV_DTYPES}, got {kv_dtype!r}")
    if per not in ("head", "tensor"):
        raise InputError(f"per: expected 'head' or 'tensor', got {per!r}")
    if kv_order not in PAGED_ORDERS:
        raise InputError(f"kv_order: expected one of {sorted(PAGED_ORDERS)}, got {kv_order!r}")
    torch = _torch_of(pages)
    values = (pages.detach().float().cpu().numpy() if torch else np.asarray(pages, np.float32))
    if values.ndim != 5 or values.shape[1] != 2:
        raise InputError(f"pages: expected [P, 2, ...] pages of rank 5, got shape {values.shape}")
    head_axis = PAGE_HEAD_AXIS[PAGED_ORDERS[kv_order].name]
    largest = _finite_max(kv_dtype)
    scales, quantised = [], np.empty(values.shape, NUMPY_DTYPES[kv_dtype])
    for which in (0, 1):
        half = values[:, which]
        others = tuple(axis for axis in range(half.ndim) if axis != head_axis)
        amax = np.abs(half).max(axis=others, initial=0.0) if per == "head" else \
            np.full(half.shape[head_axis], np.abs(half).max(initial=0.0))
        scale = np.where(amax > 0, amax / largest, 1.0).astype(np.float32)
        shape = [1] * half.ndim
        shape[head_axis] = -1
        quantised[:, which] = np.clip(half / scale.reshape(shape), -largest, largest).astype(NUMPY_DTYPES[kv_dtype])
        scales.append(scale)
    if torch:
        return (torch.from_numpy(quantised.view(np.uint8)).view(getattr(torch, kv_dtype)).to(pages.device),
                *(torch.from_numpy(s).to(pages.device) for s in scales))
    return quantised, *scales


def _torch_of(value):
    """The torch module if ``value`` is a torch tensor, else None (torch is not imported here)."""
    module = type(value).__module__
    if module.startswith("torch"):
        import torch

        return torch
    return None


def dequantized_call(spec, args: tuple) -> tuple:
    """(spec without its 8-bit cache, the call with its pages dequantised and no scales) of the
    call ``args`` (in the table's order) of a spec with an 8-bit KV cache (a variant or its
    serving pass): what the reference and the error model evaluate."""
    base = getattr(spec, "base", spec)
    named = dict(zip(argument_names(spec), args, strict=True))
    pages = np.asarray(named.pop("pages"))
    k_scale, v_scale = (np.asarray(named.pop(name), np.float32) for name in ("k_scale", "v_scale"))
    head_axis = PAGE_HEAD_AXIS[base.kv_layout]
    shape = [1] * (pages.ndim - 1)
    shape[head_axis] = -1
    widened = pages.astype(np.float32)
    halves = [widened[:, which] * scale.reshape(shape) for which, scale in ((0, k_scale), (1, v_scale))]
    named["pages"] = np.stack(halves, axis=1).astype(NUMPY_DTYPES[base.dtype])
    plain = dataclasses.replace(base, kv_dtype=None)
    plain_spec = DecodeSpec(plain, spec.queries) if isinstance(spec, DecodeSpec) else plain
    return plain_spec, ordered(plain_spec, named)

