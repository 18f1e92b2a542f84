"""The artifact cache without IREE in the loop: a counting fake compiler stands in for iree-compile."""

from __future__ import annotations

import json
import logging

import pytest

from linalg_prefill.mlir import SequencePrefillSpec
from linalg_prefill.pipeline import ArtifactCache, Target

SPEC = SequencePrefillSpec(4, 4, 64, "float32", causal=True, sm_scale=0.125)
TARGET = Target("llvm-cpu")
IR = "module {}"


class CountingCompiler:
    """``build()`` returns fixed vmfb bytes and counts its calls."""

    def __init__(self, data: bytes = b"vmfb-bytes" * 100):
        self.data, self.calls = data, 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.data


def cached_vmfb(cache: ArtifactCache):
    (path,) = cache.root.glob("*/*/*/kernel.vmfb")
    return path


def test_second_lookup_compiles_nothing(tmp_path):
    cache, compiler = ArtifactCache(tmp_path), CountingCompiler()
    assert cache.get_or_build(SPEC, TARGET, IR, compiler) == compiler.data
    assert cache.get_or_build(SPEC, TARGET, IR, compiler) == compiler.data
    assert compiler.calls == 1
    recorded = json.loads((cached_vmfb(cache).parent / "spec.json").read_text())
    assert recorded["name"] == SPEC.name and recorded["target"] == TARGET.tag


def test_other_ir_or_flags_are_other_entries(tmp_path):
    cache, compiler = ArtifactCache(tmp_path), CountingCompiler()
    cache.get_or_build(SPEC, TARGET, IR, compiler)
    cache.get_or_build(SPEC, TARGET, IR + " ", compiler)
    cache.get_or_build(SPEC, Target("llvm-cpu", "x86-64-v3"), IR, compiler)
    assert compiler.calls == 3


@pytest.mark.parametrize("damage", ["truncate", "flip", "drop spec.json"])
def test_damaged_entry_is_compiled_again(tmp_path, caplog, damage):
    cache, compiler = ArtifactCache(tmp_path), CountingCompiler()
    cache.get_or_build(SPEC, TARGET, IR, compiler)
    vmfb = cached_vmfb(cache)
    if damage == "truncate":
        vmfb.write_bytes(compiler.data[:17])
    elif damage == "flip":
        flipped = bytearray(compiler.data)
        flipped[40] ^= 0x10
        vmfb.write_bytes(bytes(flipped))
    else:
        (vmfb.parent / "spec.json").unlink()
    with caplog.at_level(logging.INFO, logger="linalg_prefill"):
        assert cache.get_or_build(SPEC, TARGET, IR, compiler) == compiler.data
    assert compiler.calls == 2
    assert ("no recorded sha256" if damage == "drop spec.json" else "damaged") in caplog.text
    assert vmfb.read_bytes() == compiler.data  # repaired in place
    assert cache.get_or_build(SPEC, TARGET, IR, compiler) == compiler.data and compiler.calls == 2


def test_unusable_cache_folder_compiles_without_storing(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cache, compiler = ArtifactCache(blocker / "cache"), CountingCompiler()
    with caplog.at_level(logging.WARNING, logger="linalg_prefill"):
        assert cache.get_or_build(SPEC, TARGET, IR, compiler) == compiler.data
        assert cache.get_or_build(SPEC, TARGET, IR, compiler) == compiler.data
    assert compiler.calls == 2
    assert "not writable" in caplog.text and "LINALG_PREFILL_CACHE_DIR" in caplog.text


def test_disabled_cache_always_compiles(tmp_path):
    cache, compiler = ArtifactCache(tmp_path, enabled=False), CountingCompiler()
    cache.get_or_build(SPEC, TARGET, IR, compiler)
    cache.get_or_build(SPEC, TARGET, IR, compiler)
    assert compiler.calls == 2 and not list(tmp_path.iterdir())


def test_log_level_from_the_environment():
    import subprocess
    import sys

    script = ("import logging, linalg_prefill; "
              "logging.getLogger('linalg_prefill.pipeline').info('hello from the test')")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={"LINALG_PREFILL_LOG": "info", "PATH": ""})
    assert "linalg_prefill INFO: hello from the test" in run.stderr
    quiet = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env={"PATH": ""})
    assert quiet.stderr == ""
    bad = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={"LINALG_PREFILL_LOG": "loud", "PATH": ""})
    assert "LINALG_PREFILL_LOG: expected debug, info, warning or error" in bad.stderr


def test_clear_removes_only_the_entries_the_cache_wrote(tmp_path):
    """A cache root shared with other files: clear() removes its entries and the folders they
    leave empty, never the root or a file it did not write (issue: clear-cache data loss)."""
    cache = ArtifactCache(tmp_path / "shared")
    cache.get_or_build(SPEC, TARGET, IR, CountingCompiler())
    cache.get_or_build(SPEC, Target("cuda"), IR, CountingCompiler())
    foreign = [cache.root / "notes.txt", cache.root / "3.13.0-mine" / "data.bin"]
    (path,) = [p for p in cache.root.glob("*/llvm-cpu-host/*") if p.is_dir()]
    foreign.append(path.parent / "keep-this-folder-0123456789abcdef" / "user.txt")
    for file in foreign:
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text("not the cache's")
    assert cache.clear() == 2
    assert all(file.read_text() == "not the cache's" for file in foreign)
    assert not list(cache.root.glob("*/*/*/kernel.vmfb")) and not list(cache.root.glob("*/*/*.lock"))
    assert not (cache.root / path.parent.parent.name / "cuda-sm_80").exists()  # emptied, so removed
    assert cache.root.is_dir()


def test_files_respect_the_process_umask(tmp_path):
    import os
    import stat

    previous = os.umask(0o022)
    try:
        cache = ArtifactCache(tmp_path)
        cache.get_or_build(SPEC, TARGET, IR, CountingCompiler())
        modes = {stat.S_IMODE(p.stat().st_mode) for p in tmp_path.glob("*/*/*/*") if p.is_file()}
        os.umask(0o077)
        cache.get_or_build(SPEC, TARGET, IR + " ", CountingCompiler())
        private = {stat.S_IMODE(p.stat().st_mode) for p in tmp_path.glob("*/*/*/*.vmfb")} - modes
    finally:
        os.umask(previous)
    assert modes == {0o644} and private == {0o600}
