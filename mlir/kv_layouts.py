"""Where a variant's keys and values live, as one object per layout: the IR half (how the kernels
read a row). The host half (lengths, serving-pass tables, examples, the error model and the
reference) is ``runtime/kv_layouts.py``, one class per layout under the same ``name``.

* ``dense`` (k, v [B, Lk, h_kv, d]): read by the dense kernels themselves (sequence.py,
  fused_kernels.py), so it has no hook here.
* ``ragged`` (k [N, h_kv, d_qk], v [N, h_kv, d_v], entry b's rows by kv_indptr), and
  ``ragged_hnd`` (k [h_kv, N, d_qk], v [h_kv, N, d_v]: head-major, as DynamicCache holds a row).
* ``paged`` (pages [P, 2, h_kv, page_size, d] through the page table, paging.py), and
  ``paged_nhd`` (pages [P, 2, page_size, h_kv, d], FlashInfer's NHD and transformers' cache).
* ``latent`` (MLA: pages [P, page_size, d_qk] through the page table, a key row whose first
  d_v columns are its value, one shared KV head).

A KV-cache layout (:class:`CacheLayout`) reads its rows for each lowering: the linalg entry
loader (``entry_loader``, kv_cache.py), the fused lowering's batch-wide source (``batch_kv``,
fused_kernels.py) and the serving passes' element read (``element``, decode.py and
fused_decode.py), plus the passes' ``block``, ``kv_bytes_per_key`` and ``vectorise_rows``.
Each hook takes the call's arguments it reads by their ABI name (mlir/abi.py). A new layout
is a subclass defining every abstract hook, registered in :data:`LAYOUTS` under its name
(tests/test_kv_layouts.py checks both halves).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from .amx import as_i64
from .dtypes import ir_dtype, kv_dtype_of
from .ir import (
    DYN, HostReadable, affine_map, arith_d, const_index, const_int, dim, element_type, empty, extract_slice, f32, fill,
    generic, ir, linalg_d, lt, narrowed, scf_d, sizes_of, storage_tiles, tensor_d, tensor_type, tie_dims, widened,
)
from .paging import clamped_page, gather_rows, index_at, page_bounds, page_table, physical_row, read_element

#: Rows of a ragged entry per serving-pass table entry (the ragged cache has no pages).
RAGGED_BLOCK = 16


@dataclass(frozen=True)
class EntryKv:
    """One batch entry's KV as a linalg loader returns it.

    ``load_keys()`` and ``load_values()`` build keys [kv_pad, h_kv, d_qk] and values
    [kv_pad, h_kv, d_v] where they are called (inside each RoPE branch, see
    kv_cache.``then_rotated_if``), token-major, with ``kv_pad = storage_tiles(kv_len, kv_tile) *
    kv_tile``; rows at or past ``kv_len`` may hold anything finite or not (they are zeroed before
    use). ``rope_offset`` is the i32 RoPE position of row 0, or None for variants without RoPE.
    """

    kv_len: ir.Value
    load_keys: Callable[[], ir.Value]
    load_values: Callable[[], ir.Value]
    rope_offset: ir.Value | None = None


#: The scalar of entry e's logical row r (r < kv_len(e)) at out_indices (head, column).
RowSource = Callable[[ir.Value, ir.Value, list], ir.Value]
#: Reads an element of an index array as an index: in a generic (tensor.extract) or on the host.
Reader = Callable[[object, list], ir.Value]


def device_read(array: HostReadable, indices: list) -> ir.Value:
    """An element of a host-readable index array, read where the code runs (in a generic)."""
    return read_element(array.tensor, indices)


def host_read(array: HostReadable, indices: list) -> ir.Value:
    """An element of a host-readable index array, read on the host."""
    return array.load(indices)


@dataclass(frozen=True)
class BatchKv:
    """Every entry's KV as the fused lowering's batch-wide layout reads it (fused_kernels.py).

    ``base(read, b)`` is the first storage row of entry ``b`` (its tiles start at ``base // TILE
    + b``) and ``kv_len(read, b)`` its length, for ``b`` in [0, B) (``base`` also at B), read on
    the host (:func:`host_read`) or in a generic (:func:`device_read`). ``keys`` and ``values``
    fetch one scalar of a row inside a generic; ``rope_offset`` is the [B] i32 RoPE position of
    each entry's row 0, or None. ``sources`` are the tensors holding the rows, and
    ``row_offset(which, e, r, head)`` (inside a generic, ``r`` < kv_len) is (the index of a source,
    the i64 element offset in it, the tensor viewed flat) of K (``which`` 0) or V (1) of head
    ``head`` at entry ``e``'s row ``r``: the x86 kernels' row gather (x86_kv_cache.py), addressed as
    the serving passes address rows (:meth:`CacheLayout.row_offset`).
    """

    batch: ir.Value
    base: Callable[[Reader, ir.Value], ir.Value]
    kv_len: Callable[[Reader, ir.Value], ir.Value]
    keys: RowSource
    values: RowSource
    heads: int
    d_qk: int
    d_v: int
    rope_offset: ir.Value | None
    sources: tuple[ir.Value, ...]
    row_offset: Callable[[int, ir.Value, ir.Value, ir.Value], tuple[int, ir.Value]]

    @staticmethod
    def row_or_zero(source: RowSource, e: ir.Value, row: ir.Value, rest: Callable[[], list], kv_len: ir.Value,
                    elem: ir.Type) -> ir.Value:
        """``source``'s (keys' or values') element ``rest()`` of entry ``e``'s row ``row``, inside a
        generic: the row read clamped into [0, kv_len) (nothing out of bounds), 0 at or past
        ``kv_len`` (nothing another entry holds, NaN included, reaches this one)."""
        clamped = arith_d.maxsi(arith_d.minsi(row, arith_d.subi(kv_len, const_index(1))), const_index(0))
        value = source(e, clamped, rest())
        return arith_d.select(lt(row, kv_len), value, arith_d.constant(elem, 0.0))


class KvLayout:
    """A layout: ``name`` is how specs, the host half and the artifacts' facts spell it.
    Creating one checks that its class sets every attribute of ``required`` (and, for an ABC,
    defines every abstract hook)."""

    name: str
    required: tuple[str, ...] = ("name",)
    #: The scales of an 8-bit cache (a spec with ``kv_dtype``: mlir/abi.py KV_SCALES) that the
    #: loaders take when the call has them; ``one_scale``: the keys and values are the same
    #: elements, so an 8-bit cache has one scale (k_scale and v_scale equal).
    optional_operands: tuple[str, ...] = ()
    one_scale: bool = False

    def __init__(self):
        missing = [attribute for attribute in self.required if not hasattr(self, attribute)]
        if missing:
            raise TypeError(f"{type(self).__name__} must set {', '.join(missing)}")


class DenseLayout(KvLayout):
    """k, v [B, Lk, h_kv, d]: the dense kernels index them directly, storing them once per call as
    tiles of their lowering's shape (:meth:`stored`)."""

    name = "dense"

    @staticmethod
    def stored(x: ir.Value, length: ir.Value, sizes: list, source: Callable, scales: ir.Value | None,
               dt: ir.Type, elem: ir.Type) -> ir.Value:
        """A tensor of ``sizes`` in ``elem`` whose element at loop indices I is x[b, row, h, j] for
        (b, h, row, j) = ``source(I)``, zero where row >= ``length`` (x's L): an 8-bit ``x`` read
        through its KV head's ``scales`` into the compute dtype ``dt`` (:func:`dequantized`), then
        widened to ``elem`` where that differs. One generic that reads ``x`` itself, its row clamped
        to L - 1, rather than a copy of a zero-padded x; a zero fill when L == 0 (no row to read)."""
        zero = arith_d.constant(elem, 0.0)
        result_type = tensor_type([DYN if isinstance(size, ir.Value) else size for size in sizes], elem)
        branch = scf_d.IfOp(lt(const_index(0), length), [result_type], has_else=True)
        with ir.InsertionPoint(branch.then_block):
            last_row = arith_d.subi(length, const_index(1))

            def body(_out):
                b, h, row, j = source([linalg_d.IndexOp(i).result for i in range(len(sizes))])
                value = dequantized(tensor_d.extract(x, [b, arith_d.minsi(row, last_row), h, j]), scales, h, dt)
                value = value if value.type == elem else widened(value)
                return [arith_d.select(lt(row, length), value, zero)]

            loops = len(sizes)
            scf_d.YieldOp([generic([], [empty(sizes, elem)], [affine_map(loops, range(loops))], "p" * loops, body)[0]])
        with ir.InsertionPoint(branch.else_block):
            scf_d.YieldOp([fill(zero, sizes, elem)])
        return tie_dims(branch.results[0], sizes)


class CacheLayout(KvLayout, ABC):
    """A KV-cache layout: how each lowering reads an entry's rows."""

    required = ("name", "operands", "host_readable", "vectorise_rows")
    #: The call's arguments the layout reads, by ABI name (mlir/abi.py): what its entry_loader and
    #: batch_kv take.
    operands: tuple[str, ...]
    #: The layout's index arguments the fused kernels read on the host (ir.HostReadable).
    host_readable: tuple[str, ...]
    #: Whether a serving pass with many query rows may vectorise its scores along them, where the
    #: CPU's pass vectors do (decode.PassVectors.rows_from).
    vectorise_rows: bool

    @abstractmethod
    def entry_loader(self, spec, **arguments) -> Callable[[ir.Value], EntryKv]:
        """The linalg lowering's loader: entry ``b`` -> its :class:`EntryKv` (kv_cache.py)."""

    @abstractmethod
    def batch_kv(self, spec, **arguments) -> BatchKv:
        """The fused lowering's source of every entry's rows; the ``host_readable`` arguments
        arrive as buffer views."""

    @abstractmethod
    def element(self, spec, cache, which: int, entry, logical_block, column: Callable[[], ir.Value], slot, head,
                col) -> ir.Value:
        """A serving pass's K (``which`` 0) or V (1) element, in the cache's dtype: column ``col``
        of head ``head`` at slot ``slot`` of the entry's logical block ``logical_block``
        (``column()`` builds its logical row); ``cache`` is the pass's decode.KvCache (its
        ``sources``, ``table`` and ``geometry``), ``spec`` the pass's DecodeSpec."""

    @abstractmethod
    def block(self, spec) -> int:
        """Logical KV rows per serving-pass table entry of the variant ``spec``."""

    @abstractmethod
    def kv_bytes_per_key(self, spec) -> int:
        """Bytes of K/V one key's cache row holds for the variant ``spec``."""

    #: The axis of the layout's first source whose extent :meth:`row_offset` clamps into (rows or
    #: pages); None: the layout has no x86 serving pass.
    extent_axis: int | None = None

    def row_offset(self, spec, which: int, table_value: ir.Value, slot: ir.Value, head: ir.Value,
                   extent: ir.Value) -> tuple[int, ir.Value]:
        """The x86 serving pass's row address (mlir/x86_decode.py): (the index of the source among
        the pass's KV sources, the element offset in it) of head ``head``'s K (``which`` 0) or V
        (1) row at slot ``slot`` of the table entry ``table_value``; ``extent`` is the source's
        size along ``extent_axis``, into which a row or page is clamped. All i64 Values."""
        raise NotImplementedError(f"layout {self.name} has no x86 serving pass")


def _i64_ops(like: ir.Value):
    """(constant, clamp) helpers in ``like``'s integer type: ``c(n)``, ``clamp(x, last)`` into [0, last]."""
    def c(n: int) -> ir.Value:
        return arith_d.constant(like.type, n)

    def clamp(x: ir.Value, last: ir.Value) -> ir.Value:
        return arith_d.maxsi(arith_d.minsi(x, last), c(0))

    return c, clamp


def _itemsize(dtype: str) -> int:
    return ir_dtype(dtype).itemsize


def dequantized(value: ir.Value, scales: ir.Value | None, head: ir.Value, elem: ir.Type) -> ir.Value:
    """An element of an 8-bit KV cache read through its KV head's scale, in the compute dtype
    ``elem``: ``elem(f32(x) * scales[head])`` (semantics §15, the reference's dequantisation);
    ``scales`` None (a cache in the compute dtype): ``value`` as it is."""
    if scales is None:
        return value
    scaled = _widened_8_bit(value, tensor_d.extract(scales, [head]))
    return narrowed(elem, _bf16_rounded(scaled) if isinstance(elem, ir.BF16Type) else scaled)


#: Per 8-bit format (its dtype name): (mantissa bits, exponent bias). The fnuz formats (gfx942's)
#: have one more bias and no negative zero; their NaN pattern 0x80 reads as a zero, as other NaN
#: patterns read finite (quantize_pages saturates, so none is stored).
EIGHT_BIT_FORMATS = {"float8_e4m3fn": (3, 7), "float8_e5m2": (2, 15), "float8_e4m3fnuz": (3, 8),
                     "float8_e5m2fnuz": (2, 16)}
#: The formats whose bits move into a float16's as they are (:func:`f16_bits`): every exponent
#: field of theirs is a finite f16 exponent, or (e5m2) means what it means in f16.
THROUGH_F16 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz")


def f16_bits(byte: ir.Value, kv_dtype: str) -> ir.Value:
    """The float16 bits (i16, or a vector of them for a vector of bytes) whose value is the 8-bit
    float ``byte`` (i8) of format ``kv_dtype`` (one of THROUGH_F16) times 2^(bias - 15): its
    exponent and mantissa bits moved into the float16's fields as they are, its sign to the
    f16's (a shift of e5m2's byte, a shift and a mask of e4m3's sign-extended one: 1-9% faster
    paged serving steps than moving sign and fields apart). The serving passes' scalar widening
    (:func:`_widened_8_bit`) and the x86 passes' vector one (mlir/x86_decode.py) share it."""
    mantissa, _ = EIGHT_BIT_FORMATS[kv_dtype]
    i16 = ir.IntegerType.get_signless(16)
    halves = ir.VectorType.get(ir.VectorType(byte.type).shape, i16) if isinstance(byte.type, ir.VectorType) else i16
    shift = 10 - mantissa
    if shift == 8:  # e5m2: x is a float16's high byte
        return arith_d.shli(arith_d.extui(halves, byte), const_int(halves, 8))
    # the sign extension carries x's sign to bit 15; the mask keeps it and the 7 field bits
    return arith_d.andi(arith_d.shli(arith_d.extsi(halves, byte), const_int(halves, shift)),
                        const_int(halves, -0x8000 | 0x7F << shift))


def _format_of(x: ir.Value) -> str:
    """The 8-bit format (dtype name) of ``x``'s element type, in an open context."""
    return next(name for name in EIGHT_BIT_FORMATS if ir_dtype(name).element_type() == x.type)


def _widened_8_bit(x: ir.Value, scale: ir.Value) -> ir.Value:
    """f32(x) * scale for an 8-bit float ``x``, in integer ops IREE vectorises (its own extf from
    f8 runs element by element: the 8-bit serving step 2x slower than the bf16 one).

    e4m3fn, e4m3fnuz and e5m2: x's exponent and mantissa bits move into a float16's fields as
    they are (:func:`f16_bits`), which the CPU widens to f32 in one instruction, subnormals
    included; the f16 is then x times 2^(bias - 15), so it is scaled by 2^(15 - bias), exactly.
    e5m2's inf and NaN patterns stay inf and NaN; e4m3's top patterns read finite (448 for
    e4m3fn's largest, 480 for its NaN pattern). e5m2fnuz, whose top exponent is finite: a normal
    x's fields move into an f32's, the exponent rebiased; a subnormal x (exponent bits 0: the CPU
    flushes f32 subnormals, so not through the same move) is its mantissa times 2^(1 - bias -
    mantissa bits); then the sign."""
    name = _format_of(x)
    mantissa, bias = EIGHT_BIT_FORMATS[name]
    if name in THROUGH_F16:
        half = f16_bits(arith_d.bitcast(ir.IntegerType.get_signless(8), x), name)
        value = arith_d.extf(f32(), arith_d.bitcast(ir.F16Type.get(), half))
        if bias != 15:
            value = arith_d.mulf(value, arith_d.constant(f32(), 2.0 ** (15 - bias)))
        return arith_d.mulf(value, scale)
    i32 = ir.IntegerType.get_signless(32)

    def c(value: int) -> ir.Value:
        return arith_d.constant(i32, value)

    bits = arith_d.extui(i32, arith_d.bitcast(ir.IntegerType.get_signless(8), x))
    low = arith_d.andi(bits, c(0x7F))
    normal = arith_d.bitcast(f32(), arith_d.addi(arith_d.shli(low, c(23 - mantissa)), c((127 - bias) << 23)))
    subnormal = arith_d.mulf(arith_d.sitofp(f32(), low), arith_d.constant(f32(), 2.0 ** (1 - bias - mantissa)))
    magnitude = arith_d.select(arith_d.cmpi(arith_d.CmpIPredicate.ult, low, c(1 << mantissa)), subnormal, normal)
    sign = arith_d.shli(arith_d.andi(bits, c(0x80)), c(24))
    value = arith_d.bitcast(f32(), arith_d.ori(arith_d.bitcast(i32, magnitude), sign))
    return arith_d.mulf(value, scale)


def _bf16_rounded(x: ir.Value) -> ir.Value:
    """f32 ``x`` rounded to the nearest bfloat16 (ties to even), still as f32, in integer ops: IREE
    3.13 drops a truncf to bf16 whose value is widened straight back (a serving pass reads each
    element in f32), and the rounding is part of the element's value (semantics §15)."""
    i32 = ir.IntegerType.get_signless(32)
    bits = arith_d.bitcast(i32, x)
    lsb = arith_d.andi(arith_d.shrui(bits, arith_d.constant(i32, 16)), arith_d.constant(i32, 1))
    rounded = arith_d.addi(bits, arith_d.addi(arith_d.constant(i32, 0x7FFF), lsb))
    return arith_d.bitcast(x.type, arith_d.andi(rounded, arith_d.constant(i32, -0x10000)))


# ---- ragged


def _with_a_row(x: ir.Value, axis: int) -> ir.Value:
    """``x`` with N rows along ``axis``, or one zero row in their place when N == 0, so that a row
    index clamped into [0, rows - 1] always reads inside it. No copy when N > 0."""
    sizes = sizes_of(x)
    branch = scf_d.IfOp(lt(sizes[axis], const_index(1)), [x.type], has_else=True)
    with ir.InsertionPoint(branch.then_block):
        elem = ir.RankedTensorType(x.type).element_type
        zero = arith_d.constant(elem, 0.0)
        scf_d.YieldOp([fill(zero, [const_index(1) if i == axis else size for i, size in enumerate(sizes)], elem)])
    with ir.InsertionPoint(branch.else_block):
        scf_d.YieldOp([x])
    return tie_dims(branch.results[0], [arith_d.maxsi(size, const_index(1)) if i == axis else size
                                        for i, size in enumerate(sizes)])


class RaggedLayout(CacheLayout):
    """Entry b's KV is rows [kv_indptr[b], kv_indptr[b + 1]) of k [Lk, h_kv, d_qk] and v [Lk,
    h_kv, d_v] (token-major, ``kv_order="nhd"``)."""

    name = "ragged"
    operands = ("k", "v", "kv_indptr", "k_rope_pos_offset")
    optional_operands = ("k_scale", "v_scale")
    host_readable = ("kv_indptr",)
    vectorise_rows = True
    #: The axis of k and v their rows are along, and their dims (mlir/abi.py).
    row_axis = 0
    key_dims = ("Lk", "h_kv", "d_qk")
    value_dims = ("Lk", "h_kv", "d_v")

    def _at(self, x: ir.Value, row, head, col) -> ir.Value:
        """The element of k or v at ``row``, ``head``, ``col``."""
        return tensor_d.extract(x, [row, head, col])

    def _entry_rows(self, x: ir.Value, start: ir.Value, rows: ir.Value, scales: ir.Value | None,
                    elem: ir.Type) -> ir.Value:
        """Rows [start, start + rows) of ``x`` (N >= 1 rows), token-major [rows, h_kv, d] in
        ``elem`` (an 8-bit ``x`` widened through ``scales`` [h_kv] as gathered: ``dequantized``),
        each index clamped into [0, N - 1]: the rows past the entry read its neighbour's (or the
        last) rows, never out of bounds, and the caller zeroes them. One gather generic: before, K
        and V were each zero-padded (a fill and a copy of the whole tensor) and then sliced (a
        second copy per entry)."""
        sizes = sizes_of(x)
        last = arith_d.subi(sizes[self.row_axis], const_index(1))
        heads, cols = (size for i, size in enumerate(sizes) if i != self.row_axis)

        def body(_out):
            row = arith_d.minsi(arith_d.addi(start, linalg_d.IndexOp(0).result), last)
            head = linalg_d.IndexOp(1).result
            return [dequantized(self._at(x, row, head, linalg_d.IndexOp(2).result), scales, head, elem)]

        out = empty([rows, heads, cols], elem)
        return generic([], [out], [affine_map(3, range(3))], "ppp", body)[0]

    def entry_loader(self, spec, *, k, v, kv_indptr, k_rope_pos_offset, k_scale=None, v_scale=None):
        k_rows, v_rows = _with_a_row(k, self.row_axis), _with_a_row(v, self.row_axis)
        elem = element_type(spec.dtype)

        def load(b: ir.Value) -> EntryKv:
            start = index_at(kv_indptr, b)
            kv_len = arith_d.subi(index_at(kv_indptr, arith_d.addi(b, const_index(1))), start)
            kv_pad = arith_d.muli(storage_tiles(kv_len, spec.kv_tile), const_index(spec.kv_tile))
            return EntryKv(
                kv_len=kv_len,
                load_keys=lambda: self._entry_rows(k_rows, start, kv_pad, k_scale, elem),
                load_values=lambda: self._entry_rows(v_rows, start, kv_pad, v_scale, elem),
                rope_offset=tensor_d.extract(k_rope_pos_offset, [b]),
            )

        return load

    def batch_kv(self, spec, *, k, v, kv_indptr, k_rope_pos_offset, k_scale=None, v_scale=None) -> BatchKv:
        kv_indptr = HostReadable(kv_indptr, 1, "kv_indptr")
        elem = element_type(spec.dtype)
        last = arith_d.subi(kv_indptr.dims[0], const_index(1))

        def start(read, b):
            return read(kv_indptr, [arith_d.minsi(b, last)])

        def kv_len(read, b):
            return arith_d.subi(start(read, arith_d.addi(b, const_index(1))), start(read, b))

        def rows_of(x, scales):
            last_row = arith_d.maxsi(arith_d.subi(dim(x, self.row_axis), const_index(1)), const_index(0))
            return lambda e, r, rest: dequantized(self._at(
                x, arith_d.minsi(arith_d.addi(start(device_read, e), r), last_row), *rest), scales, rest[0], elem)

        def row_offset(which, e, r, head):
            row = as_i64(arith_d.addi(start(device_read, e), r))
            slot, head = as_i64(const_index(0)), as_i64(head)   # a ragged row is its own table entry
            return self.row_offset(spec, which, row, slot, head, as_i64(dim(k, self.row_axis)))

        return BatchKv(last, start, kv_len, rows_of(k, k_scale), rows_of(v, v_scale), spec.h_kv, spec.d_qk, spec.d_v,
                       k_rope_pos_offset, (k, v), row_offset)

    def element(self, spec, cache, which, entry, logical_block, column, slot, head, col):
        source = cache.sources[which]
        row = arith_d.addi(read_element(cache.table, [entry, logical_block]), slot)
        row = arith_d.maxsi(arith_d.minsi(row, arith_d.subi(dim(source, self.row_axis), const_index(1))),
                            const_index(0))
        return self._at(source, row, head, col)

    def block(self, spec) -> int:
        return RAGGED_BLOCK

    @property
    def extent_axis(self) -> int:
        return self.row_axis

    def row_offset(self, spec, which, table_value, slot, head, extent):
        c, clamp = _i64_ops(table_value)
        row = clamp(arith_d.addi(table_value, slot), arith_d.subi(extent, c(1)))
        return which, arith_d.muli(self._flat_row(spec, row, head, extent), c(spec.d_qk if which == 0 else spec.d_v))

    def _flat_row(self, spec, row, head, rows):
        """The row's index in k or v viewed as [rows x h_kv, d] (token-major)."""
        return arith_d.addi(arith_d.muli(row, arith_d.constant(row.type, spec.h_kv)), head)

    def kv_bytes_per_key(self, spec) -> int:
        return spec.h_kv * (spec.d_qk + spec.d_v) * _itemsize(kv_dtype_of(spec))


class RaggedHndLayout(RaggedLayout):
    """Entry b's KV is rows [kv_indptr[b], kv_indptr[b + 1]) of k [h_kv, Lk, d_qk] and v [h_kv,
    Lk, d_v] (head-major, ``kv_order="hnd"``): transformers' DynamicCache holds a batch row's keys
    so (``[B, h_kv, S, d]``), and the hf adapter passes row b as it lies."""

    name = "ragged_hnd"
    row_axis = 1
    key_dims = ("h_kv", "Lk", "d_qk")
    value_dims = ("h_kv", "Lk", "d_v")

    def _at(self, x: ir.Value, row, head, col) -> ir.Value:
        return tensor_d.extract(x, [head, row, col])

    def _flat_row(self, spec, row, head, rows):
        return arith_d.addi(arith_d.muli(head, rows), row)


# ---- paged and latent: rows through the page table (paging.py)


def _paged_geometry(spec, page_indptr: HostReadable, length_info: HostReadable):
    """(base, kv_len, table) of the paged layouts in the fused lowering: an entry's storage is its
    pages (twice that with a sliding window, whose sinks may repeat rows: kv_len <= 2 * physical
    rows), its length the page table's (paging.page_table)."""
    rows_per_page = spec.page_size * (2 if spec.sliding_window else 1)
    last = arith_d.subi(page_indptr.dims[0], const_index(1))

    def base(read, b):
        return arith_d.muli(read(page_indptr, [arith_d.minsi(b, last)]), const_index(rows_per_page))

    def table(read, b):
        last_entry = arith_d.maxsi(arith_d.subi(last, const_index(1)), const_index(0))
        return page_table(spec, arith_d.minsi(b, last_entry), page_indptr, length_info, read=read)

    return base, lambda read, b: table(read, b).kv_len, table


def _paged_source(spec, table, page_values, fetch) -> RowSource:
    """RowSource reading logical row r of entry e through the page table and ``fetch(page, slot,
    rest)`` (page ids clamped into range)."""

    def source(e, r, rest):
        entry = table(device_read, e)
        page, slot = physical_row(spec, entry, page_values, r, page_bounds(entry, page_values))
        return fetch(page, slot, rest)

    return source


def _length_info_rank(spec) -> int:
    return 2 if spec.sliding_window else 1


class _PageTableLayout(CacheLayout, ABC):
    """Rows through the page table (page_indptr, page_values, length_info); a serving-pass table
    entry is a page."""

    host_readable = ("page_indptr", "length_info")

    def _host_table(self, spec, page_indptr, length_info):
        """The fused lowering's host-readable page_indptr and length_info, and the page table's
        (base, kv_len, table) over them."""
        page_indptr = HostReadable(page_indptr, 1, "page_indptr")
        length_info = HostReadable(length_info, _length_info_rank(spec), "length_info")
        return page_indptr, _paged_geometry(spec, page_indptr, length_info)

    @abstractmethod
    def _page_element(self, pages, page, which: int, head, slot, col) -> ir.Value:
        """K (0) or V (1) element ``col`` of head ``head`` at ``slot`` of page ``page``."""

    def element(self, spec, cache, which, entry, logical_block, column, slot, head, col):
        table_block, page_slot = logical_block, slot
        if spec.sliding_window:  # logical row r is physical r (r < sink tokens) or r - sink tokens + window_offset
            r = column()
            sink_tokens = read_element(cache.geometry, [entry, const_index(1)])
            offset = read_element(cache.geometry, [entry, const_index(2)])
            physical = arith_d.select(lt(r, sink_tokens), r, arith_d.addi(arith_d.subi(r, sink_tokens), offset))
            last_block = arith_d.subi(dim(cache.table, 1), const_index(1))
            table_block = arith_d.minsi(arith_d.divui(physical, const_index(spec.block)), last_block)
            page_slot = arith_d.remui(physical, const_index(spec.block))
        pages = cache.sources[0]
        page = clamped_page(read_element(cache.table, [entry, table_block]), pages)
        return self._page_element(pages, page, which, head, page_slot, col)

    def block(self, spec) -> int:
        return spec.page_size

    def _row_offsets(self, spec, table, pages, page_values):
        """BatchKv.row_offset of the rows through the page table ``table`` (_paged_geometry's)."""
        def row_offset(which, e, r, head):
            entry = table(device_read, e)
            page, slot = physical_row(spec, entry, page_values, r, page_bounds(entry, page_values))
            return self.row_offset(spec, which, as_i64(page), as_i64(slot), as_i64(head), as_i64(dim(pages, 0)))

        return row_offset


class PagedLayout(_PageTableLayout):
    """Entry b's K and V rows gathered from pages [P, 2, h_kv, page_size, d] (TVM's head-major
    pages, ``kv_order="hnd"``)."""

    name = "paged"
    operands = ("pages", "page_indptr", "page_values", "length_info", "k_rope_pos_offset")
    optional_operands = ("k_scale", "v_scale")
    vectorise_rows = True
    #: The pages argument's dims (mlir/abi.py).
    page_dims = ("P", 2, "h_kv", "page_size", "d")

    def _at(self, pages, page, which, head, slot, col) -> ir.Value:
        """The element of K (``which`` 0) or V (1) at ``head``, ``slot``, ``col`` of ``page``."""
        return tensor_d.extract(pages, [page, which, head, slot, col])

    def entry_loader(self, spec, *, pages, page_indptr, page_values, length_info, k_rope_pos_offset,
                     k_scale=None, v_scale=None):
        elem = element_type(spec.dtype)

        def load(b: ir.Value) -> EntryKv:
            table = page_table(spec, b, page_indptr, length_info)

            def gather(which: int) -> ir.Value:  # 0: keys, 1: values
                scales = (k_scale, v_scale)[which]

                def fetch(page, slot, out_indices):
                    head, col = out_indices
                    value = self._at(pages, clamped_page(page, pages), const_index(which), head, slot, col)
                    return dequantized(value, scales, head, elem)
                return gather_rows(spec, table, page_values, fetch, [spec.h_kv, spec.d], elem)

            return EntryKv(kv_len=table.kv_len, load_keys=lambda: gather(0), load_values=lambda: gather(1),
                           rope_offset=tensor_d.extract(k_rope_pos_offset, [b]))

        return load

    def batch_kv(self, spec, *, pages, page_indptr, page_values, length_info, k_rope_pos_offset,
                 k_scale=None, v_scale=None) -> BatchKv:
        page_indptr, (base, kv_len, table) = self._host_table(spec, page_indptr, length_info)
        elem = element_type(spec.dtype)

        def half(which):
            scales = (k_scale, v_scale)[which]

            def fetch(page, slot, rest):
                value = self._at(pages, clamped_page(page, pages), const_index(which), rest[0], slot, rest[1])
                return dequantized(value, scales, rest[0], elem)
            return _paged_source(spec, table, page_values, fetch)

        return BatchKv(arith_d.subi(page_indptr.dims[0], const_index(1)), base, kv_len, half(0), half(1),
                       spec.h_kv, spec.d, spec.d, k_rope_pos_offset, (pages,),
                       self._row_offsets(spec, table, pages, page_values))

    def _page_element(self, pages, page, which, head, slot, col):
        return self._at(pages, page, const_index(which), head, slot, col)

    extent_axis = 0

    def row_offset(self, spec, which, table_value, slot, head, extent):
        c, clamp = _i64_ops(table_value)
        page = clamp(table_value, arith_d.subi(extent, c(1)))
        half = arith_d.addi(arith_d.muli(page, c(2)), c(which))   # [P x 2, ...]
        return 0, arith_d.muli(self._page_row(spec, half, head, slot), c(spec.d))

    def _page_row(self, spec, half, head, slot):
        """The row's index in pages viewed as [P x 2 x h_kv x page_size, d]."""
        c, _ = _i64_ops(half)
        return arith_d.addi(arith_d.muli(arith_d.addi(arith_d.muli(half, c(spec.h_kv)), head), c(spec.page_size)), slot)

    def kv_bytes_per_key(self, spec) -> int:
        return spec.h_kv * (spec.d_qk + spec.d_v) * _itemsize(kv_dtype_of(spec))


class PagedNhdLayout(PagedLayout):
    """Entry b's K and V rows gathered from pages [P, 2, page_size, h_kv, d] (token-major pages,
    ``kv_order="nhd"``): FlashInfer's NHD paged cache, and transformers' continuous-batching
    cache, whose layer views are these pages (linalg_prefill/hf_paged.py)."""

    name = "paged_nhd"
    page_dims = ("P", 2, "page_size", "h_kv", "d")

    def _at(self, pages, page, which, head, slot, col) -> ir.Value:
        return tensor_d.extract(pages, [page, which, slot, head, col])

    def _page_row(self, spec, half, head, slot):
        """The row's index in pages viewed as [P x 2 x page_size x h_kv, d]."""
        c, _ = _i64_ops(half)
        return arith_d.addi(arith_d.muli(arith_d.addi(arith_d.muli(half, c(spec.page_size)), slot), c(spec.h_kv)), head)


class LatentLayout(_PageTableLayout):
    """MLA's latent rows from pages [P, page_size, d_latent + d_rope]: keys are whole rows, values
    their first d_latent columns (one shared KV head)."""

    name = "latent"
    operands = ("pages", "page_indptr", "page_values", "length_info")
    #: Keys and values are the same rows: one scale (the host checks v_scale == k_scale,
    #: runtime/variants.py), and the rows widen through k_scale.
    optional_operands = ("k_scale", "v_scale")
    one_scale = True
    #: Slower for MLA's wide rows (docs/performance.md, decode passes).
    vectorise_rows = False

    def entry_loader(self, spec, *, pages, page_indptr, page_values, length_info, k_scale=None, v_scale=None):
        elem = element_type(spec.dtype)

        def load(b: ir.Value) -> EntryKv:
            table = page_table(spec, b, page_indptr, length_info)

            def fetch(page, slot, out_indices):
                head, col = out_indices
                return dequantized(tensor_d.extract(pages, [clamped_page(page, pages), slot, col]), k_scale, head, elem)

            rows = gather_rows(spec, table, page_values, fetch, [1, spec.d_qk], elem)
            values = extract_slice(rows, [0, 0, 0], [dim(rows, 0), 1, spec.d_latent])
            return EntryKv(kv_len=table.kv_len, load_keys=lambda: rows, load_values=lambda: values)

        return load

    def batch_kv(self, spec, *, pages, page_indptr, page_values, length_info, k_scale=None, v_scale=None) -> BatchKv:
        page_indptr, (base, kv_len, table) = self._host_table(spec, page_indptr, length_info)
        elem = element_type(spec.dtype)

        def fetch(page, slot, rest):  # one scale: v_scale equals k_scale (one_scale)
            return dequantized(tensor_d.extract(pages, [clamped_page(page, pages), slot, rest[1]]), k_scale, rest[0],
                               elem)

        source = _paged_source(spec, table, page_values, fetch)
        return BatchKv(arith_d.subi(page_indptr.dims[0], const_index(1)), base, kv_len, source, source,
                       1, spec.d_qk, spec.d_latent, None, (pages,), self._row_offsets(spec, table, pages, page_values))

    def _page_element(self, pages, page, which, head, slot, col):
        return tensor_d.extract(pages, [page, slot, col])  # values are the first d_v columns

    extent_axis = 0

    def row_offset(self, spec, which, table_value, slot, head, extent):
        c, clamp = _i64_ops(table_value)   # K and V: the same row (values its first d_v columns)
        page = clamp(table_value, arith_d.subi(extent, c(1)))
        return 0, arith_d.muli(arith_d.addi(arith_d.muli(page, c(spec.page_size)), slot), c(spec.d_qk))

    def kv_bytes_per_key(self, spec) -> int:
        return spec.d_qk * _itemsize(kv_dtype_of(spec))  # one latent row, values included


DENSE, RAGGED, RAGGED_HND, PAGED, PAGED_NHD, LATENT = (
    DenseLayout(), RaggedLayout(), RaggedHndLayout(), PagedLayout(), PagedNhdLayout(), LatentLayout())
#: Every layout by name (runtime/kv_layouts.py has the host half of each).
LAYOUTS: dict[str, KvLayout] = {layout.name: layout for layout in (DENSE, RAGGED, RAGGED_HND, PAGED, PAGED_NHD, LATENT)}
#: The ragged layout of each ``RaggedPrefillSpec.kv_order``: token-major rows (FlashInfer's NHD)
#: or head-major (HND).
RAGGED_ORDERS: dict[str, RaggedLayout] = {"nhd": RAGGED, "hnd": RAGGED_HND}
#: The paged layout of each ``PagedPrefillSpec.kv_order``.
PAGED_ORDERS: dict[str, PagedLayout] = {"hnd": PAGED, "nhd": PAGED_NHD}


def cache_layout(spec) -> CacheLayout:
    """``spec``'s layout, which must be a KV cache's (TypeError otherwise)."""
    layout = spec.layout
    if not isinstance(layout, CacheLayout):
        raise TypeError(f"{type(spec).__name__} has no KV cache (layout {layout.name})")
    return layout
