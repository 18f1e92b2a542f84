"""A kernel and its serving passes compiled as one module (mlir/bundle.py, pipeline/compiler.py:
cached_bundle), and kernels of one shape with theirs (the pre-build's bundles): the module keeps
every member's function, the vmfb serves each member, and the calls that take the passes match
the reference."""

from __future__ import annotations

import re

import numpy as np
import pytest

from linalg_prefill.mlir import PagedPrefillSpec
from linalg_prefill.mlir.bundle import NotBundled, bundled, function_name, member_symbol
from linalg_prefill.mlir.decode import DecodeSpec
from linalg_prefill.pipeline import ArtifactCache, Target
from linalg_prefill.pipeline.compiler import bundle_tasks, cached_bundle, keyed_ir, kernel_shape
from linalg_prefill.pipeline.tuning import tuned_ir
from linalg_prefill.runtime import open_kernel
from linalg_prefill.runtime.examples import example_inputs
from linalg_prefill.runtime.kernels import passes_at_open

from support import assert_matches_reference, with_arguments

KERNEL = PagedPrefillSpec(8, 2, 32, "float32", page_size=8)
PASSES = [DecodeSpec(KERNEL, queries) for queries in (1, 4)]
#: A kernel of KERNEL's shape (its dispatches mostly the same): another page size, a window.
SHAPE_MATE = PagedPrefillSpec(8, 2, 32, "float32", page_size=16, sliding_window=True)
#: An AMX CPU's lowering and a Zen 4's (both the x86 kernels and passes, whose hand-written
#: dispatches must not clash), whatever this machine is.
TARGETS = [Target("llvm-cpu", "sapphirerapids"), Target("llvm-cpu", "znver4")]


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.arch)
def test_the_bundle_keeps_every_members_function_and_renames_the_symbols_they_share(target):
    texts = [tuned_ir(spec, target) for spec in (KERNEL, *PASSES)]
    text = bundled(texts)
    for symbol in ("batch_prefill_paged_kv", "decode_entries", "decode_entries_q4"):
        assert re.search(rf"func\.func @{symbol}\(", text), symbol
    # every top-level symbol once: a second member's private symbol of a taken name is renamed
    top_level = re.findall(r"^  (?:stream\.executable|func\.func|util\.func|util\.global)\s+(?:\w+ )*@(\w+)",
                           text, flags=re.MULTILINE)
    assert len(top_level) == len(set(top_level)) and len(top_level) >= 3


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.arch)
def test_kernels_of_one_shape_share_a_module_under_names_of_their_own(target):
    """Each member's public function renamed to its member_symbol; a hand-written dispatch's
    entry another member took (the x86 passes' ``stream_chunks``) renamed with its uses: the
    module verifies, and every name is there once."""
    members = [KERNEL, PASSES[0], SHAPE_MATE, DecodeSpec(SHAPE_MATE, 1)]
    text = bundled([tuned_ir(spec, target) for spec in members], [member_symbol(spec) for spec in members])
    for spec in members:
        assert len(re.findall(rf"func\.func @{member_symbol(spec)}\(", text)) == 1, spec.name
        assert not re.search(rf"func\.func @{spec.symbol}\(", text)
    entries = re.findall(r"stream\.executable\.export public @(\w+)", text)
    assert len(entries) == len(set(entries))
    if target.lowering_of(KERNEL) == "x86":
        assert {"stream_chunks", "stream_chunks_3", "attend_entry", "attend_entry_2"} <= set(entries)
        references = set(re.findall(r"@x86\w*::@(\w+)", text))   # the dispatches of the members' executables
        assert {"stream_chunks", "stream_chunks_3", "attend_entry", "attend_entry_2"} <= references


def test_the_pre_build_groups_the_kernels_of_one_shape_on_the_cpu():
    """by_shape: KERNEL, SHAPE_MATE and their passes in one bundle on llvm-cpu (largest first);
    a kernel of another dtype alone; on CUDA each kernel with its passes."""
    cpu, cuda = TARGETS[1], Target("cuda", "sm_80")
    other = PagedPrefillSpec(8, 2, 32, "float16", page_size=8)
    tasks = [(other, cpu), (KERNEL, cpu), (PASSES[0], cpu), (SHAPE_MATE, cpu), (KERNEL, cuda), (SHAPE_MATE, cuda)]
    assert kernel_shape(KERNEL) == kernel_shape(SHAPE_MATE) != kernel_shape(other)
    assert bundle_tasks(tasks, by_shape=True) == [(cpu, [KERNEL, PASSES[0], SHAPE_MATE]), (cpu, [other]),
                                                  (cuda, [KERNEL]), (cuda, [SHAPE_MATE])]


def test_two_public_functions_of_one_name_are_not_bundled():
    text = tuned_ir(KERNEL, TARGETS[1])
    with pytest.raises(NotBundled, match="batch_prefill_paged_kv"):
        bundled([text, text])


def test_tasks_group_a_kernel_with_its_passes_per_target():
    other = PagedPrefillSpec(8, 2, 32, "float16", page_size=8)
    cpu, fused = TARGETS[1], Target("llvm-cpu", "znver4", lowering="fused")
    tasks = [(PASSES[0], cpu), (other, cpu), (KERNEL, cpu), (PASSES[1], cpu), (KERNEL, fused), (PASSES[0], cpu)]
    assert bundle_tasks(tasks) == [(cpu, [PASSES[0], KERNEL, PASSES[1]]), (cpu, [other]), (fused, [KERNEL])]


def test_the_workers_shares_build_each_bundle_once(tmp_path, monkeypatch):
    """tests/conftest.py's pre-build: each worker claims a bundle before it builds it, so two
    workers build every bundle once between them, and a bundle claimed already (by a worker
    still compiling it) is passed over, not built or waited for."""
    import conftest

    built = []
    monkeypatch.setattr(conftest, "cached_bundle",
                        lambda specs, target, cache: built.append(specs[0]) or [(b"", True)] * len(specs))
    other = PagedPrefillSpec(8, 2, 32, "float16", page_size=8)
    cpu = TARGETS[1]
    tasks = [(KERNEL, cpu), (PASSES[0], cpu), (other, cpu), (KERNEL, Target("llvm-cpu", "znver3"))]
    claims = tmp_path / "claims"
    claims.mkdir()
    (claims / "1").touch()  # the bundle of `other`, claimed by a worker that is compiling it
    first = conftest._fill_share(tasks, ArtifactCache(tmp_path / "cache"), claims, 0, 2)
    second = conftest._fill_share(tasks, ArtifactCache(tmp_path / "cache"), claims, 1, 2)
    assert built == [KERNEL, KERNEL]  # bundles 0 and 2, worker 0's share; 1 claimed before; none left for worker 1
    assert (first.compiled, second.compiled) == (3, 0)


def test_a_bundle_serves_the_kernels_of_one_shape_and_their_passes(tmp_path):
    """Two kernels of one shape and the passes they open with, compiled as one module into an
    empty cache: one vmfb for all, each member's function its member_symbol, and for each kernel
    a batch whose entries take the passes and the kernel (1, 3 and 20 queries) matches the
    reference."""
    cache, target = ArtifactCache(tmp_path / "artifacts"), Target("llvm-cpu")
    members = [spec for kernel in (KERNEL, SHAPE_MATE) for spec in (kernel, *passes_at_open(kernel, target))]
    built = cached_bundle(members, target, cache)
    assert len(members) >= 6 and all(ran for _, ran in built) and len({vmfb for vmfb, _ in built}) == 1
    assert [cache.cached(spec, target, keyed_ir(spec, target)) for spec in members] == [built[0][0]] * len(members)
    assert [function_name(spec, built[0][0]) for spec in members] == [member_symbol(spec) for spec in members]
    for spec in (KERNEL, SHAPE_MATE):
        passes = passes_at_open(spec, target)
        kernel = open_kernel(spec, target, cache=cache, serving_passes=[p.queries for p in passes])
        assert kernel.serving_passes == tuple(p.queries for p in passes)
        args = example_inputs(spec, np.random.default_rng(3), [(1, 40), (3, 77), (20, 20)])
        call = with_arguments(spec, args, causal=1)
        assert_matches_reference(spec.name, kernel(*call), spec, call)


def test_a_group_that_fails_to_compile_falls_back_to_each_kernels_bundle(tmp_path, monkeypatch):
    """A module of two kernels that IREE rejects: each kernel then compiles with its passes
    (under its own names), and every member gets its kernel's vmfb."""
    from linalg_prefill.pipeline import CompileError, compiler

    compiled = []

    def fake_compile(text, target, name="module"):
        functions = sorted(re.findall(r"^  func\.func @(\w+)\(", text, flags=re.MULTILINE))
        compiled.append(functions)
        if any("__" in function for function in functions):
            raise CompileError("a module of two kernels, refused")
        return " ".join(functions).encode()

    monkeypatch.setattr(compiler, "compile_ir", fake_compile)
    target = TARGETS[1]
    built = cached_bundle([KERNEL, PASSES[0], SHAPE_MATE], target, ArtifactCache(tmp_path / "cache"))
    assert compiled == [sorted(member_symbol(spec) for spec in (KERNEL, PASSES[0], SHAPE_MATE)),
                        ["batch_prefill_paged_kv", "decode_entries"], ["batch_prefill_paged_kv_sliding_window"]]
    assert [vmfb for vmfb, _ in built] == [b"batch_prefill_paged_kv decode_entries"] * 2 + \
        [b"batch_prefill_paged_kv_sliding_window"]
