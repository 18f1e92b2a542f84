"""Row layouts shared by the variants: GQA groups folded into query rows, and back.

A KV head's G = h_q // h_kv query heads are folded into its rows, token-major and head-minor,
so one K/V tile serves the whole group:

    q    [B, L, h_q, d]  ->  [B, h_kv, L_pad * G, d]    row r: token r // G, head h * G + r % G
    tile [1, h_kv, T * G, ...]      ->  out[b, t0 : t0 + T] of [B, L_pad, h_q, ...]  (the inverse,
                                        one query tile at a time, into a token-order output)
"""

from __future__ import annotations

from .ir import (
    IndexLike, affine_map, arith_d, collapse, const_f32, const_index, empty, expand, f32, fill,
    generic, insert_slice, ir, on_target_device, sizes_of, tensor_d, widened,
)
from .specs import EMPTY_ROW_LSE


def group_query_rows(q: ir.Value, h_kv: int, group: int, padded_len: ir.Value) -> ir.Value:
    """[B, Lq, h_q, d] -> f32 [B, h_kv, padded_len * G, d] (token-major, head-minor rows), rows of
    tokens at or past Lq zero.

    One widening transpose, zero-padded with ``tensor.pad``: IREE fills the padded tensor and
    writes the rows into it in place (the alternatives tried copied or gathered:
    docs/performance.md, f32 K/V tiles and query rows).
    """
    batch, length, _, d = sizes_of(q)
    q5 = expand(q, [[0], [1], [2, 3], [4]], [batch, length, h_kv, group, d])

    def widen(x, _out):
        return [widened(x)]

    rows = generic([q5], [empty([batch, h_kv, length, group, d], f32())],
                   [affine_map(5, (0, 2, 1, 3, 4)), affine_map(5, range(5))], "ppppp", widen)[0]
    dynamic = ir.ShapedType.get_dynamic_size()
    pad = tensor_d.PadOp(rows.type, rows, [], [arith_d.subi(padded_len, length)], [0] * 5, [0, 0, dynamic, 0, 0])
    with ir.InsertionPoint(pad.region.blocks.append(*[ir.IndexType.get()] * 5)):
        tensor_d.YieldOp(const_f32(0.0))
    return collapse(pad.result, [[0], [1], [2, 3], [4]])


def write_tile(rows: ir.Value, dest: ir.Value, entry: IndexLike, first_token: ir.Value, group: int) -> ir.Value:
    """``dest`` [B, L_pad, h_q, ...] with ``dest[entry, first_token : first_token + T]`` replaced by
    one query tile ``rows`` [1, h_kv, T * G, ...] (f32, grouped rows) in token order, converted to
    ``dest``'s element type.

    The transpose is one elementwise generic that IREE fuses with the tile's normalisation; the
    insert is an in-place copy of T contiguous tokens (docs/performance.md). IREE 3.13: ``dest``
    must be padded to whole tiles: a dynamic-size insert, or a loop result returned without a
    final slice, makes it copy the whole carried output on every iteration.
    """
    shape = ir.RankedTensorType(rows.type).shape
    h_kv, tail = shape[1], list(shape[3:])
    tokens = shape[2] // group
    rank = 4 + len(tail)
    tail_groups = [[4 + i] for i in range(len(tail))]
    grouped = expand(rows, [[0], [1], [2, 3], *tail_groups], [1, h_kv, tokens, group, *tail])
    elem = ir.RankedTensorType(dest.type).element_type

    def body(x, _out):
        return [x if elem == x.type else arith_d.truncf(elem, x)]

    read = affine_map(rank, (0, 2, 1, 3, *range(4, rank)))  # loops (b, t, h, g, ...)
    ordered = generic([grouped], [empty([1, tokens, h_kv, group, *tail], elem)],
                      [read, affine_map(rank, range(rank))], "p" * rank, body)[0]
    return insert_slice(collapse(ordered, [[0], [1], [2, 3], *tail_groups]), dest,
                        [entry, first_token, 0, *[0] * len(tail)], [1, tokens, h_kv * group, *tail])


def first_fence() -> ir.Value:
    """The fence a loop over query tiles starts with (see :func:`fence_after`): a 0-d f32 constant,
    which needs no dispatch (a fill did).

    The first tile still reads it back, which completes only after the dispatches queued before
    it (docs/performance.md, fences). IREE 3.13: skipping that read with an ``scf.if`` failed
    two-entry calls ("transient buffer has not been committed" at hal.fence.await).
    """
    zero = ir.DenseElementsAttr.get_splat(ir.RankedTensorType.get([], f32()), ir.FloatAttr.get(f32(), 0.0))
    return on_target_device(arith_d.constant(zero.type, zero), [])


def fence_after(lse_tile: ir.Value) -> ir.Value:
    """A 0-d f32 tensor (the smallest lse of ``lse_tile`` [B, H, M]) that exists only once that
    query tile is computed. The loops carry it to the next tile, which passes it to
    :func:`waited`. Reduced to 0-d so that it is valid even for B == 0."""
    zero_d = fill(const_f32(EMPTY_ROW_LSE), [], f32())
    maps = [affine_map(3, (0, 1, 2)), ir.AffineMap.get(3, 0, [])]
    return generic([lse_tile], [zero_d], maps, "rrr", lambda x, acc: [arith_d.minimumf(x, acc)])[0]


def waited(fence: ir.Value) -> ir.Value:
    """An index that is always 0 but that the host can only know once ``fence`` is computed.

    Adding it to an offset of the next query tile makes the host wait for the previous tile
    before it issues the next one; without it the transient buffers of every in-flight KV step
    stay allocated. The wait sits at the start of the next tile, so the last tile of a call does
    not wait (docs/performance.md, fences).
    """
    value = tensor_d.extract(fence, [])
    impossible = arith_d.cmpf(arith_d.CmpFPredicate.OLT, value, const_f32(-1.0e30))
    return arith_d.select(impossible, const_index(1), const_index(0))
