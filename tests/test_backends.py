"""The backend records (pipeline/targets.py: BACKENDS): unknown names and archs are errors, an
incomplete record is caught, and a new backend is one record that every reader takes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from linalg_prefill.cli import backend_list, main
from linalg_prefill.mlir import RaggedPrefillSpec, SequencePrefillSpec
from linalg_prefill.pipeline import targets
from linalg_prefill.pipeline.targets import BACKENDS, Backend, Target, check_backend
from linalg_prefill.pipeline.tuning import tuned_ir
from linalg_prefill.runtime.compare import compare_backends
from linalg_prefill.runtime.examples import example_inputs


def test_an_unknown_backend_names_itself_and_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown backend 'metal': known backends are llvm-cpu, cuda, rocm$"):
        Target("metal")


def test_an_unknown_arch_names_itself_and_the_known_ones():
    with pytest.raises(ValueError, match=r"cuda arch 'sm_90': known archs are sm_80, sm_86, sm_89, sm_120; "
                                         r"IREE 3.13 has no sm_90"):
        Target("cuda", "sm_90")
    assert Target("llvm-cpu", "x86-64-v3").flags()[2] == "--iree-llvmcpu-target-cpu=x86-64-v3"  # any LLVM CPU


def test_every_record_is_complete_and_an_incomplete_one_is_named():
    for name, record in BACKENDS.items():
        check_backend(name, record)
    fields = {f.name: getattr(BACKENDS["llvm-cpu"], f.name) for f in dataclasses.fields(Backend)}
    with pytest.raises(TypeError, match="row_chunk"):
        Backend(**{name: value for name, value in fields.items() if name != "row_chunk"})
    for field, value, why in [("lowering", "tiles", "must be one of"), ("driver", "", "non-empty"),
                              ("tune_attention", None, "callable"), ("structure_checks", [], "tuple"),
                              ("default_arch", "sm_70", "not in archs"), ("output_storage", True, "host driver")]:
        record = dataclasses.replace(BACKENDS["cuda"], **{field: value})
        with pytest.raises(TypeError, match=rf"BACKENDS\['cuda'\]\.{field}: .*{why}"):
            check_backend("cuda", record)


@pytest.fixture
def fake_backend(monkeypatch):
    """A third backend registered by its record alone: llvm-cpu's flags and hooks, its own name
    and default arch."""
    record = dataclasses.replace(BACKENDS["llvm-cpu"], name="fake-cpu", default_arch="x86-64-v3")
    monkeypatch.setitem(targets.BACKENDS, "fake-cpu", record)
    return record


def test_a_new_backend_is_one_record(fake_backend, capsys):
    target = Target("fake-cpu")
    assert (target.arch, target.lowering, target.driver, target.tag) == ("x86-64-v3", "linalg", "local-task",
                                                                          "fake-cpu-x86-64-v3")
    assert target.flags() == Target("llvm-cpu", "x86-64-v3").flags()
    for spec in (SequencePrefillSpec(4, 2, 64, "float16", causal=True, sm_scale=0.125),
                 RaggedPrefillSpec(4, 2, 192, 128, "bfloat16")):
        for lowering in ("linalg", "fused"):
            assert tuned_ir(spec, Target("fake-cpu", lowering=lowering)) == \
                tuned_ir(spec, Target("llvm-cpu", "x86-64-v3", lowering=lowering))
    assert backend_list("llvm-cpu,fake-cpu") == ["llvm-cpu", "fake-cpu"]
    assert main(["show-config"]) == 0
    shown = capsys.readouterr().out
    assert "backend fake-cpu  driver local-task, lowering linalg, arch x86-64-v3 (archs: any)" in shown


#: tests/test_wrappers.py's SEQ: the llvm-cpu artifact is pre-built (the fake backend's is not).
SHARED_SEQ = SequencePrefillSpec(4, 2, 64, "float32", causal=True, sm_scale=0.125)


@pytest.mark.compiles(SHARED_SEQ)
def test_a_new_backend_runs_against_the_reference_by_default(fake_backend, cache):
    """compare_backends' default backends come from the table: the new one runs next to llvm-cpu."""
    spec = SHARED_SEQ
    report = compare_backends(spec, example_inputs(spec, np.random.default_rng(0), ((5, 5), (3, 3))), cache=cache)
    assert {"llvm-cpu", "fake-cpu"} <= set(report.ran) and report.ok, report.table()
    if Target("llvm-cpu").lowering_of(spec) == Target("fake-cpu").lowering_of(spec):
        assert report.pairwise[0][2:] == (0.0, 0.0)  # same flags, same IR: the same artifact
    else:  # an AMX host builds llvm-cpu's in the x86 lowering (fake-cpu's arch has no AMX)
        assert report.pairwise[0][2:] != (0.0, 0.0)


def test_the_ir_builders_hold_no_target_attribute():
    """mlir/ marks an op's role (mlir.ir.mark_tiling) and the backend record supplies its tiling:
    no #iree_cpu / #iree_gpu attribute is written in mlir/, an untuned serving pass carries only the
    marks, llvm-cpu tiles them, and a GPU backend given the linalg lowering gets none of llvm-cpu's
    tilings (it used to: the passes built their CPU tilings themselves)."""
    from pathlib import Path

    from linalg_prefill.mlir import DecodeSpec, PagedPrefillSpec, build_module
    from linalg_prefill.mlir.ir import TILING_MARKER

    sources = Path(__file__).resolve().parent.parent / "mlir"
    assert not [path.name for path in sources.glob("*.py") if "#iree_cpu" in path.read_text()
                or "#iree_gpu" in path.read_text()]
    spec = DecodeSpec(PagedPrefillSpec(8, 2, 64, "float32"), 4)
    untuned = build_module(spec).operation.get_asm()
    assert TILING_MARKER in untuned and "#iree_cpu" not in untuned
    on_cpu = tuned_ir(spec, Target("llvm-cpu"))
    assert "#iree_cpu.lowering_config" in on_cpu and TILING_MARKER not in on_cpu
    on_gpu = tuned_ir(spec, Target("cuda", lowering="linalg"))
    assert "#iree_cpu" not in on_gpu and TILING_MARKER not in on_gpu
