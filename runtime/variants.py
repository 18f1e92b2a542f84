"""Each variant's runtime hooks, beside its argument table (mlir/abi.py): the host check a call
runs before the kernel, and the float64 reference (runtime/reference.py) it is compared with.

A new variant adds a row here, a table in mlir/abi.py, its builder, its check and its reference;
the kernel's argument handling, keyword calls, example inputs and ``compare_backends`` follow.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from ..mlir.abi import argument_names, arguments, concrete_dims, ordered
from ..mlir.decode import DecodeSpec
from ..mlir.specs import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from . import reference
from .checks import check_f32, check_one_scale, check_scale
from .dense_checks import check_masked, check_sequence
from .errors import InputError
from .kv_checks import check_mla, check_paged, check_ragged


@dataclass(frozen=True)
class Variant:
    """``check(spec, named)``: the arguments by name, checked, by name (InputError naming the
    argument otherwise); ``reference(**named, **options)``: the float64 (output, lse) of the
    arguments by name, its keyword-only parameters filled from the spec's attributes of the same
    names (:func:`reference_options`). A pass (DecodeSpec) has no check: its caller builds its
    calls (its reference takes them in order)."""

    reference: Callable[..., tuple]
    check: Callable[..., tuple] | None = None


VARIANTS: dict[type, Variant] = {
    SequencePrefillSpec: Variant(reference.batch_sequence_prefill_kv, check_sequence),
    MaskedSequencePrefillSpec: Variant(reference.batch_sequence_prefill_kv_masked, check_masked),
    RaggedPrefillSpec: Variant(reference.batch_prefill_ragged_kv, check_ragged),
    PagedPrefillSpec: Variant(reference.batch_prefill_paged_kv, check_paged),
    MlaPagedPrefillSpec: Variant(reference.batch_prefill_paged_kv_mla, check_mla),
    DecodeSpec: Variant(reference.decode_entries),
}


def variant(spec) -> Variant:
    try:
        return VARIANTS[type(spec)]
    except KeyError:
        raise InputError(f"spec: unsupported spec type {type(spec).__name__}") from None


#: The table's array kinds checked by kind and dims, whatever the variant (mlir/abi.py).
_KIND_CHECKS = {"f32": check_f32, "scale": check_scale}


def checked(spec, args: tuple) -> tuple:
    """A call's arguments (in the table's order) checked, back in that order: the variant's check
    by name, then the ``f32`` and ``scale`` arguments of the table (``sinks``, an 8-bit cache's
    ``k_scale`` and ``v_scale``) by their kind and dims (dims are spec fields). InputError naming
    the argument otherwise."""
    table = arguments(spec)
    named = dict(zip((arg.name for arg in table), args, strict=True))
    rest = variant(spec).check(spec, {arg.name: named[arg.name] for arg in table if arg.kind not in _KIND_CHECKS})
    by_kind = {arg.name: _KIND_CHECKS[arg.kind](arg.name, named[arg.name], shape=concrete_dims(spec, arg, {}))
               for arg in table if arg.kind in _KIND_CHECKS}
    if "v_scale" in by_kind:
        check_one_scale(spec, by_kind["k_scale"], by_kind["v_scale"])
    return ordered(spec, {**rest, **by_kind})



def reference_options(spec) -> dict:
    """The keyword arguments (plain JSON values) that carry ``spec``'s compile-time choices to its
    reference function: each keyword-only parameter the spec has an attribute for."""
    parameters = inspect.signature(variant(spec).reference).parameters.values()
    options = {}
    for parameter in parameters:
        if parameter.kind is parameter.KEYWORD_ONLY and hasattr(spec, parameter.name):
            value = getattr(spec, parameter.name)
            options[parameter.name] = dict(value) if parameter.name == "rope_scaling" else value
    return options


def call_arguments(spec, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """A call's arguments in the table's positional order: ``args`` first, then ``kwargs`` by
    name (``kernel(q=q, q_indptr=..., causal=1, ...)``). Unknown, repeated or missing names
    raise InputError naming them."""
    names = argument_names(spec)
    if len(args) > len(names):
        raise InputError(f"{spec.symbol}: takes {len(names)} arguments ({', '.join(names)}), got {len(args)}")
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise InputError(f"{unknown[0]}: not an argument of {spec.symbol} ({', '.join(names)})")
    repeated = [name for name in names[:len(args)] if name in kwargs]
    if repeated:
        raise InputError(f"{repeated[0]}: given by position and by keyword")
    named = dict(zip(names, args), **kwargs)
    missing = [name for name in names if name not in named]
    if missing:
        raise InputError(f"{missing[0]}: missing (arguments of {spec.symbol}: {', '.join(names)})")
    return tuple(named[name] for name in names)
