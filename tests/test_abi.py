"""The argument table (mlir/abi.py) is the one source of each variant's arguments: the MLIR
signatures (linalg and fused) are built from it, the runtime names, positions, keyword calls and
example inputs come from it, and the host checks, the references, the IR and the README agree
with it."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import numpy as np
import pytest

from linalg_prefill.mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
    DecodeSpec, build_fused_module, build_module,
)
from linalg_prefill.mlir.abi import ARGUMENTS, argument_names, arguments, position, result_dims, spelled
from linalg_prefill.pipeline.compiler import keyed_ir
from linalg_prefill.pipeline.targets import Target
from linalg_prefill.pipeline.tuning import tuned_module
from linalg_prefill.runtime.compare import error_bound, reference_for
from linalg_prefill.runtime.errors import InputError
from linalg_prefill.runtime.examples import example_inputs
from linalg_prefill.runtime.kernels import open_kernel
from linalg_prefill.runtime.variants import VARIANTS, call_arguments, checked

SPECS = [SequencePrefillSpec(8, 2, 64, "float32", causal=True, sm_scale=0.125),
         MaskedSequencePrefillSpec(8, 2, 64, "float16", mask_mode="padded", sm_scale=0.125),
         RaggedPrefillSpec(8, 2, 64, 32, "bfloat16"),
         PagedPrefillSpec(8, 2, 64, "float32", page_size=16, sliding_window=True),
         MlaPagedPrefillSpec(16, 64, 16, "float32", page_size=16)]
README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_variant_has_a_table():
    checked = {kind for kind, hooks in VARIANTS.items() if hooks.check is not None}
    assert {type(spec) for spec in SPECS} == set(ARGUMENTS) - {DecodeSpec} == checked
    assert set(VARIANTS) == set(ARGUMENTS)  # the serving passes have a table and a reference too


#: The specs whose tables grow with an option (the custom-mask arguments, semantics §13).
WITH_OPTIONS = SPECS + [dataclasses.replace(SPECS[1], mask_mode="custom"),
                        dataclasses.replace(SPECS[2], custom_mask=True), dataclasses.replace(SPECS[3], custom_mask=True),
                        dataclasses.replace(SPECS[3], custom_mask=True, head_sinks=True),
                        dataclasses.replace(SPECS[4], head_sinks=True)]


@pytest.mark.parametrize("spec", WITH_OPTIONS, ids=lambda s: s.name)
def test_the_host_check_and_the_reference_take_the_tables_arguments_by_name(spec):
    """The check takes the call's arguments by name (but the f32 ones, runtime.variants.checked
    checks them) and returns every one of them by name; the reference names a parameter after
    each argument of the table, an option's with a default (runtime.compare.reference_for calls it
    by name)."""
    hooks = VARIANTS[type(spec)]
    table = arguments(spec)
    args = example_inputs(spec, np.random.default_rng(0))
    named = {arg.name: value for arg, value in zip(table, args) if arg.kind != "f32"}
    assert set(hooks.check(spec, named)) == set(named)
    parameters = inspect.signature(hooks.reference).parameters
    assert {arg.name for arg in table} <= set(parameters)
    required = {name for name, p in parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty}
    assert required <= {arg.name for arg in table}
    if not spec.head_sinks:
        assert argument_names(dataclasses.replace(spec, head_sinks=True)) == (*argument_names(spec), "sinks")


@pytest.mark.parametrize("spec", WITH_OPTIONS, ids=lambda s: s.name)
def test_example_inputs_pass_the_host_check(spec):
    args = example_inputs(spec, np.random.default_rng(0))
    assert len(args) == len(arguments(spec))
    checked(spec, args)  # raises InputError naming the argument otherwise


#: The variants and serving passes of each KV-cache layout (ragged, paged with a window, latent).
WITH_PASSES = SPECS + [DecodeSpec(SPECS[2], 4), DecodeSpec(SPECS[3], 1), DecodeSpec(SPECS[4], 4)]


@pytest.mark.parametrize("spec", WITH_PASSES, ids=lambda s: s.name)
def test_the_mlir_signature_is_the_tables(spec):
    module = build_module(spec)   # held while its function is read (a freed module's ops crash)
    (function,) = list(module.body.operations)
    inputs = function.type.inputs
    assert len(inputs) == len(arguments(spec))
    for arg, type_ in zip(arguments(spec), inputs):
        text = str(type_)
        if arg.kind in ("int", "float"):
            assert text == ("i32" if arg.kind == "int" else "f32"), arg.name
        else:
            assert text.startswith("tensor<") and len(arg.dims_of(spec)) == text.count("x"), (arg.name, text)
            assert text.endswith("xi32>") == (arg.kind == "index"), (arg.name, text)
    for dims, type_ in zip(result_dims(spec), function.type.results):
        assert type_.shape[len(dims) - 1] == getattr(spec, dims[-1]) and len(type_.shape) == len(dims)


HOST_READABLE = ("q_indptr", "kv_indptr", "page_indptr", "length_info")


@pytest.mark.parametrize("spec", WITH_PASSES, ids=lambda s: s.name)
def test_cpu_functions_take_storage_for_their_results_and_gpu_ones_do_not(spec):
    """llvm-cpu's modules (its record's output_storage): the table's arguments, then one
    ``!hal.buffer`` per result marked as its storage (iree.abi.output = i), in every lowering
    the CPU builds (x86 where this CPU has AMX, linalg, fused); CUDA's: the table's arguments
    only."""
    for target in (Target("llvm-cpu"), Target("llvm-cpu", lowering="linalg"), Target("llvm-cpu", lowering="fused"),
                   Target("cuda")):
        module = tuned_module(spec, target)   # held: its ops are read below
        (function,) = [op for op in module.body.operations
                       if op.operation.name == "func.func" and "sym_visibility" not in op.attributes]
        inputs, storage = list(function.type.inputs), target.record.output_storage
        assert len(inputs) == len(arguments(spec)) + (2 if storage else 0), target.tag
        if storage:
            assert [str(t) for t in inputs[-2:]] == ["!hal.buffer"] * 2
            assert [str(a) for a in list(function.arg_attrs)[-2:]] == ["{iree.abi.output = 0 : index}",
                                                                         "{iree.abi.output = 1 : index}"]


@pytest.mark.parametrize("spec", WITH_PASSES, ids=lambda s: s.name)
def test_the_fused_signature_is_the_tables(spec):
    """The fused lowering takes the same arguments; the index arrays it reads on the host are
    ``!hal.buffer_view``s."""
    module = build_fused_module(spec)   # held while its function is read
    (function,) = list(module.body.operations)
    inputs = function.type.inputs
    assert len(inputs) == len(arguments(spec))
    for arg, type_ in zip(arguments(spec), inputs):
        assert (str(type_) == "!hal.buffer_view") == (arg.name in HOST_READABLE), (arg.name, str(type_))


def test_call_arguments_bind_positions_and_names():
    spec = SPECS[4]
    names = argument_names(spec)
    values = tuple(range(len(names)))
    assert call_arguments(spec, values, {}) == values
    assert call_arguments(spec, values[:3], dict(zip(names[3:], values[3:]))) == values
    assert call_arguments(spec, (), dict(zip(reversed(names), reversed(values)))) == values
    with pytest.raises(InputError, match="^sm_scal: not an argument of batch_prefill_paged_kv_mla"):
        call_arguments(spec, values[:-1], {"sm_scal": 1.0})
    with pytest.raises(InputError, match="^q: given by position and by keyword"):
        call_arguments(spec, values, {"q": 0})
    with pytest.raises(InputError, match="^sm_scale: missing"):
        call_arguments(spec, values[:-1], {})
    with pytest.raises(InputError, match="takes 8 arguments"):
        call_arguments(spec, values + (0,), {})


@pytest.mark.compiles(SPECS[2])
def test_a_kernel_called_by_name_runs_the_positional_call(cache):
    spec = SPECS[2]
    kernel = open_kernel(spec, cache=cache)
    args = example_inputs(spec, np.random.default_rng(1))
    by_position = kernel(*args)
    by_name = kernel(args[0], **dict(zip(argument_names(spec)[1:], args[1:])))
    for a, b in zip(by_position, by_name):
        assert np.array_equal(a, b)


WITH_WINDOWS = SPECS + [dataclasses.replace(spec, sliding_window=not spec.sliding_window) for spec in SPECS[3:]]


@pytest.mark.parametrize("spec", WITH_WINDOWS, ids=lambda s: s.symbol)
def test_the_readme_abi_table_is_the_tables(spec):
    assert f"| `{spec.symbol}` | `{spelled(spec)}` |" in README.splitlines()


def test_positions_come_from_the_table():
    paged, mla = SPECS[3], SPECS[4]
    assert position(paged, "rotary_mode") == 9 and position(paged, "causal") == 8
    assert position(mla, "rotary_mode") is None and position(mla, "sm_scale") == 7


#: Query and RoPE arrays of the same type and shape: one query an entry, so q_rope_position [Lq]
#: and k_rope_pos_offset [B] are both int32 [3].
PERMUTED = RaggedPrefillSpec(4, 2, 16, 16, "float32", q_tile=8, kv_tile=16)
PERMUTED_ENTRIES = [(1, 9), (1, 30), (1, 17)]


def test_a_permuted_table_is_read_by_name_everywhere(monkeypatch, cache, request):
    """The two RoPE arrays (both tensor<?xi32>, which a positional builder would confuse without
    the verifier noticing) swapped in the table: the kernel built from that table, its check and
    its reference bind them by name, so a call by name matches the reference; the call in the old
    order hands each array to the other's name, and the reference check fails."""
    rng = np.random.default_rng(0)
    args = example_inputs(PERMUTED, rng, PERMUTED_ENTRIES)  # RoPE on
    named = dict(zip(argument_names(PERMUTED), args))
    table = ARGUMENTS[RaggedPrefillSpec]

    def swapped(spec):
        original = list(table(spec))
        i, j = (next(n for n, arg in enumerate(original) if arg.name == name)
                for name in ("q_rope_position", "k_rope_pos_offset"))
        original[i], original[j] = original[j], original[i]
        return tuple(original)

    monkeypatch.setitem(ARGUMENTS, RaggedPrefillSpec, swapped)
    for memo in (arguments, keyed_ir):  # the permuted table and its IR, not ones kept before (or after)
        memo.cache_clear()
        request.addfinalizer(memo.cache_clear)
    assert argument_names(PERMUTED).index("k_rope_pos_offset") < argument_names(PERMUTED).index("q_rope_position")
    kernel = open_kernel(PERMUTED, cache=cache)
    want = reference_for(PERMUTED, tuple(named[name] for name in argument_names(PERMUTED)))
    by_name = kernel(**named)
    bound = error_bound(PERMUTED, tuple(named[name] for name in argument_names(PERMUTED)), want)
    assert bound.holds(by_name, want)
    in_the_old_order = kernel(*args)
    assert not bound.holds(in_the_old_order, want)
