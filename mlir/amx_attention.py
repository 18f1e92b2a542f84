"""The AMX lowering of the dense sequence prefill: one hand-written dispatch per call that runs the
whole online softmax with Q.K^T and P.V on AMX tiles (mlir/amx.py) and the softmax in f32 vector
code, fed by Q, K and V packed into tile order once per call by linalg generics.

Packed operands (G = h_q // h_kv folded into the query rows: row r of KV head h holds token r // G
and query head h * G + r % G; Mt row tiles of 16, an even number; T KV blocks of ``KV_BLOCK``):

    q_tiles  [B, h_kv, Mt, d/32, 16, 32]            A tiles: 16 rows x 32 dims, 1 KiB each
    k_tiles  [B, h_kv, T, KV_BLOCK/16, d/2, 16, 2]  B tiles of Q.K^T: 16 dim-pairs x 16 keys x 2
    v_tiles  [B, h_kv, T, d/16, KV_BLOCK/2, 16, 2]  B tiles of P.V: 16 key-pairs x 16 dims x 2

rows and keys past the call's lengths are zero. The dispatch's workgroup (x, h, b) owns query rows
[32x, 32x + 32) of KV head h of entry b and keeps on its stack, f32 unless named:

    scores [32, KV_BLOCK]   probs [32, KV_BLOCK] (operand dtype)   acc [32, d]   max, sum [32]

For each visible KV block: scores on AMX (2 x 2 C tiles at a time), then per row the scale, the
mask (key < the row's end), the running max, 2^(s - max) into probs, the sum and the acc rescale,
then acc += probs . values on AMX (acc's C tiles loaded and stored back). The rows are written to
the output [B, Lq, h_q, d] directly (normalised, in the dtype); (max, sum) per row go to a
[B, h_kv, Mt*16, 2] f32 buffer from which one generic makes lse [B, Lq, h_q] (base 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from iree.compiler.dialects import builtin as builtin_d
from iree.compiler.dialects import flow as flow_d
from iree.compiler.dialects import llvm as llvm_d
from iree.compiler.dialects import stream as stream_d
from iree.compiler.dialects import vector as vector_d

from .amx import LOG2E, Tiles, Vec, as_i64, at, binding_pointer, const_i64, i32, i64, stack_bytes
from .ir import (
    DYN, affine_map, arith_d, ceil_div, const_f32, const_index, dim, element_type, empty, f32, func_d, generic, ir,
    linalg_d, math_d, scf_d, tensor_d, tensor_type,
)
from .abi import function_module
from .kv_layouts import DENSE
from .score_tiles import PackedTiles
from .specs import EMPTY_ROW_LSE, SequencePrefillSpec

#: Keys of one KV step.
KV_BLOCK = 128
#: Query rows of one workgroup (two A tiles).
ROW_BLOCK = 32
#: The running max's start (finite, as the linalg lowering's: mlir/online_softmax.py).
NO_KEY_MAX = -1.0e30

_EXECUTABLE = "amx_attention"
_ENTRY = "attend"
_DISPATCH_SCALARS = ("batch", "q_len", "kv_len", "row_tiles", "kv_blocks")


@dataclass(frozen=True)
class AmxShapes:
    """The static facts of one kernel: heads, head dim, operand dtype, causal, the score scale
    (sm_scale * log2(e), the log2-domain factor)."""

    h_q: int
    h_kv: int
    d: int
    dtype: str
    causal: bool
    scale_log2: float

    @property
    def group(self) -> int:
        return self.h_q // self.h_kv


def _memref(rank: int, elem: ir.Type) -> ir.Type:
    return ir.MemRefType.get([DYN] * rank, elem)


class _Dispatch:
    """Builds the dispatch function's body (one workgroup's rows)."""

    def __init__(self, shapes: AmxShapes, pointers: dict, scalars: dict):
        self.s = shapes
        self.p = pointers
        self.n = scalars
        self.tiles = Tiles(shapes.dtype)
        self.vec = Vec()
        self.elem = element_type(shapes.dtype)
        d = shapes.d
        self.score_stride = KV_BLOCK * 4
        self.prob_stride = KV_BLOCK * 2
        self.acc_stride = d * 4
        self.score_bytes = ROW_BLOCK * self.score_stride
        self.scores = stack_bytes(self.score_bytes)
        self.probs = stack_bytes(ROW_BLOCK * self.prob_stride)
        self.acc = stack_bytes(ROW_BLOCK * self.acc_stride)
        self.state = stack_bytes(ROW_BLOCK * 8)   # (max, sum) per row

    @staticmethod
    def row_addr(base, row, stride) -> ir.Value:
        """``base + row * stride`` (row an i64 Value)."""
        return at(base, arith_d.muli(row, const_i64(stride)))

    def emit(self) -> None:
        s = self.s
        wx = as_i64(stream_d.dispatch_workgroup_id(0))
        head = as_i64(stream_d.dispatch_workgroup_id(1))
        entry = as_i64(stream_d.dispatch_workgroup_id(2))
        q_len, kv_len = self.n["q_len"], self.n["kv_len"]
        row_tiles, kv_blocks = self.n["row_tiles"], self.n["kv_blocks"]
        first_row = arith_d.muli(wx, const_i64(ROW_BLOCK))
        rows_total = arith_d.muli(q_len, const_i64(s.group))
        rows_valid = arith_d.minsi(const_i64(ROW_BLOCK), arith_d.subi(rows_total, first_row))
        offset = arith_d.subi(kv_len, q_len)   # bottom-right causal: key <= token + offset
        if s.causal:
            last_token = arith_d.divsi(arith_d.addi(first_row, arith_d.subi(rows_valid, const_i64(1))),
                                       const_i64(s.group))
            end = arith_d.minsi(kv_len, arith_d.maxsi(const_i64(0), arith_d.addi(last_token, arith_d.addi(offset, const_i64(1)))))
        else:
            end = kv_len
        blocks = arith_d.divsi(arith_d.addi(end, const_i64(KV_BLOCK - 1)), const_i64(KV_BLOCK))
        hk = arith_d.addi(arith_d.muli(entry, const_i64(s.h_kv)), head)   # (b, h) flattened
        # q tiles of this workgroup: [Mt, d/32] of 1 KiB from tile row 2 wx
        q_base = at(self.p["q_tiles"], arith_d.muli(
            arith_d.addi(arith_d.muli(hk, row_tiles), arith_d.muli(wx, const_i64(2))), const_i64(s.d // 32 * 1024)))
        block_bytes = KV_BLOCK * s.d * 2
        kv_offset = arith_d.muli(arith_d.muli(hk, kv_blocks), const_i64(block_bytes))
        k_base = at(self.p["k_tiles"], kv_offset)
        v_base = at(self.p["v_tiles"], kv_offset)

        self._init_rows()
        loop = scf_d.ForOp(const_index(0), arith_d.index_cast(ir.IndexType.get(), blocks), const_index(1))
        with ir.InsertionPoint(loop.body):
            block = as_i64(loop.induction_variable)
            self._scores(q_base, at(k_base, arith_d.muli(block, const_i64(block_bytes))), self.scores)
            self._softmax(block, self.scores, first_row, q_len, kv_len, offset)
            self._accumulate(at(v_base, arith_d.muli(block, const_i64(block_bytes))))
            scf_d.YieldOp([])
        self._write_rows(entry, head, wx, first_row, rows_valid, q_len, row_tiles)

    def _for_rows(self, count, body) -> None:
        loop = scf_d.ForOp(const_index(0), count if isinstance(count, ir.Value) else const_index(count), const_index(1))
        with ir.InsertionPoint(loop.body):
            body(as_i64(loop.induction_variable))
            scf_d.YieldOp([])

    def _init_rows(self) -> None:
        zero = self.vec.const(0.0)
        state = ir.VectorType.get([2], f32())
        init = arith_d.constant(state, ir.DenseElementsAttr.get(np.array([NO_KEY_MAX, 0.0], np.float32), type=state))

        def row(r):
            acc_row = self.row_addr(self.acc, r, self.acc_stride)
            for t in range(self.s.d // 16):
                self.vec.store(zero, at(acc_row, t * 64))
            llvm_store(init, self.row_addr(self.state, r, 8))

        self._for_rows(ROW_BLOCK, row)

    def _scores(self, q_base, k_block, scores) -> None:
        """scores[32, KV_BLOCK] = q . k^T on AMX, two key tiles at a time (2 x 2 C tiles)."""
        d, t = self.s.d, self.tiles
        q_row_tile = d // 32 * 1024         # bytes of one row tile's d/32 A tiles
        k_key_tile = d // 2 * 64            # bytes of one key tile's d/2 pair rows
        for pair in range(KV_BLOCK // 32):
            acc = [t.zero() for _ in range(4)]
            for step in range(d // 32):
                a = [t.load(at(q_base, i * q_row_tile + step * 1024), 64) for i in range(2)]
                b = [t.load(at(k_block, (2 * pair + j) * k_key_tile + step * 1024), 64) for j in range(2)]
                acc = [t.dot(acc[2 * i + j], a[i], b[j]) for i in range(2) for j in range(2)]
            for i in range(2):
                for j in range(2):
                    where = i * 16 * self.score_stride + (2 * pair + j) * 16 * 4
                    t.store(at(scores, where), self.score_stride, acc[2 * i + j])

    def _softmax(self, block, scores, first_row, q_len, kv_len, offset) -> None:
        """The rows' softmax step; the mask is applied only where the block reaches past the
        first row's end (the keys the first row may not see, or past kv_len)."""
        s = self.s
        if s.causal:
            token = arith_d.divsi(first_row, const_i64(s.group))
            first_end = arith_d.minsi(kv_len, arith_d.addi(token, arith_d.addi(offset, const_i64(1))))
        else:
            first_end = kv_len
        block_end = arith_d.muli(arith_d.addi(block, const_i64(1)), const_i64(KV_BLOCK))
        masked = arith_d.cmpi(arith_d.CmpIPredicate.sgt, block_end, first_end)
        branch = scf_d.IfOp(masked, [], has_else=True)
        with ir.InsertionPoint(branch.then_block):
            self._softmax_rows(block, scores, first_row, q_len, kv_len, offset, True)
            scf_d.YieldOp([])
        with ir.InsertionPoint(branch.else_block):
            self._softmax_rows(block, scores, first_row, q_len, kv_len, offset, False)
            scf_d.YieldOp([])

    def _softmax_rows(self, block, scores, first_row, q_len, kv_len, offset, masked: bool) -> None:
        s, v = self.s, self.vec
        scale = v.const(s.scale_log2)
        neg_inf = v.const(float("-inf"))
        block_start = arith_d.trunci(i32(), arith_d.muli(block, const_i64(KV_BLOCK)))
        columns = [arith_d.addi(v.iota(), v.splat(arith_d.addi(block_start, arith_d.constant(i32(), 16 * c))))
                   for c in range(KV_BLOCK // 16)]

        def row(r):
            if s.causal:
                token = arith_d.divsi(arith_d.addi(first_row, r), const_i64(s.group))
                row_end = arith_d.minsi(kv_len, arith_d.addi(token, arith_d.addi(offset, const_i64(1))))
            else:
                row_end = kv_len
            limit = v.splat(arith_d.trunci(i32(), row_end))
            score_row = self.row_addr(scores, r, self.score_stride)
            chunks = []
            for c in range(KV_BLOCK // 16):
                raw = arith_d.mulf(v.load(at(score_row, c * 64)), scale)
                if masked:
                    valid = arith_d.cmpi(arith_d.CmpIPredicate.slt, columns[c], limit)
                    raw = arith_d.select(valid, raw, neg_inf)
                chunks.append(raw)
            widest = chunks[0]
            for chunk in chunks[1:]:
                widest = v.max(widest, chunk)
            state_at = self.row_addr(self.state, r, 8)
            old_max = llvm_load(f32(), state_at)
            old_sum = llvm_load(f32(), at(state_at, 4))
            new_max = v.max(old_max, v.reduce("maximumf", widest))
            new_max_v = v.splat(new_max)
            weights = [v.exp2(arith_d.subf(chunk, new_max_v)) for chunk in chunks]
            total = weights[0]
            for w in weights[1:]:
                total = arith_d.addf(total, w)
            alpha_v = v.exp2(v.splat(arith_d.subf(old_max, new_max)))
            alpha = vector_extract(alpha_v)
            new_sum = arith_d.addf(arith_d.mulf(old_sum, alpha), v.reduce("add", total))
            llvm_store(new_max, state_at)
            llvm_store(new_sum, at(state_at, 4))
            prob_row = self.row_addr(self.probs, r, self.prob_stride)
            for c, w in enumerate(weights):
                v.store(v.narrow(w, self.elem), at(prob_row, c * 32))
            grew = scf_d.IfOp(arith_d.cmpf(arith_d.CmpFPredicate.OGT, new_max, old_max))
            with ir.InsertionPoint(grew.then_block):
                acc_row = self.row_addr(self.acc, r, self.acc_stride)
                for t in range(s.d // 16):
                    where = at(acc_row, t * 64)
                    v.store(arith_d.mulf(v.load(where), alpha_v), where)
                scf_d.YieldOp([])

        self._for_rows(ROW_BLOCK, row)

    def _accumulate(self, v_block) -> None:
        """acc[32, d] += probs[32, KV_BLOCK] . values on AMX, two dim tiles at a time."""
        d, t = self.s.d, self.tiles
        v_dim_tile = KV_BLOCK // 2 * 64      # bytes of one dim tile's key-pair rows
        for pair in range(d // 32):
            c_at = [at(self.acc, i * 16 * self.acc_stride + (2 * pair + j) * 64) for i in range(2) for j in range(2)]
            acc = [t.load(p, self.acc_stride) for p in c_at]
            for step in range(KV_BLOCK // 32):
                a = [t.load(at(self.probs, i * 16 * self.prob_stride + step * 64), self.prob_stride) for i in range(2)]
                b = [t.load(at(v_block, (2 * pair + j) * v_dim_tile + step * 1024), 64) for j in range(2)]
                acc = [t.dot(acc[2 * i + j], a[i], b[j]) for i in range(2) for j in range(2)]
            for p, tile in zip(c_at, acc):
                t.store(p, self.acc_stride, tile)

    def _write_rows(self, entry, head, wx, first_row, rows_valid, q_len, row_tiles) -> None:
        s, v = self.s, self.vec
        zero = arith_d.constant(f32(), 0.0)
        one = arith_d.constant(f32(), 1.0)

        def row(r):
            global_row = arith_d.addi(first_row, r)
            token = arith_d.divsi(global_row, const_i64(s.group))
            q_head = arith_d.addi(arith_d.muli(head, const_i64(s.group)), arith_d.remsi(global_row, const_i64(s.group)))
            state_at = self.row_addr(self.state, r, 8)
            total = llvm_load(f32(), at(state_at, 4))
            inv = arith_d.select(arith_d.cmpf(arith_d.CmpFPredicate.OGT, total, zero), arith_d.divf(one, total), zero)
            inv_v = v.splat(inv)
            out_row = arith_d.addi(arith_d.muli(arith_d.addi(arith_d.muli(entry, q_len), token), const_i64(s.h_q)), q_head)
            out_at = at(self.p["out"], arith_d.muli(out_row, const_i64(s.d * 2)))
            acc_row = self.row_addr(self.acc, r, self.acc_stride)
            for t in range(s.d // 16):
                value = arith_d.mulf(v.load(at(acc_row, t * 64)), inv_v)
                v.store(v.narrow(value, self.elem), at(out_at, t * 32))
            # (max, sum) of the row at [b, h, 32 wx + r]
            hk = arith_d.addi(arith_d.muli(entry, const_i64(s.h_kv)), head)
            state_row = arith_d.addi(arith_d.muli(hk, arith_d.muli(row_tiles, const_i64(16))), global_row)
            llvm_store(llvm_load(i64(), state_at), at(self.p["state"], arith_d.muli(state_row, const_i64(8))))

        self._for_rows(arith_d.index_cast(ir.IndexType.get(), rows_valid), row)


def llvm_load(elem: ir.Type, pointer: ir.Value) -> ir.Value:
    return llvm_d.load(elem, pointer, alignment=4)


def llvm_store(value: ir.Value, pointer: ir.Value) -> None:
    llvm_d.store(value, pointer, alignment=4)


def vector_extract(vector: ir.Value) -> ir.Value:
    """Lane 0 of a vector."""
    return vector_d.extract(vector, [], [0])


def build_executable(shapes: AmxShapes) -> None:
    """The ``stream.executable`` @amx_attention with the dispatch @attend, at the insertion point."""
    index = ir.IndexType.get()
    binding = ir.Type.parse("!stream.binding")
    executable = stream_d.ExecutableOp(_EXECUTABLE, sym_visibility="private")
    body = executable.body.blocks.append()
    with ir.InsertionPoint(body):
        export = stream_d.ExecutableExportOp(_ENTRY, _ENTRY, sym_visibility="public")
        count = export.workgroup_count.blocks.append(index, index, index)
        with ir.InsertionPoint(count):
            stream_d.ReturnOp(list(count.arguments))
        inner = builtin_d.ModuleOp()
        with ir.InsertionPoint(inner.body):
            arg_types = [binding] * 3 + [index] * len(_DISPATCH_SCALARS) + [binding] * 2
            fn = func_d.FuncOp(_ENTRY, (arg_types, []))
            with ir.InsertionPoint(fn.add_entry_block()):
                args = list(fn.arguments)
                scalars = dict(zip(_DISPATCH_SCALARS, args[3:3 + len(_DISPATCH_SCALARS)]))
                batch, q_len, kv_len, row_tiles, kv_blocks = (scalars[n] for n in _DISPATCH_SCALARS)
                elem = element_type(shapes.dtype)
                pointers = {
                    "q_tiles": binding_pointer(args[0], _memref(6, elem), _q_dims(shapes, batch, row_tiles)),
                    "k_tiles": binding_pointer(args[1], _memref(7, elem), _kv_dims(shapes, batch, kv_blocks, True)),
                    "v_tiles": binding_pointer(args[2], _memref(7, elem), _kv_dims(shapes, batch, kv_blocks, False)),
                    "out": binding_pointer(args[-2], _memref(4, elem), _static_dims([batch, q_len, shapes.h_q, shapes.d])),
                    "state": binding_pointer(args[-1], _memref(4, f32()), _static_dims(
                        [batch, shapes.h_kv, arith_d.muli(row_tiles, const_index(16)), 2])),
                }
                as64 = {name: as_i64(value) for name, value in scalars.items()}
                _Dispatch(shapes, pointers, as64).emit()
                func_d.ReturnOp([])
        stream_d.ExecutableEndOp()


def _static_dims(values):
    return [v if isinstance(v, ir.Value) else const_index(v) for v in values]


def _q_dims(s: AmxShapes, batch, row_tiles):
    return _static_dims([batch, s.h_kv, row_tiles, s.d // 32, 16, 32])


def _kv_dims(s: AmxShapes, batch, kv_blocks, keys: bool):
    if keys:
        return _static_dims([batch, s.h_kv, kv_blocks, KV_BLOCK // 16, s.d // 2, 16, 2])
    return _static_dims([batch, s.h_kv, kv_blocks, s.d // 16, KV_BLOCK // 2, 16, 2])


def _tile_storage(shapes: AmxShapes):
    return PackedTiles(dtype=shapes.dtype, m0=16, n0=16, k0=2)


def emit_dense(shapes: AmxShapes, q: ir.Value, k: ir.Value, v: ir.Value, anchor: ir.Operation) -> list[ir.Value]:
    """(output [B, Lq, h_q, d], lse [B, Lq, h_q] f32) of q [B, Lq, h_q, d], k/v [B, Lk, h_kv, d]
    through the AMX dispatch; its executable is built before ``anchor`` (the kernel's function)."""
    with ir.InsertionPoint(anchor):
        build_executable(shapes)
    s = shapes
    elem = element_type(s.dtype)
    batch, q_len, kv_len = dim(q, 0), dim(q, 1), dim(k, 1)
    row_blocks = ceil_div(arith_d.muli(q_len, const_index(s.group)), ROW_BLOCK)
    row_tiles = arith_d.muli(row_blocks, const_index(2))
    kv_blocks = ceil_div(kv_len, KV_BLOCK)

    def q_source(loops):   # (b, h, mt, ds, i, c) -> (b, head, token, dim)
        b, h, mt, ds, i, c = loops
        row = arith_d.addi(arith_d.muli(mt, const_index(16)), i)
        token = arith_d.divui(row, const_index(s.group))
        head = arith_d.addi(arith_d.muli(h, const_index(s.group)), arith_d.remui(row, const_index(s.group)))
        return b, head, token, arith_d.addi(arith_d.muli(ds, const_index(32)), c)

    q_tiles = DENSE.stored(q, q_len, [batch, s.h_kv, row_tiles, s.d // 32, 16, 32], q_source, None, elem, elem)
    layout = _tile_storage(s)
    stored = [layout.kv_storage(keys, batch, s.h_kv, kv_blocks, s.d, KV_BLOCK) for keys in (True, False)]
    k_tiles, v_tiles = (DENSE.stored(x, kv_len, st.sizes, st.source, None, elem, st.elem) for x, st in zip((k, v), stored))

    out_type = tensor_type([DYN, DYN, s.h_q, s.d], elem)
    state_type = tensor_type([DYN, s.h_kv, DYN, 2], f32())
    state_rows = arith_d.muli(row_tiles, const_index(16))
    entry = ir.ArrayAttr.get([ir.SymbolRefAttr.get([_EXECUTABLE, _ENTRY])])
    dispatch = flow_d.DispatchOp(
        [out_type, state_type], [row_blocks, const_index(s.h_kv), batch], entry,
        [q_tiles, k_tiles, v_tiles, batch, q_len, kv_len, row_tiles, kv_blocks],
        [batch, row_tiles, batch, kv_blocks, batch, kv_blocks],
        [batch, q_len, batch, state_rows])
    out, state = dispatch.results

    def lse_body(_out):
        b, t, hq = (linalg_d.IndexOp(i).result for i in range(3))
        head = arith_d.divui(hq, const_index(s.group))
        row = arith_d.addi(arith_d.muli(t, const_index(s.group)), arith_d.remui(hq, const_index(s.group)))
        best = tensor_d.extract(state, [b, head, row, const_index(0)])
        total = tensor_d.extract(state, [b, head, row, const_index(1)])
        seen = arith_d.cmpf(arith_d.CmpFPredicate.OGT, total, const_f32(0.0))
        return [arith_d.select(seen, arith_d.addf(best, math_d.log2(total)), const_f32(EMPTY_ROW_LSE))]

    lse = generic([], [empty([batch, q_len, s.h_q], f32())], [affine_map(3, range(3))], "ppp", lse_body)[0]
    return [out, lse]


def unsupported(spec) -> str | None:
    """Why the AMX lowering cannot build ``spec`` (None where it can): the dense sequence prefill
    in bf16 with a head dim that divides into 32-column tiles, no soft cap, sinks or 8-bit KV."""
    if type(spec) is not SequencePrefillSpec:
        return f"{type(spec).__name__} has no AMX kernel (the dense sequence prefill has)"
    if spec.dtype != "bfloat16":
        return f"dtype {spec.dtype}: the AMX kernel is bf16 (tdpbf16ps)"
    if spec.d % 32:
        return f"d={spec.d}: the AMX kernel needs a multiple of 32"
    if spec.logits_soft_cap or spec.head_sinks or spec.kv_dtype:
        return "soft cap, head sinks and 8-bit KV have no AMX kernel"
    return None


def build_amx_sequence_prefill(spec: SequencePrefillSpec) -> ir.Module:
    """The verified module of ``spec`` (same signature as sequence.build_sequence_prefill) with
    the attention in one AMX dispatch; ValueError where :func:`unsupported` says why not."""
    why = unsupported(spec)
    if why:
        raise ValueError(f"no AMX lowering for {spec.name}: {why}")
    shapes = AmxShapes(spec.h_q, spec.h_kv, spec.d, spec.dtype, spec.causal, spec.sm_scale * LOG2E)

    def emit(args):
        function = args["q"].owner.owner   # the kernel's func.func: the executable goes before it
        return emit_dense(shapes, args["q"], args["k"], args["v"], function)

    return function_module(spec, emit)
