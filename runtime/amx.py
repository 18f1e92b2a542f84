"""The AMX register state a process asks Linux for before its first tile instruction.

Linux (5.16 and later) gives a process the 8 KiB of AMX tile data state only on request:
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; without it the first tile instruction
kills the process with SIGILL. The runtime asks once per process, before it loads the first
kernel built in the AMX lowering (runtime/kernels.py, runtime/artifact_set.py).
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

#: x86-64 Linux: the arch_prctl syscall, its request, and the tile data's state component.
SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

_granted = False
_lock = threading.Lock()


class AmxUnavailable(RuntimeError):
    """The OS refused the AMX tile state (or this is not x86-64 Linux): AMX kernels cannot run."""


def request_amx_state() -> None:
    """Asks Linux for the AMX tile data state of this process, once; AmxUnavailable naming the
    CPU feature and the OS's answer where it is refused."""
    global _granted
    with _lock:
        if _granted:
            return
        if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
            raise AmxUnavailable(f"the AMX kernels (CPU feature amx_tile) need x86-64 Linux, this is "
                                 f"{platform.system()} {platform.machine()}")
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
            errno = ctypes.get_errno()
            raise AmxUnavailable(
                f"the AMX kernels need the CPU's amx_tile state (XTILEDATA), which Linux refused: "
                f"arch_prctl(ARCH_REQ_XCOMP_PERM) failed with {os.strerror(errno)} (errno {errno}); open the "
                f"kernel with Target('llvm-cpu', lowering='fused') or a named arch without AMX instead")
        _granted = True
