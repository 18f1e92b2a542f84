"""Host memory on CPU devices (runtime/devices.py: keep_host_memory): a call's transients come
from the C heap and stay there, so a second call of the same shape faults none of them in again.
"""

from __future__ import annotations

import platform
import resource

import numpy as np
import pytest

from linalg_prefill.mlir import PagedPrefillSpec
from linalg_prefill.mlir.decode import DecodeSpec
from linalg_prefill.runtime import open_kernel
from linalg_prefill.runtime.devices import keep_host_memory
from linalg_prefill.runtime.examples import example_inputs

SPEC = PagedPrefillSpec(8, 2, 64, "float32", page_size=16)
# 16 entries of 16 queries over 4096 keys: the 16-query pass's scores take about 100 MB (with
# glibc's defaults, 50 MB faulted 0 pages in again: IREE or glibc kept them; 100 MB faulted in
# 20,000 of its 28,672 pages on every call).
ENTRIES = [(16, 4096)] * 16
PAGE = 4096

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
