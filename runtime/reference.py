"""Float64 numpy reference for every prefill kernel variant (semantics §1–§7 with §11).

Every public function but one mirrors the seed's ABI (§1, §11.1): same argument names and order,
including the different rope-argument orders of the paged and ragged kernels (§9.5). The
exception, :func:`decode_entries`, evaluates the serving passes' own calls (runtime/decode.py),
so that a GPU machine can check them with this file alone.  Instead of
writing into ``output``/``lse`` buffers they return ``(output, lse)`` as float64 arrays:

* ``output`` has the kernel's output shape;
* ``lse`` is the base-2 log-sum-exp of the scaled scores, ``sm_scale`` included:
  ``lse = log2(sum_valid 2^(sm_scale * log2(e) * q.k)) = logsumexp(sm_scale * q.k) / ln 2``.

Decisions of §11 implemented here:

* masked keys weigh exactly 0 (§11.2): the result is the plain softmax over the valid keys;
* a row with no valid key (``kv_len == 0``, causal rows ``row < qo_len - kv_len``, padding rows
  of the masked kernel) gets output exactly 0 and lse exactly :data:`EMPTY_ROW_LSE` (§11.3);
* RoPE follows :mod:`linalg_prefill.runtime.rope` (§11.5), computed in float64;
* sliding window is the seed's ``length_info`` remap with the plain causal mask (§2, §11.7);
* per-head sink logits (``sinks``, the last argument of a ``head_sinks`` call) join each row's
  denominator (§13).

All inputs (float16, bfloat16, float32, float64) are converted to float64 first; nothing is
rounded back to the kernel dtype.  Work is vectorised per batch entry (and per chunk of query rows
to bound memory) with ``numpy.matmul``.

Example
-------
Two query rows against three keys with ``q = 0`` (uniform weights), bottom-right causal: row 0
sees keys 0..1, row 1 sees all three.

>>> import numpy as np
>>> from linalg_prefill.runtime import reference as ref
>>> q = np.zeros((2, 1, 4), np.float32)
>>> k = np.ones((3, 1, 4), np.float32)
>>> v = np.arange(3, dtype=np.float32).reshape(3, 1, 1).repeat(4, axis=-1)
>>> out, lse = ref.batch_prefill_ragged_kv(
...     q, np.array([0, 2]), k, v, np.array([0, 3]), np.zeros(2, int), np.zeros(1, int),
...     1, 0, 1.0, 1e4, 0.5)  # causal, rotary_mode, rope_scale, rope_theta, sm_scale
>>> out[:, 0, 0].tolist(), np.round(lse[:, 0], 6).tolist()
([0.5, 1.0], [1.0, 1.584963])
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .kv_layouts import host_layout
from .rope import apply_rope

__all__ = [
    "EMPTY_ROW_LSE",
    "MASK_MODES",
    "attend",
    "batch_prefill_paged_kv",
    "batch_prefill_ragged_kv",
    "batch_prefill_paged_kv_mla",
    "batch_sequence_prefill_kv",
    "batch_sequence_prefill_kv_masked",
    "decode_entries",
    "merge_state",
]

# The contract's constants, stated here again: this module and rope.py are the oracle, which the
# GPU bundle runs without the package (bench/gpu_bundle.py); tests/test_reference.py checks they
# agree with mlir/specs.py's.
#: lse of a row with no valid key (§11.3); also the "empty state" marker for :func:`merge_state`.
EMPTY_ROW_LSE = -5e4
#: mask modes of :func:`batch_sequence_prefill_kv_masked` (§7).
MASK_MODES = ("padded", "causal_padded_left", "custom")


_LOG2E = 1.0 / math.log(2.0)
# Score elements per chunk of query rows (float64): bounds the temporaries to a few x 32 MiB.
_CHUNK_ELEMS = 1 << 21
# At most this many query rows per chunk, so that causal chunks skip the keys they never see.
_CHUNK_ROWS = 128


def _f64(x: Any) -> np.ndarray:
    """``x`` as float64 (works for ml_dtypes.bfloat16 too): ``x`` itself when it already is, so
    callers must not write into the result."""
    return np.asarray(x, dtype=np.float64)


def _i64(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {a.dtype}")
    return a.astype(np.int64)


# ----------------------------------------------------------------------------- core


def attend(
    q_rows: np.ndarray,
    k_rows: np.ndarray,
    v_rows: np.ndarray,
    valid: np.ndarray,
    sm_scale: float,
    logits_soft_cap: float = 0.0,
    sink: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax attention over the valid keys only, in float64.

    Parameters
    ----------
    q_rows : ``[..., M, d_qk]``
    k_rows : ``[..., N, d_qk]``
    v_rows : ``[..., N, d_v]``
        Leading dims (if any) broadcast against each other as in ``numpy.matmul``.
    valid : bool, broadcastable to ``[..., M, N]``
        ``valid[m, n]``: key ``n`` enters the softmax of query ``m``.  Invalid keys weigh exactly 0.
    sm_scale : float
        Score scale (natural-log domain): ``score = sm_scale * q.k``.
    logits_soft_cap : float
        When > 0, ``score = cap * tanh(sm_scale * q.k / cap)`` (Gemma 2's logit soft-capping),
        applied before the mask.
    sink : broadcastable to ``[..., M]``, optional
        Each row's sink logit (natural log, §13): ``e^sink`` joins the denominator of a row with a
        valid key, ``out = sum_n e^(s_n) v_n / (e^sink + sum_n e^(s_n))`` and ``lse =
        log2(e^sink + sum_n e^(s_n))``.  A row with no valid key stays 0 and -5e4.

    Returns
    -------
    out : float64 ``[..., M, d_v]``
        ``sum_n p[m, n] v[n]`` with ``p`` the softmax of the valid scores; exactly 0 for a row
        with no valid key.
    lse : float64 ``[..., M]``
        ``log2(sum_valid 2^(score * log2 e))``; exactly :data:`EMPTY_ROW_LSE` for a row with no
        valid key.
    """
    q = _f64(q_rows)
    k = _f64(k_rows)
    v = _f64(v_rows)
    s = np.matmul(q, np.swapaxes(k, -1, -2))
    if s.shape[-1] == 0:
        return np.zeros(s.shape[:-1] + (v.shape[-1],)), np.full(s.shape[:-1], EMPTY_ROW_LSE)
    if logits_soft_cap > 0:
        cap = float(logits_soft_cap)
        s = cap * _LOG2E * np.tanh(s * (float(sm_scale) / cap))
    else:
        s *= float(sm_scale) * _LOG2E
    valid = np.broadcast_to(np.asarray(valid, dtype=bool), s.shape)
    np.copyto(s, -np.inf, where=~valid)
    has = valid.any(axis=-1)
    m = np.where(has, s.max(axis=-1), 0.0)
    s -= m[..., None]
    if sink is not None:  # the larger of the row's max and its sink (log2 units) is the base
        sink2 = np.broadcast_to(np.asarray(sink, np.float64) * _LOG2E, m.shape)
        top = np.where(has, np.maximum(m, sink2), 0.0)
        s -= (top - m)[..., None]
        m = top
    p = np.exp2(s, out=s)  # exp2(-inf) == 0: masked keys weigh exactly 0
    d = np.where(has, p.sum(axis=-1), 1.0)
    if sink is not None:
        d += np.where(has, np.exp2(sink2 - m), 0.0)
    out = np.matmul(p, v)
    out /= d[..., None]
    lse = np.where(has, m + np.log2(d), EMPTY_ROW_LSE)
    return out, lse


def _attend_heads(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, valid: np.ndarray, sm_scale: float, logits_soft_cap: float = 0.0,
    sinks: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """GQA attention of one batch entry.

    ``q [M, h_q, d_qk]``, ``k [N, h_kv, d_qk]``, ``v [N, h_kv, d_v]``, ``valid [M, N]``; query
    head ``h`` reads KV head ``h // (h_q // h_kv)``; ``sinks [h_q]`` (natural log, §13) or None.
    Returns ``out [M, h_q, d_v]`` and ``lse [M, h_q]``.
    """
    m_rows, h_q, d_qk = q.shape
    n_rows, h_kv, _ = k.shape
    d_v = v.shape[-1]
    g = h_q // h_kv
    out = np.zeros((m_rows, h_q, d_v))
    lse = np.full((m_rows, h_q), EMPTY_ROW_LSE)
    if m_rows == 0:
        return out, lse
    kh = np.ascontiguousarray(_f64(k).transpose(1, 0, 2))  # [h_kv, N, d_qk]
    vh = np.ascontiguousarray(_f64(v).transpose(1, 0, 2))  # [h_kv, N, d_v]
    # q head h = kv * g + j  ->  [h_kv, g, M, d]
    qh = _f64(q).transpose(1, 0, 2).reshape(h_kv, g, m_rows, d_qk)
    step = max(1, min(_CHUNK_ROWS, _CHUNK_ELEMS // max(1, h_q * n_rows)))
    for a in range(0, m_rows, step):
        b = min(m_rows, a + step)
        mc = b - a
        # Only the span of columns that some row of the chunk attends to (trims causal work).
        cols = np.flatnonzero(valid[a:b].any(axis=0))
        if cols.size == 0:
            continue  # every row of the chunk is empty: out 0, lse EMPTY_ROW_LSE
        c0, c1 = int(cols[0]), int(cols[-1]) + 1
        qc = qh[:, :, a:b].reshape(h_kv, g * mc, d_qk)
        vc = np.tile(valid[a:b, c0:c1], (g, 1))[None]  # [1, g*mc, c1-c0]
        # row j * mc + i of KV head h is query head h * g + j
        sc = None if sinks is None else np.repeat(_f64(sinks).reshape(h_kv, g), mc, axis=1)
        o, s = attend(qc, kh[:, c0:c1], vh[:, c0:c1], vc, sm_scale, logits_soft_cap, sc)
        out[a:b] = o.reshape(h_q, mc, d_v).transpose(1, 0, 2)
        lse[a:b] = s.reshape(h_q, mc).T
    return out, lse


def _causal_valid(qo_len: int, kv_len: int, causal: int) -> np.ndarray:
    """``valid [qo_len, kv_len]`` of §3: bottom-right causal when ``causal > 0``, else all keys."""
    if causal > 0:
        rows = np.arange(qo_len)[:, None]
        cols = np.arange(kv_len)[None, :]
        return cols <= rows + (kv_len - qo_len)
    return np.ones((qo_len, kv_len), dtype=bool)


# ----------------------------------------------------------------------------- validation


def _entry_valid(qo_len: int, kv_len: int, causal: int, custom_mask, mask_indptr, b: int) -> np.ndarray:
    """``valid [qo_len, kv_len]`` of entry ``b``: its block of ``custom_mask`` (§14: from
    ``mask_indptr[b]``, row-major, non-zero = visible; ``causal`` ignored) when one is given,
    else :func:`_causal_valid`."""
    if custom_mask is None:
        return _causal_valid(qo_len, kv_len, causal)
    start = int(np.asarray(mask_indptr)[b])
    block = np.asarray(custom_mask).reshape(-1)[start:start + qo_len * kv_len]
    if block.size != qo_len * kv_len:
        raise ValueError(f"custom_mask: entry {b} needs {qo_len * kv_len} elements from {start}, found {block.size}")
    return block.reshape(qo_len, kv_len) != 0


def _check_heads(h_q: int, h_kv: int) -> None:
    if h_kv <= 0 or h_q % h_kv != 0:
        raise ValueError(f"h_q ({h_q}) must be a positive multiple of h_kv ({h_kv})")


def _check_rotary_mode(rotary_mode: int) -> bool:
    if int(rotary_mode) != rotary_mode or int(rotary_mode) not in (0, 1):
        raise ValueError(f"rotary_mode must be 0 or 1, got {rotary_mode!r}")
    return int(rotary_mode) == 1


def _check_indptr(name: str, indptr: np.ndarray, total: int, batch: int | None = None) -> None:
    if indptr.ndim != 1 or indptr.shape[0] < 1:
        raise ValueError(f"{name} must be a 1-D array of length batch_size + 1")
    if batch is not None and indptr.shape[0] != batch + 1:
        raise ValueError(f"{name} has length {indptr.shape[0]}, expected batch_size + 1 = {batch + 1}")
    if indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] != total:
        raise ValueError(f"{name} must start at 0, be non-decreasing and end at {total}: {indptr}")


def _check_rank(name: str, x: np.ndarray, rank: int) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {x.shape}")


def _page_slots(
    b: int,
    page_indptr: np.ndarray,
    page_values: np.ndarray,
    length_info: np.ndarray,
    page_size: int,
    num_pages: int,
    sliding_window: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Physical ``(page, slot)`` of every logical KV row of entry ``b`` (§1.1, §2).

    Returns two int arrays of length ``kv_len_b``.
    """
    p0, p1 = int(page_indptr[b]), int(page_indptr[b + 1])
    n_pages = p1 - p0
    empty = np.zeros(0, dtype=np.int64)
    if n_pages == 0:
        return empty, empty
    if sliding_window:
        last, sw_off, sink = (int(length_info[i, b]) for i in range(3))
    else:
        last, sw_off, sink = int(length_info[b]), 0, 0
    if not 1 <= last <= page_size:
        raise ValueError(f"length_info: last_page_len {last} of entry {b} not in [1, {page_size}]")
    phys_len = (n_pages - 1) * page_size + last
    kv_len = phys_len - sw_off + sink
    if sw_off < 0 or sink < 0 or kv_len < 0:
        raise ValueError(
            f"length_info: entry {b} has sliding-window offset {sw_off}, sink {sink} "
            f"and physical length {phys_len}, giving kv_len {kv_len}"
        )
    r = np.arange(kv_len, dtype=np.int64)
    phys = np.where(r < sink, r, r - sink + sw_off) if sliding_window else r
    if kv_len and (phys.min() < 0 or phys.max() >= phys_len):
        raise ValueError(f"length_info: entry {b} maps KV rows outside its {phys_len} slots")
    pages_of_entry = page_values[p0:p1]
    if np.any(pages_of_entry < 0) or np.any(pages_of_entry >= num_pages):
        raise ValueError(f"page_values of entry {b} outside [0, {num_pages}): {pages_of_entry}")
    return pages_of_entry[phys // page_size], phys % page_size


def _check_paged_common(q_indptr, page_indptr, page_values, length_info, total_len, sliding_window):
    batch = q_indptr.shape[0] - 1
    _check_indptr("q_indptr", q_indptr, total_len)
    _check_indptr("page_indptr", page_indptr, page_values.shape[0], batch)
    expected = (3, batch) if sliding_window else (batch,)
    if length_info.shape != expected:
        raise ValueError(f"length_info must have shape {expected}, got {length_info.shape}")
    return batch


# ----------------------------------------------------------------------------- variants


def batch_prefill_paged_kv(
    q: np.ndarray,
    q_indptr: np.ndarray,
    pages: np.ndarray,
    page_indptr: np.ndarray,
    page_values: np.ndarray,
    length_info: np.ndarray,
    k_rope_pos_offset: np.ndarray,
    q_rope_position: np.ndarray,
    causal: int,
    rotary_mode: int,
    rope_scale: float,
    rope_theta: float,
    sm_scale: float,
    sinks: np.ndarray | None = None,
    custom_mask: np.ndarray | None = None,
    mask_indptr: np.ndarray | None = None,
    *,
    rope_scaling: Mapping[str, Any] | None = None,
    sliding_window: bool = False,
    logits_soft_cap: float = 0.0,
    rotary_dim: int | None = None,
    kv_order: str = "hnd",
) -> tuple[np.ndarray, np.ndarray]:
    """Paged-KV prefill (``batch_prefill_paged_kv[_sliding_window]``, §1.1).

    Parameters
    ----------
    q : ``[total_len, h_q, d]``
    q_indptr : int ``[B + 1]``
        Entry ``b`` owns query rows ``[q_indptr[b], q_indptr[b + 1])``.
    pages : ``[max_num_pages, 2, h_kv, page_size, d]``
        Dim 1: 0 = K, 1 = V.  ``page_size = pages.shape[3]``. With ``kv_order="nhd"``:
        ``[max_num_pages, 2, page_size, h_kv, d]``.
    page_indptr : int ``[B + 1]``
    page_values : int ``[nnz_pages]``
        Physical page ids of each entry in logical order.
    length_info : int ``[B]`` (``last_page_len``) or ``[3, B]`` with ``sliding_window``
        (``last_page_len``, sliding-window offset, sink length; §2).
    k_rope_pos_offset : int ``[B]``
        RoPE position of logical KV row 0 of each entry.
    q_rope_position : int ``[total_len]``
    causal : int
        ``> 0``: bottom-right causal mask (§3); else every KV row is valid. Ignored with a
        ``custom_mask``.
    rotary_mode : int
        1: RoPE on Q (at ``q_rope_position``) and K (at ``k_rope_pos_offset[b] + r``), 0: none.
    rope_scale, rope_theta, sm_scale : float
    sinks : ``[h_q]``, optional
        Per-head sink logits (``head_sinks``, §13); the same for every variant.
    custom_mask : bool or uint8 ``[sum of qo_len * kv_len]``, optional
        Entry ``b``'s ``qo_len x kv_len`` block from ``mask_indptr[b]``, row-major over its
        logical KV rows (after the window remap); non-zero: the query sees the key (§14). Pass
        it and ``mask_indptr`` by name: the kernel's call puts them before ``sinks``.
    mask_indptr : int ``[B + 1]``, optional
    rope_scaling : dict, optional
        Compile-time RoPE scaling (see :mod:`linalg_prefill.runtime.rope`).
    sliding_window : bool
        Use the ``[3, B]`` ``length_info`` remap.
    kv_order : ``"hnd"`` or ``"nhd"``
        Where a page keeps its heads (``PagedPrefillSpec.kv_order``).

    Returns
    -------
    output : float64 ``[total_len, h_q, d]``
    lse : float64 ``[total_len, h_q]`` (base 2, ``sm_scale`` included)
    """
    q = np.asarray(q)
    pages = np.asarray(pages)
    _check_rank("q", q, 3)
    _check_rank("pages", pages, 5)
    if kv_order not in ("hnd", "nhd"):
        raise ValueError(f"kv_order must be 'hnd' or 'nhd', got {kv_order!r}")
    if kv_order == "nhd":
        pages = pages.transpose(0, 1, 3, 2, 4)
    total_len, h_q, d = q.shape
    num_pages, two, h_kv, page_size, d_kv = pages.shape
    if two != 2 or d_kv != d:
        raise ValueError(f"pages must be [max_num_pages, 2, h_kv, page_size, {d}], got {pages.shape}")
    _check_heads(h_q, h_kv)
    rotary = _check_rotary_mode(rotary_mode)
    q_indptr = _i64(q_indptr, "q_indptr")
    page_indptr = _i64(page_indptr, "page_indptr")
    page_values = _i64(page_values, "page_values")
    length_info = _i64(length_info, "length_info")
    batch = _check_paged_common(q_indptr, page_indptr, page_values, length_info, total_len, sliding_window)
    if rotary:
        k_rope_pos_offset = _i64(k_rope_pos_offset, "k_rope_pos_offset")
        q_rope_position = _i64(q_rope_position, "q_rope_position")
    rope_kw = dict(rope_theta=rope_theta, rope_scale=rope_scale, rope_scaling=rope_scaling, rotary_dim=rotary_dim)

    out = np.zeros((total_len, h_q, d))
    lse = np.full((total_len, h_q), EMPTY_ROW_LSE)
    for b in range(batch):
        q0, q1 = int(q_indptr[b]), int(q_indptr[b + 1])
        page, slot = _page_slots(b, page_indptr, page_values, length_info, page_size, num_pages, sliding_window)
        if q1 == q0:
            continue
        kv_len = page.shape[0]
        kv = _f64(pages[page, :, :, slot, :])  # [kv_len, 2, h_kv, d]
        k, v = kv[:, 0], kv[:, 1]
        qb = _f64(q[q0:q1])
        if rotary:
            qb = apply_rope(qb, q_rope_position[q0:q1], **rope_kw)
            k = apply_rope(k, k_rope_pos_offset[b] + np.arange(kv_len), **rope_kw)
        valid = _entry_valid(q1 - q0, kv_len, int(causal), custom_mask, mask_indptr, b)
        out[q0:q1], lse[q0:q1] = _attend_heads(qb, k, v, valid, sm_scale, logits_soft_cap, sinks)
    return out, lse


def batch_prefill_ragged_kv(
    q: np.ndarray,
    q_indptr: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    kv_indptr: np.ndarray,
    q_rope_position: np.ndarray,
    k_rope_pos_offset: np.ndarray,
    causal: int,
    rotary_mode: int,
    rope_scale: float,
    rope_theta: float,
    sm_scale: float,
    sinks: np.ndarray | None = None,
    custom_mask: np.ndarray | None = None,
    mask_indptr: np.ndarray | None = None,
    *,
    rope_scaling: Mapping[str, Any] | None = None,
    logits_soft_cap: float = 0.0,
    rotary_dim: int | None = None,
    kv_order: str = "nhd",
) -> tuple[np.ndarray, np.ndarray]:
    """Ragged-KV prefill (``batch_prefill_ragged_kv``, §1.2).  Note ``q_rope_position`` comes
    before ``k_rope_pos_offset`` here (§9.5).

    Parameters
    ----------
    q : ``[Lq, h_q, d_qk]``
    q_indptr : int ``[B + 1]``
    k : ``[Lk, h_kv, d_qk]``
    v : ``[Lk, h_kv, d_v]``
        ``d_v`` may differ from ``d_qk``.
    kv_indptr : int ``[B + 1]``
        KV row ``r`` of entry ``b`` is ``k/v[kv_indptr[b] + r]``.
    q_rope_position : int ``[Lq]``
    k_rope_pos_offset : int ``[B]``
    causal, rotary_mode : int
        As :func:`batch_prefill_paged_kv`; RoPE rotates all ``d_qk`` dims of Q and K.
    rope_scale, rope_theta, sm_scale : float
    custom_mask, mask_indptr : optional
        As :func:`batch_prefill_paged_kv` (§14).
    rope_scaling : dict, optional
    kv_order : ``"nhd"`` or ``"hnd"``
        ``"hnd"``: k and v head-major, ``[h_kv, Lk, d]`` (``RaggedPrefillSpec.kv_order``).

    Returns
    -------
    output : float64 ``[Lq, h_q, d_v]``
    lse : float64 ``[Lq, h_q]``
    """
    if kv_order not in ("nhd", "hnd"):
        raise ValueError(f"kv_order must be 'nhd' or 'hnd', got {kv_order!r}")
    if kv_order == "hnd":
        k, v = (np.asarray(x).transpose(1, 0, 2) for x in (k, v))
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_rank(name, x, 3)
    total_q, h_q, d_qk = q.shape
    total_kv, h_kv, d_k = k.shape
    if d_k != d_qk or v.shape[:2] != (total_kv, h_kv):
        raise ValueError(f"k {k.shape} / v {v.shape} do not match q {q.shape}")
    d_v = v.shape[2]
    _check_heads(h_q, h_kv)
    rotary = _check_rotary_mode(rotary_mode)
    q_indptr = _i64(q_indptr, "q_indptr")
    kv_indptr = _i64(kv_indptr, "kv_indptr")
    batch = q_indptr.shape[0] - 1
    _check_indptr("q_indptr", q_indptr, total_q)
    _check_indptr("kv_indptr", kv_indptr, total_kv, batch)
    if rotary:
        k_rope_pos_offset = _i64(k_rope_pos_offset, "k_rope_pos_offset")
        q_rope_position = _i64(q_rope_position, "q_rope_position")
    rope_kw = dict(rope_theta=rope_theta, rope_scale=rope_scale, rope_scaling=rope_scaling, rotary_dim=rotary_dim)

    out = np.zeros((total_q, h_q, d_v))
    lse = np.full((total_q, h_q), EMPTY_ROW_LSE)
    for b in range(batch):
        q0, q1 = int(q_indptr[b]), int(q_indptr[b + 1])
        k0, k1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
        if q1 == q0:
            continue
        qb, kb, vb = _f64(q[q0:q1]), _f64(k[k0:k1]), _f64(v[k0:k1])
        if rotary:
            qb = apply_rope(qb, q_rope_position[q0:q1], **rope_kw)
            kb = apply_rope(kb, k_rope_pos_offset[b] + np.arange(k1 - k0), **rope_kw)
        valid = _entry_valid(q1 - q0, k1 - k0, int(causal), custom_mask, mask_indptr, b)
        out[q0:q1], lse[q0:q1] = _attend_heads(qb, kb, vb, valid, sm_scale, logits_soft_cap, sinks)
    return out, lse


def batch_prefill_paged_kv_mla(
    q: np.ndarray,
    q_indptr: np.ndarray,
    pages: np.ndarray,
    page_indptr: np.ndarray,
    page_values: np.ndarray,
    length_info: np.ndarray,
    causal: int,
    sm_scale: float,
    sinks: np.ndarray | None = None,
    *,
    d_latent: int,
    sliding_window: bool = False,
    logits_soft_cap: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Paged MLA prefill over a latent cache (``batch_prefill_paged_kv_mla[_sliding_window]``, §1.3).

    One shared KV head; no RoPE (the rope part of Q and of the cache is already rotated).

    Parameters
    ----------
    q : ``[total_len, h_q, d_latent + d_rope]``
        Absorbed query (latent part, then rope part).
    q_indptr : int ``[B + 1]``
    pages : ``[max_num_pages, page_size, d_latent + d_rope]``
        K of a row is the whole row; V is its first ``d_latent`` columns.
    page_indptr, page_values, length_info :
        As :func:`batch_prefill_paged_kv` (``length_info`` ``[3, B]`` with ``sliding_window``).
    causal : int
    sm_scale : float
    d_latent : int
        Keyword-only: number of latent (value) columns.
    sliding_window : bool

    Returns
    -------
    output : float64 ``[total_len, h_q, d_latent]``
    lse : float64 ``[total_len, h_q]``
    """
    q = np.asarray(q)
    pages = np.asarray(pages)
    _check_rank("q", q, 3)
    _check_rank("pages", pages, 3)
    total_len, h_q, d_qk = q.shape
    num_pages, page_size, d_row = pages.shape
    if d_row != d_qk or not 0 < d_latent <= d_qk:
        raise ValueError(f"pages {pages.shape} / d_latent {d_latent} do not match q {q.shape}")
    q_indptr = _i64(q_indptr, "q_indptr")
    page_indptr = _i64(page_indptr, "page_indptr")
    page_values = _i64(page_values, "page_values")
    length_info = _i64(length_info, "length_info")
    batch = _check_paged_common(q_indptr, page_indptr, page_values, length_info, total_len, sliding_window)

    out = np.zeros((total_len, h_q, d_latent))
    lse = np.full((total_len, h_q), EMPTY_ROW_LSE)
    for b in range(batch):
        q0, q1 = int(q_indptr[b]), int(q_indptr[b + 1])
        page, slot = _page_slots(b, page_indptr, page_values, length_info, page_size, num_pages, sliding_window)
        if q1 == q0:
            continue
        rows = _f64(pages[page, slot])[:, None, :]  # [kv_len, 1, d_qk]
        valid = _causal_valid(q1 - q0, rows.shape[0], int(causal))
        out[q0:q1], lse[q0:q1] = _attend_heads(q[q0:q1], rows, rows[..., :d_latent], valid, sm_scale, logits_soft_cap,
                                               sinks)
    return out, lse


def _check_dense(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_rank(name, x, 4)
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: expected [B, L, h, d] with matching B, d")
    _check_heads(q.shape[2], k.shape[2])


def batch_sequence_prefill_kv(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    sinks: np.ndarray | None = None,
    *,
    causal: int,
    sm_scale: float,
    logits_soft_cap: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Dense batched prefill (``batch_sequence_prefill_kv``, §1.4); no RoPE.

    Parameters
    ----------
    q : ``[B, qo_len, h_q, d]``
    k, v : ``[B, kv_len, h_kv, d]``
    causal : int or bool
        Bottom-right causal mask when true (``qo_len`` may differ from ``kv_len``).
    sm_scale : float

    Returns
    -------
    output : float64 ``[B, qo_len, h_q, d]``
    lse : float64 ``[B, qo_len, h_q]``
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    _check_dense(q, k, v)
    valid = _causal_valid(q.shape[1], k.shape[1], int(causal))
    return _attend_entries(q, k, v, lambda _b: valid, sm_scale, logits_soft_cap, sinks)


def _attend_entries(q, k, v, valid_of, sm_scale: float, logits_soft_cap: float,
                    sinks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each dense entry ``b`` attended with its mask ``valid_of(b)`` [qo_len, kv_len]."""
    batch, qo_len, h_q, d = q.shape
    out = np.zeros((batch, qo_len, h_q, d))
    lse = np.full((batch, qo_len, h_q), EMPTY_ROW_LSE)
    for b in range(batch):
        out[b], lse[b] = _attend_heads(q[b], k[b], v[b], valid_of(b), sm_scale, logits_soft_cap, sinks)
    return out, lse


def _masked_valid(qo_len: int, kv_len: int, valid_len: int, mask_mode: str) -> np.ndarray:
    """``valid [qo_len, kv_len]`` of §7; padding query rows are all False."""
    rows = np.arange(qo_len)[:, None]
    cols = np.arange(kv_len)[None, :]
    if mask_mode == "padded":
        return (rows < valid_len) & (cols < valid_len)
    # causal_padded_left
    return (rows >= qo_len - valid_len) & (cols >= kv_len - valid_len) & (cols <= rows + (kv_len - qo_len))


def batch_sequence_prefill_kv_masked(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    valid_lens: np.ndarray | None = None,
    sinks: np.ndarray | None = None,
    custom_mask: np.ndarray | None = None,
    *,
    mask_mode: str,
    sm_scale: float,
    logits_soft_cap: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Dense batched prefill with a per-entry valid length (``batch_sequence_prefill_kv_masked``, §7).

    Parameters
    ----------
    q : ``[B, qo_len, h_q, d]``
    k, v : ``[B, kv_len, h_kv, d]``
    valid_lens : int ``[B]``
        In ``[0, min(qo_len, kv_len)]``, with the padded mask modes.
    custom_mask : ``[B, qo_len, kv_len]``
        With ``mask_mode="custom"`` (non-zero: the query sees the key, §14).
    mask_mode : ``"padded"``, ``"causal_padded_left"`` or ``"custom"``
        ``"padded"``: right padding, bidirectional; query row ``i`` and key ``j`` are valid when
        ``i, j < valid_len``.  ``"causal_padded_left"``: left padding; valid query suffix and KV
        suffix of length ``valid_len`` aligned bottom-right, causal inside.
    sm_scale : float

    Returns
    -------
    output : float64 ``[B, qo_len, h_q, d]``
        Padding query rows are exactly 0.
    lse : float64 ``[B, qo_len, h_q]``
        Padding query rows are exactly :data:`EMPTY_ROW_LSE`.
    """
    if mask_mode not in MASK_MODES:
        raise ValueError(f"mask_mode must be one of {MASK_MODES}, got {mask_mode!r}")
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    _check_dense(q, k, v)
    batch, qo_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
    if mask_mode == "custom":
        if custom_mask is None:
            raise ValueError('mask_mode "custom" needs custom_mask [B, qo_len, kv_len]')
        custom_mask = np.asarray(custom_mask)
        if custom_mask.shape != (batch, qo_len, kv_len):
            raise ValueError(f"custom_mask must have shape ({batch}, {qo_len}, {kv_len}), got {custom_mask.shape}")
        return _attend_entries(q, k, v, lambda b: custom_mask[b] != 0, sm_scale, logits_soft_cap)
    if valid_lens is None:
        raise ValueError(f"mask_mode {mask_mode!r} needs valid_lens [B]")
    valid_lens = _i64(valid_lens, "valid_lens")
    if valid_lens.shape != (batch,):
        raise ValueError(f"valid_lens must have shape ({batch},), got {valid_lens.shape}")
    if np.any(valid_lens < 0) or np.any(valid_lens > min(qo_len, kv_len)):
        raise ValueError(f"valid_lens must lie in [0, {min(qo_len, kv_len)}]: {valid_lens}")
    return _attend_entries(q, k, v, lambda b: _masked_valid(qo_len, kv_len, int(valid_lens[b]), mask_mode),
                           sm_scale, logits_soft_cap, sinks)


def decode_entries(q: np.ndarray, *kv_and_plan: Any, kv_layout: str, group_size: int, block: int, d_v: int,
                   sliding_window: bool = False, logits_soft_cap: float = 0.0,
                   head_sinks: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """One call of a serving pass (``decode_entries`` of mlir/decode.py and mlir/fused_decode.py).

    ``q [n, h_kv, R, d_qk]`` (row ``t * G + g``: token t, query head ``h * G + g``, G =
    ``group_size``), then the KV sources of ``kv_layout`` (``"paged"``: pages [P, 2, h_kv, block,
    d]; ``"latent"``: MLA's pages [P, block, d_qk] whose first ``d_v`` columns are the values;
    ``"ragged"``: k [N, h_kv, d_qk], v [N, h_kv, d_v]), ``table [n, c, P]`` (c chunks of P blocks: a
    page id, or for ragged the first row of a block of ``block`` rows), ``geometry [n, 4]`` (kv_len, sink, window_offset, qo_len), ``causal``,
    ``sm_scale``. Logical KV row c of entry i is physical row ``c`` (``c - sink + window_offset``
    past the sink with ``sliding_window``), found through the table; token t sees c when
    ``c < kv_len`` and, if causal, ``c <= kv_len - qo_len + t`` (every token, the padding ones
    past qo_len too). With ``head_sinks`` the call ends with ``sinks [h_q]`` (§13). Returns
    ``output [n, h_kv, R, d_v]`` and ``lse [n, h_kv, R]``.
    """
    layout = host_layout(kv_layout)
    sinks = kv_and_plan[-1] if head_sinks else None
    *sources, table, geometry, causal, sm_scale = kv_and_plan[:len(kv_and_plan) - int(head_sinks)]
    n, h_kv, rows, d_qk = q.shape
    table = np.asarray(table).reshape(n, -1)
    group = group_size
    queries = rows // group
    out = np.zeros((n, h_kv, rows, d_v))
    lse = np.full((n, h_kv, rows), EMPTY_ROW_LSE)
    for i in range(n):
        kv_len, sink, offset, qo_len = (int(x) for x in geometry[i])
        c = np.arange(kv_len)
        physical = np.where(c < sink, c, c - sink + offset) if sliding_window else c
        k, v = layout.pass_entry_kv(sources, table[i], physical, block, d_v)
        tokens = np.arange(queries)[:, None]
        valid = np.ones((queries, kv_len), bool) if not causal else c[None] <= kv_len - qo_len + tokens
        q_tokens = _f64(q[i]).reshape(h_kv, queries, group, d_qk).transpose(1, 0, 2, 3).reshape(queries, -1, d_qk)
        o, s = _attend_heads(q_tokens, k, v, valid, sm_scale, logits_soft_cap, sinks)
        out[i] = o.reshape(queries, h_kv, group, d_v).transpose(1, 0, 2, 3).reshape(h_kv, rows, d_v)
        lse[i] = s.reshape(queries, h_kv, group).transpose(1, 0, 2).reshape(h_kv, rows)
    return out, lse


def merge_state(
    v_a: np.ndarray, s_a: np.ndarray, v_b: np.ndarray, s_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Merge two partial attention states in base 2 (§1.6).

    Parameters
    ----------
    v_a, v_b : ``[..., d]``
        Partial outputs (each normalised over its own keys).
    s_a, s_b : ``[...]``
        Their base-2 lse.  A state with ``s <= EMPTY_ROW_LSE`` (or ``-inf``) is empty and gets
        weight exactly 0, whatever its output.

    Returns
    -------
    v : float64 ``[..., d]``
        ``(w_a v_a + w_b v_b) / (w_a + w_b)`` with ``w_i = 2^(s_i - max(s_a, s_b))``.
    s : float64 ``[...]``
        ``max(s_a, s_b) + log2(w_a + w_b)``.  Two empty states merge to output 0 and lse
        exactly :data:`EMPTY_ROW_LSE`; no NaN is produced.
    """
    v_a, v_b = _f64(v_a), _f64(v_b)
    s_a, s_b = _f64(s_a), _f64(s_b)
    empty_a = s_a <= EMPTY_ROW_LSE
    empty_b = s_b <= EMPTY_ROW_LSE
    both = empty_a & empty_b
    s_max = np.maximum(np.where(empty_a, -np.inf, s_a), np.where(empty_b, -np.inf, s_b))
    s_max = np.where(both, 0.0, s_max)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        w_a = np.where(empty_a, 0.0, np.exp2(np.where(empty_a, 0.0, s_a) - s_max))
        w_b = np.where(empty_b, 0.0, np.exp2(np.where(empty_b, 0.0, s_b) - s_max))
    w = np.where(both, 1.0, w_a + w_b)
    v = (w_a[..., None] * np.where(empty_a[..., None], 0.0, v_a) + w_b[..., None] * np.where(empty_b[..., None], 0.0, v_b)) / w[..., None]
    s = np.where(both, EMPTY_ROW_LSE, s_max + np.log2(w))
    return v, s
