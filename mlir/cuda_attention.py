"""The CUDA "mma" lowering of the dense sequence prefills: one hand-written dispatch over the
whole call, FlashAttention-2's structure in the typed bindings' ``nvvm`` ops (issue 52 item 5),
for what IREE 3.13's own CUDA codegen does not emit (``cp.async``, ``ldmatrix``, skipped causal
tiles, one launch a call; docs/cuda.md). Its workgroup (:class:`_Workgroup`) takes its rows, keys
and outputs from a placement: :class:`DensePlacement` here, the KV-cache prefills' in
mlir/cuda_kv_cache.py, the serving passes' in mlir/cuda_decode.py.

Grid (x, y, z) = (query tiles, h_q, B): workgroup (x, h, b) owns the ``rows`` = 16 x ``warps``
query tokens [t0, t0 + rows) of query head h of entry b (causal calls take the tiles last first,
the longest first), ``warps`` warps of 16 rows each. Per workgroup:

    q   read once from q [B, Lq, h_q, d] into registers as mma A fragments (16 x 16 per d step)
    K/V tiles of ``kv_block`` keys of KV head h // G from k/v [B, Lk, h_kv, d], copied with
        cp.async (16 bytes a thread) into shared memory, double-buffered (the next tile's copy
        runs under this tile's work); rows of 2d bytes, 16-byte chunk c of key r at c ^ (r % 8)
        (no bank conflicts for ldmatrix's eight rows); keys past Lk read key Lk - 1 (masked)
    S = q . K^T   mma.sync m16n8k16 (f16 or bf16, f32 sums), K fragments by ldmatrix
    softmax       per row in registers: scale * log2(e), the mask (only in tiles that cross a
                  row's bound: :class:`key_ranges.KeyRange`), the running max across the 4 lanes
                  of a row (shfl.bfly), 2^(s - max) with ex2.approx, the sum kept per lane
    O += P . V    P rounded to the dtype, V fragments by ldmatrix.trans

Tiles run from the first the workgroup's rows can see to the last: fully masked tiles are not
computed. The rows are written normalised into out [B, Lq, h_q, d] (0 for a row that saw no
key) and their base-2 lse into lse [B, Lq, h_q] (EMPTY_ROW_LSE there), by the dispatch itself,
with the head's sink in the denominator where the spec has ``head_sinks``.
"""

from __future__ import annotations

from dataclasses import dataclass

from iree.compiler.dialects import gpu as gpu_d
from iree.compiler.dialects import nvvm

from .abi import function_module
from .amx import (
    BINDING, as_i64, binding_pointer, const_i64, dynamic_dims, hand_written_dispatch, static_shape, workgroup_ids,
)
from .ir import (
    arith_d, ceil_div, const_f32, const_index, dim, dispatch_mark, element_type, f32, flow_d, i32, ir, llvm_d,
    memref_d, scf_d, tensor_type,
)
from .key_ranges import MASKS, KeyRange
from .online_softmax import LOG2E
from .specs import EMPTY_ROW_LSE, MaskedSequencePrefillSpec, SequencePrefillSpec

_EXECUTABLE = "cuda_attention"
_ENTRY = "attend"
_DISPATCH_SCALARS = ("batch", "q_len", "kv_len")
#: Rows of one warp: an mma.sync m16n8k16 A tile.
WARP_ROWS = 16
#: Bytes one cp.async copies, and the shared-memory chunk the swizzle permutes.
CHUNK = 16
#: The largest dynamic shared memory a workgroup may use (IREE's sm_80 table: 166912 bytes).
SHARED_LIMIT = 163 * 1024
#: The shfl.bfly lane offsets that join the four lanes holding one row (lanes 4r .. 4r + 3).
_ROW_LANE_OFFSETS = (1, 2)


#: The dtypes with an mma.sync kind, and the head dims the kernel takes (fragments of 16 columns,
#: a swizzle over at least 8 chunks a row, the f32 output fragments within a thread's registers).
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class MmaTiling:
    """A workgroup's shape: ``warps`` warps of 16 query rows, ``kv_block`` keys a tile."""

    warps: int = 4
    kv_block: int = 64

    @property
    def rows(self) -> int:
        return WARP_ROWS * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def __post_init__(self):
        if self.warps not in (1, 2, 4, 8) or self.kv_block not in (32, 64, 128):
            raise ValueError(f"MmaTiling: warps 1, 2, 4 or 8 and kv_block 32, 64 or 128, got {self}")
        if self.shared_bytes(max(HEAD_DIMS)) > SHARED_LIMIT:
            raise ValueError(f"MmaTiling: {self} needs more shared memory than {SHARED_LIMIT} bytes")

    def shared_bytes(self, d: int) -> int:
        """Two stages of a K and a V tile of head dim ``d`` (2-byte elements)."""
        return 2 * 2 * self.kv_block * d * 2


#: The tiling the lowering builds with (the GPU sweep's candidates vary it: bench/gpu_sweep.py).
MMA_TILING = MmaTiling()


@dataclass(frozen=True)
class KernelShapes:
    """The static facts of one kernel (as mlir/x86_attention.py's): heads, head dim, dtype, the
    mask (key_ranges.MASKS; the KV-cache placements read their own), sm_scale * log2(e) (the
    dense kernels'; the others take it at the call), the tiling and whether each query head has a
    sink (semantics §13: ``sinks [h_q]`` f32, natural-log units)."""

    h_q: int
    h_kv: int
    d: int
    dtype: str
    mask: str
    scale_log2: float
    tiling: MmaTiling = MMA_TILING
    sinks: bool = False

    @property
    def group(self) -> int:
        return self.h_q // self.h_kv


# ---- typed-binding helpers -------------------------------------------------------------------

def _ptr(space: int) -> ir.Type:
    return ir.Type.parse(f"!llvm.ptr<{space}>")


def _attr(text: str) -> ir.Attribute:
    return ir.Attribute.parse(text)


def _struct(elem: ir.Type, count: int) -> ir.Type:
    return ir.Type.parse(f"!llvm.struct<({', '.join([str(elem)] * count)})>")


def _gep(space: int, base: ir.Value, offset) -> ir.Value:
    """``base + offset`` bytes in address space ``space`` (offset an i64 Value or int)."""
    offset = const_i64(offset) if isinstance(offset, int) else offset
    return llvm_d.getelementptr(_ptr(space), base, [offset], [-2147483648], ir.IntegerType.get_signless(8), 0)


def _i(value: int) -> ir.Value:
    return const_i64(value)


def _add(*values):
    total = values[0]
    for value in values[1:]:
        total = arith_d.addi(total, _i(value) if isinstance(value, int) else value)
    return total


def _mul(a, b):
    return arith_d.muli(a, _i(b) if isinstance(b, int) else b)


def _ex2(x: ir.Value) -> ir.Value:
    return llvm_d.call_intrinsic(f32(), "llvm.nvvm.ex2.approx.ftz.f", [x], [], [])


def _lg2(x: ir.Value) -> ir.Value:
    return llvm_d.call_intrinsic(f32(), "llvm.nvvm.lg2.approx.ftz.f", [x], [], [])


def _lane_max(x: ir.Value) -> ir.Value:
    """The max of ``x`` over the four lanes that hold one row."""
    return _across_row(x, arith_d.maximumf)


def _lane_sum(x: ir.Value) -> ir.Value:
    """The sum of ``x`` over the four lanes that hold one row."""
    return _across_row(x, arith_d.addf)


def _across_row(x: ir.Value, combine) -> ir.Value:
    for offset in _ROW_LANE_OFFSETS:
        other = nvvm.shfl_sync(arith_d.constant(i32(), -1), x, arith_d.constant(i32(), offset),
                               arith_d.constant(i32(), 0x1F), _attr("#nvvm.shfl_kind<bfly>"))
        x = combine(x, other)
    return x


def finished_row(total: ir.Value, row_max: ir.Value, sink: ir.Value | None) -> tuple[ir.Value, ir.Value]:
    """(1 / denominator, base-2 lse) of a row from its sum over its four lanes and its max (log2
    units), with its head's ``sink`` (log2 units) in the denominator or None: (0, EMPTY_ROW_LSE)
    for a row that saw no key (online_softmax.sink_normalised and sink_lse, in ex2 / lg2)."""
    seen = arith_d.cmpf(arith_d.CmpFPredicate.OGT, total, const_f32(0.0))
    if sink is None:
        denominator, lse = total, arith_d.addf(row_max, _lg2(total))
    else:
        safe_max = arith_d.select(seen, row_max, sink)
        denominator = arith_d.addf(total, _ex2(arith_d.subf(sink, safe_max)))
        top = arith_d.maximumf(safe_max, sink)
        lse = arith_d.addf(top, _lg2(arith_d.addf(arith_d.mulf(total, _ex2(arith_d.subf(safe_max, top))),
                                                   _ex2(arith_d.subf(sink, top)))))
    inverse = arith_d.select(seen, arith_d.divf(const_f32(1.0), denominator), const_f32(0.0))
    return inverse, arith_d.select(seen, lse, const_f32(EMPTY_ROW_LSE))


def head_sink(sinks: ir.Value | None, head: ir.Value) -> ir.Value | None:
    """Query head ``head``'s sink in log2 units from the ``sinks`` [h_q] f32 pointer (None: none)."""
    if sinks is None:
        return None
    return arith_d.mulf(llvm_d.load(f32(), _gep(1, sinks, _mul(head, 4))), const_f32(LOG2E))


class _Operands:
    """The mma.sync operand forms of a dtype: f16 fragments are vector<2xf16>, bf16 ones i32; the
    PTX types named (the typed bindings' verifier aborts the process without them)."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.elem = element_type(dtype)
        self.pair = ir.VectorType.get([2], self.elem)

    def fragment(self, bits: ir.Value) -> ir.Value:
        """An i32 register (two elements) as an mma operand."""
        return llvm_d.bitcast(self.pair, bits) if self.dtype == "float16" else bits

    def packed(self, low: ir.Value, high: ir.Value) -> ir.Value:
        """Two f32 values rounded to the dtype, as one i32 (``low`` in bits 0-15): one
        ``cvt.rn.{f16,bf16}x2.f32`` (its first operand goes to the upper half). arith.truncf to
        bf16 became seven integer instructions an element (MLIR's bf16 emulation)."""
        convert = nvvm.convert_f32x2_to_f16x2 if self.dtype == "float16" else nvvm.convert_f32x2_to_bf16x2
        return llvm_d.bitcast(i32(), convert(self.pair, high, low, rnd=_attr("#nvvm.fp_rnd_mode<rn>")))

    def mma(self, a: list, b: list, c: list) -> list[ir.Value]:
        """c + a . b for one 16 x 8 x 16 tile (four f32 per lane)."""
        kind = _attr(f"#nvvm.mma_type<{'f16' if self.dtype == 'float16' else 'bf16'}>")
        kinds = {"multiplicand_a_ptx_type": kind, "multiplicand_b_ptx_type": kind}
        result = nvvm.mma_sync(_struct(f32(), 4), _attr("#nvvm.shape<m = 16, n = 8, k = 16>"),
                               _attr("#nvvm.mma_layout<row>"), _attr("#nvvm.mma_layout<col>"),
                               [self.fragment(x) for x in a], [self.fragment(x) for x in b], list(c), **kinds)
        return [llvm_d.extractvalue(f32(), result, [i]) for i in range(4)]


def _ldmatrix4(address: ir.Value, transposed: bool) -> list[ir.Value]:
    """Four 8 x 8 b16 matrices from shared memory (lane i gives row i % 8 of matrix i // 8)."""
    layout = _attr(f"#nvvm.mma_layout<{'col' if transposed else 'row'}>")
    value = nvvm.ldmatrix(address, 4, layout, _attr("#nvvm.ld_st_matrix_shape<m = 8, n = 8>"),
                          _attr("#nvvm.ld_st_matrix_elt_type<b16>"), results=[_struct(i32(), 4)])
    return [llvm_d.extractvalue(i32(), value, [i]) for i in range(4)]


def _if(condition: ir.Value, then, values: list[ir.Value]) -> list[ir.Value]:
    """``then(values)`` where ``condition`` holds, else ``values`` (scf.if with results)."""
    branch = scf_d.IfOp(condition, [value.type for value in values], has_else=True)
    with ir.InsertionPoint(branch.then_block):
        scf_d.YieldOp(list(then(values)))
    with ir.InsertionPoint(branch.else_block):
        scf_d.YieldOp(list(values))
    return list(branch.results)


def _when(condition: ir.Value, body) -> None:
    """``body()`` where ``condition`` holds (scf.if without results)."""
    branch = scf_d.IfOp(condition, [], has_else=False)
    with ir.InsertionPoint(branch.then_block):
        body()
        scf_d.YieldOp([])


# ---- the dispatch ----------------------------------------------------------------------------

class _Workgroup:
    """The tile loop of one workgroup (module docstring) over the rows, keys and outputs its
    placement gives (:class:`DensePlacement`; mlir/cuda_decode.py's pass placement): row r of a
    workgroup is warp r // 16's, and a lane holds rows lane // 4 and lane // 4 + 8 of its warp's."""

    def __init__(self, s: KernelShapes, place):
        self.s, self.t, self.place = s, s.tiling, place
        self.ops = _Operands(s.dtype)
        self.row_bytes = s.d * 2
        self.tile_bytes = self.t.kv_block * self.row_bytes

    def emit(self) -> None:
        s, t, place = self.s, self.t, self.place
        tid = as_i64(gpu_d.thread_id(gpu_d.Dimension.x))
        self.warp, self.lane = arith_d.divui(tid, _i(32)), arith_d.remui(tid, _i(32))
        self.tid = tid
        place.bind(self)
        row = _add(_mul(self.warp, WARP_ROWS), arith_d.divui(self.lane, _i(4)))
        self.rows = (row, _add(row, 8))
        bounds = [place.row_keys(r) for r in self.rows]
        self.row_lo, self.row_hi = [b[0] for b in bounds], [b[1] for b in bounds]
        lo, all_see, hi = place.workgroup_keys()
        self.all_see = (lo, all_see)
        first_tile = arith_d.divsi(lo, _i(t.kv_block))
        end_tile = arith_d.select(arith_d.cmpi(arith_d.CmpIPredicate.sgt, hi, lo),
                                  arith_d.divsi(_add(hi, t.kv_block - 1), _i(t.kv_block)), first_tile)
        self._shared()
        q_frags = self._query_fragments()
        self.first_tile = first_tile
        _when(arith_d.cmpi(arith_d.CmpIPredicate.slt, first_tile, end_tile),
              lambda: (self._copy_tile(first_tile, _i(0)), nvvm.cp_async_commit_group()))
        zero, minus_inf = const_f32(0.0), const_f32(float("-inf"))
        n_out = s.d // 8 * 4
        carried = [zero] * n_out + [minus_inf, minus_inf, zero, zero]
        index = ir.IndexType.get()
        loop = scf_d.ForOp(arith_d.index_cast(index, first_tile), arith_d.index_cast(index, end_tile),
                           const_index(1), carried)
        with ir.InsertionPoint(loop.body):
            state = list(loop.inner_iter_args)
            tile = as_i64(loop.induction_variable)
            new = self._tile_step(tile, end_tile, q_frags, state[:n_out], state[n_out:n_out + 2],
                                  state[n_out + 2:])
            scf_d.YieldOp(new)
        result = list(loop.results)
        place.write(self, result[:n_out], result[n_out:n_out + 2], result[n_out + 2:])

    def _shared(self) -> None:
        space = ir.Attribute.parse("#gpu.address_space<workgroup>")
        size = self.t.shared_bytes(self.s.d)
        buffer = memref_d.alloc(ir.MemRefType.get([size], ir.IntegerType.get_signless(8), memory_space=space), [], [])
        address = memref_d.extract_aligned_pointer_as_index(buffer)
        self.shared = llvm_d.inttoptr(_ptr(3), as_i64(address))

    def _query_fragments(self) -> list[list[ir.Value]]:
        """q's A fragments, one per 16 columns of d: (row lo, cols c..c+1), (row hi, c..c+1),
        (lo, c+8..), (hi, c+8..) with c = 16 k + 2 (lane % 4)."""
        s = self.s
        col = _mul(arith_d.remui(self.lane, _i(4)), 2)
        rows = [self.place.q_row(row) for row in self.rows]
        frags = []
        for step in range(s.d // 16):
            regs = []
            for half in (0, 8):
                for row in rows:
                    element = _add(row, col, 16 * step + half)
                    regs.append(llvm_d.load(i32(), _gep(1, self.place.q, _mul(element, 2))))
            frags.append(regs)
        return frags

    def _copy_tile(self, tile, stage) -> None:
        """cp.async of the K and V tile ``tile`` into ``stage`` (an i64 0 or 1), 16 bytes a copy:
        thread i copies chunk i % chunks of rows i // chunks, + threads // chunks, ..."""
        s, t = self.s, self.t
        chunks = s.d * 2 // CHUNK
        rows_per_pass = t.threads // chunks
        chunk = arith_d.remui(self.tid, _i(chunks))
        first_row = arith_d.divui(self.tid, _i(chunks))
        same_swizzle = rows_per_pass % 8 == 0    # then a thread's rows share row % 8
        swizzled = _mul(arith_d.xori(chunk, arith_d.remui(first_row, _i(8))), CHUNK)
        stage_base = _mul(stage, 2 * self.tile_bytes)
        for pass_ in range(t.kv_block // rows_per_pass):
            row = _add(first_row, pass_ * rows_per_pass)
            if not same_swizzle:
                swizzled = _mul(arith_d.xori(chunk, arith_d.remui(row, _i(8))), CHUNK)
            element = _add(self.place.kv_row(_add(_mul(tile, t.kv_block), row)), _mul(chunk, CHUNK // 2))
            shared_row = _add(stage_base, _mul(row, self.row_bytes), swizzled)
            for source, offset in ((self.place.k, 0), (self.place.v, self.tile_bytes)):
                nvvm.cp_async_shared_global(_gep(3, self.shared, _add(shared_row, offset)),
                                            _gep(1, source, _mul(element, 2)), CHUNK,
                                            _attr("#nvvm.load_cache_modifier<cg>"))

    def _matrix_address(self, stage_base, key, chunk) -> ir.Value:
        """The shared address of 16-byte ``chunk`` of ``key`` in a tile at ``stage_base``."""
        swizzled = arith_d.xori(chunk, arith_d.remui(key, _i(8)))
        return _gep(3, self.shared, _add(stage_base, _mul(key, self.row_bytes), _mul(swizzled, CHUNK)))

    def _tile_step(self, tile, end_tile, q_frags, out, row_max, row_sum) -> list[ir.Value]:
        s, t, ops = self.s, self.t, self.ops
        stage = arith_d.andi(arith_d.subi(tile, self.first_tile), _i(1))
        following = _add(tile, 1)
        _when(arith_d.cmpi(arith_d.CmpIPredicate.slt, following, end_tile),
              lambda: self._copy_tile(following, arith_d.xori(stage, _i(1))))
        nvvm.cp_async_commit_group()
        nvvm.cp_async_wait_group(1)
        gpu_d.barrier()
        k_base = _mul(stage, 2 * self.tile_bytes)
        v_base = _add(k_base, self.tile_bytes)
        lane8, pair = arith_d.remui(self.lane, _i(8)), arith_d.divui(self.lane, _i(8))
        # S = q . K^T: n-blocks of 8 keys, 4 f32 each (rows lo, lo, hi, hi)
        zero = const_f32(0.0)
        scores = [[zero] * 4 for _ in range(t.kv_block // 8)]
        for block in range(t.kv_block // 16):
            key = _add(lane8, _mul(arith_d.divui(pair, _i(2)), 8), 16 * block)
            for step in range(s.d // 16):
                chunk = _add(arith_d.remui(pair, _i(2)), 2 * step)
                m = _ldmatrix4(self._matrix_address(k_base, key, chunk), transposed=False)
                scores[2 * block] = ops.mma(q_frags[step], m[0:2], scores[2 * block])
                scores[2 * block + 1] = ops.mma(q_frags[step], m[2:4], scores[2 * block + 1])
        flat = [arith_d.mulf(x, self.place.scale_log2) for block in scores for x in block]
        key_first = _add(_mul(tile, t.kv_block), _mul(arith_d.remui(self.lane, _i(4)), 2))
        lo, hi = self.all_see
        crosses = arith_d.ori(arith_d.cmpi(arith_d.CmpIPredicate.slt, _mul(tile, t.kv_block), lo),
                              arith_d.cmpi(arith_d.CmpIPredicate.sgt, _mul(_add(tile, 1), t.kv_block), hi))
        flat = _if(crosses, lambda values: self._masked(values, key_first), flat)
        # the online softmax of rows lo (element 0, 1 of a block) and hi (2, 3)
        probs, new_max, new_sum, factors = [None] * len(flat), [], [], []
        for half in (0, 1):
            mine = [i for i in range(len(flat)) if (i % 4) // 2 == half]
            best = flat[mine[0]]
            for i in mine[1:]:
                best = arith_d.maximumf(best, flat[i])
            best = arith_d.maximumf(row_max[half], _lane_max(best))
            is_empty = arith_d.cmpf(arith_d.CmpFPredicate.OEQ, best, const_f32(float("-inf")))
            safe = arith_d.select(is_empty, const_f32(0.0), best)
            factor = _ex2(arith_d.subf(row_max[half], safe))
            total = arith_d.mulf(row_sum[half], factor)
            for i in mine:
                probs[i] = _ex2(arith_d.subf(flat[i], safe))
                total = arith_d.addf(total, probs[i])
            new_max.append(best)
            new_sum.append(total)
            factors.append(factor)
        out = [arith_d.mulf(x, factors[(i % 4) // 2]) for i, x in enumerate(out)]
        # O += P . V: P's A fragment of keys 16 j .. 16 j + 15 is n-blocks 2j, 2j + 1 of S
        p_frags = []
        for j in range(t.kv_block // 16):
            a, b = probs[8 * j:8 * j + 4], probs[8 * j + 4:8 * j + 8]
            p_frags.append([ops.packed(a[0], a[1]), ops.packed(a[2], a[3]), ops.packed(b[0], b[1]),
                            ops.packed(b[2], b[3])])
        blocks = [out[4 * i:4 * i + 4] for i in range(s.d // 8)]
        for j in range(t.kv_block // 16):
            key = _add(lane8, _mul(arith_d.remui(pair, _i(2)), 8), 16 * j)
            for block in range(s.d // 16):
                chunk = _add(arith_d.divui(pair, _i(2)), 2 * block)
                m = _ldmatrix4(self._matrix_address(v_base, key, chunk), transposed=True)
                blocks[2 * block] = ops.mma(p_frags[j], m[0:2], blocks[2 * block])
                blocks[2 * block + 1] = ops.mma(p_frags[j], m[2:4], blocks[2 * block + 1])
        self._release_stage()
        return [x for block in blocks for x in block] + new_max + new_sum

    @staticmethod
    def _release_stage() -> None:
        """Every warp is done with this tile's stage: the next step may copy into it."""
        gpu_d.barrier()

    def _masked(self, values, key_first) -> list[ir.Value]:
        """The scores with -inf where a row's key is outside its [lo, hi)."""
        minus_inf = const_f32(float("-inf"))
        masked = []
        for i, value in enumerate(values):
            block, element = divmod(i, 4)
            half = element // 2
            key = _add(key_first, 8 * block + element % 2)
            inside = arith_d.andi(arith_d.cmpi(arith_d.CmpIPredicate.sge, key, self.row_lo[half]),
                                  arith_d.cmpi(arith_d.CmpIPredicate.slt, key, self.row_hi[half]))
            masked.append(arith_d.select(inside, value, minus_inf))
        return masked

    def column(self) -> ir.Value:
        """The first of the two output columns a lane holds in each 8-column block."""
        return _mul(arith_d.remui(self.lane, _i(4)), 2)

    def first_of_row(self) -> ir.Value:
        """Whether this lane is the first of its row's four (i1)."""
        return arith_d.cmpi(arith_d.CmpIPredicate.eq, arith_d.remui(self.lane, _i(4)), _i(0))

    def write_normalised(self, out, row_max, row_sum, sink, output_row) -> None:
        """Rows lo and hi of this lane, normalised (with the head's ``sink``, log2 units, or
        None), into the placement's out [rows, d] in the dtype, and their lse (the lane of the
        row's four that holds columns 0, 1) into its lse [rows] f32; ``output_row(row)`` gives
        (whether workgroup row ``row`` is one of the call's, its index among out's rows)."""
        d, pointers = self.s.d, self.place.p
        col = self.column()
        for half in (0, 1):
            inverse, lse = finished_row(_lane_sum(row_sum[half]), row_max[half], sink)
            valid, row = output_row(self.rows[half])

            def write(half=half, inverse=inverse, lse=lse, row=row):
                for block in range(d // 8):
                    low, high = (arith_d.mulf(out[4 * block + 2 * half + e], inverse) for e in (0, 1))
                    element = _add(_mul(row, d), col, 8 * block)
                    llvm_d.store(self.ops.packed(low, high), _gep(1, pointers["out"], _mul(element, 2)))
                _when(self.first_of_row(), lambda: llvm_d.store(lse, _gep(1, pointers["lse"], _mul(row, 4))))

            _when(valid, write)


class DensePlacement:
    """The dense prefills' rows and keys: workgroup (x, h, b) owns query tokens [x, x + 1) * rows
    of query head h of entry b (the last tile first under a causal mask); q, k, v in the caller's
    layout; rows written normalised with their lse (the module docstring)."""

    def __init__(self, s: KernelShapes, pointers: dict, scalars: dict):
        self.s = s
        self.q, self.k, self.v, self.p = pointers["q"], pointers["k"], pointers["v"], pointers
        self.batch, self.q_len, self.kv_len = (scalars[name] for name in _DISPATCH_SCALARS)
        self.scale_log2 = None

    def bind(self, w: _Workgroup) -> None:
        s, t = self.s, w.t
        self.scale_log2 = const_f32(s.scale_log2)
        wx, head, entry = workgroup_ids()
        tiles = arith_d.divsi(_add(self.q_len, t.rows - 1), _i(t.rows))
        if s.mask in ("causal", "causal_padded_left"):      # the longest tiles first
            wx = arith_d.subi(arith_d.subi(tiles, _i(1)), wx)
        self.entry, self.head = entry, head
        self.kv_head = arith_d.divui(head, _i(s.group))
        self.first_token = _mul(wx, t.rows)
        self.rows = t.rows
        valid_len = None
        if "valid_lens" in self.p:
            valid_len = arith_d.extsi(ir.IntegerType.get_signless(64),
                                      llvm_d.load(i32(), _gep(1, self.p["valid_lens"], _mul(entry, 4))))
        self.keys = KeyRange(s.mask, self.q_len, self.kv_len, valid_len)
        self.last_q = arith_d.subi(self.q_len, _i(1))

    def _token(self, row) -> ir.Value:
        return _add(self.first_token, row)

    def _clamped(self, row) -> ir.Value:
        return arith_d.minsi(self._token(row), self.last_q)

    def row_keys(self, row) -> tuple[ir.Value, ir.Value]:
        """The keys [lo, hi) workgroup row ``row`` sees."""
        return self.keys.lo(), self.keys.hi(self._clamped(row))

    def workgroup_keys(self) -> tuple[ir.Value, ir.Value, ir.Value]:
        """(the first key any row sees, the end of the keys every row sees, the end of those any
        row sees): the first and last rows bound every mask of key_ranges.MASKS."""
        ends = [self.keys.hi(self._clamped(_i(0))), self.keys.hi(self._clamped(_i(self.rows - 1)))]
        return self.keys.lo(), arith_d.minsi(*ends), arith_d.maxsi(*ends)

    def q_row(self, row) -> ir.Value:
        """The element offset in q of row ``row``'s first column (a row past the call reads the last)."""
        s = self.s
        return _mul(_add(_mul(_add(_mul(self.entry, self.q_len), self._clamped(row)), s.h_q), self.head), s.d)

    def kv_row(self, key) -> ir.Value:
        """The element offset in k and v of key ``key`` (clamped into the call's keys)."""
        s = self.s
        key = arith_d.minsi(key, arith_d.subi(self.kv_len, _i(1)))
        return _mul(_add(_mul(_add(_mul(self.entry, self.kv_len), key), s.h_kv), self.kv_head), s.d)

    def _output_row(self, row) -> tuple[ir.Value, ir.Value]:
        """(whether row ``row`` is a query of the call, its index in out [B * Lq * h_q, d])."""
        token = self._token(row)
        return (arith_d.cmpi(arith_d.CmpIPredicate.slt, token, self.q_len),
                _add(_mul(_add(_mul(self.entry, self.q_len), token), self.s.h_q), self.head))

    def write(self, w: _Workgroup, out, row_max, row_sum) -> None:
        """The rows normalised into out [B, Lq, h_q, d], their lse into lse [B, Lq, h_q]; rows
        past the call's queries are not written."""
        w.write_normalised(out, row_max, row_sum, head_sink(self.p.get("sinks"), self.head), self._output_row)


def global_pointers(bound: dict, sizes: dict, elements: dict) -> dict:
    """The global-memory pointer of each of a hand-written dispatch's ``bound`` bindings (name:
    ``!stream.binding``), viewed as a memref of its ``sizes`` and ``elements``."""
    return {name: llvm_d.addrspacecast(_ptr(1), binding_pointer(
        binding, ir.MemRefType.get(static_shape(sizes[name]), elements[name]), dynamic_dims(sizes[name])))
        for name, binding in bound.items()}


def workgroup_executable(names: tuple[str, str], s: KernelShapes, bindings: tuple[tuple[str, ...], tuple[str, ...]],
                         scalar_names: tuple[str, ...], elements: dict, sizes, placement, scaled: bool = False) -> None:
    """The ``stream.executable`` ``names`` (executable, entry) at the insertion point, its one
    dispatch a :class:`_Workgroup` of ``s``: its function takes the input bindings, the scalars
    ``scalar_names`` (index), scale_log2 (f32) where ``scaled``, then the result bindings
    (``bindings``: (inputs, results)), and is marked with its threads (the CUDA record's
    ``tune_dispatch`` gives IREE the workgroup size). ``sizes(scalars)``: each binding's sizes
    from the index scalars; ``placement(pointers, scalars as i64, scale_log2 or None)``: the rows
    and keys of a workgroup."""
    inputs, results = bindings
    index, binding = ir.IndexType.get(), ir.Type.parse(BINDING)
    arg_types = [binding] * len(inputs) + [index] * len(scalar_names) + [f32()] * scaled + [binding] * len(results)
    with hand_written_dispatch(*names, arg_types, dispatch_mark(s.tiling.threads)) as args:
        scalars = dict(zip(scalar_names, args[len(inputs):len(inputs) + len(scalar_names)]))
        scale_log2 = args[len(inputs) + len(scalar_names)] if scaled else None
        bound = dict(zip((*inputs, *results), [*args[:len(inputs)], *args[len(args) - len(results):]]))
        pointers = global_pointers(bound, sizes(scalars), elements)
        scalars = {name: as_i64(value) for name, value in scalars.items()}
        _Workgroup(s, placement(pointers, scalars, scale_log2)).emit()


def workgroup_dispatch(names: tuple[str, str], workload: list, operands: list, sizes: dict,
                       bindings: tuple[tuple[str, ...], tuple[str, ...]], result_elements: dict) -> list[ir.Value]:
    """The results of one ``flow.dispatch`` of the entry ``names`` (executable, entry) over
    ``workload`` (3 index values) with ``operands`` (the input tensors, then the scalars): its
    inputs' and results' (``bindings``) dynamic sizes from ``sizes``, each result a tensor of its
    ``result_elements``."""
    inputs, results = bindings
    dispatch = flow_d.DispatchOp(
        [tensor_type(static_shape(sizes[name]), result_elements[name]) for name in results], workload,
        ir.ArrayAttr.get([ir.SymbolRefAttr.get(list(names))]), operands,
        [size for name in inputs for size in dynamic_dims(sizes[name])],
        [size for name in results for size in dynamic_dims(sizes[name])])
    return list(dispatch.results)


def _inputs(s: KernelShapes) -> tuple[str, ...]:
    return ("q", "k", "v", *(("valid_lens",) if s.mask in ("padded", "causal_padded_left") else ()),
            *(("sinks",) if s.sinks else ()))


def _sizes(s: KernelShapes, batch, q_len, kv_len) -> dict:
    return {"q": [batch, q_len, s.h_q, s.d], "k": [batch, kv_len, s.h_kv, s.d], "v": [batch, kv_len, s.h_kv, s.d],
            "valid_lens": [batch], "sinks": [s.h_q], "out": [batch, q_len, s.h_q, s.d], "lse": [batch, q_len, s.h_q]}


def build_executable(s: KernelShapes) -> None:
    """The ``stream.executable`` @cuda_attention with the dispatch @attend at the insertion point:
    the input bindings, the scalars (index), then the results out and lse."""
    elem = element_type(s.dtype)
    elems = {"q": elem, "k": elem, "v": elem, "valid_lens": i32(), "sinks": f32(), "out": elem, "lse": f32()}
    workgroup_executable((_EXECUTABLE, _ENTRY), s, (_inputs(s), ("out", "lse")), _DISPATCH_SCALARS, elems,
                         lambda scalars: _sizes(s, *scalars.values()),
                         lambda pointers, scalars, _: DensePlacement(s, pointers, scalars))


def emit_dense(s: KernelShapes, q, k, v, anchor: ir.Operation, valid_lens=None, sinks=None) -> list[ir.Value]:
    """(output [B, Lq, h_q, d], lse [B, Lq, h_q] f32) of q [B, Lq, h_q, d], k/v [B, Lk, h_kv, d]
    (valid_lens [B] int32 for the padded masks) through one dispatch over the whole call."""
    with ir.InsertionPoint(anchor):
        build_executable(s)
    batch, q_len, kv_len = dim(q, 0), dim(q, 1), dim(k, 1)
    operands = [q, k, v, *([valid_lens] if "valid_lens" in _inputs(s) else []), *([sinks] if s.sinks else [])]
    return workgroup_dispatch((_EXECUTABLE, _ENTRY), [ceil_div(q_len, s.tiling.rows), const_index(s.h_q), batch],
                              [*operands, batch, q_len, kv_len], _sizes(s, batch, q_len, kv_len),
                              (_inputs(s), ("out", "lse")), {"out": element_type(s.dtype), "lse": f32()})


def _mask(spec) -> str:
    if isinstance(spec, MaskedSequencePrefillSpec):
        return spec.mask_mode
    return "causal" if spec.causal else "full"


def unsupported(spec) -> str | None:
    """Why the mma lowering cannot build ``spec`` (None where it can)."""
    if type(spec) not in (SequencePrefillSpec, MaskedSequencePrefillSpec):
        return f"{type(spec).__name__} has no mma kernel (the dense sequence prefills have)"
    if _mask(spec) not in MASKS:
        return f"mask_mode {spec.mask_mode!r} has no mma kernel"
    if spec.dtype not in DTYPES:
        return f"dtype {spec.dtype}: mma.sync takes {' and '.join(DTYPES)}"
    if spec.d not in HEAD_DIMS:
        return f"d={spec.d}: the mma kernel takes head dims {HEAD_DIMS}"
    if spec.kv_dtype or spec.logits_soft_cap:
        return "8-bit KV and a soft cap have no dense mma kernel"
    return None


def build_cuda_sequence_prefill(spec, tiling: MmaTiling | None = None) -> ir.Module:
    """The verified module of ``spec`` (same signature as sequence.build_sequence_prefill) with
    the attention in one hand-written CUDA dispatch of ``tiling`` (default :data:`MMA_TILING`, read
    at the call: the GPU sweep sets it); ValueError where :func:`unsupported` says why not."""
    why = unsupported(spec)
    if why:
        raise ValueError(f"no mma lowering for {spec.name}: {why}")
    shapes = KernelShapes(spec.h_q, spec.h_kv, spec.d, spec.dtype, _mask(spec), spec.sm_scale * LOG2E,
                          tiling or MMA_TILING, spec.head_sinks)

    def emit(args):
        function = args["q"].owner.owner
        return emit_dense(shapes, args["q"], args["k"], args["v"], function, args.get("valid_lens"), args.get("sinks"))

    return function_module(spec, emit)
