"""KV-cache prefill: ``batch_prefill_ragged_kv``, ``batch_prefill_paged_kv[_sliding_window]`` and
``batch_prefill_paged_kv_mla[_sliding_window]`` (semantics §1.1-§1.3, §2-§6, §11).

The kernels keep the seed's arguments (index arrays and runtime scalars) and walk the batch
entries in an ``scf.for`` on the host side of the IREE program, so an entry costs what its own
tokens cost: no entry is padded to the longest one. Per entry:

1. its KV rows are loaded token-major, ``[kv_pad, h_kv, d]`` with ``kv_pad`` its length rounded up
   to the KV tile, by the spec's layout (kv_layouts.py, ``entry_loader``): a slice for ragged KV,
   a gather through the page table for paged KV and MLA;
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
    DYN, arith_d, ceil_div, collapse, const_index, dim, expand, extract_slice, ir, is_one, le, lt, one_of,
    scf_d, sizes_of, storage_tiles, tensor_type, tie_dims,
)
from .abi import function_module, operands
from .kv_layouts import EntryKv
from .layout import group_query_rows
from .mask_rules import CallMask, Lengths, MaskRule, mask_rule
from .online_softmax import ScoreIndices, ScoreMask, online_softmax, row_sinks
from .paging import index_at
from .query_tiles import QueryTiles, kv_tile_loader
from .score_tiles import ROW_TILES, RowTiles
from .rope import apply_rope
from .specs import SMALL_Q_TILE, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec

KvCacheSpec = Union[RaggedPrefillSpec, PagedPrefillSpec, MlaPagedPrefillSpec]


@dataclass(frozen=True)
class RopeArgs:
    """The runtime RoPE scalars: ``rotary_mode`` (i32), ``rope_scale`` and ``rope_theta`` (f32)."""

    rotary_mode: ir.Value
    scale: ir.Value
    theta: ir.Value
    rope_scaling: dict
    rotary_dim: int | None = None


def rotated_if(rope: RopeArgs | None, x: ir.Value, positions: ir.Value) -> ir.Value:
    """``x`` [N, H, D] with RoPE applied when ``rotary_mode == 1`` (``positions``: [N] i32 or a
    scalar i32 first position)."""
    return then_rotated_if(rope, lambda: x, positions, lambda value: [value], [x.type], [sizes_of(x)])[0]


def then_rotated_if(rope: RopeArgs | None, build_x: Callable[[], ir.Value], positions: ir.Value,
                     then: Callable[[ir.Value], list[ir.Value]], result_types: list, sizes: list) -> list[ir.Value]:
    """``then(x)`` for ``x = build_x()``, with RoPE applied to ``x`` first when ``rotary_mode == 1``
    (see ``rotated_if``); ``result_types`` and ``sizes`` describe ``then``'s results.

    ``build_x`` and ``then`` run inside each branch, so without RoPE IREE fuses them: the key
    gather and its tile layout become one dispatch (docs/performance.md, KV-cache entries).
    """
    if rope is None:
        return then(build_x())
    branch = scf_d.IfOp(is_one(rope.rotary_mode), result_types, has_else=True)
    with ir.InsertionPoint(branch.then_block):
        scf_d.YieldOp(then(apply_rope(build_x(), positions, theta=rope.theta, scale=rope.scale,
                                      rope_scaling=rope.rope_scaling, rotary_dim=rope.rotary_dim)))
    with ir.InsertionPoint(branch.else_block):
        scf_d.YieldOp(then(build_x()))
    return [tie_dims(result, size) for result, size in zip(branch.results, sizes)]


def _query_padding(spec: KvCacheSpec, total_q: ir.Value) -> ir.Value:
    """Rows the queries (and outputs) are padded by: one query tile, so that a tile starting
    near the end never reads out of bounds; only SMALL_Q_TILE when the whole call has at most
    that many queries, as every entry then runs one SMALL_Q_TILE tile (a 16-token call pads to
    32 tokens instead of 80)."""
    if spec.q_tile <= SMALL_Q_TILE:
        return const_index(spec.q_tile)
    return arith_d.select(le(total_q, const_index(SMALL_Q_TILE)), const_index(SMALL_Q_TILE),
                          const_index(spec.q_tile))


def _laid_out_kv(spec: KvCacheSpec, kv: EntryKv, rope: RopeArgs | None, d_qk: int, d_v: int, layout: RowTiles):
    """The entry's keys (rotated when its call rotates) and values as ``layout`` stores them
    (row tiles: f32 keys [1, h_kv, tiles, d_qk, kv_tile] and values [1, h_kv, tiles * kv_tile,
    d_v]), which kv_tile_loader reads."""
    h_kv = spec.h_kv
    stored_tiles = storage_tiles(kv.kv_len, spec.kv_tile)

    def kv_tiles(rotated_keys):  # rows past the entry zeroed (score_tiles: token_major_tiles)
        return [layout.token_major_tiles(rotated_keys, kv.kv_len, stored_tiles, spec.kv_tile, True),
                layout.token_major_tiles(kv.load_values(), kv.kv_len, stored_tiles, spec.kv_tile, False)]

    storage = [layout.kv_storage(keys, 1, h_kv, stored_tiles, d, spec.kv_tile) for keys, d in ((True, d_qk), (False, d_v))]
    return then_rotated_if(
        rope, kv.load_keys, kv.rope_offset, kv_tiles,
        [tensor_type([DYN if isinstance(x, ir.Value) else x for x in s.sizes], s.elem) for s in storage],
        [s.sizes for s in storage])


def _tile_softmax(spec: KvCacheSpec, mask: CallMask, entry_mask, lengths: Lengths, load_kv_tile,
                  num_kv_tiles: ir.Value, first_local: ir.Value, tile_tokens: int, *, d_v: int,
                  sm_scale: ir.Value, row_chunk: int | None, sinks: ir.Value | None, layout: RowTiles):
    """The online softmax of one query tile (tokens [first_local, first_local + tile_tokens) of
    the entry) over the KV tiles it can see, masked by the rule (``mask`` bound to the call,
    ``entry_mask`` to the entry); ``sinks``: the tile rows' sinks (online_softmax.row_sinks) or
    None."""
    group = spec.group_size

    def valid(idx: ScoreIndices, _extras):
        col = arith_d.addi(idx.kv_start, idx.n)
        return entry_mask.valid(lengths, lambda: arith_d.addi(first_local, arith_d.divui(idx.m, const_index(group))),
                                col)

    def softmax(q_tile):
        def last_row_end():
            return arith_d.minsi(arith_d.addi(first_local, const_index(tile_tokens)), lengths.q_len)

        return online_softmax(
            q_tile, num_kv_tiles=mask.visible_tiles(lengths, last_row_end, spec.kv_tile, num_kv_tiles),
            kv_tile=spec.kv_tile, d_v=d_v, load_kv_tile=load_kv_tile, mask=ScoreMask(predicate=valid),
            sm_scale=sm_scale,
            # rows past the entry (the next entry's, or padding) only see more than its first row
            unmasked_tiles=mask.unmasked_tiles(lengths, first_local, spec.kv_tile),
            row_chunk=row_chunk,
            soft_cap=spec.logits_soft_cap,
            sinks=sinks,
            layout=layout,
        )

    return softmax


def _attend_entries(
    spec: KvCacheSpec,
    q: ir.Value,
    q_indptr: ir.Value,
    *,
    d_v: int,
    load_entry: Callable[[ir.Value], EntryKv],
    mask_args: dict,
    rule: MaskRule,
    sm_scale: ir.Value,
    rope: RopeArgs | None,
    row_chunk: int | None,
    sinks: ir.Value | None = None,
    layout: RowTiles = ROW_TILES,
) -> list[ir.Value]:
    """Output [Lq, h_q, d_v] (dtype) and lse [Lq, h_q] (f32) for q [Lq, h_q, d_qk] (already rotated).
    ``mask_args``: the call's arguments by name (``rule`` reads its operands);
    ``row_chunk``: the widest row the online softmax reduces in one op (None: whole rows);
    ``sinks``: [h_q] f32 sink logits (semantics §13) or None; ``layout``: the KV step's tiles
    (score_tiles.py), kept when every query tile size of the spec divides into them."""
    group, h_kv = spec.group_size, spec.h_kv
    q_shape = ir.RankedTensorType(q.type)
    d_qk, dt = q_shape.shape[2], q_shape.element_type
    if not all(layout.fits(tokens * group, spec.kv_tile, d_qk, d_v) for tokens in {spec.q_tile, SMALL_Q_TILE}):
        layout = ROW_TILES
    total_q = dim(q, 0)
    padded_tokens = arith_d.addi(total_q, _query_padding(spec, total_q))
    q4 = expand(q, [[0, 1], [2], [3]], [1, total_q, spec.h_q, d_qk])
    q_rows = group_query_rows(q4, h_kv, group, padded_tokens)
    mask = rule.bind(mask_args)
    # The batch's output and lse are carried in token order, padded by one query tile
    # (query_tiles.py). (IREE 3.13: carrying a buffer per entry instead made paged calls fail
    # intermittently, about 1 call in 15: "transient buffer has not been committed".)
    batch = arith_d.subi(dim(q_indptr, 0), const_index(1))
    driver = QueryTiles([1, padded_tokens, spec.h_q, d_v], [1, padded_tokens, spec.h_q], group, h_kv)
    tile_sinks = {tokens: None if sinks is None else row_sinks(sinks, h_kv, group, tokens)
                  for tokens in sorted({spec.q_tile, SMALL_Q_TILE})}

    def entry(b, carried):
        q_start = index_at(q_indptr, b)
        qo_len = arith_d.subi(index_at(q_indptr, arith_d.addi(b, const_index(1))), q_start)
        kv = load_entry(b)
        entry_mask = mask.entry(b)
        num_kv_tiles = ceil_div(kv.kv_len, spec.kv_tile)
        keys, values = _laid_out_kv(spec, kv, rope, d_qk, d_v, layout)
        lengths = Lengths(qo_len, kv.kv_len, arith_d.subi(kv.kv_len, qo_len))
        load_kv_tile = kv_tile_loader(keys, values, 0, spec.kv_tile, layout)

        def attend(first_local, tile_tokens: int, tile):
            """Queries [first_local, first_local + tile_tokens) of the entry against its KV."""
            softmax = _tile_softmax(spec, mask, entry_mask, lengths, load_kv_tile, num_kv_tiles, first_local,
                                    tile_tokens, d_v=d_v, sm_scale=sm_scale, row_chunk=row_chunk,
                                    sinks=tile_sinks[tile_tokens], layout=layout)
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


def rope_arguments(spec: KvCacheSpec, args) -> RopeArgs | None:
    """The call's runtime RoPE scalars (``args`` by name), or None for a variant without RoPE (MLA)."""
    if "rotary_mode" not in args:
        return None
    return RopeArgs(args["rotary_mode"], args["rope_scale"], args["rope_theta"], dict(spec.rope_scaling),
                    spec.rotary_dim)


def build_kv_cache_prefill(spec: KvCacheSpec, *, row_chunk: int | None, rule: MaskRule | None = None,
                           score_tiles: RowTiles = ROW_TILES) -> ir.Module:
    """The kernel of a KV-cache variant, its arguments by name (mlir/abi.py): ``batch_prefill_ragged_kv``,
    ``batch_prefill_paged_kv[_sliding_window]`` or ``batch_prefill_paged_kv_mla[_sliding_window]``
    ``-> (output, lse)``. The spec's layout reads the KV operands it declares, ``rule`` (default:
    the spec's, mask_rules.mask_rule) the mask operands it declares; q is rotated first where the
    variant has RoPE."""
    rule = rule or mask_rule(spec)

    def emit(args):
        rope = rope_arguments(spec, args)
        q = args["q"] if rope is None else rotated_if(rope, args["q"], args["q_rope_position"])
        return _attend_entries(
            spec, q, args["q_indptr"], d_v=spec.d_v,
            load_entry=spec.layout.entry_loader(spec, **operands(spec.layout, args)),
            mask_args=args, rule=rule, sm_scale=args["sm_scale"], rope=rope, row_chunk=row_chunk,
            sinks=args.get("sinks"), layout=score_tiles,
        )

    return function_module(spec, emit)
