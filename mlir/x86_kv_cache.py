"""The x86 lowering of the KV-cache prefill kernels (``batch_prefill_ragged_kv``,
``batch_prefill_paged_kv[_sliding_window]``, ``batch_prefill_paged_kv_mla[_sliding_window]``):
the dense kernel's dispatch (mlir/x86_attention.py: AMX tiles for bf16, or DotEngine's pair dot
products without AMX; FMA blocks for f32 and f16; the f32 vector softmax) once per batch entry,
over all of its query rows, fed by the entry's K and V packed once into the engine's order. d_v
may differ from d_qk (a ragged cache's; MLA: one KV head of d_latent + d_rope key columns, the
first d_latent of them its values).

Per entry (an ``scf.for`` on the host side, as the linalg kernels walk their entries; an entry
without queries is skipped):

1. its K and V are packed as the engine reads them (zero past kv_len), each key's row read where
   the variant's layout keeps it (kv_layouts.py, ``BatchKv``: a ragged slice, a page-table gather,
   the sliding window's sinks then window): a cache in the kernel's dtype by the row packing
   dispatch (x86_packing.emit_packed_rows: 64-byte loads, 16 x 16 transposes for keys) at offsets
   one generic computes per key and head (``BatchKv.row_offset``, the serving passes' row
   addressing); keys rotated at ``k_rope_pos_offset[b] + row`` when ``rotary_mode == 1``
   (rope.apply_rope, then rounded to the dtype) and an 8-bit cache's rows (dequantised) by one
   generic each (at 2 x 64 new over 4096 cached, f32, the generics' packing was a fifth of the
   call: docs/performance.md);
2. one dispatch, workgroups (row blocks of the entry's qo_len x G rows, h_kv), reads the entry's
   query rows from the call's q (already rotated) in place and writes its output rows and their
   (max, sum) in token order into the call's output [Lq, h_q, d] and state [Lq, h_q, 2], which
   the loop carries and the dispatch updates in place (tied operands: no copy of either).

Keys a row sees: the KV-cache causal rule with the call's runtime ``causal`` flag
(key_ranges.FlagCausalKeys); ``sm_scale`` is the call's. With ``head_sinks`` each row's
denominator gets 2^(sink - max) (semantics §13). After the loop one generic turns the state into
lse [Lq, h_q] (base 2; EMPTY_ROW_LSE for a row that saw no key).
"""

from __future__ import annotations

from .abi import function_module, operands
from .dtypes import quantized_kv
from .amx import as_i64, at, binding_pointer, const_i64, dynamic_dims, i64, static_shape
from .ir import (
    HostReadable, affine_map, arith_d, ceil_div, const_f32, const_index, dim, element_type, empty, f32, flow_d,
    generic, i32, ir, is_one, linalg_d, lt, on_target_device, scf_d, tensor_d, tensor_type, tie_dims,
)
from .kv_cache import rope_arguments, rotated_if
from .kv_layouts import BatchKv, host_read
from .mask_rules import KvCacheCausalRule, mask_rule
from .online_softmax import LOG2E, sink_lse
from . import rope as rope_builder
from .rope import apply_rope
from .specs import EMPTY_ROW_LSE, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec
from .x86_attention import (
    BINDING, ENGINES, XEON_WITH_AMX, KernelShapes, X86Cpu, _Dispatch, blocks_for, blocks_unfit, engine_for,
    hand_written_dispatch, llvm_load, state_lse, vector_extract,
)
from .key_ranges import FlagCausalKeys
from .x86_packing import emit_packed_rows, kv_tile_sizes

_EXECUTABLE = "x86_kv_cache"
_ENTRY = "attend_entry"
#: Index scalars of the dispatch: the call's tokens, the entry's first token, queries and keys,
#: its packed KV steps and the causal flag; then sm_scale (f32).
_SCALARS = ("tokens", "q_start", "q_len", "kv_len", "kv_blocks", "causal")


def kv_cache_unsupported(spec, cpu: X86Cpu = XEON_WITH_AMX) -> str | None:
    """Why the x86 lowering has no kernel for the KV-cache variant ``spec`` on ``cpu`` (None where
    it has): ragged, paged and MLA's latent caches in bf16, f32 or f16, head dims d_qk and d_v
    multiples of 32, the KV-cache causal mask (not a custom one), workgroup blocks within the
    stack budget."""
    if type(spec) not in (RaggedPrefillSpec, PagedPrefillSpec, MlaPagedPrefillSpec):
        return f"{type(spec).__name__} has no x86 kernel"
    if spec.dtype not in ENGINES:
        return f"dtype {spec.dtype}: the kernels are bf16 (AMX tiles), f32 and f16 (FMA blocks)"
    if spec.d_qk % 32 or spec.d_v % 32:
        return f"d_qk={spec.d_qk}, d_v={spec.d_v}: the x86 kernels need head dims of a multiple of 32"
    if not isinstance(mask_rule(spec), KvCacheCausalRule):
        return "the x86 kernels know the KV-cache causal mask only"
    return blocks_unfit(spec.dtype, spec.d_qk, spec.d_v, cpu)


class _EntryDispatch(_Dispatch):
    """One workgroup: a row block of one KV head of the entry, its rows at tokens q_start + t of
    the call's q, output and state."""

    def __init__(self, shapes: KernelShapes, engine, pointers: dict, scalars: dict, sm_scale):
        super().__init__(shapes, engine, pointers, scalars)
        self.scale_log2 = arith_d.mulf(sm_scale, arith_d.constant(f32(), LOG2E))

    def key_range(self, entry, q_len, kv_len):
        causal = arith_d.cmpi(arith_d.CmpIPredicate.ne, self.n["causal"], const_i64(0))
        return FlagCausalKeys(kv_len, q_len, causal, kv_len)

    def first_token(self, entry, q_len) -> ir.Value:
        return self.n["q_start"]

    def state_at(self, hk, global_row, out_row) -> ir.Value:
        return at(self.p["state"], arith_d.muli(out_row, const_i64(8)))

    def normaliser(self, total, row_max, head, global_row) -> ir.Value:
        if "sinks" not in self.p:
            return super().normaliser(total, row_max, head, global_row)
        sink = llvm_load(f32(), at(self.p["sinks"], arith_d.muli(self.query_head(head, global_row), const_i64(4))))
        exponent = arith_d.subf(arith_d.mulf(sink, arith_d.constant(f32(), LOG2E)), row_max)
        return self.inverse(total, arith_d.addf(total, vector_extract(self.vec.exp2(self.vec.splat(exponent)))))


def _tensor_sizes(shapes: KernelShapes, engine, tokens, kv_blocks) -> dict:
    """The sizes (ints or index Values) of the dispatch's tensors by binding name."""
    s = shapes
    return {"q": [tokens, s.h_q, s.d], **kv_tile_sizes(s, engine, 1, kv_blocks),
            "sinks": [s.h_q], "out": [tokens, s.h_q, s.d_v], "state": [tokens, s.h_q, 2]}


def _names(sinks: bool) -> list[str]:
    """The dispatch's bindings in operand order (out and state are updated in place)."""
    return ["q", "k_tiles", "v_tiles", *(["sinks"] if sinks else []), "out", "state"]


def _build_executable(shapes: KernelShapes, engine, sinks: bool) -> None:
    """The ``stream.executable`` of the entry dispatch at the insertion point: one binding per
    operand (:func:`_names`; the results out and state are tied to their operands, so written
    through those), then ``_SCALARS`` (index) and sm_scale (f32)."""
    names = _names(sinks)
    arg_types = [ir.Type.parse(BINDING)] * len(names) + [ir.IndexType.get()] * len(_SCALARS) + [f32()]
    elems = {"q": element_type(shapes.dtype), "k_tiles": engine.operand, "v_tiles": engine.operand, "sinks": f32(),
             "out": element_type(shapes.dtype), "state": f32()}
    with hand_written_dispatch(_EXECUTABLE, _ENTRY, arg_types) as args:
        scalars = dict(zip(_SCALARS, args[len(names):len(names) + len(_SCALARS)]))
        sizes = _tensor_sizes(shapes, engine, scalars["tokens"], scalars["kv_blocks"])
        pointers = {}
        for name, binding in zip(names, args):
            pointers[name] = binding_pointer(binding, ir.MemRefType.get(static_shape(sizes[name]), elems[name]),
                                             dynamic_dims(sizes[name]))
        _EntryDispatch(shapes, engine, pointers, {name: as_i64(value) for name, value in scalars.items()},
                       args[-1]).emit()


def _row_offsets(shapes: KernelShapes, kv: BatchKv, which: int, b, kv_len, kv_blocks) -> tuple[ir.Value, ir.Value]:
    """(the source tensor, offsets [h_kv, kv_blocks x kv_block] i64) of entry ``b``'s K (``which``
    0) or V (1) rows: each key's row of each head as an element offset in the source viewed
    flat (BatchKv.row_offset), keys past kv_len at its last row."""
    rows = arith_d.muli(kv_blocks, const_index(shapes.kv_block))
    last = arith_d.maxsi(arith_d.subi(kv_len, const_index(1)), const_index(0))
    source = []   # the source row_offset names: one for every element (ragged: k or v; paged: pages)

    def body(_out):
        head, row = (linalg_d.IndexOp(i).result for i in range(2))
        index, offset = kv.row_offset(which, b, arith_d.minsi(row, last), head)
        source.append(kv.sources[index])
        return [offset]

    offsets = generic([], [empty([shapes.h_kv, rows], i64())], [affine_map(2, range(2))], "pp", body)[0]
    return source[0], tie_dims(offsets, [shapes.h_kv, rows])


def _packed_kv(shapes: KernelShapes, engine, kv: BatchKv, b, kv_len, kv_blocks, rope, gathered: bool,
               anchor: ir.Operation) -> list[ir.Value]:
    """Entry ``b``'s keys (rotated where the call rotates) and values in the engine's order
    (kv_blocks x kv_block rows, zero past kv_len; MLA's values are the first d_v columns of its
    key rows): where ``gathered`` (a cache in the kernel's dtype) by the row packing dispatch
    (x86_packing.emit_packed_rows, its executables built before ``anchor``), keys that the call
    rotates and an 8-bit cache's rows (dequantised) by one generic each."""
    s = shapes
    storage = [engine.layout.kv_storage(keys, 1, s.h_kv, kv_blocks, s.d if keys else s.d_v, s.kv_block)
               for keys in (True, False)]
    types = [tensor_type(static_shape(st.sizes), st.elem) for st in storage]

    elem = element_type(s.dtype)

    def rows_packed(which: int) -> ir.Value:
        source, offsets = _row_offsets(s, kv, which, b, kv_len, kv_blocks)
        return tie_dims(emit_packed_rows(s, engine, which, source, offsets, kv_len, kv_blocks, anchor),
                        storage[which].sizes)

    def widened(value):   # f16 into the FMA engine's f32
        return value if value.type == engine.operand else arith_d.extf(engine.operand, value)

    def from_cache(source):
        """Row ``row`` of head ``h``, column ``j`` of the entry (in the spec's dtype; 0 past kv_len)."""
        return lambda h, row, j: kv.row_or_zero(source, b, row, lambda: [h, j], kv_len, elem)

    def packed(st, read):
        loops = len(st.sizes)

        def body(_out):
            _, h, row, j = st.source([linalg_d.IndexOp(i).result for i in range(loops)])
            return [widened(read(h, row, j))]

        return generic([], [empty(st.sizes, st.elem)], [affine_map(loops, range(loops))], "p" * loops, body)[0]

    def keys_unrotated() -> ir.Value:
        return rows_packed(0) if gathered else packed(storage[0], from_cache(kv.keys))

    values = rows_packed(1) if gathered else packed(storage[1], from_cache(kv.values))
    if rope is None:
        return [keys_unrotated(), values]
    branch = scf_d.IfOp(is_one(rope.rotary_mode), [types[0]], has_else=True)
    with ir.InsertionPoint(branch.then_block):   # rotated keys rounded to the dtype (rope.py), then packed
        rows = arith_d.muli(kv_blocks, const_index(s.kv_block))
        token_major = generic([], [empty([rows, s.h_kv, s.d], elem)], [affine_map(3, range(3))], "ppp",
                              lambda _out: [from_cache(kv.keys)(*(linalg_d.IndexOp(i).result for i in (1, 0, 2)))])[0]
        positions = generic([], [empty([rows], i32())], [affine_map(1, (0,))], "p",
                            lambda _out: [rope_builder.row_position(tensor_d.extract(kv.rope_offset, [b]))])[0]
        rotated = apply_rope(token_major, positions, theta=rope.theta, scale=rope.scale,
                             rope_scaling=rope.rope_scaling, rotary_dim=rope.rotary_dim)
        scf_d.YieldOp([packed(storage[0], lambda h, row, j: tensor_d.extract(rotated, [row, h, j]))])
    with ir.InsertionPoint(branch.else_block):
        scf_d.YieldOp([keys_unrotated()])
    return [tie_dims(branch.results[0], storage[0].sizes), values]


def _attend_entry(shapes: KernelShapes, engine, q, q_indptr: HostReadable, kv: BatchKv, b, rope, causal, sm_scale,
                  sinks, carried: list[ir.Value], gathered: bool, anchor: ir.Operation) -> list[ir.Value]:
    """The carried (output, state) with entry ``b``'s rows written by its dispatch; every size
    and offset read on the host (no wait on the device). An entry without queries packs no KV
    and runs no workgroup."""
    s = shapes
    tokens = dim(q, 0)
    q_start = q_indptr.load([b])
    qo_len = arith_d.subi(q_indptr.load([arith_d.addi(b, const_index(1))]), q_start)
    kv_len = kv.kv_len(host_read, b)
    kv_blocks = arith_d.select(lt(const_index(0), qo_len), ceil_div(kv_len, s.kv_block), const_index(0))
    k_tiles, v_tiles = _packed_kv(s, engine, kv, b, kv_len, kv_blocks, rope, gathered, anchor)
    sizes = _tensor_sizes(s, engine, tokens, kv_blocks)
    names = _names(sinks is not None)
    tensors = dict(q=q, k_tiles=k_tiles, v_tiles=v_tiles, sinks=sinks, out=carried[0], state=carried[1])
    row_blocks = ceil_div(arith_d.muli(qo_len, const_index(s.group)), s.row_block)
    causal_index = arith_d.index_cast(ir.IndexType.get(), causal)
    entry = ir.ArrayAttr.get([ir.SymbolRefAttr.get([_EXECUTABLE, _ENTRY])])
    tied = ir.ArrayAttr.get([ir.IntegerAttr.get(ir.IndexType.get(), names.index(name)) for name in ("out", "state")])
    dispatch = flow_d.DispatchOp(
        [carried[0].type, carried[1].type], [row_blocks, const_index(s.h_kv), const_index(1)], entry,
        [*(tensors[name] for name in names), tokens, q_start, qo_len, kv_len, kv_blocks, causal_index, sm_scale],
        [size for name in names for size in dynamic_dims(sizes[name])],
        [tokens, tokens], tied_operands=tied)
    return [tie_dims(dispatch.results[0], sizes["out"]), tie_dims(dispatch.results[1], sizes["state"])]


def _lse(shapes: KernelShapes, state: ir.Value, sinks: ir.Value | None) -> ir.Value:
    """lse [Lq, h_q] f32 (base 2) of the rows' (max, sum) ``state`` [Lq, h_q, 2], with the heads'
    ``sinks`` [h_q] (natural log) where given; EMPTY_ROW_LSE for a row that saw no key."""
    tokens = dim(state, 0)

    def body(_out):
        t, h = (linalg_d.IndexOp(i).result for i in range(2))
        best = tensor_d.extract(state, [t, h, const_index(0)])
        total = tensor_d.extract(state, [t, h, const_index(1)])
        if sinks is None:
            return [state_lse(best, total)]
        sink = arith_d.mulf(tensor_d.extract(sinks, [h]), const_f32(LOG2E))
        return [sink_lse(best, total, sink, const_f32(0.0), const_f32(EMPTY_ROW_LSE))]

    return generic([], [empty([tokens, shapes.h_q], f32())], [affine_map(2, range(2))], "pp", body)[0]


def build_x86_kv_cache_prefill(spec: RaggedPrefillSpec | PagedPrefillSpec, cpu: X86Cpu = XEON_WITH_AMX) -> ir.Module:
    """The verified module of the KV-cache variant ``spec`` (kv_cache.build_kv_cache_prefill's
    signature) with each entry's attention in one hand-written dispatch for ``cpu``
    (x86_attention.engine_for); ValueError where :func:`kv_cache_unsupported` says why not."""
    why = kv_cache_unsupported(spec, cpu)
    if why:
        raise ValueError(f"no x86 lowering for {spec.name}: {why}")
    shapes = KernelShapes(spec.h_q, spec.h_kv, spec.d_qk, spec.dtype, "causal", 0.0,
                          *blocks_for(spec.dtype, spec.d_qk, spec.d_v, cpu), spec.logits_soft_cap, spec.d_v)

    def emit(args):
        engine = engine_for(spec.dtype, cpu)
        sinks = args.get("sinks")
        function = args["q"].owner.owner   # the kernel's func.func: the executables go before it
        with ir.InsertionPoint(function):
            _build_executable(shapes, engine, sinks is not None)
        rope = rope_arguments(spec, args)
        q = args["q"] if rope is None else rotated_if(rope, args["q"], args["q_rope_position"])
        q_indptr = HostReadable(args["q_indptr"], 1, "q_indptr")
        kv = spec.layout.batch_kv(spec, **operands(spec.layout, args))
        tokens = dim(q, 0)
        sizes = [[tokens, spec.h_q, spec.d_v], [tokens, spec.h_q, 2]]
        initial = [on_target_device(empty(sizes[0], element_type(spec.dtype)), sizes[0]),
                   on_target_device(empty(sizes[1], f32()), sizes[1])]
        loop = scf_d.ForOp(const_index(0), kv.batch, const_index(1), initial)
        with ir.InsertionPoint(loop.body):
            carried = [tie_dims(x, size) for x, size in zip(loop.inner_iter_args, sizes)]
            scf_d.YieldOp(_attend_entry(shapes, engine, q, q_indptr, kv, loop.induction_variable, rope, args["causal"],
                                        args["sm_scale"], sinks, carried, not quantized_kv(spec), function))
        out, state = (tie_dims(x, size) for x, size in zip(loop.results, sizes))
        return [out, _lse(shapes, state, sinks)]

    return function_module(spec, emit, host_readable=("q_indptr", *spec.layout.host_readable))
