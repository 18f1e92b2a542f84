"""IREE devices: creation, and probing by driver or by backend (its record's driver,
pipeline/targets.py: BACKENDS)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import iree.runtime as rt

from ..mlir.x86_attention import WORKER_STACK_BYTES
from ..pipeline.quiet_logging import root_logger_left_alone
from ..pipeline.targets import Target, target_for
from .errors import InputError

DEFAULT_CPU_DRIVER = "local-task"

#: CPU devices get IREE's caching allocator: a kernel's transient buffers (score tiles, padded
#: outputs) are then reused from call to call instead of coming fresh from the system allocator
#: as pages that fault in on first touch (7% on the dense kernel, docs/performance.md).
#: Bounded (at most 512 MiB and 64 free buffers kept; larger requests go straight through): the
#: unbounded form keeps every size a process ever allocated, which varying shapes would grow.
CPU_ALLOCATORS = ["caching:device_local=*;512mib;64"]

#: Host blocks up to this size come from the C heap instead of fresh mmap'ed pages, and freed
#: ones stay in it up to this size (glibc's M_MMAP_THRESHOLD, 32 MiB at most by default, and
#: M_TRIM_THRESHOLD). IREE 3.13's local-task device takes a call's transients (a serving pass's
#: scores) past the caching allocator, straight from malloc: every call mapped them (or grew the
#: heap) anew and faulted each page in on first touch (the 32 x 16 vs 1024 f32 pass 100 -> 64 ms,
#: docs/performance.md). Process-wide, set when the first CPU device is created;
#: LINALG_PREFILL_KEEP_HOST_MEMORY=0 leaves malloc as it is.
HOST_MEMORY_KEPT = 1 << 30
_MALLOPT = {"M_TRIM_THRESHOLD": -1, "M_MMAP_THRESHOLD": -3}  # glibc's parameter numbers


@functools.cache
def get_device(driver: str) -> rt.HalDevice:
    """A process-wide device for ``driver`` ("local-task", "local-sync", "cuda", "cuda://0")."""
    try:
        with root_logger_left_alone():
            if driver.startswith("local-"):
                keep_host_memory()
                give_workers_stack()
                return rt.get_driver(driver).create_default_device(allocators=CPU_ALLOCATORS)
            return rt.get_device(driver)
    except (RuntimeError, ValueError) as err:
        raise RuntimeError(f"cannot create IREE device {driver!r}: {err}") from None


def cpu_workers() -> int:
    """How many worker threads the CPU devices run, at most: one per CPU of
    :func:`pin_cpu_threads`' ids when they were given, else one per CPU this process may run on
    (IREE's default topology takes one per physical core, so with SMT this counts more workers
    than there are, never fewer)."""
    return len(_pinned_ids) or len(os.sched_getaffinity(0))


_pinned_ids: list[int] = []


def pin_cpu_threads(cpu_ids) -> list[int]:
    """Runs the CPU devices' worker threads on ``cpu_ids``, one thread on each (IREE's
    ``--task_topology_cpu_ids``). IREE's default places a process's workers on the host's first
    CPUs, so processes sharing a host (the ranks of ``torchrun``) would all run on the same ones;
    ``linalg_prefill.distributed.pin_rank_threads`` gives each rank its own share. Process-wide:
    call before the first kernel opens (RuntimeError after, when it could no longer apply)."""
    ids = sorted({int(i) for i in cpu_ids})
    if not ids or ids[0] < 0:
        raise InputError(f"cpu_ids: expected CPU ids >= 0, got {cpu_ids!r}")
    if get_device.cache_info().currsize:
        raise RuntimeError("pin_cpu_threads: an IREE device exists already; call it before the first kernel opens")
    rt.flags.parse_flags(f"--task_topology_cpu_ids={','.join(map(str, ids))}")
    _pinned_ids[:] = ids
    return ids


def give_workers_stack() -> None:
    """Gives the CPU device's worker threads WORKER_STACK_BYTES of stack (IREE's
    ``--task_worker_stack_size``; its default, 128 KiB, is less than the x86 kernels' workgroup
    buffers of wide heads take: mlir/x86_attention.py, STACK_BUDGET). Process-wide, read when a
    local-task device is created; a device created before keeps its workers."""
    rt.flags.parse_flags(f"--task_worker_stack_size={WORKER_STACK_BYTES}")


@functools.cache
def c_library() -> ctypes.CDLL | None:
    """This process's C library through ctypes, or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_host_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to HOST_MEMORY_KEPT (see there); False where that
    is switched off or the C library has no ``mallopt`` (not glibc)."""
    if os.environ.get("LINALG_PREFILL_KEEP_HOST_MEMORY", "1") == "0":
        return False
    mallopt = getattr(c_library(), "mallopt", None)
    if mallopt is None:
        return False
    return all(mallopt(parameter, HOST_MEMORY_KEPT) == 1 for parameter in _MALLOPT.values())


def device_available(driver: str) -> bool:
    """True when a device for ``driver`` can actually be created (listing a driver is not enough)."""
    return device_problem(driver) is None


def device_problem(driver: str) -> str | None:
    """Why no device for ``driver`` can be created here (IREE's first line), or None when one can."""
    try:
        get_device(driver)
    except RuntimeError as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        return lines[0] if lines else "unknown error"
    return None


def backend_available(backend: str | Target) -> bool:
    """True when a device for the backend's driver can be created here."""
    return device_available(target_for(backend).driver)


def cuda_available() -> bool:
    return backend_available("cuda")
