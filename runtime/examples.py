"""Valid seed-ABI calls built from a variant's argument table (mlir/abi.py), and the one page-table
generator the demo, compare, bench and tests draw paged calls from.

    args = example_inputs(spec, np.random.default_rng(0))          # a mixed batch, RoPE on
    args = example_inputs(spec, rng, entries=[(128, 128)] * 4)      # four 128-token prefills
    table = page_table(rng, physical_lens=[40, 0, 9], page_size=16)  # shuffled, 2 spare pages
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..mlir.abi import argument_names, arguments, concrete_dims, ordered
from .checks import NUMPY_DTYPES
from .kv_checks import natural_positions

__all__ = ["EXAMPLE_ENTRIES", "PageTable", "draw_tensors", "example_inputs", "indptr", "page_table", "uniform"]

# (qo_len, kv_len) per entry of the KV-cache examples: causal rows with no key, several pages, a
# single row, an entry with no KV.
EXAMPLE_ENTRIES = ((5, 3), (12, 40), (1, 9), (3, 0))
# (B, Lq, Lk) of the default dense examples: qo_len > kv_len, so causal rows with no key; the
# masked variant's valid_lens are [17, 5, 0] (whole, partial, empty).
DENSE_EXAMPLE = (3, 20, 17)
# Sliding-window examples keep this many sink rows and evict this many rows after them.
EXAMPLE_SINKS, EXAMPLE_EVICTED = 2, 5
# Per-head sink logits (``head_sinks``, the ``f32`` arguments) are drawn uniform in this range:
# from below the scores of [-1, 1) inputs to well above them, so the sink changes every row.
SINK_RANGE = (-2.0, 4.0)


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


def example_inputs(spec, rng: np.random.Generator, entries=EXAMPLE_ENTRIES, *, window=None, **given) -> tuple:
    """A valid seed-ABI call for ``spec``, built from its argument table: values in [-1, 1),
    causal, RoPE on where the variant has it (and ``d_qk`` is even), sm_scale 1/sqrt(d_qk).

    ``entries``: (qo_len, kv_len) per batch entry. KV-cache variants get random RoPE offsets
    (queries at the end of their entry's KV) and shuffled pages with 2 unused ones. A
    sliding-window table keeps EXAMPLE_SINKS sinks and evicts EXAMPLE_EVICTED rows per entry, or
    follows ``window``: (sw_offset, sink) per entry; ``sinks`` (``head_sinks``) are uniform in
    SINK_RANGE, drawn last. The dense variants take B = len(entries) and
    the first entry's lengths (DENSE_EXAMPLE for the default entries), the masked variant
    valid_lens min(Lq, Lk) each. ``given``: arguments by name that replace the drawn ones
    (``rotary_mode=0``, ``sm_scale=0.125``); tensors are drawn after the index arrays, in the
    table's order.
    """
    unknown = sorted(set(given) - set(argument_names(spec)))
    if unknown:
        raise TypeError(f"{unknown[0]}: not an argument of {spec.symbol}")
    if spec.kv_layout == "dense":
        named, sizes = _dense_batch(entries)
    else:
        named, sizes = _kv_cache_batch(spec, rng, entries, window)
    named.update(causal=1, rotary_mode=1 - spec.d_qk % 2, rope_scale=1.0, rope_theta=1e4, sm_scale=spec.d_qk ** -0.5)
    named.update(draw_tensors(spec, rng, sizes, skip=tuple(given)))
    named.update({arg.name: rng.uniform(*SINK_RANGE, concrete_dims(spec, arg, sizes)).astype(np.float32)
                  for arg in arguments(spec) if arg.kind == "f32" and arg.name not in given})
    return ordered(spec, {**named, **given})


def draw_tensors(spec, rng: np.random.Generator, sizes: dict, skip: tuple[str, ...] = ()) -> dict:
    """The call's tensor arguments by name (except ``skip``), uniform in [-1, 1) in the spec's
    dtype, drawn in the table's order with the table's dims; ``sizes`` gives the symbols
    (``"B"``, ``"Lq"``, ``"Lk"``, ``"P"``)."""
    return {arg.name: uniform(rng, concrete_dims(spec, arg, sizes), spec.dtype)
            for arg in arguments(spec) if arg.kind == "tensor" and arg.name not in skip}


def uniform(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    """Values in [-1, 1) drawn in float64, rounded to ``dtype`` (a spec dtype name)."""
    return rng.uniform(-1.0, 1.0, shape).astype(NUMPY_DTYPES[dtype])


def indptr(lengths) -> np.ndarray:
    """int32 [B+1] CSR offsets of ``lengths``."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _dense_batch(entries) -> tuple[dict, dict]:
    batch, qo_len, kv_len = DENSE_EXAMPLE if entries is EXAMPLE_ENTRIES else (len(entries), *entries[0])
    full = min(qo_len, kv_len)
    valid = [full, min(full, 5), 0] if entries is EXAMPLE_ENTRIES else [full] * batch
    return {"valid_lens": np.array(valid, np.int32)}, {"B": batch, "Lq": qo_len, "Lk": kv_len}


def _kv_cache_batch(spec, rng, entries, window) -> tuple[dict, dict]:
    """The index arrays of a KV-cache call by ABI name (those of every layout: the table picks)."""
    qo_lens, kv_lens = (np.array(x, np.int64).reshape(-1) for x in zip(*entries))
    q_indptr = indptr(qo_lens)
    k_off = (rng.integers(0, 64, len(kv_lens)) + np.maximum(qo_lens - kv_lens, 0)).astype(np.int32)
    q_pos, k_off = natural_positions(q_indptr, kv_lens, k_rope_pos_offset=k_off)
    named = {"q_indptr": q_indptr, "kv_indptr": indptr(kv_lens), "q_rope_position": q_pos, "k_rope_pos_offset": k_off}
    sizes = {"Lq": int(q_indptr[-1]), "Lk": int(kv_lens.sum())}
    if "page_indptr" in argument_names(spec):
        physical = kv_lens
        if spec.sliding_window:
            if window is None:
                sink = np.minimum(kv_lens, EXAMPLE_SINKS)
                window = np.stack([sink + EXAMPLE_EVICTED, sink], axis=1)
            window = np.where(kv_lens[:, None] > 0, np.asarray(window, np.int64).reshape(-1, 2), 0)
            physical = np.where(kv_lens > 0, kv_lens - window[:, 1] + window[:, 0], 0)
        table = page_table(rng, physical, spec.page_size, window=window if spec.sliding_window else None)
        named.update(page_indptr=table.page_indptr, page_values=table.page_values, length_info=table.length_info)
        sizes["P"] = table.num_pages
    return named, sizes
