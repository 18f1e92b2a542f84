"""Short entries in one pass: every entry of a KV-cache call with at most ``queries`` queries.

A serving step is often many sequences with one (decode) or a few (speculative verification) new
tokens each. Walked one entry at a time (kv_cache.py), each costs its own gather, layout and
KV-tile dispatches; here all of them run in a fixed sequence of dispatches (llvm-cpu, the linalg
lowering). Shapes (n entries, h = h_kv, G the GQA group, R = queries x G rows per KV head with row
t * G + g holding token t and head g, c chunks of P blocks, C = P x block columns a chunk):

    q         [n, h, R, d_qk]          the entries' query rows, zero past an entry's queries
    table     [n, c, P] i32            per KV block of ``block`` logical rows: a page id (paged,
                                       MLA) or the block's first row in k/v (ragged); P chosen
                                       per call (DecodeSpec.chunk_blocks)
    geometry  [n, 4] i32               kv_len, sink tokens, window_offset (semantics §2; 0, 0 without
                                       sliding window), qo_len
    scores    [n, c, h, P, block, R] f32   one pass per chunk of C columns
    output    [n, h, R, d_v] (dtype), lse [n, h, R] f32 (base 2); rows past qo_len are padding

Every chunk is reduced on its own (max, sum, probs x values), then the chunks merge by their
maxima (a 4- or 16-query call whose entries are one chunk each skips the merge). The K and V
rows are read straight from the cache inside the two contractions (no gathered copy): the
contraction's loop order is chosen so IREE cannot collapse its dims, and its tiling vectorises
only the head dim, whose loads are then contiguous. The mask is the base
spec's rule (mask_rules.py), which must be a ``one_pass`` one: the KV-cache causal mask.

Bitwise reproducibility: an entry's chunks are computed alone, padded chunks add exact zeros, the
chunk merge reduces one chunk at a time, and an entry of one chunk gets the same bits merged (its
chunk weighs 1 exactly) as unmerged, so an entry's result does not depend on the other entries of
the call (tests/test_decode_batches.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Union, get_args

from .ir import (
    DYN, affine_map, arith_d, collapse, const_f32, const_index, dim, element_type, empty, expand, f32, fill,
    func_d, generic, i32, index, ir, linalg_d, lt, mark_tiling, math_d, module_context, own_dispatch,
    own_dispatch_results, scf_d, sizes_of, tensor_d, tensor_type, tie_dims, widened,
)
from .abi import ARGUMENTS, Arg, argument_types, bound_arguments, kv_sources, result_types
from .dtypes import quantized_kv
from .kv_layouts import cache_layout, dequantized
from .mask_rules import Lengths, MaskRule, mask_rule
from .online_softmax import NO_KEY_MAX, row_sinks, score_transform, sink_lse, sink_normalised
from .specs import EMPTY_ROW_LSE, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec

KvCacheSpec = Union[RaggedPrefillSpec, PagedPrefillSpec, MlaPagedPrefillSpec]


@dataclass(frozen=True)
class PassVectors:
    """How a serving pass's scores contraction vectorises on a CPU (pipeline/cpu_tiles.py picks
    one per CPU): ``head_dim``, the widest head-dim vector of a (key, row) dot (one horizontal
    sum per vector); ``rows_from``: passes with at least this many query rows per KV head (and a
    layout with ``vectorise_rows``) broadcast each key element to ROW_VECTOR rows instead (None:
    never)."""

    head_dim: int
    rows_from: int | None

    def by_rows(self, spec: "DecodeSpec") -> bool:
        """Whether ``spec``'s scores vectorise along its query rows."""
        return self.rows_from is not None and spec.rows >= self.rows_from and cache_layout(spec.base).vectorise_rows


#: AVX-512: 128-lane head-dim dots for every pass (16 lanes had reduced each 16-lane product to
#: a scalar and chained the sums: the 32 x 1 vs 1024 f32 scores 18.8 -> 6.6 ms; the rows form of
#: the 4-query pass, one latency-bound accumulator per key, 40.7 -> 26.5 ms for the pass).
WIDE_PASS_VECTORS = PassVectors(head_dim=128, rows_from=None)
#: Other CPUs (AVX2): 16-lane dots, rows from 16 (built for znver3 and run on the AVX-512 VM,
#: 128 lanes took the 1-query scores 11.4 -> 22.5 ms and the 4-query ones 21.3 -> 78.6).
NARROW_PASS_VECTORS = PassVectors(head_dim=16, rows_from=16)

#: Columns of the chunks a pass aims at (T = CHUNK_COLUMNS / block blocks; an entry's chunks
#: hold T to 2T - 1 blocks, fewer for an entry shorter than T): 128 was the fastest fixed chunk
#: for the 1-, 4- and 16-query passes (docs/performance.md, decode passes).
CHUNK_COLUMNS = 128
#: Each chunk keeps its f32 products (R x h_kv x d_v per entry) until the merge: chunks widen
#: (doubling) until those are at most this fraction of the K/V bytes a chunk reads. Only many
#: heads over a narrow cache row reach it: DeepSeek-V3's MLA (h_q 128, d_v 512, 576-wide bf16
#: latent rows) gets 512 columns.
CHUNK_PRODUCTS_SHARE = 0.25
#: The widest chunk a pass aims at (its entries' chunks hold up to twice as many columns, less a
#: block: DecodeSpec.chunk_blocks).
MAX_CHUNK_COLUMNS = 512
#: f32 tensors of one score per (key, query row) the pass materialises: the raw scores, the
#: masked and scaled scores, the probabilities.
SCORE_TENSORS = 3
#: The probs x values contraction vectorises along the query rows (up to ROW_VECTOR a vector on
#: llvm-cpu, pipeline/cpu_tiles.py): each value element is one broadcast load, and PV_COLUMNS
#: head-dim columns per key give as many independent accumulators (docs/performance.md, decode
#: passes). Passes of ROW_VECTOR or more rows keep their scores key-major.
ROW_VECTOR = 16
PV_COLUMNS = 8


def _from_base(name: str) -> property:
    """A DecodeSpec attribute that is its base spec's."""
    return property(lambda self: getattr(self.base, name), doc=f"The base spec's ``{name}``.")


@dataclass(frozen=True)
class DecodeSpec:
    """The one-pass kernel of a KV-cache spec (``base``) for entries of up to ``queries`` queries:
    its own artifact, compiled and loaded with its variant's kernel (runtime/kernels.py:
    open_kernel). ``symbol`` is the entry point, ``name`` the artifact's."""

    base: KvCacheSpec
    queries: int = 1

    @property
    def symbol(self) -> str:
        """The entry point: ``decode_entries`` for one query, ``decode_entries_q4`` for 4, ...
        (as the artifacts are named), distinct among a variant's passes so that a kernel and its
        passes compile as one module (mlir/bundle.py)."""
        return "decode_entries" if self.queries == 1 else f"decode_entries_q{self.queries}"

    # What the pass has as its variant has it (``d`` and ``page_size``: the variants that have them).
    dtype = _from_base("dtype")
    h_q = _from_base("h_q")
    h_kv = _from_base("h_kv")
    group_size = _from_base("group_size")
    layout = _from_base("layout")
    kv_layout = _from_base("kv_layout")
    logits_soft_cap = _from_base("logits_soft_cap")
    d = _from_base("d")
    d_qk = _from_base("d_qk")
    d_v = _from_base("d_v")
    page_size = _from_base("page_size")
    head_sinks = _from_base("head_sinks")

    @property
    def sliding_window(self) -> bool:
        """The variant's, False for the ragged cache (which has none)."""
        return getattr(self.base, "sliding_window", False)

    @property
    def name(self) -> str:
        return f"{self.base.name}_decode" + (f"_q{self.queries}" if self.queries > 1 else "")

    @property
    def rows(self) -> int:
        """R = queries x G: query rows per entry and KV head (row t * G + g: token t, head g)."""
        return self.queries * self.base.group_size

    @property
    def block(self) -> int:
        """Logical KV rows per table entry."""
        return cache_layout(self.base).block(self.base)

    @property
    def blocks_per_chunk(self) -> int:
        """T: the blocks of a chunk the pass aims at (an entry's chunks hold T to 2T - 1 of them,
        fewer for an entry shorter than T: :meth:`chunk_blocks`)."""
        return max(1, self.chunk_columns // self.block)

    def chunk_blocks(self, blocks: int) -> int:
        """P, the blocks per chunk of an entry of ``blocks`` table blocks: its blocks in
        ceil(blocks / (2T - 1)) chunks of equal size (rounded up), so a chunk holds less than 2T
        blocks and an entry is padded by less than a block per chunk (a short entry is one chunk
        of its own size). Its own lengths decide it, so an entry's result does not depend on its
        call. (P = 2T = 16 ran the mask's transposing write 4x slower than 13 or 8: 37 against
        9.6 and 11.7 ms in the 32 x 16 vs 1040 f32 pass.)"""
        blocks = max(int(blocks), 1)
        chunks = -(-blocks // (2 * self.blocks_per_chunk - 1))
        return -(-blocks // chunks)

    @property
    def chunk_columns(self) -> int:
        """CHUNK_COLUMNS, doubled while a chunk's products outweigh CHUNK_PRODUCTS_SHARE of its K/V
        (up to MAX_CHUNK_COLUMNS)."""
        products = self.rows * self.base.h_kv * self.d_v * 4
        columns = CHUNK_COLUMNS
        while products > CHUNK_PRODUCTS_SHARE * columns * self.kv_bytes_per_key and columns < MAX_CHUNK_COLUMNS:
            columns *= 2
        return columns

    @property
    def kv_bytes_per_key(self) -> int:
        """Bytes of K/V one key's cache row holds (MLA: one latent row, values included)."""
        return cache_layout(self.base).kv_bytes_per_key(self.base)

    @property
    def scratch_per_key(self) -> float:
        """Bytes of scratch per key of a call: SCORE_TENSORS f32 scores per query row and the
        chunk's f32 products shared by its columns (bench/serving_memory.py measures the whole)."""
        base = self.base
        scores = SCORE_TENSORS * self.rows * base.h_kv * 4
        return scores + self.rows * base.h_kv * self.d_v * 4 / self.chunk_columns

    def fields(self) -> dict:
        """Plain values :meth:`from_fields` rebuilds the pass from (an artifact manifest's)."""
        return {"base_type": type(self.base).__name__, "base": self.base.fields(), "queries": self.queries}

    @classmethod
    def from_fields(cls, fields: dict) -> "DecodeSpec":
        base_types = {t.__name__: t for t in get_args(KvCacheSpec)}
        if fields.get("base_type") not in base_types:
            raise ValueError(f"not a KV-cache spec type: {fields.get('base_type')!r}")
        return cls(base_types[fields["base_type"]](**fields["base"]), fields["queries"])


@dataclass(frozen=True)
class DecodePasses:
    """The one-pass kernels a lowering has: ``queries``, the query counts of its passes (each
    its own artifact; an entry takes the smallest that holds its queries, padded to it), whether
    a call's entries are grouped by KV length (``bucketed``: the fused pass pads every entry to
    the call's longest, the linalg pass reads the page table in place), and ``scratch_bound``,
    the most scratch per key a pass may take in K/V bytes per key (``None``: no bound, its
    scores stay in tiles). An entry whose own pass is not usable runs one query at a time in the
    1-query pass when it has at most ``split_up_to`` queries, else in the variant's kernel.
    ``call_scratch``: the most scratch bytes one call of a pass takes; a pass's entries, in
    order of KV length, are cut into calls within it (None: no bound). An entry with more
    queries than the largest pass and at most ``pieces_up_to`` keys runs in that pass, in
    pieces of its queries (0: none does). ``chunk_columns``: where set, every entry's chunks
    hold this many columns (or the spec's DecodeSpec.chunk_columns, if more), for a pass that
    reads no key past its entry's, so that padding a short entry costs it nothing (None: each
    entry's chunks sized by DecodeSpec.chunk_blocks); ``few_workers_chunk_columns``, the wider
    chunks of a device with few workers (:meth:`for_workers`). ``loaded``: the passes a kernel
    loaded at open, the only usable ones (None: every one)."""

    queries: tuple[int, ...]
    bucketed: bool
    scratch_bound: float | None = None
    split_up_to: int = 4
    call_scratch: int | None = None
    pieces_up_to: int = 0
    chunk_columns: int | None = None
    loaded: tuple[int, ...] | None = None
    few_workers_chunk_columns: int | None = None

    def for_workers(self, spec, workers: int) -> "DecodePasses":
        """These passes for a kernel of ``spec`` whose device runs ``workers`` threads: chunks of
        ``few_workers_chunk_columns`` where one sequence's KV heads alone give every worker two
        workgroups (h_kv >= 2 x workers), else as they are. An entry is split into chunks so that
        few sequences still fill the workers; where its heads already do, more chunks only add
        each workgroup's fixed work and the merge's (docs/performance.md, eighth session: one
        sequence of h 32/8 over 2049 keys on 2 workers, 0.74-0.80 -> 0.65-0.69 ms a call). An
        entry's chunks still depend on its own length only, never on its batch."""
        if self.few_workers_chunk_columns is None or spec.h_kv < 2 * max(1, workers):
            return self
        return replace(self, chunk_columns=max(self.chunk_columns or 0, self.few_workers_chunk_columns))

    def chunk_blocks(self, pass_spec: DecodeSpec, blocks: int) -> int:
        """P, the table blocks per chunk of an entry of ``blocks`` blocks in ``pass_spec``: one
        for every entry with ``chunk_columns``, else the entry's own (DecodeSpec.chunk_blocks)."""
        if self.chunk_columns is None:
            return pass_spec.chunk_blocks(blocks)
        return max(1, max(self.chunk_columns, pass_spec.chunk_columns) // pass_spec.block)

    def usable(self, spec) -> tuple[int, ...]:
        """The query counts of the passes that keep ``spec``'s scratch within the bound (and
        are loaded)."""
        return tuple(queries for queries in self.queries if self._within_bound(DecodeSpec(spec, queries)) != 0
                     and (self.loaded is None or queries in self.loaded))

    def pieces_per_call(self, pass_spec: DecodeSpec) -> int:
        """How many pass entries of one batch entry (its pieces) a call of ``pass_spec`` may hold:
        as many as keep their scratch within the bound (at least one; all without a bound)."""
        within = self._within_bound(pass_spec)
        return ALL_PIECES if within is None else max(1, within)

    def _within_bound(self, pass_spec: DecodeSpec) -> int | None:
        """How many pass entries' scratch per key fit in ``scratch_bound`` times a key's K/V
        (None without a bound)."""
        if self.scratch_bound is None:
            return None
        return int(self.scratch_bound * pass_spec.kv_bytes_per_key // pass_spec.scratch_per_key)

    def taken(self, queries: int, usable: tuple[int, ...]) -> int:
        """The pass (its query count) an entry whose own pass is ``queries`` takes, or 0 (the
        variant's kernel)."""
        if queries in usable:
            return queries
        return min(usable) if usable and min(usable) == 1 and queries <= self.split_up_to else 0


#: DecodePasses.pieces_per_call without a scratch bound: every piece of an entry in one call.
ALL_PIECES = 1 << 30

#: Per lowering (pipeline/targets.py; runtime/decode.py plans the calls). llvm-cpu's linalg
#: pass: 1, 2-4 and 5-16 queries (the 16-query pass against the entry loop: 32 x 16 vs 1024
#: 96-102 against 132 ms, 128 x 16 vs 128 55-60 against 175, docs/serving.md); it materialises
#: every score, so a pass whose scores outweigh the keys' K/V (many query heads over one latent
#: row: DeepSeek-V3's MLA with 4 queries) is not used: entries of up to 4 queries then run one
#: query at a time in the 1-query pass (measured faster for V3 than its 4-query pass), longer
#: ones in the variant's kernel. The fused pass (CUDA) puts R = queries x G rows of an entry on
#: 16-row tensor-core tiles. A linalg pass call takes at most 256 MiB of scratch, which the host
#: allocator then keeps from call to call (runtime/devices.py: HOST_MEMORY_KEPT), and its entries
#: have similar KV lengths (a call pads each to its longest): 128 x 16 vs 4096 cached 1444 -> 895-911
#: ms, vs mixed lengths 1777 -> 513 ms (docs/serving.md). Entries of 17 or more queries over at
#: most 256 keys run in 16-query pieces: 64 x 64 vs 128 cached 0.46-0.51 -> 0.69-0.72 of torch's
#: speed; over 512 keys the variant's kernel was faster (0.76-0.99 against 0.71-0.74).
DECODE_PASSES = {"linalg": DecodePasses((1, 4, 16), bucketed=False, scratch_bound=2.0, call_scratch=256 << 20,
                                       pieces_up_to=256),
                 "fused": DecodePasses((1, 4, 16), bucketed=True),
                 # CUDA's mma passes (mlir/cuda_decode.py): the fused passes' gather and padding
                 "mma": DecodePasses((1, 4, 16), bucketed=True),
                 # llvm-cpu on CPUs with AMX (mlir/x86_decode.py): its scratch is each chunk's
                 # products, no scores, so no pass is left out; calls cut as the linalg pass's;
                 # no entry in pieces: the x86 kernel (mlir/x86_kv_cache.py) runs a 96 x 96 bf16
                 # entry in 0.89 ms against 2.31 in 16-query pieces (200 x 200: 1.49 against 5.59).
                 # Chunks of 1024 columns for every entry (a workgroup reads no key past its
                 # entry's, so a short entry padded to one chunk costs nothing, and a batch of
                 # any lengths takes one chunk size): a workgroup's fixed work (its queries copied
                 # and transposed, its partial results written and merged) is over 8x the keys of
                 # 128; 32 x 4 vs 4096 bf16 49.0 -> 40.2 ms (512: 42.1, 2048: 40.1), 32 x 1 38.9
                 # -> 36.6 (docs/performance.md)
                 # (4096 where a sequence's KV heads fill the workers twice over: for_workers)
                 "x86": DecodePasses((1, 4, 16), bucketed=False, call_scratch=256 << 20, chunk_columns=1024,
                                     few_workers_chunk_columns=4096)}


def _index(i: int) -> ir.Value:
    return linalg_d.IndexOp(i).result


class KvCache:
    """Where logical row ``r`` of entry ``i`` lives, and its K or V element: the layout's
    (kv_layouts.py, ``element``). ``table`` is the pass's [n, c, P] table as [n, c x P]."""

    def __init__(self, spec: DecodeSpec, sources: list, table: ir.Value, chunk_blocks: ir.Value, geometry: ir.Value):
        self.spec, self.sources, self.table, self.chunk_blocks, self.geometry = (spec, sources, table, chunk_blocks,
                                                                                 geometry)

    def logical_block(self, chunk: ir.Value, block: ir.Value) -> ir.Value:
        """The entry's block index of (chunk, block)."""
        return arith_d.addi(arith_d.muli(chunk, self.chunk_blocks), block)

    def logical_column(self, chunk: ir.Value, block: ir.Value, slot: ir.Value) -> ir.Value:
        """The entry's KV column (logical row) of (chunk, block, slot)."""
        return arith_d.addi(arith_d.muli(self.logical_block(chunk, block), const_index(self.spec.block)), slot)

    def element(self, which: int, entry, chunk, block, slot, head, col, *, widen: bool = True) -> ir.Value:
        """K (0) or V (1) element ``col`` of head ``head`` at column (chunk, block, slot), f32
        (``widen``) or in the spec's dtype (an 8-bit cache's dequantised: :meth:`_element`)."""
        value = self._element(which, entry, chunk, block, slot, head, col)
        return widened(value) if widen else value

    def _element(self, which: int, entry, chunk, block, slot, head, col) -> ir.Value:
        """The layout's element, read through its KV head's scale where the cache is 8-bit (the
        scales are the last two sources: mlir/abi.py kv_sources)."""
        spec = self.spec
        value = cache_layout(spec.base).element(spec, self, which, entry, self.logical_block(chunk, block),
                                                lambda: self.logical_column(chunk, block, slot), slot, head, col)
        scales = self.sources[len(self.sources) - 2 + which] if quantized_kv(spec) else None
        return dequantized(value, scales, head, element_type(spec.dtype))


def _pass_arguments(spec: DecodeSpec) -> tuple[Arg, ...]:
    """``decode_entries``'s arguments (module docstring): its variant's KV sources between the
    queries of n pass entries and their table and geometry."""
    return (Arg("q", "tensor", ("n", "h_kv", "rows", "d_qk")), *kv_sources(spec.base),
            Arg("table", "index", ("n", "chunks", "P")), Arg("geometry", "index", ("n", 4)), Arg("causal", "int"),
            Arg("sm_scale", "float"))


ARGUMENTS[DecodeSpec] = _pass_arguments


def decode_module(spec: DecodeSpec, emit: Callable[..., list]) -> ir.Module:
    """A verified module with one function ``decode_entries`` (module docstring);
    ``emit(q, cache, table, geometry, causal, sm_scale, sinks)`` builds its body (cache: KvCache;
    table: [n, c, P]; sinks: [h_q] f32, the last argument of a spec with ``head_sinks``, or None)."""
    with module_context() as module:
        with ir.InsertionPoint(module.body):
            fn = func_d.FuncOp(spec.symbol, (argument_types(spec), result_types(spec)))
            with ir.InsertionPoint(fn.add_entry_block()):
                args = bound_arguments(spec, fn.arguments)
                table, geometry = args["table"], args["geometry"]
                sources = [args[source.name] for source in kv_sources(spec.base)]
                cache = KvCache(spec, sources, collapse(table, [[0], [1, 2]]), dim(table, 2), geometry)
                func_d.ReturnOp(emit(args["q"], cache, table, geometry, args["causal"], args["sm_scale"],
                                     args.get("sinks")))
        module.operation.verify()
        return module


def build_decode(spec: DecodeSpec, rule: MaskRule | None = None, vectors: PassVectors = NARROW_PASS_VECTORS
                 ) -> ir.Module:
    """``decode_entries(q, *kv, table, geometry, causal, sm_scale) -> (output, lse)``; ``kv`` is
    ``pages`` (paged [P, 2, h_kv, page, d], MLA [P, page, d_qk]) or ``k, v`` (ragged). ``rule``:
    the mask (default: the base spec's), a ``one_pass`` rule reading at most ``causal``;
    ``vectors``: the CPU's (pipeline/cpu_tiles.py)."""
    rule = pass_rule(spec, rule)
    return decode_module(spec, lambda *args: _decode(spec, rule, vectors, *args))


def pass_rule(spec: DecodeSpec, rule: MaskRule | None) -> MaskRule:
    """``rule``, or the base spec's; ValueError unless it is a ``one_pass`` rule (mask_rules.py)."""
    rule = rule or mask_rule(spec.base)
    if not rule.one_pass:
        raise ValueError(f"{type(rule).__name__} does not run in the one-pass serving kernels")
    return rule


def _decode(spec: DecodeSpec, rule: MaskRule, vectors: PassVectors, q, cache: KvCache, table, geometry, causal,
            sm_scale, sinks) -> list[ir.Value]:
    base = spec.base
    h, group = base.h_kv, spec.rows
    block = spec.block
    entries, chunks, per_chunk = (dim(table, axis) for axis in range(3))
    # The table as an operand indexed by (entry, chunk, block), used by the bodies: a block marked
    # -1 lies past every column of its entry and adds nothing. Without such an operand IREE
    # collapses (block, slot) into one dim, vectorises it, and every load becomes a gather.
    no_page = arith_d.constant(i32(), -1)

    def kept(table_value, value):
        return arith_d.select(arith_d.cmpi(arith_d.CmpIPredicate.ne, table_value, no_page), value, const_f32(0.0))

    # scores [n, c, h, p, s, g]: loops (i, c, h, p, s, g, k)
    score_sizes = [entries, chunks, h, per_chunk, block, group]

    def score_body(q_value, table_value, acc):
        i, c, hh, p, s, k = (_index(x) for x in (0, 1, 2, 3, 4, 6))
        key = cache.element(0, i, c, p, s, hh, k)
        return [arith_d.addf(acc, kept(table_value, arith_d.mulf(widened(q_value), key)))]

    if vectors.by_rows(spec):  # q as [n, h, d_qk, R]: a key element broadcast over R query rows
        transposed = [entries, h, spec.d_qk, group]  # its own dispatch: fused, q is read strided
        q_operand = own_dispatch(lambda: generic(
            [q], [empty(transposed, element_type(spec.dtype))], [affine_map(4, (0, 1, 3, 2)), affine_map(4, range(4))],
            "pppp", lambda x, _out: [x])[0], tensor_type([DYN, h, spec.d_qk, group], element_type(spec.dtype)), transposed)
        q_map, role, tiles = affine_map(7, (0, 2, 6, 5)), "pass.scores.rows", {}
    else:  # a key row's contiguous head-dim vector dotted with one query row at a time
        q_operand, q_map = q, affine_map(7, (0, 2, 5, 6))
        role, tiles = "pass.scores.dots", dict(d_qk=spec.d_qk, head_vector=vectors.head_dim)
    raw = generic([q_operand, table], [fill(const_f32(0.0), score_sizes, f32())],
                  [q_map, affine_map(7, (0, 1, 3)), affine_map(7, range(6))], "ppppppr", score_body)[0]
    raw, = mark_tiling(raw, role, drop_unit_loops=True, block=block, group=group, **tiles)

    scale = score_transform(sm_scale, base.logits_soft_cap)
    every = affine_map(6, range(6))

    mask = rule.bind({"causal": causal}).per_call()
    # Passes of ROW_VECTOR or more rows keep the masked scores key-major, [n, c, h, p, s, g]: the
    # chunk's max and sum reduce over keys with a vector of rows, and nothing is transposed (the
    # 16-query pass's mask 1.53 -> 0.92 ms on 32 x 16 vs 192 keys, docs/performance.md). Fewer rows
    # make those vectors short: such passes store them row-major, [n, c, h, g, p, s], so the max
    # and exp2 read each row's columns contiguously (with g innermost they read with a stride of
    # g: 9.0 ms of the 32 x 1 vs 1024 f32 pass's 50.6, docs/serving.md). Both: _chunk_softmax.
    key_major = group >= ROW_VECTOR
    loops = (0, 1, 2, 3, 4, 5) if key_major else (0, 1, 2, 4, 5, 3)  # the loop dim of each of (i, c, h, p, s, g)
    _, c_, _, p_, s_, g_ = loops

    def mask_body(x, kv_len, qo_len, _out):
        c, row, p, s = (_index(x_) for x_ in (c_, g_, p_, s_))
        col = cache.logical_column(c, p, s)
        kv_len, qo_len = (arith_d.index_cast(index(), v) for v in (kv_len, qo_len))
        token = arith_d.divui(row, const_index(base.group_size))
        valid = mask.valid(Lengths(qo_len, kv_len, arith_d.subi(kv_len, qo_len)), lambda: token, col)
        return [arith_d.select(valid, scale(x), const_f32(float("-inf")))]

    lengths, query_lengths = _column(geometry, 0), _column(geometry, 3)
    layout = [score_sizes[loops.index(axis)] for axis in range(6)]
    # In a dispatch of its own: left to IREE 3.13, it went into the scores contraction's dispatch
    # (the 16-query pass on 31 entries of 1040 keys 63.8-69.9 -> 79.8 ms a call); before the chunk
    # softmax had its own tiles, fused with the max and exp2, it kept a chunk's masked row on the
    # stack, which a dynamic P cannot bound.
    scores = own_dispatch(lambda: generic(
        [raw, lengths, query_lengths], [empty(layout, f32())],
        [affine_map(6, loops), affine_map(6, (0,)), affine_map(6, (0,)), every], "pppppp",
        mask_body)[0], tensor_type([DYN, DYN, h, *((DYN, block, group) if key_major else (group, DYN, block))], f32()),
        layout)
    # The probabilities by key, [n, c, h, p, s, g]: probs x values reads a key's rows as one vector.
    chunk_max, probs, chunk_sum = _chunk_softmax(scores, key_major, block)

    # Passes of ROW_VECTOR or more rows without sinks divide each chunk's products by its sum in
    # the probs x values dispatch, so that a call of one chunk per entry skips the chunk merge (the
    # 16-query pass over 32 entries of 192 keys 17.2-19.0 -> 14.3-16.1 ms, docs/performance.md); in the
    # 1-query pass (4-row vectors) that division took probs x values 155 -> 429 us (8 x 1 vs 129).
    if key_major and sinks is None:
        normalised, in_dtype = _probs_times_values(spec, cache, probs, table, lengths, kept, chunk_sum)
        return _one_chunk_or_merged(spec, chunk_max, chunk_sum, normalised, in_dtype)
    weighted, = _probs_times_values(spec, cache, probs, table, lengths, kept)
    return merge_chunks(spec, chunk_max, chunk_sum, weighted, sinks, normalised=False)


def _chunk_softmax(scores, key_major: bool, block: int) -> tuple[ir.Value, ir.Value, ir.Value]:
    """(chunk_max [n, c, h, R], probs [n, c, h, p, s, R], chunk_sum [n, c, h, R]) of the masked
    scores, key-major [n, c, h, p, s, R] or row-major [n, c, h, R, p, s].

    Built on the scores as [N = n x c x h, K = p x s, R] (key-major) or [N, R, K] so that the
    tiling attached to the ops stays (IREE 3.13 collapses a 6-dim generic's dims and drops it).
    The exp2 op and the sum share a dispatch, their tiles the backend's (llvm-cpu: key-major, up
    to 64 rows of one key, the max the same; row-major, [R rows, 16 keys] that the exp2 op writes
    transposed as one vector: pipeline/cpu_tiles.py). Left to IREE, the three ran on 8-row vectors (key-major) or
    one scalar at a time (row-major): the 16-query pass's softmax 8.05 -> 5.10 ms on 31 entries
    of 1040 keys, the 1-query pass's 72 -> 14 us on 8 entries of 129 (docs/performance.md).
    """
    if key_major:
        n, c, h, p, s, rows = sizes_of(scores)
        flat = collapse(scores, [[0, 1, 2], [3, 4], [5]])  # [N, K, R]
        count, keys = dim(flat, 0), dim(flat, 1)
        role, tiles = "pass.softmax.key_major", dict(rows=rows)
    else:
        n, c, h, rows, p, s = sizes_of(scores)
        flat = collapse(scores, [[0, 1, 2], [3], [4, 5]])  # [N, R, K]
        count, keys = dim(flat, 0), dim(flat, 2)
        role, tiles = "pass.softmax.row_major", dict(rows=rows, block=block)
    # loops (N, R, K) in all three ops
    by_row, by_key = affine_map(3, (0, 1)), affine_map(3, (0, 2, 1))
    score_map = by_key if key_major else affine_map(3, (0, 1, 2))
    chunk_max = generic([flat], [fill(const_f32(NO_KEY_MAX), [count, rows], f32())], [score_map, by_row], "ppr",
                        lambda x, acc: [arith_d.maximumf(x, acc)])[0]
    if key_major:  # (row-major, IREE collapses its (N, R) and would drop it)
        mark_tiling(chunk_max, role, **tiles)

    def exp_and_sum():
        probs = generic([flat, chunk_max], [empty([count, keys, rows], f32())], [score_map, by_row, by_key], "ppp",
                        lambda x, m, _out: [math_d.exp2(arith_d.subf(x, m))])[0]
        chunk_sum = generic([probs], [fill(const_f32(0.0), [count, rows], f32())], [by_key, by_row], "ppr",
                            lambda x, acc: [arith_d.addf(x, acc)])[0]
        mark_tiling(chunk_sum, role, **tiles)
        return [probs, chunk_sum]

    probs, chunk_sum = own_dispatch_results(
        exp_and_sum, [tensor_type([DYN, DYN, rows], f32()), tensor_type([DYN, rows], f32())],
        [[count, keys, rows], [count, rows]])
    per_row = lambda x: expand(x, [[0, 1, 2], [3]], [n, c, h, rows])  # noqa: E731
    return per_row(chunk_max), expand(probs, [[0, 1, 2], [3, 4], [5]], [n, c, h, p, s, rows]), per_row(chunk_sum)


def _columns_per_load(d_v: int) -> int:
    """J: head-dim columns per key of one probs x values step (the largest divisor of d_v up to
    PV_COLUMNS), each its own accumulator."""
    return max(j for j in range(1, min(d_v, PV_COLUMNS) + 1) if d_v % j == 0)


def _probs_times_values(spec: DecodeSpec, cache: KvCache, probs, table, lengths, kept, chunk_sum=None):
    """``[weighted]``, weighted [n, c, h, R, d_v] = probs [n, c, h, p, s, R] x values, per chunk;
    given the chunks' sums ``chunk_sum`` [n, c, h, R], ``[weighted / sum in f32, the same in the
    dtype]`` instead (one tensor twice for f32): the division and cast join the op that
    interleaves the J outputs (as an op of their own, IREE fused them into the contraction's
    dispatch and the 1-query pass's probs x values took 155 -> 429 us on 8 x 1 vs 129 keys).

    Vectorised along the query rows: each value element is one broadcast load from the cache,
    multiplied into a vector of up to ROW_VECTOR rows' probabilities. Head-dim columns go in J
    outputs (column dd * J + j in output j; loops (i, c, h, dd, r, p, s)), so that a key's step
    updates J independent accumulators. Along the head dim instead, IREE 3.13 reads the value rows
    as gathers: its vectoriser takes a page-table read as a contiguous load only along the
    innermost loop, and it moves the key loops (reductions) innermost.
    """
    base = spec.base
    h, group, d_v = base.h_kv, spec.rows, spec.d_v
    entries, chunks = sizes_of(probs)[:2]
    columns = _columns_per_load(d_v)
    outer = d_v // columns

    def body(prob, table_value, kv_len, *accs):
        i, c, hh, dd, p, s = (_index(x) for x in (0, 1, 2, 3, 5, 6))
        # rows past kv_len weigh 0, but 0 * NaN is NaN: a cache's unused rows may hold anything
        keep = lt(cache.logical_column(c, p, s), arith_d.index_cast(index(), kv_len))
        updated = []
        for j, acc in enumerate(accs):
            value = cache.element(1, i, c, p, s, hh, arith_d.addi(arith_d.muli(dd, const_index(columns)), const_index(j)))
            updated.append(arith_d.addf(acc, kept(table_value, arith_d.select(keep, arith_d.mulf(prob, value),
                                                                               const_f32(0.0)))))
        return updated

    out_sizes = [entries, chunks, h, group, outer]
    results = generic(
        [probs, table, lengths], [fill(const_f32(0.0), out_sizes, f32()) for _ in range(columns)],
        [affine_map(7, (0, 1, 2, 5, 6, 4)), affine_map(7, (0, 1, 5)), affine_map(7, (0,))]
        + [affine_map(7, (0, 1, 2, 4, 3))] * columns, "pppppr" + "r", body)
    results = mark_tiling(results[0], "pass.probs_values", drop_unit_loops=True, outer=outer, group=group)
    dt = element_type(spec.dtype)

    # The J outputs interleaved by one elementwise op (as J inserted slices, J strided copies).
    def interleaved(*args):
        j = _index(5)
        value = args[0]
        for column in range(1, columns):
            value = arith_d.select(arith_d.cmpi(arith_d.CmpIPredicate.eq, j, const_index(column)), args[column], value)
        if chunk_sum is None:
            return [value]
        row_sum = args[columns]
        value = arith_d.select(_no_key(row_sum), const_f32(0.0), arith_d.divf(value, row_sum))
        return [value] + ([] if isinstance(dt, ir.F32Type) else [arith_d.truncf(dt, value)])

    sizes = [entries, chunks, h, group, outer, columns]
    if chunk_sum is None:
        inputs, outputs = results, [empty(sizes, f32())]
    else:
        inputs = [*results, chunk_sum]
        outputs = [empty(sizes, f32())] + ([] if isinstance(dt, ir.F32Type) else [empty(sizes, dt)])
    maps = [affine_map(6, range(5))] * columns + [affine_map(6, range(4))] * (len(inputs) - columns)
    stacked = generic(inputs, outputs, maps + [affine_map(6, range(6))] * len(outputs), "pppppp", interleaved)
    merged = [collapse(x, [[0], [1], [2], [3], [4, 5]]) for x in stacked]
    return merged if chunk_sum is None else [merged[0], merged[-1]]


def _column(geometry: ir.Value, column: int) -> ir.Value:
    """geometry[:, column] as an [n] i32 tensor."""
    entries = dim(geometry, 0)

    def body(_out):
        return [tensor_d.extract(geometry, [_index(0), const_index(column)])]

    return generic([], [empty([entries], i32())], [affine_map(1, (0,))], "p", body)[0]


def _one_chunk_or_merged(spec: DecodeSpec, chunk_max, chunk_sum, normalised, in_dtype) -> list[ir.Value]:
    """Output [n, h, R, d_v] (dtype) and lse [n, h, R] from each chunk's max and sum and its probs
    x values divided by its sum, ``normalised`` [n, c, h, R, d_v] f32 (``in_dtype`` the same in
    the dtype): a call of one chunk per entry returns them as they are, a host-side ``scf.if`` on
    the chunk count skipping the merge (:func:`merge_chunks`)."""
    h, group, d_v = spec.base.h_kv, spec.rows, spec.d_v
    entries, chunks = dim(chunk_max, 0), dim(chunk_max, 1)
    one_chunk = arith_d.cmpi(arith_d.CmpIPredicate.eq, chunks, const_index(1))
    branch = scf_d.IfOp(one_chunk, [tensor_type([DYN, h, group, d_v], element_type(spec.dtype)),
                                    tensor_type([DYN, h, group], f32())], has_else=True)
    with ir.InsertionPoint(branch.then_block):  # [n, 1, ...] -> [n, ...]: a reshape, no copy
        first = lambda x: collapse(x, [[0, 1], *([axis] for axis in range(2, len(sizes_of(x))))])  # noqa: E731
        scf_d.YieldOp([first(in_dtype), _lse(first(chunk_max), first(chunk_sum))])
    with ir.InsertionPoint(branch.else_block):
        scf_d.YieldOp(merge_chunks(spec, chunk_max, chunk_sum, normalised, None, normalised=True))
    return [tie_dims(branch.results[0], [entries, h, group, d_v]), tie_dims(branch.results[1], [entries, h, group])]


def _no_key(row_sum: ir.Value) -> ir.Value:
    """Whether a row saw no key (its sum is 0)."""
    return arith_d.cmpf(arith_d.CmpFPredicate.OEQ, row_sum, const_f32(0.0))


def _lse(row_max, row_sum) -> ir.Value:
    """lse [n, h, R] = max + log2(sum) from f32 [n, h, R] tensors; EMPTY_ROW_LSE for a row with no key."""
    return generic([row_max, row_sum], [empty(sizes_of(row_max), f32())], [affine_map(3, range(3))] * 3, "ppp",
                   lambda m, s, _out: [arith_d.select(_no_key(s), const_f32(EMPTY_ROW_LSE),
                                                      arith_d.addf(m, math_d.log2(s)))])[0]


def merge_chunks(spec: DecodeSpec, chunk_max, chunk_sum, products, sinks, normalised: bool) -> list[ir.Value]:
    """The chunks' ``products`` [n, c, h, R, d_v] merged by their maxima, reduced one chunk at a
    time (reduction tile 1). ``normalised`` products are each chunk's divided by its sum
    (:func:`_probs_times_values`) and weigh s_c 2^(max_c - max) / total: an entry's one real chunk
    among padded ones weighs 1 exactly, so its rows have the same bits as in a call of one chunk
    (:func:`_one_chunk_or_merged`). Otherwise they are the raw sums, weigh 2^(max_c - max), and
    are divided by the total at the end, where the heads' ``sinks`` [h_q] f32 (semantics §13), or
    None, join the denominator."""
    base = spec.base
    h, group, d_v = base.h_kv, spec.rows, spec.d_v
    entries = dim(chunk_max, 0)
    rows = [entries, h, group]
    over_chunks = affine_map(4, (0, 3, 1, 2))  # loops (i, h, g, c)
    row_max = generic([chunk_max], [fill(const_f32(NO_KEY_MAX), rows, f32())], [over_chunks, affine_map(4, (0, 1, 2))],
                      "pppr", lambda x, acc: [arith_d.maximumf(x, acc)])[0]
    mark_tiling(row_max, "pass.merge.rows", group=group)
    # Each chunk's weight 2^(max_c - max) is computed inside the two reductions: as an op of its
    # own, IREE fused it with them into dispatches that failed to compile for small heads
    # ("exceeded stack allocation limit", a buffer sized by the chunk count).
    def weight(chunk_max_value, row_max_value):
        return math_d.exp2(arith_d.subf(chunk_max_value, row_max_value))

    total = generic([chunk_sum, chunk_max, row_max], [fill(const_f32(0.0), rows, f32())],
                    [over_chunks, over_chunks, affine_map(4, (0, 1, 2)), affine_map(4, (0, 1, 2))], "pppr",
                    lambda s, m, top, acc: [arith_d.addf(acc, arith_d.mulf(s, weight(m, top)))])[0]
    mark_tiling(total, "pass.merge.rows", group=group)
    zero, dt = const_f32(0.0), element_type(spec.dtype)
    by_chunk, by_row = affine_map(5, (0, 4, 1, 2)), affine_map(5, (0, 1, 2))
    if normalised:
        def merged(x, m, top, s, all_sum, acc_):
            share = arith_d.divf(arith_d.mulf(s, weight(m, top)), all_sum)
            return [arith_d.addf(acc_, arith_d.mulf(x, arith_d.select(_no_key(all_sum), zero, share)))]

        inputs, maps = [products, chunk_max, row_max, chunk_sum, total], [by_chunk, by_row, by_chunk, by_row]
    else:
        def merged(x, m, top, acc_):
            return [arith_d.addf(acc_, arith_d.mulf(x, weight(m, top)))]

        inputs, maps = [products, chunk_max, row_max], [by_chunk, by_row]
    acc = generic(inputs, [fill(const_f32(0.0), [*rows, d_v], f32())],
                  [affine_map(5, (0, 4, 1, 2, 3)), *maps, affine_map(5, (0, 1, 2, 3))], "ppppr", merged)[0]
    mark_tiling(acc, "pass.merge.values", group=group, d_v=d_v)
    if sinks is not None:
        return _with_sinks(spec, acc, row_max, total, sinks)

    def output(a, s, _out):
        value = a if normalised else arith_d.select(_no_key(s), zero, arith_d.divf(a, s))
        return [value if isinstance(dt, ir.F32Type) else arith_d.truncf(dt, value)]

    out = generic([acc, total], [empty([*rows, d_v], dt)],
                  [affine_map(4, range(4)), affine_map(4, (0, 1, 2)), affine_map(4, range(4))], "pppp", output)[0]
    return [out, _lse(row_max, total)]


def _with_sinks(spec: DecodeSpec, acc, row_max, total, sinks) -> list[ir.Value]:
    """The output [n, h, R, d_v] (dtype) and lse [n, h, R] of :func:`merge_chunks` with each row's
    sink in the denominator (online_softmax.sink_normalised, sink_lse), in f32 before the cast."""
    base, dt = spec.base, element_type(spec.dtype)
    rows = sizes_of(row_max)
    by_row = row_sinks(sinks, base.h_kv, base.group_size, spec.queries)  # [h, R]
    zero, empty_lse = const_f32(0.0), const_f32(EMPTY_ROW_LSE)

    def normalised(a, m, s, k, _out):
        value = sink_normalised(a, m, s, k, zero)
        return [value if isinstance(dt, ir.F32Type) else arith_d.truncf(dt, value)]

    row = affine_map(4, (0, 1, 2))
    output = generic([acc, row_max, total, by_row], [empty([*rows, spec.d_v], dt)],
                     [affine_map(4, range(4)), row, row, affine_map(4, (1, 2)), affine_map(4, range(4))], "pppp",
                     normalised)[0]
    lse = generic([row_max, total, by_row], [empty(rows, f32())],
                  [affine_map(3, range(3))] * 2 + [affine_map(3, (1, 2)), affine_map(3, range(3))], "ppp",
                  lambda m, s, k, _out: [sink_lse(m, s, k, zero, empty_lse)])[0]
    return [output, lse]
