"""The argument table (mlir/abi.py) is the one source of each variant's arguments: the MLIR
signature is built from it, the runtime names and positions come from it, and the host checks,
the IR and the README agree with it."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from linalg_prefill.mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
    build_module,
)
from linalg_prefill.mlir.abi import ARGUMENTS, argument_names, arguments, position, spelled
from linalg_prefill.runtime.kernels import _CHECKS

SPECS = [SequencePrefillSpec(8, 2, 64, "float32", causal=True, sm_scale=0.125),
         MaskedSequencePrefillSpec(8, 2, 64, "float16", mask_mode="padded", sm_scale=0.125),
         RaggedPrefillSpec(8, 2, 64, 32, "bfloat16"),
         PagedPrefillSpec(8, 2, 64, "float32", page_size=16, sliding_window=True),
         MlaPagedPrefillSpec(16, 64, 16, "float32", page_size=16)]
README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_variant_has_a_table():
    assert {type(spec) for spec in SPECS} == set(ARGUMENTS) == set(_CHECKS)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: type(s).__name__)
def test_the_host_check_takes_the_tables_arguments(spec):
    assert tuple(inspect.signature(_CHECKS[type(spec)]).parameters)[1:] == argument_names(spec)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: type(s).__name__)
def test_the_mlir_signature_is_the_tables(spec):
    (function,) = [op for op in build_module(spec).body.operations]
    inputs = function.type.inputs
    assert len(inputs) == len(arguments(spec))
    for arg, type_ in zip(arguments(spec), inputs):
        text = str(type_)
        if arg.kind in ("int", "float"):
            assert text == ("i32" if arg.kind == "int" else "f32"), arg.name
        else:
            assert text.startswith("tensor<") and len(arg.dims_of(spec)) == text.count("x"), (arg.name, text)
            assert text.endswith("xi32>") == (arg.kind == "index"), (arg.name, text)


WITH_WINDOWS = SPECS + [dataclasses.replace(spec, sliding_window=not spec.sliding_window) for spec in SPECS[3:]]


@pytest.mark.parametrize("spec", WITH_WINDOWS, ids=lambda s: s.symbol)
def test_the_readme_abi_table_is_the_tables(spec):
    assert f"| `{spec.symbol}` | `{spelled(spec)}` |" in README.splitlines()


def test_positions_come_from_the_table():
    paged, mla = SPECS[3], SPECS[4]
    assert position(paged, "rotary_mode") == 9 and position(paged, "causal") == 8
    assert position(mla, "rotary_mode") is None and position(mla, "sm_scale") == 7
