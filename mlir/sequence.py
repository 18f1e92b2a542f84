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
    DYN, affine_map, arith_d, ceil_div, const_index, dim, element_type, empty, extract_slice, f32, fill,
    generic, ir, le, linalg_d, lt, one_of, scf_d, sizes_of, storage_tiles,
    tensor_d, tensor_type, tie_dims, widened,
)
from .abi import function_module
from .layout import group_query_rows
from .masks import sequence_validity
from .online_softmax import ScoreIndices, ScoreMask, online_softmax, row_sinks, unmasked_kv_tiles
from .query_tiles import QueryTiles, kv_tile_loader
from .specs import SMALL_Q_TILE, MaskedSequencePrefillSpec, SequencePrefillSpec

SequenceSpec = Union[SequencePrefillSpec, MaskedSequencePrefillSpec]


def _kv_tiles(x: ir.Value, num_tiles: ir.Value, kv_tile: int, keys: bool) -> ir.Value:
    """[B, L, h_kv, d] -> f32 keys [B, h_kv, num_tiles, d, kv_tile] (each tile transposed, k-major)
    or values [B, h_kv, num_tiles * kv_tile, d]; rows at or past L are zero.

    One generic that reads ``x`` itself (row clamped to L - 1, then zeroed) rather than a
    transpose of a zero-padded copy: the copy cost another K or V of memory and ran as a slow
    element-wise memcpy, and IREE 3.13 folds a plain key transpose into the scores contraction
    inside the loop, which then reads keys [N, d] (n-major) at 52 GFLOP/s instead of 88-97 with
    the tuned tiling (pipeline/tuning.py). With L == 0 there is no row to read, so the tiles are
    then a zero fill (an ``scf.if``).

    The tiles (and the query rows) are f32 whatever the input dtype: the contractions then run
    the tuned f32 code instead of widening f16/bf16 in their inner loop once per use (bf16 and
    f16 13-30% faster, docs/performance.md); it costs K and V once more in f32, O(L).
    """
    length = dim(x, 1)
    batch, h_kv, d = dim(x, 0), *ir.RankedTensorType(x.type).shape[2:]
    elem = f32()
    rows = arith_d.muli(num_tiles, const_index(kv_tile))
    sizes = [batch, h_kv, num_tiles, d, kv_tile] if keys else [batch, h_kv, rows, d]
    zero = arith_d.constant(elem, 0.0)
    result_type = tensor_type([DYN if isinstance(s, ir.Value) else s for s in sizes], elem)
    branch = scf_d.IfOp(lt(const_index(0), length), [result_type], has_else=True)
    with ir.InsertionPoint(branch.then_block):
        last_row = arith_d.subi(length, const_index(1))

        def body(_out):
            index = [linalg_d.IndexOp(i).result for i in range(len(sizes))]
            if keys:  # loops (b, h, t, j, n): row t * kv_tile + n, dim j
                b, h, t, j, n = index
                row = arith_d.addi(arith_d.muli(t, const_index(kv_tile)), n)
            else:  # loops (b, h, row, j)
                b, h, row, j = index
            value = widened(tensor_d.extract(x, [b, arith_d.minsi(row, last_row), h, j]))
            return [arith_d.select(lt(row, length), value, zero)]

        loops = len(sizes)
        scf_d.YieldOp([generic([], [empty(sizes, elem)], [affine_map(loops, range(loops))], "p" * loops, body)[0]])
    with ir.InsertionPoint(branch.else_block):
        scf_d.YieldOp([fill(zero, sizes, elem)])
    return tie_dims(branch.results[0], sizes)


class _Lengths:
    """Index values shared by mask predicates: per-call lengths and the query tile's first token."""

    def __init__(self, q_len: ir.Value, kv_len: ir.Value, group: int):
        self.q_len = q_len
        self.kv_len = kv_len
        self.group = group
        self.diagonal = arith_d.subi(kv_len, q_len)  # col <= row + diagonal (bottom-right causal)

    def token(self, first_token: ir.Value, m: ir.Value) -> ir.Value:
        return arith_d.addi(first_token, arith_d.divui(m, const_index(self.group)))


def _sequence_mask(spec: SequenceSpec, lengths: _Lengths, first_token: ir.Value,
                   valid_len: ir.Value | None = None) -> ScoreMask:
    def predicate(idx: ScoreIndices, _extras):
        col = arith_d.addi(idx.kv_start, idx.n)
        return sequence_validity(spec, col, lambda: lengths.token(first_token, idx.m), q_len=lengths.q_len,
                                 kv_len=lengths.kv_len, diagonal=lengths.diagonal, valid_len=valid_len)

    return ScoreMask(predicate=predicate)


def _visible_kv_tiles(spec: SequenceSpec, q_tile: int, lengths: _Lengths, first_token, num_kv_tiles):
    """KV tiles a query tile must visit: all of them, or up to its last row's diagonal if causal."""
    if not spec.causal:
        return num_kv_tiles
    last_token_end = arith_d.minsi(arith_d.addi(first_token, const_index(q_tile)), lengths.q_len)
    kv_end = arith_d.addi(last_token_end, lengths.diagonal)
    kv_end = arith_d.maxsi(arith_d.minsi(kv_end, lengths.kv_len), const_index(0))
    return ceil_div(kv_end, spec.kv_tile)


def build_sequence_prefill(spec: SequenceSpec, *, row_chunk: int | None) -> ir.Module:
    """The verified module for a dense (or masked) sequence-prefill spec; symbol ``spec.symbol``.
    ``row_chunk``: the widest row the online softmax reduces in one op (None: whole rows)."""
    return function_module(spec, lambda *args, **named: _emit_sized_body(spec, row_chunk, *args, **named))


def _emit_sized_body(spec: SequenceSpec, row_chunk: int | None, q, k, v, valid_lens=None, *, sinks=None):
    """The body with ``spec.q_tile``, or, for a call of at most SMALL_Q_TILE query tokens (a short
    chunk against a long prefix), with SMALL_Q_TILE-token tiles instead of one mostly padded tile."""
    if spec.q_tile <= SMALL_Q_TILE:
        return _emit_body(spec, spec.q_tile, row_chunk, q, k, v, valid_lens, sinks)
    sizes = [[*sizes_of(q)[:3], spec.d], sizes_of(q)[:3]]

    def tied(values):
        return [tie_dims(value, size) for value, size in zip(values, sizes)]

    def body(tile_tokens):
        return lambda _unused: tied(_emit_body(spec, tile_tokens, row_chunk, q, k, v, valid_lens, sinks))

    is_short = le(dim(q, 1), const_index(SMALL_Q_TILE))
    placeholders = [empty(size, ir.RankedTensorType(t).element_type) for size, t in zip(sizes, (q.type, _lse_type(q)))]
    return one_of(is_short, body(SMALL_Q_TILE), body(spec.q_tile), placeholders, tied)


def _lse_type(q: ir.Value) -> ir.Type:
    return tensor_type([DYN, DYN, ir.RankedTensorType(q.type).shape[2]], f32())


def _emit_body(spec: SequenceSpec, tile_tokens: int, row_chunk: int | None, q, k, v, valid_lens=None, sinks=None):
    """Batch entries one at a time (an ``scf.for`` over B), so every dispatch inside works on
    static [1, h_kv, ...] tiles (1.2x faster than a dynamic batch dim, docs/performance.md).
    Query tiles have ``tile_tokens`` tokens; ``sinks`` [h_q] f32 or None (semantics §13)."""
    group, h_kv, d = spec.group_size, spec.h_kv, spec.d
    dt = element_type(spec.dtype)
    batch = dim(q, 0)
    lengths = _Lengths(dim(q, 1), dim(k, 1), group)
    num_q_tiles = ceil_div(lengths.q_len, tile_tokens)
    num_kv_tiles = ceil_div(lengths.kv_len, spec.kv_tile)
    padded_tokens = arith_d.muli(num_q_tiles, const_index(tile_tokens))
    q_rows = group_query_rows(q, h_kv, group, padded_tokens)
    stored_tiles = storage_tiles(lengths.kv_len, spec.kv_tile)
    keys = _kv_tiles(k, stored_tiles, spec.kv_tile, keys=True)
    values = _kv_tiles(v, stored_tiles, spec.kv_tile, keys=False)

    driver = QueryTiles([batch, padded_tokens, spec.h_q, d], [batch, padded_tokens, spec.h_q], group, h_kv)
    tile_sinks = None if sinks is None else row_sinks(sinks, h_kv, group, tile_tokens)

    def entry(b, carried):
        valid_len = None
        if valid_lens is not None:
            valid_len = arith_d.index_cast(ir.IndexType.get(), tensor_d.extract(valid_lens, [b]))
        load_kv_tile = kv_tile_loader(keys, values, b, spec.kv_tile)

        def attend(first_token, tile):
            def softmax(q_tile):
                mask = _sequence_mask(spec, lengths, first_token, valid_len)
                return online_softmax(
                    q_tile,
                    num_kv_tiles=_visible_kv_tiles(spec, tile_tokens, lengths, first_token, num_kv_tiles),
                    kv_tile=spec.kv_tile,
                    d_v=d,
                    load_kv_tile=load_kv_tile,
                    mask=mask,
                    sm_scale=spec.sm_scale,
                    unmasked_tiles=None if valid_len is not None else unmasked_kv_tiles(
                        lengths.kv_len, first_token, lengths.diagonal, spec.kv_tile, spec.causal),
                    row_chunk=row_chunk,
                    soft_cap=spec.logits_soft_cap,
                    sinks=tile_sinks,
                )

            return driver.attend(q_rows, b, first_token, tile_tokens, tile, softmax)

        return driver.tiles(num_q_tiles, tile_tokens, carried, attend)

    out, lse = driver.entries(batch, dt, entry)
    return [extract_slice(out, [0, 0, 0, 0], [batch, lengths.q_len, spec.h_q, d]),
            extract_slice(lse, [0, 0, 0], [batch, lengths.q_len, spec.h_q])]
