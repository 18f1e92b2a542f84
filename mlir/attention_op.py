"""One query band through IREE's ``iree_linalg_ext.online_attention``: the fused lowering's core.

IREE tiles ``online_attention`` over the KV axis itself and decomposes it into the online-softmax
loop inside one dispatch (on CUDA: the ``VectorDistribute`` pipeline with ``mma.sync`` for
f16/bf16 operands). The op returns the unnormalised accumulator and the running max and sum;
two consumer generics, fused into the same dispatch, turn them into the output and the base-2
lse. Shapes (a band of ``band`` query tokens, a multiple of TILE; Tk KV tiles of TILE tokens;
G = h_q // h_kv):

    q_band   [band, h_kv, G, d_qk]       input dtype (token-major: a slice of the padded queries)
    keys     [Tk, h_kv, TILE, d_qk]      input dtype (tile-major, rows past the KV length zero)
    values   [Tk, h_kv, TILE, d_v]       input dtype
    mask     [h_kv, G, band, Tk, TILE]   i1, a generic over indices, fused (nothing stored)
    output   [band, h_kv, G, d_v]        input dtype;  lse [band, h_kv, G] f32, base 2

Loops of the op: ``ALL_LOOPS`` = (h, g, qi, k1, kt, ki, n), less a unit head loop. The band is one static dim
(IREE collapses adjacent static dims, so a [Tb, TILE] split would not survive), tiled by TILE
rows per workgroup. Scaling: IREE multiplies Q by ``scale * log2(e)``
in Q's dtype before the contraction, which would round every query element of f16/bf16 inputs.
The op therefore gets ``scale = ln 2`` (Q times 1) and the region maps the f32 ``q.k`` to the
score (``online_softmax.score_transform``: ``sm_scale * log2(e) * q.k``, soft-capped when asked):
scores are exact f32 products, and ``max + log2(sum)`` is the base-2 lse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Union

from .ir import (
    affine_map, arith_d, collapse, const_f32, const_index, empty, expand, f32, fill, generic, i1, ir, linalg_d,
    math_d, sizes_of,
)
from .online_softmax import score_transform, sink_lse, sink_normalised
from .specs import EMPTY_ROW_LSE

#: Tokens per query tile and per KV tile: the op's innermost dims stay static (a dynamic sequence
#: dim puts IREE's CUDA backend on a one-row-per-workgroup SIMT configuration, without mma).
TILE = 64
#: Discardable attribute on every online_attention op; pipeline/tuning.py replaces it with the
#: target's tile configuration (or removes it, keeping IREE's default).
ATTENTION_MARKER = "linalg_prefill.attention"
# Finite start of the running max: with -inf a fully masked first KV tile gives NaN.
_RUNNING_MAX_START = -3.4028234663852886e38

#: Validity of (query row, KV column) as index values local to the band's entry -> i1.
Validity = Callable[[ir.Value, ir.Value], ir.Value]


#: Loops of the online_attention op of a band, less any unit head loop; the op's ATTENTION_MARKER
#: names the ones it has, and pipeline/tuning.py sizes its tiles by these names (``e``: the
#: entries of a decode pass, mlir/fused_decode.py).
ALL_LOOPS = ("h", "g", "qi", "k1", "kt", "ki", "n")


@dataclass(frozen=True)
class OperandDims:
    """The loops indexing each operand of the op, in the operand's dim order (``rows``: the
    accumulator's, the running max's and sum's; the accumulator adds ``n``). The mask's last
    three dims are always (qi, kt, ki): pipeline/tuning.py reads the query rows there."""

    q: tuple
    k: tuple
    v: tuple
    mask: tuple
    rows: tuple


_BAND_DIMS = OperandDims(q=("qi", "h", "g", "k1"), k=("kt", "h", "ki", "k1"), v=("kt", "h", "ki", "n"),
                         mask=("h", "g", "qi", "kt", "ki"), rows=("qi", "h", "g"))


def attend_band(q_band: ir.Value, keys: ir.Value, values: ir.Value, *, first_row: ir.Value,
                valid: Validity, sm_scale: Union[float, ir.Value], soft_cap: float,
                sinks: ir.Value | None = None) -> tuple[ir.Value, ir.Value]:
    """(output, lse) of one band; ``first_row`` is the entry-local token of the band's row 0 and
    ``valid(row, col)`` decides which pairs enter the softmax (rows and columns entry-local).
    The score of ``q.k`` is ``online_softmax.score_transform(sm_scale, soft_cap)``'s. ``sinks``:
    the heads' sinks [h_kv, G] f32 in log2 units (``online_softmax.row_sinks`` of one token), or
    None (semantics §13)."""
    band, h_kv, group, _d_qk = ir.RankedTensorType(q_band.type).shape
    d_v = ir.RankedTensorType(values.type).shape[3]
    elem = ir.RankedTensorType(q_band.type).element_type
    # A unit head loop (h_kv == 1, as in MLA, or G == 1) is left out of the op: IREE drops unit
    # loops, and the tile configuration must name every loop that remains.
    loops = tuple(name for name in ALL_LOOPS if not (name == "h" and h_kv == 1 or name == "g" and group == 1))
    rows = ("qi", "h", "g")
    mask = _squeezed(_mask(valid, first_row, [h_kv, group, band, sizes_of(keys)[0], TILE]),
                     ("h", "g", "qi", "kt", "ki"), loops)
    row_sizes = [size for name, size in zip(rows, (band, h_kv, group)) if name in loops]
    acc = fill(const_f32(0.0), [*row_sizes, d_v], f32())
    row_max = fill(const_f32(_RUNNING_MAX_START), row_sizes, f32())
    row_sum = fill(const_f32(0.0), row_sizes, f32())
    acc, row_max, row_sum = _online_attention(
        loops, _BAND_DIMS, _squeezed(q_band, (*rows, "k1"), loops), _squeezed(keys, ("kt", "h", "ki", "k1"), loops),
        _squeezed(values, ("kt", "h", "ki", "n"), loops), mask, acc, row_max, row_sum,
        score_transform(sm_scale, soft_cap))
    if sinks is None:
        output = _normalised(acc, row_sum, elem)
        lse = _lse(row_max, row_sum)
    else:
        output, lse = _with_sinks(acc, row_max, row_sum, sinks, rows, ("h", "g"), loops, elem)
    return (_unsqueezed(output, (*rows, "n"), loops, [band, h_kv, group, d_v]),
            _unsqueezed(lse, rows, loops, [band, h_kv, group]))


#: Loops of the op of a decode pass (every entry at once), less a unit head loop.
ENTRY_LOOPS = ("e", "h", "qi", "k1", "kt", "ki", "n")
_ENTRY_DIMS = OperandDims(q=("e", "h", "qi", "k1"), k=("e", "kt", "h", "ki", "k1"), v=("e", "kt", "h", "ki", "n"),
                          mask=("e", "h", "qi", "kt", "ki"), rows=("e", "h", "qi"))
#: Validity of (entry, query row, KV column) -> i1, all index values.
EntryValidity = Callable[[ir.Value, ir.Value, ir.Value], ir.Value]


def attend_entries(q: ir.Value, keys: ir.Value, values: ir.Value, *, valid: EntryValidity,
                   sm_scale: Union[float, ir.Value], soft_cap: float,
                   sinks: ir.Value | None = None) -> tuple[ir.Value, ir.Value]:
    """(output [n, h_kv, R, d_v] in q's dtype, lse [n, h_kv, R] f32) of n entries at once, each
    with its own KV: q [n, h_kv, R, d_qk], keys [n, Tk, h_kv, TILE, d_qk], values [n, Tk, h_kv,
    TILE, d_v]; ``valid(entry, row, col)`` decides which pairs enter the softmax. Scores as in
    :func:`attend_band`; ``sinks``: the rows' sinks [h_kv, R] f32 in log2 units
    (``online_softmax.row_sinks``), or None."""
    entries, h_kv, rows, _d_qk = sizes_of(q)
    d_v = ir.RankedTensorType(values.type).shape[4]
    elem = ir.RankedTensorType(q.type).element_type
    loops = tuple(name for name in ENTRY_LOOPS if not (name == "h" and h_kv == 1))
    dims = _ENTRY_DIMS
    tiles = sizes_of(keys)[1]

    def mask_body(_out):
        e, qi, kt, ki = (linalg_d.IndexOp(i).result for i in (0, 2, 3, 4))
        return [valid(e, qi, arith_d.addi(arith_d.muli(kt, const_index(TILE)), ki))]

    mask = generic([], [empty([entries, h_kv, rows, tiles, TILE], i1())], [affine_map(5, range(5))], "ppppp",
                   mask_body)[0]
    row_sizes = [size for name, size in zip(dims.rows, (entries, h_kv, rows)) if name in loops]
    acc = fill(const_f32(0.0), [*row_sizes, d_v], f32())
    row_max = fill(const_f32(_RUNNING_MAX_START), row_sizes, f32())
    row_sum = fill(const_f32(0.0), row_sizes, f32())
    acc, row_max, row_sum = _online_attention(
        loops, dims, _squeezed(q, dims.q, loops), _squeezed(keys, dims.k, loops), _squeezed(values, dims.v, loops),
        _squeezed(mask, dims.mask, loops), acc, row_max, row_sum, score_transform(sm_scale, soft_cap))
    if sinks is None:
        output = _normalised(acc, row_sum, elem)
        lse = _lse(row_max, row_sum)
    else:
        output, lse = _with_sinks(acc, row_max, row_sum, sinks, dims.rows, ("h", "qi"), loops, elem)
    return (_unsqueezed(output, (*dims.rows, "n"), loops, [entries, h_kv, rows, d_v]),
            _unsqueezed(lse, dims.rows, loops, [entries, h_kv, rows]))


def _groups(names: tuple, loops: tuple) -> list[list[int]]:
    """Reassociation merging each dim whose loop is not in ``loops`` (a unit dim) into a kept one."""
    groups, pending = [], []
    for i, name in enumerate(names):
        pending.append(i)
        if name in loops:
            groups.append(pending)
            pending = []
    if pending:
        groups[-1].extend(pending)
    return groups


def _squeezed(x: ir.Value, names: tuple, loops: tuple) -> ir.Value:
    """``x`` (dims named ``names``) without its dims whose loops the op leaves out."""
    groups = _groups(names, loops)
    return x if len(groups) == len(names) else collapse(x, groups)


def _unsqueezed(x: ir.Value, names: tuple, loops: tuple, sizes: list) -> ir.Value:
    """The inverse of :func:`_squeezed`: ``x`` back to the full ``sizes``."""
    groups = _groups(names, loops)
    return x if len(groups) == len(names) else expand(x, groups, sizes)


def _mask(valid: Validity, first_row: ir.Value, sizes: list) -> ir.Value:
    """i1 [h_kv, G, band, Tk, TILE]: ``valid(first_row + qi, kt * TILE + ki)``."""

    def body(_out):
        qi, kt, ki = (linalg_d.IndexOp(i).result for i in (2, 3, 4))
        col = arith_d.addi(arith_d.muli(kt, const_index(TILE)), ki)
        return [valid(arith_d.addi(first_row, qi), col)]

    return generic([], [empty(sizes, i1())], [affine_map(5, range(5))], "ppppp", body)[0]


def _online_attention(loops, dims: OperandDims, q, k, v, mask, acc, row_max, row_sum, score):
    """The op over ``loops`` on operands indexed as ``dims`` says (dims whose loop is not in
    ``loops`` are absent from the operands); its region maps the f32 ``q.k`` through ``score``;
    returns (acc, max, sum)."""
    n = len(loops)

    def m(*names):
        return affine_map(n, [loops.index(d) for d in names if d in loops])

    rows = dims.rows
    maps = [m(*dims.q), m(*dims.k), m(*dims.v), ir.AffineMap.get(n, 0, []),
            m(*dims.mask), m(*rows, "n"), m(*rows), m(*rows)]
    op = ir.Operation.create(
        "iree_linalg_ext.online_attention",
        results=[acc.type, row_max.type, row_sum.type],
        operands=[q, k, v, const_f32(math.log(2.0)), mask, acc, row_max, row_sum],
        attributes={
            "indexing_maps": ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps]),
            "operandSegmentSizes": ir.DenseI32ArrayAttr.get([1, 1, 1, 1, 1, 1, 1, 1]),
            ATTENTION_MARKER: ir.ArrayAttr.get([ir.StringAttr.get(name) for name in loops]),
        },
        regions=1,
    )
    block = op.regions[0].blocks.append(f32())
    with ir.InsertionPoint(block):
        ir.Operation.create("iree_linalg_ext.yield", operands=[score(block.arguments[0])])
    return list(op.results)


def _no_key(row_sum: ir.Value) -> ir.Value:
    """A row saw no valid key exactly when its sum is 0 (a NaN sum stays NaN, as in online_softmax)."""
    return arith_d.cmpf(arith_d.CmpFPredicate.OEQ, row_sum, const_f32(0.0))


def _normalised(acc: ir.Value, row_sum: ir.Value, elem: ir.Type) -> ir.Value:
    """``acc / sum`` in ``elem``, shaped like ``acc`` [..., h_kv, G, d_v]; 0 for rows without a
    valid key."""
    sizes = sizes_of(acc)
    rank = len(sizes)
    zero = const_f32(0.0)

    def body(a, s, _out):
        value = arith_d.select(_no_key(s), zero, arith_d.divf(a, s))
        return [value if elem == f32() else arith_d.truncf(elem, value)]

    maps = [affine_map(rank, range(rank)), affine_map(rank, range(rank - 1)), affine_map(rank, range(rank))]
    return generic([acc, row_sum], [empty(sizes, elem)], maps, "p" * rank, body)[0]


def _lse(row_max: ir.Value, row_sum: ir.Value) -> ir.Value:
    """``max + log2(sum)`` [Tb, TILE, h_kv, G] f32; EMPTY_ROW_LSE for rows without a valid key.
    A generic of its own: one generic with both results cost an 8.7 KB stack frame on CUDA."""
    empty_lse = const_f32(EMPTY_ROW_LSE)

    def body(m, s, _out):
        return [arith_d.select(_no_key(s), empty_lse, arith_d.addf(m, math_d.log2(s)))]

    rank = ir.RankedTensorType(row_max.type).rank
    ident = affine_map(rank, range(rank))
    return generic([row_max, row_sum], [empty(sizes_of(row_max), f32())], [ident] * 3, "p" * rank, body)[0]


def _with_sinks(acc: ir.Value, row_max: ir.Value, row_sum: ir.Value, sinks: ir.Value, rows: tuple,
                sink_dims: tuple, loops: tuple, elem: ir.Type) -> tuple[ir.Value, ir.Value]:
    """:func:`_normalised` and :func:`_lse` with each row's sink in the denominator
    (online_softmax.sink_normalised, sink_lse), in f32 before the output's cast to ``elem``:
    ``acc`` [*rows, d_v], ``row_max`` and ``row_sum`` [*rows] (less the dims whose loops are not
    in ``loops``), ``sinks`` with the dims ``sink_dims`` (named as in ``rows``; squeezed here)."""
    kept = [name for name in rows if name in loops]
    sink_positions = [kept.index(name) for name in sink_dims if name in loops]
    sinks = _squeezed(sinks, sink_dims, loops) if sink_positions else collapse(sinks, [])
    rank = len(kept)
    row_map, sink_map = affine_map(rank + 1, range(rank)), affine_map(rank + 1, sink_positions)
    ident = affine_map(rank + 1, range(rank + 1))
    zero, empty_lse = const_f32(0.0), const_f32(EMPTY_ROW_LSE)

    def body(a, m, s, k, _out):
        value = sink_normalised(a, m, s, k, zero)
        return [value if elem == f32() else arith_d.truncf(elem, value)]

    output = generic([acc, row_max, row_sum, sinks], [empty(sizes_of(acc), elem)],
                     [ident, row_map, row_map, sink_map, ident], "p" * (rank + 1), body)[0]
    rows_ident = affine_map(rank, range(rank))
    lse = generic([row_max, row_sum, sinks], [empty(sizes_of(row_max), f32())],
                  [rows_ident, rows_ident, affine_map(rank, sink_positions), rows_ident], "p" * rank,
                  lambda m, s, k, _out: [sink_lse(m, s, k, zero, empty_lse)])[0]
    return output, lse
