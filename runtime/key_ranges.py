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

:func:`chunked_call` does the same for chunked attention (Llama 4, semantics §16) over the
caller's own page table: each run of a sequence's queries within one chunk is an entry from the
chunk's first key.

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
    return _window_arguments(entries, entries.batch * pages_per_row, None, page_size)


def _window_arguments(entries: Entries, row_start: np.ndarray, page_table, page_size: int) -> tuple:
    """:func:`paged_arguments` over a page table: entry ``e``'s row's ``p``-th page is
    ``page_table[row_start[e] + p]`` (``page_table`` None: the page id is that index)."""
    seen = entries.hi > entries.lo
    first = entries.lo // page_size
    last = np.where(seen, (entries.hi - 1) // page_size, first - 1)
    counts = last - first + 1
    page_indptr = np.concatenate([[0], np.cumsum(counts)])
    offsets = np.arange(page_indptr[-1]) - np.repeat(page_indptr[:-1], counts)
    page_values = np.repeat(row_start + first, counts) + offsets
    if page_table is not None:
        page_values = page_table[page_values]
    last_page_len = np.where(seen, entries.hi - last * page_size, 1)
    sw_off = np.where(seen, entries.lo - first * page_size, 0)
    length_info = np.stack([last_page_len, sw_off, np.zeros_like(sw_off)])
    return page_indptr.astype(np.int32), page_values.astype(np.int32), length_info.astype(np.int32)


@dataclass(frozen=True)
class ChunkedCall:
    """The paged sliding-window variant's arguments of a chunked-attention call (Llama 4,
    semantics §16), every array int32: ``q_indptr [n+1]``, ``page_indptr [n+1]``, ``page_values``,
    ``length_info [3, n]`` (last_page_len, sw_off, sink 0) and ``k_rope_pos_offset [n]`` of its
    ``n`` entries. The queries keep their rows: a sequence's are split where they cross a chunk,
    so the output comes back in the caller's row order."""

    q_indptr: np.ndarray
    page_indptr: np.ndarray
    page_values: np.ndarray
    length_info: np.ndarray
    k_rope_pos_offset: np.ndarray


def chunked_call(q_indptr, page_indptr, page_values, last_page_len, k_rope_pos_offset, *, chunk: int,
                 page_size: int) -> ChunkedCall:
    """A paged call of B sequences, as chunked attention's entries (vLLM's "virtual batches").

    Sequence ``b`` has queries ``[q_indptr[b], q_indptr[b+1])`` at the end of its ``kv_len`` keys
    (pages ``page_values[page_indptr[b]:page_indptr[b+1]]``, the last holding
    ``last_page_len[b]`` rows: the seed's paged layout without a window), query t at position
    ``kv_len - q_len + t``, its keys at ``k_rope_pos_offset[b] + row``. A query at position p sees
    the keys from ``p - p % chunk`` to p: each run of a sequence's queries within one chunk is an
    entry over its chunk's pages from the chunk's first key (``sw_off``), causal
    (bottom-right) within it. Run it causal, RoPE as the call's. Every sequence needs its queries'
    keys in its pages (``kv_len >= q_len``); ValueError naming the argument otherwise."""
    q_indptr, page_indptr = np.asarray(q_indptr, np.int64), np.asarray(page_indptr, np.int64)
    page_values, last = np.asarray(page_values, np.int64), np.asarray(last_page_len, np.int64)
    offsets = np.asarray(k_rope_pos_offset, np.int64)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk: must be a positive int, got {chunk!r}")
    pages = page_indptr[1:] - page_indptr[:-1]
    kv_lens = np.where(pages > 0, (pages - 1) * page_size + last, 0)
    q_lens = q_indptr[1:] - q_indptr[:-1]
    if np.any(kv_lens < q_lens):
        b = int(np.flatnonzero(kv_lens < q_lens)[0])
        raise ValueError(f"page_indptr: sequence {b} has {kv_lens[b]} keys for {q_lens[b]} queries; its queries' "
                         "keys must be in its pages")
    q_bounds, runs = [0], []    # runs: (sequence, first key, end of keys) of each entry
    for b, (q_len, kv_len) in enumerate(zip(q_lens.tolist(), kv_lens.tolist())):
        first_position = kv_len - q_len
        for start in range(first_position - first_position % chunk, kv_len, chunk) if q_len else [first_position]:
            end = min(start + chunk, kv_len)                            # the keys of this chunk's last query
            q_bounds.append(q_bounds[-1] + end - max(start, first_position))
            runs.append((b, start, end))
    entries = Entries(np.asarray(q_bounds, np.int32), *np.asarray(runs, np.int64).reshape(-1, 3).T)
    tables = _window_arguments(entries, page_indptr[entries.batch], page_values, page_size)
    rope_offsets = (offsets[entries.batch] + entries.lo).astype(np.int32)
    return ChunkedCall(entries.q_indptr, *tables, rope_offsets)

