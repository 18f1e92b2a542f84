"""Planning a KV-cache call on the host: its short entries run in one pass (mlir/decode.py,
mlir/fused_decode.py).

An entry with few queries (1 to 16: ``DECODE_PASSES``) and at
least one KV row is a *pass entry* when the call's keys need no inline RoPE
(``rotary_mode == 0``; MLA never rotates). :func:`split_decode` turns such a call into

* for each query count of the lowering's passes, its pass entries (every entry with that many
  queries or fewer, padded to it; a longer entry in pieces of that many: :func:`_pieces`) in
  calls of one chunk size and similar lengths (linalg, :func:`_calls_of`), or, in the fused
  lowering (CUDA), one call per KV-length bucket (:func:`bucket_tiles`, padding under 1.5x): a
  fixed number of dispatches each, a bounded number of calls whatever the batch size (a pass
  whose scratch would pass its bound, ``DecodePasses.usable``, hands its entries to the 1-query
  pass, one query a pass entry; a call holds as many pieces of an entry as the pass's scratch
  bound allows), and
* the variant's own kernel for the other entries (``_rest_call``),

then scatters the results back into token order. Which path an entry takes depends on its own
lengths only, so its result is the same alone or in any batch. Measured on the 2-core EPYC
(f32, h_q 32, h_kv 8, d 128): docs/serving.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..mlir.abi import argument_names, arguments, kv_sources
from ..mlir.attention_op import TILE
from ..mlir.decode import DECODE_PASSES, DecodePasses, DecodeSpec
from .checks import on_host
from .kv_layouts import host_layout
from .module import host_array


#: Bucket widths of the fused pass, in KV tiles: 1, 2, 3, 4, 6, 8, 12, ... (powers of two and
#: 1.5 times them): an entry is padded by less than 1.5x its tiles, and a call of entries up to
#: L keys takes at most 2 log2(L / TILE) + 1 calls, whatever the batch size.
def bucket_tiles(tiles: np.ndarray) -> np.ndarray:
    """int [n]: the bucket (its width in KV tiles) of entries with ``tiles`` KV tiles (>= 1)."""
    tiles = np.maximum(np.asarray(tiles, np.int64), 1)
    power = 2 ** np.floor(np.log2(tiles)).astype(np.int64)
    return np.where(tiles <= power, power, np.where(tiles * 2 <= power * 3, power * 3 // 2, power * 2))
#: Padding of the per-entry block table: a block past every column of its entry.
NO_BLOCK = -1
#: A linalg pass call pads its entries' chunks (to its longest) by less than this factor.
MAX_CHUNK_PADDING = 1.5


def _named(spec, args: tuple) -> dict:
    """The call's arguments by their names in the variant's table (mlir/abi.py)."""
    return dict(zip(argument_names(spec), args))


def kv_lengths(spec, args: tuple) -> np.ndarray:
    """int64 [B]: each entry's logical KV length (semantics §2)."""
    return _CallIndex.of(spec, args).kv_lens


@dataclass(frozen=True)
class _CallIndex:
    """What a schedule reads of a call, read once: its arguments by name (``named``, the index
    arrays on the host), its index arrays (``index``), and each entry's query rows and logical
    KV length (``qo_lens``, ``kv_lens`` int64 [B])."""

    named: dict
    index: dict
    qo_lens: np.ndarray
    kv_lens: np.ndarray

    @classmethod
    def of(cls, spec, args: tuple) -> "_CallIndex":
        named, index = {}, {}
        for arg, value in zip(arguments(spec), args):
            if arg.kind == "index":
                value = index[arg.name] = on_host(value)
            named[arg.name] = value
        qo_lens = np.diff(index["q_indptr"].astype(np.int64))
        return cls(named, index, qo_lens, host_layout(spec).kv_lengths(spec, index))


def pass_queries(spec, args: tuple, passes: DecodePasses = DECODE_PASSES["linalg"]) -> np.ndarray:
    """int [B]: the query count of the pass each entry takes (the smallest of the usable
    ``passes.queries`` that holds its queries; 1 for an entry with more queries that runs one
    query at a time because its own pass is not usable: DecodePasses.taken; the largest for
    an entry with more queries than it and at most ``passes.pieces_up_to`` keys, in pieces), or
    0 for the variant's own kernel."""
    return _pass_queries(spec, _CallIndex.of(spec, args), passes)


def _pass_queries(spec, call: _CallIndex, passes: DecodePasses) -> np.ndarray:
    qo_lens, kv_lens = call.qo_lens, call.kv_lens
    chosen = np.zeros(len(qo_lens), np.int64)
    usable = passes.usable(spec)
    if not usable or int(call.named.get("rotary_mode", 0)) != 0:
        return chosen
    eligible = (kv_lens >= 1) & (qo_lens >= 1)
    largest = max(passes.queries)
    if largest in usable:  # long entries over short caches: in pieces of the largest pass
        chosen[eligible & (qo_lens > largest) & (kv_lens <= passes.pieces_up_to)] = largest
    for queries in sorted(passes.queries, reverse=True):
        chosen[eligible & (qo_lens <= queries)] = passes.taken(queries, usable)
    return chosen


def block_table(spec: DecodeSpec, index: dict, entries: np.ndarray, kv_lens: np.ndarray, visible: np.ndarray,
                qo_lens: np.ndarray, width_multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """The decode kernel's ``table`` [n, W / P, P] and ``geometry`` [n, 4] (kv_len, sink,
    window_offset, qo_len) for pass entries that read batch entries ``entries`` (indices into
    the batch, int [n]) of a call whose index arrays are ``index`` (by name, on the host) with
    ``kv_lens`` keys, of which the first ``visible`` count, and ``qo_lens`` queries (int [n]
    each); P = ``width_multiple`` blocks a chunk."""
    base = spec.base
    first_blocks, blocks, sink, offset = host_layout(base).table_rows(base, index, entries, kv_lens, spec.block)
    width = -(-max(int(blocks.max()), 1) // width_multiple) * width_multiple
    table = np.full((len(entries), width), NO_BLOCK, np.int32)
    for row, (ids, count) in enumerate(zip(first_blocks, blocks)):
        table[row, :len(ids)] = ids
        table[row, len(ids):count] = ids[-1]
    geometry = np.stack([visible, sink, offset, qo_lens], axis=1).astype(np.int32)
    return table.reshape(len(entries), width // width_multiple, width_multiple), geometry


def _pieces(entries: np.ndarray, kv_lens: np.ndarray, qo_lens: np.ndarray, causal: bool, size: int):
    """Entries as pass entries of at most ``size`` queries each (one for an entry of up to
    ``size`` queries, ceil(q / size) for a longer one): (batch entry, first token, queries,
    visible keys) of each, int [m]. A piece of tokens [f, f + n) sees the first kv_len - qo_len
    + f + n keys (bottom-right causal; none below 1) or all of them, so the pass's causal mask
    over its n queries is the entry's own."""
    pieces = -(-qo_lens[entries] // size)
    batch_entry = np.repeat(entries, pieces)
    first = (np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * size
    counts = np.minimum(qo_lens[batch_entry] - first, size)
    visible = kv_lens[batch_entry]
    if causal:
        visible = np.maximum(visible - qo_lens[batch_entry] + first + counts, 0)
    return batch_entry, first, counts, visible


@dataclass(frozen=True)
class DecodeCall:
    """One call of a pass: ``args`` in decode_entries' order (q [n, h_kv, R, d_qk], the KV
    sources, table, geometry, causal, sm_scale[, sinks]), and where its rows go: ``rows`` [n, queries]
    the entries' query rows in the batch, ``real`` [n, queries] which of them exist."""

    spec: DecodeSpec
    args: tuple
    rows: np.ndarray
    real: np.ndarray


@dataclass(frozen=True)
class PassCall:
    """The part of a pass call the index arrays fix: the pass, its ``table`` [n, c, P] and
    ``geometry`` [n, 4] (:func:`block_table`), and ``rows``/``real`` as in :class:`DecodeCall`.

    ``head_rows`` [n x h_kv x queries] and ``real_head_rows`` (bool, the same length): the pass's
    q (and its output) as rows of one KV head's G query heads, [n, h_kv, queries, G x d] flattened,
    index the batch's rows of the same shape, [tokens x h_kv, G x d]: row (i, h, t) is token
    rows[i, t]'s head group h. One ``np.take`` then moves q, and one indexed store the results.
    ``every_row``: whether every row is real (no padding).
    """

    spec: DecodeSpec
    table: np.ndarray
    geometry: np.ndarray
    rows: np.ndarray
    real: np.ndarray
    head_rows: np.ndarray
    real_head_rows: np.ndarray
    every_row: bool

    @classmethod
    def of(cls, spec: DecodeSpec, table: np.ndarray, geometry: np.ndarray, rows: np.ndarray, real: np.ndarray):
        h_kv = spec.base.h_kv
        head_rows = (rows[:, None, :] * h_kv + np.arange(h_kv)[None, :, None]).reshape(-1)
        real_head_rows = np.broadcast_to(real[:, None, :], (len(rows), h_kv, rows.shape[1])).reshape(-1)
        return cls(spec, table, geometry, rows, real, head_rows, real_head_rows, bool(real.all()))

    def call(self, named: dict, q: np.ndarray, new_array: Callable = None) -> DecodeCall:
        """The call for one layer: ``named`` its arguments by ABI name, ``q`` [tokens, h_q, d] its
        queries on the host; the pass's q is written through ``new_array(shape, dtype) -> (argument,
        view)`` (module.host_visible_array; default a numpy array), zero in padding rows."""
        group, d = self.spec.base.group_size, q.shape[-1]
        q_arg, q_pass = (new_array or host_array)(self.q_shape(d), q.dtype)
        by_head = np.ascontiguousarray(q).reshape(-1, group * d)  # [tokens x h_kv, G x d]
        pass_rows = q_pass.reshape(-1, group * d)  # [n x h_kv x queries, G x d]
        if self.every_row:
            np.take(by_head, self.head_rows, axis=0, out=pass_rows, mode="clip")  # unbuffered; rows valid
        else:
            pass_rows[...] = 0
            pass_rows[self.real_head_rows] = by_head[self.head_rows[self.real_head_rows]]
        return DecodeCall(self.spec, self.arguments(named, q_arg), self.rows, self.real)

    def q_shape(self, d: int) -> tuple:
        """The pass's q ``[n, h_kv, R, d]`` (R = queries x G rows a KV head)."""
        n, queries = self.rows.shape
        return n, self.spec.base.h_kv, queries * self.spec.base.group_size, d

    def arguments(self, named: dict, q_pass) -> tuple:
        """The pass's arguments for one layer given its q (``q_pass`` [n, h_kv, R, d_qk])."""
        spec = self.spec.base
        return (q_pass, *(named[arg.name] for arg in kv_sources(spec)),
                *self.fixed_arguments(named, self.table, self.geometry),
                *((named["sinks"],) if spec.head_sinks else ()))

    @staticmethod
    def fixed_arguments(named: dict, table, geometry) -> tuple:
        """The pass's arguments between its KV sources and its sinks: ``table``, ``geometry``
        (as given: this call's arrays, or copies of them on the device) and the call's causal flag
        and sm_scale from ``named``."""
        return table, geometry, int(named["causal"]), float(named["sm_scale"])

    def in_order(self, tokens: int) -> bool:
        """Whether the pass's rows are a call's ``tokens`` query rows in order, all real (one query
        an entry, entries in batch order, or one KV head): its q and results are then the call's
        q [tokens, h_q, d] and results reshaped."""
        return self.every_row and np.array_equal(self.head_rows, np.arange(tokens * self.spec.base.h_kv))


@dataclass(frozen=True)
class DecodeSchedule:
    """What a KV-cache call's index arrays decide, computed once per plan (a wrapper's ``plan``)
    and reused by every layer: ``passes`` [B] (:func:`pass_queries`), the pass calls, and for
    the other entries their query rows ``rest_rows`` [Lq] (bool) and the index arguments of
    their call (``rest_index``, by ABI name; None when every entry takes a pass), and whether the
    call is one pass call over its rows in order (``in_order``: PassCall.in_order)."""

    passes: np.ndarray
    calls: tuple[PassCall, ...]
    rest_rows: np.ndarray
    rest_index: dict | None
    in_order: bool


def decode_schedule(spec, args: tuple, decode_passes: DecodePasses) -> DecodeSchedule | None:
    """The schedule of a KV-cache call (``args`` checked, in the seed's order), or None when no
    entry takes a pass."""
    call = _CallIndex.of(spec, args)
    passes = _pass_queries(spec, call, decode_passes)
    if not passes.any():
        return None
    qo_lens = call.qo_lens
    in_pass = passes > 0
    rest_rows = np.repeat(~in_pass, qo_lens)  # [Lq]: rows of the other entries
    rest_index = host_layout(spec).rest_arguments(spec, call.index, in_pass, qo_lens) if rest_rows.any() else None
    calls = tuple(_pass_calls(spec, call, passes, decode_passes))
    in_order = rest_index is None and len(calls) == 1 and calls[0].in_order(len(rest_rows))
    return DecodeSchedule(passes, calls, rest_rows, rest_index, in_order)


def schedule_key(spec, args: tuple) -> tuple:
    """What :func:`decode_schedule` reads of a call (``args`` checked, in the seed's order): its
    index arrays' contents and its scalars, with every argument's shape."""
    key = []
    for arg, value in zip(arguments(spec), args):
        if arg.kind == "index":
            array = on_host(value)
            key.append((array.shape, array.dtype.str, array.tobytes()))
        elif arg.kind in ("int", "float"):
            key.append(value)
        else:
            key.append(tuple(value.shape))
    return tuple(key)


def decode_calls(spec, args: tuple, passes: np.ndarray, decode_passes: DecodePasses) -> list[DecodeCall]:
    """The pass calls of a KV-cache call whose one-pass entries are ``passes`` (from
    :func:`pass_queries`): per query count, one per (chunk size, band of lengths), or one per KV
    bucket when ``decode_passes.bucketed``; an entry of more queries than its pass runs in
    pieces (:func:`_pieces`), each a pass entry whose table holds the keys it sees. ``args``
    are checked, in the seed's order."""
    read = _CallIndex.of(spec, args)
    q = np.asarray(on_host(read.named["q"]))
    return [call.call(read.named, q) for call in _pass_calls(spec, read, passes, decode_passes)]


def _pass_calls(spec, call: _CallIndex, passes: np.ndarray, decode_passes: DecodePasses) -> list[PassCall]:
    """:func:`decode_calls`' calls without their per-layer tensors."""
    q_indptr = call.index["q_indptr"].astype(np.int64)
    qo_lens, kv_lens = call.qo_lens, call.kv_lens
    causal = int(call.named["causal"]) == 1
    calls = []
    for queries in decode_passes.queries:
        taking = np.flatnonzero(passes == queries)
        if not len(taking):
            continue
        pass_spec = DecodeSpec(spec, queries)
        entries, first, counts, visible = _pieces(taking, kv_lens, qo_lens, causal, queries)
        # a piece's table holds the keys it sees (with a sliding window all of its entry's: the
        # logical rows it sees are not a prefix of its table)
        table_lens = kv_lens[entries] if pass_spec.sliding_window else np.maximum(visible, 1)
        # a call holds as many pieces of an entry as keep its scratch within the pass's bound
        # (bench/serving_memory.py: DeepSeek-V3's 4-query entries as 1-query pieces took 3.87x
        # their K/V in calls of all four pieces, 1.98x one at a time)
        band = first // (queries * decode_passes.pieces_per_call(pass_spec))
        calls_of = [(np.flatnonzero(band == group)[chosen], multiple) for group in np.unique(band)
                    for chosen, multiple in _calls_of(pass_spec, table_lens[band == group], decode_passes)]
        for chosen, multiple in calls_of:
            token = np.arange(queries)
            rows = (q_indptr[entries[chosen]] + first[chosen])[:, None] + token  # [n, queries]: the query rows
            real = token < counts[chosen][:, None]  # the rest are padding
            table, geometry = block_table(pass_spec, call.index, entries[chosen], table_lens[chosen], visible[chosen],
                                          counts[chosen], multiple)
            calls.append(PassCall.of(pass_spec, table, geometry, rows, real))
    return calls


def split_decode(spec, args: tuple, schedule: DecodeSchedule, run_decode: Callable, run_rest: Callable,
                 new_array: Callable, device_results: Callable, to_host: bool, outputs=None):
    """(output, lse) of a KV-cache call whose entries ``schedule`` (:func:`decode_schedule`)
    splits: its pass calls go through ``run_decode(queries, *args, use=use)`` and the rest through
    ``run_rest(*args, use=use)``, each handing its call's results to ``use`` (valid only inside
    it: LoadedKernel.consume). The pass's q, and the results when not ``to_host``, are
    made by ``new_array(shape, dtype) -> (argument, view)`` (module.host_visible_array: on the CPU
    drivers device buffers the host writes in place); ``device_results`` makes the results
    device arrays when ``to_host`` is False (module.device_resident: numpy ones uploaded).
    ``outputs``: the caller's arrays for host results (runtime/outputs.py), written in place
    and returned as given. ``args`` are checked, in the seed's order."""
    named = _named(spec, args)
    q = np.asarray(on_host(named["q"]))
    if schedule.in_order:
        return _in_order(spec, named, q, schedule.calls[0], run_decode, device_results, to_host, outputs)
    group = spec.group_size
    if outputs is not None:
        (output, lse), (output_view, lse_view) = outputs.given, outputs.arrays
        output_view, lse_view = output_view.reshape(-1, spec.h_q, spec.d_v), lse_view.reshape(-1, spec.h_q)
    else:
        results = host_array if to_host else new_array
        output, output_view = results((q.shape[0], spec.h_q, spec.d_v), q.dtype)
        lse, lse_view = results((q.shape[0], spec.h_q), np.float32)
    out_by_head = output_view.reshape(-1, group * spec.d_v)  # [tokens x h_kv, G x d_v]
    lse_by_head = lse_view.reshape(-1, group)
    for scheduled in schedule.calls:
        call = scheduled.call(named, q, new_array)

        def scatter(out_pass, lse_pass):
            # the pass's [n, h_kv, queries, G, ...] rows stored at their tokens' head groups
            out_rows, lse_rows = out_pass.reshape(-1, group * spec.d_v), lse_pass.reshape(-1, group)
            if scheduled.every_row:
                out_by_head[scheduled.head_rows], lse_by_head[scheduled.head_rows] = out_rows, lse_rows
            else:
                real, rows = scheduled.real_head_rows, scheduled.head_rows[scheduled.real_head_rows]
                out_by_head[rows], lse_by_head[rows] = out_rows[real], lse_rows[real]

        run_decode(call.rows.shape[1], *call.args, use=scatter)
    if schedule.rest_index is not None:
        rest_rows = schedule.rest_rows

        def store(out_rest, lse_rest):
            output_view[rest_rows], lse_view[rest_rows] = out_rest, lse_rest

        run_rest(*_rest_call(spec, args, schedule.rest_index, q[rest_rows], rest_rows), use=store)
    return (output, lse) if to_host else device_results([output, lse])


def _in_order(spec, named: dict, q: np.ndarray, scheduled: PassCall, run_decode: Callable, device_results: Callable,
              to_host: bool, outputs=None):
    """(output, lse) of a call that is one pass call over its rows in order (a decode step of one
    query an entry: PassCall.in_order): the pass takes q as it is, reshaped, and its results are
    copied out once, reshaped (no pass q built, no scatter: 8 x 1 vs 128 cached, the step's host
    work about 100 -> 60 us, `run` min 0.394-0.406 -> 0.348 ms against 0.29 for the pass call
    alone, docs/performance.md)."""
    q_pass = q.reshape(scheduled.q_shape(q.shape[-1]))
    out_shape, lse_shape = (q.shape[0], spec.h_q, spec.d_v), (q.shape[0], spec.h_q)

    def copied(out_pass, lse_pass):
        if outputs is not None:
            return outputs.store(out_pass, lse_pass)
        output, lse = out_pass.reshape(out_shape), lse_pass.reshape(lse_shape)
        return (np.array(output), np.array(lse)) if to_host else device_results([output, lse])

    return run_decode(scheduled.rows.shape[1], *scheduled.arguments(named, q_pass), use=copied)


def _calls_of(pass_spec: DecodeSpec, lengths: np.ndarray, passes: DecodePasses) -> list[tuple[np.ndarray, int]]:
    """The pass entries (indices into ``lengths`` [m], each one's table length in keys) of each
    call of a pass, and the call's table blocks per chunk P. Bucketed (the fused pass): one call
    per KV-length bucket (:func:`bucket_tiles`), P a KV tile. Else the entries of each P
    (``DecodePasses.chunk_blocks`` of each entry) in calls cut by :func:`_within_scratch`; an
    empty list when there are no entries."""
    if not len(lengths):
        return []
    entries = np.arange(len(lengths))
    if passes.bucketed:
        buckets = bucket_tiles(-(-lengths // TILE))
        return [(entries[buckets == width], max(1, TILE // pass_spec.block)) for width in np.unique(buckets)]
    chunk_blocks = np.array([passes.chunk_blocks(pass_spec, b) for b in -(-lengths // pass_spec.block)], np.int64)
    return [(cut, int(per_chunk)) for per_chunk in np.unique(chunk_blocks)
            for cut in _within_scratch(pass_spec, entries[chunk_blocks == per_chunk], lengths, int(per_chunk), passes)]


def _within_scratch(pass_spec: DecodeSpec, entries: np.ndarray, lengths: np.ndarray, per_chunk: int,
                    passes: DecodePasses) -> list[np.ndarray]:
    """``entries`` (pass entries of P = ``per_chunk``) in order of table length, cut into calls
    that pad an entry's chunks by less than MAX_CHUNK_PADDING and take at most
    ``passes.call_scratch`` bytes of scratch (no bound when None); entries that fit one call keep
    their order (a decode step's rows then stay in order: PassCall.in_order)."""
    ordered = entries[np.argsort(lengths[entries], kind="stable")]
    chunks = -(-lengths[ordered] // (per_chunk * pass_spec.block))  # ascending
    scratch = per_chunk * pass_spec.block * pass_spec.scratch_per_key  # bytes per chunk of an entry
    bound = np.inf if passes.call_scratch is None else passes.call_scratch
    calls, start = [], 0
    for i in range(len(ordered)):  # ordered[start:i + 1] padded to ordered[i]'s chunks
        if i > start and (chunks[i] > MAX_CHUNK_PADDING * chunks[start] or (i + 1 - start) * chunks[i] * scratch > bound):
            calls.append(ordered[start:i])
            start = i
    return calls + [ordered[start:]] if calls else [entries]


def _rest_call(spec, args: tuple, rest_index: dict, q_rest: np.ndarray, rest_rows: np.ndarray) -> list:
    """The variant's arguments for the entries that are not decode entries (queries ``q_rest``,
    index arguments ``rest_index``): the layout decides which entries the call keeps and cuts its
    index arrays to them (runtime/kv_layouts.py, ``rest_arguments``: the page tables keep only
    those entries, the ragged cache every entry, the decode entries with no queries). (Skipping
    query-less entries inside the kernel, an ``scf.if`` around the entry's work, made about one
    call in two return wrong rows for other entries in IREE 3.13.)
    """
    named = _named(spec, args)
    rest = dict(named, q=np.ascontiguousarray(q_rest))
    if "q_rope_position" in named:
        rest["q_rope_position"] = np.ascontiguousarray(on_host(named["q_rope_position"])[rest_rows])
    rest.update(rest_index)
    return list(rest.values())
