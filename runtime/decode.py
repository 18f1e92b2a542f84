"""Planning a KV-cache call on the host: its decode entries run in one pass (mlir/decode.py).

An entry with exactly one query and at least one KV row is a *decode entry* when the call's keys
need no inline RoPE (``rotary_mode == 0``; MLA never rotates). On llvm-cpu (the linalg lowering)
:func:`split_decode` turns such a call into

* one ``decode_entries`` call over every decode entry at once (a fixed number of dispatches,
  whatever the batch size), and
* the variant's own kernel for the other entries (``_rest_call``),

then scatters both results back into token order. Which path an entry takes depends on its own
lengths only, so its result is the same alone or in any batch. Measured on the 2-core EPYC, 32
entries x 1 query vs 1024 cached (f32, h_q 32, h_kv 8, d 128): 365 ms entry by entry, 60-80 ms in
one pass, torch SDPA on the gathered KV 47-56 ms (docs/serving.md). Entries with 2 or 4 queries
measured 137 and 288 ms in a one-pass variant (against ~370 entry by entry and torch's 77 and 84),
and 16 queries 1128 ms (worse than entry by entry): the pass is for single queries only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..mlir.decode import DecodeSpec
from ..mlir.specs import MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec
from .kv_checks import paged_kv_lengths

#: Queries of an entry the one-pass decode kernel takes (measured, see the module docstring).
DECODE_QUERIES = 1
#: Padding of the per-entry block table: a block past every column of its entry.
NO_BLOCK = -1


def _host(value) -> Any:
    """A numpy view of a checked argument (IREE DeviceArrays are copied to the host)."""
    return value.to_host() if hasattr(value, "to_host") else value


@dataclass(frozen=True)
class _Layout:
    """Where a variant's arguments sit in the seed's positional order."""

    kv: tuple[int, ...]  # the KV sources the decode kernel reads
    q_rope_position: int | None
    rotary_mode: int | None


_LAYOUTS = {
    PagedPrefillSpec: _Layout(kv=(2,), q_rope_position=7, rotary_mode=9),
    RaggedPrefillSpec: _Layout(kv=(2, 3), q_rope_position=5, rotary_mode=8),
    MlaPagedPrefillSpec: _Layout(kv=(2,), q_rope_position=None, rotary_mode=None),
}


def kv_lengths(spec, args: tuple) -> np.ndarray:
    """int64 [B]: each entry's logical KV length (semantics §2)."""
    if isinstance(spec, RaggedPrefillSpec):
        return np.diff(_host(args[4]).astype(np.int64))
    return paged_kv_lengths(_host(args[3]), _host(args[5]), spec.page_size, spec.sliding_window)


def decode_entries(spec, args: tuple) -> np.ndarray:
    """bool [B]: the call's decode entries (see the module docstring)."""
    layout = _LAYOUTS[type(spec)]
    qo_lens = np.diff(_host(args[1]).astype(np.int64))
    eligible = (qo_lens == DECODE_QUERIES) & (kv_lengths(spec, args) >= 1)
    if layout.rotary_mode is not None and int(args[layout.rotary_mode]) != 0:
        return np.zeros_like(eligible)
    return eligible


def block_table(spec: DecodeSpec, args: tuple, entries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The decode kernel's ``table`` [n, W] and ``geometry`` [n, 3] (kv_len, sink,
    window_offset) for the decode entries ``entries`` (indices into the batch)."""
    base, block = spec.base, spec.block
    kv_lens = kv_lengths(base, args)[entries]
    ragged = isinstance(base, RaggedPrefillSpec)
    if ragged:
        starts = _host(args[4]).astype(np.int64)[entries]
        blocks = -(-kv_lens // block)
        first_blocks = [starts[i] + block * np.arange(blocks[i]) for i in range(len(entries))]
        sink = offset = np.zeros_like(kv_lens)
    else:
        page_indptr, page_values = _host(args[3]).astype(np.int64), _host(args[4])
        first_blocks = [page_values[page_indptr[b]:page_indptr[b + 1]] for b in entries]
        # Logical blocks past an entry's pages (sink > window offset) still read through the
        # table's last page: pad with it, so only blocks past every column are NO_BLOCK.
        blocks = np.maximum([len(p) for p in first_blocks], -(-kv_lens // block))
        info = _host(args[5])
        sink, offset = ((info[2][entries], info[1][entries]) if base.sliding_window
                        else (np.zeros_like(kv_lens), np.zeros_like(kv_lens)))
    width = -(-max(int(blocks.max()), 1) // spec.blocks_per_chunk) * spec.blocks_per_chunk
    table = np.full((len(entries), width), NO_BLOCK, np.int32)
    for row, (ids, count) in enumerate(zip(first_blocks, blocks)):
        table[row, :len(ids)] = ids
        table[row, len(ids):count] = ids[-1]
    geometry = np.stack([kv_lens, sink, offset], axis=1).astype(np.int32)
    return table, geometry


def split_decode(spec, args: tuple, run_decode: Callable, run_rest: Callable, device_results: Callable,
                 to_host: bool):
    """(output, lse) of a KV-cache call whose decode entries go through ``run_decode(*args)``
    and the rest through ``run_rest(*args)`` (both return numpy results); ``device_results``
    uploads them when ``to_host`` is False. ``args`` are checked, in the seed's order."""
    layout = _LAYOUTS[type(spec)]
    decode = decode_entries(spec, args)
    q_indptr = _host(args[1]).astype(np.int64)
    q = np.asarray(_host(args[0]))
    qo_lens = np.diff(q_indptr)
    decode_rows = q_indptr[:-1][decode]
    rest_lens = np.where(decode, 0, qo_lens)
    rest_rows = np.repeat(~decode, qo_lens)  # [Lq]: rows of the other entries

    pass_spec = DecodeSpec(spec)
    table, geometry = block_table(pass_spec, args, np.flatnonzero(decode))
    h_kv, group = spec.h_kv, spec.group_size
    q_pass = np.ascontiguousarray(q[decode_rows].reshape(len(decode_rows), h_kv, group, q.shape[-1]))
    out_pass, lse_pass = run_decode(q_pass, *(args[i] for i in layout.kv), table, geometry, float(args[-1]))

    d_out = pass_spec.d_v
    output = np.empty((q.shape[0], spec.h_q, d_out), out_pass.dtype)
    lse = np.empty((q.shape[0], spec.h_q), np.float32)
    output[decode_rows] = out_pass.reshape(-1, spec.h_q, d_out)
    lse[decode_rows] = lse_pass.reshape(-1, spec.h_q)
    if rest_lens.any():
        output[rest_rows], lse[rest_rows] = run_rest(*_rest_call(spec, args, decode, q[rest_rows], rest_rows))
    return (output, lse) if to_host else device_results([output, lse])


def _rest_call(spec, args: tuple, decode: np.ndarray, q_rest: np.ndarray, rest_rows: np.ndarray) -> list:
    """The variant's arguments for the entries that are not decode entries (queries ``q_rest``).

    Paged and MLA calls keep only those entries (their page tables are cut down to them). A
    ragged call keeps every entry, the decode entries with no queries, because its KV rows
    are addressed by one indptr over all entries; the kernel still lays out their KV then.
    (Skipping query-less entries inside the kernel, an ``scf.if`` around the entry's work, made
    about one call in two return wrong rows for other entries in IREE 3.13.)
    """
    layout = _LAYOUTS[type(spec)]
    rest = list(args)
    rest[0] = np.ascontiguousarray(q_rest)
    if layout.q_rope_position is not None:
        rest[layout.q_rope_position] = np.ascontiguousarray(_host(args[layout.q_rope_position])[rest_rows])
    q_indptr = _host(args[1]).astype(np.int64)
    qo_lens = np.diff(q_indptr)
    if isinstance(spec, RaggedPrefillSpec):
        rest[1] = np.concatenate([[0], np.cumsum(np.where(decode, 0, qo_lens))]).astype(np.int32)
        return rest
    keep = np.flatnonzero(~decode)
    page_indptr = _host(args[3]).astype(np.int64)
    counts = np.diff(page_indptr)[keep]
    rest[1] = np.concatenate([[0], np.cumsum(qo_lens[keep])]).astype(np.int32)
    rest[3] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    page_values = _host(args[4])
    rest[4] = (np.concatenate([page_values[page_indptr[b]:page_indptr[b + 1]] for b in keep]).astype(np.int32)
               if counts.sum() else np.zeros(0, np.int32))
    info = _host(args[5])
    rest[5] = np.ascontiguousarray(info[..., keep])
    if isinstance(spec, PagedPrefillSpec):
        rest[6] = np.ascontiguousarray(_host(args[6])[keep])  # k_rope_pos_offset
    return rest
