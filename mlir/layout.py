"""Row layouts shared by the variants: GQA groups folded into query rows, and back.

A KV head's G = h_q // h_kv query heads are folded into its rows, token-major and head-minor,
so one K/V tile serves the whole group:

    q    [B, L, h_q, d]  ->  [B, h_kv, L_pad * G, d]    row r: token r // G, head h * G + r % G
    rows [B, h_kv, L_pad * G, ...]  ->  [B, L, h_q, ...]  (the inverse, padding dropped)
"""

from __future__ import annotations

from typing import Sequence

from .ir import (
    IndexLike, affine_map, arith_d, collapse, const_f32, const_index, convert, empty, expand, extract_slice, f32, fill,
    generic, insert_slice, ir, sizes_of, tensor_d, transpose, zero_padded,
)
from .online_softmax import EMPTY_ROW_LSE


def group_query_rows(q: ir.Value, h_kv: int, group: int, padded_len: ir.Value) -> ir.Value:
    """[B, Lq, h_q, d] -> zero-padded [B, h_kv, padded_len * G, d] (token-major, head-minor rows)."""
    batch, length, _, d = sizes_of(q)
    q5 = expand(q, [[0], [1], [2, 3], [4]], [batch, length, h_kv, group, d])
    qt = transpose(q5, (0, 2, 1, 3, 4))
    padded = zero_padded(qt, [batch, h_kv, padded_len, group, d])
    return collapse(padded, [[0], [1], [2, 3], [4]])


def ungroup_rows(rows: ir.Value, h_kv: int, group: int, length: ir.Value, padded_tokens: ir.Value) -> ir.Value:
    """[B, h_kv, padded_tokens * G, ...] -> [B, length, h_q, ...]: the inverse of the query layout.

    ``padded_tokens`` is passed in rather than read back with ``tensor.dim``: ``rows`` is usually
    the result of a loop, and IREE cannot resolve the dynamic dims of loop results.
    """
    shape = ir.RankedTensorType(rows.type).shape
    batch = sizes_of(rows)[0]
    tail = list(shape[3:])
    r5 = expand(rows, [[0], [1], [2, 3], *[[4 + i] for i in range(len(tail))]],
                [batch, h_kv, padded_tokens, group, *tail])
    valid = extract_slice(r5, [0] * (4 + len(tail)), [batch, h_kv, length, group, *tail])
    perm = (0, 2, 1, 3, *range(4, 4 + len(tail)))
    back = transpose(valid, perm)
    return collapse(back, [[0], [1], [2, 3], *[[4 + i] for i in range(len(tail))]])


def wait_for(lse_tile: ir.Value) -> ir.Value:
    """An index that is always 0 but that the host can only know after ``lse_tile`` is computed.

    Adding it to the next offset makes the host wait for each query tile before issuing the
    next. Without it the host loop runs ahead of the device and the transient buffers of every
    in-flight KV step stay allocated (measured: peak memory grew faster than linearly in L).
    The lse tile is first reduced into a 0-d tensor so the read is valid even for B == 0.
    """
    zero_d = fill(const_f32(EMPTY_ROW_LSE), [], f32())
    maps = [affine_map(3, (0, 1, 2)), ir.AffineMap.get(3, 0, [])]
    smallest = generic([lse_tile], [zero_d], maps, "rrr", lambda x, acc: [arith_d.minimumf(x, acc)])[0]
    value = tensor_d.extract(smallest, [])
    impossible = arith_d.cmpf(arith_d.CmpFPredicate.OLT, value, const_f32(-1.0e30))
    return arith_d.select(impossible, const_index(1), const_index(0))


def pack_tile(output: ir.Value, lse: ir.Value) -> ir.Value:
    """output [1, H, M, d] and lse [1, H, M] (f32) -> one f32 tile [1, H, M, d + 1], lse last.

    The sequence kernel's query-tile loop carries its results in this one tensor. (Before loop
    inits went through ``on_target_device``, IREE 3.13 copied carried tensors whole on every
    iteration, two carried tensors even more than one; now the tile is inserted in place.)
    """
    _, heads, rows, d = ir.RankedTensorType(output.type).shape
    packed = empty([1, heads, rows, d + 1], f32())
    packed = insert_slice(output, packed, [0, 0, 0, 0], [1, heads, rows, d])
    lse_column = expand(lse, [[0], [1], [2, 3]], [1, heads, rows, 1])
    return insert_slice(lse_column, packed, [0, 0, 0, d], [1, heads, rows, 1])


def unpack_rows(packed: ir.Value, sizes: Sequence[IndexLike], elem: ir.Type) -> tuple[ir.Value, ir.Value]:
    """[B, H, R, d + 1] f32 -> output [B, H, R, d] in ``elem`` and lse [B, H, R] f32.

    ``sizes`` are the packed tensor's sizes (it comes out of a loop, whose dims IREE cannot read).
    """
    batch, heads, rows, width = sizes
    output = convert(extract_slice(packed, [0, 0, 0, 0], [batch, heads, rows, width - 1]), elem)
    lse = extract_slice(packed, [0, 0, 0, width - 1], [batch, heads, rows, 1])
    return output, collapse(lse, [[0], [1], [2, 3]])
