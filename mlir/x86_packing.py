"""K and V packed into the x86 kernels' engine order by hand-written dispatches: the dense
kernel's k and v [B, L, h_kv, d] (:func:`emit_packed_kv`), and one entry's rows of a KV cache at
the offsets its kernel computes (:func:`emit_packed_rows`, mlir/x86_kv_cache.py).

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
row of v a copy. The row packing dispatch (one for an entry's K, one for its V; B = 1) packs the
same way, workgroup (t, h), each key's row at the element offset its table holds (i64 [h_kv, T
N]) instead of at a stride: a KV cache's rows where its layout keeps them.
"""

from __future__ import annotations

from .amx import (
    BINDING, as_i64, at, binding_pointer, const_i64, dynamic_dims, hand_written_dispatch, i16, i64, static_shape,
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


def emit_packed_rows(shapes, engine, which: int, source: ir.Value, offsets: ir.Value, kv_len: ir.Value,
                     kv_blocks: ir.Value, anchor: ir.Operation) -> ir.Value:
    """One entry's k_tiles (``which`` 0) or v_tiles (1) [1, h_kv, ...] in ``engine``'s layout
    (module docstring; zero past ``kv_len``) gathered from ``source`` (a KV cache tensor, the
    spec's dtype) at ``offsets`` [h_kv, kv_blocks x kv_block] (i64: each key's row of each head,
    the element offset in ``source`` viewed flat, every one in bounds), through the row packing
    dispatch; its executable is built before ``anchor``."""
    name = ("k_tiles", "v_tiles")[which]
    source_type, offsets_type = (ir.RankedTensorType(x.type) for x in (source, offsets))
    with ir.InsertionPoint(anchor):
        _build_rows_executable(shapes, engine, which, source_type)
    size = kv_tile_sizes(shapes, engine, 1, kv_blocks)[name]
    source_dims = [dim(source, axis) for axis, extent in enumerate(source_type.shape) if extent == DYN]
    entry = ir.ArrayAttr.get([ir.SymbolRefAttr.get(list(_rows_names(which)))])
    dispatch = flow_d.DispatchOp(
        [tensor_type(static_shape(size), engine.operand)], [kv_blocks, const_index(shapes.h_kv), const_index(1)],
        entry, [source, offsets, *source_dims, kv_len, kv_blocks],
        [*source_dims, *(dim(offsets, axis) for axis, extent in enumerate(offsets_type.shape) if extent == DYN)],
        dynamic_dims(size))
    return dispatch.results[0]


def _rows_names(which: int) -> tuple[str, str]:
    """(executable, entry) of the row packing dispatch of keys (0) or values (1): IREE links the
    target's executables into one library, where each entry's symbol must be unique."""
    name = f"pack_{'kv'[which]}_rows"
    return f"x86_{name}", name


def _build_rows_executable(shapes, engine, which: int, source_type) -> None:
    """The ``stream.executable`` of :func:`emit_packed_rows`'s dispatch at the insertion point:
    bindings source and offsets, the source's dynamic dims, kv_len and kv_blocks (index), then
    the binding of the tiles."""
    index, binding = ir.IndexType.get(), ir.Type.parse(BINDING)
    dynamic = sum(1 for extent in source_type.shape if extent == DYN)
    arg_types = [binding] * 2 + [index] * (dynamic + 2) + [binding]
    with hand_written_dispatch(*_rows_names(which), arg_types) as args:
        source_dims, (kv_len, kv_blocks) = args[2:2 + dynamic], args[2 + dynamic:4 + dynamic]
        rows = arith_d.muli(kv_blocks, const_index(shapes.kv_block))
        source = binding_pointer(args[0], ir.MemRefType.get(list(source_type.shape), source_type.element_type),
                                 source_dims)
        offsets = binding_pointer(args[1], ir.MemRefType.get([shapes.h_kv, DYN], i64()), [rows])
        size = kv_tile_sizes(shapes, engine, 1, kv_blocks)[("k_tiles", "v_tiles")[which]]
        tiles = binding_pointer(args[-1], ir.MemRefType.get(static_shape(size), engine.operand), dynamic_dims(size))
        step, head, _ = workgroup_ids()
        packing = _packing(engine)(shapes, as_i64(kv_len), step)
        packing.emit_rows(which, source, offsets, tiles, step, head, as_i64(kv_blocks))


def _packing(engine) -> type:
    """The packing of ``engine``'s layout: AMX's (and DotEngine's) pair tiles, or f32 rows."""
    return _TilePacking if getattr(engine.layout, "packed", False) else _RowPacking


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
        n = {name: as_i64(value) for name, value in scalars.items()}
        step, head, entry = workgroup_ids()
        _packing(engine)(shapes, n["kv_len"], step).emit_dense(pointers, step, head, entry, n["kv_blocks"])


class _StridedRows:
    """Key r's row of one head at ``head_at`` + r x ``row_bytes`` (the dense kernel's k and v)."""

    def __init__(self, head_at: ir.Value, row_bytes: int):
        self.base, self.row_bytes = head_at, row_bytes

    def offset(self, row: ir.Value) -> ir.Value:
        """The row's byte offset from ``base``."""
        return arith_d.muli(row, const_i64(self.row_bytes))


class _TableRows:
    """Key r's row of one head at element ``offsets[r]`` of ``source`` (an entry's rows in a KV
    cache: x86_kv_cache.py's row offsets, i64 a key)."""

    def __init__(self, source: ir.Value, offsets: ir.Value, element_bytes: int):
        self.base, self.offsets, self.element_bytes = source, offsets, element_bytes

    def offset(self, row: ir.Value) -> ir.Value:
        element = llvm_d.load(i64(), at(self.offsets, arith_d.muli(row, const_i64(8))), alignment=8)
        return arith_d.muli(element, const_i64(self.element_bytes))


class _Packing:
    """The packing dispatches' body: a workgroup packs one KV step (keys [first_key, first_key +
    kv_block)) of one head (the layouts' ``_keys`` and ``_values``), reading each key's row
    through a rows object (:class:`_StridedRows`, :class:`_TableRows`)."""

    #: Bytes of a k or v element in the call, and in the packed tiles.
    source_bytes = 2
    packed_bytes = 2

    def __init__(self, shapes, kv_len: ir.Value, step: ir.Value):
        self.s = shapes
        self.last_key = arith_d.subi(kv_len, const_i64(1))
        self.kv_len = kv_len
        self.first_key = arith_d.muli(step, const_i64(shapes.kv_block))

    def emit_dense(self, pointers: dict, step, head, entry, kv_blocks) -> None:
        """Step ``step`` of KV head ``head`` of entry ``entry`` of k and v [B, L, h_kv, d] (the
        dense packing dispatch)."""
        s = self.s
        packed_step = arith_d.addi(arith_d.muli(arith_d.addi(arith_d.muli(entry, const_i64(s.h_kv)), head), kv_blocks),
                                   step)
        first_row = arith_d.muli(entry, self.kv_len)   # entry's key 0 in k and v viewed as [B * L, h_kv, d]
        for name, width, pack in (("k", s.d, self._keys), ("v", s.d_v, self._values)):
            row_bytes = s.h_kv * width * self.source_bytes   # between two keys of one head
            head_at = at(pointers[name], arith_d.muli(arith_d.addi(arith_d.muli(first_row, const_i64(s.h_kv)), head),
                                                      const_i64(width * self.source_bytes)))
            step_bytes = s.kv_block * width * self.packed_bytes
            out = at(pointers[f"{name}_tiles"], arith_d.muli(packed_step, const_i64(step_bytes)))
            pack(_StridedRows(head_at, row_bytes), out, width)

    def emit_rows(self, which: int, source, offsets, tiles, step, head, kv_blocks) -> None:
        """Step ``step`` of KV head ``head`` of one entry's keys (``which`` 0) or values (1) into
        ``tiles``, each key's row at ``offsets`` [h_kv, kv_blocks x kv_block] (i64 elements) of
        ``source`` (:func:`emit_packed_rows`)."""
        s = self.s
        width, pack = ((s.d, self._keys), (s.d_v, self._values))[which]
        offsets_at = at(offsets, arith_d.muli(head, arith_d.muli(kv_blocks, const_i64(s.kv_block * 8))))
        step_bytes = s.kv_block * width * self.packed_bytes
        out = at(tiles, arith_d.muli(arith_d.addi(arith_d.muli(head, kv_blocks), step), const_i64(step_bytes)))
        pack(_TableRows(source, offsets_at, self.source_bytes), out, width)

    def _row(self, rows, key, offset, vector_type) -> ir.Value:
        """A vector of key ``key``'s row from byte ``offset`` (an int or an i64 Value; the row
        clamped to the last key, zero past it)."""
        row = arith_d.minsi(key, self.last_key)
        offset = const_i64(offset) if isinstance(offset, int) else offset
        loaded = llvm_d.load(vector_type, at(rows.base, arith_d.addi(rows.offset(row), offset)), alignment=2)
        element = vector_type.element_type
        zero = ir.FloatAttr.get(element, 0.0) if isinstance(element, ir.FloatType) else ir.IntegerAttr.get(element, 0)
        zeros = arith_d.constant(vector_type, ir.DenseElementsAttr.get_splat(vector_type, zero))
        return arith_d.select(arith_d.cmpi(arith_d.CmpIPredicate.slt, key, self.kv_len), loaded, zeros)


class _TilePacking(_Packing):
    """AMX B tiles from bf16 k and v."""

    def _keys(self, rows, out, d: int) -> None:
        """Each 16 keys' 16 x 32 dims: rows of 16 dim pairs (i32) transposed to 16 rows of keys."""
        pairs = ir.VectorType.get([16], i32())

        def chunk(group, chunk):
            first = arith_d.addi(self.first_key, arith_d.muli(group, const_i64(16)))
            chunk_out = at(out, arith_d.addi(arith_d.muli(group, const_i64(d // 2 * _VECTOR)),
                                             arith_d.muli(chunk, const_i64(16 * _VECTOR))))
            offset = arith_d.muli(chunk, const_i64(_VECTOR))
            loaded = [self._row(rows, arith_d.addi(first, const_i64(i)), offset, pairs) for i in range(16)]
            for r, column in enumerate(_transposed(loaded)):
                llvm_d.store(column, at(chunk_out, r * _VECTOR), alignment=64)

        _loops(self.s.kv_block // 16, d // 32, chunk)

    def _values(self, rows, out, d_v: int) -> None:
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
                a = self._row(rows, first, chunk * _VECTOR, halves)
                b = self._row(rows, second, chunk * _VECTOR, halves)
                for half, mask in enumerate((low, high)):
                    place = arith_d.addi(arith_d.muli(const_i64(2 * chunk + half), const_i64(pair_rows * _VECTOR)),
                                         arith_d.muli(pair, const_i64(_VECTOR)))
                    llvm_d.store(vector_d.shuffle(a, b, mask), at(out, place), alignment=64)
            scf_d.YieldOp([])


class _RowPacking(_Packing):
    """f32 row tiles from f32 or f16 k and v (f16 widened)."""

    def __init__(self, shapes, kv_len: ir.Value, step: ir.Value):
        super().__init__(shapes, kv_len, step)
        self.source = element_type(shapes.dtype)
        self.source_bytes = 2 if self.source != f32() else 4
        self.packed_bytes = 4

    def _lanes(self, rows, key, offset) -> ir.Value:
        """16 f32 lanes of key ``key``'s row from byte ``offset`` (f16 widened)."""
        lanes = self._row(rows, key, offset, ir.VectorType.get([16], self.source))
        return lanes if self.source == f32() else arith_d.extf(ir.VectorType.get([16], f32()), lanes)

    def _keys(self, rows, out, d: int) -> None:
        """Each 16 keys x 16 dims transposed to 16 rows (dims) of 16 keys."""
        n = self.s.kv_block

        def chunk(group, chunk):
            first = arith_d.addi(self.first_key, arith_d.muli(group, const_i64(16)))
            chunk_out = at(out, arith_d.addi(arith_d.muli(group, const_i64(_VECTOR)),
                                             arith_d.muli(chunk, const_i64(16 * n * 4))))
            offset = arith_d.muli(chunk, const_i64(16 * self.source_bytes))
            loaded = [self._lanes(rows, arith_d.addi(first, const_i64(i)), offset) for i in range(16)]
            for r, column in enumerate(_transposed(loaded)):
                llvm_d.store(column, at(chunk_out, r * n * 4), alignment=64)

        _loops(n // 16, d // 16, chunk)

    def _values(self, rows, out, d_v: int) -> None:
        """Each key's row, in f32."""
        loop = scf_d.ForOp(const_index(0), const_index(self.s.kv_block), const_index(1))
        with ir.InsertionPoint(loop.body):
            key = as_i64(loop.induction_variable)
            row_out = at(out, arith_d.muli(key, const_i64(d_v * 4)))
            for chunk in range(d_v // 16):
                offset = 16 * chunk * self.source_bytes
                lanes = self._lanes(rows, arith_d.addi(self.first_key, key), offset)
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
