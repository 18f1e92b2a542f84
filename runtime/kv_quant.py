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
    k8, v8, k_scale, v_scale = quantize_kv(k, v, "float8_e5m2")             # ragged K/V
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..mlir.abi import argument_names, ordered
from ..mlir.decode import DecodeSpec
from ..mlir.kv_layouts import PAGED_ORDERS, RAGGED_ORDERS
from ..mlir.specs import KV_DTYPES
from .checks import NUMPY_DTYPES
from .errors import InputError
from .kv_layouts import host_layout

__all__ = ["dequantized_call", "quantize_kv", "quantize_latent", "quantize_pages"]


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
    _check_format(kv_dtype, per)
    if kv_order not in PAGED_ORDERS:
        raise InputError(f"kv_order: expected one of {sorted(PAGED_ORDERS)}, got {kv_order!r}")
    torch = _torch_of(pages)
    values = _as_float32(pages, torch)
    if values.ndim != 5 or values.shape[1] != 2:
        raise InputError(f"pages: expected [P, 2, ...] pages of rank 5, got shape {values.shape}")
    head_axis = host_layout(PAGED_ORDERS[kv_order].name).head_axis
    (k8, k_scale), (v8, v_scale) = (_quantised(values[:, which], head_axis, kv_dtype, per) for which in (0, 1))
    return _like(pages, torch, kv_dtype, np.stack([k8, v8], axis=1), k_scale, v_scale)


def quantize_kv(k, v, kv_dtype: str, *, kv_order: str = "nhd", per: str = "head"):
    """(k, v in ``kv_dtype``, k_scale [h_kv] f32, v_scale [h_kv] f32) for the K/V of a
    ``RaggedPrefillSpec`` (k [Lk, h_kv, d_qk], v [Lk, h_kv, d_v]; ``kv_order="hnd"``: [h_kv, Lk,
    d]) or of a dense spec (rank 4: k, v [B, Lk, h_kv, d]), numpy or torch; scales and rounding as
    :func:`quantize_pages`'."""
    _check_format(kv_dtype, per)
    if kv_order not in RAGGED_ORDERS:
        raise InputError(f"kv_order: expected one of {sorted(RAGGED_ORDERS)}, got {kv_order!r}")
    results = []
    for name, x in (("k", k), ("v", v)):
        torch = _torch_of(x)
        values = _as_float32(x, torch)
        if values.ndim not in (3, 4):
            raise InputError(f"{name}: expected rank 3 (ragged) or 4 (dense), got shape {values.shape}")
        head_axis = host_layout("dense" if values.ndim == 4 else RAGGED_ORDERS[kv_order].name).head_axis
        x8, scale = _quantised(values, head_axis, kv_dtype, per)
        results.append(_like(x, torch, kv_dtype, x8, scale))
    (k8, k_scale), (v8, v_scale) = results
    return k8, v8, k_scale, v_scale


def quantize_latent(pages, kv_dtype: str):
    """(pages in ``kv_dtype``, k_scale [1] f32, v_scale [1] f32, the same) for MLA's latent pages
    [P, page_size, d_latent + d_rope], numpy or torch: one scale, as :func:`quantize_pages`' per
    tensor (the keys and values are the same elements)."""
    _check_format(kv_dtype, "tensor")
    torch = _torch_of(pages)
    values = _as_float32(pages, torch)
    if values.ndim != 3:
        raise InputError(f"pages: expected [P, page_size, d_latent + d_rope] pages of rank 3, got shape {values.shape}")
    quantised, scale = _quantised(values[None], 0, kv_dtype, "tensor")
    pages8, k_scale = _like(pages, torch, kv_dtype, quantised[0], scale)
    return pages8, k_scale, k_scale


def _check_format(kv_dtype: str, per: str) -> None:
    if kv_dtype not in KV_DTYPES:
        raise InputError(f"kv_dtype: expected one of {KV_DTYPES}, got {kv_dtype!r}")
    if per not in ("head", "tensor"):
        raise InputError(f"per: expected 'head' or 'tensor', got {per!r}")


def _as_float32(x, torch) -> np.ndarray:
    return x.detach().float().cpu().numpy() if torch else np.asarray(x, np.float32)


def _quantised(values: np.ndarray, head_axis: int, kv_dtype: str, per: str) -> tuple[np.ndarray, np.ndarray]:
    """(``values`` in ``kv_dtype``, scale [h_kv] f32) with the KV heads along ``head_axis``."""
    largest = _finite_max(kv_dtype)
    others = tuple(axis for axis in range(values.ndim) if axis != head_axis)
    amax = np.abs(values).max(axis=others, initial=0.0) if per == "head" else \
        np.full(values.shape[head_axis], np.abs(values).max(initial=0.0))
    scale = np.where(amax > 0, amax / largest, 1.0).astype(np.float32)
    quantised = np.clip(values / _along(scale, values.ndim, head_axis), -largest, largest)
    return quantised.astype(NUMPY_DTYPES[kv_dtype]), scale


def _along(scale: np.ndarray, ndim: int, axis: int) -> np.ndarray:
    """``scale`` [h_kv] shaped to broadcast along ``axis`` of an array of rank ``ndim``."""
    shape = [1] * ndim
    shape[axis] = -1
    return scale.reshape(shape)


def _like(original, torch, kv_dtype: str, quantised: np.ndarray, *scales: np.ndarray):
    """The results as the caller's kind: numpy, or torch tensors on ``original``'s device."""
    if torch:
        return (torch.from_numpy(quantised.view(np.uint8)).view(getattr(torch, kv_dtype)).to(original.device),
                *(torch.from_numpy(s).to(original.device) for s in scales))
    return quantised, *scales


def _torch_of(value):
    """The torch module if ``value`` is a torch tensor, else None (torch is not imported here)."""
    module = type(value).__module__
    if module.startswith("torch"):
        import torch

        return torch
    return None


def dequantized_call(spec, args: tuple) -> tuple:
    """(spec without its 8-bit cache, the call with its K/V dequantised and no scales) of the
    call ``args`` (in the table's order) of a spec with an 8-bit KV cache (a variant or its
    serving pass): what the reference and the error model evaluate."""
    base = getattr(spec, "base", spec)
    named = dict(zip(argument_names(spec), args, strict=True))
    k_scale, v_scale = (np.asarray(named.pop(name), np.float32) for name in ("k_scale", "v_scale"))
    dtype = NUMPY_DTYPES[base.dtype]

    def widened(x, scale, head_axis):
        return (np.asarray(x).astype(np.float32) * _along(scale, np.ndim(x), head_axis)).astype(dtype)

    named = host_layout(base).dequantized(named, k_scale, v_scale, widened)
    plain = dataclasses.replace(base, kv_dtype=None)
    plain_spec = DecodeSpec(plain, spec.queries) if isinstance(spec, DecodeSpec) else plain
    return plain_spec, ordered(plain_spec, named)
