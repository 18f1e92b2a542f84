"""Kernels from an AOT build folder (``linalg-prefill build``), with a JIT fallback.

    artifacts = open_artifacts("build/llama-3-8b", "llvm-cpu")
    kernel = artifacts.kernel(spec)       # the folder's vmfb, sha256-checked, loaded once
    output, lse = kernel(*args)

A spec the folder lacks is compiled into the artifact cache (as :func:`open_kernel` does), or,
with ``aot_only=True``, raises :class:`ArtifactError` saying how to build it. A KV-cache kernel
takes its serving passes (``Target.serving_passes``) from the folder too (``build_artifacts``
builds them), at load: a pass the folder lacks is compiled then, or with ``aot_only=True`` left
out (the entries it would take run in the passes there are, or the kernel itself).
"""

from __future__ import annotations

import threading
from pathlib import Path

from ..mlir import SPEC_TYPES
from ..mlir.bundle import function_name
from ..mlir.decode import DecodeSpec
from ..pipeline import ArtifactCache, Target, target_for
from ..pipeline.artifacts import ArtifactError, load_manifest, verify_artifact
from ..pipeline.targets import input_alignment
from .kernels import Kernel, compiled_kernels, open_kernel, ready_to_load
from .module import LoadedKernel
from .outputs import result_shapes

__all__ = ["ArtifactSet", "open_artifacts", "spec_from_entry"]


#: What a manifest entry may hold: a variant or a variant's serving pass (build_artifacts).
_ENTRY_SPEC_TYPES = {spec_type.__name__: spec_type for spec_type in (*SPEC_TYPES, DecodeSpec)}


def spec_from_entry(entry: dict):
    """The spec a manifest entry was built from (``spec_type`` and ``spec`` fields)."""
    spec_type = _ENTRY_SPEC_TYPES.get(entry["spec_type"])
    if spec_type is None:
        raise ArtifactError(f"{entry['variant']}: unknown spec type {entry['spec_type']!r}")
    return spec_type.from_fields(entry["spec"])


class ArtifactSet:
    """The artifacts of one build folder for one backend, loaded on demand.

    ``kernel(spec)`` returns the same :class:`Kernel` for the same spec, from any thread (a lock
    guards the loaded kernels; a kernel is loaded, or compiled, while the lock is held).
    """

    def __init__(self, root: Path, backend: str | Target, manifest: dict, *, aot_only: bool,
                 cache: ArtifactCache | None):
        self.root = root
        self.backend = backend
        self.aot_only = aot_only
        self._cache = cache
        self.entries = _entries(manifest, backend)
        self._kernels: dict = {}
        self._lock = threading.Lock()

    def specs(self) -> list:
        """The variant specs this folder has artifacts for on this backend, in manifest order
        (their serving passes' artifacts are not listed)."""
        return [spec for spec in map(spec_from_entry, self.entries.values()) if not isinstance(spec, DecodeSpec)]

    def kernel(self, spec) -> Kernel:
        """The loaded kernel for ``spec``: the folder's artifact, else compiled (JIT) unless aot_only."""
        with self._lock:
            kernel = self._kernels.get(spec)
            if kernel is None:
                kernel = self._kernels[spec] = self._load(spec)
            return kernel

    def _load(self, spec) -> Kernel:
        entry = self.entries.get(spec.name)
        if entry is not None:
            target = _entry_target(entry)
            passes = target.serving_passes(spec)
            missing = [] if self.aot_only else [pass_spec for pass_spec in passes if pass_spec.name not in self.entries]
            loaded = {pass_spec.queries: self._loaded(pass_spec, self.entries[pass_spec.name], target)
                      for pass_spec in passes if pass_spec.name in self.entries}
            loaded.update((pass_spec.queries, pass_kernel) for pass_spec, pass_kernel in
                          zip(missing, compiled_kernels(missing, target, target.driver, self._cache)))
            return Kernel(spec, target, self._loaded(spec, entry, target), loaded)
        if self.aot_only:
            backend = target_for(self.backend).backend
            raise ArtifactError(
                f"{spec.name}: no {backend} artifact in {self.root} (aot_only); build it there with "
                f"`linalg-prefill build --model CONFIG --out {self.root} --backends {backend}` (a model "
                f"that needs this variant) or pipeline.artifacts.build_artifacts([spec], [{backend!r}], "
                f"{str(self.root)!r}), or open the folder with aot_only=False to compile it on first use")
        return open_kernel(spec, self.backend, cache=self._cache)

    def _loaded(self, spec, entry: dict, target: Target) -> LoadedKernel:
        """The folder's artifact of ``spec`` (a variant or a serving pass), sha256-checked, loaded."""
        ready_to_load(spec, target)
        vmfb = verify_artifact(entry, self.root).read_bytes()
        return LoadedKernel(vmfb, function_name(spec, vmfb), target.driver, alignment=input_alignment(entry["flags"]),
                            results=result_shapes(spec))

    def __repr__(self) -> str:
        return f"ArtifactSet({self.root}, {target_for(self.backend).tag}, {len(self.entries)} artifacts)"


def _entries(manifest: dict, backend: str | Target) -> dict:
    """variant -> manifest entry for ``backend``; of several archs, the backend's default wins."""
    default = target_for(backend).tag
    entries: dict = {}
    for entry in manifest["artifacts"]:
        if _matches(entry, backend) and (entry["variant"] not in entries or entry["target"] == default):
            entries[entry["variant"]] = entry
    return entries


def _matches(entry: dict, backend: str | Target) -> bool:
    """A backend name matches any arch of that backend; a Target matches its tag only."""
    if isinstance(backend, Target):
        return entry["target"] == backend.tag
    return entry["backend"] == backend


def _entry_target(entry: dict) -> Target:
    """The Target of a manifest entry (its tag is ``<backend>-<arch>``)."""
    return Target(entry["backend"], entry["target"][len(entry["backend"]) + 1:])


def open_artifacts(dir, backend: str | Target = "llvm-cpu", *, aot_only: bool = False,
                   cache: ArtifactCache | None = None) -> ArtifactSet:
    """The build folder ``dir`` for ``backend``; raises ArtifactError if its manifest is unusable
    (ValueError for an unknown backend).

    ``cache`` is where specs missing from the folder are compiled (default: the environment's).
    """
    root = Path(dir)
    return ArtifactSet(root, backend, load_manifest(root), aot_only=aot_only, cache=cache)
