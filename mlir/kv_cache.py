"""KV-cache prefill: ``batch_prefill_ragged_kv``, ``batch_prefill_paged_kv[_sliding_window]`` and
``batch_prefill_paged_kv_mla[_sliding_window]`` (semantics §1.1-§1.3, §2-§6, §11).

The kernels keep the seed's arguments (index arrays and runtime scalars) and walk the batch
entries in an ``scf.for`` on the host side of the IREE program, so an entry costs what its own
tokens cost: no entry is padded to the longest one. Per entry:

1. its KV rows are loaded token-major, ``[kv_pad, h_kv, d]`` with ``kv_pad`` its length rounded up
   to the KV tile: a slice for ragged KV, a gather through the page table for paged KV and MLA;
2. keys get RoPE at ``k_rope_pos_offset[b] + row`` when ``rotary_mode == 1`` (never values);
3. rows past the entry's length are zeroed and K/V are laid out in KV tiles, widened to f32
   (keys ``[1, h_kv, T, d_qk, kv_tile]``, values ``[1, h_kv, T * kv_tile, d_v]``);
4. each query tile of ``q_tile`` tokens (GQA group folded into rows) runs the online-softmax
   emitter over the entry's KV tiles, stopping at the causal diagonal when ``causal == 1``.

Queries are rotated once for the whole call (``q_rope_position``) and padded by one query tile,
so a tile that starts near the end of an entry never reads out of bounds. Its rows past the entry
belong to the next entry (or the padding); they are written, then overwritten when the next entry
(processed later) writes its own rows, and the padding is dropped at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from .ir import (
    DYN, affine_map, arith_d, ceil_div, collapse, const_index, dim, element_type, empty, expand, extract_slice, f32,
    fill, generic, i32, index, ir, le, linalg_d, lt, one_of, scf_d, sizes_of, storage_tiles,
    tensor_d, tensor_type, tie_dims, widened,
)
from .abi import function_module
from .layout import group_query_rows
from .masks import kv_cache_validity
from .online_softmax import ScoreIndices, ScoreMask, online_softmax, row_sinks, unmasked_kv_tiles
from .query_tiles import QueryTiles, kv_tile_loader
from .rope import apply_rope
from .specs import SMALL_Q_TILE, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec

KvCacheSpec = Union[RaggedPrefillSpec, PagedPrefillSpec, MlaPagedPrefillSpec]


@dataclass(frozen=True)
class EntryKv:
    """One batch entry's KV as a loader returns it.

    ``load_keys()`` and ``load_values()`` build keys [kv_pad, h_kv, d_qk] and values
    [kv_pad, h_kv, d_v] where they are called (inside each RoPE branch, see ``_then_rotated_if``),
    token-major, with ``kv_pad = storage_tiles(kv_len, kv_tile) * kv_tile``; rows at or past
    ``kv_len`` may hold anything finite or not (they are zeroed before use). ``rope_offset`` is the
    i32 RoPE position of row 0, or None for variants without RoPE.
    """

    kv_len: ir.Value
    load_keys: Callable[[], ir.Value]
    load_values: Callable[[], ir.Value]
    rope_offset: ir.Value | None = None


@dataclass(frozen=True)
class RopeArgs:
    """The runtime RoPE scalars: ``rotary_mode`` (i32), ``rope_scale`` and ``rope_theta`` (f32)."""

    rotary_mode: ir.Value
    scale: ir.Value
    theta: ir.Value
    rope_scaling: dict
    rotary_dim: int | None = None


def _index_at(array: ir.Value, position: ir.Value) -> ir.Value:
    """``array[position]`` of an i32 tensor, as an index."""
    return _read_element(array, [position])


def _is_one(flag: ir.Value) -> ir.Value:
    return arith_d.cmpi(arith_d.CmpIPredicate.eq, flag, arith_d.constant(i32(), 1))


def _rotated_if(rope: RopeArgs | None, x: ir.Value, positions: ir.Value) -> ir.Value:
    """``x`` [N, H, D] with RoPE applied when ``rotary_mode == 1`` (``positions``: [N] i32 or a
    scalar i32 first position)."""
    return _then_rotated_if(rope, lambda: x, positions, lambda value: [value], [x.type], [sizes_of(x)])[0]


def _then_rotated_if(rope: RopeArgs | None, build_x: Callable[[], ir.Value], positions: ir.Value,
                     then: Callable[[ir.Value], list[ir.Value]], result_types: list, sizes: list) -> list[ir.Value]:
    """``then(x)`` for ``x = build_x()``, with RoPE applied to ``x`` first when ``rotary_mode == 1``
    (see ``_rotated_if``); ``result_types`` and ``sizes`` describe ``then``'s results.

    ``build_x`` and ``then`` run inside each branch, so without RoPE IREE fuses them: the key
    gather and its tile layout become one dispatch (docs/performance.md, KV-cache entries).
    """
    if rope is None:
        return then(build_x())
    branch = scf_d.IfOp(_is_one(rope.rotary_mode), result_types, has_else=True)
    with ir.InsertionPoint(branch.then_block):
        scf_d.YieldOp(then(apply_rope(build_x(), positions, theta=rope.theta, scale=rope.scale,
                                      rope_scaling=rope.rope_scaling, rotary_dim=rope.rotary_dim)))
    with ir.InsertionPoint(branch.else_block):
        scf_d.YieldOp(then(build_x()))
    return [tie_dims(result, size) for result, size in zip(branch.results, sizes)]


def _kv_tiles(x: ir.Value, kv_len: ir.Value, num_tiles: ir.Value, kv_tile: int, keys: bool) -> ir.Value:
    """Token-major [T * kv_tile, h, d] -> keys [1, h, T, d, kv_tile] or values [1, h, T * kv_tile, d],
    widened to f32 (see sequence.py: ``_kv_tiles``).

    Rows at or past ``kv_len`` become 0, so nothing another entry (or NaN padding) left there can
    reach this entry's result: a masked key weighs 0, and 0 * NaN would still be NaN.
    """
    h, d = ir.RankedTensorType(x.type).shape[1:]
    tiled = expand(x, [[0, 1], [2], [3]], [num_tiles, kv_tile, h, d])
    elem = f32()
    zero = arith_d.constant(elem, 0.0)
    if keys:  # loops (h, t, j, n)
        out = empty([h, num_tiles, d, kv_tile], elem)
        source_map, col_dim = affine_map(4, (1, 3, 0, 2)), 3
    else:  # loops (h, t, n, j)
        out = empty([h, num_tiles, kv_tile, d], elem)
        source_map, col_dim = affine_map(4, (1, 2, 0, 3)), 2

    def body(value, _out):
        tile = linalg_d.IndexOp(1).result
        col = arith_d.addi(arith_d.muli(tile, const_index(kv_tile)), linalg_d.IndexOp(col_dim).result)
        value = widened(value)
        return [arith_d.select(lt(col, kv_len), value, zero)]

    result = generic([tiled], [out], [source_map, affine_map(4, range(4))], "pppp", body)[0]
    if keys:
        return expand(result, [[0, 1], [2], [3], [4]], [1, h, num_tiles, d, kv_tile])
    return expand(collapse(result, [[0], [1, 2], [3]]), [[0, 1], [2], [3]],
                  [1, h, arith_d.muli(num_tiles, const_index(kv_tile)), d])


def _query_padding(spec: KvCacheSpec, total_q: ir.Value) -> ir.Value:
    """Rows the queries (and outputs) are padded by: one query tile, so that a tile starting
    near the end never reads out of bounds; only SMALL_Q_TILE when the whole call has at most
    that many queries, as every entry then runs one SMALL_Q_TILE tile (a 16-token call pads to
    32 tokens instead of 80)."""
    if spec.q_tile <= SMALL_Q_TILE:
        return const_index(spec.q_tile)
    return arith_d.select(le(total_q, const_index(SMALL_Q_TILE)), const_index(SMALL_Q_TILE),
                          const_index(spec.q_tile))


def _laid_out_kv(spec: KvCacheSpec, kv: EntryKv, rope: RopeArgs | None, d_qk: int, d_v: int):
    """The entry's keys [1, h_kv, tiles, d_qk, kv_tile] (rotated when its call rotates) and values
    [1, h_kv, tiles * kv_tile, d_v], f32 (kv_tile_loader reads them)."""
    h_kv = spec.h_kv
    stored_tiles = storage_tiles(kv.kv_len, spec.kv_tile)

    def kv_tiles(rotated_keys):
        return [_kv_tiles(rotated_keys, kv.kv_len, stored_tiles, spec.kv_tile, keys=True),
                _kv_tiles(kv.load_values(), kv.kv_len, stored_tiles, spec.kv_tile, keys=False)]

    stored_rows = arith_d.muli(stored_tiles, const_index(spec.kv_tile))
    return _then_rotated_if(
        rope, kv.load_keys, kv.rope_offset, kv_tiles,
        [tensor_type([1, h_kv, DYN, d_qk, spec.kv_tile], f32()), tensor_type([1, h_kv, DYN, d_v], f32())],
        [[1, h_kv, stored_tiles, d_qk, spec.kv_tile], [1, h_kv, stored_rows, d_v]])


def _tile_softmax(spec: KvCacheSpec, kv: EntryKv, load_kv_tile, num_kv_tiles: ir.Value, first_local: ir.Value,
                  tile_tokens: int, qo_len: ir.Value, diagonal: ir.Value, causal_on: ir.Value, *, d_v: int,
                  sm_scale: ir.Value, row_chunk: int | None, sinks: ir.Value | None):
    """The online softmax of one query tile (tokens [first_local, first_local + tile_tokens) of
    the entry) over the KV tiles it can see, masked by the entry's length and causality; ``sinks``:
    the tile rows' sinks (online_softmax.row_sinks) or None."""
    group = spec.group_size

    def valid(idx: ScoreIndices, _extras):
        col = arith_d.addi(idx.kv_start, idx.n)
        return kv_cache_validity(
            col, lambda: arith_d.addi(first_local, arith_d.divui(idx.m, const_index(group))),
            kv_len=kv.kv_len, diagonal=diagonal, causal=causal_on)

    def softmax(q_tile):
        last_row_end = arith_d.minsi(arith_d.addi(first_local, const_index(tile_tokens)), qo_len)
        causal_end = arith_d.maxsi(arith_d.minsi(arith_d.addi(last_row_end, diagonal), kv.kv_len), const_index(0))
        visible = arith_d.select(causal_on, ceil_div(causal_end, spec.kv_tile), num_kv_tiles)
        return online_softmax(
            q_tile, num_kv_tiles=visible, kv_tile=spec.kv_tile, d_v=d_v,
            load_kv_tile=load_kv_tile, mask=ScoreMask(predicate=valid), sm_scale=sm_scale,
            # rows past the entry (the next entry's, or padding) only see more than its first row
            unmasked_tiles=unmasked_kv_tiles(kv.kv_len, first_local, diagonal, spec.kv_tile, causal_on),
            row_chunk=row_chunk,
            soft_cap=spec.logits_soft_cap,
            sinks=sinks,
        )

    return softmax


def _attend_entries(
    spec: KvCacheSpec,
    q: ir.Value,
    q_indptr: ir.Value,
    *,
    d_v: int,
    load_entry: Callable[[ir.Value], EntryKv],
    causal: ir.Value,
    sm_scale: ir.Value,
    rope: RopeArgs | None,
    row_chunk: int | None,
    sinks: ir.Value | None = None,
) -> list[ir.Value]:
    """Output [Lq, h_q, d_v] (dtype) and lse [Lq, h_q] (f32) for q [Lq, h_q, d_qk] (already rotated).
    ``row_chunk``: the widest row the online softmax reduces in one op (None: whole rows);
    ``sinks``: [h_q] f32 sink logits (semantics §13) or None."""
    group, h_kv = spec.group_size, spec.h_kv
    q_shape = ir.RankedTensorType(q.type)
    d_qk, dt = q_shape.shape[2], q_shape.element_type
    total_q = dim(q, 0)
    padded_tokens = arith_d.addi(total_q, _query_padding(spec, total_q))
    q4 = expand(q, [[0, 1], [2], [3]], [1, total_q, spec.h_q, d_qk])
    q_rows = group_query_rows(q4, h_kv, group, padded_tokens)
    causal_on = _is_one(causal)
    # The batch's output and lse are carried in token order, padded by one query tile
    # (query_tiles.py). (IREE 3.13: carrying a buffer per entry instead made paged calls fail
    # intermittently, about 1 call in 15: "transient buffer has not been committed".)
    batch = arith_d.subi(dim(q_indptr, 0), const_index(1))
    driver = QueryTiles([1, padded_tokens, spec.h_q, d_v], [1, padded_tokens, spec.h_q], group, h_kv)
    tile_sinks = {tokens: None if sinks is None else row_sinks(sinks, h_kv, group, tokens)
                  for tokens in sorted({spec.q_tile, SMALL_Q_TILE})}

    def entry(b, carried):
        q_start = _index_at(q_indptr, b)
        qo_len = arith_d.subi(_index_at(q_indptr, arith_d.addi(b, const_index(1))), q_start)
        kv = load_entry(b)
        num_kv_tiles = ceil_div(kv.kv_len, spec.kv_tile)
        keys, values = _laid_out_kv(spec, kv, rope, d_qk, d_v)
        diagonal = arith_d.subi(kv.kv_len, qo_len)  # causal: col <= row + diagonal
        load_kv_tile = kv_tile_loader(keys, values, 0, spec.kv_tile)

        def attend(first_local, tile_tokens: int, tile):
            """Queries [first_local, first_local + tile_tokens) of the entry against its KV."""
            softmax = _tile_softmax(spec, kv, load_kv_tile, num_kv_tiles, first_local, tile_tokens, qo_len, diagonal,
                                    causal_on, d_v=d_v, sm_scale=sm_scale, row_chunk=row_chunk,
                                    sinks=tile_sinks[tile_tokens])
            return driver.attend(q_rows, 0, arith_d.addi(q_start, first_local), tile_tokens, tile, softmax)

        def all_tiles(tiles_carried):
            return driver.tiles(ceil_div(qo_len, spec.q_tile), spec.q_tile, tiles_carried,
                                lambda first_local, tile: attend(first_local, spec.q_tile, tile))

        if spec.q_tile <= SMALL_Q_TILE:
            return all_tiles(carried)
        # A short entry (at most SMALL_Q_TILE queries, e.g. a chunk of a few tokens against a
        # long cache) runs one small tile instead of a mostly padded q_tile.
        is_short = arith_d.andi(lt(const_index(0), qo_len), le(qo_len, const_index(SMALL_Q_TILE)))
        return one_of(is_short, lambda tile: attend(const_index(0), SMALL_Q_TILE, tile), all_tiles,
                      driver.tied(carried), driver.tied)

    out_rows, lse_rows = driver.entries(batch, dt, entry)
    output = extract_slice(out_rows, [0, 0, 0, 0], [1, total_q, spec.h_q, d_v])
    lse = extract_slice(lse_rows, [0, 0, 0], [1, total_q, spec.h_q])
    return [collapse(output, [[0, 1], [2], [3]]), collapse(lse, [[0, 1], [2]])]


def _with_a_row(x: ir.Value) -> ir.Value:
    """``x`` [N, ...], or one zero row in its place when N == 0, so that a row index clamped into
    [0, rows - 1] always reads inside it. No copy when N > 0."""
    sizes = sizes_of(x)
    branch = scf_d.IfOp(lt(sizes[0], const_index(1)), [x.type], has_else=True)
    with ir.InsertionPoint(branch.then_block):
        elem = ir.RankedTensorType(x.type).element_type
        scf_d.YieldOp([fill(arith_d.constant(elem, 0.0), [const_index(1), *sizes[1:]], elem)])
    with ir.InsertionPoint(branch.else_block):
        scf_d.YieldOp([x])
    return tie_dims(branch.results[0], [arith_d.maxsi(sizes[0], const_index(1)), *sizes[1:]])


def _entry_rows(x: ir.Value, start: ir.Value, rows: ir.Value) -> ir.Value:
    """Rows [start, start + rows) of ``x`` [N, ...] (N >= 1), each index clamped into [0, N - 1]: the
    rows past the entry read its neighbour's (or the last) rows, never out of bounds, and the
    caller zeroes them. One gather generic: before, K and V were each zero-padded (a fill and a
    copy of the whole tensor) and then sliced (a second copy per entry)."""
    sizes = sizes_of(x)
    last = arith_d.subi(sizes[0], const_index(1))
    rank = len(sizes)

    def body(_out):
        row = arith_d.minsi(arith_d.addi(start, linalg_d.IndexOp(0).result), last)
        return [tensor_d.extract(x, [row, *[linalg_d.IndexOp(i).result for i in range(1, rank)]])]

    out = empty([rows, *sizes[1:]], ir.RankedTensorType(x.type).element_type)
    return generic([], [out], [affine_map(rank, range(rank))], "p" * rank, body)[0]


def _ragged_loader(spec: RaggedPrefillSpec, k, v, kv_indptr, k_rope_pos_offset):
    """Entry b's KV is rows [kv_indptr[b], kv_indptr[b + 1]) of k and v."""
    k_rows, v_rows = _with_a_row(k), _with_a_row(v)

    def load(b: ir.Value) -> EntryKv:
        start = _index_at(kv_indptr, b)
        kv_len = arith_d.subi(_index_at(kv_indptr, arith_d.addi(b, const_index(1))), start)
        kv_pad = arith_d.muli(storage_tiles(kv_len, spec.kv_tile), const_index(spec.kv_tile))
        return EntryKv(
            kv_len=kv_len,
            load_keys=lambda: _entry_rows(k_rows, start, kv_pad),
            load_values=lambda: _entry_rows(v_rows, start, kv_pad),
            rope_offset=tensor_d.extract(k_rope_pos_offset, [b]),
        )

    return load


@dataclass(frozen=True)
class _PageTable:
    """Index values locating one entry's rows in the page table (§2)."""

    first_page: ir.Value  # position of the entry's first page in page_values
    physical_len: ir.Value  # rows stored in its pages
    kv_len: ir.Value  # logical rows (after the sink-token/window remap)
    window_offset: ir.Value  # physical row of logical row ``sink_tokens`` (0 without sliding window)
    sink_tokens: ir.Value  # attention-sink tokens kept before the window (length_info[2]; 0 without)


def _read_element(array: ir.Value, indices: list) -> ir.Value:
    """``array[indices]`` of an i32 tensor, as an index (read where the code runs)."""
    return arith_d.index_cast(index(), tensor_d.extract(array, indices))


def _page_table(spec, b, page_indptr, length_info, read=_read_element) -> _PageTable:
    """Entry ``b``'s page-table geometry; ``read(array, indices)`` reads an element of
    ``page_indptr`` or ``length_info`` as an index (the fused lowering's host side passes
    ``HostReadable`` arrays and their loads)."""
    first_page = read(page_indptr, [b])
    num_pages = arith_d.subi(read(page_indptr, [arith_d.addi(b, const_index(1))]), first_page)
    has_pages = arith_d.cmpi(arith_d.CmpIPredicate.sgt, num_pages, const_index(0))
    zero = const_index(0)
    if spec.sliding_window:
        def info(row):
            return read(length_info, [const_index(row), b])
        last_page_len, window_offset, sink_tokens = info(0), info(1), info(2)
    else:
        last_page_len, window_offset, sink_tokens = read(length_info, [b]), zero, zero
    full_pages = arith_d.muli(arith_d.subi(num_pages, const_index(1)), const_index(spec.page_size))
    physical_len = arith_d.select(has_pages, arith_d.addi(full_pages, last_page_len), zero)
    logical_len = arith_d.addi(arith_d.subi(physical_len, window_offset), sink_tokens)
    kv_len = arith_d.select(has_pages, arith_d.maxsi(logical_len, zero), zero)
    return _PageTable(first_page, physical_len, kv_len, window_offset, sink_tokens)


def _gather_rows(spec, table: _PageTable, page_values, fetch, shape, elem) -> ir.Value:
    """A token-major tensor [kv_pad, *shape] of rows gathered through the page table.

    ``fetch(page, slot, out_indices)`` returns the scalar for logical row ``r`` whose physical
    position is ``(page, slot)``; every index is clamped into range, so rows past ``kv_len``
    (whose result is zeroed later) never read out of bounds. One generic per tensor: a
    multi-result gather fused with its consumer fails to compile for h_kv == 1 ("write affecting
    operations on global resources", IREE 3.13).
    """
    kv_pad = arith_d.muli(storage_tiles(table.kv_len, spec.kv_tile), const_index(spec.kv_tile))
    out = empty([kv_pad, *shape], elem)
    rank = 1 + len(shape)
    bounds = page_bounds(table, page_values)

    def body(_out):
        page, slot = physical_row(spec, table, page_values, linalg_d.IndexOp(0).result, bounds)
        out_indices = [linalg_d.IndexOp(i).result for i in range(1, rank)]
        return [fetch(page, slot, out_indices)]

    return generic([], [out], [affine_map(rank, range(rank))], "p" * rank, body)[0]


def page_bounds(table: _PageTable, page_values: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(last page slot of page_values, last physical row of the entry), both at least 0: the
    clamps of :func:`physical_row`."""
    last_page_slot = arith_d.maxsi(arith_d.subi(dim(page_values, 0), const_index(1)), const_index(0))
    last_row = arith_d.maxsi(arith_d.subi(table.physical_len, const_index(1)), const_index(0))
    return last_page_slot, last_row


def physical_row(spec, table: _PageTable, page_values: ir.Value, r: ir.Value,
                 bounds: tuple[ir.Value, ir.Value]) -> tuple[ir.Value, ir.Value]:
    """(page id, slot) of the entry's logical row ``r`` (§2): the sink-token rows [0, sink_tokens) are the
    first physical rows, the rest start at ``window_offset``; every index is clamped into range
    (``bounds`` from :func:`page_bounds`), so rows past kv_len never read out of bounds."""
    last_page_slot, last_row = bounds
    remapped = arith_d.addi(arith_d.subi(r, table.sink_tokens), table.window_offset)
    physical = arith_d.select(lt(r, table.sink_tokens), r, remapped)
    physical = arith_d.maxsi(arith_d.minsi(physical, last_row), const_index(0))
    page_slot = arith_d.addi(table.first_page, arith_d.divui(physical, const_index(spec.page_size)))
    page_slot = arith_d.minsi(page_slot, last_page_slot)
    page = arith_d.index_cast(index(), tensor_d.extract(page_values, [page_slot]))
    slot = arith_d.remui(physical, const_index(spec.page_size))
    return page, slot


def _clamped_page(page: ir.Value, pages: ir.Value) -> ir.Value:
    """A page id forced into [0, P): the host checks reject bad ids; this only guarantees no
    out-of-bounds read if a caller bypasses them."""
    last = arith_d.subi(dim(pages, 0), const_index(1))
    return arith_d.maxsi(arith_d.minsi(page, last), const_index(0))


def _paged_loader(spec: PagedPrefillSpec, pages, page_indptr, page_values, length_info, k_rope_pos_offset):
    """Entry b's K and V rows gathered from pages [P, 2, h_kv, page_size, d]."""
    elem = element_type(spec.dtype)

    def load(b: ir.Value) -> EntryKv:
        table = _page_table(spec, b, page_indptr, length_info)

        def gather(which: int) -> ir.Value:  # 0: keys, 1: values
            def fetch(page, slot, out_indices):
                head, col = out_indices
                return tensor_d.extract(pages, [_clamped_page(page, pages), const_index(which), head, slot, col])
            return _gather_rows(spec, table, page_values, fetch, [spec.h_kv, spec.d], elem)

        return EntryKv(kv_len=table.kv_len, load_keys=lambda: gather(0), load_values=lambda: gather(1),
                       rope_offset=tensor_d.extract(k_rope_pos_offset, [b]))

    return load


def _mla_loader(spec: MlaPagedPrefillSpec, pages, page_indptr, page_values, length_info):
    """Entry b's latent rows from pages [P, page_size, d_latent + d_rope]: keys are whole rows,
    values their first d_latent columns (one shared KV head)."""
    elem = element_type(spec.dtype)

    def load(b: ir.Value) -> EntryKv:
        table = _page_table(spec, b, page_indptr, length_info)

        def fetch(page, slot, out_indices):
            _head, col = out_indices
            return tensor_d.extract(pages, [_clamped_page(page, pages), slot, col])

        rows = _gather_rows(spec, table, page_values, fetch, [1, spec.d_qk], elem)
        values = extract_slice(rows, [0, 0, 0], [dim(rows, 0), 1, spec.d_latent])
        return EntryKv(kv_len=table.kv_len, load_keys=lambda: rows, load_values=lambda: values)

    return load


def build_ragged_prefill(spec: RaggedPrefillSpec, *, row_chunk: int | None) -> ir.Module:
    """``batch_prefill_ragged_kv(q, q_indptr, k, v, kv_indptr, q_rope_position, k_rope_pos_offset,
    causal, rotary_mode, rope_scale, rope_theta, sm_scale) -> (output, lse)``."""
    def emit(q, q_indptr, k, v, kv_indptr, q_rope_position, k_rope_pos_offset,
             causal, rotary_mode, rope_scale, rope_theta, sm_scale, sinks=None):
        rope = RopeArgs(rotary_mode, rope_scale, rope_theta, dict(spec.rope_scaling), spec.rotary_dim)
        return _attend_entries(
            spec, _rotated_if(rope, q, q_rope_position), q_indptr, d_v=spec.d_v,
            load_entry=_ragged_loader(spec, k, v, kv_indptr, k_rope_pos_offset),
            causal=causal, sm_scale=sm_scale, rope=rope, row_chunk=row_chunk, sinks=sinks,
        )

    return function_module(spec, emit)


def build_paged_prefill(spec: PagedPrefillSpec, *, row_chunk: int | None) -> ir.Module:
    """``batch_prefill_paged_kv[_sliding_window](q, q_indptr, pages, page_indptr, page_values,
    length_info, k_rope_pos_offset, q_rope_position, causal, rotary_mode, rope_scale, rope_theta,
    sm_scale) -> (output, lse)``."""
    def emit(q, q_indptr, pages, page_indptr, page_values, length_info, k_rope_pos_offset,
             q_rope_position, causal, rotary_mode, rope_scale, rope_theta, sm_scale, sinks=None):
        rope = RopeArgs(rotary_mode, rope_scale, rope_theta, dict(spec.rope_scaling), spec.rotary_dim)
        return _attend_entries(
            spec, _rotated_if(rope, q, q_rope_position), q_indptr, d_v=spec.d,
            load_entry=_paged_loader(spec, pages, page_indptr, page_values, length_info, k_rope_pos_offset),
            causal=causal, sm_scale=sm_scale, rope=rope, row_chunk=row_chunk, sinks=sinks,
        )

    return function_module(spec, emit)


def build_mla_prefill(spec: MlaPagedPrefillSpec, *, row_chunk: int | None) -> ir.Module:
    """``batch_prefill_paged_kv_mla[_sliding_window](q, q_indptr, pages, page_indptr, page_values,
    length_info, causal, sm_scale) -> (output [Lq, h_q, d_latent], lse)``."""
    def emit(q, q_indptr, pages, page_indptr, page_values, length_info, causal, sm_scale, sinks=None):
        return _attend_entries(
            spec, q, q_indptr, d_v=spec.d_latent,
            load_entry=_mla_loader(spec, pages, page_indptr, page_values, length_info),
            causal=causal, sm_scale=sm_scale, rope=None, row_chunk=row_chunk, sinks=sinks,
        )

    return function_module(spec, emit)
