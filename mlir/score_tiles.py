"""How the llvm-cpu online softmax lays out a KV step's tiles and contracts them: two layouts,
chosen per CPU and dtype in one place (pipeline/cpu_tiles.py, the ``score_tiles`` hook of the
backend record), shared by every variant of the linalg lowering.

:data:`ROW_TILES` (CPUs without AVX-512, shapes the packed tiles do not divide, the GPU backends'
linalg lowering): f32 rows, the contractions ``linalg.generic``s the pipeline tunes
(pipeline/tuning.py)::

    query tile  [B, H, M, d_qk]  f32          keys   [B, H, d_qk, N] f32 (one KV tile, transposed)
    scores      [B, H, M, N]     f32          values [B, H, N, d_v]  f32
    probs       [B, H, M, N]     f32          acc    [B, H, M, d_v]  f32       row state [B, H, M]

:class:`PackedTiles` (AVX-512: bf16 operands with avx512_bf16, else f32 ones): the operands in the
tile layout of ``linalg.batch_mmt4d`` (m0 x n0 x k0 tiles, f32 sums), the KV heads as the batch
and B a static 1 (every variant's tiles are [1, H, ...])::

    query tile  [H, M/m0, d_qk/k0, m0, k0]    operand type   packed once per query tile
    keys        [H, N/n0, d_qk/k0, n0, k0]    operand type   packed once per call (dense) or entry
    values      [H, d_v/n0, N/k0, n0, k0]     operand type   the same
    scores      [H, M/m0, N/n0, m0, n0]       f32
    probs       [H, M/m0, N/k0, m0, k0]       operand type   the P.V operand (bf16: the error model's u_P)
    acc         [H, M/m0, d_v/n0, m0, n0]     f32                         row state [H, M/m0, m0]

A layout gives the online softmax (mlir/online_softmax.py) its contractions, the loops of each
tile that name a query row (``row_dims``: reductions, broadcasts and the row state follow them),
the (b, h, m, n) of a score element for the mask, and the normalised output back as [1, H, M, d_v].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .ir import (
    DYN, IndexLike, affine_map, arith_d, bitcast, collapse, const_f32, const_index, element_type, empty, expand,
    extract_slice, f32, fill, generic, ir, linalg_d, mark_tiling, narrowed, own_dispatch, sizes_of, tensor_d,
    tensor_type, widened,
)
from .layout import group_query_rows

#: Discardable attribute on the two contraction generics of :data:`ROW_TILES` (scores and probs x
#: values). The pipeline replaces it with a target-specific tiling where it has measured one
#: (pipeline/tuning.py).
CONTRACTION_MARKER = "linalg_prefill.contraction"


def contract_generic(lhs: ir.Value, rhs: ir.Value, init: ir.Value, lhs_dims, rhs_dims, out_dims) -> ir.Value:
    """``init + sum_k f32(lhs) * f32(rhs)`` as a marked ``linalg.generic``, k the last loop."""
    loops = len(out_dims) + 1
    maps = [affine_map(loops, lhs_dims), affine_map(loops, rhs_dims), affine_map(loops, out_dims)]

    def body(a, b, acc):
        return [arith_d.addf(acc, arith_d.mulf(widened(a), widened(b)))]

    result = generic([lhs, rhs], [init], maps, "p" * (loops - 1) + "r", body)[0]
    result.owner.attributes[CONTRACTION_MARKER] = ir.UnitAttr.get()
    return result


def _contract(lhs: ir.Value, rhs: ir.Value, init: ir.Value, lhs_dims, rhs_dims, out_dims) -> ir.Value:
    """:func:`contract_generic` over loops (b, h, m, x, k). With a static unit B (every variant's
    tiles are [1, H, ...]) the generic is built without it, as loops (h, m, x, k): IREE drops unit
    loops anyway, and rebuilding the op would discard the tiling the pipeline attaches to it."""
    if all(ir.RankedTensorType(x.type).shape[0] == 1 for x in (lhs, rhs, init)):
        squeeze = [[0, 1], [2], [3]]
        shape = ir.RankedTensorType(init.type).shape
        result = contract_generic(collapse(lhs, squeeze), collapse(rhs, squeeze), collapse(init, squeeze),
                                  *(tuple(d - 1 for d in dims[1:]) for dims in (lhs_dims, rhs_dims, out_dims)))
        return expand(result, squeeze, [1, *shape[1:]])
    return contract_generic(lhs, rhs, init, lhs_dims, rhs_dims, out_dims)


@dataclass(frozen=True)
class KvStorage:
    """How a variant stores its K or V tiles for a layout: the stored tensor's ``sizes`` and, for
    the loops of one generic over them, the (b, h, row, dim) of the source element each
    position holds (``source(loop_indices, kv_tile)``)."""

    sizes: list
    source: Callable[[Sequence[ir.Value]], tuple]
    elem: ir.Type


def converted(elem: ir.Type, value: ir.Value) -> ir.Value:
    """A float scalar as ``elem``: widened to f32 and rounded to ``elem`` where it differs."""
    if value.type == elem:
        return value
    wide = widened(value)
    return wide if elem == f32() else narrowed(elem, wide)


def _zeroed_past(tiled: ir.Value, sizes: list, loops_of_source: tuple, column: Callable, kv_len: ir.Value,
                 elem: ir.Type) -> ir.Value:
    """One generic over ``sizes`` reading ``tiled`` (an entry's token-major K or V, expanded) at the
    loops ``loops_of_source`` (one per dim of ``tiled``), converted to ``elem``, zero where
    ``column(loop indices)`` (the entry-local KV row) is at or past ``kv_len``: nothing another
    entry (or NaN padding) left there can reach this entry's result (a masked key weighs 0, and
    0 * NaN would still be NaN)."""
    zero = arith_d.constant(elem, 0.0)
    rank = len(sizes)

    def body(value, _out):
        col = column([linalg_d.IndexOp(i).result for i in range(rank)])
        value = converted(elem, value)
        return [arith_d.select(arith_d.cmpi(arith_d.CmpIPredicate.slt, col, kv_len), value, zero)]

    source = ir.AffineMap.get(rank, 0, [ir.AffineDimExpr.get(d) for d in loops_of_source])
    return generic([tiled], [empty(sizes, elem)], [source, affine_map(rank, range(rank))], "p" * rank, body)[0]


class RowTiles:
    """f32 rows and tuned generic contractions (module docstring)."""

    row_dims = (0, 1, 2)
    acc_row_dims = (0, 1, 2)
    packed = False

    def fits(self, rows: int, kv_tile: int, d_qk: int, d_v: int) -> bool:
        """Whether query tiles of ``rows`` rows, KV tiles and head dims fit the layout (any do)."""
        return True

    def describe(self) -> str:
        """One line for ``linalg-prefill show-config``."""
        return "row tiles (f32 generic contractions)"

    def query_rows(self, q: ir.Value, h_kv: int, group: int, padded_len: ir.Value) -> ir.Value:
        """q [B, Lq, h_q, d] -> the call's query rows, f32 [B, h_kv, padded_len * G, d] in grouped
        rows (layout.group_query_rows), rows of tokens at or past Lq zero."""
        return group_query_rows(q, h_kv, group, padded_len)

    def query_tile(self, q_rows: ir.Value, entry: IndexLike, first_row: ir.Value, rows: int) -> ir.Value:
        """Rows [first_row, first_row + rows) of the query rows at batch index ``entry``: [1, H, rows, d]."""
        _, h_kv, _, d = ir.RankedTensorType(q_rows.type).shape
        return extract_slice(q_rows, [entry, 0, first_row, 0], [1, h_kv, rows, d])

    def query_operand(self, q_tile: ir.Value) -> ir.Value:
        """The query tile [B, H, M, d_qk] as the scores contraction reads it."""
        return q_tile

    def row_sizes(self, q_tile: ir.Value) -> list:
        return sizes_of(q_tile)[:3]

    def scores(self, query: ir.Value, keys: ir.Value, kv_tile: int) -> ir.Value:
        """Raw dot products [B, H, M, N] f32 of a query operand and one KV tile's keys [B, H, d, N]."""
        sizes = [*sizes_of(query)[:3], kv_tile]
        return _contract(query, keys, fill(const_f32(0.0), sizes, f32()), (0, 1, 2, 4), (0, 1, 4, 3), (0, 1, 2, 3))

    def score_position(self, loops: Sequence[ir.Value], kv_start: ir.Value) -> tuple:
        """(b, h, m, n) of a score element from the loop indices of a generic over the scores."""
        return tuple(loops)

    def probs(self, scores: ir.Value, weight: Callable, row_max: ir.Value, elementwise) -> ir.Value:
        """The softmax weights ``weight(s, max)`` as the P.V contraction reads them."""
        return elementwise([scores], [row_max], weight)

    def summed_weights(self, probs: ir.Value, scores: ir.Value, weight: Callable, row_max: ir.Value,
                       elementwise) -> ir.Value:
        """The f32 weights whose row sums enter the running sum (the probs themselves here)."""
        return probs

    def acc_sizes(self, row_sizes: list, d_v: int) -> list:
        return [*row_sizes, d_v]

    def probs_times_values(self, probs: ir.Value, values: ir.Value, acc_sizes: list) -> ir.Value:
        """P [B, H, M, N] x values [B, H, N, d_v] -> [B, H, M, d_v] f32 (loops b, h, m, d, n)."""
        return _contract(probs, values, fill(const_f32(0.0), acc_sizes, f32()), (0, 1, 2, 4), (0, 1, 4, 3), (0, 1, 2, 3))

    def output_rows(self, acc: ir.Value, row_inputs: Sequence[tuple[ir.Value, tuple]], body) -> ir.Value:
        """``body(acc element, *row scalars)`` over acc [B, H, M, d_v] -> [B, H, M, d_v] f32; each row
        input is (tensor, its dims among (b, h, m))."""
        rank = 4
        maps = [affine_map(rank, range(rank)), *(affine_map(rank, dims) for _, dims in row_inputs),
                affine_map(rank, range(rank))]
        return generic([acc, *(t for t, _ in row_inputs)], [empty(sizes_of(acc), f32())], maps, "pppp",
                       lambda *a: [body(*a[:-1])])[0]

    def rows_as_tile(self, rows: ir.Value) -> ir.Value:
        """Row state -> [B, H, M] (the lse of a tile)."""
        return rows

    def tile_rows(self, per_row: ir.Value) -> ir.Value:
        """[H, M] per-row values (e.g. sinks) -> indexable by the row state's dims minus the first."""
        return per_row

    def token_major_tiles(self, x: ir.Value, kv_len: ir.Value, tiles: ir.Value, kv_tile: int, keys: bool) -> ir.Value:
        """Token-major K or V [tiles * kv_tile, h, d] of one entry -> its stored keys [1, h, tiles, d,
        kv_tile] or values [1, h, tiles * kv_tile, d] (as :meth:`kv_storage` with B = 1), f32, rows
        at or past ``kv_len`` zero."""
        h, d = ir.RankedTensorType(x.type).shape[1:]
        tiled = expand(x, [[0, 1], [2], [3]], [tiles, kv_tile, h, d])

        def column(loops):  # tile t, row n within it
            return arith_d.addi(arith_d.muli(loops[1], const_index(kv_tile)), loops[3 if keys else 2])

        if keys:  # loops (h, t, j, n)
            result = _zeroed_past(tiled, [h, tiles, d, kv_tile], (1, 3, 0, 2), column, kv_len, f32())
            return expand(result, [[0, 1], [2], [3], [4]], [1, h, tiles, d, kv_tile])
        result = _zeroed_past(tiled, [h, tiles, kv_tile, d], (1, 2, 0, 3), column, kv_len, f32())  # (h, t, n, j)
        return expand(collapse(result, [[0], [1, 2], [3]]), [[0, 1], [2], [3]],
                      [1, h, arith_d.muli(tiles, const_index(kv_tile)), d])

    def kv_storage(self, keys: bool, batch: IndexLike, h_kv: int, tiles: IndexLike, d: int, kv_tile: int) -> KvStorage:
        """keys [B, h_kv, tiles, d, kv_tile] (each tile transposed) or values [B, h_kv, tiles * kv_tile, d]."""
        if keys:
            def source(loops):  # (b, h, t, j, n)
                b, h, t, j, n = loops
                return b, h, arith_d.addi(arith_d.muli(t, const_index(kv_tile)), n), j
            return KvStorage([batch, h_kv, tiles, d, kv_tile], source, f32())
        rows = arith_d.muli(tiles, const_index(kv_tile)) if isinstance(tiles, ir.Value) else tiles * kv_tile
        return KvStorage([batch, h_kv, rows, d], lambda loops: tuple(loops), f32())

    def load(self, keys: ir.Value, values: ir.Value, entry: IndexLike, tile_index: ir.Value, kv_tile: int):
        """(keys [1, H, d_qk, N], values [1, H, N, d_v]) of one KV tile of stored tiles."""
        _, h_kv, _, d_qk, _ = ir.RankedTensorType(keys.type).shape
        d_v = ir.RankedTensorType(values.type).shape[3]
        start = arith_d.muli(tile_index, const_index(kv_tile))
        tile_keys = extract_slice(keys, [entry, 0, tile_index, 0, 0], [1, h_kv, 1, d_qk, kv_tile])
        return (collapse(tile_keys, [[0], [1], [2, 3], [4]]),
                extract_slice(values, [entry, 0, start, 0], [1, h_kv, kv_tile, d_v]))


ROW_TILES = RowTiles()


@dataclass(frozen=True)
class PackedTiles(RowTiles):
    """Operands of type ``dtype`` packed in m0 x n0 x k0 tiles, contracted by ``linalg.batch_mmt4d``
    (module docstring). ``m0``, ``n0``, ``k0``: IREE's mmt4d tile for the CPU and operand type."""

    dtype: str = "bfloat16"
    m0: int = 16
    n0: int = 16
    k0: int = 2

    row_dims = (0, 1, 3)
    acc_row_dims = (0, 1, 3)
    packed = True

    def fits(self, rows: int, kv_tile: int, d_qk: int, d_v: int) -> bool:
        """Whether query tiles of ``rows`` rows, KV tiles and head dims divide into whole packed tiles."""
        return (rows % self.m0 == 0 and kv_tile % self.n0 == 0 and kv_tile % self.k0 == 0
                and d_qk % self.k0 == 0 and d_v % self.n0 == 0)

    def _elem(self) -> ir.Type:
        return element_type(self.dtype)

    def describe(self) -> str:
        return f"packed {self.m0}x{self.n0}x{self.k0} {self.dtype} tiles (batch_mmt4d)"

    def query_rows(self, q: ir.Value, h_kv: int, group: int, padded_len: ir.Value) -> ir.Value:
        """q [B, Lq, h_q, d] -> the call's query rows packed once, [B, h_kv, padded_len * G / m0,
        d / k0, m0, k0] in the operand type (grouped rows as layout.group_query_rows orders them),
        when G divides m0: one generic over q zero-padded to ``padded_len`` tokens, whose loops
        (b, h, m1, k1, t, g, k) read q [B, M1, m0 / G, h_kv, G, d / k0, k0] as a plain transpose,
        in a dispatch of its own with its own tiles (pipeline/cpu_tiles.py). Other groups keep the f32
        rows, packed tile by tile (:meth:`query_operand`)."""
        if self.m0 % group:
            return group_query_rows(q, h_kv, group, padded_len)
        batch, length, _, d = sizes_of(q)
        elem = self._elem()
        dynamic = ir.ShapedType.get_dynamic_size()
        pad = tensor_d.PadOp(q.type, q, [], [arith_d.subi(padded_len, length)], [0] * 4, [0, dynamic, 0, 0])
        with ir.InsertionPoint(pad.region.blocks.append(*[ir.IndexType.get()] * 4)):
            tensor_d.YieldOp(arith_d.constant(ir.RankedTensorType(q.type).element_type, 0.0))
        tokens_per_tile = self.m0 // group
        m1 = arith_d.divui(padded_len, const_index(tokens_per_tile))
        split = expand(pad.result, [[0], [1, 2], [3, 4], [5, 6]],
                       [batch, m1, tokens_per_tile, h_kv, group, d // self.k0, self.k0])
        sizes = [batch, h_kv, m1, d // self.k0, tokens_per_tile, group, self.k0]

        def transposed():
            packed = generic([split], [empty(sizes, elem)],
                             [affine_map(7, (0, 2, 4, 1, 5, 3, 6)), affine_map(7, range(7))], "p" * 7,
                             lambda x, _out: [converted(elem, x)])[0]
            mark_tiling(packed, "dense.query_packing", columns=d // self.k0, tokens=tokens_per_tile, group=group,
                        k0=self.k0)
            return packed

        packed = own_dispatch(transposed, tensor_type([DYN, h_kv, DYN, *sizes[3:]], elem), sizes)
        return collapse(packed, [[0], [1], [2], [3], [4, 5], [6]])

    def query_tile(self, q_rows: ir.Value, entry: IndexLike, first_row: ir.Value, rows: int) -> ir.Value:
        """Packed rows: [1, H, rows / m0, d / k0, m0, k0] (``first_row`` a multiple of m0); f32 rows as
        the row tiles slice them."""
        shape = ir.RankedTensorType(q_rows.type).shape
        if len(shape) == 4:
            return super().query_tile(q_rows, entry, first_row, rows)
        first = arith_d.divui(first_row, const_index(self.m0))
        return extract_slice(q_rows, [entry, 0, first, 0, 0, 0], [1, shape[1], rows // self.m0, *shape[3:]])

    def query_operand(self, q_tile: ir.Value) -> ir.Value:
        """A query tile -> [H, M/m0, d/k0, m0, k0]: packed rows as they are; f32 rows [1, H, M, d]
        packed here, in the operand type (bf16 rows were widened from bf16: the narrowing is exact)."""
        if ir.RankedTensorType(q_tile.type).rank == 6:
            return collapse(q_tile, [[0, 1], [2], [3], [4], [5]])
        _, heads, rows, d = ir.RankedTensorType(q_tile.type).shape
        split = expand(collapse(q_tile, [[0, 1], [2], [3]]), [[0], [1, 2], [3, 4]],
                       [heads, rows // self.m0, self.m0, d // self.k0, self.k0])
        return self._narrowed(split, [heads, rows // self.m0, d // self.k0, self.m0, self.k0], (0, 1, 3, 2, 4))

    def _narrowed(self, source: ir.Value, sizes: list, read: tuple) -> ir.Value:
        """A transpose of ``source`` into ``sizes`` (loop i of the result reads source dim read[i]),
        in the packed dtype."""
        elem = self._elem()
        rank = len(sizes)
        source_dims = [0] * rank
        for loop, dim_ in enumerate(read):
            source_dims[dim_] = loop
        return generic([source], [empty(sizes, elem)], [affine_map(rank, source_dims), affine_map(rank, range(rank))],
                       "p" * rank, lambda x, _out: [narrowed(elem, x)])[0]

    def row_sizes(self, q_tile: ir.Value) -> list:
        shape = ir.RankedTensorType(q_tile.type).shape
        if len(shape) == 6:
            return [shape[1], shape[2], self.m0]
        _, heads, rows, _ = shape
        return [heads, rows // self.m0, self.m0]

    def scores(self, query: ir.Value, keys: ir.Value, kv_tile: int) -> ir.Value:
        heads, m1 = ir.RankedTensorType(query.type).shape[:2]
        init = fill(const_f32(0.0), [heads, m1, kv_tile // self.n0, self.m0, self.n0], f32())
        return linalg_d.batch_mmt4d(query, keys, outs=[init])

    def score_position(self, loops: Sequence[ir.Value], kv_start: ir.Value) -> tuple:
        h, m1, n1, m0, n0 = loops
        m = arith_d.addi(arith_d.muli(m1, const_index(self.m0)), m0)
        n = arith_d.addi(arith_d.muli(n1, const_index(self.n0)), n0)
        return const_index(0), h, m, n

    def probs(self, scores: ir.Value, weight: Callable, row_max: ir.Value, elementwise) -> ir.Value:
        """The weights in the operand type as P.V's lhs, [H, M1, N/k0, m0, k0], in two steps: the
        weights in the scores' layout [H, M1, N1, m0, n0], then each tile's transpose with its k0
        consecutive weights moved as one integer (``flow.tensor.bitcast`` between the two, free).

        The transpose on its own is a plain 32-bit transpose that IREE vectorises; written into the
        weights' generic it had a 2-element innermost dim and ran at 9 cycles an element
        (dense bf16 L=2048: 100 ms of 244; 5.5 ms this way, docs/performance.md)."""
        heads, m1, n1, m0, n0 = ir.RankedTensorType(scores.type).shape
        elem = self._elem()
        maps = [affine_map(5, range(5)), affine_map(5, self.row_dims), affine_map(5, range(5))]
        weights = generic([scores, row_max], [empty([heads, m1, n1, m0, n0], elem)], maps, "p" * 5,
                          lambda s, m, _out: [narrowed(elem, weight(s, m))])[0]
        word = ir.IntegerType.get_signless(self.k0 * ir.FloatType(elem).width)
        groups = n0 // self.k0
        words = bitcast(weights, [heads, m1, n1, m0, groups], word)
        moved = generic([words], [empty([heads, m1, n1, groups, m0], word)],
                        [affine_map(5, (0, 1, 2, 4, 3)), affine_map(5, range(5))], "p" * 5, lambda x, _out: [x])[0]
        return bitcast(moved, [heads, m1, n1 * groups, m0, self.k0], elem)

    def summed_weights(self, probs: ir.Value, scores: ir.Value, weight: Callable, row_max: ir.Value,
                       elementwise) -> ir.Value:
        """The f32 weights, not the rounded P.V operand: the lse keeps f32 sums (semantics §12;
        summing the bf16 weights moved the lse by up to 2^-8, 28x its bound)."""
        return elementwise([scores], [row_max], weight)

    def acc_sizes(self, row_sizes: list, d_v: int) -> list:
        heads, m1, m0 = row_sizes
        return [heads, m1, d_v // self.n0, m0, self.n0]

    def probs_times_values(self, probs: ir.Value, values: ir.Value, acc_sizes: list) -> ir.Value:
        return linalg_d.batch_mmt4d(probs, values, outs=[fill(const_f32(0.0), acc_sizes, f32())])

    def output_rows(self, acc: ir.Value, row_inputs: Sequence[tuple[ir.Value, tuple]], body) -> ir.Value:
        """acc [H, M1, D1, m0, n0] -> [1, H, M, d_v]: loops (h, m1, m0, d1, n0), rows at (h, m1, m0)."""
        heads, m1, d1, m0, n0 = ir.RankedTensorType(acc.type).shape
        maps = [affine_map(5, (0, 1, 3, 2, 4)), *(affine_map(5, dims) for _, dims in row_inputs),
                affine_map(5, range(5))]
        out = generic([acc, *(t for t, _ in row_inputs)], [empty([heads, m1, m0, d1, n0], f32())], maps, "ppppp",
                      lambda *a: [body(*a[:-1])])[0]
        return expand(collapse(out, [[0], [1, 2], [3, 4]]), [[0, 1], [2], [3]], [1, heads, m1 * m0, d1 * n0])

    def rows_as_tile(self, rows: ir.Value) -> ir.Value:
        heads, m1, m0 = ir.RankedTensorType(rows.type).shape
        return expand(collapse(rows, [[0], [1, 2]]), [[0, 1], [2]], [1, heads, m1 * m0])

    def tile_rows(self, per_row: ir.Value) -> ir.Value:
        heads, rows = ir.RankedTensorType(per_row.type).shape
        return expand(per_row, [[0], [1, 2]], [heads, rows // self.m0, self.m0])

    def token_major_tiles(self, x: ir.Value, kv_len: ir.Value, tiles: ir.Value, kv_tile: int, keys: bool) -> ir.Value:
        """Token-major K or V [tiles * kv_tile, h, d] of one entry -> its stored tiles (:meth:`kv_storage`
        with B = 1, whose ``source`` gives each element's row) in the operand type, rows at or past
        ``kv_len`` zero."""
        h, d = ir.RankedTensorType(x.type).shape[1:]
        storage = self.kv_storage(keys, 1, h, tiles, d, kv_tile)
        if keys:  # loops (h, t, n1, k1, n0, k0) read x as [t, n1, n0, h, k1, k0]
            split, source = [tiles, kv_tile // self.n0, self.n0, h, d // self.k0, self.k0], (1, 2, 4, 0, 3, 5)
        else:  # loops (h, t, d1, k1, d0, k0) read x as [t, k1, k0, h, d1, d0]
            split, source = [tiles, kv_tile // self.k0, self.k0, h, d // self.n0, self.n0], (1, 3, 5, 0, 2, 4)
        zero_entry = const_index(0)
        result = _zeroed_past(expand(x, [[0, 1, 2], [3], [4, 5]], split), storage.sizes[1:], source,
                              lambda loops: storage.source([zero_entry, *loops])[2], kv_len, storage.elem)
        return expand(result, [[0, 1], [2], [3], [4], [5], [6]], storage.sizes)

    def kv_storage(self, keys: bool, batch: IndexLike, h_kv: int, tiles: IndexLike, d: int, kv_tile: int) -> KvStorage:
        """keys [B, h_kv, tiles, N/n0, d/k0, n0, k0] or values [B, h_kv, tiles, d/n0, N/k0, n0, k0]."""
        def row_in(t, within):
            return arith_d.addi(arith_d.muli(t, const_index(kv_tile)), within)

        def flat(outer, size, inner):
            return arith_d.addi(arith_d.muli(outer, const_index(size)), inner)

        if keys:
            def source(loops):  # (b, h, t, n1, k1, n0, k0)
                b, h, t, n1, k1, n0, k0 = loops
                return b, h, row_in(t, flat(n1, self.n0, n0)), flat(k1, self.k0, k0)
            return KvStorage([batch, h_kv, tiles, kv_tile // self.n0, d // self.k0, self.n0, self.k0], source,
                             self._elem())

        def source(loops):  # (b, h, t, d1, k1, d0, k0)
            b, h, t, d1, k1, d0, k0 = loops
            return b, h, row_in(t, flat(k1, self.k0, k0)), flat(d1, self.n0, d0)
        return KvStorage([batch, h_kv, tiles, d // self.n0, kv_tile // self.k0, self.n0, self.k0], source,
                         self._elem())

    def load(self, keys: ir.Value, values: ir.Value, entry: IndexLike, tile_index: ir.Value, kv_tile: int):
        """(keys [H, N/n0, d_qk/k0, n0, k0], values [H, d_v/n0, N/k0, n0, k0]) of one KV tile."""
        def tile(stored):
            shape = ir.RankedTensorType(stored.type).shape
            one = extract_slice(stored, [entry, 0, tile_index, 0, 0, 0, 0], [1, *shape[1:2], 1, *shape[3:]])
            return collapse(one, [[0, 1, 2], [3], [4], [5], [6]])
        return tile(keys), tile(values)


def packed_tiles_for(dtype: str, cpu_features: frozenset) -> PackedTiles | None:
    """The packed layout of ``dtype`` on a CPU with ``cpu_features`` (names as in /proc/cpuinfo),
    or None where the row tiles stay (measured, dense causal h_q 32, h_kv 8, d 128, 2 threads:
    docs/performance.md, packed tiles): bf16 operands on avx512_bf16 (IREE's 16x16x2 bf16 mmt4d);
    f32 operands for f32 and f16 on other AVX-512 CPUs (16x16x1; IREE's f16 tiles ran slower than
    f32 ones, 156 against 224 GFLOP/s). AVX2 keeps the row tiles: its 8x8x1 f32 tiles ran 0.86x of
    them (built for znver3)."""
    if dtype == "bfloat16" and "avx512_bf16" in cpu_features:
        return PackedTiles(dtype="bfloat16", m0=16, n0=16, k0=2)
    if dtype in ("float32", "float16", "bfloat16") and "avx512f" in cpu_features:
        return PackedTiles(dtype="float32", m0=16, n0=16, k0=1)
    return None
