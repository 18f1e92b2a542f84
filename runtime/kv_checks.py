"""Host-side checks of the KV-cache variants' seed-ABI arguments (semantics §1.1-§1.3, §2, §11.8).

One function per variant, taking the kernel's arguments by ABI name (a mapping, mlir/abi.py) and
returning every one of them normalised, by name:

* arrays as C-contiguous numpy arrays of the expected dtype (non-contiguous input is copied; a
  wrong dtype is rejected, never cast; torch CPU tensors are read through :func:`as_array`);
* int scalars (``causal``, ``rotary_mode``) as Python ``int``;
* float scalars (``rope_scale``, ``rope_theta``, ``sm_scale``) as Python ``float``.

Every violation raises :class:`InputError` whose message starts with the argument's name and
states what was expected and what was found. Once a call passes, no kernel read is out of bounds
and no RoPE position overflows int32.

Notation: ``Lq`` query rows, ``Lk`` ragged KV rows, ``B`` batch entries (``len(q_indptr) - 1``),
``P`` pages (``max_num_pages``), ``nnz`` used page slots (``len(page_values)``).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping

import numpy as np

from ..mlir.dtypes import kv_dtype_of
from .checks import INT32_MAX, as_array, check_indptr, check_int32, check_range, check_same, check_tensor
from .errors import InputError
from .kv_layouts import paged_kv_lengths, physical_lengths
from .masks import CallLengths, host_mask

FLOAT32_MAX = float(np.finfo(np.float32).max)

__all__ = ["check_indptr", "check_mla", "check_paged", "check_ragged", "paged_kv_lengths"]


# ----------------------------------------------------------------------------- variants


def check_ragged(spec, named: Mapping) -> dict:
    """Arguments of ``batch_prefill_ragged_kv`` (§1.2) for a ``RaggedPrefillSpec``, by name.

    q [Lq, h_q, d_qk], q_indptr [B+1] i32, k [Lk, h_kv, d_qk], v [Lk, h_kv, d_v] (``kv_order="hnd"``:
    k [h_kv, Lk, d_qk], v [h_kv, Lk, d_v]) in ``spec.kv_dtype`` or ``dtype``, kv_indptr [B+1] i32, q_rope_position [Lq] i32,
    k_rope_pos_offset [B] i32, the scalars, and the mask rule's arguments (runtime/masks.py:
    custom_mask and mask_indptr with ``spec.custom_mask``).
    """
    q = check_tensor("q", named["q"], dtype=spec.dtype, shape=(None, spec.h_q, spec.d_qk))
    k = check_tensor("k", named["k"], dtype=kv_dtype_of(spec), shape=kv_shape(spec, spec.layout.key_dims))
    v = check_tensor("v", named["v"], dtype=kv_dtype_of(spec), shape=kv_shape(spec, spec.layout.value_dims))
    rows = spec.layout.row_axis
    check_same(f"v.shape[{rows}]", v.shape[rows], f"k.shape[{rows}] (Lk)", k.shape[rows])
    q_indptr = check_indptr("q_indptr", named["q_indptr"], None, q.shape[0], "Lq (rows of q)")
    batch = q_indptr.shape[0] - 1
    kv_indptr = check_indptr("kv_indptr", named["kv_indptr"], batch, k.shape[rows], "Lk (rows of k)")
    q_rope_position = check_int32("q_rope_position", named["q_rope_position"], shape=(q.shape[0],))
    k_rope_pos_offset = check_int32("k_rope_pos_offset", named["k_rope_pos_offset"], shape=(batch,))
    scalars = check_rope_scalars(named, spec.d_qk, "d_qk")
    kv_lens = lambda: np.diff(kv_indptr.astype(np.int64))  # noqa: E731
    if scalars["rotary_mode"] == 1:
        check_positions(q_rope_position, k_rope_pos_offset, kv_lens())
    return {**named, "q": q, "q_indptr": q_indptr, "k": k, "v": v, "kv_indptr": kv_indptr,
            "q_rope_position": q_rope_position, "k_rope_pos_offset": k_rope_pos_offset, **scalars,
            **host_mask(spec).check(named, CallLengths(np.diff(q_indptr.astype(np.int64)), kv_lens))}


def check_paged(spec, named: Mapping) -> dict:
    """Arguments of ``batch_prefill_paged_kv[_sliding_window]`` (§1.1) for a ``PagedPrefillSpec``,
    by name.

    q [Lq, h_q, d], q_indptr [B+1] i32, pages [P, 2, h_kv, page_size, d] in ``spec.kv_dtype`` or
    ``dtype`` (``kv_order="nhd"``: [P, 2, page_size, h_kv, d]), page_indptr [B+1] i32,
    page_values [nnz] i32, length_info [B] i32 (or [3, B] with ``spec.sliding_window``), k_rope_pos_offset [B] i32, q_rope_position [Lq] i32,
    the scalars, and the mask rule's arguments (runtime/masks.py: custom_mask and mask_indptr
    with ``spec.custom_mask``, columns logical KV rows, §2).
    """
    q = check_tensor("q", named["q"], dtype=spec.dtype, shape=(None, spec.h_q, spec.d))
    pages = check_tensor("pages", named["pages"], dtype=kv_dtype_of(spec), shape=page_shape(spec))
    table = _check_page_table(spec, q, pages, named)
    batch = table["q_indptr"].shape[0] - 1
    k_rope_pos_offset = check_int32("k_rope_pos_offset", named["k_rope_pos_offset"], shape=(batch,))
    q_rope_position = check_int32("q_rope_position", named["q_rope_position"], shape=(q.shape[0],))
    scalars = check_rope_scalars(named, spec.d, "d")

    @functools.cache
    def kv_lens():  # once, for RoPE's positions and the mask both
        return paged_kv_lengths(table["page_indptr"], table["length_info"], spec.page_size, spec.sliding_window)

    if scalars["rotary_mode"] == 1:
        check_positions(q_rope_position, k_rope_pos_offset, kv_lens())
    return {**named, "q": q, "pages": pages, **table, "k_rope_pos_offset": k_rope_pos_offset,
            "q_rope_position": q_rope_position, **scalars,
            **host_mask(spec).check(named, CallLengths(np.diff(table["q_indptr"].astype(np.int64)), kv_lens))}


def page_shape(spec) -> tuple:
    """The shape a paged spec's ``pages`` must have, ``None`` for the page count P (its layout's
    ``page_dims``, mlir/kv_layouts.py)."""
    return kv_shape(spec, spec.layout.page_dims)


def kv_shape(spec, dims: tuple) -> tuple:
    """A KV tensor's shape from its layout's ``dims``: spec fields read, the call's sizes (``P``,
    ``Lk``) None."""
    return tuple(None if dim in ("P", "Lk") else dim if isinstance(dim, int) else getattr(spec, dim) for dim in dims)


def check_mla(spec, named: Mapping) -> dict:
    """Arguments of ``batch_prefill_paged_kv_mla[_sliding_window]`` (§1.3) for a
    ``MlaPagedPrefillSpec``, by name.

    q [Lq, h_q, d_latent + d_rope], q_indptr [B+1] i32, pages [P, page_size, d_latent + d_rope]
    in ``spec.kv_dtype`` or ``dtype``, page_indptr [B+1] i32, page_values [nnz] i32, length_info
    [B] i32 (or [3, B]), causal, sm_scale.
    """
    q = check_tensor("q", named["q"], dtype=spec.dtype, shape=(None, spec.h_q, spec.d_qk))
    pages = check_tensor("pages", named["pages"], dtype=kv_dtype_of(spec), shape=(None, spec.page_size, spec.d_qk))
    table = _check_page_table(spec, q, pages, named)
    return {**named, "q": q, "pages": pages, **table, "causal": check_choice("causal", named["causal"], (0, 1)),
            "sm_scale": check_float("sm_scale", named["sm_scale"])}


# ----------------------------------------------------------------------------- index arrays


def _check_page_table(spec, q, pages, named: Mapping) -> dict:
    """q_indptr [B+1], page_indptr [B+1], page_values [nnz] in [0, P) and length_info [B] or
    [3, B] of ``named`` against checked ``q`` [Lq, ...] and ``pages`` [P, ...]; returns the four
    arrays by name."""
    q_indptr = check_indptr("q_indptr", named["q_indptr"], None, q.shape[0], "Lq (rows of q)")
    batch = q_indptr.shape[0] - 1
    page_values = check_int32("page_values", named["page_values"], shape=(None,))
    page_indptr = check_indptr("page_indptr", named["page_indptr"], batch, page_values.shape[0],
                               "nnz (length of page_values)")
    _check_page_ids(page_values, pages.shape[0])
    shape = (3, batch) if spec.sliding_window else (batch,)
    length_info = check_int32("length_info", named["length_info"], shape=shape)
    check_length_info(length_info, page_indptr, spec.page_size, spec.sliding_window)
    return {"q_indptr": q_indptr, "page_indptr": page_indptr, "page_values": page_values, "length_info": length_info}


def _check_page_ids(page_values: np.ndarray, num_pages: int) -> None:
    """Every page id [nnz] in [0, P)."""
    bad = (page_values < 0) | (page_values >= num_pages)
    if np.any(bad):
        at = int(np.argmax(bad))
        raise InputError(f"page_values: page ids expected in [0, P) = [0, {num_pages}), "
                         f"found {page_values[at]} at index {at}")


def check_length_info(length_info: np.ndarray, page_indptr: np.ndarray, page_size: int,
                       sliding_window: bool) -> None:
    """For every entry with pages: last_page_len in [1, page_size] and, with a sliding window,
    sw_off and sink in [0, phys] where phys = (n_pages - 1) * page_size + last_page_len.

    This keeps the sink rows [0, sink) and the window rows [sw_off, phys) inside the entry's
    pages and the length ``phys - sw_off + sink`` non-negative. Entries with no pages are skipped.
    """
    n_pages = np.diff(page_indptr.astype(np.int64))
    info = length_info.astype(np.int64)
    last = info[0] if sliding_window else info
    element = "length_info[0, {b}]" if sliding_window else "length_info[{b}]"
    _check_entries(f"last_page_len ({element})", n_pages > 0, last, 1, page_size)
    if sliding_window:
        phys = physical_lengths(n_pages, last, page_size)
        _check_entries("sliding-window offset sw_off (length_info[1, {b}])", n_pages > 0, info[1], 0, phys)
        _check_entries("sink length (length_info[2, {b}])", n_pages > 0, info[2], 0, phys)


def _check_entries(what: str, used: np.ndarray, values: np.ndarray, low, high) -> None:
    """``low <= values[b] <= high[b]`` for every entry ``b`` with ``used[b]`` (bounds may be
    per-entry arrays); the error names the first offending entry."""
    high = np.broadcast_to(high, values.shape)
    bad = used & ((values < low) | (values > high))
    if np.any(bad):
        b = int(np.argmax(bad))
        raise InputError(
            f"length_info: {what.format(b=b)} of entry {b} (which has pages) expected in "
            f"[{low}, {int(high[b])}], found {int(values[b])}")


def check_positions(q_rope_position: np.ndarray, k_rope_pos_offset: np.ndarray,
                     kv_len: np.ndarray) -> None:
    """RoPE positions (rotary_mode 1): q_rope_position [Lq] >= 0, k_rope_pos_offset [B] >= 0 and
    k_rope_pos_offset[b] + kv_len[b] <= INT32_MAX, so ``offset + r`` never overflows int32."""
    check_range("q_rope_position", q_rope_position, 0, INT32_MAX)
    check_range("k_rope_pos_offset", k_rope_pos_offset, 0, INT32_MAX)
    last = k_rope_pos_offset.astype(np.int64) + kv_len
    if np.any(last > INT32_MAX):
        b = int(np.argmax(last > INT32_MAX))
        raise InputError(
            f"k_rope_pos_offset: entry {b}: offset + kv_len expected <= {INT32_MAX} (int32), "
            f"found {int(k_rope_pos_offset[b])} + {int(kv_len[b])} = {int(last[b])}")


# ----------------------------------------------------------------------------- scalars


def check_rope_scalars(named: Mapping, dim: int, dim_name: str) -> dict:
    """causal, rotary_mode in {0, 1}; finite float32 scales; with rotary_mode 1 also
    rope_scale > 0, rope_theta > 0 and an even rotated dim ``dim``. Returns the five scalars by
    name."""
    causal = check_choice("causal", named["causal"], (0, 1))
    rotary_mode = check_choice("rotary_mode", named["rotary_mode"], (0, 1))
    rope_scale = check_float("rope_scale", named["rope_scale"])
    rope_theta = check_float("rope_theta", named["rope_theta"])
    sm_scale = check_float("sm_scale", named["sm_scale"])
    if rotary_mode == 1:
        _check_positive("rope_scale", rope_scale)
        _check_positive("rope_theta", rope_theta)
        if dim % 2:
            raise InputError(f"rotary_mode: 1 rotates all {dim_name} = {dim} dims, expected an even "
                             f"{dim_name}, found an odd one")
    return {"causal": causal, "rotary_mode": rotary_mode, "rope_scale": rope_scale, "rope_theta": rope_theta,
            "sm_scale": sm_scale}


def _scalar(name: str, value) -> numbers.Real:
    """A real, non-bool scalar: Python/numpy numbers, 0-d numpy arrays or torch tensors."""
    if not isinstance(value, numbers.Number):
        array = as_array(name, value)
        if array.ndim:
            raise InputError(f"{name}: expected a scalar, got an array of shape {array.shape}")
        value = array[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InputError(f"{name}: expected a real number (not bool), got {type(value).__name__} {value!r}")
    return value


def check_choice(name: str, value, choices: tuple[int, ...]) -> int:
    """An integer scalar (int32 in the ABI) that is one of ``choices``; returned as ``int``."""
    value = _scalar(name, value)
    if not isinstance(value, numbers.Integral):
        raise InputError(f"{name}: expected an integer in {choices}, got {type(value).__name__} {value!r}")
    if int(value) not in choices:
        raise InputError(f"{name}: expected one of {choices}, found {int(value)}")
    return int(value)


def check_float(name: str, value) -> float:
    """A real scalar finite in float32 (float32 in the ABI); returned as ``float``."""
    value = float(_scalar(name, value))
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise InputError(f"{name}: expected a finite float32 value, found {value}")
    return value


def _check_positive(name: str, value: float) -> None:
    if value <= 0:
        raise InputError(f"{name}: expected > 0 with rotary_mode 1, found {value}")


def natural_positions(q_indptr: np.ndarray, kv_lens: np.ndarray, q_rope_position=None,
                      k_rope_pos_offset=None) -> tuple[np.ndarray, np.ndarray]:
    """q_rope_position int32 [Lq] and k_rope_pos_offset int32 [B]: given ones checked for dtype
    and shape, missing ones natural.

    Natural: K row r of entry b at ``k_rope_pos_offset[b] + r`` with offset 0, query row i at
    ``offset + kv_len - qo_len + i`` (aligned bottom-right, like the causal mask). An entry with
    qo_len > kv_len gets the offset ``qo_len - kv_len`` instead of 0, so no position is negative
    (RoPE depends on position differences, which stay the same).
    """
    rows = int(q_indptr[-1])
    qo_lens = np.diff(q_indptr.astype(np.int64))
    if k_rope_pos_offset is None:
        k_off = np.maximum(qo_lens - kv_lens, 0).astype(np.int32)
    else:
        k_off = check_int32("k_rope_pos_offset", k_rope_pos_offset, shape=(len(kv_lens),))
    if q_rope_position is not None:
        return check_int32("q_rope_position", q_rope_position, shape=(rows,)), k_off
    starts = k_off.astype(np.int64) + kv_lens - qo_lens - q_indptr[:-1]
    positions = np.repeat(starts, qo_lens) + np.arange(rows)
    if positions.size and positions.max() > INT32_MAX:
        entry = int(np.searchsorted(q_indptr, int(positions.argmax()), side="right")) - 1
        raise InputError(f"k_rope_pos_offset: entry {entry}'s query positions (offset + kv_len - qo_len + i) "
                         f"reach {int(positions.max())}, beyond int32 ({INT32_MAX})")
    return positions.astype(np.int32), k_off
