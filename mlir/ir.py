"""One place for every MLIR/IREE Python-binding import, plus small typed-builder helpers.

Kernel builders import from here, never from ``iree.compiler`` directly. Dialect modules carry a
``_d`` suffix so that ``linalg_d.generic`` never collides with local names. Helpers only wrap the
bindings' builders (no MLIR text is parsed to build a kernel body).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Callable, Iterator, Sequence, Union

from iree.compiler import ir
from iree.compiler.dialects import arith as arith_d
from iree.compiler.dialects import func as func_d
from iree.compiler.dialects import linalg as linalg_d
from iree.compiler.dialects import math as math_d
from iree.compiler.dialects import scf as scf_d
from iree.compiler.dialects import tensor as tensor_d
# the x86 lowering's hand-written dispatch (mlir/amx.py, mlir/x86_attention.py)
from iree.compiler.dialects import builtin as builtin_d
from iree.compiler.dialects import flow as flow_d
from iree.compiler.dialects import llvm as llvm_d
from iree.compiler.dialects import memref as memref_d
from iree.compiler.dialects import stream as stream_d
from iree.compiler.dialects import vector as vector_d

__all__ = [
    "ir", "arith_d", "func_d", "linalg_d", "math_d", "scf_d", "tensor_d",
    "builtin_d", "flow_d", "llvm_d", "memref_d", "stream_d", "vector_d",
    "DYN", "module_context", "element_type", "tensor_type", "f32", "i1", "i32", "index",
    "const_index", "const_f32", "const_i32", "dim", "affine_map", "generic", "extract_slice",
    "insert_slice", "empty", "fill", "ceil_div", "storage_tiles", "to_index", "select", "expand", "collapse",
    "sizes_of", "tie_dims", "lt", "le", "logical_not", "one_of", "widened",
]

DYN = ir.ShapedType.get_dynamic_size()

IndexLike = Union[int, ir.Value]


_THIS_FILE = os.path.abspath(__file__)
#: The folder that holds mlir/: locations name builder files relative to it ("mlir/decode.py").
_SOURCE_ROOT = os.path.dirname(os.path.dirname(_THIS_FILE))


def builder_location() -> ir.Location:
    """The location of the builder line that called into this module: its file, relative to the
    source root, and line. Printed with debug info (pipeline/tuning.py: ``tuned_ir(...,
    locations=True)``), an IREE diagnostic then names the Python line that built the op."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) == _THIS_FILE:
        frame = frame.f_back
    if frame is None:
        return ir.Location.unknown()
    return ir.Location.file(os.path.relpath(frame.f_code.co_filename, _SOURCE_ROOT), frame.f_lineno, 0)


def _located(helper: Callable) -> Callable:
    """``helper``'s ops (and those its callbacks build) carry the caller's :func:`builder_location`."""
    @functools.wraps(helper)
    def located(*args, **kwargs):
        with builder_location():
            return helper(*args, **kwargs)
    return located


@contextlib.contextmanager
def module_context() -> Iterator[ir.Module]:
    """Opens a context with an unknown location and yields an empty module to build into. The
    context runs single-threaded: a multi-threaded verifier reports a failure from a worker
    thread, whose diagnostic then waits for the GIL that the verifying thread holds, so a builder
    bug hung ``verify()`` instead of raising (seen building mlir/x86_attention.py)."""
    with ir.Context() as context, ir.Location.unknown():
        context.enable_multithreading(False)
        module = ir.Module.create()
        yield module


def element_type(dtype: str) -> ir.Type:
    """The MLIR element type of a spec's dtype ("float32", "float16", "bfloat16": mlir/dtypes.py)."""
    from .dtypes import ir_dtype

    return ir_dtype(dtype).element_type()


def tensor_type(shape: Sequence[int], elem: ir.Type) -> ir.RankedTensorType:
    return ir.RankedTensorType.get(list(shape), elem)


def f32() -> ir.Type:
    return ir.F32Type.get()


def i1() -> ir.Type:
    return ir.IntegerType.get_signless(1)


def i8() -> ir.Type:
    return ir.IntegerType.get_signless(8)


def i32() -> ir.Type:
    return ir.IntegerType.get_signless(32)


def index() -> ir.Type:
    return ir.IndexType.get()


def widened(value: ir.Value) -> ir.Value:
    """A float scalar as f32: extended when narrower (f16, bf16), unchanged when already f32."""
    if isinstance(value.type, ir.F32Type):
        return value
    return arith_d.extf(f32(), value)


def narrowed(elem: ir.Type, value: ir.Value) -> ir.Value:
    """An f32 scalar rounded to the float type ``elem`` (unchanged when it has that type)."""
    return value if value.type == elem else arith_d.truncf(elem, value)


def const_index(value: int) -> ir.Value:
    return arith_d.constant(index(), value)


def const_f32(value: float) -> ir.Value:
    return arith_d.constant(f32(), value)


def const_i32(value: int) -> ir.Value:
    return arith_d.constant(i32(), value)


def const_int(type_: ir.Type, value: int) -> ir.Value:
    """An integer constant of ``type_``, splat where it is a vector type."""
    if isinstance(type_, ir.VectorType):
        return arith_d.constant(type_, ir.DenseElementsAttr.get_splat(type_, ir.IntegerAttr.get(type_.element_type,
                                                                                                  value)))
    return arith_d.constant(type_, value)


def to_index(value: IndexLike) -> ir.Value:
    """An index Value from a Python int, an index Value, or an i32 Value."""
    if isinstance(value, int):
        return const_index(value)
    if isinstance(value.type, ir.IntegerType):
        return arith_d.index_cast(index(), value)
    return value


def dim(tensor: ir.Value, axis: int) -> ir.Value:
    return tensor_d.dim(tensor, const_index(axis))


def ceil_div(a: IndexLike, b: IndexLike) -> ir.Value:
    return arith_d.ceildivsi(to_index(a), to_index(b))


def storage_tiles(length: IndexLike, tile: int) -> ir.Value:
    """Tiles a buffer of ``length`` rows is padded to: ceil(length / tile), but at least 1.

    Loops still run ceil(length / tile) times; the spare tile only keeps a zero-length entry from
    allocating a zero-byte buffer, which IREE 3.13's CUDA driver rejects (``hal.device.queue.alloca``
    INVALID_ARGUMENT; the llvm-cpu driver accepts it).
    """
    return arith_d.maxsi(ceil_div(length, tile), const_index(1))


def select(cond: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
    return arith_d.select(cond, a, b)


def lt(a: ir.Value, b: ir.Value) -> ir.Value:
    """``a < b`` for signed index (or integer) values."""
    return arith_d.cmpi(arith_d.CmpIPredicate.slt, a, b)


def is_one(flag: ir.Value) -> ir.Value:
    """``flag == 1`` for an i32 runtime flag (``causal``, ``rotary_mode``), as an i1."""
    return arith_d.cmpi(arith_d.CmpIPredicate.eq, flag, arith_d.constant(i32(), 1))


def logical_not(flag: ir.Value) -> ir.Value:
    """``!flag`` for an i1."""
    return arith_d.xori(flag, arith_d.constant(ir.IntegerType.get_signless(1), 1))


def one_of(condition: ir.Value, if_true: Callable, if_false: Callable, carried: Sequence[ir.Value],
           tie: Callable) -> list[ir.Value]:
    """``if_true(carried)`` when ``condition`` holds, else ``if_false(carried)``; both return values
    typed like ``carried``, and ``tie`` states the dynamic dims of each branch's results.

    Built as two ``scf.if`` ops, each with its work in the then-branch and ``carried`` passed
    through the else-branch: IREE 3.13 miscompiled loops placed in an else-branch (wrong outputs).
    """
    for holds, body in ((condition, if_true), (logical_not(condition), if_false)):
        branch = scf_d.IfOp(holds, [value.type for value in carried], has_else=True)
        with ir.InsertionPoint(branch.then_block):
            scf_d.YieldOp(list(body(carried)))
        with ir.InsertionPoint(branch.else_block):
            scf_d.YieldOp(list(carried))
        carried = tie(branch.results)
    return list(carried)


def le(a: ir.Value, b: ir.Value) -> ir.Value:
    """``a <= b`` for signed index (or integer) values."""
    return arith_d.cmpi(arith_d.CmpIPredicate.sle, a, b)


def affine_map(n_dims: int, dims: Sequence[int]) -> ir.AffineMap:
    """The projection ``(d0, ..., d{n_dims-1}) -> (d{dims[0]}, d{dims[1]}, ...)``."""
    return ir.AffineMap.get(n_dims, 0, [ir.AffineDimExpr.get(d) for d in dims])


@_located
def generic(
    inputs: Sequence[ir.Value],
    outputs: Sequence[ir.Value],
    maps: Sequence[ir.AffineMap],
    iterators: str,
    body: Callable[..., Sequence[ir.Value]],
) -> list[ir.Value]:
    """Builds a ``linalg.generic`` and returns its results.

    ``iterators`` spells one letter per loop: ``p`` parallel, ``r`` reduction. ``body`` receives
    the block arguments (inputs then outputs, as scalars) and returns the values to yield.
    """
    kinds = {"p": linalg_d.IteratorType.parallel, "r": linalg_d.IteratorType.reduction}
    op = linalg_d.GenericOp_(
        list(inputs),
        list(outputs),
        ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps]),
        [kinds[c] for c in iterators],
    )
    block = op.regions[0].blocks[0]
    with ir.InsertionPoint(block):
        linalg_d.YieldOp(list(body(*block.arguments)))
    return list(op.results)


def _split_static(values: Sequence[IndexLike]) -> tuple[list[ir.Value], list[int]]:
    dynamic, static = [], []
    for v in values:
        if isinstance(v, int):
            static.append(v)
        else:
            static.append(DYN)
            dynamic.append(v)
    return dynamic, static


@_located
def extract_slice(
    source: ir.Value, offsets: Sequence[IndexLike], sizes: Sequence[IndexLike]
) -> ir.Value:
    """A unit-stride ``tensor.extract_slice``; an int is static, a Value dynamic."""
    dyn_off, st_off = _split_static(offsets)
    dyn_size, st_size = _split_static(sizes)
    elem = ir.RankedTensorType(source.type).element_type
    result = tensor_type(st_size, elem)
    return tensor_d.extract_slice(
        result, source, dyn_off, dyn_size, [], st_off, st_size, [1] * len(st_size)
    )


@_located
def insert_slice(
    source: ir.Value, dest: ir.Value, offsets: Sequence[IndexLike], sizes: Sequence[IndexLike]
) -> ir.Value:
    """A unit-stride ``tensor.insert_slice`` of ``source`` into ``dest`` at ``offsets``."""
    dyn_off, st_off = _split_static(offsets)
    dyn_size, st_size = _split_static(sizes)
    return tensor_d.insert_slice(
        source, dest, dyn_off, dyn_size, [], st_off, st_size, [1] * len(st_size)
    )


@_located
def empty(sizes: Sequence[IndexLike], elem: ir.Type) -> ir.Value:
    """``tensor.empty`` with int (static) or Value (dynamic) sizes."""
    return tensor_d.empty(list(sizes), elem)


@_located
def fill(value: ir.Value, sizes: Sequence[IndexLike], elem: ir.Type) -> ir.Value:
    """A tensor of ``sizes`` filled with the scalar ``value``."""
    out = empty(sizes, elem)
    return linalg_d.fill(value, outs=[out])


@_located
def expand(source: ir.Value, groups: Sequence[Sequence[int]], sizes: Sequence[IndexLike]) -> ir.Value:
    """``tensor.expand_shape``: source dim i becomes the result dims in ``groups[i]``."""
    dynamic, static = _split_static(sizes)
    elem = ir.RankedTensorType(source.type).element_type
    return tensor_d.expand_shape(tensor_type(static, elem), source, groups, dynamic, static)


@_located
def collapse(source: ir.Value, groups: Sequence[Sequence[int]]) -> ir.Value:
    """``tensor.collapse_shape``: each group of source dims becomes one result dim."""
    src = ir.RankedTensorType(source.type)
    shape = []
    for group in groups:
        sizes = [src.shape[i] for i in group]
        shape.append(DYN if DYN in sizes else _product(sizes))
    return tensor_d.collapse_shape(tensor_type(shape, src.element_type), source, groups)


def _product(values: Sequence[int]) -> int:
    result = 1
    for v in values:
        result *= v
    return result


def sizes_of(tensor: ir.Value) -> list[IndexLike]:
    """Each dim of ``tensor``: an int where static, a ``tensor.dim`` Value where dynamic."""
    shape = ir.RankedTensorType(tensor.type).shape
    return [dim(tensor, i) if s == DYN else s for i, s in enumerate(shape)]


@_located
def on_target_device(tensor: ir.Value, sizes: Sequence[IndexLike]) -> ir.Value:
    """``tensor`` placed on the compile target's device (``flow.tensor.transfer`` to
    ``@__device_0``, the one device every artifact targets); ``sizes`` as for :func:`tie_dims`.

    Use it on the initial value of every loop-carried tensor. Without it IREE 3.13 cannot tell
    which device the carried value lives on, inserts a ``stream.async.transfer`` of it on every
    iteration and copies the whole tensor each trip (a 16-tile loop over a 32 MiB output copied
    512 MiB). With it the tile updates happen in place; tests/test_ir_structure.py checks that the
    stream IR of our loops has no copy left. (A ``stream.affinity`` attribute on the function does
    the same but trips IREE's IPO pass; IREE's Python bindings have no builder for
    ``#hal.device.affinity``, so that attribute is parsed.)
    """
    dynamic = [s for s in sizes if not isinstance(s, int)]
    affinity = ir.Attribute.parse("#hal.device.affinity<@__device_0>")
    op = ir.Operation.create("flow.tensor.transfer", results=[tensor.type], operands=[tensor, *dynamic],
                             attributes={"target": affinity})
    return op.result


@_located
def own_dispatch(build: Callable[[], ir.Value], result_type: ir.Type, sizes: Sequence[IndexLike]) -> ir.Value:
    """The ``result_type`` tensor ``build()`` makes, computed in a ``flow.dispatch.region`` of its
    own (``sizes`` as for :func:`tie_dims`), so that IREE neither fuses it into its consumers nor
    moves it into their loop: a layout built once before a loop stays built once (left to fusion,
    IREE 3.13 recomputed the fused kernels' K/V tiles inside every query band)."""
    return own_dispatch_results(lambda: [build()], [result_type], [sizes])[0]


@_located
def own_dispatch_results(build: Callable[[], list[ir.Value]], result_types: Sequence[ir.Type],
                         sizes: Sequence[Sequence[IndexLike]]) -> list[ir.Value]:
    """:func:`own_dispatch` for several results: the tensors ``build()`` makes (of
    ``result_types``, each of its ``sizes``), computed in one dispatch."""
    dynamic = [s for shape in sizes for s in shape if not isinstance(s, int)]
    region_op = ir.Operation.create(
        "flow.dispatch.region", results=list(result_types), operands=dynamic,
        attributes={"operandSegmentSizes": ir.DenseI32ArrayAttr.get([len(dynamic), 0])}, regions=2)
    with ir.InsertionPoint(region_op.regions[0].blocks.append()):
        ir.Operation.create("flow.return", operands=build())
    return list(region_op.results)


#: The discardable attribute of a generic whose tiling a backend chooses (pipeline/tuning.py:
#: apply_tuning): its role (``"pass.scores.rows"``, ...) and the sizes its tiling reads.
TILING_MARKER = "linalg_prefill.tiling"


def mark_tiling(value: ir.Value, role: str, *, drop_unit_loops: bool = False, **sizes: int) -> list[ir.Value]:
    """Marks the generic that produces ``value`` with its ``role`` and ``sizes`` and returns its
    results (use them in place of the op's own); each backend's ``tune_generic`` hook turns the
    mark into its tiling (pipeline/cpu_tiles.py for llvm-cpu) or drops it. IREE keeps an llvm-cpu
    tiling only while it leaves the op's dims alone: build the op with dims nothing can collapse,
    in a dispatch of its own where fusion would rebuild it. IREE also folds every dim of static
    extent 1 (FoldUnitExtentDims rebuilds the op without its attributes); with
    ``drop_unit_loops`` the op is rebuilt here without such loops (:func:`without_unit_loops`)
    and the mark names them (``unit_loops``) for the hook to leave out. (Not for ops IREE fuses
    with another tiled op: two tilings in one dispatch fail to compile.)"""
    op = value.owner
    unit = _unit_loops(op) if drop_unit_loops else set()
    generic_op, results = without_unit_loops(op, unit) if unit else (op, list(op.results))
    i64 = ir.IntegerType.get_signless(64)
    generic_op.attributes[TILING_MARKER] = ir.DictAttr.get(
        {"role": ir.StringAttr.get(role), "unit_loops": ir.DenseI64ArrayAttr.get(sorted(unit)),
         **{name: ir.IntegerAttr.get(i64, size) for name, size in sizes.items()}})
    return results


#: The discardable attribute of a hand-written GPU dispatch's function: the threads of its
#: workgroup, which the backend's ``tune_dispatch`` hook turns into IREE's translation_info
#: (pipeline/tuning.py: apply_tuning; no backend attribute is written in mlir/).
DISPATCH_MARKER = "linalg_prefill.dispatch"


def dispatch_mark(threads: int) -> dict[str, ir.Attribute]:
    """The function attributes of a hand-written GPU dispatch of ``threads`` a workgroup."""
    i64 = ir.IntegerType.get_signless(64)
    return {DISPATCH_MARKER: ir.DictAttr.get({"threads": ir.IntegerAttr.get(i64, threads)})}


def tiling_mark(op: ir.Operation) -> tuple[str, dict[str, int], tuple[int, ...]]:
    """(role, sizes, unit loops) of a generic :func:`mark_tiling` marked; the sizes and the
    role's tiling count the unit loops, which the op no longer has."""
    marks = ir.DictAttr(op.attributes[TILING_MARKER])
    role = ir.StringAttr(marks["role"]).value
    unit = tuple(ir.DenseI64ArrayAttr(marks["unit_loops"]))
    sizes = {}
    for index in range(len(marks)):
        named = marks[index]
        if named.name not in ("role", "unit_loops"):
            sizes[named.name] = ir.IntegerAttr(named.attr).value
    return role, sizes, unit


def _unit_loops(op) -> set[int]:
    """The loops of a linalg.generic that index a tensor operand's dim of static extent 1."""
    maps = [ir.AffineMapAttr(m).value for m in ir.ArrayAttr(op.attributes["indexing_maps"])]
    unit = set()
    for operand, amap in zip(op.operands, maps):
        if not isinstance(operand.type, ir.RankedTensorType):
            continue
        shape = ir.RankedTensorType(operand.type).shape
        for axis, expr in enumerate(amap.results):
            if shape[axis] == 1 and isinstance(expr, ir.AffineDimExpr):
                unit.add(expr.position)
    return unit


def _dropping(shape_rank: int, dropped: set[int]) -> list[list[int]]:
    """collapse_shape groups that fold each dropped (extent-1) dim into a kept neighbour."""
    groups, pending = [], []
    for axis in range(shape_rank):
        if axis in dropped:
            (groups[-1] if groups else pending).append(axis)
        else:
            groups.append(pending + [axis])
            pending = []
    return groups


def without_unit_loops(op, unit: set[int]) -> tuple[ir.Operation, list[ir.Value]]:
    """Rebuilds the linalg.generic ``op`` (projection maps only) without the loops ``unit``,
    which have extent 1: each operand's dims on them collapsed away, their ``linalg.index`` 0, the
    other loops renumbered, the results expanded back to ``op``'s types. Returns the new generic
    and those results; ``op`` is erased."""
    maps = [ir.AffineMapAttr(m).value for m in ir.ArrayAttr(op.attributes["indexing_maps"])]
    n_loops = maps[0].n_dims
    kept = [loop for loop in range(n_loops) if loop not in unit]
    renumber = {loop: new for new, loop in enumerate(kept)}
    kinds = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
    iterators = [linalg_d.IteratorType.reduction if "reduction" in kinds[loop] else linalg_d.IteratorType.parallel
                 for loop in kept]
    n_inputs = len(op.operands) - len(op.results)
    with op.location, ir.InsertionPoint(op):
        operands, new_maps, output_groups = [], [], []
        for index, (operand, amap) in enumerate(zip(op.operands, maps)):
            positions = [ir.AffineDimExpr(expr).position for expr in amap.results]  # projections only
            dropped = {axis for axis, loop in enumerate(positions) if loop in unit}
            groups = _dropping(len(positions), dropped)
            operands.append(collapse(operand, groups) if dropped else operand)
            new_maps.append(affine_map(len(kept), [renumber[loop] for loop in positions if loop not in unit]))
            if index >= n_inputs:
                output_groups.append((groups, sizes_of(operand), bool(dropped)))
        new = linalg_d.GenericOp_(operands[:n_inputs], operands[n_inputs:],
                                  ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in new_maps]), iterators)
        old_block, block = op.regions[0].blocks[0], new.regions[0].blocks[0]
        for old_arg, arg in zip(old_block.arguments, block.arguments):
            old_arg.replace_all_uses_with(arg)
        for inner in list(old_block.operations):
            inner.detach_from_parent()
            ir.InsertionPoint(block).insert(inner)
        i64 = ir.IntegerType.get_signless(64)
        for inner in list(block.operations):
            if inner.operation.name != "linalg.index":
                continue
            loop = ir.IntegerAttr(inner.attributes["dim"]).value
            if loop in unit:
                with ir.InsertionPoint(inner):
                    zero = const_index(0)
                inner.result.replace_all_uses_with(zero)
                inner.operation.erase()
            else:
                inner.attributes["dim"] = ir.IntegerAttr.get(i64, renumber[loop])
        results = [expand(result, groups, sizes) if dropped else result
                   for result, (groups, sizes, dropped) in zip(new.results, output_groups)]
    for old, result in zip(op.results, results):
        old.replace_all_uses_with(result)
    op.operation.erase()
    return new, results


def buffer_view_type() -> ir.Type:
    """``!hal.buffer_view``: what every tensor argument is at the VM level (parsed: no builder)."""
    return ir.Type.parse("!hal.buffer_view")


class HostReadable:
    """An int32 index argument that both dispatches and the host program read.

    The function takes it as ``!hal.buffer_view`` (at the VM level the same argument as a tensor)
    and imports it as ``tensor`` for the dispatches; the host loads elements straight from its
    buffer (``hal.buffer.load``). The runtime allocates such arguments host-local and mappable
    (runtime/module.py), so a host read inside a loop is a memory read, not a copy from the
    device and a wait, and offsets computed from it stay plain host values (IREE 3.13 writes a
    dispatch result in place only at such offsets).
    """

    def __init__(self, view: ir.Value, rank: int, name: str):
        self.dims = [_op("hal.buffer_view.dim", [view], index(), {"index": ir.IntegerAttr.get(index(), i)})
                     for i in range(rank)]
        self.buffer = _op("hal.buffer_view.buffer", [view], ir.Type.parse("!hal.buffer"))
        self.tensor = ir.Operation.create(
            "hal.tensor.import", results=[tensor_type([DYN] * rank, i32())], operands=[view, *self.dims],
            attributes={"name": ir.StringAttr.get(name), "target_encoding": ir.TypeAttr.get(tensor_type([DYN] * rank, i32())),
                        "operandSegmentSizes": ir.DenseI32ArrayAttr.get([1, rank, 0, 0])}).result

    def load(self, indices: Sequence[ir.Value]) -> ir.Value:
        """The element at ``indices`` (row-major), read on the host, as an index."""
        flat = indices[0]
        for dim_size, i in zip(self.dims[1:], indices[1:]):
            flat = arith_d.addi(arith_d.muli(flat, dim_size), i)
        offset = arith_d.muli(flat, const_index(4))
        return arith_d.index_cast(index(), _op("hal.buffer.load", [self.buffer, offset], i32()))


def _op(name: str, operands: list, result: ir.Type, attributes: dict | None = None) -> ir.Value:
    return ir.Operation.create(name, results=[result], operands=operands, attributes=attributes or {}).result


@_located
def bitcast(tensor: ir.Value, shape: Sequence[int], elem: ir.Type) -> ir.Value:
    """A static-shape tensor reinterpreted as ``shape`` x ``elem`` of the same bytes
    (``flow.tensor.bitcast``: no copy, a dispatch boundary)."""
    result = tensor_type(shape, elem)
    return ir.Operation.create("flow.tensor.bitcast", results=[result], operands=[tensor],
                               attributes={"operandSegmentSizes": ir.DenseI32ArrayAttr.get([1, 0, 0])}).result


def tie_dims(tensor: ir.Value, sizes: Sequence[IndexLike]) -> ir.Value:
    """``tensor`` annotated with its dynamic dims (``flow.tensor.tie_shape``).

    IREE must know the dynamic dims of every tensor that crosses host-side control flow (``scf.if``
    results, ``scf.for`` iter_args and results) and cannot always derive them; tying states them.
    ``sizes`` lists every dim; only the Values (dynamic dims) are used.
    """
    dynamic = [s for s in sizes if not isinstance(s, int)]
    if not dynamic:
        return tensor
    op = ir.Operation.create("flow.tensor.tie_shape", results=[tensor.type], operands=[tensor, *dynamic])
    return op.result
