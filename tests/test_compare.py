"""compare_backends, example_inputs and ``linalg-prefill check`` (runtime.compare, linalg_prefill.cli)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from linalg_prefill.mlir.decode import DecodeSpec
from linalg_prefill.mlir import MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec
from linalg_prefill.mlir.abi import argument_names
from linalg_prefill.pipeline import Target
from linalg_prefill.pipeline.artifacts import build_artifacts
from linalg_prefill.cli import main
from linalg_prefill.runtime import compare_backends, cuda_available, example_inputs
from linalg_prefill.runtime.compare import BackendResult, ComparisonReport, error_bound, reference_for
from linalg_prefill.runtime.variants import VARIANTS
from linalg_prefill.runtime.reference import EMPTY_ROW_LSE
from support import LLAMA3
from test_wrappers import MASKED, MLA, PAGED, RAGGED, SEQ, SLIDING

#: A bf16 spec with RoPE that tests/test_kv_cache_prefill.py compiles too.
ROTATED = RaggedPrefillSpec(8, 2, 64, 64, "bfloat16", LLAMA3)
SPECS = {"ragged": RAGGED, "paged": PAGED, "sliding_window": SLIDING, "mla": MLA, "sequence": SEQ, "masked": MASKED}


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
@pytest.mark.compiles(DecodeSpec(MLA))  # example_inputs' one-query entries take MLA's decode pass
def test_llvm_cpu_matches_reference_and_cuda_is_skipped(spec, cache):
    report = compare_backends(spec, example_inputs(spec, np.random.default_rng(0)), cache=cache)
    cpu = report.result("llvm-cpu")
    assert cpu.within_bound and cpu.empty_rows_exact and max(cpu.bound_ratio) > 0, report.table()
    assert report.ok and "err/bound" in report.table()
    if not cuda_available():
        assert report.result("cuda").skipped == "no cuda device here"
        assert report.ran == ("llvm-cpu",) and report.pairwise == ()
        assert "skipped: no cuda device here" in report.table()


@pytest.mark.compiles(SEQ, backends=("llvm-cpu", Target("llvm-cpu", "x86-64-v3")))
def test_pairwise_difference_of_two_cpu_targets(cache):
    args = example_inputs(SEQ, np.random.default_rng(1))
    report = compare_backends(SEQ, args, ("llvm-cpu", Target("llvm-cpu", "x86-64-v3")), cache=cache)
    assert report.ran == ("llvm-cpu", "llvm-cpu-x86-64-v3") and report.ok
    ((a, b, out_diff, lse_diff),) = report.pairwise
    # both within the bound of the reference, so within twice the bound of each other
    assert (a, b) == report.ran and out_diff <= 2 * report.bound.output.max() and lse_diff <= 2 * report.bound.lse.max()
    assert "llvm-cpu vs llvm-cpu-x86-64-v3" in report.table()


KV_SPECS = [
    RaggedPrefillSpec(4, 2, 64, 32, "bfloat16", {"rope_type": "gptj"}),
    PagedPrefillSpec(4, 2, 64, "float16", page_size=1, sliding_window=True),
    PagedPrefillSpec(4, 4, 128, "float32", page_size=16),
    MlaPagedPrefillSpec(4, 64, 16, "bfloat16", page_size=8, sliding_window=True),
]


@pytest.mark.parametrize("spec", KV_SPECS, ids=lambda s: s.name)
def test_example_inputs_are_valid_with_empty_rows(spec):
    args = example_inputs(spec, np.random.default_rng(2))
    named = dict(zip(argument_names(spec), args))
    VARIANTS[type(spec)].check(spec, named)  # raises InputError if the call is invalid
    q_indptr = named["q_indptr"]
    assert len(q_indptr) > 2 and len(set(np.diff(q_indptr))) > 2  # a few entries, mixed lengths
    lse = reference_for(spec, args)[1]
    assert np.any(lse == EMPTY_ROW_LSE) and np.any(lse != EMPTY_ROW_LSE)  # a qo_len > kv_len entry
    if spec.kv_layout != "ragged":
        page_values = named["page_values"]
        assert not np.array_equal(page_values, np.sort(page_values))  # shuffled pages


def test_report_out_of_bound():
    bound = error_bound(SEQ, example_inputs(SEQ, np.random.default_rng(1)))
    report = ComparisonReport(SEQ, bound, (BackendResult("llvm-cpu", 2e-4, 1e-6, True, bound_ratio=(1.5, 0.2)),
                                           BackendResult("cuda", skipped="no cuda device here")), ())
    assert not report.ok
    assert "OUT OF BOUND" in report.table() and SEQ.name in report.table() and "1.500" in report.table()
    empty_rows_wrong = BackendResult("llvm-cpu", 0.0, 0.0, False, bound_ratio=(0.1, 0.1))
    assert not ComparisonReport(SEQ, bound, (empty_rows_wrong,), ()).ok


@pytest.mark.compiles(ROTATED, DecodeSpec(ROTATED))  # example_inputs' one-query entries take the decode pass
def test_a_report_holds_the_calls_own_bound(cache):
    """A bf16 call that rotates q and k is allowed the rounding of the rotated values
    (runtime/error_model.py); the same call without RoPE is held much closer."""
    rotated = ROTATED
    args = example_inputs(rotated, np.random.default_rng(2))
    without_rope = example_inputs(rotated, np.random.default_rng(2), rotary_mode=0)
    with_rope, plain = (compare_backends(rotated, call, ("llvm-cpu",), cache=cache) for call in (args, without_rope))
    assert with_rope.ok and plain.ok
    assert with_rope.bound.lse.max() > 10 * plain.bound.lse.max()


@pytest.fixture(scope="module")
def build_dir(cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("check")
    build_artifacts([SEQ, MASKED], [Target("llvm-cpu")], out, jobs=1, cache=cache, progress=False)
    return out


def test_check_command(build_dir, capsys):
    assert main(["check", str(build_dir), "--backends", "llvm-cpu"]) == 0
    printed = capsys.readouterr().out
    assert SEQ.name in printed and MASKED.name in printed
    assert "2 variants, 2 backend runs: all within their error bounds" in printed


def test_check_command_failures(build_dir, tmp_path, capsys):
    assert main(["check", str(build_dir), "--backends", "llvm-cpu,cuda"]) == 0  # no cuda artifacts: not run
    assert main(["check", str(build_dir), "--backends", "cuda"]) == 1
    assert "nothing ran" in capsys.readouterr().out
    assert main(["check", str(build_dir), "--backends", "tpu"]) == 2
    assert "--backends 'tpu': expected comma-separated names" in capsys.readouterr().err
    copy = tmp_path / "build"
    shutil.copytree(build_dir, copy)
    vmfb = next(copy.rglob(f"{SEQ.name}.vmfb"))
    data = vmfb.read_bytes()
    vmfb.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert main(["check", str(copy), "--backends", "llvm-cpu"]) == 1
    printed = capsys.readouterr().out
    assert f"{SEQ.name}: error:" in printed and "1 OUT OF BOUND or failed" in printed
