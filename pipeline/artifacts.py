"""Ahead-of-time artifacts: a folder of vmfb files plus ``manifest.json``.

``build_artifacts`` compiles every (spec, target) through the on-disk :class:`ArtifactCache`
(so rebuilding compiles nothing) in a process pool, and writes ``<out>/<target tag>/<spec
name>.vmfb`` and ``<out>/manifest.json``::

    {"format": 1, "compiler_version": ..., "model": ..., "model_config": {...} or null,
     "artifacts": [{"variant", "symbol", "spec_type", "spec", "backend", "target", "arch", "flags",
                    "file", "sha256", "bytes"}, ...]}

A build holds an exclusive lock on ``<out>/.build.lock``, so two processes building into one
folder both succeed (the second one finds everything in the cache); every file is written
through a temporary file and a rename. ``load_manifest`` and ``verify_artifact`` check a folder
before use and raise :class:`ArtifactError` with the fix (rebuild with ``linalg-prefill build``).

``fill_cache`` is the same parallel build for any list of (spec, target) pairs, into the cache
only (no folder, no manifest): the test suite compiles every spec its collected tests need with
it before they run (tests/conftest.py).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ..mlir.bundle import function_name
from ..mlir.decode import DecodeSpec
from .cache import ArtifactCache, atomic_write, default_cache, file_lock
from .compiler import COMPILER_VERSION, CompileError, cached_build
from .model_config import ModelConfig
from .targets import Target, target_for

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
REBUILD_HINT = "rebuild with `linalg-prefill build --model CONFIG --out {out}`"


class ArtifactError(ValueError):
    """An artifact folder that cannot be used as is: missing, modified, or from another compiler."""


@dataclass(frozen=True)
class BuildReport:
    """What ``build_artifacts`` did: manifest entries, how many were compiled vs reused from the cache."""

    out_dir: Path
    entries: list
    compiled: int
    reused: int
    seconds: float

    @property
    def manifest_path(self) -> Path:
        return self.out_dir / MANIFEST

    def summary(self) -> str:
        return (f"{len(self.entries)} artifacts: {self.compiled} compiled, {self.reused} reused from the cache, "
                f"in {self.seconds:.1f} s; manifest {self.manifest_path}")


def build_artifacts(specs, backends, out_dir, *, jobs: int | None = None, cache: ArtifactCache | None = None,
                    progress: TextIO | bool = True, model: ModelConfig | None = None) -> BuildReport:
    """Compiles every spec for every backend (a name or a :class:`Target`) into ``out_dir``, with
    each KV-cache spec's serving passes for that backend (``Target.serving_passes``).

    ``jobs`` worker processes (default ``os.cpu_count()``) compile in parallel; ``cache`` defaults
    to the environment's cache; one progress line per finished artifact goes to ``progress`` (a
    stream; True means stderr, False silence); ``model`` names the manifest. Raises
    :class:`CompileError` listing every failed artifact (after the others finish) and then writes
    no manifest. Workers are spawned, so a script calling this needs the usual
    ``if __name__ == "__main__"`` guard.
    """
    out_dir = Path(out_dir)
    store = default_cache() if cache is None else cache
    tasks = [(spec, target_for(backend)) for backend in backends for spec in specs]
    tasks += [(pass_spec, target) for spec, target in tasks for pass_spec in target.serving_passes(spec)]
    if not tasks:
        raise ValueError("nothing to build: no specs or no backends")
    stream = sys.stderr if progress is True else progress or None
    start = time.perf_counter()
    with file_lock(out_dir / ".build.lock"):
        paths = [out_dir / _relative_file(spec, target) for spec, target in tasks]
        results = _run_pool(tasks, paths, store, jobs or os.cpu_count() or 1, stream)
        entries = [_entry(spec, target, *results[i][1:3], results[i][4]) for i, (spec, target) in enumerate(tasks)]
        manifest = {
            "format": MANIFEST_FORMAT,
            "compiler_version": COMPILER_VERSION,
            "model": model.name if model else None,
            "model_config": model.to_dict() if model else None,
            "artifacts": entries,
        }
        atomic_write(out_dir / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    compiled = sum(result[0] for result in results)
    return BuildReport(out_dir, entries, compiled, len(tasks) - compiled, time.perf_counter() - start)


@dataclass(frozen=True)
class CacheFill:
    """What ``fill_cache`` did: how many artifacts were compiled vs already in the cache."""

    compiled: int
    reused: int
    seconds: float


def fill_cache(tasks, *, jobs: int | None = None, cache: ArtifactCache | None = None,
               progress: TextIO | bool = True) -> CacheFill:
    """Compiles every (spec, target) pair of ``tasks`` (a target: a name or a :class:`Target`)
    into ``cache`` (default: the environment's) in ``jobs`` worker processes (default
    ``os.cpu_count()``), writing nothing else; ``progress`` as in ``build_artifacts``. Raises
    :class:`CompileError` listing every failed pair after the others finish. Same ``__main__``
    guard as ``build_artifacts``."""
    tasks = list(dict.fromkeys((spec, target_for(target)) for spec, target in tasks))
    start = time.perf_counter()
    if not tasks:
        return CacheFill(0, 0, 0.0)
    store = default_cache() if cache is None else cache
    stream = sys.stderr if progress is True else progress or None
    results = _run_pool(tasks, [None] * len(tasks), store, jobs or os.cpu_count() or 1, stream)
    compiled = sum(result[0] for result in results)
    return CacheFill(compiled, len(tasks) - compiled, time.perf_counter() - start)


def _run_pool(tasks, paths: list, cache: ArtifactCache, jobs: int, progress: TextIO | None) -> list:
    """``_build_one``'s result per task (written to ``paths[i]`` unless None), in task order;
    worker processes are spawned, not forked."""
    results: list = [None] * len(tasks)
    failures = []
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=context) as pool:
        futures = {pool.submit(_build_one, spec, target, paths[i], cache): i for i, (spec, target) in enumerate(tasks)}
        for done, future in enumerate(as_completed(futures), 1):
            i = futures[future]
            spec, target = tasks[i]
            try:
                results[i] = future.result()
                status = f"{'compiled' if results[i][0] else 'cached':8} {results[i][3]:6.1f} s"
            except CompileError as err:
                failures.append(f"{target.tag}/{spec.name}: {err}")
                status = "FAILED"
            if progress is not None:
                print(_progress_line(done, len(tasks), status, _relative_file(spec, target)), file=progress, flush=True)
    if failures:
        raise CompileError(f"{len(failures)} of {len(tasks)} artifacts failed:\n" + "\n".join(failures))
    return results


def _build_one(spec, target: Target, path: Path | None, cache: ArtifactCache) -> tuple[bool, str, int, float, str]:
    """Worker: the vmfb from the cache (compiling it if missing) written to ``path`` (unless None).

    Returns (compiled, sha256, size, seconds, the function it holds for ``spec``: mlir.bundle.function_name);
    ``compiled`` is True only when this call ran IREE.
    """
    start = time.perf_counter()
    data, compiled = cached_build(spec, target, cache)
    if path is not None:
        atomic_write(path, data)
    return compiled, hashlib.sha256(data).hexdigest(), len(data), time.perf_counter() - start, function_name(spec, data)


def _relative_file(spec, target: Target) -> str:
    return f"{target.tag}/{spec.name}.vmfb"


def _entry(spec, target: Target, sha256: str, size: int, symbol: str) -> dict:
    """A manifest's entry; ``symbol``: the artifact's function (``spec.symbol``, unless the
    artifact is a module of kernels of one shape that a test cache held: mlir/bundle.py)."""
    return {
        "variant": spec.name,
        **({"pass_of": spec.base.name} if isinstance(spec, DecodeSpec) else {}),  # a variant's serving pass
        "symbol": symbol,
        "spec_type": type(spec).__name__,
        "spec": spec.fields(),
        "backend": target.backend,
        "target": target.tag,
        "arch": target.arch,
        "flags": target.flags(),
        "file": _relative_file(spec, target),
        "sha256": sha256,
        "bytes": size,
    }


def _progress_line(done: int, total: int, status: str, name: str, width: int = 20) -> str:
    filled = width * done // total
    return f"[{'#' * filled}{'.' * (width - filled)}] {done:>{len(str(total))}}/{total} {status}  {name}"


def load_manifest(out_dir) -> dict:
    """The folder's manifest; raises ArtifactError when missing, unreadable, or from another compiler."""
    path = Path(out_dir) / MANIFEST
    hint = REBUILD_HINT.format(out=out_dir)
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no manifest; {hint}") from None
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path}: not valid JSON ({err}); {hint}") from None
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ArtifactError(f"{path}: manifest format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}; {hint}")
    if manifest.get("compiler_version") != COMPILER_VERSION:
        raise ArtifactError(f"{path}: built with IREE compiler {manifest.get('compiler_version')}, but "
                            f"{COMPILER_VERSION} is installed; {hint}")
    return manifest


def verify_artifact(entry: dict, out_dir) -> Path:
    """The path of a manifest entry's file after checking its sha256; raises ArtifactError if not."""
    root = Path(out_dir).resolve()
    path = (root / entry["file"]).resolve()
    hint = REBUILD_HINT.format(out=out_dir)
    if not path.is_relative_to(root):
        raise ArtifactError(f"{entry['file']}: outside the artifact folder {root}; {hint}")
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; {hint}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != entry["sha256"]:
        raise ArtifactError(f"{path}: sha256 {digest} does not match the manifest's {entry['sha256']} "
                            f"(modified or corrupted); {hint}")
    return path
