"""iree-compile's checks after each pass are off (pipeline/compiler.py: run_flags): the same vmfb
bytes as with them on, a module that does not verify still refused, the checks back on by the
environment."""

from __future__ import annotations

import pytest

from linalg_prefill.mlir import PagedPrefillSpec
from linalg_prefill.mlir.decode import DecodeSpec
from linalg_prefill.pipeline import CompileError, Target
from linalg_prefill.pipeline.compiler import compile_ir, run_flags
from linalg_prefill.pipeline.tuning import tuned_ir

LINALG_CPU = Target("llvm-cpu", "znver3")   # the linalg pass on any x86 host


def test_the_checks_are_off_unless_the_environment_asks_for_them(monkeypatch):
    monkeypatch.delenv("LINALG_PREFILL_COMPILER_VERIFY", raising=False)
    assert run_flags() == ["--verify=false"]
    for off in ("0", "false", "Off", "no"):
        monkeypatch.setenv("LINALG_PREFILL_COMPILER_VERIFY", off)
        assert run_flags() == ["--verify=false"], off
    monkeypatch.setenv("LINALG_PREFILL_COMPILER_VERIFY", "1")
    assert run_flags() == []


@pytest.mark.parametrize("spec, target", [
    (DecodeSpec(PagedPrefillSpec(8, 2, 64, "float32", page_size=16), 4), LINALG_CPU),
    (PagedPrefillSpec(8, 2, 64, "float16", page_size=16), Target("cuda", "sm_80")),
], ids=["llvm-cpu-pass", "cuda-kernel"])
def test_a_module_compiles_to_the_same_bytes_with_the_checks_on(monkeypatch, spec, target):
    text = tuned_ir(spec, target)
    monkeypatch.delenv("LINALG_PREFILL_COMPILER_VERIFY", raising=False)
    unchecked = compile_ir(text, target)
    monkeypatch.setenv("LINALG_PREFILL_COMPILER_VERIFY", "1")
    assert compile_ir(text, target) == unchecked


def test_a_module_that_does_not_verify_is_refused_with_the_checks_off(monkeypatch):
    monkeypatch.delenv("LINALG_PREFILL_COMPILER_VERIFY", raising=False)
    text = """func.func @f(%a: tensor<4xf32>) -> tensor<4xf32> {
  %c = arith.constant 1 : i32
  return %c : i32
}"""
    with pytest.raises(CompileError, match=r"doesn't match function result type"):
        compile_ir(text, LINALG_CPU)
