"""Each variant's arguments, in the seed's positional order: the one table the MLIR signatures,
the runtime's argument names and positions, and the README's ABI table are derived from.

A dim is an int, the name of a spec field (``"h_q"``, ``"d_qk"``, ``"page_size"``), or a symbol
the call decides (``"B"``, ``"Lq"``, ...: dynamic). Kinds: ``tensor`` in the spec's dtype,
``kv`` the keys and values in the spec's KV-cache dtype (dtypes.kv_dtype_of: its dtype unless it
reads 8-bit pages), ``f32`` a float32 array whatever the spec's dtype, ``scale`` a float32 array
of positive finite scales, ``index`` an int32 array, ``mask`` a custom mask (bool or uint8 at the
call, i8 in the IR), ``int`` an i32 scalar, ``float`` an f32 scalar. A spec with an 8-bit KV
cache takes ``k_scale, v_scale [h_kv]`` after its table's arguments (semantics §15), a spec with
``head_sinks`` takes ``sinks [h_q]`` f32 (natural-log logits, semantics §13) after every other.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Callable, Union

from .arg import Arg, Dims
from .ir import DYN, buffer_view_type, element_type, f32, func_d, i32, i8, ir, module_context, tensor_type
from .mask_rules import mask_rule
from .dtypes import kv_dtype_of
from .specs import MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec


def _scalars(*names: str) -> tuple[Arg, ...]:
    return tuple(Arg(name, "float" if name in _FLOAT_SCALARS else "int") for name in names)


_FLOAT_SCALARS = ("rope_scale", "rope_theta", "sm_scale")
_ROPE_SCALARS = _scalars("causal", "rotary_mode", "rope_scale", "rope_theta", "sm_scale")
_DENSE = (Arg("q", "tensor", ("B", "Lq", "h_q", "d")), Arg("k", "kv", ("B", "Lk", "h_kv", "d")),
          Arg("v", "kv", ("B", "Lk", "h_kv", "d")))
_PAGE_TABLE = (Arg("page_indptr", "index", ("B+1",)), Arg("page_values", "index", ("nnz",)),
               Arg("length_info", "index", lambda spec: (3, "B") if spec.sliding_window else ("B",)))

_RAGGED = (
    Arg("q", "tensor", ("Lq", "h_q", "d_qk")), Arg("q_indptr", "index", ("B+1",)),
    Arg("k", "kv", lambda spec: spec.layout.key_dims), Arg("v", "kv", lambda spec: spec.layout.value_dims),
    Arg("kv_indptr", "index", ("B+1",)), Arg("q_rope_position", "index", ("Lq",)),
    Arg("k_rope_pos_offset", "index", ("B",)), *_ROPE_SCALARS)
_PAGED = (
    Arg("q", "tensor", ("Lq", "h_q", "d")), Arg("q_indptr", "index", ("B+1",)),
    Arg("pages", "kv", lambda spec: spec.layout.page_dims), *_PAGE_TABLE,
    Arg("k_rope_pos_offset", "index", ("B",)), Arg("q_rope_position", "index", ("Lq",)), *_ROPE_SCALARS)


def _with_mask_rule(base: tuple[Arg, ...]) -> Callable[[object], tuple[Arg, ...]]:
    """``base``, then the arguments of the spec's mask rule (mlir/mask_rules.py: ``arguments``):
    valid_lens, a custom mask and its offsets, or none."""
    return lambda spec: (*base, *mask_rule(spec).arguments)


#: Each variant's arguments (a callable of the spec where they depend on it).
ARGUMENTS: dict[type, Union[tuple[Arg, ...], Callable[[object], tuple[Arg, ...]]]] = {
    SequencePrefillSpec: _DENSE,
    MaskedSequencePrefillSpec: _with_mask_rule(_DENSE),
    RaggedPrefillSpec: _with_mask_rule(_RAGGED),
    PagedPrefillSpec: _with_mask_rule(_PAGED),
    MlaPagedPrefillSpec: (
        Arg("q", "tensor", ("Lq", "h_q", "d_qk")), Arg("q_indptr", "index", ("B+1",)),
        Arg("pages", "kv", ("P", "page_size", "d_qk")), *_PAGE_TABLE, *_scalars("causal", "sm_scale")),
}


#: The per-head sink logits of a spec with ``head_sinks``: always the last argument.
SINKS = Arg("sinks", "f32", ("h_q",))
#: The per-KV-head scales of a spec with an 8-bit KV cache (its ``kv_dtype``), after its table.
KV_SCALES = (Arg("k_scale", "scale", ("h_kv",)), Arg("v_scale", "scale", ("h_kv",)))


@functools.cache
def arguments(spec) -> tuple[Arg, ...]:
    """The variant's argument table (kept per spec: a serving call reads it several times)."""
    try:
        table = ARGUMENTS[type(spec)]
    except KeyError:
        raise TypeError(f"spec: no argument table for {type(spec).__name__}") from None
    table = table(spec) if callable(table) else table
    scales = KV_SCALES if getattr(spec, "kv_dtype", None) else ()  # a serving pass's are among its kv_sources
    return (*table, *scales, *((SINKS,) if spec.head_sinks else ()))


def argument_names(spec) -> tuple[str, ...]:
    """The variant's argument names in the seed's positional order."""
    return tuple(arg.name for arg in arguments(spec))


def position(spec, name: str) -> int | None:
    """The position of argument ``name`` in the variant's call, or None when it has none."""
    names = argument_names(spec)
    return names.index(name) if name in names else None


def concrete_dims(spec, arg: Arg, sizes: dict) -> tuple[int, ...]:
    """``arg``'s dims for one call: ints as they are, spec fields read from ``spec``, symbols
    (``"B"``, ``"Lq"``, ``"Lk"``, ``"P"``, ...) from ``sizes``."""
    return tuple(d if isinstance(d, int) else sizes[d] if d in sizes else getattr(spec, d) for d in arg.dims_of(spec))


def _dim(spec, value) -> int:
    return value if isinstance(value, int) else getattr(spec, value, DYN)


def _tensor_type(spec, arg: Arg) -> ir.Type:
    elem = {"tensor": element_type(spec.dtype), "kv": element_type(kv_dtype_of(spec)), "f32": f32(), "scale": f32(),
            "mask": i8()}.get(arg.kind, i32())
    return tensor_type([_dim(spec, d) for d in arg.dims_of(spec)], elem)


def argument_types(spec, host_readable: tuple[str, ...] = ()) -> list[ir.Type]:
    """The MLIR types of the variant's arguments (in an open context): symbols are dynamic; the
    index arguments named in ``host_readable`` are ``!hal.buffer_view`` (the fused lowering reads
    them on the host side of its dispatches)."""
    types = []
    for arg in arguments(spec):
        if arg.name in host_readable:
            types.append(buffer_view_type())
        elif arg.kind in ("tensor", "kv", "f32", "scale", "index", "mask"):
            types.append(_tensor_type(spec, arg))
        else:
            types.append(i32() if arg.kind == "int" else f32())
    return types


def result_dims(spec) -> tuple[Dims, Dims]:
    """(output, lse) dims: the output is q's with ``d_v`` columns, lse q's without its last dim."""
    q_dims = arguments(spec)[0].dims_of(spec)
    return (*q_dims[:-1], "d_v"), q_dims[:-1]


def result_types(spec) -> list[ir.Type]:
    """The MLIR types of (output, lse), in an open context: output in the spec's dtype, lse f32."""
    out_dims, lse_dims = result_dims(spec)
    return [tensor_type([_dim(spec, d) for d in out_dims], element_type(spec.dtype)),
            tensor_type([_dim(spec, d) for d in lse_dims], f32())]


def kv_sources(spec) -> tuple[Arg, ...]:
    """The arguments a call's keys and values are read from: its KV tensors, then their scales
    where the spec has an 8-bit KV cache."""
    return tuple(arg for arg in arguments(spec) if arg.kind in ("kv", "scale"))


def function_module(spec, emit: Callable[[Mapping[str, ir.Value]], list],
                    host_readable: tuple[str, ...] = ()) -> ir.Module:
    """A verified module with one function ``spec.symbol(*arguments) -> (output, lse)`` typed by
    the table; ``emit(args)`` builds its body from the block arguments by name (``args["q"]``,
    ``args["sinks"]`` with ``head_sinks``: :func:`bound_arguments`) and returns the results."""
    with module_context() as module:
        with ir.InsertionPoint(module.body):
            fn = func_d.FuncOp(spec.symbol, (argument_types(spec, host_readable), result_types(spec)))
            with ir.InsertionPoint(fn.add_entry_block()):
                func_d.ReturnOp(emit(bound_arguments(spec, fn.arguments)))
        module.operation.verify()
        return module


#: The argument attribute naming the result an ``!hal.buffer`` argument is the storage of.
OUTPUT_STORAGE_ATTRIBUTE = "iree.abi.output"


def with_output_storage(module: ir.Module) -> ir.Module:
    """``module`` with each public function taking, after its arguments, one ``!hal.buffer`` per
    result (``{iree.abi.output = i}``): storage the caller passes and IREE's entry point writes
    result i into (the results come back as views of it), instead of buffers IREE allocates.
    On the CPU drivers the runtime passes arrays of its own there (runtime/module.py), so a call
    no longer copies its results out of IREE's buffers: 2.5 ms of a 26 ms dense bf16 call of
    2048 tokens (docs/performance.md, thirteenth session). In place; returns ``module``."""
    with module.context, ir.Location.unknown():
        storage = ir.Type.parse("!hal.buffer")
        index = ir.IndexType.get()
        for op in module.body.operations:
            if op.operation.name != "func.func" or "sym_visibility" in op.attributes and \
                    ir.StringAttr(op.attributes["sym_visibility"]).value != "public":
                continue
            kind = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
            inputs, results = list(kind.inputs), list(kind.results)
            block = op.regions[0].blocks[0]
            for _ in results:
                block.add_argument(storage, ir.Location.unknown())
            op.attributes["function_type"] = ir.TypeAttr.get(
                ir.FunctionType.get(inputs + [storage] * len(results), results))
            given = list(ir.ArrayAttr(op.attributes["arg_attrs"])) if "arg_attrs" in op.attributes else \
                [ir.DictAttr.get({})] * len(inputs)
            op.attributes["arg_attrs"] = ir.ArrayAttr.get(
                given + [ir.DictAttr.get({OUTPUT_STORAGE_ATTRIBUTE: ir.IntegerAttr.get(index, i)})
                         for i in range(len(results))])
        module.operation.verify()
    return module


def bound_arguments(spec, values) -> Mapping[str, ir.Value]:
    """A function's block arguments by their names in the table (read-only)."""
    return MappingProxyType(dict(zip(argument_names(spec), values, strict=True)))


def operands(part, args: Mapping[str, ir.Value]) -> dict:
    """The arguments ``part`` (a KV layout, a mask rule) declares in its ``operands``, by name,
    and those of its ``optional_operands`` the call has (a layout's scales of 8-bit pages)."""
    return {**{name: args[name] for name in part.operands},
            **{name: args[name] for name in getattr(part, "optional_operands", ()) if name in args}}


def ordered(spec, named: dict) -> tuple:
    """The values of ``named`` (argument name -> value) in the variant's positional order."""
    return tuple(named[name] for name in argument_names(spec))


def spelled(spec) -> str:
    """The argument list as the README's ABI table writes it: ``q [Lq, h_q, d_qk], ..., causal``."""
    return ", ".join(f"{arg.name} [{', '.join(map(str, arg.dims_of(spec)))}]" if arg.dims else arg.name
                     for arg in arguments(spec))
