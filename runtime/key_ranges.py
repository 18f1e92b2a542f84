"""Attention whose every query sees one contiguous range of keys, as calls of the paged kernel.

A causal, padded, sliding-window or block-diagonal mask (what transformers builds for decoder
models) gives each query row a range of keys ``[lo, hi)``. :func:`key_ranges` reads those ranges
off a boolean mask (None for a mask with holes) or :func:`rule_ranges` derives them from the
causal and window rules, :func:`plan_entries` groups consecutive queries into the paged kernel's
entries, and :func:`paged_arguments` writes the entries' page table over a paged copy of the keys:

* queries ``s..e-1`` of one batch row share an entry when they share ``lo`` and ``hi`` grows by
  one per query (a causal staircase, bottom-right aligned: semantics §3), optionally after rows
  that see no key (left padding); an entry's keys are ``[lo, hi_last)``;
* any other query is an entry of its own (a decode-shaped entry: the serving pass runs all of
  them in one call), so per-query windows and right-padding rows are exact;
* an entry is a window into its batch row's pages: its pages from ``lo // page_size`` to
  ``(hi - 1) // page_size``, ``sw_off = lo % page_size`` (the sliding-window variant's
  ``length_info``, no sink rows), so no key is copied twice, however the entries overlap.

Everything here is host-side numpy over int64 index arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np



@dataclass(frozen=True)
class Entries:
    """Consecutive query groups of a flattened ``[B * S_q]`` query axis.

    ``q_indptr`` int32 ``[n + 1]`` (the groups), ``batch`` int64 ``[n]`` (the batch row of each),
    ``lo`` / ``hi`` int64 ``[n]``: the keys of each entry, ``hi <= lo`` for an entry whose
    queries see no key (its output is 0).
    """

    q_indptr: np.ndarray
    batch: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    def __len__(self) -> int:
        return len(self.batch)


def key_ranges(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(lo, hi)`` int64 ``[B, S_q]``: the key range each query row of a boolean ``mask
    [B, S_q, S_kv]`` allows (``hi == lo`` where it allows none); None when a row allows keys that
    are not one contiguous range (a mask with holes: a tree or a per-pair mask, which needs the
    custom-mask kernels, semantics §14)."""
    batch, q_len, kv_len = mask.shape
    counts = mask.sum(axis=-1, dtype=np.int64)
    lo = np.argmax(mask, axis=-1).astype(np.int64)
    hi = kv_len - np.argmax(mask[..., ::-1], axis=-1).astype(np.int64)
    empty = counts == 0
    lo[empty], hi[empty] = 0, 0
    if np.any(~empty & (hi - lo != counts)):
        return None
    return lo, hi


def rule_ranges(batch: int, q_len: int, kv_len: int, *, causal: bool, window: int | None) -> tuple:
    """``(lo, hi)`` int64 ``[B, S_q]`` without a mask: query ``i`` sits at key ``kv_len - q_len + i``
    (bottom-right), sees keys up to it when ``causal`` (all otherwise), and the ``window`` keys
    ending there when a window is given (transformers' ``sliding_window``: ``i - window < j <= i``)."""
    diagonal = kv_len - q_len + np.arange(q_len, dtype=np.int64)
    hi = np.minimum(diagonal + 1, kv_len) if causal else np.full(q_len, kv_len, np.int64)
    lo = np.maximum(diagonal - window + 1, 0) if window else np.zeros(q_len, np.int64)
    hi = np.maximum(hi, 0)
    lo = np.minimum(lo, hi)
    return np.broadcast_to(lo, (batch, q_len)).copy(), np.broadcast_to(hi, (batch, q_len)).copy()


def plan_entries(lo: np.ndarray, hi: np.ndarray) -> Entries:
    """Groups the queries of ``lo, hi [B, S_q]`` into entries (module docstring)."""
    batch, q_len = lo.shape
    lo, hi = lo.reshape(-1), hi.reshape(-1)
    seen = hi > lo
    start = np.zeros(lo.shape, bool)
    start[::q_len] = True  # every batch row starts an entry
    prev_seen, prev_lo, prev_hi = np.roll(seen, 1), np.roll(lo, 1), np.roll(hi, 1)
    staircase = seen & prev_seen & (lo == prev_lo) & (hi == prev_hi + 1)
    after_empty = seen & ~prev_seen & (hi == lo + 1)  # the diagonal leaves the empty rows here
    still_empty = ~seen & ~prev_seen
    start |= ~(staircase | after_empty | still_empty)
    first = np.flatnonzero(start)
    last = np.append(first[1:], lo.size) - 1
    return Entries(q_indptr=np.append(first, lo.size).astype(np.int32), batch=first // q_len,
                   lo=lo[last], hi=np.where(seen[last], hi[last], lo[last]))


def paged_arguments(entries: Entries, pages_per_row: int, page_size: int) -> tuple:
    """``(page_indptr [n+1], page_values [nnz], length_info [3, n])`` int32 for the paged kernel's
    sliding-window variant over pages numbered ``b * pages_per_row + p`` (batch row ``b``, its
    ``p``-th page): each entry reads pages ``lo // page_size .. (hi - 1) // page_size`` from row
    ``sw_off = lo % page_size``; an entry without keys has no page."""
    seen = entries.hi > entries.lo
    first = entries.lo // page_size
    last = np.where(seen, (entries.hi - 1) // page_size, first - 1)
    counts = last - first + 1
    page_indptr = np.concatenate([[0], np.cumsum(counts)])
    offsets = np.arange(page_indptr[-1]) - np.repeat(page_indptr[:-1], counts)
    page_values = np.repeat(entries.batch * pages_per_row + first, counts) + offsets
    last_page_len = np.where(seen, entries.hi - last * page_size, 1)
    sw_off = np.where(seen, entries.lo - first * page_size, 0)
    length_info = np.stack([last_page_len, sw_off, np.zeros_like(sw_off)])
    return page_indptr.astype(np.int32), page_values.astype(np.int32), length_info.astype(np.int32)
