"""Dense sequence prefill: ``batch_sequence_prefill_kv`` and ``batch_sequence_prefill_kv_masked``.

Layout inside the kernel (G = h_q // h_kv folded into the query rows, so each K/V tile is loaded
once per KV head):

    q  [B, Lq, h_q, d]  -> [B, h_kv, Lq_pad * G, d] f32  row r holds token r // G, head h*G + r % G
    k  [B, Lk, h_kv, d] -> [B, h_kv, Lk_pad / kv_tile, d, kv_tile] f32  (tiles transposed, contiguous)
    v  [B, Lk, h_kv, d] -> [B, h_kv, Lk_pad, d] f32
    output [B, Lq_pad, h_q, d] and lse [B, Lq_pad, h_q]: each query tile is written back in token
    order as soon as it is done (layout.write_tile); the padding is sliced off at the end.

An outer ``scf.for`` walks query tiles of ``q_tile`` tokens; for each, the online-softmax
emitter walks KV tiles of ``kv_tile`` columns. With a causal mask the KV loop stops at the last
tile the query tile can see, so fully masked tiles cost nothing. Peak scratch per step is one
[B, h_kv, q_tile * G, kv_tile] f32 score tile: no Lq x Lk buffer exists at any length.
"""

from __future__ import annotations

from typing import Union

from .ir import (
    DYN, arith_d, ceil_div, const_index, dim, element_type, empty, extract_slice, f32, ir, le,
    one_of, sizes_of, storage_tiles, tensor_type, tie_dims,
)
from .abi import function_module
from .kv_layouts import DENSE
from .mask_rules import CallMask, Lengths, MaskRule, mask_rule
from .online_softmax import ScoreIndices, ScoreMask, online_softmax, row_sinks
from .score_tiles import ROW_TILES, RowTiles
from .query_tiles import QueryTiles, kv_tile_loader
from .specs import SMALL_Q_TILE, MaskedSequencePrefillSpec, SequencePrefillSpec

SequenceSpec = Union[SequencePrefillSpec, MaskedSequencePrefillSpec]


def _kv_tiles(x: ir.Value, num_tiles: ir.Value, kv_tile: int, keys: bool, layout: RowTiles,
              scales: ir.Value | None, dt: ir.Type) -> ir.Value:
    """[B, L, h_kv, d] -> the stored keys or values of ``layout`` (score_tiles: row tiles f32 keys
    [B, h_kv, num_tiles, d, kv_tile], each tile transposed, or values [B, h_kv, num_tiles * kv_tile, d];
    packed tiles in the dtype); rows at or past L are zero. An 8-bit ``x`` is read through its
    KV head's ``scales`` [h_kv] into the compute dtype ``dt`` (kv_layouts.dequantized) as stored.

    One generic that reads ``x`` itself (row clamped to L - 1, then zeroed) rather than a
    transpose of a zero-padded copy: the copy cost another K or V of memory and ran as a slow
    element-wise memcpy, and IREE 3.13 folds a plain key transpose into the scores contraction
    inside the loop, which then reads keys [N, d] (n-major) at 52 GFLOP/s instead of 88-97 with
    the tuned tiling (pipeline/tuning.py). With L == 0 there is no row to read, so the tiles are
    then a zero fill (an ``scf.if``).

    The row tiles (and the query rows) are f32 whatever the input dtype: the contractions then run
    the tuned f32 code instead of widening f16/bf16 in their inner loop once per use (bf16 and
    f16 13-30% faster, docs/performance.md); it costs K and V once more in f32, O(L).
    """
    length = dim(x, 1)
    batch, h_kv, d = dim(x, 0), *ir.RankedTensorType(x.type).shape[2:]
    storage = layout.kv_storage(keys, batch, h_kv, num_tiles, d, kv_tile)
    return DENSE.stored(x, length, storage.sizes, storage.source, scales, dt, storage.elem)


def _token(first_token: ir.Value, m: ir.Value, group: int) -> ir.Value:
    """The entry-local token of query-tile row ``m`` (rows hold token-major GQA groups)."""
    return arith_d.addi(first_token, arith_d.divui(m, const_index(group)))


def _sequence_mask(mask, lengths: Lengths, first_token: ir.Value, group: int) -> ScoreMask:
    """The score predicate of a query tile whose first token is ``first_token`` (``mask``: the
    rule bound to the batch entry)."""
    def predicate(idx: ScoreIndices, _extras):
        col = arith_d.addi(idx.kv_start, idx.n)
        return mask.valid(lengths, lambda: _token(first_token, idx.m, group), col)

    return ScoreMask(predicate=predicate)


def build_sequence_prefill(spec: SequenceSpec, *, row_chunk: int | None, rule: MaskRule | None = None,
                           score_tiles: RowTiles = ROW_TILES) -> ir.Module:
    """The verified module for a dense (or masked) sequence-prefill spec; symbol ``spec.symbol``.
    ``row_chunk``: the widest row the online softmax reduces in one op (None: whole rows);
    ``rule``: the mask (default: the spec's, mask_rules.mask_rule), which reads the operands it
    declares by name; ``score_tiles``: the KV step's tile layout (score_tiles.py), kept for
    the query tiles it divides."""
    rule = rule or mask_rule(spec)

    def emit(args):
        return _emit_sized_body(spec, row_chunk, score_tiles, rule.bind(args), args["q"], args["k"], args["v"],
                                sinks=args.get("sinks"), scales=(args.get("k_scale"), args.get("v_scale")))

    return function_module(spec, emit)


def _emit_sized_body(spec: SequenceSpec, row_chunk: int | None, layout: RowTiles, mask: CallMask, q, k, v, *,
                     sinks=None, scales=(None, None)):
    """The body with ``spec.q_tile``, or, for a call of at most SMALL_Q_TILE query tokens (a short
    chunk against a long prefix), with SMALL_Q_TILE-token tiles instead of one mostly padded tile.
    ``scales``: (k_scale, v_scale) [h_kv] of an 8-bit k and v, else Nones."""
    if spec.q_tile <= SMALL_Q_TILE:
        return _emit_body(spec, spec.q_tile, row_chunk, layout, mask, q, k, v, sinks, scales)
    sizes = [[*sizes_of(q)[:3], spec.d], sizes_of(q)[:3]]

    def tied(values):
        return [tie_dims(value, size) for value, size in zip(values, sizes)]

    def body(tile_tokens):
        return lambda _unused: tied(_emit_body(spec, tile_tokens, row_chunk, layout, mask, q, k, v, sinks, scales))

    is_short = le(dim(q, 1), const_index(SMALL_Q_TILE))
    placeholders = [empty(size, ir.RankedTensorType(t).element_type) for size, t in zip(sizes, (q.type, _lse_type(q)))]
    return one_of(is_short, body(SMALL_Q_TILE), body(spec.q_tile), placeholders, tied)


def _lse_type(q: ir.Value) -> ir.Type:
    return tensor_type([DYN, DYN, ir.RankedTensorType(q.type).shape[2]], f32())


def _emit_body(spec: SequenceSpec, tile_tokens: int, row_chunk: int | None, layout: RowTiles, mask: CallMask, q, k, v,
               sinks=None, scales=(None, None)):
    """Batch entries one at a time (an ``scf.for`` over B), so every dispatch inside works on
    static [1, h_kv, ...] tiles (1.2x faster than a dynamic batch dim, docs/performance.md).
    Query tiles have ``tile_tokens`` tokens; ``layout`` the KV step's tiles (the row tiles where
    these query tiles do not divide into it); ``mask`` is the rule bound to the call; ``sinks``
    [h_q] f32 or None (semantics §13)."""
    group, h_kv, d = spec.group_size, spec.h_kv, spec.d
    if not layout.fits(tile_tokens * group, spec.kv_tile, d, d):
        layout = ROW_TILES
    dt = element_type(spec.dtype)
    batch = dim(q, 0)
    q_len, kv_len = dim(q, 1), dim(k, 1)
    lengths = Lengths(q_len, kv_len, arith_d.subi(kv_len, q_len))
    num_q_tiles = ceil_div(lengths.q_len, tile_tokens)
    num_kv_tiles = ceil_div(lengths.kv_len, spec.kv_tile)
    padded_tokens = arith_d.muli(num_q_tiles, const_index(tile_tokens))
    q_rows = layout.query_rows(q, h_kv, group, padded_tokens)
    stored_tiles = storage_tiles(lengths.kv_len, spec.kv_tile)
    keys = _kv_tiles(k, stored_tiles, spec.kv_tile, True, layout, scales[0], dt)
    values = _kv_tiles(v, stored_tiles, spec.kv_tile, False, layout, scales[1], dt)

    driver = QueryTiles([batch, padded_tokens, spec.h_q, d], [batch, padded_tokens, spec.h_q], group, h_kv,
                        layout=layout)
    tile_sinks = None if sinks is None else row_sinks(sinks, h_kv, group, tile_tokens)

    def entry(b, carried):
        entry_mask = mask.entry(b)
        load_kv_tile = kv_tile_loader(keys, values, b, spec.kv_tile, layout)

        def attend(first_token, tile):
            def softmax(q_tile):
                def last_row_end():
                    return arith_d.minsi(arith_d.addi(first_token, const_index(tile_tokens)), lengths.q_len)

                return online_softmax(
                    q_tile,
                    num_kv_tiles=mask.visible_tiles(lengths, last_row_end, spec.kv_tile, num_kv_tiles),
                    kv_tile=spec.kv_tile,
                    d_v=d,
                    load_kv_tile=load_kv_tile,
                    mask=_sequence_mask(entry_mask, lengths, first_token, group),
                    sm_scale=spec.sm_scale,
                    unmasked_tiles=mask.unmasked_tiles(lengths, first_token, spec.kv_tile),
                    row_chunk=row_chunk,
                    soft_cap=spec.logits_soft_cap,
                    sinks=tile_sinks,
                    layout=layout,
                )

            return driver.attend(q_rows, b, first_token, tile_tokens, tile, softmax)

        return driver.tiles(num_q_tiles, tile_tokens, carried, attend)

    out, lse = driver.entries(batch, dt, entry)
    return [extract_slice(out, [0, 0, 0, 0], [batch, lengths.q_len, spec.h_q, d]),
            extract_slice(lse, [0, 0, 0], [batch, lengths.q_len, spec.h_q])]
