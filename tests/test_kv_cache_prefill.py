"""Layer (b)/(c): ragged, paged (± sliding window) and MLA prefill against the float64 reference.

Every batch mixes entries that exercise the edge cases of semantics §3/§11.3: an entry with
``qo_len > kv_len`` under the causal mask (rows with no valid key), an entry with no KV at all,
an entry with no queries, single rows, and entries longer than one query tile (64 tokens) and one
KV tile (128 columns). Page tables are shuffled, with unused pages and partial last pages.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import BACKENDS, BACKENDS_WITHOUT_FUSED_CPU, assert_matches_reference
from linalg_prefill.mlir import MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec
from linalg_prefill.mlir.specs import ROPE_FIELDS
from linalg_prefill.mlir.abi import position
from linalg_prefill.runtime import open_kernel
from linalg_prefill.runtime.examples import example_inputs

# (qo_len, kv_len) per entry; kv_len is the logical length (after any sink/window remap).
ENTRIES = [(5, 3), (0, 7), (17, 40), (1, 1), (9, 0), (70, 150)]
SHORT_ENTRIES = [(5, 3), (0, 7), (12, 30), (9, 0), (3, 20)]

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
ROPE_TYPES = {
    "default": {},
    "gptj": {"rope_type": "gptj"},
    "llama3": LLAMA3,
    "llama4": {**LLAMA3, "rope_type": "llama4"},
    "longrope": {"rope_type": "longrope", "max_position_embeddings": 131072,
                 "original_max_position_embeddings": 4096},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
             "beta_fast": 32, "beta_slow": 1},
}


def test_the_rope_examples_cover_every_rope_type():
    assert set(ROPE_TYPES) == set(ROPE_FIELDS)


def _inputs(spec, rng, entries, window=None) -> tuple:
    """The call's arguments before its scalars (runtime/examples.py); with a sliding window,
    ``window[b] = (sw_off, sink)``."""
    return example_inputs(spec, rng, entries, window=window)[:position(spec, "causal")]


# ---------------------------------------------------------------------------------------------
# ragged


def _run_ragged(spec, backend, cache, *, entries=ENTRIES, rotary_modes=(0, 1), rope_scale=1.0, seed=0):
    kernel = open_kernel(spec, backend, cache=cache)
    rng = np.random.default_rng(seed)
    q, q_indptr, k, v, kv_indptr, q_pos, k_offsets = _inputs(spec, rng, entries)
    sm_scale = spec.d_qk ** -0.5
    for causal in (0, 1):
        for rotary in rotary_modes:
            args = (q, q_indptr, k, v, kv_indptr, q_pos, k_offsets, causal, rotary, rope_scale, 1e4, sm_scale)
            assert_matches_reference(f"{spec.name} causal={causal} rotary={rotary}", kernel(*args), spec, args)


@pytest.mark.parametrize("backend", BACKENDS_WITHOUT_FUSED_CPU)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["G1", "G4", "G8"])
@pytest.mark.parametrize("d", [64, 128])
def test_ragged_float32(backend, heads, d, cache):
    _run_ragged(RaggedPrefillSpec(*heads, d, d, "float32"), backend, cache)


@pytest.mark.parametrize("backend", BACKENDS_WITHOUT_FUSED_CPU)
def test_ragged_dqk_differs_from_dv(backend, cache):
    """The MLA self-attention shape: d_qk = 192 (nope + rope), d_v = 128."""
    _run_ragged(RaggedPrefillSpec(4, 4, 192, 128, "float32"), backend, cache, rotary_modes=(0,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ragged_half(backend, dtype, cache):
    _run_ragged(RaggedPrefillSpec(8, 2, 64, 64, dtype, ROPE_TYPES["llama3"]), backend, cache)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rope_type", list(ROPE_TYPES))
def test_ragged_rope_types(backend, rope_type, cache):
    """Every rope type with rope_scale != 1."""
    spec = RaggedPrefillSpec(4, 2, 64, 64, "float32", ROPE_TYPES[rope_type])
    _run_ragged(spec, backend, cache, entries=SHORT_ENTRIES, rotary_modes=(1,), rope_scale=0.5, seed=3)


# ---------------------------------------------------------------------------------------------
# paged


def _run_paged(spec, backend, cache, *, entries=ENTRIES, window=None, rotary_modes=(0, 1), seed=0):
    kernel = open_kernel(spec, backend, cache=cache)
    args = _inputs(spec, np.random.default_rng(seed), entries, window)
    for causal in (0, 1):
        for rotary in rotary_modes:
            call = (*args, causal, rotary, 1.0, 1e4, spec.d ** -0.5)
            assert_matches_reference(f"{spec.name} causal={causal} rotary={rotary}", kernel(*call), spec, call)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 8, 16, 32, 64])
def test_paged_page_sizes(backend, page_size, cache):
    _run_paged(PagedPrefillSpec(8, 2, 64, "float32", page_size=page_size), backend, cache)


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_d128_gqa8(backend, cache):
    _run_paged(PagedPrefillSpec(8, 1, 128, "float32", page_size=16), backend, cache, rotary_modes=(0,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_paged_sliding_window_with_sinks(backend, dtype, cache):
    """length_info [3, B]: window offsets and sinks remap logical rows (§2)."""
    spec = PagedPrefillSpec(8, 2, 64, dtype, page_size=8, sliding_window=True)
    window = [(4, 2), (0, 0), (10, 4), (3, 1), (0, 0), (20, 6)]
    _run_paged(spec, backend, cache, window=window, rotary_modes=(0,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paged_half(backend, dtype, cache):
    _run_paged(PagedPrefillSpec(4, 4, 128, dtype, page_size=16), backend, cache, rotary_modes=(0,))


# ---------------------------------------------------------------------------------------------
# MLA


def _run_mla(spec, backend, cache, *, entries=ENTRIES, window=None, seed=0):
    kernel = open_kernel(spec, backend, cache=cache)
    rng = np.random.default_rng(seed)
    inputs = _inputs(spec, rng, entries, window)
    sm_scale = 192 ** -0.5  # DeepSeek's (qk_nope + qk_rope)^-0.5, not d_qk^-0.5 (§1.3)
    for causal in (0, 1):
        args = (*inputs, causal, sm_scale)
        assert_matches_reference(f"{spec.name} causal={causal}", kernel(*args), spec, args)


@pytest.mark.parametrize("backend", BACKENDS_WITHOUT_FUSED_CPU)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_mla_deepseek_sizes(backend, dtype, cache):
    """d_latent 512 + d_rope 64, h_q = 16 (DeepSeek-V2-Lite)."""
    spec = MlaPagedPrefillSpec(16, 512, 64, dtype, page_size=16)
    _run_mla(spec, backend, cache, entries=[(5, 3), (0, 7), (20, 40), (9, 0), (33, 140)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_sliding_window(backend, cache):
    spec = MlaPagedPrefillSpec(4, 64, 16, "float32", page_size=8, sliding_window=True)
    _run_mla(spec, backend, cache, window=[(4, 2), (0, 0), (10, 4), (3, 1), (0, 0), (20, 6)])


# ---------------------------------------------------------------------------------------------
# batch behaviour


def test_ragged_small_tiles_walk_many_tiles(cache):
    """Tiles far smaller than the entries: many query and KV steps per entry, partial last tiles."""
    spec = RaggedPrefillSpec(8, 2, 64, 64, "float32", q_tile=8, kv_tile=16)
    _run_ragged(spec, "llvm-cpu", cache, rotary_modes=(1,))


def test_entry_results_do_not_depend_on_the_batch(cache):
    """An entry alone and inside a batch (any position) gives bitwise the same float32 result."""
    spec = RaggedPrefillSpec(8, 2, 64, 64, "float32")
    kernel = open_kernel(spec, cache=cache)
    rng = np.random.default_rng(5)
    q, q_indptr, k, v, kv_indptr, q_pos, k_offsets = _inputs(spec, rng, ENTRIES)
    out, lse = kernel(q, q_indptr, k, v, kv_indptr, q_pos, k_offsets, 1, 1, 1.0, 1e4, 0.125)
    b = 2
    q0, q1, k0, k1 = q_indptr[b], q_indptr[b + 1], kv_indptr[b], kv_indptr[b + 1]
    alone = kernel(q[q0:q1], np.array([0, q1 - q0], np.int32), k[k0:k1], v[k0:k1],
                   np.array([0, k1 - k0], np.int32), q_pos[q0:q1], k_offsets[b:b + 1], 1, 1, 1.0, 1e4, 0.125)
    np.testing.assert_array_equal(alone[0], out[q0:q1])
    np.testing.assert_array_equal(alone[1], lse[q0:q1])


def test_nan_in_one_entry_stays_in_that_entry(cache):
    """NaN in one entry's keys and values never reaches another entry's output (KV rows past an
    entry's end are zeroed, not multiplied by a zero weight)."""
    spec = RaggedPrefillSpec(4, 2, 64, 64, "float32")
    kernel = open_kernel(spec, cache=cache)
    rng = np.random.default_rng(6)
    q, q_indptr, k, v, kv_indptr, q_pos, k_offsets = _inputs(spec, rng, SHORT_ENTRIES)
    args = lambda kk, vv: (q, q_indptr, kk, vv, kv_indptr, q_pos, k_offsets, 0, 0, 1.0, 1e4, 0.125)  # noqa: E731
    clean = kernel(*args(k, v))
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[kv_indptr[2]:kv_indptr[3]] = np.nan
    v_bad[kv_indptr[2]:kv_indptr[3]] = np.nan
    dirty = kernel(*args(k_bad, v_bad))
    other = np.ones(q_indptr[-1], bool)
    other[q_indptr[2]:q_indptr[3]] = False
    assert np.isnan(dirty[0][q_indptr[2]:q_indptr[3]]).all()
    np.testing.assert_array_equal(dirty[0][other], clean[0][other])
