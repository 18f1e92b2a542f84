"""IREE devices: creation, and probing by driver or by backend (its record's driver,
pipeline/targets.py: BACKENDS)."""

from __future__ import annotations

import functools

import iree.runtime as rt

from ..pipeline.quiet_logging import root_logger_left_alone
from ..pipeline.targets import Target, target_for

DEFAULT_CPU_DRIVER = "local-task"

#: CPU devices get IREE's caching allocator: a kernel's transient buffers (score tiles, padded
#: outputs) are then reused from call to call instead of coming fresh from the system allocator
#: as pages that fault in on first touch (7% on the dense kernel, docs/performance.md).
#: Bounded (at most 512 MiB and 64 free buffers kept; larger requests go straight through): the
#: unbounded form keeps every size a process ever allocated, which varying shapes would grow.
CPU_ALLOCATORS = ["caching:device_local=*;512mib;64"]


@functools.cache
def get_device(driver: str) -> rt.HalDevice:
    """A process-wide device for ``driver`` ("local-task", "local-sync", "cuda", "cuda://0")."""
    try:
        with root_logger_left_alone():
            if driver.startswith("local-"):
                return rt.get_driver(driver).create_default_device(allocators=CPU_ALLOCATORS)
            return rt.get_device(driver)
    except (RuntimeError, ValueError) as err:
        raise RuntimeError(f"cannot create IREE device {driver!r}: {err}") from None


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
