"""IREE's diagnostics name the Python line that built the failing op (mlir/ir.py:
builder_location): artifacts compile from IR printed with each op's builder line."""

from __future__ import annotations

import re

import pytest

from linalg_prefill.mlir import PagedPrefillSpec
from linalg_prefill.mlir import decode
from linalg_prefill.mlir.decode import DecodeSpec
from linalg_prefill.pipeline import ArtifactCache, CompileError, Target, compile_spec, cpu_tiles
from linalg_prefill.pipeline.compiler import keyed_ir
from linalg_prefill.pipeline.tuning import tuned_ir


def test_ops_carry_their_builder_lines_and_the_cache_key_does_not():
    spec = DecodeSpec(PagedPrefillSpec(8, 2, 64, "float32"), 4)
    located = tuned_ir(spec, Target("llvm-cpu"), locations=True)
    lines = {int(n) for n in re.findall(r'loc\("mlir/decode\.py":(\d+)', located)}
    source = open(decode.__file__).read().splitlines()
    assert lines and all(1 <= n <= len(source) for n in lines)
    assert any("generic(" in source[n - 1] for n in lines)  # the contractions' own lines
    assert "loc(" not in tuned_ir(spec, Target("llvm-cpu"))


def test_a_compile_error_names_the_builder_line(tmp_path, monkeypatch, request):
    """Tiles of 1024 lanes on the ops the pass builder marks with a role (llvm-cpu's tilings:
    pipeline/cpu_tiles.py) make IREE 3.13 reject the first of them ("large vector sizes"); the
    error names the line of mlir/decode.py that built it."""
    for role, tiling in list(cpu_tiles.CPU_GENERIC_TILINGS.items()):
        def oversized(tiling=tiling, **sizes):
            levels = tiling(**sizes)
            levels["vector_common_parallel"] = [1024 if size else 0 for size in levels["vector_common_parallel"]]
            return levels

        monkeypatch.setitem(cpu_tiles.CPU_GENERIC_TILINGS, role, oversized)
    keyed_ir.cache_clear()  # the oversized tilings' IR (pipeline/compiler.py keeps a process's IR)
    request.addfinalizer(keyed_ir.cache_clear)
    spec = DecodeSpec(PagedPrefillSpec(8, 2, 64, "float32"), 4)
    linalg_cpu = Target("llvm-cpu", "znver3")   # the linalg pass on any host (an AVX-512 CPU's f32 one is x86)
    with pytest.raises(CompileError, match=r"large vector sizes") as error:
        compile_spec(spec, linalg_cpu, cache=ArtifactCache(tmp_path))
    named = re.search(r"mlir/decode\.py:(\d+):0: error", str(error.value))
    assert named, str(error.value)[:2000]
    assert "generic(" in open(decode.__file__).read().splitlines()[int(named.group(1)) - 1]
