"""The CUDA mma lowering of the serving passes (``DecodeSpec``): flash-decoding, each entry's keys
split into chunks that workgroups run at once, merged by their maxima (the CUDA issue's item 2).

Same signature and semantics as ``decode.build_decode``, and the same variant logic: K and V are
gathered once into tile-major rows by the fused pass's gather (``fused_decode.gathered_kv``: the
page table and sliding-window remap of ``decode.KvCache``, zero past each entry's kv_len), the
queries padded to 16-row tiles (``fused_decode.padded_queries``), the chunks merged by the linalg
passes' merge (``decode.merge_chunks``, the heads' sinks in its denominator). The attention is the
dense kernel's workgroup (mlir/cuda_attention.py: cp.async, ldmatrix, mma.sync, the online
softmax in registers) over the rows and keys of :class:`PassPlacement`:

    q       [n, h, R', d]          R = queries x G rows per KV head, R' = R rounded up to 16
    keys    [n, Tk, h, 64, d]      values the same
    grid    (C, h, n), C = ceil(Tk / CHUNK_TILES): workgroup (c, hh, e) runs the keys
            [c, c + 1) * CHUNK_TILES * 64 of entry e, KV head hh, R' / 16 warps
    acc     [n, C, h, R, d] f32    each chunk's probabilities x values, not divided by its sum
    max, sum [n, C, h, R] f32      the chunk's row max (NO_KEY_MAX where it saw no key) and sum

A row's keys are those of the base spec's causal rule with the call's flag
(key_ranges.FlagCausalKeys: below kv_len and, when causal, on or left of the bottom-right
diagonal, token = row // G).
"""

from __future__ import annotations

from .amx import workgroup_ids
from .attention_op import TILE
from .cuda_attention import (
    DTYPES, HEAD_DIMS, KernelShapes, MmaTiling, WARP_ROWS, _Workgroup, _add, _gep, _i, _lane_sum, _mul, _when,
    workgroup_dispatch, workgroup_executable,
)
from .decode import DecodeSpec, KvCache, decode_module, merge_chunks
from .fused_decode import gathered_kv, padded_queries, padded_rows
from .ir import arith_d, ceil_div, const_f32, const_index, dim, element_type, f32, i32, ir, llvm_d
from .key_ranges import FlagCausalKeys
from .mask_rules import KvCacheCausalRule, mask_rule
from .online_softmax import LOG2E, NO_KEY_MAX
from .specs import MlaPagedPrefillSpec

_EXECUTABLE = "cuda_serving_pass"
_ENTRY = "attend_chunks"
#: KV tiles (of 64 keys) a chunk: 256 keys, so that 32 sequences of 1024 keys over 8 KV heads
#: are 1024 workgroups. A GPU sweep candidate (bench/gpu_sweep.py).
CHUNK_TILES = 4
_SCALARS = ("entries", "tiles", "chunks", "causal")
_INPUTS, _RESULTS = ("q", "keys", "values", "geometry"), ("acc", "max", "sum")


class PassPlacement:
    """The rows and keys of a pass's workgroup (module docstring)."""

    def __init__(self, spec: DecodeSpec, pointers: dict, scalars: dict, scale_log2: ir.Value):
        self.spec = spec
        self.q, self.k, self.v, self.p = pointers["q"], pointers["keys"], pointers["values"], pointers
        self.entries, self.tiles, self.chunks, causal = (scalars[name] for name in _SCALARS)
        self.causal = arith_d.cmpi(arith_d.CmpIPredicate.ne, causal, _i(0))
        self.scale_log2 = scale_log2
        self.h = spec.base.h_kv
        self.padded = padded_rows(spec)

    def bind(self, w: _Workgroup) -> None:
        chunk, self.head, self.entry = workgroup_ids()
        self.chunk = chunk
        i64 = ir.IntegerType.get_signless(64)

        def geometry(column: int) -> ir.Value:
            address = _gep(1, self.p["geometry"], _mul(_add(_mul(self.entry, 4), column), 4))
            return arith_d.extsi(i64, llvm_d.load(i32(), address))

        kv_len, qo_len = geometry(0), geometry(3)
        self.keys = FlagCausalKeys(kv_len, qo_len, self.causal, kv_len)
        self.start = _mul(chunk, CHUNK_TILES * TILE)
        self.end = _add(self.start, CHUNK_TILES * TILE)

    def _token(self, row) -> ir.Value:
        """Row ``row``'s query token (rows past R read R - 1's)."""
        return arith_d.divui(arith_d.minsi(row, _i(self.spec.rows - 1)), _i(self.spec.base.group_size))

    def row_keys(self, row) -> tuple[ir.Value, ir.Value]:
        return self.start, arith_d.minsi(self.keys.hi(self._token(row)), self.end)

    def workgroup_keys(self) -> tuple[ir.Value, ir.Value, ir.Value]:
        first, last = (arith_d.minsi(self.keys.hi(self._token(_i(row))), self.end) for row in (0, self.padded - 1))
        return self.start, first, last

    def q_row(self, row) -> ir.Value:
        return _mul(_add(_mul(_add(_mul(self.entry, self.h), self.head), self.padded), row), self.spec.d_qk)

    def kv_row(self, key) -> ir.Value:
        key = arith_d.minsi(key, arith_d.subi(_mul(self.tiles, TILE), _i(1)))
        tile, within = arith_d.divui(key, _i(TILE)), arith_d.remui(key, _i(TILE))
        return _mul(_add(_mul(_add(_mul(_add(_mul(self.entry, self.tiles), tile), self.h), self.head), TILE), within),
                    self.spec.d_qk)

    def write(self, w: _Workgroup, out, row_max, row_sum) -> None:
        """The lane's rows below R: their products (f32) into acc, max and sum (the first lane of
        a row's four) into max and sum."""
        d, rows = self.spec.d_v, self.spec.rows
        col = w.column()
        for half in (0, 1):
            total = _lane_sum(row_sum[half])
            seen = arith_d.cmpf(arith_d.CmpFPredicate.OGT, total, const_f32(0.0))
            best = arith_d.select(seen, row_max[half], const_f32(NO_KEY_MAX))
            row = w.rows[half]
            state = _add(_mul(_add(_mul(_add(_mul(self.entry, self.chunks), self.chunk), self.h), self.head), rows),
                         row)

            def write(half=half, state=state, best=best, total=total):
                for block in range(d // 8):
                    element = _add(_mul(state, d), col, 8 * block)
                    for e in (0, 1):
                        llvm_d.store(out[4 * block + 2 * half + e], _gep(1, self.p["acc"], _mul(_add(element, e), 4)))
                _when(w.first_of_row(), lambda: (llvm_d.store(best, _gep(1, self.p["max"], _mul(state, 4))),
                                                 llvm_d.store(total, _gep(1, self.p["sum"], _mul(state, 4)))))

            _when(arith_d.cmpi(arith_d.CmpIPredicate.slt, row, _i(rows)), write)


def pass_unsupported(spec) -> str | None:
    """Why the mma lowering has no serving pass for ``spec`` (None where it has one)."""
    base = spec.base
    if isinstance(base, MlaPagedPrefillSpec):
        return "MLA's head dims (576/512) have no mma pass"
    if spec.dtype not in DTYPES:
        return f"dtype {spec.dtype}: mma.sync takes {' and '.join(DTYPES)}"
    if spec.d_qk != spec.d_v or spec.d_qk not in HEAD_DIMS:
        return f"d_qk={spec.d_qk}, d_v={spec.d_v}: the mma pass takes equal head dims {HEAD_DIMS}"
    if base.logits_soft_cap:
        return "a soft cap has no mma pass"
    if type(mask_rule(base)) is not KvCacheCausalRule:
        return f"{type(mask_rule(base)).__name__} has no mma pass"
    if padded_rows(spec) > 8 * WARP_ROWS:
        return f"{spec.rows} rows a KV head: the mma pass takes at most {8 * WARP_ROWS}"
    return None


def _tiling(spec: DecodeSpec) -> MmaTiling:
    return MmaTiling(padded_rows(spec) // WARP_ROWS, TILE)


def build_executable(spec: DecodeSpec) -> None:
    """The ``stream.executable`` with the pass's dispatch at the insertion point: q, keys, values,
    geometry, the index scalars, scale_log2 (f32), then acc, max and sum."""
    # the workgroup reads d, dtype and tiling; the keys and the scale are the placement's
    shapes = KernelShapes(spec.base.h_q, spec.base.h_kv, spec.d_qk, spec.dtype, "pass", 0.0, _tiling(spec))
    elem = element_type(spec.dtype)
    elems = {"q": elem, "keys": elem, "values": elem, "geometry": i32(), "acc": f32(), "max": f32(), "sum": f32()}
    workgroup_executable((_EXECUTABLE, _ENTRY), shapes, (_INPUTS, _RESULTS), _SCALARS, elems,
                         lambda scalars: _sizes(spec, scalars["entries"], scalars["tiles"], scalars["chunks"]),
                         lambda pointers, scalars, scale_log2: PassPlacement(spec, pointers, scalars, scale_log2),
                         scaled=True)


def _sizes(spec: DecodeSpec, entries, tiles, chunks) -> dict:
    h, d, rows = spec.base.h_kv, spec.d_qk, spec.rows
    return {"q": [entries, h, padded_rows(spec), d], "keys": [entries, tiles, h, TILE, d],
            "values": [entries, tiles, h, TILE, d], "geometry": [entries, 4],
            "acc": [entries, chunks, h, rows, d], "max": [entries, chunks, h, rows], "sum": [entries, chunks, h, rows]}


def attend_chunks(spec: DecodeSpec, q_padded, keys, values, geometry, causal, sm_scale,
                  anchor: ir.Operation) -> list[ir.Value]:
    """(acc, max, sum) of every chunk (module docstring) of q_padded [n, h, R', d], keys and
    values [n, Tk, h, 64, d], geometry [n, 4] i32, the causal flag (i32) and sm_scale (f32), in
    one dispatch whose executable is built before ``anchor`` (the function)."""
    with ir.InsertionPoint(anchor):
        build_executable(spec)
    entries, tiles = dim(q_padded, 0), dim(keys, 1)
    chunks = ceil_div(tiles, CHUNK_TILES)
    return workgroup_dispatch(
        (_EXECUTABLE, _ENTRY), [chunks, const_index(spec.base.h_kv), entries],
        [q_padded, keys, values, geometry, entries, tiles, chunks, arith_d.index_cast(ir.IndexType.get(), causal),
         arith_d.mulf(sm_scale, const_f32(LOG2E))],
        _sizes(spec, entries, tiles, chunks), (_INPUTS, _RESULTS), dict.fromkeys(_RESULTS, f32()))


def _decode(spec: DecodeSpec, q, cache: KvCache, geometry, causal, sm_scale, sinks) -> list[ir.Value]:
    """The pass: the shared gather and padding, the chunks' dispatch, the shared merge."""
    tiles = ceil_div(arith_d.muli(dim(cache.table, 1), const_index(spec.block)), TILE)
    keys = gathered_kv(spec, cache, 0, spec.d_qk, tiles)
    values = gathered_kv(spec, cache, 1, spec.d_v, tiles)
    acc, best, total = attend_chunks(spec, padded_queries(spec, q), keys, values, geometry, causal, sm_scale,
                                     q.owner.owner)
    return merge_chunks(spec, best, total, acc, sinks, normalised=False)


def build_cuda_decode(spec: DecodeSpec) -> ir.Module:
    """``decode_entries(q, *kv, table, geometry, causal, sm_scale) -> (output, lse)`` in the mma
    lowering; ValueError where :func:`pass_unsupported` says why not."""
    why = pass_unsupported(spec)
    if why:
        raise ValueError(f"no mma pass for {spec.name}: {why}")

    def emit(q, cache, _table, geometry, causal, sm_scale, sinks):
        return _decode(spec, q, cache, geometry, causal, sm_scale, sinks)

    return decode_module(spec, emit)
