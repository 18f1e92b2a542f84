"""The x86 lowering of the dense sequence prefill: one hand-written dispatch per call runs the whole
online softmax, Q.K^T and P.V in an engine per dtype (bf16: AMX tiles, :class:`AmxEngine`; f32
and f16: AVX-512 FMA register blocks, :class:`FmaEngine`, f16 widened as it is copied and
packed) and the softmax in f32 vector code (mlir/amx.py: ``Vec``; a soft cap applied to each
score block first), fed by K and V packed into the engine's order once per call by a packing
dispatch of its own (mlir/x86_packing.py). The KV-cache kernels
(mlir/x86_kv_cache.py) and serving passes (mlir/x86_decode.py) run the same dispatch body.
IREE 3.13's llvm-cpu codegen emits no AMX and runs f32 contractions load-bound (docs/performance.md,
the x86 lowering), so the backend record picks this lowering on Intel Xeons with AMX
(pipeline/cpu_tiles.py: cpu_spec_lowering).

Rows (G = h_q // h_kv folded in: row r of KV head h holds token r // G and query head h * G + r % G;
a workgroup owns ``row_block`` rows, a KV step is ``kv_block`` keys, both per kernel: blocks_for).
Q is read in place: each workgroup copies its rows from q [B, Lq, h_q, d] into its stack in the
engine's order (zero past the call's rows). K and V are packed once per call (T KV steps; keys
past the call's are zero):

    AmxEngine  k [B, h_kv, T, kv_block/16, d/2, 16, 2]  v [B, h_kv, T, d/16, kv_block/2, 16, 2]  bf16 B tiles
               q rows as A tiles [row_block/16, d/32, 16, 32]
    FmaEngine  k [B, h_kv, T, d, kv_block] (each block transposed)  v [B, h_kv, T * kv_block, d]  f32
               q rows [row_block, d]

Workgroup (x, h, b) owns rows [x, x + 1) * row_block of KV head h of entry b and keeps on its
stack, f32 unless named:

    scores [row_block, kv_block]   probs [row_block, kv_block] (the engine's operand dtype)
    acc [row_block, d]   (max, sum) [row_block]   q rows [row_block, d] (operand dtype)

For each KV step the rows can see: the scores (engine), then per row the mask (the row's keys
[lo, hi), :data:`MASKS`; only in steps that cross the rows' bounds), the running max, 2^(scale * s - max)
into probs, the sum and, where the max grew, the acc rescale; then acc += probs . values
(engine). With AMX and 64 rows the scores of one half of the rows are computed between 8-row
slices of the other half's softmax (``_Dispatch._overlapped_step``), so tiles and vectors run at
once. Rows are written to the output [B, Lq, h_q, d] directly (normalised, in the dtype);
(max, sum) per row go to a [B, h_kv, rows, 2] f32 buffer from which one generic makes lse
[B, Lq, h_q] (base 2; EMPTY_ROW_LSE and output 0 for a row that saw no key).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .amx import (
    BINDING, Tiles, Vec, as_i64, at, binding_pointer, ceil_div_i64, const_i64, dynamic_dims, hand_written_dispatch, i32,
    i64, stack_bytes, static_shape, workgroup_ids,
)
from .ir import (
    affine_map, arith_d, ceil_div, const_f32, const_index, const_int, dim, element_type, empty, f32, flow_d, generic,
    ir, linalg_d, llvm_d, math_d, scf_d, tensor_d, tensor_type, vector_d,
)
from .abi import function_module
from .online_softmax import LOG2E, NO_KEY_MAX
from .key_ranges import MASKS, KeyRange
from .score_tiles import ROW_TILES, PackedTiles
from .specs import EMPTY_ROW_LSE, MaskedSequencePrefillSpec, SequencePrefillSpec
from .x86_packing import emit_packed_kv, kv_tile_sizes


@dataclass(frozen=True)
class X86Cpu:
    """What the x86 lowering's kernels may use on the CPU they are built for, beyond AVX-512 F, DQ
    and BW (which every CPU it builds for has): AMX tiles (amx_tile and amx_bf16: bf16 products;
    without them bf16 on DotEngine where the CPU has AVX-512 BF16, else bf16 passes only, widened),
    AVX-512 VBMI (vpermi2b: a bf16 pass over an 8-bit cache widens it through byte tables) and
    AVX-512 BF16 (vdpbf16ps: without AMX, bf16 products on bf16 pairs, :class:`DotEngine`).
    pipeline/cpu_tiles.py: x86_cpu reads them from the CPU's features."""

    amx: bool = True
    vbmi: bool = True
    bf16_dot: bool = True


#: A Xeon with AMX tiles (Sapphire Rapids on: VBMI too), the x86 builders' default.
XEON_WITH_AMX = X86Cpu()


#: A workgroup's buffers live on its stack. IREE's workers keep 128 KiB by default (a kernel whose
#: buffers took 144 KiB crashed); the runtime gives them WORKER_STACK_BYTES (runtime/devices.py,
#: ``--task_worker_stack_size``, before its first CPU device), and blocks are chosen to keep the
#: buffers within STACK_BUDGET of it (the rest: the dispatch's frames and spills).
WORKER_STACK_BYTES = 1 << 20
STACK_BUDGET = 512 * 1024


def blocks_for(dtype: str, d: int, d_v: int | None = None, cpu: X86Cpu = XEON_WITH_AMX) -> tuple[int, int]:
    """(query rows of a workgroup, keys of a KV step) for head dims ``d`` (q, k) and ``d_v``
    (values; default d) on ``cpu`` (:func:`engine_type`): the largest of the engine's rows
    (:data:`ROW_BLOCKS`) and KV steps (:data:`KV_STEPS`) whose buffers fit STACK_BUDGET, rows
    first; ValueError where none do."""
    engine = engine_type(dtype, cpu)
    amx = engine.uses_amx
    for rows in ROW_BLOCKS[amx]:
        for keys in KV_STEPS[amx]:
            if workgroup_bytes(engine.OPERAND_BYTES, rows, keys, d, d_v) <= STACK_BUDGET:
                return rows, keys
    raise ValueError(f"d={d}, d_v={d_v or d}: no x86 blocks fit the stack budget")


#: The KV steps a kernel's engine tries, widest first, by whether it runs on AMX tiles. AMX: 256
#: keys against 128 (a step's acc tiles loaded and stored, and its rows' softmax state updated,
#: half as often a key): dense causal bf16, 64-row workgroups, same process, L = 512 / 2048 /
#: 8192 3.4-3.5 / 26.7-29.2 / 383-440 ms against 3.4-3.6 / 28.5-31.0 / 421-495 (512 keys: 32.1
#: and 405 against 256's 30.8 and 388 at 2048 and 8192). FMA: 128 keys (256: f32 L = 2048 118 ->
#: 124 ms).
KV_STEPS = {True: (256, 128, 64), False: (128, 64)}
#: A workgroup's query rows, widest first, by whether its engine runs on AMX tiles: AMX 64 (K and V
#: read half as often as with 32: 1.1x at L = 8192; the interleaved step takes 64), FMA 96 or 48,
#: whole blocks of FmaEngine's 6 rows (64 left a block of 4 whose code doubled the blocks', the
#: kernel's compile 14% longer; dense causal f32 L = 2048 96 rows 118.9 / 126.1 ms against 64
#: rows' 120.9 / 126.7).
ROW_BLOCKS = {True: (64, 32), False: (96, 48)}


def workgroup_bytes(operand: int, rows: int, keys: int, d: int, d_v: int | None = None) -> int:
    """Stack bytes of a workgroup's buffers (:class:`_Dispatch`) of ``rows`` rows and KV steps of
    ``keys`` keys: scores and acc [rows, d_v] in f32, probs and q rows [rows, d] in the engine's
    operands of ``operand`` bytes (its OPERAND_BYTES), (max, sum) a row."""
    return rows * (keys * 4 + keys * operand + (d if d_v is None else d_v) * 4 + d * operand + 8)

_EXECUTABLE = "x86_attention"
_ENTRY = "attend"
_DISPATCH_SCALARS = ("batch", "q_len", "kv_len", "rows", "kv_blocks")


@dataclass(frozen=True)
class KernelShapes:
    """The static facts of one kernel: heads, the head dim of q and k (``d``), operand dtype, the
    mask (:data:`MASKS`), the score scale (sm_scale * log2(e), the log2-domain factor), the
    workgroup's rows, a KV step's keys, the logits soft cap (0: none; semantics §11: cap *
    tanh(sm_scale s / cap)) and the head dim of v and the output (``d_v``; 0: d. MLA: d_latent
    of d_latent + d_rope; a ragged cache's d_v may differ from its d_qk)."""

    h_q: int
    h_kv: int
    d: int
    dtype: str
    mask: str
    scale_log2: float
    row_block: int
    kv_block: int
    soft_cap: float = 0.0
    d_v: int = 0

    def __post_init__(self):
        if not self.d_v:
            object.__setattr__(self, "d_v", self.d)

    @property
    def group(self) -> int:
        return self.h_q // self.h_kv


def _bytes(elem: ir.Type) -> int:
    """Bytes of an f32, bf16 or f16 element."""
    return 4 if elem == f32() else 2


class AmxEngine:
    """Q.K^T and P.V on AMX tiles (bf16 operands, f32 sums): the workgroup's q rows as A tiles
    [row_block/16, d/32, 16, 32], k and v in B tiles (score_tiles.PackedTiles 16 x 16 x 2), probs
    in bf16. Groups of 32 keys no row of the workgroup sees in a step (the causal diagonal's, a
    call's last) are not scored, and P.V runs over the step's groups the rows see only
    (_Dispatch.step_keys; bitwise the same): dense causal bf16 L = 512 / 2048 2.93-3.15 /
    23.1-23.2 ms against 3.11-3.37 / 23.8-25.0 (same process; fourteenth session)."""

    uses_amx = True
    #: Bytes of an operand (q rows, probabilities, staged keys and values): bf16.
    OPERAND_BYTES = 2
    #: Whether the P.V step reads value rows where a serving pass's cache holds them (its row
    #: pointers) instead of a staged copy (x86_decode.InPlaceValues).
    values_in_place = False
    #: Whether a serving pass stages its keys (x86_decode.ByteKeysDotEngine takes their scores instead).
    keys_staged = True

    def __init__(self, dtype: str):
        self.operand = element_type(dtype)
        self.prob_elem = self.operand
        self.layout = PackedTiles(dtype=dtype, m0=16, n0=16, k0=2)

    def q_row_at(self, d: int, row: ir.Value) -> ir.Value:
        """Byte offset of row ``row``'s first 64 bytes in the workgroup's A tiles
        [row_block/16, d/32, 16, 32]; its next 64 bytes (32 dims) are a tile (1 KiB) further."""
        tile, within = arith_d.divui(row, const_i64(16)), arith_d.remui(row, const_i64(16))
        return arith_d.addi(arith_d.muli(tile, const_i64(d // 32 * 1024)), arith_d.muli(within, const_i64(64)))

    q_chunk_stride = 1024

    def scores(self, w: "_Dispatch", q_base, k_block, scores) -> None:
        """scores[row_block, kv_block] = q . k^T, in groups of 2 x 2 C tiles (:meth:`score_group`),
        those of keys past ``w.step_keys`` (where the dispatch bounds them) skipped."""
        for row_pair in range(w.s.row_block // 32):
            for key_pair in range(w.s.kv_block // 32):
                self.score_group(w, q_base, k_block, scores, row_pair, key_pair, w.step_keys if key_pair else None)

    def score_group(self, w: "_Dispatch", q_base, k_block, scores, row_pair: int, key_pair, seen=None) -> None:
        """The scores of rows [32 row_pair, +32) and keys [32 key_pair, +32) (``key_pair`` an int or
        an i64 Value): 2 x 2 C tiles over d/32 steps of 2 A and 2 B tiles; with ``seen`` (the keys
        of the step some row sees, i64), only where some of those keys are seen: the softmax masks
        the columns of a skipped group without reading them."""
        if seen is not None:
            first_key = arith_d.muli(key_pair, const_i64(32)) if not isinstance(key_pair, int) else const_i64(32 * key_pair)
            within = scf_d.IfOp(arith_d.cmpi(arith_d.CmpIPredicate.sgt, seen, first_key))
            with ir.InsertionPoint(within.then_block):
                self.score_group(w, q_base, k_block, scores, row_pair, key_pair)
                scf_d.YieldOp([])
            return
        d, t = w.s.d, Tiles()
        q_row_tile = d // 32 * 1024         # bytes of one row tile's d/32 A tiles
        k_key_tile = d // 2 * 64            # bytes of one key tile's d/2 pair rows
        dynamic = not isinstance(key_pair, int)
        keys = at(k_block, arith_d.muli(key_pair, const_i64(2 * k_key_tile)) if dynamic else key_pair * 2 * k_key_tile)
        columns = at(scores, arith_d.muli(key_pair, const_i64(32 * 4)) if dynamic else key_pair * 32 * 4)
        acc = [t.zero() for _ in range(4)]
        for step in range(d // 32):
            a = [t.load(at(q_base, (2 * row_pair + i) * q_row_tile + step * 1024), 64) for i in range(2)]
            b = [t.load(at(keys, j * k_key_tile + step * 1024), 64) for j in range(2)]
            acc = [t.dot(acc[2 * i + j], a[i], b[j]) for i in range(2) for j in range(2)]
        for i in range(2):
            for j in range(2):
                t.store(at(columns, (2 * row_pair + i) * 16 * w.score_stride + j * 16 * 4), w.score_stride,
                        acc[2 * i + j])

    def accumulate(self, w: "_Dispatch", v_block) -> None:
        """acc[row_block, d_v] += probs[row_block, kv_block] . values, two dim tiles at a time;
        where the dispatch bounds the keys some row sees (``w.step_keys``), over the steps of 32
        keys that hold them only (the probabilities past them are 0), in an scf.for carrying the
        C tiles."""
        d, t = w.s.d_v, Tiles()
        v_dim_tile = w.s.kv_block // 2 * 64      # bytes of one dim tile's key-pair rows
        steps = None if w.step_keys is None else arith_d.index_cast(
            ir.IndexType.get(), ceil_div_i64(w.step_keys, 32))

        def step_dots(rows, pair, step, acc):
            step_at = step * 64 if isinstance(step, int) else arith_d.muli(step, const_i64(64))
            a = [t.load(at(at(w.probs, (rows + i) * 16 * w.prob_stride), step_at), w.prob_stride) for i in range(2)]
            step_tile = step * 1024 if isinstance(step, int) else arith_d.muli(step, const_i64(1024))
            b = [t.load(at(at(v_block, (2 * pair + j) * v_dim_tile), step_tile), 64) for j in range(2)]
            return [t.dot(acc[2 * i + j], a[i], b[j]) for i in range(2) for j in range(2)]

        for rows in range(0, w.s.row_block // 16, 2):   # pairs of row tiles
            for pair in range(d // 32):
                c_at = [at(w.acc, (rows + i) * 16 * w.acc_stride + (2 * pair + j) * 64)
                        for i in range(2) for j in range(2)]
                acc = [t.load(p, w.acc_stride) for p in c_at]
                if steps is None:
                    for step in range(w.s.kv_block // 32):
                        acc = step_dots(rows, pair, step, acc)
                else:
                    loop = scf_d.ForOp(const_index(0), steps, const_index(1), acc)
                    with ir.InsertionPoint(loop.body):
                        scf_d.YieldOp(step_dots(rows, pair, as_i64(loop.induction_variable),
                                                list(loop.inner_iter_args)))
                    acc = list(loop.results)
                for p, tile in zip(c_at, acc):
                    t.store(p, w.acc_stride, tile)


class FmaEngine:
    """Q.K^T and P.V in f32 AVX-512 FMAs on register blocks: the workgroup's q rows [row_block, d],
    k tiles transposed [B, h_kv, T, d, kv_block] and values [B, h_kv, T * kv_block, d] (the row
    tiles of score_tiles.ROW_TILES), probs f32. Scores in blocks of 6 rows x 64 keys (24
    accumulators, one query element broadcast per row and step: 24 FMAs to 10 loads), P.V in
    blocks of 6 rows x 64 dims; a pass's last row_block % 6 rows in one block of their own (the
    prefill kernels' 96 or 48 rows leave none: ROW_BLOCKS). Against 4 x 4 (16 FMAs to 8 loads):
    dense causal f32 L = 512 / 2048 1.2x / 1.05x, f16 1.06x; 7 rows (28 accumulators) spill
    (docs/performance.md, tenth session). In a step some of whose keys no row of the workgroup
    sees (the causal diagonal's, a call's last), score columns past them (64 at a time) and P.V
    keys past them (4 at a time) are skipped (_Dispatch.step_keys), the results bitwise the same:
    dense causal f32 L = 512 / 2048 8.3-8.9 / 100.8-101.0 ms against 9.0-9.7 / 104.0-104.3, f16
    L = 2048 106.3-109.6 against 110.8-113.5 (same process; fourteenth session)."""

    uses_amx = False
    values_in_place = False
    keys_staged = True
    OPERAND_BYTES = 4
    SCORE_ROWS, SCORE_VECTORS = 6, 4
    ACC_ROWS, ACC_VECTORS = 6, 4
    UNROLL = 4

    def __init__(self, dtype: str):
        self.operand = f32()
        self.prob_elem = f32()
        self.layout = ROW_TILES

    def q_row_at(self, d: int, row: ir.Value) -> ir.Value:
        """Byte offset of row ``row`` in the workgroup's rows [row_block, d] f32."""
        return arith_d.muli(row, const_i64(d * 4))

    q_chunk_stride = 64

    @staticmethod
    def _blocked(count, step, initial, body):
        """An scf.for over [0, count) by ``step`` carrying the vectors ``initial`` (``count`` an int
        or an index Value); ``body(i64 index, vectors) -> vectors``."""
        upper = count if isinstance(count, ir.Value) else const_index(count)
        loop = scf_d.ForOp(const_index(0), upper, const_index(step), initial)
        with ir.InsertionPoint(loop.body):
            scf_d.YieldOp(body(as_i64(loop.induction_variable), list(loop.inner_iter_args)))
        return list(loop.results)

    def rows_computed(self, rows_valid: ir.Value, row_block: int) -> ir.Value:
        """The rows of a prefill workgroup the blocks compute (an i64 Value): its ``rows_valid``
        rows rounded up to whole blocks of rows, at most ``row_block`` (a multiple of them)."""
        rows = self.SCORE_ROWS
        assert rows == self.ACC_ROWS and row_block % rows == 0
        rounded = arith_d.muli(ceil_div_i64(rows_valid, rows), const_i64(rows))
        return arith_d.minsi(rounded, const_i64(row_block))

    @staticmethod
    def _row_blocks(w: "_Dispatch", rows: int, body) -> None:
        """``body(first row, rows)`` for each block of ``rows`` rows of the workgroup's
        ``row_block`` (of its ``rows_computed`` where the dispatch bounds them), in an scf.for
        (unrolled, the f32 kernels' IR grew to 1 MB and took 3 s to compile), then once for the
        last ``row_block % rows`` rows."""
        row_block = w.s.row_block
        full = row_block - row_block % rows
        if full:
            first = const_index(0)
            upper = const_index(full) if w.rows_computed is None else \
                arith_d.index_cast(ir.IndexType.get(), w.rows_computed)
            loop = scf_d.ForOp(first, upper, const_index(rows))
            with ir.InsertionPoint(loop.body):
                body(as_i64(loop.induction_variable), rows)
                scf_d.YieldOp([])
        if row_block % rows:
            body(const_i64(full), row_block % rows)

    def scores(self, w: "_Dispatch", q_base, k_block, scores) -> None:
        """Scores [row_block, kv_block] of the step; a group of columns past ``w.step_keys`` (the
        keys some row of the step sees, where the dispatch bounds them) is not computed: the
        softmax masks those columns without reading them."""
        d, v = w.s.d, w.vec
        vectors = self.SCORE_VECTORS
        row_bytes = d * _bytes(self.operand)

        def group(q_rows, score_rows, rows, col0):
            step = self._macs(w, lambda kk: self._key_step(w, k_block, kk), True, q_rows, row_bytes, rows, col0,
                              vectors)
            zero = v.const(0.0)
            acc = self._blocked(self._depth(d), self.UNROLL, [zero] * (rows * vectors), step)
            for r in range(rows):
                for c in range(vectors):
                    v.store(acc[r * vectors + c], at(score_rows, r * w.score_stride + (col0 + 16 * c) * 4))

        def row_block(row0, rows):
            q_rows = at(q_base, arith_d.muli(row0, const_i64(row_bytes)))
            score_rows = at(scores, arith_d.muli(row0, const_i64(w.score_stride)))
            for col0 in range(0, w.s.kv_block, 16 * vectors):
                if not col0 or w.step_keys is None:
                    group(q_rows, score_rows, rows, col0)
                    continue
                seen = scf_d.IfOp(arith_d.cmpi(arith_d.CmpIPredicate.sgt, w.step_keys, const_i64(col0)))
                with ir.InsertionPoint(seen.then_block):
                    group(q_rows, score_rows, rows, col0)
                    scf_d.YieldOp([])

        self._row_blocks(w, self.SCORE_ROWS, row_block)

    def accumulate(self, w: "_Dispatch", v_block) -> None:
        d, v = w.s.d_v, w.vec

        def row_block(row0, rows):
            acc_rows = at(w.acc, arith_d.muli(row0, const_i64(w.acc_stride)))
            prob_rows = at(w.probs, arith_d.muli(row0, const_i64(w.prob_stride)))
            for col0 in range(0, d, 16 * self.ACC_VECTORS):
                vectors = min(self.ACC_VECTORS, (d - col0) // 16)   # d = 96: 4 vectors, then 2
                places = [at(acc_rows, r * w.acc_stride + (col0 + 16 * c) * 4)
                          for r in range(rows) for c in range(vectors)]

                step = self._macs(w, lambda kk: self._value_step(w, v_block, kk), False, prob_rows, w.prob_stride,
                                  rows, col0, vectors)
                acc = self._blocked(depth, self.UNROLL, [v.load(p) for p in places], step)
                for p, value in zip(places, acc):
                    v.store(value, p)

        depth = self._depth(w.s.kv_block)
        if w.step_keys is not None:   # keys past the step's seen ones have probability 0: not added
            depth = arith_d.index_cast(ir.IndexType.get(), self._steps_seen(w.step_keys))
        self._row_blocks(w, self.ACC_ROWS, row_block)

    def _macs(self, w: "_Dispatch", step_at, keys: bool, rows_at, row_stride: int, rows: int, col0: int,
              vectors: int):
        """The :meth:`_blocked` body of a block of ``rows`` x ``vectors`` accumulators (row-major):
        UNROLL steps kk, each ``vectors`` x 16 lanes from column ``col0`` of the step at
        ``step_at(kk)`` (keys: Q.K^T; values: P.V), times the f32 at ``kk * 4`` of each of ``rows``
        rows from ``rows_at``, ``row_stride`` bytes apart (the q rows; the probabilities)."""
        def step(k, acc):
            for u in range(self.UNROLL):
                kk = arith_d.addi(k, const_i64(u))
                step_start = step_at(kk)
                lanes = [self._lanes(w, step_start, col0 + 16 * c, keys=keys) for c in range(vectors)]
                column = arith_d.muli(kk, const_i64(4))
                for r in range(rows):
                    factor = self._broadcast(at(at(rows_at, r * row_stride), column))
                    for c in range(vectors):
                        acc[r * vectors + c] = self._mac(acc[r * vectors + c], factor, lanes[c])
            return acc
        return step

    # One step of the blocks: step kk reads 16 lanes of keys (scores; key columns from ``col``)
    # or values (P.V; dims from ``col``) and multiplies them by the 4 bytes of a q row or a probs
    # row at ``kk * 4``: one f32.

    @staticmethod
    def _depth(size: int) -> int:
        """Steps over a contraction of ``size`` elements."""
        return size

    def _steps_seen(self, keys) -> ir.Value:
        """The P.V steps over a step's first ``keys`` keys (an i64 Value), whole UNROLLs of them."""
        return arith_d.andi(arith_d.addi(keys, const_i64(self.UNROLL - 1)), const_i64(-self.UNROLL))

    @staticmethod
    def _key_step(w: "_Dispatch", k_block, step) -> ir.Value:
        """Where step ``step``'s keys start (K^T [d, kv_block]: row ``step``)."""
        return at(k_block, arith_d.muli(step, const_i64(w.s.kv_block * 4)))

    @staticmethod
    def _value_step(w: "_Dispatch", v_block, step) -> ir.Value:
        """Where step ``step``'s values start (V [kv_block, d_v]: row ``step``)."""
        return at(v_block, arith_d.muli(step, const_i64(w.s.d_v * 4)))

    def _lanes(self, w: "_Dispatch", step_at, col: int, keys: bool) -> ir.Value:
        """16 lanes of a step from column ``col``."""
        return w.vec.load(at(step_at, col * 4))

    @staticmethod
    def _broadcast(scalar_at) -> ir.Value:
        return Vec().splat(llvm_load(f32(), scalar_at))

    @staticmethod
    def _mac(acc, broadcast, lanes) -> ir.Value:
        return math_d.fma(broadcast, lanes, acc)


class DotEngine(FmaEngine):
    """Q.K^T and P.V in bf16 on a CPU without AMX tiles but with AVX-512 BF16 (a Zen 4), in pair
    dot products (vdpbf16ps) on AMX's operand layouts: K [kv_block/16, d/2, 16, 2], V [d_v/16,
    kv_block/2, 16, 2] (``layout``: the dense kernels' tile packing; a serving pass's staging,
    mlir/x86_decode.py: DotStaging), q rows [row_block, d] and probs [row_block, kv_block] bf16.
    Each 16-lane step multiplies a broadcast pair of a row's bf16 (two query dims, or two keys'
    probabilities) into 16 keys' (or dims') pairs: FmaEngine's blocks, a pair a step, half its
    products and no widening. On a Zen 4 against the linalg lowering: the bf16 passes 1.14-1.82x,
    dense causal bf16 L = 128 / 512 / 2048 4.8x / 2.4x / 1.9x (docs/performance.md,
    twenty-second session)."""

    OPERAND_BYTES = 2
    #: As InPlaceValues (mlir/x86_decode.py): a pass's rows are multiples of 4 more often than of
    #: 6 (a dense kernel's 96 or 48 rows are both).
    SCORE_ROWS = ACC_ROWS = 4

    def __init__(self, dtype: str):
        self.operand = ir.BF16Type.get()
        self.prob_elem = self.operand
        self.layout = PackedTiles(dtype=dtype, m0=16, n0=16, k0=2)

    def q_row_at(self, d: int, row: ir.Value) -> ir.Value:
        """Byte offset of row ``row`` in the workgroup's rows [row_block, d] bf16."""
        return arith_d.muli(row, const_i64(d * 2))

    @staticmethod
    def _depth(size: int) -> int:
        return size // 2

    def _steps_seen(self, keys) -> ir.Value:
        pairs = arith_d.divsi(arith_d.addi(keys, const_i64(1)), const_i64(2))
        return super()._steps_seen(pairs)

    @staticmethod
    def _key_step(w: "_Dispatch", k_block, step) -> ir.Value:
        return at(k_block, arith_d.muli(step, const_i64(64)))   # K [kv_block/16, d/2, 16, 2]: pair row

    _value_step = _key_step                                     # V [d_v/16, kv_block/2, 16, 2]: key-pair row

    def _lanes(self, w: "_Dispatch", step_at, col: int, keys: bool) -> ir.Value:
        """16 pairs of bf16 of the step's row, columns [col, col + 16) (keys, or value dims)."""
        tile = w.s.d // 2 * 64 if keys else w.s.kv_block // 2 * 64
        lanes = llvm_load(ir.VectorType.get([16], i32()), at(step_at, (col // 16) * tile))
        return vector_d.bitcast(ir.VectorType.get([32], ir.BF16Type.get()), lanes)

    @staticmethod
    def _broadcast(scalar_at) -> ir.Value:
        pair = vector_d.broadcast(ir.VectorType.get([16], i32()), llvm_load(i32(), scalar_at))
        return vector_d.bitcast(ir.VectorType.get([32], ir.BF16Type.get()), pair)

    @staticmethod
    def _mac(acc, broadcast, lanes) -> ir.Value:
        return llvm_d.call_intrinsic(acc.type, "llvm.x86.avx512bf16.dpbf16ps.512", [acc, broadcast, lanes],
                                     [], [])


#: The contractions of a kernel per dtype: AMX tiles for bf16, FMA blocks for f32 and for f16
#: (widened to f32 as it is packed: these CPUs have no amx_fp16; the linalg lowering ran f16 at
#: 0.64-0.70x torch SDPA there).
ENGINES = {"bfloat16": AmxEngine, "float32": FmaEngine, "float16": FmaEngine}


def engine_type(dtype: str, cpu: X86Cpu = XEON_WITH_AMX) -> type | None:
    """The contraction engine class of a kernel in ``dtype`` on ``cpu``:
    :data:`ENGINES`' where the CPU has AMX tiles or the engine needs none; bf16 without them
    DotEngine where the CPU has AVX-512 BF16, else None (no x86 kernel)."""
    engine = ENGINES[dtype]
    if cpu.amx or not engine.uses_amx:
        return engine
    return DotEngine if cpu.bf16_dot else None


def engine_for(dtype: str, cpu: X86Cpu = XEON_WITH_AMX):
    """The contraction engine of a kernel in ``dtype`` on ``cpu`` (build inside an MLIR context)."""
    return engine_type(dtype, cpu)(dtype)


def uses_amx(spec, cpu: X86Cpu = XEON_WITH_AMX) -> bool:
    """Whether ``spec``'s kernel in this lowering runs AMX tile instructions on ``cpu`` (its
    process must ask Linux for the tile state first: runtime/amx.py)."""
    return cpu.amx and ENGINES[spec.dtype].uses_amx


class _Dispatch:
    """Builds the dispatch function's body (one workgroup's rows)."""

    def __init__(self, shapes: KernelShapes, engine, pointers: dict, scalars: dict):
        self.s = shapes
        self.engine = engine
        self.p = pointers
        self.n = scalars
        self.vec = Vec()
        self.elem = element_type(shapes.dtype)
        d = shapes.d
        self.score_stride = self.s.kv_block * 4
        self.prob_stride = self.s.kv_block * _bytes(engine.prob_elem)
        self.acc_stride = shapes.d_v * 4
        self.score_bytes = self.s.row_block * self.score_stride
        self.scores = stack_bytes(self.score_bytes)
        self.probs = stack_bytes(self.s.row_block * self.prob_stride)
        self.acc = stack_bytes(self.s.row_block * self.acc_stride)
        self.state = stack_bytes(self.s.row_block * 8)   # (max, sum) per row
        self.q_rows = stack_bytes(self.s.row_block * d * _bytes(engine.operand))   # in the engine's order
        #: log2(e) x the score scale (f32), and the rows the softmax steps walk (all of them here)
        self.scale_log2 = arith_d.constant(f32(), shapes.scale_log2)
        self.softmax_rows = self.s.row_block
        #: The rows the engine's blocks compute (an i64 Value) where the dispatch bounds them (a
        #: prefill workgroup on the FMA blocks or DotEngine: :meth:`emit`); None: all row_block.
        self.rows_computed = None
        #: The keys of the current KV step some row of the workgroup sees (an i64 Value, at most
        #: kv_block; fewer in the step of the causal diagonal: :meth:`keys_seen`), where the
        #: dispatch bounds them (its :meth:`emit`; a serving pass's does not): the engines skip
        #: the score columns and P.V keys past it. None where unbounded.
        self.step_keys = None

    @staticmethod
    def row_addr(base, row, stride) -> ir.Value:
        """``base + row * stride`` (row an i64 Value)."""
        return at(base, arith_d.muli(row, const_i64(stride)))

    def emit(self) -> None:
        s = self.s
        wx, head, entry = workgroup_ids()
        q_len, kv_len = self.n["q_len"], self.n["kv_len"]
        kv_blocks = self.n["kv_blocks"]
        first_row = arith_d.muli(wx, const_i64(self.s.row_block))
        rows_total = arith_d.muli(q_len, const_i64(s.group))
        rows_valid = arith_d.minsi(const_i64(self.s.row_block), arith_d.subi(rows_total, first_row))
        if not self.engine.uses_amx:   # a workgroup's last rows past the entry's are not computed
            self.rows_computed = self.engine.rows_computed(rows_valid, s.row_block)
            self.softmax_rows = arith_d.index_cast(ir.IndexType.get(), self.rows_computed)
        keys = self.key_range(entry, q_len, kv_len)
        # hi grows (causal), is one value or 0 for a prefix of rows (padded) or a suffix
        # (left-padded): the rows' widest and narrowest ends are those of the first and last row
        first_token = arith_d.divsi(first_row, const_i64(s.group))
        last_token = arith_d.divsi(arith_d.addi(first_row, arith_d.subi(rows_valid, const_i64(1))), const_i64(s.group))
        ends = keys.hi(first_token), keys.hi(last_token)
        end, self.narrowest_end = arith_d.maxsi(*ends), arith_d.minsi(*ends)
        self.keys = keys
        first_block = arith_d.divsi(keys.lo(), const_i64(s.kv_block))
        blocks = ceil_div_i64(end, self.s.kv_block)
        hk = arith_d.addi(arith_d.muli(entry, const_i64(s.h_kv)), head)   # (b, h) flattened
        operand_bytes = _bytes(self.engine.operand)
        block_bytes = self.s.kv_block * s.d * operand_bytes
        v_block_bytes = self.s.kv_block * s.d_v * operand_bytes
        q_base = self.q_rows
        self._copy_query_rows(lambda row: self._token_head(entry, head, row, q_len), first_row, rows_total)
        blocks_before = arith_d.muli(hk, kv_blocks)
        k_base = at(self.p["k_tiles"], arith_d.muli(blocks_before, const_i64(block_bytes)))
        v_base = at(self.p["v_tiles"], arith_d.muli(blocks_before, const_i64(v_block_bytes)))

        self._init_rows()

        def k_block(block):
            return at(k_base, arith_d.muli(block, const_i64(block_bytes)))

        self.widest_end = end
        overlapped = self.engine.uses_amx and s.row_block == 64
        if overlapped:   # rows [0, 32) of the first step are scored before the loop
            first = scf_d.IfOp(arith_d.cmpi(arith_d.CmpIPredicate.slt, first_block, blocks))
            with ir.InsertionPoint(first.then_block):
                seen = self.keys_seen(first_block)
                for key_pair in range(s.kv_block // 32):
                    self.engine.score_group(self, q_base, k_block(first_block), self.scores, 0, key_pair,
                                            seen if key_pair else None)
                scf_d.YieldOp([])
        index = ir.IndexType.get()
        loop = scf_d.ForOp(arith_d.index_cast(index, first_block), arith_d.index_cast(index, blocks), const_index(1))
        with ir.InsertionPoint(loop.body):
            block = as_i64(loop.induction_variable)
            self.step_keys = self.keys_seen(block)
            if overlapped:
                self._overlapped_step(block, blocks, q_base, k_block, first_row)
            else:
                self.engine.scores(self, q_base, k_block(block), self.scores)
                self._softmax(self.column_of(block), self.scores, first_row)
            self.engine.accumulate(self, at(v_base, arith_d.muli(block, const_i64(v_block_bytes))))
            scf_d.YieldOp([])
        self._write_rows(entry, head, hk, first_row, rows_valid, q_len)

    def key_range(self, entry, q_len, kv_len):
        """The keys each row of entry ``entry`` sees (:class:`KeyRange` of the kernel's mask)."""
        valid_len = llvm_load(i32(), at(self.p["valid_lens"], arith_d.muli(entry, const_i64(4)))) \
            if "valid_lens" in self.p else None
        return KeyRange(self.s.mask, q_len, kv_len, None if valid_len is None else arith_d.extsi(i64(), valid_len))

    def state_at(self, hk, global_row, out_row) -> ir.Value:
        """Where row ``global_row`` of (entry, KV head) ``hk`` keeps its (max, sum): state
        [B, h_kv, rows, 2] (``out_row``: its row of the output)."""
        return at(self.p["state"], arith_d.muli(arith_d.addi(arith_d.muli(hk, self.n["rows"]), global_row),
                                                const_i64(8)))

    def normaliser(self, total, row_max, head, global_row) -> ir.Value:
        """1 / the row's denominator (its ``total`` of weights), 0 for a row that saw no key."""
        return self.inverse(total, total)

    @staticmethod
    def inverse(total, denominator) -> ir.Value:
        """1 / ``denominator``, 0 for a row that saw no key (its ``total`` of weights not above 0)."""
        zero, one = arith_d.constant(f32(), 0.0), arith_d.constant(f32(), 1.0)
        return arith_d.select(arith_d.cmpf(arith_d.CmpFPredicate.OGT, total, zero), arith_d.divf(one, denominator), zero)

    def _token_head(self, entry, head, global_row, q_len) -> ir.Value:
        """The row of q or the output [*, d] that row ``global_row`` of KV head ``head`` of entry
        ``entry`` is: token first_token + global_row // G, query head head * G + global_row % G."""
        group = const_i64(self.s.group)
        token = arith_d.divsi(global_row, group)
        q_head = self.query_head(head, global_row, group)
        return arith_d.addi(arith_d.muli(arith_d.addi(self.first_token(entry, q_len), token), const_i64(self.s.h_q)),
                            q_head)

    def query_head(self, head, global_row, group: ir.Value | None = None) -> ir.Value:
        """The query head of row ``global_row`` of KV head ``head``: head * G + global_row % G."""
        group = group or const_i64(self.s.group)
        return arith_d.addi(arith_d.muli(head, group), arith_d.remsi(global_row, group))

    def first_token(self, entry, q_len) -> ir.Value:
        """Entry ``entry``'s first token in q and the output [B * Lq, ...]: entry * Lq."""
        return arith_d.muli(entry, q_len)

    def _overlapped_step(self, block, blocks, q_base, k_block, first_row) -> None:
        """The scores and softmax of KV step ``block`` with AMX and vector work interleaved (64-row
        workgroups): the softmax of rows [0, 32) runs between the score groups of rows [32, 64) of
        this step, that of rows [32, 64) between those of rows [0, 32) of the next step (whose
        scores rows are free again); rows [0, 32) of the first step are scored before the loop.
        Each 2 x 2 group of tiles alternates with 8 rows of softmax, so the core can run both."""
        engine, scores = self.engine, self.scores
        start = self.column_of(block)
        self._softmax(start, scores, first_row, 0, lambda key_pair: engine.score_group(
            self, q_base, k_block(block), scores, 1, key_pair, self.step_keys))
        following = arith_d.addi(block, const_i64(1))

        def next_step(key_pair):
            more = scf_d.IfOp(arith_d.cmpi(arith_d.CmpIPredicate.slt, following, blocks))
            with ir.InsertionPoint(more.then_block):
                engine.score_group(self, q_base, k_block(following), scores, 0, key_pair, self.keys_seen(following))
                scf_d.YieldOp([])

        self._softmax(start, scores, first_row, 32, next_step)

    def _copy_query_rows(self, source_row, first_row, rows_total) -> None:
        """The workgroup's query rows into ``q_rows`` in the engine's order, 64 bytes at a time:
        row r from row ``source_row(first_row + r)`` of q viewed as [*, d]; rows from
        ``rows_total`` on are zero."""
        s, v = self.s, self.vec
        chunks = s.d * _bytes(self.engine.operand) // 64
        bits = ir.VectorType.get([16], i32())
        zero = const_int(bits, 0)

        def row(r):
            global_row = arith_d.addi(first_row, r)
            dest = at(self.q_rows, self.engine.q_row_at(s.d, r))
            present = scf_d.IfOp(arith_d.cmpi(arith_d.CmpIPredicate.slt, global_row, rows_total), [], has_else=True)
            with ir.InsertionPoint(present.then_block):
                source = at(self.p["q"], arith_d.muli(source_row(global_row), const_i64(s.d * _bytes(self.elem))))
                for c in range(chunks):
                    if self.elem == self.engine.operand:
                        chunk = v.load(at(source, c * 64), i32())
                    else:   # f16 rows of the FMA engine, widened 16 at a time
                        chunk = arith_d.extf(v.f32x, v.load(at(source, c * 32), self.elem))
                    v.store(chunk, at(dest, c * self.engine.q_chunk_stride))
                scf_d.YieldOp([])
            with ir.InsertionPoint(present.else_block):
                for c in range(chunks):
                    v.store(zero, at(dest, c * self.engine.q_chunk_stride))
                scf_d.YieldOp([])

        self._for_rows(self.s.row_block, row)

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
            for t in range(self.s.d_v // 16):
                self.vec.store(zero, at(acc_row, t * 64))
            llvm_store(init, self.row_addr(self.state, r, 8))

        self._for_rows(self.s.row_block, row)

    def column_of(self, block) -> ir.Value:
        """The first key (column) of KV step ``block``."""
        return arith_d.muli(block, const_i64(self.s.kv_block))

    def keys_seen(self, block) -> ir.Value:
        """The keys of KV step ``block`` some row of the workgroup sees: kv_block, fewer in the
        step of the causal diagonal and a call's last (i64; the step is one of the rows')."""
        return arith_d.minsi(const_i64(self.s.kv_block), arith_d.subi(self.widest_end, self.column_of(block)))

    def _softmax(self, block_start, scores, first_row, row_begin=0, between=None) -> None:
        """The rows' softmax step over keys [block_start, + kv_block) (with ``between``: of rows
        [row_begin, +32) in kv_block / 32 groups, ``between(group)`` emitted before each); the
        mask is applied only where the block reaches past the narrowest row end or starts before
        the rows' first key."""
        block_end = arith_d.addi(block_start, const_i64(self.s.kv_block))
        masked = arith_d.cmpi(arith_d.CmpIPredicate.sgt, block_end, self.narrowest_end)
        if self.keys.has_lower_bound:
            masked = arith_d.ori(masked, arith_d.cmpi(arith_d.CmpIPredicate.slt, block_start, self.keys.lo()))
        branch = scf_d.IfOp(masked, [], has_else=True)
        for masked, part in ((True, branch.then_block), (False, branch.else_block)):
            with ir.InsertionPoint(part):
                self._softmax_rows(block_start, scores, first_row, masked, row_begin, between)
                scf_d.YieldOp([])

    def _softmax_rows(self, block_start, scores, first_row, masked: bool, row_begin: int, between) -> None:
        s, v = self.s, self.vec
        capped = s.soft_cap > 0
        if capped:   # scores become cap log2(e) tanh(sm_scale s / cap), in the log2 domain already
            inner = v.splat(arith_d.mulf(self.scale_log2, arith_d.constant(f32(), 1.0 / (LOG2E * s.soft_cap))))
            outer = v.const(s.soft_cap * LOG2E)
        scale_scalar = arith_d.constant(f32(), 1.0) if capped else self.scale_log2
        scale = v.splat(scale_scalar)
        neg_inf = v.const(float("-inf"))
        block_start = arith_d.trunci(i32(), block_start)
        columns = [arith_d.addi(v.iota(), v.splat(arith_d.addi(block_start, arith_d.constant(i32(), 16 * c))))
                   for c in range(self.s.kv_block // 16)]

        lower = v.splat(arith_d.trunci(i32(), self.keys.lo())) if masked and self.keys.has_lower_bound else None

        def row(r):
            token = arith_d.divsi(arith_d.addi(first_row, r), const_i64(s.group))
            limit = v.splat(arith_d.trunci(i32(), self.keys.hi(token))) if masked else None
            score_row = self.row_addr(scores, r, self.score_stride)
            chunks = []   # raw q.k; the scale enters the row max and, fused, the exponents
            for c in range(self.s.kv_block // 16):
                raw = v.load(at(score_row, c * 64))
                if capped:
                    raw = arith_d.mulf(v.tanh(arith_d.mulf(raw, inner)), outer)
                if masked:
                    valid = arith_d.cmpi(arith_d.CmpIPredicate.slt, columns[c], limit)
                    if lower is not None:
                        valid = arith_d.andi(valid, arith_d.cmpi(arith_d.CmpIPredicate.sge, columns[c], lower))
                    raw = arith_d.select(valid, raw, neg_inf)
                chunks.append(raw)
            widest = chunks[0]
            for chunk in chunks[1:]:
                widest = v.max(widest, chunk)
            state_at = self.row_addr(self.state, r, 8)
            old_max = llvm_load(f32(), state_at)
            old_sum = llvm_load(f32(), at(state_at, 4))
            new_max = v.max(old_max, arith_d.mulf(v.reduce("maximumf", widest), scale_scalar))
            less_max = v.splat(arith_d.negf(new_max))
            weights = [v.exp2(math_d.fma(chunk, scale, less_max)) for chunk in chunks]
            total = weights[0]
            for w in weights[1:]:
                total = arith_d.addf(total, w)
            # where the max grew, the old sum and acc scaled by 2^(old max - new max); else that
            # factor is exactly 1 (the exp2 fit is 1 at 0) and neither is touched
            grew = scf_d.IfOp(arith_d.cmpf(arith_d.CmpFPredicate.OGT, new_max, old_max), [f32()], has_else=True)
            with ir.InsertionPoint(grew.then_block):
                alpha_v = v.exp2(v.splat(arith_d.subf(old_max, new_max)))
                acc_row = self.row_addr(self.acc, r, self.acc_stride)
                for t in range(s.d_v // 16):
                    where = at(acc_row, t * 64)
                    v.store(arith_d.mulf(v.load(where), alpha_v), where)
                scf_d.YieldOp([arith_d.mulf(old_sum, vector_extract(alpha_v))])
            with ir.InsertionPoint(grew.else_block):
                scf_d.YieldOp([old_sum])
            new_sum = arith_d.addf(grew.results[0], v.reduce("add", total))
            llvm_store(new_max, state_at)
            llvm_store(new_sum, at(state_at, 4))
            prob_row = self.row_addr(self.probs, r, self.prob_stride)
            prob_elem = self.engine.prob_elem
            for c, w in enumerate(weights):
                v.store(v.narrow(w, prob_elem), at(prob_row, c * 16 * _bytes(prob_elem)))

        if between is None:
            self._for_rows(self.softmax_rows, row)
            return
        groups = self.s.kv_block // 32
        per_group = 32 // groups
        loop = scf_d.ForOp(const_index(0), const_index(groups), const_index(1))
        with ir.InsertionPoint(loop.body):
            group = as_i64(loop.induction_variable)
            between(group)
            first = arith_d.addi(const_i64(row_begin), arith_d.muli(group, const_i64(per_group)))
            self._for_rows(per_group, lambda i: row(arith_d.addi(first, i)))
            scf_d.YieldOp([])

    def _write_rows(self, entry, head, hk, first_row, rows_valid, q_len) -> None:
        s, v = self.s, self.vec

        def row(r):
            global_row = arith_d.addi(first_row, r)
            state_at = self.row_addr(self.state, r, 8)
            inv_v = v.splat(self.normaliser(llvm_load(f32(), at(state_at, 4)), llvm_load(f32(), state_at), head,
                                            global_row))
            out_row = self._token_head(entry, head, global_row, q_len)
            out_at = at(self.p["out"], arith_d.muli(out_row, const_i64(s.d_v * _bytes(self.elem))))
            acc_row = self.row_addr(self.acc, r, self.acc_stride)
            for t in range(s.d_v // 16):
                value = arith_d.mulf(v.load(at(acc_row, t * 64)), inv_v)
                v.store(v.narrow(value, self.elem), at(out_at, t * 16 * _bytes(self.elem)))
            llvm_store(llvm_load(i64(), state_at), self.state_at(hk, global_row, out_row))

        self._for_rows(arith_d.index_cast(ir.IndexType.get(), rows_valid), row)


def llvm_load(elem: ir.Type, pointer: ir.Value) -> ir.Value:
    return llvm_d.load(elem, pointer, alignment=4)


def llvm_store(value: ir.Value, pointer: ir.Value) -> None:
    llvm_d.store(value, pointer, alignment=4)


def vector_extract(vector: ir.Value) -> ir.Value:
    """Lane 0 of a vector."""
    return vector_d.extract(vector, [], [0])


def _inputs(s: KernelShapes) -> tuple[str, ...]:
    """The dispatch's input bindings, in order (valid_lens [B] int32 for the masks that read it)."""
    return ("q", "k_tiles", "v_tiles", *(("valid_lens",) if s.mask in ("padded", "causal_padded_left") else ()))


def _operand_sizes(s: KernelShapes, engine, batch, q_len, rows, kv_blocks) -> dict:
    """The sizes (ints, or index Values) of the dispatch's tensors: the packed q, k and v of
    ``engine``, the output and the rows' (max, sum) state."""
    return {"q": [batch, q_len, s.h_q, s.d], **kv_tile_sizes(s, engine, batch, kv_blocks),
            "valid_lens": [batch],
            "out": [batch, q_len, s.h_q, s.d_v],
            "state": [batch, s.h_kv, rows, 2]}


def build_executable(shapes: KernelShapes, engine) -> None:
    """The ``stream.executable`` @x86_attention with the dispatch @attend, at the insertion point:
    the input bindings (:func:`_inputs`), the scalars ``_DISPATCH_SCALARS`` (index), then the
    results out and state."""
    index, binding = ir.IndexType.get(), ir.Type.parse(BINDING)
    inputs = _inputs(shapes)
    arg_types = [binding] * len(inputs) + [index] * len(_DISPATCH_SCALARS) + [binding] * 2
    with hand_written_dispatch(_EXECUTABLE, _ENTRY, arg_types) as args:
        scalars = dict(zip(_DISPATCH_SCALARS, args[len(inputs):len(inputs) + len(_DISPATCH_SCALARS)]))
        sizes = _operand_sizes(shapes, engine, scalars["batch"], scalars["q_len"], scalars["rows"],
                               scalars["kv_blocks"])
        elems = {"q": element_type(shapes.dtype), "k_tiles": engine.operand, "v_tiles": engine.operand, "valid_lens": i32(),
                 "out": element_type(shapes.dtype), "state": f32()}
        bound = dict(zip((*inputs, "out", "state"), [*args[:len(inputs)], *args[-2:]]))
        pointers = {name: binding_pointer(bound[name], ir.MemRefType.get(static_shape(sizes[name]), elems[name]),
                                          dynamic_dims(sizes[name])) for name in bound}
        as64 = {name: as_i64(value) for name, value in scalars.items()}
        _Dispatch(shapes, engine, pointers, as64).emit()


def emit_dense(shapes: KernelShapes, q: ir.Value, k: ir.Value, v: ir.Value, anchor: ir.Operation,
               valid_lens: ir.Value | None = None, cpu: X86Cpu = XEON_WITH_AMX) -> list[ir.Value]:
    """(output [B, Lq, h_q, d], lse [B, Lq, h_q] f32) of q [B, Lq, h_q, d], k/v [B, Lk, h_kv, d]
    (and valid_lens [B] int32 for the padded masks) through the dispatch on ``cpu``'s engine; its
    executable is built before ``anchor`` (the kernel's function)."""
    s = shapes
    engine = engine_for(s.dtype, cpu)
    with ir.InsertionPoint(anchor):
        build_executable(s, engine)
    elem = element_type(s.dtype)
    batch, q_len, kv_len = dim(q, 0), dim(q, 1), dim(k, 1)
    row_blocks = ceil_div(arith_d.muli(q_len, const_index(s.group)), s.row_block)
    rows = arith_d.muli(row_blocks, const_index(s.row_block))
    kv_blocks = ceil_div(kv_len, s.kv_block)
    sizes = _operand_sizes(s, engine, batch, q_len, rows, kv_blocks)
    k_tiles, v_tiles = emit_packed_kv(s, engine, k, v, anchor)

    entry = ir.ArrayAttr.get([ir.SymbolRefAttr.get([_EXECUTABLE, _ENTRY])])
    operands = [q, k_tiles, v_tiles, *([valid_lens] if "valid_lens" in _inputs(s) else [])]
    dispatch = flow_d.DispatchOp(
        [tensor_type(static_shape(sizes["out"]), elem), tensor_type(static_shape(sizes["state"]), f32())],
        [row_blocks, const_index(s.h_kv), batch], entry,
        [*operands, batch, q_len, kv_len, rows, kv_blocks],
        [dyn for name in _inputs(s) for dyn in dynamic_dims(sizes[name])],
        [*dynamic_dims(sizes["out"]), *dynamic_dims(sizes["state"])])
    out, state = dispatch.results

    def lse_body(_out):
        b, t, hq = (linalg_d.IndexOp(i).result for i in range(3))
        head = arith_d.divui(hq, const_index(s.group))
        row = arith_d.addi(arith_d.muli(t, const_index(s.group)), arith_d.remui(hq, const_index(s.group)))
        best = tensor_d.extract(state, [b, head, row, const_index(0)])
        total = tensor_d.extract(state, [b, head, row, const_index(1)])
        return [state_lse(best, total)]

    lse = generic([], [empty([batch, q_len, s.h_q], f32())], [affine_map(3, range(3))], "ppp", lse_body)[0]
    return [out, lse]


def state_lse(best, total) -> ir.Value:
    """A row's base-2 lse from its (max, sum) state (f32 scalars): max + log2(sum), EMPTY_ROW_LSE
    for a row that saw no key (sum not above 0, as :meth:`_Dispatch.inverse` reads it)."""
    seen = arith_d.cmpf(arith_d.CmpFPredicate.OGT, total, const_f32(0.0))
    return arith_d.select(seen, arith_d.addf(best, math_d.log2(total)), const_f32(EMPTY_ROW_LSE))


def unsupported(spec, cpu: X86Cpu = XEON_WITH_AMX) -> str | None:
    """Why the x86 lowering cannot build ``spec`` for ``cpu`` (None where it can): the dense
    sequence prefill, plain or masked (padded, causal_padded_left; not a custom mask), in bf16,
    f32 or f16 with a head dim that divides into 32-column tiles, no sinks or 8-bit KV, blocks
    within the stack budget."""
    if type(spec) not in (SequencePrefillSpec, MaskedSequencePrefillSpec):
        return f"{type(spec).__name__} has no x86 kernel (the dense sequence prefills have)"
    if _mask(spec) not in MASKS:
        return f"mask_mode {spec.mask_mode!r} has no x86 kernel"
    if spec.dtype not in ENGINES:
        return f"dtype {spec.dtype}: the kernels are bf16 (AMX tiles), f32 and f16 (FMA blocks)"
    if spec.d % 32:
        return f"d={spec.d}: the x86 kernels need a multiple of 32"
    if spec.head_sinks or spec.kv_dtype:
        return "head sinks and 8-bit KV have no x86 kernel"
    return blocks_unfit(spec.dtype, spec.d, cpu=cpu)


def blocks_unfit(dtype: str, d: int, d_v: int | None = None, cpu: X86Cpu = XEON_WITH_AMX) -> str | None:
    """Why no workgroup blocks of head dims ``d``, ``d_v`` on ``cpu`` fit the stack budget (None
    where some do: :func:`blocks_for`)."""
    try:
        blocks_for(dtype, d, d_v, cpu)
    except ValueError as too_wide:
        return str(too_wide)
    return None


def _mask(spec) -> str:
    """The spec's mask as :data:`MASKS` names it."""
    if isinstance(spec, MaskedSequencePrefillSpec):
        return spec.mask_mode
    return "causal" if spec.causal else "full"


def build_x86_sequence_prefill(spec: SequencePrefillSpec | MaskedSequencePrefillSpec,
                               cpu: X86Cpu = XEON_WITH_AMX) -> ir.Module:
    """The verified module of ``spec`` (same signature as sequence.build_sequence_prefill) with
    the attention in one hand-written dispatch for ``cpu`` (:func:`engine_type`); ValueError
    where :func:`unsupported` says why not."""
    why = unsupported(spec, cpu)
    if why:
        raise ValueError(f"no x86 lowering for {spec.name}: {why}")
    shapes = KernelShapes(spec.h_q, spec.h_kv, spec.d, spec.dtype, _mask(spec), spec.sm_scale * LOG2E,
                          *blocks_for(spec.dtype, spec.d, cpu=cpu), spec.logits_soft_cap)

    def emit(args):
        function = args["q"].owner.owner   # the kernel's func.func: the executable goes before it
        return emit_dense(shapes, args["q"], args["k"], args["v"], function, args.get("valid_lens"), cpu)

    return function_module(spec, emit)
