"""Where a variant's keys and values live, on the host: one object per layout, the host half of
``mlir/kv_layouts.py`` (same ``name``): the example arrays of a call, the keys and values the
error model reads, and for the KV caches each entry's length, the serving passes' block-table rows
and the rest call's arguments (runtime/decode.py), and the reference's rows of a pass entry
(``reference.decode_entries``).

Every hook takes the call's arguments by ABI name (mlir/abi.py) as host values (numpy arrays and
scalars). This module needs numpy only, so the GPU bundle's reference package carries it
(bench/gpu_bundle.py). A new layout is a subclass defining every abstract hook, registered in
:data:`HOST_LAYOUTS` under its IR half's name (tests/test_kv_layouts.py checks both halves).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

__all__ = ["HOST_LAYOUTS", "CacheHostLayout", "HostLayout", "PageTable", "host_layout", "indptr", "page_table",
           "paged_kv_lengths", "physical_lengths"]


class HostLayout(ABC):
    """A layout's host hooks that every variant has. Creating one checks that its class sets
    ``name`` (and defines every abstract hook)."""

    name: str
    #: The KV-head axis of k and v (of one half of the pages, ``pages[:, which]``, for the paged
    #: layouts), along which an 8-bit cache's per-head scales apply; None: one scale for all.
    head_axis: int | None = None

    def __init__(self):
        if not hasattr(self, "name"):
            raise TypeError(f"{type(self).__name__} must set name")

    @abstractmethod
    def keys_and_values(self, named: dict, d_v: int) -> tuple[np.ndarray, np.ndarray]:
        """Every key row [..., d_qk] and value row [..., d_v] the call's KV holds (all heads,
        pages in use or not)."""

    @abstractmethod
    def with_absolute_values(self, named: dict) -> dict | None:
        """The call with |v| in place of its values, or None where the values are part of the
        keys (the error model then takes max |v|)."""

    @abstractmethod
    def dequantized(self, named: dict, k_scale: np.ndarray, v_scale: np.ndarray, widened) -> dict:
        """The call with its 8-bit keys and values read through their scales in place of the
        stored ones: ``widened(x, scale, axis)`` (runtime/kv_quant.py) of each stored array, its
        scales [h_kv] along the KV-head ``axis``."""


class CacheHostLayout(HostLayout):
    """A KV-cache layout's host hooks (entries of a batch, serving passes)."""

    @abstractmethod
    def example_arrays(self, spec, rng: np.random.Generator, kv_lens: np.ndarray, window) -> tuple[dict, dict]:
        """The layout's index arrays of an example call whose entries hold ``kv_lens`` keys (int64
        [B]), by ABI name, and the sizes they fix (``"Lk"``, ``"P"``); ``window`` as for
        runtime.examples.example_inputs."""

    @abstractmethod
    def kv_lengths(self, spec, named: dict) -> np.ndarray:
        """int64 [B]: each entry's logical KV length (semantics §2)."""

    @abstractmethod
    def table_rows(self, spec, named: dict, entries: np.ndarray, kv_lens: np.ndarray, block: int) -> tuple:
        """(ids, blocks, sink, window_offset) of the serving-pass table rows of batch entries
        ``entries`` (int [n]) reading their first ``kv_lens`` keys (all of them with a sliding
        window): ``ids[i]`` the table entries the layout stores for those keys of entry i (a page
        id, or the first row of a ``block``-row block), ``blocks``
        int [n] how many table entries each reads (the last id repeats up to it), and the
        sliding window's sink tokens and offset per entry (0 without one)."""

    @abstractmethod
    def rest_arguments(self, spec, named: dict, in_pass: np.ndarray, qo_lens: np.ndarray) -> dict:
        """The index arguments (by name) of the call that runs the entries not ``in_pass`` (bool
        [B]) with the variant's own kernel; ``qo_lens`` int64 [B]."""

    @abstractmethod
    def pass_entry_kv(self, sources: list, ids: np.ndarray, physical: np.ndarray, block: int,
                      d_v: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys [n, h_kv, d_qk] and values [n, h_kv, d_v] of the physical rows ``physical`` (int
        [n]) of a pass entry whose table row is ``ids`` (``sources``: the pass's KV tensors)."""


def indptr(lengths) -> np.ndarray:
    """int32 [B+1] CSR offsets of ``lengths``."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


class _KvTensors:
    """The two hooks of a layout whose keys and values are the ``k`` and ``v`` arguments."""

    def keys_and_values(self, named, d_v):
        return named["k"], named["v"]

    def with_absolute_values(self, named):
        return dict(named, v=np.abs(named["v"]))

    def dequantized(self, named, k_scale, v_scale, widened):
        return dict(named, k=widened(named["k"], k_scale, self.head_axis),
                    v=widened(named["v"], v_scale, self.head_axis))


class DenseHost(_KvTensors, HostLayout):
    """k, v [B, Lk, h_kv, d]."""

    name = "dense"
    head_axis = 2


class RaggedHost(_KvTensors, CacheHostLayout):
    """k [N, h_kv, d_qk], v [N, h_kv, d_v]; entry b's rows [kv_indptr[b], kv_indptr[b + 1])."""

    name = "ragged"
    head_axis = 1

    def example_arrays(self, spec, rng, kv_lens, window):
        return {"kv_indptr": indptr(kv_lens)}, {"Lk": int(kv_lens.sum())}

    def kv_lengths(self, spec, named):
        return np.diff(named["kv_indptr"].astype(np.int64))

    def table_rows(self, spec, named, entries, kv_lens, block):
        starts = named["kv_indptr"].astype(np.int64)[entries]
        blocks = -(-kv_lens // block)
        ids = [starts[i] + block * np.arange(blocks[i]) for i in range(len(entries))]
        return ids, blocks, np.zeros_like(kv_lens), np.zeros_like(kv_lens)

    def rest_arguments(self, spec, named, in_pass, qo_lens):
        """Every entry stays, the pass entries with no queries: the KV rows are addressed by one
        indptr over all entries (the kernel still lays out their KV then)."""
        return {"q_indptr": indptr(np.where(in_pass, 0, qo_lens))}

    def pass_entry_kv(self, sources, ids, physical, block, d_v):
        row = ids[physical // block] + physical % block
        return sources[0][row], sources[1][row]


class RaggedHndHost(RaggedHost):
    """k [h_kv, N, d_qk], v [h_kv, N, d_v] (head-major rows)."""

    name = "ragged_hnd"
    head_axis = 0

    def pass_entry_kv(self, sources, ids, physical, block, d_v):
        row = ids[physical // block] + physical % block
        return sources[0][:, row].transpose(1, 0, 2), sources[1][:, row].transpose(1, 0, 2)


@dataclass(frozen=True)
class PageTable:
    """``page_indptr`` int32 [B+1], ``page_values`` int32 [nnz] (page ids), ``length_info`` int32
    [B] (last_page_len) or [3, B] (last_page_len, sw_offset, sink) with a sliding window, and
    ``num_pages``, the pages a cache needs (every id below it)."""

    page_indptr: np.ndarray
    page_values: np.ndarray
    length_info: np.ndarray
    num_pages: int


def page_table(rng: np.random.Generator, physical_lens, page_size: int, *, spare_pages: int = 2,
               window=None, shared: bool = False, empty_last=1) -> PageTable:
    """Pages holding ``physical_lens`` rows per entry, with ``spare_pages`` unused pages.

    Page ids are a random permutation (``shared``: drawn with repeats, so entries share pages).
    ``window``: None, or per entry (sw_offset, sink) for a sliding-window table. ``empty_last``:
    the last_page_len written for an entry without pages (an int, or one per entry).
    """
    physical = np.asarray(physical_lens, np.int64).reshape(-1)
    counts = -(-physical // page_size)
    needed = int(counts.sum())
    num_pages = needed + spare_pages
    ids = rng.integers(0, max(num_pages, 1), needed) if shared else rng.permutation(num_pages)[:needed]
    last = np.where(physical > 0, (physical - 1) % page_size + 1, empty_last)
    length_info = last if window is None else np.stack([last, *np.asarray(window, np.int64).reshape(-1, 2).T])
    return PageTable(indptr(counts), ids.astype(np.int32), np.ascontiguousarray(length_info, np.int32), num_pages)


def paged_kv_lengths(page_indptr: np.ndarray, length_info: np.ndarray, page_size: int,
                     sliding_window: bool) -> np.ndarray:
    """Logical KV length of every entry, int64 [B] (semantics §2), from checked arrays.

    ``page_indptr`` [B+1]; ``length_info`` [B] (last_page_len) or, with ``sliding_window``,
    [3, B] (last_page_len, sw_off, sink). An entry with no pages has length 0 whatever its
    ``length_info``; otherwise ``(n_pages - 1) * page_size + last_page_len - sw_off + sink``.
    Computed in int64, so it never overflows.
    """
    n_pages = np.diff(np.asarray(page_indptr, dtype=np.int64))
    info = np.asarray(length_info, dtype=np.int64)
    phys = physical_lengths(n_pages, info[0] if sliding_window else info, page_size)
    if not sliding_window:
        return phys
    return np.where(n_pages > 0, phys - info[1] + info[2], 0)


def physical_lengths(n_pages: np.ndarray, last_page_len: np.ndarray, page_size: int) -> np.ndarray:
    """Used slots of each entry, int64 [B]: ``(n_pages - 1) * page_size + last_page_len``, or 0."""
    return np.where(n_pages > 0, (n_pages - 1) * page_size + last_page_len, 0)


class _PageTableHost(CacheHostLayout, ABC):
    """Rows through the page table (page_indptr, page_values, length_info; semantics §2)."""

    def example_arrays(self, spec, rng, kv_lens, window):
        """Shuffled pages with 2 unused ones; a sliding-window table keeps EXAMPLE_SINKS sinks and
        evicts EXAMPLE_EVICTED rows per entry, or follows ``window``: (sw_offset, sink) per entry."""
        physical = kv_lens
        if spec.sliding_window:
            if window is None:
                sink = np.minimum(kv_lens, EXAMPLE_SINKS)
                window = np.stack([sink + EXAMPLE_EVICTED, sink], axis=1)
            window = np.where(kv_lens[:, None] > 0, np.asarray(window, np.int64).reshape(-1, 2), 0)
            physical = np.where(kv_lens > 0, kv_lens - window[:, 1] + window[:, 0], 0)
        table = page_table(rng, physical, spec.page_size, window=window if spec.sliding_window else None)
        return ({"page_indptr": table.page_indptr, "page_values": table.page_values,
                 "length_info": table.length_info}, {"P": table.num_pages})

    def kv_lengths(self, spec, named):
        return paged_kv_lengths(named["page_indptr"], named["length_info"], spec.page_size, spec.sliding_window)

    def table_rows(self, spec, named, entries, kv_lens, block):
        page_indptr, page_values = named["page_indptr"].astype(np.int64), named["page_values"]
        needed = -(-kv_lens // block)
        ids = [page_values[page_indptr[b]:page_indptr[b + 1]] for b in entries]
        if not spec.sliding_window:  # the first kv_len keys: a prefix of the pages
            ids = [pages[:count] for pages, count in zip(ids, needed)]
        # Logical blocks past an entry's pages (sink > window offset) still read through the
        # table's last page: pad with it, so only blocks past every column are NO_BLOCK.
        blocks = np.maximum([len(p) for p in ids], needed)
        info = named["length_info"]
        sink, offset = ((info[2][entries], info[1][entries]) if spec.sliding_window
                        else (np.zeros_like(kv_lens), np.zeros_like(kv_lens)))
        return ids, blocks, sink, offset

    def rest_arguments(self, spec, named, in_pass, qo_lens):
        """Only the other entries stay: their page tables are cut down to them."""
        keep = np.flatnonzero(~in_pass)
        page_indptr = named["page_indptr"].astype(np.int64)
        counts = np.diff(page_indptr)[keep]
        rest = {"q_indptr": indptr(qo_lens[keep]), "page_indptr": indptr(counts)}
        page_values = named["page_values"]
        rest["page_values"] = (np.concatenate([page_values[page_indptr[b]:page_indptr[b + 1]] for b in keep])
                               .astype(np.int32) if counts.sum() else np.zeros(0, np.int32))
        rest["length_info"] = np.ascontiguousarray(named["length_info"][..., keep])
        if "k_rope_pos_offset" in named:
            rest["k_rope_pos_offset"] = np.ascontiguousarray(named["k_rope_pos_offset"][keep])
        return rest


#: Sliding-window examples keep this many sink rows and evict this many rows after them.
EXAMPLE_SINKS, EXAMPLE_EVICTED = 2, 5


class PagedHost(_PageTableHost):
    """pages [P, 2, h_kv, page_size, d]: keys at [:, 0], values at [:, 1]."""

    name = "paged"
    head_axis = 1

    def keys_and_values(self, named, d_v):
        return named["pages"][:, 0], named["pages"][:, 1]

    def with_absolute_values(self, named):
        pages = np.array(named["pages"], copy=True)
        pages[:, 1] = np.abs(pages[:, 1])
        return dict(named, pages=pages)

    def dequantized(self, named, k_scale, v_scale, widened):
        pages = np.asarray(named["pages"])
        return dict(named, pages=np.stack([widened(pages[:, which], scale, self.head_axis)
                                           for which, scale in ((0, k_scale), (1, v_scale))], axis=1))

    def pass_entry_kv(self, sources, ids, physical, block, d_v):
        page, slot = ids[physical // block], physical % block
        return sources[0][page, 0, :, slot], sources[0][page, 1, :, slot]


class PagedNhdHost(PagedHost):
    """pages [P, 2, page_size, h_kv, d] (FlashInfer's NHD, transformers' paged cache)."""

    name = "paged_nhd"
    head_axis = 2

    def pass_entry_kv(self, sources, ids, physical, block, d_v):
        page, slot = ids[physical // block], physical % block
        return sources[0][page, 0, slot], sources[0][page, 1, slot]


class LatentHost(_PageTableHost):
    """MLA's pages [P, page_size, d_qk]: a key row whose first d_v columns are its value."""

    name = "latent"

    def keys_and_values(self, named, d_v):
        return named["pages"], named["pages"][..., :d_v]

    def with_absolute_values(self, named):
        return None

    def dequantized(self, named, k_scale, v_scale, widened):
        """Keys and values are the same rows, under one scale (k_scale [1] broadcasts on any axis)."""
        return dict(named, pages=widened(named["pages"], k_scale, 0))

    def pass_entry_kv(self, sources, ids, physical, block, d_v):
        latent = sources[0][ids[physical // block], physical % block][:, None]
        return latent, latent[..., :d_v]


#: Every layout's host half by name (the IR halves: mlir/kv_layouts.py's LAYOUTS).
HOST_LAYOUTS: dict[str, HostLayout] = {layout.name: layout
                                       for layout in (DenseHost(), RaggedHost(), RaggedHndHost(), PagedHost(),
                                                      PagedNhdHost(), LatentHost())}


def host_layout(layout) -> HostLayout:
    """The host half of ``layout``: a layout name, or a spec (its ``kv_layout``); an unknown
    layout is a ValueError."""
    name = layout if isinstance(layout, str) else layout.kv_layout
    try:
        return HOST_LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown KV layout {name!r}: expected one of {sorted(HOST_LAYOUTS)}") from None
