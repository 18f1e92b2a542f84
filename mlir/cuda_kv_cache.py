"""The CUDA mma lowering of the ragged and paged KV-cache prefills: every entry's query tiles in
one dispatch of the dense kernel's workgroup (mlir/cuda_attention.py).

Same signature and semantics as ``kv_cache.build_kv_cache_prefill``, and the same variant logic
as the fused lowering's (fused_kernels.py): q rotated where the variant has RoPE
(``kv_cache.rotated_if``), the keys (rotated) and values of every entry gathered once through the
layout's page remap into the batch-wide tile-major ``[T, h_kv, 64, d]`` (``batch_tiles``: entry b
from tile ``tile_offset(b)``, zero past its keys), the keys a row sees by the base spec's causal
rule with the call's flag (``key_ranges.FlagCausalKeys``). Then:

    entries  [B, 4] i32      (q_start, qo_len, kv_len, first tile) of each entry (one generic)
    grid     (Lq // 64 + B, h_q, 1): slot s belongs to the entry b with the largest query-tile
             offset q_start(b) // 64 + b <= s, and holds that entry's query tokens
             [s - offset(b), s - offset(b) + 1) * 64 (none where they are past its qo_len)
    out      [Lq, h_q, d] and lse [Lq, h_q], written in token order by the dispatch
"""

from __future__ import annotations

from .abi import function_module, operands
from .amx import workgroup_ids
from .attention_op import TILE
from . import cuda_attention
from .cuda_attention import (
    DTYPES, HEAD_DIMS, KernelShapes, _Workgroup, _add, _gep, _i, _mul, head_sink, workgroup_dispatch,
    workgroup_executable,
)
from .fused_kernels import batch_tiles, tile_offset
from .ir import (
    HostReadable, affine_map, arith_d, const_f32, const_index, dim, element_type, empty, f32, generic, i32, ir,
    linalg_d, llvm_d,
)
from .key_ranges import FlagCausalKeys
from .kv_cache import rope_arguments, rotated_if
from .kv_layouts import device_read, host_read
from .mask_rules import KvCacheCausalRule, mask_rule
from .online_softmax import LOG2E
from .specs import PagedPrefillSpec, RaggedPrefillSpec

_EXECUTABLE = "cuda_kv_cache"
_ENTRY = "attend_entries"
_SCALARS = ("total_q", "batch", "tiles", "causal")


class PrefillPlacement:
    """The rows and keys of a KV-cache prefill's workgroup (module docstring)."""

    def __init__(self, s: KernelShapes, pointers: dict, scalars: dict, scale_log2: ir.Value):
        self.s = s
        self.q, self.k, self.v, self.p = pointers["q"], pointers["keys"], pointers["values"], pointers
        self.total_q, self.batch, self.tiles, causal = (scalars[name] for name in _SCALARS)
        self.causal = arith_d.cmpi(arith_d.CmpIPredicate.ne, causal, _i(0))
        self.scale_log2 = scale_log2

    def _entry_field(self, entry, column: int) -> ir.Value:
        address = _gep(1, self.p["entries"], _mul(_add(_mul(entry, 4), column), 4))
        return arith_d.extsi(ir.IntegerType.get_signless(64), llvm_d.load(i32(), address))

    def _query_tile_offset(self, entry) -> ir.Value:
        return _add(arith_d.divsi(self._entry_field(entry, 0), _i(TILE)), entry)

    def bind(self, w: _Workgroup) -> None:
        slot, self.head, _ = workgroup_ids()
        # the entry: the largest b in [0, B) with offset(b) <= slot (offsets never decrease)
        lo, hi = _i(0), arith_d.subi(self.batch, _i(1))
        for _ in range(32):
            mid = arith_d.divsi(_add(_add(lo, hi), 1), _i(2))
            fits = arith_d.cmpi(arith_d.CmpIPredicate.sle, self._query_tile_offset(mid), slot)
            lo = arith_d.select(fits, mid, lo)
            hi = arith_d.select(fits, hi, arith_d.maxsi(arith_d.subi(mid, _i(1)), lo))
        entry = lo
        self.q_start, self.qo_len = self._entry_field(entry, 0), self._entry_field(entry, 1)
        kv_len, self.first_tile = self._entry_field(entry, 2), self._entry_field(entry, 3)
        self.first_token = _mul(arith_d.subi(slot, self._query_tile_offset(entry)), TILE)
        self.keys = FlagCausalKeys(kv_len, self.qo_len, self.causal, kv_len)
        self.kv_head = arith_d.divui(self.head, _i(self.s.group))
        self.rows = w.t.rows
        self.has_rows = arith_d.cmpi(arith_d.CmpIPredicate.slt, self.first_token, self.qo_len)

    def _clamped(self, row) -> ir.Value:
        """Row ``row``'s token in its entry, within [0, qo_len)."""
        last = arith_d.maxsi(arith_d.subi(self.qo_len, _i(1)), _i(0))
        return arith_d.minsi(_add(self.first_token, row), last)

    def row_keys(self, row) -> tuple[ir.Value, ir.Value]:
        return self.keys.lo(), self.keys.hi(self._clamped(row))

    def workgroup_keys(self) -> tuple[ir.Value, ir.Value, ir.Value]:
        """A slot past its entry's queries sees no key."""
        ends = [self.keys.hi(self._clamped(_i(0))), self.keys.hi(self._clamped(_i(self.rows - 1)))]
        last = arith_d.select(self.has_rows, arith_d.maxsi(*ends), _i(0))
        return self.keys.lo(), arith_d.minsi(*ends), last

    def _q_row(self, row) -> ir.Value:
        """The call's token of ``row`` (clamped into the call's queries)."""
        token = _add(self.q_start, self._clamped(row))
        return arith_d.minsi(token, arith_d.subi(self.total_q, _i(1)))

    def q_row(self, row) -> ir.Value:
        return _mul(_add(_mul(self._q_row(row), self.s.h_q), self.head), self.s.d)

    def kv_row(self, key) -> ir.Value:
        tile = _add(self.first_tile, arith_d.divui(key, _i(TILE)))
        tile = arith_d.minsi(tile, arith_d.subi(self.tiles, _i(1)))
        within = arith_d.remui(key, _i(TILE))
        return _mul(_add(_mul(_add(_mul(tile, self.s.h_kv), self.kv_head), TILE), within), self.s.d)

    def _output_row(self, row) -> tuple[ir.Value, ir.Value]:
        """(whether row ``row`` is one of its entry's queries, its index in out [Lq * h_q, d])."""
        token = _add(self.first_token, row)
        return (arith_d.cmpi(arith_d.CmpIPredicate.slt, token, self.qo_len),
                _add(_mul(_add(self.q_start, token), self.s.h_q), self.head))

    def write(self, w: _Workgroup, out, row_max, row_sum) -> None:
        """The entry's rows normalised into out [Lq, h_q, d], their lse into lse [Lq, h_q]."""
        w.write_normalised(out, row_max, row_sum, head_sink(self.p.get("sinks"), self.head), self._output_row)


def kv_cache_unsupported(spec) -> str | None:
    """Why the mma lowering has no prefill kernel for ``spec`` (None where it has one)."""
    if type(spec) not in (RaggedPrefillSpec, PagedPrefillSpec):
        return f"{type(spec).__name__} has no mma prefill kernel (the ragged and paged caches have)"
    if spec.dtype not in DTYPES:
        return f"dtype {spec.dtype}: mma.sync takes {' and '.join(DTYPES)}"
    if spec.d_qk != spec.d_v or spec.d_qk not in HEAD_DIMS:
        return f"d_qk={spec.d_qk}, d_v={spec.d_v}: the mma kernel takes equal head dims {HEAD_DIMS}"
    if spec.logits_soft_cap:
        return "a soft cap has no mma prefill kernel"
    if type(mask_rule(spec)) is not KvCacheCausalRule:
        return f"{type(mask_rule(spec)).__name__} has no mma prefill kernel"
    return None


def _inputs(s: KernelShapes) -> tuple[str, ...]:
    return ("q", "keys", "values", "entries", *(("sinks",) if s.sinks else ()))


def _sizes(s: KernelShapes, total_q, batch, tiles) -> dict:
    return {"q": [total_q, s.h_q, s.d], "keys": [tiles, s.h_kv, TILE, s.d], "values": [tiles, s.h_kv, TILE, s.d],
            "entries": [batch, 4], "sinks": [s.h_q], "out": [total_q, s.h_q, s.d], "lse": [total_q, s.h_q]}


def build_executable(s: KernelShapes) -> None:
    """The ``stream.executable`` with the prefill's dispatch at the insertion point: q, keys,
    values, entries, the index scalars, scale_log2 (f32), then out and lse."""
    elem = element_type(s.dtype)
    elems = {"q": elem, "keys": elem, "values": elem, "entries": i32(), "sinks": f32(), "out": elem, "lse": f32()}
    workgroup_executable((_EXECUTABLE, _ENTRY), s, (_inputs(s), ("out", "lse")), _SCALARS, elems,
                         lambda scalars: _sizes(s, scalars["total_q"], scalars["batch"], scalars["tiles"]),
                         lambda pointers, scalars, scale_log2: PrefillPlacement(s, pointers, scalars, scale_log2),
                         scaled=True)


def attend_entries(s: KernelShapes, q, keys, values, entries, causal, sm_scale, anchor: ir.Operation,
                   sinks=None) -> list[ir.Value]:
    """(out [Lq, h_q, d], lse [Lq, h_q]) of q [Lq, h_q, d] (rotated), keys and values [T, h_kv,
    64, d], the entries table [B, 4] i32 and, where ``s.sinks``, sinks [h_q] f32, in one dispatch
    (its executable built before ``anchor``, the function)."""
    with ir.InsertionPoint(anchor):
        build_executable(s)
    total_q, batch, tiles = dim(q, 0), dim(entries, 0), dim(keys, 0)
    sizes = _sizes(s, total_q, batch, tiles)
    has_queries = arith_d.cmpi(arith_d.CmpIPredicate.sgt, total_q, const_index(0))
    slots = arith_d.select(has_queries, arith_d.addi(arith_d.divsi(total_q, const_index(TILE)), batch), const_index(0))
    return workgroup_dispatch(
        (_EXECUTABLE, _ENTRY), [slots, const_index(s.h_q), const_index(1)],
        [q, keys, values, entries, *([sinks] if s.sinks else []), total_q, batch, tiles,
         arith_d.index_cast(ir.IndexType.get(), causal), arith_d.mulf(sm_scale, const_f32(LOG2E))],
        sizes, (_inputs(s), ("out", "lse")), {"out": element_type(s.dtype), "lse": f32()})


def _entries_table(q_indptr: HostReadable, kv) -> ir.Value:
    """[B, 4] i32: (q_start, qo_len, kv_len, first tile) of each entry, read on the device."""

    def body(_out):
        b, column = linalg_d.IndexOp(0).result, linalg_d.IndexOp(1).result
        q_start = device_read(q_indptr, [b])
        fields = [q_start, arith_d.subi(device_read(q_indptr, [arith_d.addi(b, const_index(1))]), q_start),
                  kv.kv_len(device_read, b), tile_offset(kv, device_read, b)]
        value = fields[3]
        for i in (2, 1, 0):
            value = arith_d.select(arith_d.cmpi(arith_d.CmpIPredicate.eq, column, const_index(i)), fields[i], value)
        return [arith_d.index_cast(i32(), value)]

    return generic([], [empty([kv.batch, 4], i32())], [affine_map(2, (0, 1))], "pp", body)[0]


def build_cuda_kv_cache_prefill(spec) -> ir.Module:
    """A ragged or paged prefill kernel (kv_cache.build_kv_cache_prefill's signature; q_indptr and
    the layout's index arguments as host-readable buffer views, as the fused kernel takes them)
    in the mma lowering; ValueError where :func:`kv_cache_unsupported` says why not."""
    why = kv_cache_unsupported(spec)
    if why:
        raise ValueError(f"no mma prefill kernel for {spec.name}: {why}")
    # the tiling read at the call (the GPU sweep sets cuda_attention.MMA_TILING)
    shapes = KernelShapes(spec.h_q, spec.h_kv, spec.d_qk, spec.dtype, "kv_cache", 0.0, cuda_attention.MMA_TILING,
                          spec.head_sinks)

    def emit(args):
        rope = rope_arguments(spec, args)
        q_indptr = HostReadable(args["q_indptr"], 1, "q_indptr")
        kv = spec.layout.batch_kv(spec, **operands(spec.layout, args))
        q = args["q"] if rope is None else rotated_if(rope, args["q"], args["q_rope_position"])
        num_tiles = arith_d.maxsi(tile_offset(kv, host_read, kv.batch), const_index(1))
        keys, values = batch_tiles(kv, num_tiles, rope, element_type(spec.dtype))
        return attend_entries(shapes, q, keys, values, _entries_table(q_indptr, kv), args["causal"], args["sm_scale"],
                              args["q"].owner.owner, args.get("sinks"))

    return function_module(spec, emit, host_readable=("q_indptr", *spec.layout.host_readable))
