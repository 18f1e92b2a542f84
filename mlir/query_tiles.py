"""The loop around the attention of one query tile, shared by the dense and KV-cache families of
both lowerings: batch entries one after the other, each entry's queries in tiles (the fused
lowering's bands), each tile attended over its KV and written back in token order. A family
supplies only how an entry's K/V are laid out, how a tile's KV is masked, and how many query
tiles an entry has; a lowering supplies the attention of a tile (the linalg online softmax and
:meth:`QueryTiles.attend`, or the fused ``online_attention`` band).

    driver = QueryTiles(out_sizes, lse_sizes, group, h_kv)
    output, lse = driver.entries(count, dtype, lambda entry, carried: driver.tiles(
        tile_count, tile_tokens, carried, lambda first, carried: driver.attend(
            q_rows, entry, first, tile_tokens, carried, softmax)))

The loops carry (output, lse, fence): the output [B, L_pad, h_q, d_v] and lse [B, L_pad, h_q]
in token order, padded to whole query tiles, each tile written in place (their initial values
go through ``on_target_device``, see layout.write_tile for why the padding is needed), and, in
the linalg lowering (``fenced``), the previous tile's fence (layout.waited).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .ir import IndexLike, arith_d, const_index, empty, f32, ir, on_target_device, scf_d, tie_dims
from .layout import fence_after, first_fence, waited, write_tile
from .online_softmax import AttentionTile, KvTile
from .score_tiles import ROW_TILES, RowTiles

Carried = list  # [output, lse, fence] (fenced) or [output, lse]


@dataclass(frozen=True)
class QueryTiles:
    """The carried output and lse sizes ([B, L_pad, h_q, d_v], [B, L_pad, h_q]), the GQA group
    and KV heads the query rows are folded with (layout.group_query_rows), whether the loops
    carry a fence (the linalg lowering's tiles wait for the previous one), and the tile layout
    whose query rows :meth:`attend` slices (score_tiles.py: f32 rows, or rows packed per call)."""

    out_sizes: Sequence[IndexLike]
    lse_sizes: Sequence[IndexLike]
    group: int
    h_kv: int
    fenced: bool = True
    layout: RowTiles = ROW_TILES

    def tied(self, carried: Carried) -> Carried:
        """The carried values with their dynamic sizes tied (IREE then updates them in place)."""
        return [tie_dims(carried[0], self.out_sizes), tie_dims(carried[1], self.lse_sizes), *carried[2:]]

    def entries(self, count: ir.Value, dtype: ir.Type, body: Callable[[ir.Value, Carried], Carried]) -> list[ir.Value]:
        """(output, lse) of an ``scf.for`` over ``count`` entries; ``body(entry, carried)``
        returns the carried values after the entry (``carried`` as the loop has them: pass them
        to :meth:`tiles` or through :meth:`tied`)."""
        initial = [on_target_device(empty(self.out_sizes, dtype), self.out_sizes),
                   on_target_device(empty(self.lse_sizes, f32()), self.lse_sizes)]
        if self.fenced:
            initial.append(first_fence())
        loop = scf_d.ForOp(const_index(0), count, const_index(1), initial)
        with ir.InsertionPoint(loop.body):
            scf_d.YieldOp(body(loop.induction_variable, list(loop.inner_iter_args)))
        return self.tied(loop.results)[:2]

    def tiles(self, count: ir.Value, tile_tokens: int, carried: Carried,
              attend: Callable[[ir.Value, Carried], Carried]) -> Carried:
        """An ``scf.for`` over ``count`` query tiles of ``tile_tokens`` tokens; ``attend(first,
        carried)`` attends the tile whose first token (within the entry) is ``first``."""
        loop = scf_d.ForOp(const_index(0), count, const_index(1), self.tied(carried))
        with ir.InsertionPoint(loop.body):
            inner = self.tied(loop.inner_iter_args)
            first = arith_d.muli(loop.induction_variable, const_index(tile_tokens))
            scf_d.YieldOp(attend(first, inner))
        return self.tied(loop.results)

    def attend(self, q_rows: ir.Value, entry: IndexLike, first_token: ir.Value, tile_tokens: int, carried: Carried,
               softmax: Callable[[ir.Value], AttentionTile]) -> Carried:
        """One query tile of the linalg lowering (fenced): rows of tokens [first_token, first_token + tile_tokens) of ``q_rows``
        ([B, h_kv, L_pad * G, d_qk], or as ``layout.query_rows`` packs them) at batch index ``entry``, attended by ``softmax(q_tile)`` (the
        family's mask and KV) and written into the carried output and lse at ``first_token``.
        The tile waits for the previous one (layout.waited) before it reads its rows."""
        out_acc, lse_acc, fence = carried
        first_row = arith_d.addi(arith_d.muli(first_token, const_index(self.group)), waited(fence))
        q_tile = self.layout.query_tile(q_rows, entry, first_row, tile_tokens * self.group)
        result = softmax(q_tile)
        return [write_tile(result.output, out_acc, entry, first_token, self.group),
                write_tile(result.lse, lse_acc, entry, first_token, self.group), fence_after(result.lse)]


def kv_tile_loader(keys: ir.Value, values: ir.Value, entry: IndexLike, kv_tile: int,
                   layout: RowTiles = ROW_TILES) -> Callable[[ir.Value], KvTile]:
    """The emitter's ``load_kv_tile`` over keys and values stored as ``layout`` stores them
    (score_tiles.py; row tiles: keys [B, h_kv, tiles, d_qk, kv_tile], values
    [B, h_kv, tiles * kv_tile, d_v]) at batch index ``entry``."""

    def load(tile_index: ir.Value) -> KvTile:
        tile_keys, tile_values = layout.load(keys, values, entry, tile_index, kv_tile)
        return KvTile(keys=tile_keys, values=tile_values)

    return load
