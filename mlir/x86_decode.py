"""The x86 lowering of the serving passes (decode.DecodeSpec): one hand-written dispatch streams
each chunk of an entry's cache once, with every query row of a KV head against it, and the chunks
merge as the linalg pass merges them (decode.merge_chunks).

The dispatch is the dense kernel's (mlir/x86_attention.py: the engines, the f32 vector softmax)
with its K and V read from the cache in place: each KV step gathers its ``kv_block`` keys' rows
through the pass table (the layout's ``row_offset``: ragged rows, HND or NHD pages, the sliding
window's sink and window rows) into stack buffers in the engine's order, K by 16 x 16 32-bit
transposes (AMX: B tiles of bf16 pairs; FMA: the step's K^T) or as rows (bf16 passes of at most
KEY_ROWS_UP_TO rows: :class:`KeyRowsEngine`, whose scores are transposed instead), V by
interleaving key pairs (AMX) or, for f32 caches, not at all (the FMA blocks read each value row
where the cache holds it: :class:`InPlaceValues`); a key past the chunk, the entry or the table
(a -1 block) reads a zero row. On a CPU without AMX tiles (an AMD Zen 4: X86Cpu) a bf16 pass runs
on DotEngine's pair dot products where the CPU has AVX-512 BF16 (else widened to f32 on the FMA
blocks, its keys transposed as bf16 pairs), an 8-bit cache under bf16 through the byte tables
where it has VBMI, f32 and f16 passes on the FMA blocks (:func:`pass_engine_type`).
Shapes (n entries, h = h_kv, R = queries x G rows a KV head, c chunks of P table blocks):

    q [n, h, R, d_qk] (dtype)   table [n, c, P] i32   geometry [n, 4] i32 (kv_len, sinks, offset, qo_len)
    products [n, c, h, R, d_v] f32 (unnormalised)   state [n, c, h, R, 2] f32 (max, sum; log2 domain)

Workgroup (c x row groups, h, n) owns rows [g, g + 1) * row_block of one chunk; rows past R are
not computed by the softmax (their probabilities stay 0). Keys of a row: [chunk start,
min(chunk end, kv_len, causal end)), the KV-cache causal rule (mask_rules.KvCacheCausalRule).
"""

from __future__ import annotations

from .amx import Tiles, as_i64, at, ceil_div_i64, const_i64, i32, i64, ptr_type, stack_bytes, workgroup_ids
from .decode import DECODE_PASSES, DecodeSpec, decode_module, merge_chunks
from .dtypes import kv_dtype_of, quantized_kv
from .ir import (
    DYN, affine_map, arith_d, const_index, const_int, dim, empty, f32, flow_d, generic, ir, linalg_d, llvm_d, scf_d,
    tensor_d, tensor_type, vector_d,
)
from .kv_layouts import EIGHT_BIT_FORMATS, THROUGH_F16, cache_layout, f16_bits
from .online_softmax import LOG2E
from .x86_attention import (
    BINDING, STACK_BUDGET, XEON_WITH_AMX, AmxEngine, DotEngine, X86Cpu, FmaEngine, KernelShapes, _bytes, _Dispatch,
    binding_pointer, hand_written_dispatch,
    llvm_load, llvm_store, workgroup_bytes,
)
from .key_ranges import FlagCausalKeys
from .x86_kv_cache import kv_cache_unsupported

_EXECUTABLE = "x86_serving_pass"
_ENTRY = "stream_chunks"

#: Index scalars of the dispatch, after its tensors: the table's dims, the first KV source's extent
#: along its layout's ``extent_axis``, the causal flag and the KV heads a workgroup takes
#: (:func:`pass_heads`); then sm_scale (f32).
_SCALARS = ("entries", "chunks", "per_chunk", "extent", "causal", "heads")
#: Keys of a KV step.
PASS_KV_BLOCK = 64
#: The locality hint of the passes' prefetches: 1, ``prefetcht2`` (0 would be ``prefetchnta``,
#: 3 ``prefetcht0``). A pass's core keeps about 16 lines in flight and waits on them between its
#: steps' work; with the hint for the outer caches, the bf16 pass over pages of 16 keys ran 7-9%
#: faster than with ``prefetcht0``, the others within 2% (two builds in one process, calls
#: alternating; docs/performance.md, eighth session).
PREFETCH_LOCALITY = 1


def dispatch_names(spec: DecodeSpec) -> tuple[str, str]:
    """(executable, entry) of the pass's hand-written dispatch, named after its query count as
    its symbol is (``x86_serving_pass::stream_chunks``, ``x86_serving_pass_q4::stream_chunks_q4``):
    a variant's passes then share one module (mlir/bundle.py), where IREE links every entry of
    the target into one library."""
    suffix = spec.symbol.removeprefix("decode_entries")
    return _EXECUTABLE + suffix, _ENTRY + suffix


#: A call's workgroups take :func:`pass_heads` KV heads each where they are then at least this
#: many (fewer would leave cores idle), else one head each.
HEAD_GROUPS_FROM = 16
#: Bytes of a head's widening tables (K and V: low and high bytes, 128 entries each).
_TABLE_BYTES = 512


#: A bf16 pass of at most this many rows (queries x G) runs KeyRowsEngine (one row tile) rather
#: than AmxEngine's pairs of row tiles, whose products cost as much for 4 rows as for 32.
KEY_ROWS_UP_TO = 16


class KeyRowsEngine(AmxEngine):
    """AMX products for a pass of at most 16 rows (a decode step's queries x G), its keys read as
    rows (where the cache holds them, or a copy; no transposes: :class:`KeyRowsStaging`): the
    scores transposed, S^T [16 keys, 16 rows] = K . Q^T, with 16 keys' rows as an A tile and the
    workgroup's queries as one B tile per 32 dims (its q rows, copied as A tiles, transposed in
    place once as 32-bit pairs: :meth:`prepare_queries`); each S^T tile goes through a 16 x 16
    transpose into the rows' scores. P.V: one row tile of probs
    against AmxEngine's value tiles. Of the next step's keys (:meth:`_PassDispatch.prefetch_share`)
    the staging asks for the first half, the score groups for the third quarter, the P.V tile
    pairs for the last."""

    ROWS = 16
    #: Keys of a KV step: half of PASS_KV_BLOCK. A step's staged keys and values (an 8-bit
    #: cache's widened rows, a bf16 cache's value pairs) then take half the L1 they took, beside
    #: the rows being read and the next step's. Intel Xeon model 167 (AMX), 2 cores, paged 32 x 1
    #: (ms, 64 -> 32 keys, separate processes): e4m3 vs 4096 24.2-25.7 -> 19.2-19.8, vs 1024
    #: 4.74 -> 4.04; bf16 vs 1024 6.7-7.4 -> 5.4-5.6, vs 4096 34.6-37.1 -> 30.0-35.1; 32 x 4
    #: e4m3 vs 4096 31.6 -> 26.6 (docs/performance.md, twenty-ninth session).
    KV_BLOCK = 32
    #: The share of the next step's keys asked for while the step's keys and values are staged
    #: (the rest by :meth:`scores` and :meth:`accumulate`).
    STAGED_PREFETCH = 0.5

    def prepare_queries(self, w: "_PassDispatch") -> None:
        """The q rows' A tiles [d/32, 16 rows, 16 pairs] into B tiles [d/32, 16 pairs, 16 rows]
        (bf16 pairs: one 32-bit lane each), in place; for keys widened from 8 bits, each 64 dims
        first in the order :meth:`_PassDispatch.key_row` stages them (dims 0-7, 16-23, 32-39,
        48-55 in the first 32, the others in the second: a 128-bit lane's shuffles)."""
        lanes = ir.VectorType.get([16], i32())
        if w.byte_tables:
            for block in range(w.s.d // 64):
                for row in range(16):
                    at_0, at_1 = at(w.q_rows, 2 * block * 1024 + row * 64), at(w.q_rows, (2 * block + 1) * 1024 + row * 64)
                    c0, c1 = llvm_load(lanes, at_0), llvm_load(lanes, at_1)
                    llvm_store(vector_d.shuffle(c0, c1, [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27]), at_0)
                    llvm_store(vector_d.shuffle(c0, c1, [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31]), at_1)
        columns = score_columns(w.spec.rows)
        for chunk in range(w.s.d // 32):   # each B tile's first ``columns`` rows, packed: q_tile_bytes a tile
            tile = at(w.q_rows, chunk * 1024)
            pairs = _transposed([llvm_load(lanes, at(tile, row * 64)) for row in range(16)])
            for pair, vector in enumerate(pairs):
                first = vector if columns == 16 else vector_d.shuffle(vector, vector, list(range(columns)))
                llvm_store(first, at(w.q_rows, chunk * self.q_tile_bytes(w) + pair * 4 * columns))

    @staticmethod
    def q_tile_bytes(w: "_PassDispatch") -> int:
        """Bytes of a q B tile as :meth:`prepare_queries` packs it: 16 pairs x the score columns."""
        return 16 * 4 * score_columns(w.spec.rows)

    def scores(self, w: "_PassDispatch", q_base, k_block, scores) -> None:
        """scores[16, kv_block] from the key rows of each 16 keys: staged in k_block [kv_block,
        d], or where :class:`KeyRowsStaging` found them in the cache (``w.key_tiles``). Of the
        16 rows only the pass's first :func:`score_columns` are computed (the tiles of q and S^T
        that many columns wide) and transposed."""
        d, t, v = w.s.d, Tiles(), w.vec
        columns = score_columns(w.spec.rows)
        narrow = Tiles(16, 4 * columns)
        for group in range(w.s.kv_block // 16):
            if w.key_tiles is None:
                first, stride = at(k_block, group * 16 * d * 2), const_i64(d * 2)
            else:
                first = llvm_d.load(ptr_type(), at(w.key_tiles, group * 16), alignment=8)
                stride = llvm_load(i64(), at(w.key_tiles, group * 16 + 8))
            acc = narrow.zero()
            for step in range(d // 32):
                keys = t.load(at(first, step * 64), stride)
                acc = narrow.dot(acc, keys, narrow.load(at(q_base, step * self.q_tile_bytes(w)), 4 * columns))
            narrow.store(w.score_tile, 4 * columns, acc)
            rest = w.s.kv_block - w.staged_prefetch   # the next step's keys the staging leaves: half of them here
            w.prefetch_share(w.staged_prefetch, rest // 2, group, w.s.kv_block // 16)
            rows = _key_major_transposed([v.load(at(w.score_tile, j * 64)) for j in range(columns)], columns)
            for row, vector in enumerate(rows):
                v.store(vector, at(scores, row * w.score_stride + group * 64))

    def accumulate(self, w: "_PassDispatch", v_block) -> None:
        """acc[16, d_v] += probs[16, kv_block] . values, two dim tiles at a time, in tiles of
        the pass's first :func:`score_columns` rows."""
        t, short = Tiles(), Tiles(score_columns(w.spec.rows))
        v_dim_tile = w.s.kv_block // 2 * 64
        for pair in range(w.s.d_v // 32):
            c_at = [at(w.acc, (2 * pair + j) * 64) for j in range(2)]
            acc = [short.load(p, w.acc_stride) for p in c_at]
            for step in range(w.s.kv_block // 32):
                probs = short.load(at(w.probs, step * 64), w.prob_stride)
                values = [t.load(at(v_block, (2 * pair + j) * v_dim_tile + step * 1024), 64) for j in range(2)]
                acc = [short.dot(acc[j], probs, values[j]) for j in range(2)]
            for p, tile in zip(c_at, acc):
                short.store(p, w.acc_stride, tile)
            rest = w.s.kv_block - w.staged_prefetch   # the other half of what the staging leaves
            w.prefetch_share(w.staged_prefetch + rest // 2, rest - rest // 2, pair, w.s.d_v // 32)


class InPlaceValues(FmaEngine):
    """FmaEngine reading each key's value row where the cache holds it (f32, not 8-bit: the row
    is already the engine's operand), through the step's row pointers, instead of a staged copy:
    the f32 16-query pass (16 x 16 vs 512) spent 3.9 of its 16.3 ms copying values, and without
    the copy its 32-row workgroups fit the stack (16-row ones staged the keys of a step 4 times)."""

    values_in_place = True
    #: A pass's rows (queries x group) are rarely whole blocks of FmaEngine's 6: blocks of 4 leave
    #: no block of the rest, whose code doubled the pass's (the f32 serving grid ran the same with
    #: either, docs/performance.md, tenth session).
    SCORE_ROWS = ACC_ROWS = 4

    @staticmethod
    def _value_step(w: "_PassDispatch", row_pointers, step) -> ir.Value:
        return llvm_d.load(ptr_type(), at(row_pointers, arith_d.addi(arith_d.muli(step, const_i64(16)), const_i64(8))),
                           alignment=8)


class InPlaceWidenedValues(InPlaceValues):
    """InPlaceValues over a bf16 or f16 cache: each value row read where the cache holds it and
    widened 16 elements at a time as P.V takes them, for passes whose rows are one block of
    ACC_ROWS (each value widened once; more rows would widen it once a block). On a Zen 4
    without AMX, bf16 32 x 1 vs 1024 (4 rows) 12.6-14.1 -> 11.1-12.5 ms against the staged
    copy (docs/performance.md, twenty-first session)."""

    def _lanes(self, w: "_PassDispatch", step_at, col: int, keys: bool) -> ir.Value:
        if keys:
            return super()._lanes(w, step_at, col, keys)
        return w.chunk(1, step_at, col // 16, w.vec.f32x)   # 16 elements from column col, widened


def pass_engine_type(spec: DecodeSpec, cpu: X86Cpu = XEON_WITH_AMX) -> type:
    """The contraction engine class of the pass on ``cpu``, with AMX tiles or without:
    bf16 with AMX on KeyRowsEngine for few rows, else AmxEngine; bf16 without AMX on DotEngine
    where the CPU has AVX-512 BF16 (and VBMI for an 8-bit cache's tables; ByteKeysDotEngine for
    an 8-bit cache's passes of at most 4 rows and a head dim of a multiple of 64); an f32 cache
    InPlaceValues; without AMX a bf16 or f16 cache's passes of at most ACC_ROWS rows
    InPlaceWidenedValues (the AMX Xeon's f16 passes, measured there, keep the staged copy); else
    (f16, 8-bit, bf16 without AMX or AVX-512 BF16) FmaEngine, widening as it stages."""
    if spec.dtype == "bfloat16" and cpu.amx:
        return KeyRowsEngine if spec.rows <= KEY_ROWS_UP_TO else AmxEngine
    if spec.dtype == "bfloat16" and cpu.bf16_dot and (cpu.vbmi or not quantized_kv(spec.base)):
        fused = quantized_kv(spec.base) and spec.rows <= ByteKeysDotEngine.ROWS and spec.d_qk % 64 == 0
        return ByteKeysDotEngine if fused else DotEngine
    if spec.dtype == "float32" and not quantized_kv(spec.base):
        return InPlaceValues
    if not cpu.amx and not quantized_kv(spec.base) and spec.rows <= InPlaceValues.ACC_ROWS:
        return InPlaceWidenedValues
    return FmaEngine


def pass_blocks(spec: DecodeSpec, cpu: X86Cpu = XEON_WITH_AMX) -> tuple[int, int]:
    """(rows of a workgroup, keys of a KV step) of the pass on ``cpu``:
    KeyRowsEngine works on one 16-row tile, ByteKeysDotEngine on one block of 4 rows, AmxEngine on
    32 or 64 rows (pairs of 16-row tiles), the FMA blocks on multiples of 4; PASS_KV_BLOCK keys a
    step (an engine's KV_BLOCK where it has one); buffers and the two staging buffers within
    STACK_BUDGET."""
    engine = pass_engine_type(spec, cpu)
    rows = spec.rows
    first = getattr(engine, "KV_BLOCK", PASS_KV_BLOCK)
    if engine in (KeyRowsEngine, ByteKeysDotEngine):   # one block of rows: fewer keys a step if need be
        wanted, smaller = engine.ROWS, ((engine.ROWS, 32),)
    elif engine.uses_amx:
        wanted, smaller = 32 if rows <= 32 else 64, ((32, PASS_KV_BLOCK), (32, 32))
    else:
        wanted = min(64, -(-rows // 4) * 4)
        smaller = ((min(wanted, 32), PASS_KV_BLOCK), (16, PASS_KV_BLOCK))
    for row_block, keys in ((wanted, first), *smaller):
        if _pass_stack_bytes(spec, engine, row_block, keys) <= STACK_BUDGET:
            return row_block, keys
    raise ValueError(f"d_qk={spec.d_qk}, d_v={spec.d_v}: no x86 pass blocks fit the stack budget")


def pass_heads(spec: DecodeSpec, cpu: X86Cpu = XEON_WITH_AMX) -> int:
    """The KV heads a workgroup of the pass takes together where a call has workgroups enough
    (HEAD_GROUPS_FROM): all h_kv for KeyRowsEngine's passes where each head's q rows, acc and
    state (and widening tables) fit the stack beside the rest, else 1. Each unit of its loop is
    a step of one head, the heads of a step one after the other: a page's rows of consecutive
    heads lie together in the head-major caches (2 KiB of e4m3 K a head, 16 KiB a page's), so a
    step reads runs of them rather than a run of one head at a random place."""
    engine = pass_engine_type(spec, cpu)
    if engine is not KeyRowsEngine or spec.h_kv == 1:
        return 1
    row_block, keys = pass_blocks(spec, cpu)
    head = sum(_head_buffer_bytes(spec, engine, row_block).values()) + (_TABLE_BYTES if quantized_kv(spec.base) else 0)
    fits = _pass_stack_bytes(spec, engine, row_block, keys) + spec.h_kv * head <= STACK_BUDGET
    return spec.h_kv if fits else 1


def _head_buffer_bytes(spec: DecodeSpec, engine: type, row_block: int) -> dict[str, int]:
    """Bytes of the buffers each head of a many-head workgroup has of its own (:func:`pass_heads`),
    by the workgroup attribute they stand for: q rows in the engine's operands, acc [rows, d_v]
    in f32, (max, sum) a row."""
    return {"q_rows": row_block * spec.d_qk * engine.OPERAND_BYTES, "acc": row_block * spec.d_v * 4,
            "state": row_block * 8}


def _pass_stack_bytes(spec: DecodeSpec, engine: type, row_block: int, keys: int) -> int:
    """Stack bytes of a workgroup of one head: its buffers, the staged K (V), the zero row, the
    row pointers and a score tile."""
    operand, d, d_v = engine.OPERAND_BYTES, spec.d_qk, spec.d_v
    # columns of a staged key: K unless its scores are taken as it is widened, V unless read in place
    staged = (d if engine.keys_staged else 0) + (0 if engine.values_in_place else d_v)
    staging = keys * staged * operand + d * operand + 2 * keys * 16 + 1024
    return workgroup_bytes(operand, row_block, keys, d, d_v) + staging


def pass_unsupported(spec: DecodeSpec, cpu: X86Cpu = XEON_WITH_AMX) -> str | None:
    """Why the x86 lowering has no serving pass for ``spec`` (None where it has) on ``cpu``: its
    variant's x86 kernel's conditions (x86_kv_cache.kv_cache_unsupported: ragged, paged and MLA
    caches in bf16, f32 or f16, head dims of a multiple of 32, the KV-cache causal mask), and 8-bit
    KV widened through float16 (THROUGH_F16), blocks within the stack budget on ``cpu``'s engine."""
    base = spec.base
    why = kv_cache_unsupported(base)
    if why:
        return why
    if quantized_kv(base) and kv_dtype_of(base) not in THROUGH_F16:
        return f"8-bit KV {kv_dtype_of(base)}: the x86 passes widen {', '.join(THROUGH_F16)}"
    try:
        pass_blocks(DecodeSpec(base, max(DECODE_PASSES["x86"].queries)), cpu)
    except ValueError as too_wide:
        return str(too_wide)
    return None


def _transposed(rows: list[ir.Value]) -> list[ir.Value]:
    """The 16 x 16 transpose of 16 vectors of 16 32-bit lanes: at each scale m (8, 4, 2, 1) the
    off-diagonal m x m blocks of each 2m x 2m block swap (two-source shuffles)."""
    rows = list(rows)
    for m in (8, 4, 2, 1):
        low = [16 + lane - m if lane & m else lane for lane in range(16)]
        high = [16 + lane if lane & m else lane + m for lane in range(16)]
        for r in range(16):
            if r & m:
                continue
            a, b = rows[r], rows[r + m]
            rows[r], rows[r + m] = vector_d.shuffle(a, b, low), vector_d.shuffle(a, b, high)
    return rows


def score_columns(rows: int) -> int:
    """Columns of KeyRowsEngine's S^T tiles for a pass of ``rows`` rows: 4, 8 or 16."""
    return next(width for width in (4, 8, 16) if rows <= width)


def _key_major_transposed(vectors: list[ir.Value], rows: int) -> list[ir.Value]:
    """The ``rows`` vectors of 16 keys' scores of a row each, from ``rows`` vectors of 16/rows
    keys x ``rows`` rows (key-major: lane rows x i + r holds key i's row r), the S^T tile [16
    keys, rows] as stored: at each stage, two vectors of the same rows and neighbouring keys
    become two vectors of twice the keys and half the rows (two-source shuffles; log2(rows)
    stages of ``rows`` shuffles: 8 for 4 rows, against 64 for a 16 x 16 transpose)."""
    # each vector: (its keys, its rows), lanes key-major
    parts = [(list(range(j * 16 // rows, (j + 1) * 16 // rows)), list(range(rows)), vector)
             for j, vector in enumerate(vectors)]
    while len(parts[0][1]) > 1:
        merged = []
        for (keys_a, rows_ab, a), (keys_b, _, b) in zip(parts[::2], parts[1::2]):
            lanes = {(k, r): i for i, (k, r) in enumerate((k, r) for k in keys_a for r in rows_ab)}
            lanes.update({(k, r): 16 + i for i, (k, r) in enumerate((k, r) for k in keys_b for r in rows_ab)})
            keys, half = keys_a + keys_b, len(rows_ab) // 2
            for part_rows in (rows_ab[:half], rows_ab[half:]):
                mask = [lanes[(k, r)] for k in keys for r in part_rows]
                merged.append((keys, part_rows, vector_d.shuffle(a, b, mask)))
        parts = sorted(merged, key=lambda part: (part[1][0], part[0][0]))
    return [vector for _, _, vector in parts]


def _lane_groups_transposed(vectors: list[ir.Value]) -> list[ir.Value]:
    """Four vectors of 16 lanes as four 4 x 4 blocks of 4-lane groups, transposed: group g of
    vector t becomes group t of vector g (two stages of two-source shuffles)."""
    def groups(pairs):   # [(vector, group)] of the two sources -> lanes
        return [4 * group + 16 * source + i for source, group in pairs for i in range(4)]

    a, b, c, e = vectors
    ab_low, ab_high = (vector_d.shuffle(a, b, groups([(0, g), (1, g), (0, g + 1), (1, g + 1)])) for g in (0, 2))
    ce_low, ce_high = (vector_d.shuffle(c, e, groups([(0, g), (1, g), (0, g + 1), (1, g + 1)])) for g in (0, 2))
    out = []
    for left, right in ((ab_low, ce_low), (ab_high, ce_high)):   # groups (g, g + 1) of a b | c e
        out.append(vector_d.shuffle(left, right, groups([(0, 0), (0, 1), (1, 0), (1, 1)])))
        out.append(vector_d.shuffle(left, right, groups([(0, 2), (0, 3), (1, 2), (1, 3)])))
    return out


def _join(low: ir.Value, high: ir.Value, first: int) -> ir.Value:
    """Bytes [first, first + 32) of the looked-up ``low`` and ``high`` bytes (64 i8 each)
    interleaved into 32 bf16 (as 64 i8), in their order."""
    return vector_d.shuffle(low, high, [first + i // 2 + (64 if i % 2 else 0) for i in range(64)])


def _in_lane_join(low: ir.Value, high: ir.Value, half: int) -> ir.Value:
    """Bytes [8 half, 8 half + 8) of each 128-bit lane of the looked-up ``low`` and ``high`` bytes
    (64 i8 each) interleaved into 32 bf16 (as 64 i8): one in-lane unpack (vpunpck[lh]bw)."""
    return vector_d.shuffle(low, high, [16 * lane + 8 * half + i // 2 + (64 if i % 2 else 0)
                                        for lane in range(4) for i in range(16)])


class AmxStaging:
    """A KV step's keys and values in AmxEngine's order (score_tiles.PackedTiles 16 x 16 x 2):
    K [kv_block/16, d/2, 16, 2] (a 32-bit transpose of each 16 keys x 16 dim pairs), V [d/16,
    kv_block/2, 16, 2] (pairs of keys interleaved)."""

    def keys(self, w: "_PassDispatch", group, rows: list[ir.Value]) -> None:
        """Keys [16 group, + 16) from their 16 row pointers."""
        d, lanes = w.s.d, ir.VectorType.get([16], i32())
        group_at = at(w.k_stage, arith_d.muli(group, const_i64(d // 2 * 64)))
        for chunk in range(d // 32):
            loaded = [w.chunk(0, row, chunk, lanes) for row in rows]
            for j, out in enumerate(_transposed(loaded)):
                llvm_store(out, at(group_at, (16 * chunk + j) * 64))

    def values(self, w: "_PassDispatch", group, rows: list[ir.Value]) -> None:
        d, kv = w.s.d_v, w.s.kv_block
        halves = ir.VectorType.get([32], ir.IntegerType.get_signless(16))
        dim_tile = kv // 2 * 64
        low = [i // 2 + 32 * (i % 2) for i in range(32)]          # dims 0-15 of the chunk, keys a, b
        high = [16 + i // 2 + 32 * (i % 2) for i in range(32)]    # dims 16-31
        per_group = w.staged_prefetch // (kv // 16)   # of the next step's keys, this group's
        group_keys = arith_d.muli(group, const_i64(per_group))
        for pair in range(8):
            w.prefetch_share(group_keys, per_group, pair, 8)
            pair_at = at(w.v_stage, arith_d.muli(arith_d.addi(arith_d.muli(group, const_i64(8)), const_i64(pair)),
                                                 const_i64(64)))
            if w.values_permuted:   # 64 dims of both keys interleaved, then looked up
                for first in range(0, d, 64):
                    for j, out in enumerate(w.paired_value_block(rows[2 * pair], rows[2 * pair + 1], first)):
                        llvm_store(out, at(pair_at, (first // 16 + j) * dim_tile))
                continue
            for chunk in range(d // 32):
                if w.byte_tables:   # both keys' bytes in one lookup, interleaved as it ends
                    outs = w.paired_values(rows[2 * pair], rows[2 * pair + 1], chunk)
                else:
                    a, b = (w.chunk(1, rows[2 * pair + i], chunk, halves) for i in range(2))
                    outs = (vector_d.shuffle(a, b, low), vector_d.shuffle(a, b, high))
                for j, out in enumerate(outs):
                    llvm_store(out, at(pair_at, (2 * chunk + j) * dim_tile))


class FmaStaging:
    """A KV step's keys and values in FmaEngine's order: K^T [d, kv_block] (16 x 16 transposes),
    V [kv_block, d_v] (row copies, for 8-bit caches widened; f32 values are read in place), f32."""

    def keys(self, w: "_PassDispatch", group, rows: list[ir.Value]) -> None:
        d, kv, v = w.s.d, w.s.kv_block, w.vec
        group_at = at(w.k_stage, arith_d.muli(group, const_i64(64)))
        group_keys = arith_d.muli(group, const_i64(16))
        lanes = ir.VectorType.get([16], i32())
        if w.kv_format is None and w.elem == ir.BF16Type.get():
            self._bf16_keys(w, group_at, group_keys, (
                ([llvm_load(lanes, at(row, chunk * 64)) for row in rows], [32 * chunk + 2 * m for m in range(16)])
                for chunk in range(d // 32)))
            return
        if w.byte_tables:   # 8-bit elements to bf16 through the head's tables, 64 a lookup
            self._bf16_keys(w, group_at, group_keys, self._table_chunks(w, rows))
            return
        for chunk in range(d // 16):
            if w.v_stage is None:   # no values staged: the keys carry the prefetches
                w.prefetch_share(group_keys, 16, chunk, d // 16)
            loaded = [w.chunk(0, row, chunk, v.f32x) for row in rows]
            for j, out in enumerate(_transposed(loaded)):
                v.store(out, at(group_at, (16 * chunk + j) * kv * 4))

    @staticmethod
    def _table_chunks(w: "_PassDispatch", rows: list[ir.Value]):
        """(16 vectors of bf16 pairs, the first dim of each pair) for each 32 dims of the 16 8-bit
        K ``rows``, 64 elements a lookup (:meth:`_PassDispatch.key_block`)."""
        for first in range(0, w.s.d, 64):
            blocks = [w.key_block(row, first) for row in rows]
            for j in range(len(blocks[0])):
                yield [block[j] for block in blocks], [w.pair_dim(first, j, m) for m in range(16)]

    @staticmethod
    def _bf16_keys(w: "_PassDispatch", group_at, group_keys, chunks) -> None:
        """Keys as bf16: each 32 dims of the 16 rows as 16 vectors of 16 bf16 pairs (``chunks``:
        (vectors, the first dim of each pair) from a bf16 cache's 64 bytes, or an 8-bit cache's
        elements through the tables), one 16 x 16 32-bit transpose, each pair vector widened into
        its two dims' K^T rows (a shift, a mask): half the shuffles of widening first (Zen 4, bf16
        32 x 1 vs 1024: 11.1-11.2 -> 8.7-9.4 ms; 16 x 16 vs 512 the same, its FMAs the bound)."""
        d, kv, v = w.s.d, w.s.kv_block, w.vec
        lanes = ir.VectorType.get([16], i32())
        for chunk, (loaded, dims) in enumerate(chunks):
            if w.v_stage is None:
                w.prefetch_share(group_keys, 16, chunk, d // 32)
            for pair, first_dim in zip(_transposed(loaded), dims):
                low = arith_d.shli(pair, const_int(lanes, 16))
                high = arith_d.andi(pair, const_int(lanes, -0x10000))
                for half, bits in enumerate((low, high)):
                    v.store(vector_d.bitcast(v.f32x, bits), at(group_at, (first_dim + half) * kv * 4))

    def values(self, w: "_PassDispatch", group, rows: list[ir.Value]) -> None:
        d, v = w.s.d_v, w.vec
        group_at = at(w.v_stage, arith_d.muli(group, const_i64(16 * d * 4)))
        group_keys = arith_d.muli(group, const_i64(16))
        wide = ir.VectorType.get([32], f32())
        for i, row in enumerate(rows):
            w.prefetch_share(group_keys, 16, i, 16)
            if w.byte_tables:   # 64 elements a lookup, as bf16, widened
                for first in range(0, d, 64):
                    for j, halves in enumerate(w.value_row(row, first)):
                        llvm_store(arith_d.extf(wide, halves), at(group_at, i * d * 4 + (first + 32 * j) * 4))
                continue
            for chunk in range(d // 16):
                v.store(w.chunk(1, row, chunk, v.f32x), at(group_at, i * d * 4 + chunk * 64))


class DotStaging(AmxStaging):
    """DotEngine's order, AmxStaging's; an 8-bit cache's keys through the tables 64 elements a
    lookup (FmaStaging._table_chunks), each transposed pair vector stored as its dims' pair row."""

    def keys(self, w: "_PassDispatch", group, rows: list[ir.Value]) -> None:
        if not w.byte_tables:
            super().keys(w, group, rows)
            return
        group_at = at(w.k_stage, arith_d.muli(group, const_i64(w.s.d // 2 * 64)))
        for loaded, dims in FmaStaging._table_chunks(w, rows):
            for pair, first_dim in zip(_transposed(loaded), dims):
                llvm_store(pair, at(group_at, first_dim // 2 * 64))


class ByteKeysDotEngine(DotEngine):
    """DotEngine for a pass of at most 4 rows (a decode step's query x G 4) over an 8-bit cache:
    each 16 keys' scores taken as their bytes are widened (:class:`ByteKeysStaging`), no K staged.
    The bytes are transposed before the widening, as 32-bit words (four dims of a key a lane:
    half the shuffles of transposing the widened bf16 pairs); each looked-up vector holds two
    pairs of dims of 8 keys, against q's four dims broadcast as one 64-bit word (even lanes the
    first pair, odd lanes the second), and the two lanes of a key are added at the end."""

    ROWS = 4
    keys_staged = False

    def scores(self, w: "_PassDispatch", q_base, k_block, scores) -> None:
        """Nothing left: ByteKeysStaging.keys wrote the step's scores."""


class ByteKeysStaging(DotStaging):
    """ByteKeysDotEngine's staging: V as DotStaging stages it; each 16 keys' scores [row_block,
    16] f32 into the step's scores instead of their K."""

    def keys(self, w: "_PassDispatch", group, rows: list[ir.Value]) -> None:
        d, bf16_pairs = w.s.d, ir.VectorType.get([32], ir.BF16Type.get())
        words, quad = ir.VectorType.get([16], i32()), ir.VectorType.get([8], i64())
        acc = [[w.vec.const(0.0)] * 2 for _ in range(w.s.row_block)]
        for first in range(0, d, 64):
            loaded = [llvm_load(words, at(row, first)) for row in rows]
            for j, word in enumerate(_transposed(loaded)):   # lane k: key k's dims first + 4 j + [0, 4)
                low, high = w.lookup(0, vector_d.bitcast(ir.VectorType.get([64], ir.IntegerType.get_signless(8)),
                                                          word))
                q_dims = [vector_d.bitcast(bf16_pairs, vector_d.broadcast(quad, llvm_load(
                    i64(), at(w.q_rows, (r * d + first + 4 * j) * 2)))) for r in range(w.s.row_block)]
                for half in range(2):   # keys 4 m + 2 half and the next of lane m
                    pairs = vector_d.bitcast(bf16_pairs, _in_lane_join(low, high, half))
                    for row_acc, row_dims in zip(acc, q_dims):
                        row_acc[half] = DotEngine._mac(row_acc[half], row_dims, pairs)
        first_lane = [16 * (t // 2) + 4 * m + 2 * (t % 2) for m in range(4) for t in range(4)]   # key 4 m + t
        group_at = at(w.scores, arith_d.muli(group, const_i64(64)))
        for r, (a, b) in enumerate(acc):
            keys = arith_d.addf(vector_d.shuffle(a, b, first_lane), vector_d.shuffle(a, b, [i + 1 for i in first_lane]))
            w.vec.store(keys, at(group_at, r * w.score_stride))


class KeyRowsStaging(AmxStaging):
    """KeyRowsEngine's order: K [kv_block, d] as the rows are (copied; 8-bit caches widened), V
    as AmxStaging interleaves it. A bf16 cache's 16 keys whose rows lie at one stride (a page's
    rows of a head, consecutive ragged rows) are not copied: the scores load them where they
    are (``w.key_tiles``: each 16 keys' first row and stride)."""

    def keys(self, w: "_PassDispatch", group, rows: list[ir.Value]) -> None:
        if w.key_tiles is None:
            self._copied(w, group, rows)
            return
        slot = at(w.key_tiles, arith_d.muli(group, const_i64(16)))
        addresses = [llvm_d.ptrtoint(i64(), row) for row in rows]
        stride = arith_d.subi(addresses[1], addresses[0])
        strided = arith_d.constant(ir.IntegerType.get_signless(1), 1)
        for i, address in enumerate(addresses[2:], start=2):
            expected = arith_d.addi(addresses[0], arith_d.muli(stride, const_i64(i)))
            strided = arith_d.andi(strided, arith_d.cmpi(arith_d.CmpIPredicate.eq, address, expected))
        branch = scf_d.IfOp(strided, [], has_else=True)
        with ir.InsertionPoint(branch.then_block):
            llvm_d.store(rows[0], slot, alignment=8)
            llvm_store(stride, at(slot, 8))
            scf_d.YieldOp([])
        with ir.InsertionPoint(branch.else_block):
            llvm_d.store(self._copied(w, group, rows), slot, alignment=8)
            llvm_store(const_i64(w.s.d * 2), at(slot, 8))
            scf_d.YieldOp([])

    @staticmethod
    def _copied(w: "_PassDispatch", group, rows: list[ir.Value]) -> ir.Value:
        """The 16 keys' ``rows`` copied into their place in k_stage, which is returned."""
        d, lanes = w.s.d, ir.VectorType.get([16], i32())
        group_at = at(w.k_stage, arith_d.muli(group, const_i64(16 * d * 2)))
        for i, row in enumerate(rows):
            if w.byte_tables:   # 64 bytes a lookup
                for chunk, out in enumerate(w.key_row(row)):
                    llvm_store(out, at(group_at, i * d * 2 + chunk * 64))
                continue
            for chunk in range(d // 32):
                llvm_store(w.chunk(0, row, chunk, lanes), at(group_at, i * d * 2 + chunk * 64))
        return group_at


#: The staging of each engine's passes: f16 caches widen to f32 as they are staged (FmaEngine: these
#: CPUs have no amx_fp16; the linalg passes ran 16 x 16 vs 1024 f16 at 0.39x torch).
STAGING = {AmxEngine: AmxStaging, KeyRowsEngine: KeyRowsStaging, FmaEngine: FmaStaging, InPlaceValues: FmaStaging,
           InPlaceWidenedValues: FmaStaging, DotEngine: DotStaging, ByteKeysDotEngine: ByteKeysStaging}


class _PassDispatch(_Dispatch):
    """One workgroup of the pass: rows of one (entry, KV head) against one chunk."""

    def __init__(self, spec: DecodeSpec, cpu: X86Cpu, shapes: KernelShapes, engine, pointers: dict, scalars: dict,
                 sm_scale):
        super().__init__(shapes, engine, pointers, scalars)
        self.spec = spec
        stage_bytes = shapes.kv_block * _bytes(engine.operand)   # a column of a step's keys
        self.k_stage = stack_bytes(stage_bytes * shapes.d) if engine.keys_staged else None
        self.v_stage = None if engine.values_in_place else stack_bytes(stage_bytes * shapes.d_v)
        #: What a key past the chunk, the entry or the table reads as its K and its V row: zeros as
        #: wide as either row in f32 (a ragged cache's d_v may exceed its d_qk)
        self.zero_row_bytes = max(shapes.d, shapes.d_v) * 4
        self.zero_row = stack_bytes(self.zero_row_bytes)
        self.row_pointers = stack_bytes(2 * shapes.kv_block * 16)   # (K row, V row) of each key, two steps
        self.scale_log2 = arith_d.mulf(sm_scale, arith_d.constant(f32(), LOG2E))
        self.staging = STAGING[type(engine)]()
        self.score_tile = stack_bytes(1024) if isinstance(engine, KeyRowsEngine) else None   # one S^T tile
        self.kv_format = kv_dtype_of(spec) if quantized_kv(spec) else None
        # each 16 keys' rows in the cache (first, stride), for rows the cache holds in the operand dtype
        in_cache = isinstance(engine, KeyRowsEngine) and self.kv_format is None and self.elem == engine.operand
        self.key_tiles = stack_bytes(shapes.kv_block) if in_cache else None
        self.kv_bytes = 1 if self.kv_format else _bytes(self.elem)   # of a cache element
        #: 8-bit elements widened to bf16 through the head's byte tables (:meth:`_looked_up`): the
        #: AMX engines' operands, or a bf16 pass's FMA blocks on a CPU with VBMI (then widened to
        #: f32 as a bf16 cache is: FmaStaging)
        bf16 = ir.BF16Type.get()
        self.byte_tables = self.kv_format is not None and (engine.operand == bf16 or self.elem == bf16 and cpu.vbmi)
        #: Whether the AMX engines' staged 8-bit values, and so acc's columns, come in
        #: :meth:`paired_value_block`'s order (each 64 dims: column 16 t + 4 g + i holds dim 16 g +
        #: 4 t + i), put back in order as the partials are written (:meth:`_write_partials`)
        self.values_permuted = self.byte_tables and engine.uses_amx and shapes.d_v % 64 == 0
        #: The next step's lines are asked for a few keys at a time through the step's work
        #: (:meth:`prefetch_share`: a share for each value pair or row staged, or each K chunk
        #: where values are read in place; KeyRowsEngine's score groups and P.V tiles), not
        #: all at its start; ``next_half`` holds their rows. Same process, calls in a shuffled
        #: order with the caches flushed before each, paged 32 x 1 vs 4096 (ms): bf16 33.7 ->
        #: 30.2 and 35.0 -> 31.1, e4m3 25.3 -> 24.0 and 23.9 -> 23.9, f32 63.9 -> 61.0 and 62.1
        #: -> 59.6, f16 43.5 -> 42.7 and 43.2 -> 42.6 (docs/performance.md, fifteenth session).
        self.next_half = None
        #: Keys of the next step the staging of values asks for: every key but those the
        #: engine's own products ask for (KeyRowsEngine.STAGED_PREFETCH).
        self.staged_prefetch = int(shapes.kv_block * getattr(engine, "STAGED_PREFETCH", 1.0))
        #: KV heads a workgroup may take (:func:`pass_heads`): with more than one, each head's q
        #: rows, acc, softmax state (and widening tables) have a place of their own, and
        #: :meth:`_use_head` points the engine at the current head's
        self.max_heads = pass_heads(spec, cpu)
        if self.max_heads > 1:
            self.head_buffers = _head_buffer_bytes(spec, type(engine), shapes.row_block)
            for name, size in self.head_buffers.items():
                setattr(self, f"{name}_heads", stack_bytes(self.max_heads * size))
            self.table_heads = stack_bytes(self.max_heads * _TABLE_BYTES) if self.byte_tables else None

    def emit(self) -> None:
        s, spec = self.s, self.spec
        rows_per_head = spec.rows
        row_groups = -(-rows_per_head // s.row_block)
        wx, head_group, entry = workgroup_ids()
        chunk = arith_d.divui(wx, const_i64(row_groups))
        first_row = arith_d.muli(arith_d.remui(wx, const_i64(row_groups)), const_i64(s.row_block))
        rows_valid = arith_d.minsi(const_i64(s.row_block), arith_d.subi(const_i64(rows_per_head), first_row))
        geometry = [arith_d.extsi(i64(), llvm_load(i32(), at(self.p["geometry"], arith_d.muli(
            arith_d.addi(arith_d.muli(entry, const_i64(4)), const_i64(k)), const_i64(4))))) for k in range(4)]
        kv_len, sink_tokens, window_offset, qo_len = geometry
        chunk_columns = arith_d.muli(self.n["per_chunk"], const_i64(spec.block))
        chunk_start = arith_d.muli(chunk, chunk_columns)
        causal = arith_d.cmpi(arith_d.CmpIPredicate.ne, self.n["causal"], const_i64(0))
        self.keys = FlagCausalKeys(kv_len, qo_len, causal, arith_d.addi(chunk_start, chunk_columns))
        first_token = arith_d.divsi(first_row, const_i64(s.group))
        last_token = arith_d.divsi(arith_d.addi(first_row, arith_d.subi(rows_valid, const_i64(1))), const_i64(s.group))
        end, self.narrowest_end = self.keys.hi(last_token), self.keys.hi(first_token)
        steps = ceil_div_i64(arith_d.maxsi(const_i64(0), arith_d.subi(end, chunk_start)), s.kv_block)
        self.softmax_rows = arith_d.index_cast(ir.IndexType.get(), rows_valid)
        self.window = (sink_tokens, window_offset) if spec.sliding_window else None
        self.table_row = at(self.p["table"], arith_d.muli(
            arith_d.muli(entry, arith_d.muli(self.n["chunks"], self.n["per_chunk"])), const_i64(4)))
        self.table_blocks = arith_d.muli(self.n["chunks"], self.n["per_chunk"])
        heads = self.n["heads"] if self.max_heads > 1 else const_i64(1)   # this call's KV heads a workgroup
        first_head = arith_d.muli(head_group, heads)

        def for_heads(body) -> None:   # body(h) for each of the workgroup's heads (h an i64 Value)
            if self.max_heads == 1:
                body(const_i64(0))
                return
            loop = scf_d.ForOp(const_index(0), arith_d.index_cast(ir.IndexType.get(), heads), const_index(1))
            with ir.InsertionPoint(loop.body):
                body(as_i64(loop.induction_variable))
                scf_d.YieldOp([])

        def prepare(h) -> None:   # the head's q rows, softmax state and widening tables
            self._use_head(first_head, h, tables=False)
            if self.kv_format:
                self.scales = self._scales_of(self.head)
                if self.byte_tables:
                    self.tables = [self._bf16_table(which) for which in (0, 1)]
                    if self.max_heads > 1:
                        self._store_tables(h)
            head_row = arith_d.muli(arith_d.addi(arith_d.muli(entry, const_i64(s.h_kv)), self.head),
                                    const_i64(rows_per_head))
            self._copy_query_rows(lambda row: arith_d.addi(head_row, row), first_row, const_i64(rows_per_head))
            if isinstance(self.engine, KeyRowsEngine):
                self.engine.prepare_queries(self)
            self._init_rows()

        for_heads(prepare)
        self._zero(self.probs, s.row_block * self.prob_stride)
        self._zero(self.zero_row, self.zero_row_bytes)
        self._prefetch(chunk_start, steps, const_i64(0), first_head)
        loop = scf_d.ForOp(const_index(0), arith_d.index_cast(ir.IndexType.get(), steps), const_index(1))
        with ir.InsertionPoint(loop.body):
            step = as_i64(loop.induction_variable)
            start = arith_d.addi(chunk_start, arith_d.muli(step, const_i64(s.kv_block)))

            def unit(h) -> None:   # step ``step`` of head first_head + h
                self._use_head(first_head, h)
                this = arith_d.addi(arith_d.muli(step, heads), h)   # the unit's index
                following = arith_d.addi(this, const_i64(1))
                last = arith_d.cmpi(arith_d.CmpIPredicate.eq, arith_d.addi(h, const_i64(1)), heads)
                next_start = arith_d.select(last, arith_d.addi(start, const_i64(s.kv_block)), start)
                next_head = arith_d.select(last, first_head, arith_d.addi(self.head, const_i64(1)))
                self._prefetch(next_start, None, following, next_head, lines=False)
                self.next_half = self._pointers_of(following)
                self._stage(this)
                self.engine.scores(self, self.q_rows, self.k_stage, self.scores)
                self._softmax(start, self.scores, first_row)
                self.engine.accumulate(self, self._pointers_of(this) if self.v_stage is None else self.v_stage)

            for_heads(unit)
            scf_d.YieldOp([])

        def write(h) -> None:
            self._use_head(first_head, h, tables=False)
            place = arith_d.addi(arith_d.muli(arith_d.addi(arith_d.muli(entry, self.n["chunks"]), chunk),
                                              const_i64(s.h_kv)), self.head)
            self._write_partials(arith_d.addi(arith_d.muli(place, const_i64(rows_per_head)), first_row), rows_valid)

        for_heads(write)

    def _use_head(self, first_head, h, tables: bool = True) -> None:
        """Head ``first_head + h``'s buffers as the workgroup's (``h`` an i64 Value below the
        workgroup's heads): its q rows, acc and softmax state, and with ``tables`` its widening
        tables (:meth:`_store_tables`)."""
        self.head = arith_d.addi(first_head, h)
        if self.max_heads == 1:
            return
        for name, size in self.head_buffers.items():
            setattr(self, name, at(getattr(self, f"{name}_heads"), arith_d.muli(h, const_i64(size))))
        if tables and self.kv_format:
            self.scales = self._scales_of(self.head)
        if tables and self.byte_tables:
            bytes64 = ir.VectorType.get([64], ir.IntegerType.get_signless(8))
            base = at(self.table_heads, arith_d.muli(h, const_i64(_TABLE_BYTES)))
            loaded = [llvm_load(bytes64, at(base, 64 * k)) for k in range(8)]
            self.tables = [((loaded[4 * w], loaded[4 * w + 1]), (loaded[4 * w + 2], loaded[4 * w + 3])) for w in (0, 1)]

    def _store_tables(self, h) -> None:
        """The K and V tables of ``self.tables`` into head ``h``'s place in ``table_heads``."""
        base = at(self.table_heads, arith_d.muli(h, const_i64(_TABLE_BYTES)))
        vectors = [vector for low, high in self.tables for vector in (*low, *high)]
        for k, vector in enumerate(vectors):
            llvm_store(vector, at(base, 64 * k))

    def _scales_of(self, head) -> list[ir.Value]:
        """2^(15 - bias) x head ``head``'s K and V scales, splat (an 8-bit cache's)."""
        exponent = 2.0 ** (15 - EIGHT_BIT_FORMATS[self.kv_format][1])
        return [self.vec.splat(arith_d.mulf(llvm_load(f32(), at(self.p[name], arith_d.muli(head, const_i64(4)))),
                                            arith_d.constant(f32(), exponent)))
                for name in ("k_scale", "v_scale")]

    def chunk(self, which: int, row, chunk: int, lanes: ir.Type) -> ir.Value:
        """The ``chunk``-th 64 bytes of a K (``which`` 0) or V (1) row in the engine's operand
        dtype, as ``lanes``: loaded, from an f16 cache widened (16 elements), or from an 8-bit
        cache widened through the head's scale (:meth:`_widened`) and rounded to the compute
        dtype where that is narrower than the operands (f16 and bf16 on the FMA blocks)."""
        if self.kv_format is None and self.elem != self.engine.operand:   # f16 rows, f32 operands
            return arith_d.extf(lanes, self.vec.load(at(row, chunk * 32), self.elem))
        if self.kv_format is None:
            return llvm_load(lanes, at(row, chunk * 64))
        if self.engine.operand == ir.BF16Type.get():   # 32 elements through the head's tables
            return vector_d.bitcast(lanes, self._looked_up(which, at(row, chunk * 32)))
        wide = self._widened(which, at(row, chunk * 16))   # f32 operands: 16 elements
        if self.elem == ir.BF16Type.get():   # bf16(f32(x) x scale), semantics §15
            return self.vec.bf16_rounded(wide)
        if self.elem != self.engine.operand:   # f16(f32(x) x scale)
            return arith_d.extf(lanes, arith_d.truncf(ir.VectorType.get([16], self.elem), wide))
        return wide

    def _bf16_table(self, which: int) -> tuple:
        """The K (``which`` 0) or V (1) table of bf16(f32(x) x the head's scale) for the 128
        magnitudes x of the 8-bit format (sign bit clear), as (low bytes, high bytes), each two
        halves of 64 bytes: the widening of :meth:`_widened`, once a workgroup, rounded in
        integer ops (Vec.bf16_rounded: no avx512_bf16 needed)."""
        i8, i16 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(16)
        low, high = [], []
        for part in range(8):
            lanes = self.vec.iota()
            index = arith_d.addi(lanes, self.vec.splat(arith_d.constant(i32(), 16 * part)))
            magnitudes = arith_d.trunci(ir.VectorType.get([16], i8), index)
            rounded = vector_d.bitcast(self.vec.i32x, self.vec.bf16_rounded(self._scaled(which, magnitudes)))
            bits = arith_d.trunci(ir.VectorType.get([16], i16), arith_d.shrui(rounded, const_int(self.vec.i32x, 16)))
            low.append(arith_d.trunci(ir.VectorType.get([16], i8), bits))
            high.append(arith_d.trunci(ir.VectorType.get([16], i8), arith_d.shrui(bits, const_int(bits.type, 8))))

        def halves(parts):
            pairs = [vector_d.shuffle(parts[i], parts[i + 1], list(range(32))) for i in range(0, 8, 2)]
            return tuple(vector_d.shuffle(pairs[i], pairs[i + 1], list(range(64))) for i in (0, 2))

        return halves(low), halves(high)

    def key_row(self, row) -> list[ir.Value]:
        """The d 8-bit elements of the K row at ``row`` as d/32 vectors of 32 bf16 (as 16 i32),
        64 elements a lookup (:meth:`lookup`; 32 a lookup as :meth:`_looked_up` does wasted
        half of each ``vpermi2b``, two cycles of the shuffle port on these CPUs: with this and
        :meth:`paired_values`, e4m3 32 x 1 vs 4096 16.97 -> 13.58 ms in cache, 25.71 -> 22.60
        from memory), each 64 joined by one-cycle in-lane interleaves, dims in the order
        KeyRowsEngine.prepare_queries gives q (13.48 -> 13.08 in cache, 25.88 -> 25.44 and
        25.80 -> 25.37 from memory; docs/performance.md, fifteenth session)."""
        return [out for first in range(0, self.s.d, 64) for out in self.key_block(row, first)]

    def key_block(self, row, first: int) -> list[ir.Value]:
        """Dims [first, first + 64) of :meth:`key_row` (fewer at the row's end): one or two vectors
        of 16 bf16 pairs, pair m of vector j holding dims :meth:`pair_dim` and the next."""
        lanes = ir.VectorType.get([16], i32())
        width, (low, high) = self._row_lookup(0, row, first)
        outs = []
        for j in range(width // 32):
            if width == 64:   # in-lane byte interleaves (vpunpck[lh]bw); q's dims follow (prepare_queries)
                joined = _in_lane_join(low, high, j)
            else:
                joined = _join(low, high, 32 * j)
            outs.append(vector_d.bitcast(lanes, joined))
        return outs

    def pair_dim(self, first: int, j: int, pair: int) -> int:
        """The first of the two dims pair ``pair`` of vector ``j`` of :meth:`key_block` holds."""
        if min(64, self.s.d - first) == 64:
            return first + 16 * (pair // 4) + 8 * j + 2 * (pair % 4)
        return first + 32 * j + 2 * pair

    def value_row(self, row, first: int) -> list[ir.Value]:
        """Dims [first, first + 64) of the 8-bit V row at ``row`` (fewer at its end) as bf16 in
        their order, 32 a vector: 64 elements a lookup, low and high bytes interleaved by the
        shuffles that join them."""
        width, (low, high) = self._row_lookup(1, row, first)
        halves = ir.VectorType.get([32], ir.BF16Type.get())
        return [vector_d.bitcast(halves, _join(low, high, 32 * j)) for j in range(width // 32)]

    def _row_lookup(self, which: int, row, first: int) -> tuple[int, tuple[ir.Value, ir.Value]]:
        """(width, :meth:`lookup` of them) for the 8-bit elements [first, first + width) of the K
        (``which`` 0) or V (1) row at ``row``, width 64 or the 32 left at the row's end."""
        width = min(64, (self.s.d, self.s.d_v)[which] - first)
        raw = llvm_load(ir.VectorType.get([width], ir.IntegerType.get_signless(8)), at(row, first))
        return width, self.lookup(which, raw if width == 64 else vector_d.shuffle(raw, raw, list(range(64))))

    def paired_values(self, a, b, chunk: int) -> tuple[ir.Value, ir.Value]:
        """Dims [32 chunk, + 32) of the 8-bit V rows of keys a and b as AmxStaging.values' two
        pair vectors (dims 0-15 and 16-31 of the chunk, each 16 (a, b) bf16 pairs, as 32 i16):
        both keys' 32 bytes in one lookup (:meth:`lookup`), interleaved by the shuffle that
        joins low and high bytes."""
        i8 = ir.IntegerType.get_signless(8)
        raw = [llvm_load(ir.VectorType.get([32], i8), at(row, chunk * 32)) for row in (a, b)]
        low, high = self.lookup(1, vector_d.shuffle(raw[0], raw[1], list(range(64))))
        halves = ir.VectorType.get([32], ir.IntegerType.get_signless(16))
        outs = []
        for j in range(2):
            order = [16 * j + i // 4 + (64 if i % 2 else 0) + (32 if i % 4 >= 2 else 0) for i in range(64)]
            outs.append(vector_d.bitcast(halves, vector_d.shuffle(low, high, order)))
        return outs[0], outs[1]

    def paired_value_block(self, a, b, first: int) -> list[ir.Value]:
        """Dims [first, first + 64) of the 8-bit V rows of keys a and b as four AmxStaging pair
        vectors (16 (a, b) bf16 pairs each, as 32 i16), vector t holding dims first + 16 g + 4 t
        + [0, 4) in its lanes 4 g + [0, 4) (:attr:`values_permuted`): the two rows' bytes
        interleaved by in-lane unpacks, looked up (:meth:`lookup`), low and high bytes joined by
        in-lane unpacks; no cross-lane shuffle, where :meth:`paired_values` takes two a 32 dims."""
        bytes64 = ir.VectorType.get([64], ir.IntegerType.get_signless(8))
        halves = ir.VectorType.get([32], ir.IntegerType.get_signless(16))
        raw_a, raw_b = (llvm_load(bytes64, at(row, first)) for row in (a, b))
        outs = []
        for half in range(2):   # bytes 8 half + [0, 8) of each 128-bit lane: (a, b) byte pairs
            low, high = self.lookup(1, _in_lane_join(raw_a, raw_b, half))
            outs += [vector_d.bitcast(halves, _in_lane_join(low, high, j)) for j in range(2)]
        return outs

    def lookup(self, which: int, index) -> tuple[ir.Value, ir.Value]:
        """The low and high bytes of bf16(f32(x) x the head's scale) for 64 8-bit elements x
        (``index``, 64 i8): each magnitude's two bytes from the head's tables (vpermi2b: 128
        entries a byte of index), the high byte's sign bit flipped by x's."""
        bytes64 = index.type

        def through(table):
            return llvm_d.call_intrinsic(bytes64, "llvm.x86.avx512.vpermi2var.qi.512", [table[0], index, table[1]],
                                         [], [])

        low_table, high_table = self.tables[which]
        sign = arith_d.andi(index, const_int(bytes64, -0x80))
        return through(low_table), arith_d.xori(through(high_table), sign)

    def _looked_up(self, which: int, pointer) -> ir.Value:
        """32 8-bit elements at ``pointer`` as 32 bf16 (as 64 i8): each magnitude's two bytes
        from the head's tables (vpermi2b: 128 entries a byte of index), its sign bit flipped by
        x's. Equal to :meth:`_widened` then rounded to bf16 (bf16 rounding is symmetric in the
        sign), in a few byte shuffles instead of the f16 move, two vcvtph2ps, two multiplies and
        two vcvtneps2bf16."""
        raw = llvm_load(ir.VectorType.get([32], ir.IntegerType.get_signless(8)), pointer)
        low, high = self.lookup(which, vector_d.shuffle(raw, raw, list(range(64))))   # the upper half unused
        return _join(low, high, 0)

    def _widened(self, which: int, pointer) -> ir.Value:
        """16 8-bit elements at ``pointer`` as f32 times the head's scale (:meth:`_scaled`)."""
        return self._scaled(which, llvm_load(ir.VectorType.get([16], ir.IntegerType.get_signless(8)), pointer))

    def _scaled(self, which: int, raw) -> ir.Value:
        """16 8-bit elements ``raw`` as f32 times the head's scale: their bits moved into
        float16s (kv_layouts.f16_bits, the linalg passes' move, a vector at a time), widened by
        vcvtph2ps, times 2^(15 - bias) x scale (semantics §15: f32(x) x scale; rounded to bf16
        through the tables where the operands are bf16: :meth:`_bf16_table`)."""
        half = f16_bits(raw, self.kv_format)
        wide = arith_d.extf(self.vec.f32x, vector_d.bitcast(ir.VectorType.get([16], ir.F16Type.get()), half))
        return arith_d.mulf(wide, self.scales[which])

    def _zero(self, buffer, size: int) -> None:
        zero = self.vec.const(0.0)
        for offset in range(0, size, 64):
            self.vec.store(zero, at(buffer, offset))

    def _row_pointers(self, column, head) -> tuple[ir.Value, ir.Value]:
        """(K row, V row) pointers of the entry's logical key ``column`` for head ``head``: through
        the table and the layout; the zero row where the column is past the chunk, the entry's
        keys or its table (a -1 block)."""
        physical = column
        if self.window is not None:   # semantics §2: sinks, then the window's rows
            sinks, offset = self.window
            physical = arith_d.select(arith_d.cmpi(arith_d.CmpIPredicate.slt, column, sinks), column,
                                      arith_d.addi(arith_d.subi(column, sinks), offset))
        table_value, slot = self._table_entry(physical)
        return self._rows_at(column, table_value, slot, head)

    def _group_row_pointers(self, first_column, head) -> list[tuple[ir.Value, ir.Value]]:
        """:meth:`_row_pointers` of the 16 keys from ``first_column`` (a multiple of 16, where
        :meth:`_groups_share_blocks`): one table entry for them all."""
        table_value, slot = self._table_entry(first_column)
        return [self._rows_at(arith_d.addi(first_column, const_i64(k)), table_value, arith_d.addi(slot, const_i64(k)),
                              head) for k in range(16)]

    def _groups_share_blocks(self) -> bool:
        """Whether each 16 keys of a step from a multiple of 16 lie in one table block: whole
        multiples of 16 keys a block, no sliding window (whose sinks shift the rows)."""
        return self.window is None and self.spec.block % 16 == 0

    def _table_entry(self, physical) -> tuple[ir.Value, ir.Value]:
        """(the table's value for the block of the physical key ``physical``, the key's slot in
        it); the block clamped into the entry's table."""
        block = arith_d.minsi(arith_d.divsi(physical, const_i64(self.spec.block)),
                              arith_d.subi(self.table_blocks, const_i64(1)))
        block = arith_d.maxsi(block, const_i64(0))
        slot = arith_d.remsi(physical, const_i64(self.spec.block))
        table_value = arith_d.extsi(i64(), llvm_load(i32(), at(self.table_row, arith_d.muli(block, const_i64(4)))))
        return table_value, slot

    def _rows_at(self, column, table_value, slot, head) -> tuple[ir.Value, ir.Value]:
        """(K row, V row) pointers of head ``head``'s key ``column`` at ``slot`` of the block whose
        table value is ``table_value``; the zero row where it is absent."""
        spec, layout = self.spec, cache_layout(self.spec.base)
        present = arith_d.cmpi(arith_d.CmpIPredicate.slt, column, self.keys.end)
        present = arith_d.andi(present, arith_d.cmpi(arith_d.CmpIPredicate.ne, table_value, const_i64(-1)))
        pointers = []
        for which in (0, 1):
            source, offset = layout.row_offset(spec.base, which, table_value, slot, head, self.n["extent"])
            row = at(self.p[f"kv{source}"], arith_d.muli(offset, const_i64(self.kv_bytes)))
            pointers.append(arith_d.select(present, row, self.zero_row))
        return pointers[0], pointers[1]

    def _pointers_of(self, unit) -> ir.Value:
        """Unit ``unit``'s half of ``row_pointers`` (units, a step of one head each, alternate halves)."""
        return at(self.row_pointers, arith_d.muli(arith_d.remui(unit, const_i64(2)), const_i64(self.s.kv_block * 16)))

    def prefetch_share(self, first, count: int, part: int, parts: int) -> None:
        """Part ``part`` of ``parts`` of the next step's keys [first, first + count) (``first`` an
        int or an i64 Value) asked for, as PREFETCH_LOCALITY says, their rows read from
        ``next_half``: keys [first + count part / parts, first + count (part + 1) / parts)."""
        begin, end = count * part // parts, count * (part + 1) // parts
        base = const_i64(first) if isinstance(first, int) else first
        for key in range(begin, end):
            slot = at(self.next_half, arith_d.muli(arith_d.addi(base, const_i64(key)), const_i64(16)))
            for which in (0, 1):
                self._ask_for(llvm_d.load(ptr_type(), at(slot, 8 * which), alignment=8))

    def _ask_for(self, row) -> None:
        """The cache lines of the cache row at ``row`` asked for, as PREFETCH_LOCALITY says."""
        for line in range(0, self.s.d * self.kv_bytes, 64):
            llvm_d.intr_prefetch(at(row, line), 0, PREFETCH_LOCALITY, 1)

    def _prefetch(self, start, steps_left, step, head, lines: bool = True) -> None:
        """Head ``head``'s row pointers of keys [start, start + kv_block) (unit ``step``'s: a step
        of one head) into its half of ``row_pointers``, and with ``lines`` their cache lines asked
        for (when steps are left): the gathers of a step then find their rows in cache (without
        it, a decode pass waited on each row's first load: 10 GB/s of the machine's 20; each
        pointer computed once, not again in the gather: the e4m3 pass 1.11 -> 1.20x the bf16
        one), as PREFETCH_LOCALITY says. Without
        ``lines`` the pointers are written whether steps are left or not (past the keys: the zero
        row), for :meth:`prefetch_share` to read."""
        def pointers():
            half = self._pointers_of(step)
            grouped = self._groups_share_blocks()
            loop = scf_d.ForOp(const_index(0), const_index(self.s.kv_block // (16 if grouped else 1)), const_index(1))
            with ir.InsertionPoint(loop.body):
                if grouped:   # one table entry each 16 keys
                    first = arith_d.muli(as_i64(loop.induction_variable), const_i64(16))
                    keys = [(arith_d.addi(first, const_i64(k)), rows)
                            for k, rows in enumerate(self._group_row_pointers(arith_d.addi(start, first), head))]
                else:
                    key = as_i64(loop.induction_variable)
                    keys = [(key, self._row_pointers(arith_d.addi(start, key), head))]
                for key, rows in keys:
                    for which, row in enumerate(rows):
                        llvm_store(row, at(half, arith_d.addi(arith_d.muli(key, const_i64(16)), const_i64(8 * which))))
                        if lines:
                            self._ask_for(row)
                scf_d.YieldOp([])

        if not lines:
            pointers()
            return
        more = scf_d.IfOp(arith_d.cmpi(arith_d.CmpIPredicate.sgt, steps_left, const_i64(0)))
        with ir.InsertionPoint(more.then_block):
            pointers()
            scf_d.YieldOp([])

    def _stage(self, unit) -> None:
        """Unit ``unit``'s keys (their pointers in its half of ``row_pointers``) into the staging
        buffers, 16 at a time."""
        half = self._pointers_of(unit)
        loop = scf_d.ForOp(const_index(0), const_index(self.s.kv_block // 16), const_index(1))
        with ir.InsertionPoint(loop.body):
            group = as_i64(loop.induction_variable)
            first = at(half, arith_d.muli(group, const_i64(16 * 16)))
            pairs = [tuple(llvm_d.load(ptr_type(), at(first, 16 * i + 8 * which), alignment=8) for which in (0, 1))
                     for i in range(16)]
            self.staging.keys(self, group, [k for k, _ in pairs])
            if self.v_stage is not None:
                self.staging.values(self, group, [v for _, v in pairs])
            scf_d.YieldOp([])

    def _write_partials(self, first_place, rows_valid) -> None:
        """Each valid row's acc (unnormalised f32) to products and its (max, sum) to state."""
        v, d = self.vec, self.s.d_v

        def row(r):
            place = arith_d.addi(first_place, r)
            out_at = at(self.p["products"], arith_d.muli(place, const_i64(d * 4)))
            acc_row = self.row_addr(self.acc, r, self.acc_stride)
            columns = [v.load(at(acc_row, t * 64)) for t in range(d // 16)]
            if self.values_permuted:   # each 64 dims' four vectors back in dim order
                columns = [out for first in range(0, d // 16, 4)
                           for out in _lane_groups_transposed(columns[first:first + 4])]
            for t, column in enumerate(columns):
                v.store(column, at(out_at, t * 64))
            llvm_store(llvm_load(i64(), self.row_addr(self.state, r, 8)),
                       at(self.p["state"], arith_d.muli(place, const_i64(8))))

        self._for_rows(arith_d.index_cast(ir.IndexType.get(), rows_valid), row)


def _build_executable(spec: DecodeSpec, cpu: X86Cpu, shapes: KernelShapes, engine, operand_types: list) -> None:
    """The ``stream.executable`` of the pass at the insertion point: bindings of the tensors
    (q, the KV sources, table, geometry), the dynamic dims of each, ``_SCALARS``, sm_scale, then
    the results products and state."""
    index, binding = ir.IndexType.get(), ir.Type.parse(BINDING)
    scales = ["k_scale", "v_scale"] if quantized_kv(spec) else []
    names = ["q", *(f"kv{i}" for i in range(len(operand_types) - 3 - len(scales))), "table", "geometry", *scales]
    dynamic = [sum(1 for size in t.shape if size == DYN) for t in operand_types]
    results = [("products", [DYN, DYN, shapes.h_kv, spec.rows, shapes.d_v], f32()),
               ("state", [DYN, DYN, shapes.h_kv, spec.rows, 2], f32())]
    arg_types = [binding] * len(names) + [index] * (sum(dynamic) + len(_SCALARS)) + [f32()] + [binding] * len(results)
    with hand_written_dispatch(*dispatch_names(spec), arg_types) as args:
        bindings, rest = args[:len(names)], args[len(names):]
        dims, rest = rest[:sum(dynamic)], rest[sum(dynamic):]
        scalars, sm_scale, outs = rest[:len(_SCALARS)], rest[len(_SCALARS)], rest[len(_SCALARS) + 1:]
        pointers, used = {}, 0
        for name, value, t, count_ in zip(names, bindings, operand_types, dynamic):
            memref = ir.MemRefType.get(list(t.shape), t.element_type)
            pointers[name] = binding_pointer(value, memref, dims[used:used + count_])
            used += count_
        entries, chunks = scalars[0], scalars[1]
        for (name, shape, elem), value in zip(results, outs):
            pointers[name] = binding_pointer(value, ir.MemRefType.get(shape, elem), [entries, chunks])
        named = {name: as_i64(value) for name, value in zip(_SCALARS, scalars)}
        _PassDispatch(spec, cpu, shapes, engine, pointers, named, sm_scale).emit()


def _emit(spec: DecodeSpec, cpu: X86Cpu, shapes: KernelShapes, anchor: ir.Operation, q, cache, table, geometry,
          causal, sm_scale, sinks) -> list[ir.Value]:
    engine = pass_engine_type(spec, cpu)(spec.dtype)
    scales = cache.sources[len(cache.sources) - 2:] if quantized_kv(spec.base) else []
    sources = list(cache.sources[:len(cache.sources) - len(scales)])
    tensors = [q, *sources, table, geometry, *scales]
    types = [ir.RankedTensorType(x.type) for x in tensors]
    with ir.InsertionPoint(anchor):
        _build_executable(spec, cpu, shapes, engine, types)
    entries, chunks, per_chunk = (dim(table, axis) for axis in range(3))
    extent = dim(sources[0], cache_layout(spec.base).extent_axis)
    causal_index = arith_d.index_cast(ir.IndexType.get(), causal)
    dyn = [dim(x, axis) for x, t in zip(tensors, types) for axis, size in enumerate(t.shape) if size == DYN]
    row_groups = -(-spec.rows // shapes.row_block)
    h, d = shapes.h_kv, shapes.d_v
    heads, max_heads = const_index(1), pass_heads(spec, cpu)
    if max_heads > 1:   # a workgroup a chunk's row group and every head where they are workgroups enough
        one_head = arith_d.muli(arith_d.muli(chunks, const_index(row_groups * h)), entries)
        enough = arith_d.cmpi(arith_d.CmpIPredicate.uge, one_head, const_index(HEAD_GROUPS_FROM * max_heads))
        heads = arith_d.select(enough, const_index(max_heads), heads)
    entry = ir.ArrayAttr.get([ir.SymbolRefAttr.get(list(dispatch_names(spec)))])
    dispatch = flow_d.DispatchOp(
        [tensor_type([DYN, DYN, h, spec.rows, d], f32()), tensor_type([DYN, DYN, h, spec.rows, 2], f32())],
        [arith_d.muli(chunks, const_index(row_groups)), arith_d.divui(const_index(h), heads), entries], entry,
        [*tensors, *dyn, entries, chunks, per_chunk, extent, causal_index, heads, sm_scale],
        dyn, [entries, chunks, entries, chunks])
    products, state = dispatch.results

    def part(k):
        return generic([], [empty([entries, chunks, h, spec.rows], f32())], [affine_map(4, range(4))], "pppp",
                       lambda _out: [tensor_d.extract(state, [*(_loop(i) for i in range(4)), const_index(k)])])[0]

    return merge_chunks(spec, part(0), part(1), products, sinks, normalised=False)


def _loop(i: int) -> ir.Value:
    return linalg_d.IndexOp(i).result


def build_x86_pass(spec: DecodeSpec, cpu: X86Cpu = XEON_WITH_AMX) -> ir.Module:
    """The verified module of the serving pass ``spec`` (decode.decode_module's signature) with its
    attention in one hand-written dispatch, for ``cpu`` (without AMX tiles bf16 on DotEngine or
    the FMA blocks: :func:`pass_engine_type`); ValueError where :func:`pass_unsupported` says why
    not."""
    why = pass_unsupported(spec, cpu)
    if why:
        raise ValueError(f"no x86 lowering for {spec.name}: {why}")
    shapes = KernelShapes(spec.h_q, spec.h_kv, spec.d_qk, spec.dtype, "causal", 0.0, *pass_blocks(spec, cpu),
                          spec.base.logits_soft_cap, spec.d_v)

    def emit(q, cache, table, geometry, causal, sm_scale, sinks):
        function = q.owner.owner
        return _emit(spec, cpu, shapes, function, q, cache, table, geometry, causal, sm_scale, sinks)

    return decode_module(spec, emit)
