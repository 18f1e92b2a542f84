"""The one online-softmax emitter every variant uses.

A variant hands over a tile of queries, a KV-tile loader and a mask predicate; the emitter builds
an ``scf.for`` over KV tiles that carries the running max, running sum and accumulator (log2
domain, float32), then normalises. How the tiles are laid out and contracted is a layout object
(mlir/score_tiles.py, chosen per CPU and dtype); the row tiles' shapes (B = batch or work items,
H = KV heads, M = query rows of the tile with the GQA group folded in, N = KV columns of one tile),
the packed tiles' in score_tiles.py:

    q_tile      [B, H, M, d_qk]   dtype or f32 (the dense and KV-cache variants widen to f32 first)
    keys        [B, H, d_qk, N]   same    (from the loader, one KV tile, transposed)
    values      [B, H, N, d_v]    same
    scores      [B, H, M, N]      f32     s = sm_scale * log2(e) * q.k, masked -> -inf
    row_max     [B, H, M]         f32     starts at NO_KEY_MAX (finite, so exp2 never sees inf-inf)
    row_sum     [B, H, M]         f32     sum of 2^(s - row_max) over valid keys
    acc         [B, H, M, d_v]    f32     sum of 2^(s - row_max) * v over valid keys

Masked keys weigh exactly zero (semantics §11.2) and a row that never sees a valid key ends with
output 0 and lse EMPTY_ROW_LSE (§11.3). Per-head sink logits (§13) join the denominator in the
final normalisation only (:func:`sink_normalised`, :func:`sink_lse`), as ``2^(sink - row_max)`` in the same log2 units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, Union

from .ir import (
    affine_map, arith_d, collapse, const_f32, const_index, empty, expand, f32, fill, generic, ir, linalg_d,
    math_d, on_target_device, scf_d, sizes_of,
)
from .score_tiles import ROW_TILES, RowTiles
from .specs import EMPTY_ROW_LSE

LOG2E = 1.0 / math.log(2.0)
NO_KEY_MAX = -1.0e30



@dataclass(frozen=True)
class KvTile:
    """One KV tile as the loader returns it: keys [B, H, d_qk, N] and values [B, H, N, d_v].

    Keys come transposed (d_qk before N) because the QK^T contraction then reads both operands
    along their contiguous dim in the layout IREE's llvm-cpu matmul codegen favours (72 against
    41 GFLOP/s, docs/performance.md).
    """

    keys: ir.Value
    values: ir.Value


@dataclass(frozen=True)
class ScoreIndices:
    """Index values visible to a mask predicate inside the score generic.

    ``b, h, m, n`` are positions inside the tile; ``kv_start`` is the logical KV column of n == 0.
    """

    b: ir.Value
    h: ir.Value
    m: ir.Value
    n: ir.Value
    kv_start: ir.Value


@dataclass(frozen=True)
class ScoreMask:
    """Which (row, column) pairs enter the softmax.

    ``operands`` are extra tensors the predicate reads, each with the score dims it is indexed by
    (e.g. ``(valid_lens, (0,))`` for a per-batch length); the predicate receives their scalars.
    """

    predicate: Callable[[ScoreIndices, Sequence[ir.Value]], ir.Value]
    operands: tuple[tuple[ir.Value, tuple[int, ...]], ...] = ()


@dataclass(frozen=True)
class AttentionTile:
    """Normalised result of one query tile: output [B, H, M, d_v] f32, lse [B, H, M] f32 (base 2)."""

    output: ir.Value
    lse: ir.Value


def score_transform(sm_scale: Union[float, ir.Value], soft_cap: float) -> Callable[[ir.Value], ir.Value]:
    """The map from an f32 dot product ``q.k`` to the log2-domain score both lowerings use:
    ``sm_scale * log2(e) * q.k``, or with logits soft-capping (``soft_cap`` > 0, semantics §11)
    ``soft_cap * log2(e) * tanh(sm_scale * q.k / soft_cap)``. ``sm_scale`` is a Python float or an
    f32 Value (kernels that take it at run time); the constants are built where this is called."""
    runtime = isinstance(sm_scale, ir.Value)
    if not soft_cap:
        factor = arith_d.mulf(sm_scale, const_f32(LOG2E)) if runtime else const_f32(sm_scale * LOG2E)
        return lambda s: arith_d.mulf(s, factor)
    inner = arith_d.divf(sm_scale, const_f32(soft_cap)) if runtime else const_f32(sm_scale / soft_cap)
    outer = const_f32(soft_cap * LOG2E)
    return lambda s: arith_d.mulf(math_d.tanh(arith_d.mulf(s, inner)), outer)


def _scale_and_mask(raw: ir.Value, mask: ScoreMask, kv_start: ir.Value, scale: Callable[[ir.Value], ir.Value],
                    layout: RowTiles) -> ir.Value:
    """scores = scale(raw) where the mask holds, else -inf."""
    rank = ir.RankedTensorType(raw.type).rank
    if mask.operands and layout.packed:
        raise ValueError("a mask with operands needs the row tiles (score_tiles.ROW_TILES)")
    ident = affine_map(rank, range(rank))
    extra_vals = [t for t, _ in mask.operands]
    extra_maps = [affine_map(rank, dims) for _, dims in mask.operands]
    out = empty(sizes_of(raw), f32())
    neg_inf = const_f32(float("-inf"))

    def body(s, *rest):
        extras = rest[:-1]
        loops = [linalg_d.IndexOp(i).result for i in range(rank)]
        idx = ScoreIndices(*layout.score_position(loops, kv_start), kv_start=kv_start)
        valid = mask.predicate(idx, extras)
        return [arith_d.select(valid, scale(s), neg_inf)]

    return generic([raw, *extra_vals], [out], [ident, *extra_maps, ident], "p" * rank, body)[0]


def _reduce_rows(tile: ir.Value, init_value: float, combine, row_chunk: int | None, row_dims=(0, 1, 2)) -> ir.Value:
    """An f32 tile reduced over every loop but ``row_dims`` (the row state's sizes) with
    ``combine``, starting from ``init_value``.

    The init is a fresh fill (not the running state): IREE distributes a reduction only when its
    output starts from a fill, so the running state is combined in a separate elementwise step.
    A [B, H, M, N] row wider than ``row_chunk`` (a multiple of it) is first reduced chunk by chunk,
    [B, H, M, N / chunk, chunk] -> [B, H, M, N / chunk]; ``row_chunk=None`` reduces whole rows.
    """
    shape = ir.RankedTensorType(tile.type).shape
    if len(shape) == 4 and row_dims == (0, 1, 2):
        sizes = sizes_of(tile)[:3]
        width = shape[3]
        if row_chunk is not None and width > row_chunk and width % row_chunk == 0:
            chunks = width // row_chunk
            split = expand(tile, [[0], [1], [2], [3, 4]], [*sizes, chunks, row_chunk])
            init = fill(const_f32(init_value), [*sizes, chunks], f32())
            maps = [affine_map(5, (0, 1, 2, 3, 4)), affine_map(5, (0, 1, 2, 3))]
            tile = generic([split], [init], maps, "ppppr", lambda x, acc: [combine(x, acc)])[0]
    rank = ir.RankedTensorType(tile.type).rank
    sizes = [sizes_of(tile)[d] for d in row_dims]
    init = fill(const_f32(init_value), sizes, f32())
    maps = [affine_map(rank, range(rank)), affine_map(rank, row_dims)]
    iterators = "".join("p" if d in row_dims else "r" for d in range(rank))
    return generic([tile], [init], maps, iterators, lambda x, acc: [combine(x, acc)])[0]


def _elementwise(inputs: Sequence[ir.Value], row_inputs: Sequence[ir.Value], body, row_dims=(0, 1, 2)) -> ir.Value:
    """f32 result shaped like ``inputs[0]``; ``row_inputs`` are row state broadcast over the rest
    (indexed by the loops ``row_dims``)."""
    like = inputs[0]
    rank = ir.RankedTensorType(like.type).rank
    ident = affine_map(rank, tuple(range(rank)))
    row = affine_map(rank, row_dims)
    out = empty(sizes_of(like), f32())
    maps = [ident] * len(inputs) + [row] * len(row_inputs) + [ident]
    return generic([*inputs, *row_inputs], [out], maps, "p" * rank, lambda *a: [body(*a[:-1])])[0]


def _step_state(prev_max, prev_sum, prev_acc, scores, values, row_chunk: int | None, layout: RowTiles):
    """One online-softmax update with the scores and values of a tile (shapes: score_tiles)."""
    rows = layout.row_dims
    tile_max = _reduce_rows(scores, NO_KEY_MAX, arith_d.maximumf, row_chunk, rows)
    new_max = _elementwise([prev_max, tile_max], [], arith_d.maximumf)
    alpha = _elementwise([prev_max, new_max], [], lambda old, new: math_d.exp2(arith_d.subf(old, new)))
    def weight(s, m):
        return math_d.exp2(arith_d.subf(s, m))

    def rows_elementwise(inputs, row_inputs, body):
        return _elementwise(inputs, row_inputs, body, rows)

    probs = layout.probs(scores, weight, new_max, rows_elementwise)
    summed = layout.summed_weights(probs, scores, weight, new_max, rows_elementwise)
    tile_sum = _reduce_rows(summed, 0.0, arith_d.addf, row_chunk, rows)
    new_sum = _elementwise([prev_sum, alpha, tile_sum], [],
                           lambda l, a, t: arith_d.addf(arith_d.mulf(l, a), t))
    pv = layout.probs_times_values(probs, values, sizes_of(prev_acc))
    new_acc = _elementwise([prev_acc, pv], [alpha],
                           lambda acc, x, a: arith_d.addf(arith_d.mulf(acc, a), x), layout.acc_row_dims)
    return new_max, new_sum, new_acc


def row_sinks(sinks: ir.Value, h_kv: int, group: int, tokens: int) -> ir.Value:
    """The sink of every query row of a tile in log2 units, f32 [h_kv, tokens * G]:
    ``log2(e) * sinks[h * G + r % G]`` at (h, r), for ``sinks [h_q]`` f32 in natural-log units
    (row r of KV head h holds token r // G and query head h * G + r % G)."""
    by_head = expand(sinks, [[0, 1]], [h_kv, group])
    maps = [affine_map(3, (0, 2)), affine_map(3, (0, 1, 2))]
    log2e = const_f32(LOG2E)
    spread = generic([by_head], [empty([h_kv, tokens, group], f32())], maps, "ppp",
                     lambda x, _out: [arith_d.mulf(x, log2e)])[0]
    return collapse(spread, [[0], [1, 2]])


def sink_normalised(acc: ir.Value, row_max: ir.Value, row_sum: ir.Value, sink: ir.Value, zero: ir.Value) -> ir.Value:
    """One output element from f32 scalars with a sink (log2 units; ``row_max`` is the base of
    ``acc`` and ``row_sum``): ``acc / (row_sum + 2^(sink - row_max))``, ``zero`` (an f32 0) for a
    row with no valid key (``row_sum == 0``: a NaN sum stays NaN). A sink far above the scores
    makes the added term inf and the output 0, its limit."""
    total = arith_d.addf(row_sum, math_d.exp2(arith_d.subf(sink, row_max)))
    no_key = arith_d.cmpf(arith_d.CmpFPredicate.OEQ, row_sum, zero)
    return arith_d.select(no_key, zero, arith_d.divf(acc, total))


def sink_lse(row_max: ir.Value, row_sum: ir.Value, sink: ir.Value, zero: ir.Value, empty_lse: ir.Value) -> ir.Value:
    """One lse from f32 scalars with a sink (log2 units): ``top + log2(row_sum 2^(row_max - top)
    + 2^(sink - top))``, ``top = max(row_max, sink)`` (no overflow whichever is larger);
    ``empty_lse`` for a row with no valid key."""
    top = arith_d.maximumf(row_max, sink)
    total = arith_d.addf(arith_d.mulf(row_sum, math_d.exp2(arith_d.subf(row_max, top))),
                         math_d.exp2(arith_d.subf(sink, top)))
    no_key = arith_d.cmpf(arith_d.CmpFPredicate.OEQ, row_sum, zero)
    return arith_d.select(no_key, empty_lse, arith_d.addf(top, math_d.log2(total)))


def _finalize(acc: ir.Value, row_max: ir.Value, row_sum: ir.Value, sinks: ir.Value | None,
              layout: RowTiles) -> AttentionTile:
    """output = acc / row_sum and lse = row_max + log2(row_sum), with the rows' sinks
    (``sinks`` [H, M] from :func:`row_sinks`, or None) in the denominator (:func:`sink_normalised`,
    :func:`sink_lse`); rows with no key: 0 and -5e4. Both as [1, H, M, d_v] and [1, H, M] f32
    whatever the layout.

    A row has no valid key exactly when its sum is 0 (every weight was exp2(-inf) = 0). The test
    is ``sum == 0`` rather than ``sum > 0`` so that a NaN sum (NaN in that row's inputs) stays NaN
    in the output instead of passing for an empty row.
    """
    zero = const_f32(0.0)
    empty_lse = const_f32(EMPTY_ROW_LSE)
    if sinks is not None:
        sinks = layout.tile_rows(sinks)
        sink_dims = tuple(range(3 - ir.RankedTensorType(sinks.type).rank, 3))  # of the row state's loops
        output = layout.output_rows(acc, [(row_max, (0, 1, 2)), (row_sum, (0, 1, 2)), (sinks, sink_dims)],
                                    lambda a, m, s, k: sink_normalised(a, m, s, k, zero))
        lse = generic([row_max, row_sum, sinks], [empty(sizes_of(row_max), f32())],
                      [affine_map(3, range(3))] * 2 + [affine_map(3, sink_dims), affine_map(3, range(3))], "ppp",
                      lambda m, s, k, _out: [sink_lse(m, s, k, zero, empty_lse)])[0]
        return AttentionTile(output=output, lse=layout.rows_as_tile(lse))

    def no_key(s):
        return arith_d.cmpf(arith_d.CmpFPredicate.OEQ, s, zero)

    output = layout.output_rows(acc, [(row_sum, (0, 1, 2))],
                                lambda a, s: arith_d.select(no_key(s), zero, arith_d.divf(a, s)))
    lse = _elementwise([row_max, row_sum], [],
                       lambda m, s: arith_d.select(no_key(s), empty_lse, arith_d.addf(m, math_d.log2(s))))
    return AttentionTile(output=output, lse=layout.rows_as_tile(lse))


def unmasked_kv_tiles(kv_len: ir.Value, first_row: ir.Value, diagonal: ir.Value, kv_tile: int,
                      causal: Union[bool, ir.Value]) -> ir.Value:
    """Leading KV tiles every query row from ``first_row`` on sees whole (``online_softmax``'s
    ``unmasked_tiles``): inside ``kv_len`` and, when causal, left of the bottom-right diagonal of
    ``first_row`` (col <= row + diagonal), the most restricted row. ``causal`` is a Python bool,
    or an i1 Value for kernels that take it at run time."""
    inside = arith_d.divsi(kv_len, const_index(kv_tile))
    if causal is False:
        return inside
    first_row_end = arith_d.addi(arith_d.addi(first_row, diagonal), const_index(1))
    left_of_diagonal = arith_d.divsi(arith_d.maxsi(first_row_end, const_index(0)), const_index(kv_tile))
    causal_limit = arith_d.minsi(inside, left_of_diagonal)
    return causal_limit if causal is True else arith_d.select(causal, causal_limit, inside)


def online_softmax(
    q_tile: ir.Value,
    *,
    num_kv_tiles: ir.Value,
    kv_tile: int,
    d_v: int,
    load_kv_tile: Callable[[ir.Value], KvTile],
    mask: ScoreMask,
    sm_scale: Union[float, ir.Value],
    unmasked_tiles: ir.Value | None = None,
    row_chunk: int | None,
    soft_cap: float = 0.0,
    sinks: ir.Value | None = None,
    layout: RowTiles = ROW_TILES,
) -> AttentionTile:
    """Attention of one query tile over ``num_kv_tiles`` KV tiles of ``kv_tile`` columns.

    ``q_tile`` is [B, H, M, d_qk]; ``load_kv_tile(tile_index)`` is called inside the loop body and
    returns that tile's keys and values; ``mask`` decides validity per (b, h, m, n). The result is
    normalised (f32) with a base-2 lse that includes ``sm_scale`` (a Python float folded in as a
    constant, or an f32 Value for kernels that take it at run time).

    ``unmasked_tiles``, when given, is a count of leading tiles the caller knows the mask holds
    everywhere on (e.g. left of the causal diagonal): they run in a first loop without the mask,
    whose per-element index arithmetic is most of the row-softmax dispatch's cost on AVX2.

    ``row_chunk`` is the widest row reduced in one op (see ``_reduce_rows``), or None.
    ``soft_cap`` > 0 caps the logits (see :func:`score_transform`). ``sinks``: the rows' sink
    logits [H, M] in log2 units (:func:`row_sinks`), or None. ``layout``: how the step's tiles
    are laid out and contracted (mlir/score_tiles.py); ``load_kv_tile`` returns its K/V tiles.
    """
    query = layout.query_operand(q_tile)
    state_rows = layout.row_sizes(q_tile)
    acc_sizes = layout.acc_sizes(state_rows, d_v)
    state_sizes = [state_rows, state_rows, acc_sizes]
    init = [fill(const_f32(NO_KEY_MAX), state_rows, f32()), fill(const_f32(0.0), state_rows, f32()),
            fill(const_f32(0.0), acc_sizes, f32())]
    scale = score_transform(sm_scale, soft_cap)

    phases = [(const_index(0), num_kv_tiles, mask)]
    if unmasked_tiles is not None:
        first_masked = arith_d.minsi(unmasked_tiles, num_kv_tiles)
        phases = [(const_index(0), first_masked, None), (first_masked, num_kv_tiles, mask)]
    state = init
    for start, end, phase_mask in phases:
        carried = [on_target_device(value, sizes) for value, sizes in zip(state, state_sizes)]
        loop = scf_d.ForOp(start, end, const_index(1), carried)
        with ir.InsertionPoint(loop.body):
            tile_index = loop.induction_variable
            prev_max, prev_sum, prev_acc = loop.inner_iter_args
            tile = load_kv_tile(tile_index)
            raw = layout.scores(query, tile.keys, kv_tile)
            if phase_mask is None:
                scores = _elementwise([raw], [], scale)
            else:
                kv_start = arith_d.muli(tile_index, const_index(kv_tile))
                scores = _scale_and_mask(raw, phase_mask, kv_start, scale, layout)
            scf_d.YieldOp(list(_step_state(prev_max, prev_sum, prev_acc, scores, tile.values, row_chunk, layout)))
        state = list(loop.results)
    row_max, row_sum, acc = state
    return _finalize(acc, row_max, row_sum, sinks, layout)
