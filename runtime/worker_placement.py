"""Where the CPU device's worker threads run relative to the thread that calls a kernel.

IREE's local-task device pins one worker a CPU (``iree-worker-0`` on the first of its CPUs,
``iree-worker-1`` on the next, ...). A kernel's calling thread runs wherever the OS puts it, and
inside a torch model it shares the cores with torch's OpenMP workers, which keep spinning for a
few milliseconds after each parallel op (libgomp's default wait). Measured on a 2-core Intel Xeon
(model 207; docs/performance.md, eleventh session), a decode step of a Llama-3-shaped model
through transformers, f32, 2048 cached: the attention's calls took 3.7-4.2 ms a step when the
caller ran on the CPU of the last worker and 6.8-7.5 ms when it ran on ``iree-worker-0``'s, with
the threads placed by hand either way and with the workers' CPUs swapped (the slow case follows
the caller, not the CPU). Which CPU the caller lands on is the OS's choice, fixed for most of a
process's life, so one process in two was the slow one.

:class:`WorkerPlacement` keeps the first worker off the caller's CPU: before a call it reads the
caller's CPU (``sched_getcpu``, no system call) and, when that is the first worker's, swaps the
CPUs of the first and the last worker (two ``sched_setaffinity`` calls, only when the caller has
moved, at most once every :data:`MIN_SWAP_INTERVAL_S`: callers on different CPUs do not move the
workers back and forth at every call). Only where every worker is pinned to one CPU of its own
and there are at least two; elsewhere (another OS, no glibc, threads not found) it does nothing.
``LINALG_PREFILL_WORKER_PLACEMENT=0`` switches it off. An IREE worker sets its own CPU once, as
its thread starts (``iree_task_worker_main``); on a loaded machine that can come after a first
call's swap, and left both workers on one CPU (seen once in a fresh-clone test run, fifteenth
session): every call reads the two workers' CPUs (two ``sched_getaffinity`` calls, under a
microsecond) and puts back the placement where a worker has moved itself.

:func:`waiting_as_batch` runs a call with the calling thread under ``SCHED_BATCH`` (Linux: no
wakeup preemption) and then puts it back to ``SCHED_OTHER``. The caller waits for the workers in
IREE's runtime, and inside a torch model that wait spun: a decode step of 4 sequences (bf16, 2048
cached, ``bench/hf_decode.py``'s model), per call of 5.3 ms the calling thread used 3.5 ms of CPU
and torch's OpenMP worker 3.1, on the two CPUs the two IREE workers needed for their 1.7 ms each;
with the caller as ``SCHED_BATCH``, 2.3 ms a call, the caller 0.2 ms of CPU (docs/performance.md,
twelfth session). A short call gains nothing (one sequence's decode call, 0.5-0.8 ms, did not
spin) and pays for the later wakeup (3-4% of its time), so a kernel call waits this way only
where the kernel's previous call took :data:`BATCH_WAIT_FROM_S` or longer (runtime/module.py). A
thread under another policy (FIFO, RR, IDLE, BATCH already) is left as it is.
``LINALG_PREFILL_BATCH_WAIT=0`` switches it off.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

from .devices import c_library

T = TypeVar("T")

#: How many calls may pass before two workers or more are found (IREE may not have started them
#: all at the first call; a process whose device has one worker never finds two); then the
#: placement gives up.
FIND_ATTEMPTS = 8
WORKER_NAME = "iree-worker-"
#: The shortest time between two swaps: threads calling kernels at once from different CPUs
#: would otherwise swap the workers at every call (a decode step's calls come from one thread).
MIN_SWAP_INTERVAL_S = 0.05


def _sched_getcpu():
    """glibc's ``sched_getcpu`` (the vDSO's: no system call), or None without it."""
    function = getattr(c_library(), "sched_getcpu", None)
    if function is None:
        return None
    function.restype = ctypes.c_int
    function.argtypes = []
    return function


def iree_workers(task_dir: Path = Path("/proc/self/task")) -> list[tuple[int, int]]:
    """(thread id, index) of this process's IREE worker threads (named ``iree-worker-<index>``),
    by index; empty where /proc has none."""
    workers = []
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        if name.startswith(WORKER_NAME) and name[len(WORKER_NAME):].isdigit():
            workers.append((int(task.name), int(name[len(WORKER_NAME):])))
    return sorted(workers, key=lambda worker: worker[1])


class WorkerPlacement:
    """Keeps ``iree-worker-0`` off the calling thread's CPU (module docstring); one per process,
    :data:`PLACEMENT`, called by every CPU kernel call (runtime/module.py)."""

    def __init__(self, enabled: bool = True):
        self._getcpu = _sched_getcpu() if enabled else None
        self._lock = threading.Lock()
        self._first = self._last = None   # [thread id, CPU] of the first and the last worker
        self._attempts = 0
        self._last_swap = float("-inf")
        self.swaps = 0

    @property
    def active(self) -> bool:
        return self._getcpu is not None

    @property
    def first_worker_cpu(self) -> int | None:
        """The CPU this placement keeps the first worker on (None before it has found its
        workers); a worker that set its own CPU since is put back there at the next call."""
        return None if self._first is None else self._first[1]

    def before_call(self) -> None:
        """Moves the first worker off the caller's CPU if it is on it (module docstring)."""
        if self._getcpu is None:
            return
        cpu = self._getcpu()
        if self._first is None:
            if not self._find():
                return
        with self._lock:
            first, last = self._first, self._last
            try:
                if os.sched_getaffinity(first[0]) != {first[1]} or os.sched_getaffinity(last[0]) != {last[1]}:
                    os.sched_setaffinity(first[0], {first[1]})   # a worker that set its own CPU as it started
                    os.sched_setaffinity(last[0], {last[1]})
                now = time.monotonic()
                if cpu != first[1] or now - self._last_swap < MIN_SWAP_INTERVAL_S:
                    return
                os.sched_setaffinity(first[0], {last[1]})
                os.sched_setaffinity(last[0], {first[1]})
            except OSError:   # a worker gone or not ours to move: leave IREE's placement
                self._getcpu = None
                return
            first[1], last[1] = last[1], first[1]
            self._last_swap = now
            self.swaps += 1

    def _find(self) -> bool:
        """Finds the first and last worker and their CPUs; gives up (inactive) after
        FIND_ATTEMPTS calls without them or where they are not one CPU each on distinct CPUs."""
        with self._lock:
            if self._first is not None:
                return True
            self._attempts += 1
            workers = iree_workers()
            try:
                cpus = [os.sched_getaffinity(tid) for tid, _ in workers]
            except OSError:
                cpus = []
            if len(cpus) < 2:   # none or one listed yet (IREE may still be starting them)
                if self._attempts >= FIND_ATTEMPTS:
                    self._getcpu = None
                return False
            if not all(len(c) == 1 for c in cpus) or len(set().union(*cpus)) < len(cpus):
                self._getcpu = None   # not one CPU each: IREE's placement is not ours to adjust
                return False
            self._first = [workers[0][0], next(iter(cpus[0]))]
            self._last = [workers[-1][0], next(iter(cpus[-1]))]
            return True


PLACEMENT = WorkerPlacement(os.environ.get("LINALG_PREFILL_WORKER_PLACEMENT", "1") != "0")

#: The shortest previous call of a kernel after which its next call waits as SCHED_BATCH.
BATCH_WAIT_FROM_S = 1e-3
#: Whether :func:`waiting_as_batch` switches the caller's policy (``LINALG_PREFILL_BATCH_WAIT=0``:
#: not), and the parameters of the switch (Linux only).
BATCH_WAIT = (os.environ.get("LINALG_PREFILL_BATCH_WAIT", "1") != "0" and hasattr(os, "SCHED_BATCH")
              and hasattr(os, "sched_setscheduler"))
_NO_PRIORITY = os.sched_param(0) if hasattr(os, "sched_param") else None


def waiting_as_batch(call: Callable[[], T]) -> T:
    """``call()`` with the calling thread under ``SCHED_BATCH`` while it runs, when the thread is
    under ``SCHED_OTHER`` (module docstring); three system calls, 1.1 us in a loop."""
    if not BATCH_WAIT:
        return call()
    try:
        switched = os.sched_getscheduler(0) == os.SCHED_OTHER
        if switched:
            os.sched_setscheduler(0, os.SCHED_BATCH, _NO_PRIORITY)
    except OSError:
        switched = False
    try:
        return call()
    finally:
        if switched:
            os.sched_setscheduler(0, os.SCHED_OTHER, _NO_PRIORITY)
