"""K and V packed into the x86 dense kernel's engine order by a hand-written dispatch.

The dense x86 kernel (mlir/x86_attention.py) reads K and V packed once per call (N = kv_block
keys a step, T steps; keys past the call's are zero):

    AMX (bf16 B tiles)
      k_tiles [B, h_kv, T, N/16, d/2, 16, 2]    element (b, h, t, n1, k1, n0, k0) = k[b, t N + 16 n1 + n0, h, 2 k1 + k0]
      v_tiles [B, h_kv, T, d_v/16, N/2, 16, 2]  element (b, h, t, d1, k1, d0, k0) = v[b, t N + 2 k1 + k0, h, 16 d1 + d0]
    FMA (f32 rows; f16 widened)
      k_tiles [B, h_kv, T, d, N]                element (b, h, t, j, n) = k[b, t N + n, h, j]
      v_tiles [B, h_kv, T N, d_v]               element (b, h, r, j) = v[b, r, h, j]

As linalg generics that read k and v element by element (kv_layouts.DENSE.stored) IREE packed them
at 6-7 GB/s: 2.2 ms of a 28 ms bf16 call of 2048 tokens (h 32/8, d 128; Intel Xeon model 167).
Here workgroup (t, h, b) packs step t of KV head h of entry b with 64-byte vectors: each 16 keys x
16 lanes of k (bf16 dim pairs, or f32 dims) is a 16 x 16 transpose (four rounds of two-source
shuffles); each two bf16 keys of v one interleave of their 32 dims (two shuffles), each f32 key's
row of v a copy.
"""

from __future__ import annotations

from .amx import (
    BINDING, as_i64, at, binding_pointer, const_i64, dynamic_dims, hand_written_dispatch, i16, static_shape,
    workgroup_ids,
)
from .ir import (
    DYN, arith_d, ceil_div, const_index, dim, element_type, f32, flow_d, i32, ir, llvm_d, scf_d, tensor_type, vector_d,
)

_EXECUTABLE = "x86_pack_kv"
_ENTRY = "pack"
_SCALARS = ("batch", "kv_len", "kv_blocks")
#: Bytes of a vector (and of a B tile's row).
_VECTOR = 64


def emit_packed_kv(shapes, engine, k: ir.Value, v: ir.Value, anchor: ir.Operation) -> tuple[ir.Value, ir.Value]:
    """(k_tiles, v_tiles) of k [B, L, h_kv, d], v [B, L, h_kv, d_v] (the kernel's dtype) in
    ``engine``'s layout (module docstring), through the packing dispatch; its executable is built
    before ``anchor``."""
    elem = engine.operand
    with ir.InsertionPoint(anchor):
        _build_executable(shapes, engine)
    batch, kv_len = dim(k, 0), dim(k, 1)
    kv_blocks = ceil_div(kv_len, shapes.kv_block)
    sizes = kv_tile_sizes(shapes, engine, batch, kv_blocks)
    entry = ir.ArrayAttr.get([ir.SymbolRefAttr.get([_EXECUTABLE, _ENTRY])])
    dispatch = flow_d.DispatchOp(
        [tensor_type(static_shape(sizes[name]), elem) for name in ("k_tiles", "v_tiles")],
        [kv_blocks, const_index(shapes.h_kv), batch], entry,
        [k, v, batch, kv_len, kv_blocks],
        [batch, kv_len, batch, kv_len],
        [dyn for name in ("k_tiles", "v_tiles") for dyn in dynamic_dims(sizes[name])])
    return dispatch.results[0], dispatch.results[1]


def kv_tile_sizes(shapes, engine, batch, kv_blocks) -> dict:
    """The sizes (ints or index Values) of ``engine``'s packed k_tiles and v_tiles (module
    docstring) for ``batch`` entries of ``kv_blocks`` KV steps."""
    layout = engine.layout
    return {"k_tiles": layout.kv_storage(True, batch, shapes.h_kv, kv_blocks, shapes.d, shapes.kv_block).sizes,
            "v_tiles": layout.kv_storage(False, batch, shapes.h_kv, kv_blocks, shapes.d_v, shapes.kv_block).sizes}


def _build_executable(shapes, engine) -> None:
    """The ``stream.executable`` of the packing dispatch at the insertion point: bindings k, v,
    the scalars ``_SCALARS`` (index), then bindings k_tiles, v_tiles."""
    index, binding = ir.IndexType.get(), ir.Type.parse(BINDING)
    arg_types = [binding] * 2 + [index] * len(_SCALARS) + [binding] * 2
    elem, operand = element_type(shapes.dtype), engine.operand
    with hand_written_dispatch(_EXECUTABLE, _ENTRY, arg_types) as args:
        scalars = dict(zip(_SCALARS, args[2:2 + len(_SCALARS)]))
        sizes = kv_tile_sizes(shapes, engine, scalars["batch"], scalars["kv_blocks"])
        sources = {"k": shapes.d, "v": shapes.d_v}
        pointers = {name: binding_pointer(bound, ir.MemRefType.get([DYN, DYN, shapes.h_kv, sources[name]], elem),
                                          [scalars["batch"], scalars["kv_len"]])
                    for name, bound in zip(("k", "v"), args[:2])}
        for name, bound in zip(("k_tiles", "v_tiles"), args[-2:]):
            pointers[name] = binding_pointer(bound, ir.MemRefType.get(static_shape(sizes[name]), operand),
                                             dynamic_dims(sizes[name]))
        packing = _TilePacking if getattr(engine.layout, "packed", False) else _RowPacking
        packing(shapes, pointers, {name: as_i64(value) for name, value in scalars.items()}).emit()


class _Packing:
    """The packing dispatch's body: workgroup (t, h, b) packs KV step t of head h of entry b
    (the layouts' ``_keys`` and ``_values``)."""

    #: Bytes of a k or v element in the call, and in the packed tiles.
    source_bytes = 2
    packed_bytes = 2

    def __init__(self, shapes, pointers: dict, scalars: dict):
        self.s, self.p, self.n = shapes, pointers, scalars

    def emit(self) -> None:
        s = self.s
        step, head, entry = workgroup_ids()
        kv_len, kv_blocks = self.n["kv_len"], self.n["kv_blocks"]
        self.last_key = arith_d.subi(kv_len, const_i64(1))
        self.kv_len = kv_len
        self.first_key = arith_d.muli(step, const_i64(s.kv_block))
        packed_step = arith_d.addi(arith_d.muli(arith_d.addi(arith_d.muli(entry, const_i64(s.h_kv)), head), kv_blocks),
                                   step)
        first_row = arith_d.muli(entry, kv_len)   # entry's key 0 in k and v viewed as [B * L, h_kv, d]
        for name, width, pack in (("k", s.d, self._keys), ("v", s.d_v, self._values)):
            row_bytes = s.h_kv * width * self.source_bytes   # between two keys of one head
            head_at = at(self.p[name], arith_d.muli(arith_d.addi(arith_d.muli(first_row, const_i64(s.h_kv)), head),
                                                    const_i64(width * self.source_bytes)))
            step_bytes = s.kv_block * width * self.packed_bytes
            out = at(self.p[f"{name}_tiles"], arith_d.muli(packed_step, const_i64(step_bytes)))
            pack(head_at, row_bytes, out, width)

    def _row(self, head_at, row_bytes: int, key, offset, vector_type) -> ir.Value:
        """A vector of key ``key``'s row from byte ``offset`` (an int or an i64 Value; the row
        clamped to the last key, zero past it)."""
        row = arith_d.minsi(key, self.last_key)
        offset = const_i64(offset) if isinstance(offset, int) else offset
        loaded = llvm_d.load(vector_type, at(head_at, arith_d.addi(arith_d.muli(row, const_i64(row_bytes)), offset)),
                             alignment=2)
        element = vector_type.element_type
        zero = ir.FloatAttr.get(element, 0.0) if isinstance(element, ir.FloatType) else ir.IntegerAttr.get(element, 0)
        zeros = arith_d.constant(vector_type, ir.DenseElementsAttr.get_splat(vector_type, zero))
        return arith_d.select(arith_d.cmpi(arith_d.CmpIPredicate.slt, key, self.kv_len), loaded, zeros)


class _TilePacking(_Packing):
    """AMX B tiles from bf16 k and v."""

    def _keys(self, head_at, row_bytes: int, out, d: int) -> None:
        """Each 16 keys' 16 x 32 dims: rows of 16 dim pairs (i32) transposed to 16 rows of keys."""
        pairs = ir.VectorType.get([16], i32())

        def chunk(group, chunk):
            first = arith_d.addi(self.first_key, arith_d.muli(group, const_i64(16)))
            chunk_out = at(out, arith_d.addi(arith_d.muli(group, const_i64(d // 2 * _VECTOR)),
                                             arith_d.muli(chunk, const_i64(16 * _VECTOR))))
            offset = arith_d.muli(chunk, const_i64(_VECTOR))
            rows = [self._row(head_at, row_bytes, arith_d.addi(first, const_i64(i)), offset, pairs) for i in range(16)]
            for r, column in enumerate(_transposed(rows)):
                llvm_d.store(column, at(chunk_out, r * _VECTOR), alignment=64)

        _loops(self.s.kv_block // 16, d // 32, chunk)

    def _values(self, head_at, row_bytes: int, out, d_v: int) -> None:
        """Each two keys' 32 dims interleaved: two rows of 16 (dim, key pair) elements."""
        halves = ir.VectorType.get([32], i16())
        pair_rows = self.s.kv_block // 2
        low = [x for j in range(16) for x in (j, 32 + j)]
        high = [x for j in range(16, 32) for x in (j, 32 + j)]
        loop = scf_d.ForOp(const_index(0), const_index(pair_rows), const_index(1))
        with ir.InsertionPoint(loop.body):
            pair = as_i64(loop.induction_variable)
            first = arith_d.addi(self.first_key, arith_d.muli(pair, const_i64(2)))
            second = arith_d.addi(first, const_i64(1))
            for chunk in range(d_v // 32):
                a = self._row(head_at, row_bytes, first, chunk * _VECTOR, halves)
                b = self._row(head_at, row_bytes, second, chunk * _VECTOR, halves)
                for half, mask in enumerate((low, high)):
                    place = arith_d.addi(arith_d.muli(const_i64(2 * chunk + half), const_i64(pair_rows * _VECTOR)),
                                         arith_d.muli(pair, const_i64(_VECTOR)))
                    llvm_d.store(vector_d.shuffle(a, b, mask), at(out, place), alignment=64)
            scf_d.YieldOp([])


class _RowPacking(_Packing):
    """f32 row tiles from f32 or f16 k and v (f16 widened)."""

    def __init__(self, shapes, pointers: dict, scalars: dict):
        super().__init__(shapes, pointers, scalars)
        self.source = element_type(shapes.dtype)
        self.source_bytes = 2 if self.source != f32() else 4
        self.packed_bytes = 4

    def _lanes(self, head_at, row_bytes: int, key, offset) -> ir.Value:
        """16 f32 lanes of key ``key``'s row from byte ``offset`` (f16 widened)."""
        lanes = self._row(head_at, row_bytes, key, offset, ir.VectorType.get([16], self.source))
        return lanes if self.source == f32() else arith_d.extf(ir.VectorType.get([16], f32()), lanes)

    def _keys(self, head_at, row_bytes: int, out, d: int) -> None:
        """Each 16 keys x 16 dims transposed to 16 rows (dims) of 16 keys."""
        n = self.s.kv_block

        def chunk(group, chunk):
            first = arith_d.addi(self.first_key, arith_d.muli(group, const_i64(16)))
            chunk_out = at(out, arith_d.addi(arith_d.muli(group, const_i64(_VECTOR)),
                                             arith_d.muli(chunk, const_i64(16 * n * 4))))
            offset = arith_d.muli(chunk, const_i64(16 * self.source_bytes))
            rows = [self._lanes(head_at, row_bytes, arith_d.addi(first, const_i64(i)), offset) for i in range(16)]
            for r, column in enumerate(_transposed(rows)):
                llvm_d.store(column, at(chunk_out, r * n * 4), alignment=64)

        _loops(n // 16, d // 16, chunk)

    def _values(self, head_at, row_bytes: int, out, d_v: int) -> None:
        """Each key's row, in f32."""
        loop = scf_d.ForOp(const_index(0), const_index(self.s.kv_block), const_index(1))
        with ir.InsertionPoint(loop.body):
            key = as_i64(loop.induction_variable)
            row_out = at(out, arith_d.muli(key, const_i64(d_v * 4)))
            for chunk in range(d_v // 16):
                offset = 16 * chunk * self.source_bytes
                lanes = self._lanes(head_at, row_bytes, arith_d.addi(self.first_key, key), offset)
                llvm_d.store(lanes, at(row_out, chunk * _VECTOR), alignment=64)
            scf_d.YieldOp([])


def _loops(outer: int, inner: int, body) -> None:
    """``body(i, j)`` (i64 Values) over [0, outer) x [0, inner), in two scf.for (the 16 x 16
    transposes inside are unrolled already: the chunks in a loop keep a d = 256 kernel's
    packing at a few hundred operations)."""
    outer_loop = scf_d.ForOp(const_index(0), const_index(outer), const_index(1))
    with ir.InsertionPoint(outer_loop.body):
        inner_loop = scf_d.ForOp(const_index(0), const_index(inner), const_index(1))
        with ir.InsertionPoint(inner_loop.body):
            body(as_i64(outer_loop.induction_variable), as_i64(inner_loop.induction_variable))
            scf_d.YieldOp([])
        scf_d.YieldOp([])


def _transposed(rows: list) -> list:
    """The 16 x 16 transpose of 16 vectors of 16 lanes: four rounds of two-source shuffles, round b
    swapping the off-diagonal 2^b-blocks of each pair of rows 2^b apart."""
    rows = list(rows)
    for bit in range(4):
        distance = 1 << bit
        low = [j if not j & distance else 16 + j - distance for j in range(16)]
        high = [j + distance if not j & distance else 16 + j for j in range(16)]
        for i in range(16):
            if i & distance:
                continue
            rows[i], rows[i + distance] = (vector_d.shuffle(rows[i], rows[i + distance], low),
                                           vector_d.shuffle(rows[i], rows[i + distance], high))
    return rows
