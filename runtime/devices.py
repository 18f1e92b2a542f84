"""IREE devices: creation, probing and the mapping from backend names to drivers."""

from __future__ import annotations

import functools

import iree.runtime as rt

DEFAULT_CPU_DRIVER = "local-task"


@functools.cache
def get_device(driver: str) -> rt.HalDevice:
    """A process-wide device for ``driver`` ("local-task", "local-sync", "cuda", "cuda://0")."""
    try:
        return rt.get_device(driver)
    except (RuntimeError, ValueError) as err:
        raise RuntimeError(f"cannot create IREE device {driver!r}: {err}") from None


def device_available(driver: str) -> bool:
    """True when a device for ``driver`` can actually be created (listing a driver is not enough)."""
    try:
        get_device(driver)
    except RuntimeError:
        return False
    return True


def cuda_available() -> bool:
    return device_available("cuda")
