"""The decode pass in the fused lowering (the CUDA target's): every entry in one online_attention.

Same signature and semantics as ``decode.build_decode`` (the llvm-cpu lowering), and the same
variant logic (``decode.KvCache``: page table, sliding-window remap, ragged blocks; the base spec's
mask rule, ``mask_rules.py``). The structure is the fused lowering's (fused_kernels.py): K and V are
gathered once into tile-major rows, then one ``iree_linalg_ext.online_attention`` over (entry,
KV head, query row) holds every entry's KV loop in one dispatch. Shapes (n entries, h = h_kv,
R = queries x G rows per KV head, R' = R rounded up to ``ROW_MULTIPLE``, W table width,
Tk = ceil(W * block / TILE)):

    q       [n, h, R, d_qk]            padded inside to [n, h, R', d_qk] (zero rows)
    keys    [n, Tk, h, TILE, d_qk]     input dtype, zero past each entry's kv_len
    values  [n, Tk, h, TILE, d_v]      input dtype (MLA: a latent row's first d_v columns)
    output  [n, h, R, d_v], lse [n, h, R] f32 (base 2)

Every entry is padded to the call's widest table: the runtime groups entries of similar KV
length into one call each (runtime/decode.py: ``length_buckets``), so padding stays bounded.
No loop anywhere: a fixed number of dispatches whatever the batch size.
"""

from __future__ import annotations

from .attention_op import TILE, attend_entries
from .decode import DecodeSpec, KvCache, decode_module, pass_rule
from .ir import (
    affine_map, arith_d, ceil_div, const_index, dim, element_type, empty, extract_slice, generic,
    ir, linalg_d, lt, tensor_d,
)
from .mask_rules import Lengths, MaskRule
from .online_softmax import row_sinks
from .paging import read_element as _read

#: Query rows per workgroup of the decode op (pipeline/tuning.py: 16-row tiles, the mma.sync m);
#: R is padded up to a multiple of it.
ROW_MULTIPLE = 16


def padded_rows(spec: DecodeSpec) -> int:
    """R': the op's query rows per entry and KV head."""
    return -(-spec.rows // ROW_MULTIPLE) * ROW_MULTIPLE


def build_fused_decode(spec: DecodeSpec, rule: MaskRule | None = None) -> ir.Module:
    """``decode_entries(q, *kv, table, geometry, causal, sm_scale) -> (output, lse)``, fused;
    ``rule`` as for ``decode.build_decode``."""
    rule = pass_rule(spec, rule)
    return decode_module(spec, lambda q, cache, _table, geometry, causal, sm_scale, sinks: _decode(
        spec, rule, q, cache, geometry, causal, sm_scale, sinks))


def _decode(spec: DecodeSpec, rule: MaskRule, q, cache: KvCache, geometry, causal, sm_scale, sinks) -> list[ir.Value]:
    base = spec.base
    entries, rows = dim(q, 0), spec.rows
    tiles = ceil_div(arith_d.muli(dim(cache.table, 1), const_index(spec.block)), TILE)
    keys = gathered_kv(spec, cache, 0, spec.d_qk, tiles)
    values = gathered_kv(spec, cache, 1, spec.d_v, tiles)
    mask = rule.bind({"causal": causal}).per_call()

    def valid(e, row, col):
        kv_len = _read(geometry, [e, const_index(0)])
        qo_len = _read(geometry, [e, const_index(3)])
        token = arith_d.divui(row, const_index(base.group_size))
        return mask.valid(Lengths(qo_len, kv_len, arith_d.subi(kv_len, qo_len)), lambda: token, col)

    row_sink = None if sinks is None else _padded_row_sinks(spec, sinks)
    output, lse = attend_entries(padded_queries(spec, q), keys, values, valid=valid, sm_scale=sm_scale,
                                 soft_cap=base.logits_soft_cap, sinks=row_sink)
    h, d_v = base.h_kv, spec.d_v
    return [extract_slice(output, [0, 0, 0, 0], [entries, h, rows, d_v]),
            extract_slice(lse, [0, 0, 0], [entries, h, rows])]


def padded_queries(spec: DecodeSpec, q: ir.Value) -> ir.Value:
    """q [n, h, R, d_qk] -> [n, h, R', d_qk], rows past R zero."""
    entries, h, rows, d_qk = dim(q, 0), spec.base.h_kv, spec.rows, spec.d_qk
    padded = padded_rows(spec)
    if padded == rows:
        return q
    elem = ir.RankedTensorType(q.type).element_type

    def body(_out):
        e, hh, r, col = (linalg_d.IndexOp(i).result for i in range(4))
        value = tensor_d.extract(q, [e, hh, arith_d.minsi(r, const_index(rows - 1)), col])
        return [arith_d.select(lt(r, const_index(rows)), value, arith_d.constant(elem, 0.0))]

    return generic([], [empty([entries, h, padded, d_qk], elem)], [affine_map(4, range(4))], "pppp", body)[0]


def gathered_kv(spec: DecodeSpec, cache: KvCache, which: int, width: int, tiles: ir.Value) -> ir.Value:
    """Keys (``which`` 0) or values (1) [n, Tk, h, TILE, width] in the input dtype: logical row
    kt * TILE + ki of each entry, zero at or past its kv_len (unused cache rows may hold NaN)."""
    entries, h = dim(cache.table, 0), spec.base.h_kv
    elem = element_type(spec.dtype)
    last_block = arith_d.subi(dim(cache.table, 1), const_index(1))

    def body(_out):
        e, kt, hh, ki, col = (linalg_d.IndexOp(i).result for i in range(5))
        row = arith_d.addi(arith_d.muli(kt, const_index(TILE)), ki)
        block = arith_d.minsi(arith_d.divui(row, const_index(spec.block)), last_block)
        slot = arith_d.remui(row, const_index(spec.block))
        value = cache.element(which, e, const_index(0), block, slot, hh, col, widen=False)
        kv_len = _read(cache.geometry, [e, const_index(0)])
        return [arith_d.select(lt(row, kv_len), value, arith_d.constant(elem, 0.0))]

    return generic([], [empty([entries, tiles, h, TILE, width], elem)], [affine_map(5, range(5))], "ppppp", body)[0]


def _padded_row_sinks(spec: DecodeSpec, sinks: ir.Value) -> ir.Value:
    """[h, R'] f32: row r's sink in log2 units (online_softmax.row_sinks: query head h G + r % G);
    the padding rows past R get a sink too, and are cut off with their results."""
    group, padded = spec.base.group_size, padded_rows(spec)
    by_row = row_sinks(sinks, spec.base.h_kv, group, -(-padded // group))
    return extract_slice(by_row, [0, 0], [spec.base.h_kv, padded])
