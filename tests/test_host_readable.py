"""Index arrays in host-local memory (runtime/module.py: host_readable), the way the CUDA kernels
get them, run the fused lowering's KV-cache kernels correctly; on llvm-cpu, through the same ABI."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import FUSED_CPU, assert_matches_reference
from linalg_prefill.mlir import PagedPrefillSpec, RaggedPrefillSpec
from linalg_prefill.runtime import open_kernel
from linalg_prefill.runtime.examples import example_inputs
from linalg_prefill.runtime.module import as_device_arrays, host_readable
from support import LLAMA3

ENTRIES = [(5, 3), (0, 7), (70, 150), (9, 0), (1, 1)]


RAGGED = RaggedPrefillSpec(8, 2, 64, 64, "float32")
#: Fused-lowering kernels tests/test_kv_cache_prefill.py runs too (one compile each per session).
FUSED_RAGGED = RaggedPrefillSpec(8, 2, 64, 64, "float16", LLAMA3)
PAGED = PagedPrefillSpec(8, 2, 64, "bfloat16", page_size=8, sliding_window=True)
pytestmark = [pytest.mark.compiles(RAGGED),  # tests/conftest.py
              pytest.mark.compiles(FUSED_RAGGED, PAGED, backends=[FUSED_CPU])]


def _run_with_host_local_indices(spec, cache):
    kernel = open_kernel(spec, FUSED_CPU, cache=cache)
    args = list(example_inputs(spec, np.random.default_rng(3), entries=ENTRIES))
    indices = [i for i, a in enumerate(args) if isinstance(a, np.ndarray) and a.dtype == np.int32]
    staged = list(args)
    for i in indices:
        staged[i] = host_readable(kernel.device, args[i])
    got = kernel.launch(*staged)
    assert_matches_reference(spec.name, got, spec, args)
    assert all(staged[i].to_host().tolist() == args[i].tolist() for i in indices)


def test_ragged_reads_host_local_index_arrays(cache):
    _run_with_host_local_indices(FUSED_RAGGED, cache)


def test_paged_sliding_window_reads_host_local_index_arrays(cache):
    _run_with_host_local_indices(PAGED, cache)


def test_uploads_keep_float_arrays_on_the_device_and_indices_intact(cache):
    kernel = open_kernel(RAGGED, cache=cache)
    q = np.ones((3, 8, 64), np.float32)
    indptr = np.array([0, 1, 3], np.int32)
    q_dev, indptr_dev = as_device_arrays(kernel.device, [q, indptr])
    assert q_dev.to_host().shape == q.shape and indptr_dev.to_host().tolist() == [0, 1, 3]
