"""IREE compilation of a spec's module, through the on-disk artifact cache."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from iree.compiler import tools as iree_tools
from iree.compiler.version import VERSION as COMPILER_VERSION  # noqa: F401 (re-exported)

from ..mlir.bundle import NotBundled, bundled, member_symbol
from ..mlir.decode import DecodeSpec
from .cache import ArtifactCache, default_cache
from .quiet_logging import root_logger_left_alone
from .targets import Target, target_for
from .tuning import tuned_module

log = logging.getLogger(__name__)


class CompileError(RuntimeError):
    """IREE rejected a module; the message carries the flags and IREE's diagnostics."""


def run_flags() -> list[str]:
    """iree-compile flags of how it runs, not of what it writes, so in no artifact's key: its check
    of the module after every pass off (``--verify=false``; the module is still verified as it is
    parsed). Off, the vmfb is the same bytes (an x86 bundle, a fused CPU kernel, a CUDA kernel) and
    the compile takes 14-30% less time (docs/test-suite.md, twenty-sixth session).
    ``LINALG_PREFILL_COMPILER_VERIFY=1`` turns the checks on, to find the pass that breaks a module."""
    verify = os.environ.get("LINALG_PREFILL_COMPILER_VERIFY", "0").lower() not in ("", "0", "false", "off", "no")
    return [] if verify else ["--verify=false"]


def compile_ir(ir_text: str, target: Target, name: str = "module") -> bytes:
    """vmfb bytes for MLIR text; raises CompileError with the flags and diagnostics. ``name``
    (the spec's) only labels the log lines."""
    flags = [*target.flags(), *run_flags()]
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


def compile_specs(specs, backend: str | Target = "llvm-cpu", *, cache: ArtifactCache | None = None) -> list[bytes]:
    """vmfb bytes for each of ``specs`` on ``backend`` through the cache, in order: a kernel and
    its serving passes at open. The IR is built here, in this thread (the builders share MLIR
    contexts); the missing artifacts compile concurrently, one iree-compile process each, up to
    ``os.cpu_count()`` at a time (a cold open of paged f32, h 32/8, d 128, and its three passes on
    2 cores: 6.3-7.1 s, against 10.3-12.3 s one after another; two runs each; 3.25-3.29 s in the
    sixth session, against 4.30-4.39 s as one module, :func:`cached_bundle`, which saves CPU time
    but runs on fewer threads)."""
    target = target_for(backend)
    store = default_cache() if cache is None else cache
    results = {i: store.cached(spec, target, keyed_ir(spec, target)) for i, spec in enumerate(specs)}
    missing = [i for i, vmfb in results.items() if vmfb is None]  # each read once; these compile
    located = {i: located_ir(specs[i], target) for i in missing}

    def build(i: int) -> bytes:
        return cached_build(specs[i], target, store, located[i])[0]

    with ThreadPoolExecutor(max_workers=max(1, min(len(missing), os.cpu_count() or 1))) as pool:
        results.update(zip(missing, pool.map(build, missing)))
    return [results[i] for i in range(len(specs))]


def cached_bundle(specs, target: Target, cache: ArtifactCache) -> list[tuple[bytes, bool]]:
    """(vmfb bytes, whether IREE ran) for each of ``specs`` on ``target`` through ``cache``, those
    missing compiled as one module (mlir/bundle.py: a kernel and its passes in one iree-compile
    run, 17-23% less CPU time than one run each; kernels of one shape with their passes, each
    member's function then named mlir.bundle.member_symbol), whose vmfb each of them then keeps.
    Where they cannot share a module, or the bundle fails to compile, kernels of one shape
    compile kernel by kernel with their passes, and a kernel's bundle spec by spec (a
    CompileError then names its spec)."""
    keys = [keyed_ir(spec, target) for spec in specs]
    vmfbs = [cache.cached(spec, target, key) for spec, key in zip(specs, keys)]
    missing = [i for i, vmfb in enumerate(vmfbs) if vmfb is None]
    built, bundle = {}, {}
    if len(missing) > 1:
        shared = len({_kernel_of(specs[i]) for i in missing}) > 1   # kernels of one shape: renamed

        def build() -> bytes:   # under the first missing member's lock: another process waits for it
            texts = [keys[i] for i in missing]   # a bundle's text has no locations (mlir/bundle.py: bundled)
            symbols = [member_symbol(specs[i]) for i in missing] if shared else None
            bundle["vmfb"] = compile_ir(bundled(texts, symbols), target, " + ".join(specs[i].name for i in missing))
            return bundle["vmfb"]

        try:
            first = cache.get_or_build(specs[missing[0]], target, keys[missing[0]], build)
        except (NotBundled, CompileError) as err:
            several_kernels = len({_kernel_of(spec) for spec in specs}) > 1
            log.info("compiling %d specs %s (%s)", len(missing),
                     "kernel by kernel" if several_kernels else "one by one", str(err).splitlines()[0])
            if several_kernels:
                return _kernel_by_kernel(specs, target, cache)
        else:
            built[missing[0]] = first
            if "vmfb" in bundle:  # compiled here (else another process did, and stores the others)
                built.update({i: cache.get_or_build(specs[i], target, keys[i], lambda: bundle["vmfb"])
                              for i in missing[1:]})
    results = []
    for i, spec in enumerate(specs):
        if i in built:
            results.append((built[i], "vmfb" in bundle))
        elif vmfbs[i] is not None:
            results.append((vmfbs[i], False))
        else:
            results.append(cached_build(spec, target, cache))
    return results


def _kernel_of(spec):
    return spec.base if isinstance(spec, DecodeSpec) else spec


def _kernel_by_kernel(specs, target: Target, cache: ArtifactCache) -> list[tuple[bytes, bool]]:
    """:func:`cached_bundle` of each kernel of ``specs`` with its passes, in the order of ``specs``."""
    by_kernel: dict = {}
    for i, spec in enumerate(specs):
        by_kernel.setdefault(_kernel_of(spec), []).append(i)
    results: dict = {}
    for members in by_kernel.values():
        results.update(zip(members, cached_bundle([specs[i] for i in members], target, cache)))
    return [results[i] for i in range(len(specs))]


def bundle_tasks(tasks, by_shape: bool = False) -> list[tuple[Target, list]]:
    """``tasks`` ((spec, target) pairs) as (target, specs) groups that compile together
    (:func:`cached_bundle`): a kernel with its serving passes (DecodeSpec of it), in the order
    the pairs first appear; every other spec alone (kernels of different variants packed four to
    a module saved nothing: pre-build 306 -> 304 s, user CPU 15:12 -> 15:29, docs/test-suite.md).
    ``by_shape``: on llvm-cpu, the kernels of one :func:`kernel_shape` with their passes together
    (they share most dispatches, which a module compiles once: mlir/bundle.py), largest groups
    first."""
    groups: dict = {}
    for spec, target in tasks:
        kernel, target = _kernel_of(spec), target_for(target)
        together = kernel_shape(kernel) if by_shape and target.backend == "llvm-cpu" else kernel
        groups.setdefault((together, target), []).append(spec)
    bundles = [(target, list(dict.fromkeys(specs))) for (_, target), specs in groups.items()]
    return sorted(bundles, key=lambda bundle: -len(bundle[1])) if by_shape else bundles


def kernel_shape(kernel) -> tuple:
    """What kernels that share their dispatches have in common: the variant, the heads, the head
    dims and the dtype (RoPE, gathers, the passes' merges are the same; masks, windows, caps,
    pages, 8-bit formats and RoPE types may differ)."""
    fields = ("h_q", "h_kv", "d_qk", "d_v", "d")
    return (type(kernel).__name__, kernel.dtype, *(getattr(kernel, field, None) for field in fields))


def cached_build(spec, target: Target, cache: ArtifactCache, located: str | None = None) -> tuple[bytes, bool]:
    """(vmfb bytes, whether IREE ran) for ``spec`` on ``target`` through ``cache``: keyed by the
    IR without locations (built once per process: :func:`keyed_ir`), compiled with them so that a
    diagnostic names the builder line (printed only then, unless given as ``located``)."""
    ran = []

    def build() -> bytes:
        ran.append(True)
        return compile_ir(located or located_ir(spec, target), target, spec.name)

    return cache.get_or_build(spec, target, keyed_ir(spec, target), build), bool(ran)


@functools.lru_cache(maxsize=512)
def keyed_ir(spec, target: Target) -> str:
    """The tuned IR of ``spec`` on ``target`` without locations, the artifact cache's key: built
    once per process for the last 512 (specs and targets are frozen; a test that changes a
    builder's tables clears it, ``keyed_ir.cache_clear()``). The module stays among the last
    few built, for :func:`located_ir` to print."""
    module = tuned_module(spec, target)
    text = module.operation.get_asm()
    with _recent_lock:
        _recent[spec, target] = (text, module)
        _recent.move_to_end((spec, target))
        while len(_recent) > RECENT_MODULES:
            _recent.popitem(last=False)
    return text


def located_ir(spec, target: Target) -> str:
    """The IR :func:`keyed_ir` keys, with each op's builder line (which IREE's diagnostics then
    name): printed from the module keyed_ir built when it is among the last few and its key is
    the current one (not one from before a ``cache_clear``), else built again. A compile follows
    its key's lookup, so the build is shared (440 test artifacts: 11.3 s of building, 2.9 s of
    printing each way)."""
    key = keyed_ir(spec, target)
    with _recent_lock:
        text, module = _recent.get((spec, target), (None, None))
    if text is key:
        return module.operation.get_asm(enable_debug_info=True)
    return tuned_module(spec, target).operation.get_asm(enable_debug_info=True)


#: The modules the last keyed_ir builds made, (spec, target) -> (their key text, module).
RECENT_MODULES = 8
_recent: OrderedDict = OrderedDict()
_recent_lock = threading.Lock()
