"""Host memory on CPU devices (runtime/devices.py: keep_host_memory): a call's transients come
from the C heap and stay there, so a second call of the same shape faults none of them in again.
"""

from __future__ import annotations

import ctypes
import platform
import resource

import numpy as np
import pytest

from linalg_prefill.mlir import PagedPrefillSpec
from linalg_prefill.mlir.bundle import function_name
from linalg_prefill.mlir.decode import DECODE_PASSES, DecodeSpec
from linalg_prefill.pipeline import compile_spec, target_for
from linalg_prefill.runtime import open_kernel
from linalg_prefill.runtime.decode import decode_calls, pass_queries
from linalg_prefill.runtime.devices import keep_host_memory
from linalg_prefill.runtime.module import LoadedKernel
from linalg_prefill.runtime.outputs import result_shapes
from linalg_prefill.runtime.examples import example_inputs

SPEC = PagedPrefillSpec(8, 2, 64, "float32", page_size=16)
# 16 entries of 16 queries over 4096 keys: the 16-query pass's scores take about 100 MB (with
# glibc's defaults, 50 MB faulted 0 pages in again: IREE or glibc kept them; 100 MB faulted in
# 20,000 of its 28,672 pages on every call).
ENTRIES = [(16, 4096)] * 16
PAGE = 4096
# 1024 entries of 16 queries over 128 keys: results held across calls leaked (below)
HELD_ENTRIES = [(16, 128)] * 1024

pytestmark = pytest.mark.compiles(SPEC, passes=ENTRIES)


def test_keep_host_memory_is_set_on_glibc_and_can_be_switched_off(monkeypatch):
    assert keep_host_memory() == (platform.libc_ver()[0] == "glibc")
    monkeypatch.setenv("LINALG_PREFILL_KEEP_HOST_MEMORY", "0")
    assert not keep_host_memory()


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_a_second_call_faults_few_of_its_transient_pages_in(cache):
    kernel = open_kernel(SPEC, "llvm-cpu", cache=cache)
    args = example_inputs(SPEC, np.random.default_rng(0), ENTRIES, rotary_mode=0)
    kernel(*args)
    before = _minor_faults()
    kernel(*args)
    faults = _minor_faults() - before
    scores = DecodeSpec(SPEC, 16).scratch_per_key * sum(kv_len for _, kv_len in ENTRIES)
    assert faults < scores / PAGE / 4, f"{faults} page faults for {scores / 2**20:.0f} MiB of scores"


def _heap_in_use() -> int:
    """Bytes glibc's main heap has handed out and not taken back (mallinfo2's uordblks)."""
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    return libc.mallinfo2().uordblks


needs_mallinfo2 = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or tuple(map(int, platform.libc_ver()[1].split("."))) < (2, 33),
    reason="glibc's mallinfo2 only")


@needs_mallinfo2
@pytest.mark.parametrize("to_host", [True, False])
def test_results_held_across_calls_leave_no_memory_behind(cache, to_host):
    """IREE 3.13 (local-task) kept 64 MiB for good on every step of two calls of the 16-query
    pass over 1024 entries (32 MiB of results, about 200 MiB of scratch) whose first results were
    alive during the second and freed after it (none with 16 keys an entry, or 256 entries);
    runtime/module.py has the call write its results into arrays of its own (the CPU artifacts
    take storage for them) or copies them out, so no buffer of IREE's outlives it."""
    target = target_for("llvm-cpu")
    pass_spec = DecodeSpec(SPEC, 16)
    vmfb = compile_spec(pass_spec, target, cache=cache)
    loaded = LoadedKernel(vmfb, function_name(pass_spec, vmfb), target.driver, results=result_shapes(pass_spec))
    args = example_inputs(SPEC, np.random.default_rng(1), HELD_ENTRIES, rotary_mode=0)
    passes = DECODE_PASSES[target.lowering]
    (call,) = decode_calls(SPEC, args, pass_queries(SPEC, args, passes), passes)

    def step():
        first = loaded(*call.args, to_host=to_host)
        second = loaded(*call.args, to_host=to_host)
        del first, second

    step()
    before = _heap_in_use()
    for _ in range(4):
        step()
    grown = _heap_in_use() - before
    assert grown < 8 << 20, f"the heap in use grew by {grown / 2**20:.0f} MiB in 4 steps"


@needs_mallinfo2
def test_split_calls_with_device_results_held_leave_no_memory_behind(cache):
    """A whole split call (runtime/decode.py) with ``to_host=False``: its pass q and its results
    are device buffers the host fills in place (module.host_visible_array); a step's results alive
    during the next step and freed after it keep nothing."""
    kernel = open_kernel(SPEC, "llvm-cpu", cache=cache)
    args = example_inputs(SPEC, np.random.default_rng(2), HELD_ENTRIES, rotary_mode=0)
    held = kernel(*args, to_host=False)
    held = kernel(*args, to_host=False)  # IREE's caching allocator now keeps a freed results buffer
    before = _heap_in_use()
    for _ in range(4):
        held = kernel(*args, to_host=False)
    del held
    grown = _heap_in_use() - before
    assert grown < 8 << 20, f"the heap in use grew by {grown / 2**20:.0f} MiB in 4 steps"
