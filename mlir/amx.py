"""Typed-binding helpers for dispatches written with Intel AMX tile instructions.

IREE 3.13's llvm-cpu backend never emits AMX (its x86 microkernels stop at avx512_bf16), so the
x86 lowering (mlir/x86_attention.py) writes its dispatch itself: a ``stream.executable`` whose function reads raw pointers
of its bindings and calls LLVM's AMX intrinsics on ``!llvm.x86_amx`` values; LLVM inserts the
tile configuration (``ldtilecfg``) and ``tilerelease``. Every tile here is 16 rows x 64 bytes:

    A (left) tile   16 rows x 32 bf16            row-major, any row stride
    B (right) tile  16 k-pairs x 16 columns x 2  (VNNI-2: element (k, n) at [k // 2][n][k % 2])
    C tile          16 rows x 16 f32             row-major, any row stride

``tdpbf16ps`` adds A x B to C: 16 x 16 x 32 per call.
The vector helpers (``Vec``) cover what the dispatch's f32 softmax needs: 16-lane loads and
stores through pointers, splats, reductions and a polynomial ``exp2`` (no libm in a dispatch).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from .ir import (
    DYN, arith_d, builtin_d, const_int, f32, func_d, i32, i8, ir, llvm_d, math_d, memref_d, stream_d, vector_d,
)

#: Bytes of one AMX tile row, and rows of a tile: every tile of this lowering is full.
TILE_BYTES_PER_ROW = 64
TILE_ROWS = 16
#: LLVM's marker for a dynamic GEP index.
_DYNAMIC_INDEX = -2147483648


def ptr_type() -> ir.Type:
    return ir.Type.parse("!llvm.ptr")


def amx_type() -> ir.Type:
    return ir.Type.parse("!llvm.x86_amx")


def i64() -> ir.Type:
    return ir.IntegerType.get_signless(64)


def i16() -> ir.Type:
    return ir.IntegerType.get_signless(16)


def const_i64(value: int) -> ir.Value:
    return arith_d.constant(i64(), value)


def ceil_div_i64(value: ir.Value, divisor: int) -> ir.Value:
    """ceil(``value`` / ``divisor``) of an i64 ``value`` >= 0."""
    return arith_d.divsi(arith_d.addi(value, const_i64(divisor - 1)), const_i64(divisor))


def as_i64(index_value: ir.Value) -> ir.Value:
    """An ``index`` value as i64 (pointer arithmetic is in i64)."""
    return arith_d.index_cast(i64(), index_value)


def binding_pointer(binding: ir.Value, memref_type: ir.Type, dims) -> ir.Value:
    """The base address of a ``!stream.binding`` viewed as ``memref_type`` (dynamic ``dims``)."""
    view = stream_d.binding_subspan(memref_type, binding, arith_d.constant(ir.IndexType.get(), 0), list(dims))
    address = memref_d.extract_aligned_pointer_as_index(view)
    return llvm_d.inttoptr(ptr_type(), as_i64(address))


BINDING = "!stream.binding"


def workgroup_ids() -> tuple[ir.Value, ir.Value, ir.Value]:
    """The dispatch's workgroup ids (x, y, z) as i64 values (for pointer arithmetic)."""
    return tuple(as_i64(stream_d.dispatch_workgroup_id(axis)) for axis in range(3))


def dynamic_dims(sizes) -> list:
    """The index Values among a tensor's ``sizes`` (ints or index Values): its dynamic dims."""
    return [size for size in sizes if isinstance(size, ir.Value)]


def static_shape(sizes) -> list[int]:
    """A tensor's ``sizes`` as a shape, dynamic (DYN) where a size is an index Value."""
    return [DYN if isinstance(size, ir.Value) else size for size in sizes]


@contextmanager
def hand_written_dispatch(executable_name: str, entry: str, arg_types: list, attributes: dict | None = None):
    """A ``stream.executable`` ``executable_name`` at the insertion point whose export ``entry``
    takes its workgroup counts as given; inside its function of ``arg_types`` (bindings, then
    scalars, in the dispatch's operand order) with the function ``attributes`` (a GPU dispatch's
    ``translation_info``), yields the function's arguments for the body."""
    index = ir.IndexType.get()
    executable = stream_d.ExecutableOp(executable_name, sym_visibility="private")
    body = executable.body.blocks.append()
    with ir.InsertionPoint(body):
        export = stream_d.ExecutableExportOp(entry, entry, sym_visibility="public")
        count = export.workgroup_count.blocks.append(index, index, index)
        with ir.InsertionPoint(count):
            stream_d.ReturnOp(list(count.arguments))
        inner = builtin_d.ModuleOp()
        with ir.InsertionPoint(inner.body):
            fn = func_d.FuncOp(entry, (arg_types, []))
            for name, value in (attributes or {}).items():
                fn.attributes[name] = value
            with ir.InsertionPoint(fn.add_entry_block()):
                yield list(fn.arguments)
                func_d.ReturnOp([])
        stream_d.ExecutableEndOp()


def at(pointer: ir.Value, byte_offset: ir.Value | int) -> ir.Value:
    """``pointer + byte_offset`` (an i64 Value or a Python int)."""
    if isinstance(byte_offset, int):
        if byte_offset == 0:
            return pointer
        byte_offset = const_i64(byte_offset)
    return llvm_d.getelementptr(ptr_type(), pointer, [byte_offset], [_DYNAMIC_INDEX],
                                i8(), 0)


def stack_bytes(size: int) -> ir.Value:
    """A 64-byte aligned stack buffer of ``size`` bytes (build at the function's entry)."""
    return llvm_d.alloca(ptr_type(), const_i64(size), i8(), alignment=64)


class Tiles:
    """The AMX intrinsics for tiles of ``rows`` x ``row_bytes`` (full 16 x 64-byte tiles unless
    given), bf16 products: :meth:`dot`'s result and B operand are of that shape, its A operand
    ``rows`` x 64 bytes (32 bf16 of the contraction a row)."""

    def __init__(self, rows: int = TILE_ROWS, row_bytes: int = TILE_BYTES_PER_ROW):
        self.rows, self.row_bytes = rows, row_bytes

    def _shape(self):
        return arith_d.constant(i16(), self.rows), arith_d.constant(i16(), self.row_bytes)

    def zero(self) -> ir.Value:
        rows, cols = self._shape()
        return llvm_d.call_intrinsic(amx_type(), "llvm.x86.tilezero.internal", [rows, cols], [], [])

    def load(self, pointer: ir.Value, stride: int | ir.Value) -> ir.Value:
        rows, cols = self._shape()
        stride = const_i64(stride) if isinstance(stride, int) else stride
        return llvm_d.call_intrinsic(amx_type(), "llvm.x86.tileloadd64.internal", [rows, cols, pointer, stride], [], [])

    def store(self, pointer: ir.Value, stride: int | ir.Value, tile: ir.Value) -> None:
        rows, cols = self._shape()
        stride = const_i64(stride) if isinstance(stride, int) else stride
        llvm_d.call_intrinsic(None, "llvm.x86.tilestored64.internal", [rows, cols, pointer, stride, tile], [], [])

    def dot(self, acc: ir.Value, lhs: ir.Value, rhs: ir.Value) -> ir.Value:
        """acc + lhs x rhs (A tile x B tile, f32 sums)."""
        rows, cols = self._shape()
        depth = arith_d.constant(i16(), TILE_BYTES_PER_ROW)
        return llvm_d.call_intrinsic(amx_type(), "llvm.x86.tdpbf16ps.internal", [rows, cols, depth, acc, lhs, rhs],
                                     [], [])


#: f32 lanes of one AVX-512 vector.
LANES = 16


def _exp2_coefficients(degree: int = 6) -> list[float]:
    """A least-squares fit of 2^f on [0, 1] (Chebyshev nodes), lowest power first, the constant
    pinned to 1 (f = 0 gives exactly 1); its relative error is below 2^-24 (half an f32 ulp)."""
    nodes = 0.5 + 0.5 * np.cos(np.pi * (np.arange(64) + 0.5) / 64)
    powers = np.vander(nodes, degree + 1, increasing=True)[:, 1:]
    coeffs, *_ = np.linalg.lstsq(powers, np.exp2(nodes) - 1.0, rcond=None)
    return [1.0, *(float(c) for c in coeffs)]


EXP2_COEFFICIENTS = tuple(_exp2_coefficients())
#: Below this an exponent's 2^x is exactly 0 in f32 (2^-150 rounds to 0, nearest-even).
EXP2_ZERO_BELOW = -150.0
#: vreduceps' immediate for x - floor(x): no fraction bits kept (imm[7:4] = 0), rounding down
#: (imm[1:0] = 1, imm[2] = 0: the immediate's mode), the precision exception suppressed (imm[3]).
_FRACTION_BELOW = 0x09


class Vec:
    """16-lane f32 vector code through pointers (``vector<16xf32>``)."""

    def __init__(self):
        self.f32x = ir.VectorType.get([LANES], f32())
        self.i32x = ir.VectorType.get([LANES], i32())

    def splat(self, scalar: ir.Value) -> ir.Value:
        return vector_d.broadcast(ir.VectorType.get([LANES], scalar.type), scalar)

    def const(self, value: float) -> ir.Value:
        return arith_d.constant(self.f32x, ir.DenseElementsAttr.get_splat(self.f32x, ir.FloatAttr.get(f32(), value)))

    def iota(self) -> ir.Value:
        values = np.arange(LANES, dtype=np.int32)
        return arith_d.constant(self.i32x, ir.DenseElementsAttr.get(values, type=self.i32x))

    def load(self, pointer: ir.Value, elem: ir.Type | None = None) -> ir.Value:
        vtype = ir.VectorType.get([LANES], elem or f32())
        return llvm_d.load(vtype, pointer, alignment=4)

    def store(self, value: ir.Value, pointer: ir.Value) -> None:
        llvm_d.store(value, pointer, alignment=2)

    def reduce(self, kind: str, value: ir.Value) -> ir.Value:
        """A horizontal ``add`` or ``maximumf`` of 16 lanes. ``nnan`` and ``nsz`` let x86 use a
        plain vmaxps instead of NaN- and signed-zero-ordering compare-and-blend sequences (each
        max was two instructions, the dense bf16 kernel 8-10% slower, docs/performance.md): the
        sign of a zero maximum changes no exponent, and a NaN score these may drop (q and sinks
        are checked finite on the host, caches are not) still reaches its row through
        :meth:`exp2`, which keeps NaN."""
        attr = ir.Attribute.parse(f"#vector.kind<{kind}>")
        return vector_d.reduction(f32(), attr, value, fastmath=_plain_max())

    def max(self, a: ir.Value, b: ir.Value) -> ir.Value:
        """The larger of two f32 vectors (or scalars); ``nnan`` and ``nsz`` as :meth:`reduce`."""
        return arith_d.maximumf(a, b, fastmath=_plain_max())

    def narrow(self, value: ir.Value, elem: ir.Type) -> ir.Value:
        """16 f32 lanes rounded to ``elem`` (f32: as they are; bf16 or f16: nearest-even, bf16 through
        avx512_bf16's vcvtneps2bf16: LLVM emulates a plain fptrunc to bf16 with integer ops)."""
        if elem == f32():
            return value
        narrow_type = ir.VectorType.get([LANES], elem)
        if elem == ir.BF16Type.get():
            return llvm_d.call_intrinsic(narrow_type, "llvm.x86.avx512bf16.cvtneps2bf16.512", [value], [], [])
        return arith_d.truncf(narrow_type, value)

    def bf16_rounded(self, value: ir.Value) -> ir.Value:
        """16 f32 lanes rounded to the nearest bf16 (ties to even; finite lanes), kept in f32:
        integer ops on the bits (an extf of a truncf to bf16 folds away in IREE's pipeline: the
        FMA passes over an 8-bit cache read f32(x) x scale unrounded; and no avx512_bf16 needed)."""
        bits = vector_d.bitcast(self.i32x, value)
        odd = arith_d.andi(arith_d.shrui(bits, const_int(self.i32x, 16)), const_int(self.i32x, 1))
        rounded = arith_d.addi(bits, arith_d.addi(odd, const_int(self.i32x, 0x7FFF)))
        return vector_d.bitcast(self.f32x, arith_d.andi(rounded, const_int(self.i32x, -0x10000)))

    def exp2(self, x: ir.Value) -> ir.Value:
        """2^x for x <= 0 (the online softmax's exponents), exactly 0 for -inf and far below:
        AVX-512's vscalefps(p(f), x) = p(f) * 2^floor(x), f = x - floor(x) in [0, 1) from one
        vreduceps (against vrndscaleps and a subtraction: dense causal bf16 L = 2048 26.0-27.0 ->
        25.2-25.6 ms), p a degree-6 polynomial; x is first raised to EXP2_ZERO_BELOW, whose 2^x
        rounds to +0."""
        # vmaxps(floor, x) gives x where x is NaN (x86 returns the second operand then): a NaN
        # score stays NaN through its weight, whatever the plain maxima (:meth:`max`) dropped
        clamped = llvm_d.call_intrinsic(self.f32x, "llvm.x86.avx512.max.ps.512",
                                        [self.const(EXP2_ZERO_BELOW), x, arith_d.constant(i32(), 4)], [], [])
        every_lane = arith_d.constant(i16(), -1)
        current_rounding = arith_d.constant(i32(), 4)
        fraction = llvm_d.call_intrinsic(self.f32x, "llvm.x86.avx512.mask.reduce.ps.512",
                                         [clamped, arith_d.constant(i32(), _FRACTION_BELOW), clamped, every_lane,
                                          current_rounding], [], [])
        poly = self.const(EXP2_COEFFICIENTS[-1])
        for coeff in reversed(EXP2_COEFFICIENTS[:-1]):
            poly = math_d.fma(poly, fraction, self.const(coeff))
        return llvm_d.call_intrinsic(self.f32x, "llvm.x86.avx512.mask.scalef.ps.512",
                                     [poly, clamped, poly, every_lane, current_rounding], [], [])

    def tanh(self, x: ir.Value) -> ir.Value:
        """tanh(x) as 1 - 2 / (2^(2 log2(e) x) + 1) through :meth:`exp2` (-1 and 1 in the limits:
        2^x is 0 far below and inf far above): within a few f32 ulps of 1 absolutely, the
        precision the error model gives a soft cap's scores (cap * tanh(s / cap): 4 u32 cap)."""
        two_log2e = self.const(2.0 * 1.4426950408889634)
        exp = self.exp2(arith_d.mulf(x, two_log2e))
        return arith_d.subf(self.const(1.0), arith_d.divf(self.const(2.0), arith_d.addf(exp, self.const(1.0))))


def _plain_max() -> ir.Attribute:
    """``nnan, nsz``: :meth:`Vec.reduce`'s reasons."""
    return ir.Attribute.parse("#arith.fastmath<nnan,nsz>")
