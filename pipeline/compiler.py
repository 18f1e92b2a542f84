"""IREE compilation of a spec's module, through the on-disk artifact cache."""

from __future__ import annotations

import logging
import time

from iree.compiler import tools as iree_tools
from iree.compiler.version import VERSION as COMPILER_VERSION  # noqa: F401 (re-exported)

from .cache import ArtifactCache, default_cache
from .quiet_logging import root_logger_left_alone
from .targets import Target, target_for
from .tuning import tuned_module

log = logging.getLogger(__name__)


class CompileError(RuntimeError):
    """IREE rejected a module; the message carries the flags and IREE's diagnostics."""


def compile_ir(ir_text: str, target: Target, name: str = "module") -> bytes:
    """vmfb bytes for MLIR text; raises CompileError with the flags and diagnostics. ``name``
    (the spec's) only labels the log lines."""
    flags = target.flags()
    log.info("compiling %s for %s", name, target.tag)
    start = time.perf_counter()
    try:
        with root_logger_left_alone():
            vmfb = iree_tools.compile_str(ir_text, input_type="auto", extra_args=flags)
    except iree_tools.CompilerToolError as err:
        raise CompileError(f"iree-compile failed for {target.tag} with flags {flags}:\n{err}") from None
    log.info("compiled %s for %s in %.1f s (%d bytes)", name, target.tag, time.perf_counter() - start, len(vmfb))
    return vmfb


def compile_spec(spec, backend: str | Target = "llvm-cpu", *, cache: ArtifactCache | None = None) -> bytes:
    """vmfb bytes for ``spec`` on ``backend``, compiled once and then served from the cache."""
    return cached_build(spec, target_for(backend), default_cache() if cache is None else cache)[0]


def cached_build(spec, target: Target, cache: ArtifactCache) -> tuple[bytes, bool]:
    """(vmfb bytes, whether IREE ran) for ``spec`` on ``target`` through ``cache``: keyed by the
    IR without locations, compiled with them so that a diagnostic names the builder line."""
    module = tuned_module(spec, target)
    ran = []

    def build() -> bytes:
        ran.append(True)
        return compile_ir(module.operation.get_asm(enable_debug_info=True), target, spec.name)

    return cache.get_or_build(spec, target, module.operation.get_asm(), build), bool(ran)
