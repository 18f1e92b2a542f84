"""Layer (b)/(c): ragged, paged (± sliding window) and MLA prefill against the float64 reference.

Every batch mixes entries that exercise the edge cases of semantics §3/§11.3: an entry with
``qo_len > kv_len`` under the causal mask (rows with no valid key), an entry with no KV at all,
an entry with no queries, single rows, and entries longer than one query tile (64 tokens) and one
KV tile (128 columns). Page tables are shuffled, with unused pages and partial last pages.

Every entry runs in the variant's own kernel (``serving_passes=False``): the one-pass kernels that
short entries take by default are checked against the reference for every KV-cache variant by
tests/test_decode_batches.py, test_fuzz.py and test_head_sinks.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import BACKENDS, BACKENDS_WITHOUT_FUSED_CPU, on_backends
from linalg_prefill.mlir import MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec
from linalg_prefill.mlir.specs import ROPE_FIELDS
from linalg_prefill.mlir.abi import position
from linalg_prefill.pipeline.targets import LOWERINGS
from linalg_prefill.runtime import open_kernel
from linalg_prefill.runtime.examples import example_inputs
from support import LLAMA3, ROPE_TYPES, run_against_reference, spec_id

# (qo_len, kv_len) per entry; kv_len is the logical length (after any sink/window remap).
ENTRIES = [(5, 3), (0, 7), (17, 40), (1, 1), (9, 0), (70, 150)]
SHORT_ENTRIES = [(5, 3), (0, 7), (12, 30), (9, 0), (3, 20)]
MLA_ENTRIES = [(5, 3), (0, 7), (20, 40), (9, 0), (33, 140)]


def test_the_rope_examples_cover_every_rope_type():
    assert set(ROPE_TYPES) == set(ROPE_FIELDS)


def _calls(rotary_modes=(0, 1), **scalars) -> list[dict]:
    """Both masks (causal 0 and 1) for each of ``rotary_modes``, with ``scalars`` by name."""
    return [dict(causal=causal, rotary_mode=rotary, **scalars) for causal in (0, 1) for rotary in rotary_modes]


def _check(spec, backend="llvm-cpu", **kwargs):
    """``run_against_reference`` with every entry in the variant's own kernel."""
    run_against_reference(spec, backend, serving_passes=False, **kwargs)


def _inputs(spec, rng, entries) -> tuple:
    """The call's arguments before its scalars (runtime/examples.py)."""
    return example_inputs(spec, rng, entries)[:position(spec, "causal")]


# ---------------------------------------------------------------------------------------------
# ragged


@pytest.mark.parametrize("backend", BACKENDS_WITHOUT_FUSED_CPU)
@pytest.mark.parametrize("spec", [RaggedPrefillSpec(*heads, d, d, "float32") for heads, d in [((4, 4), 64), ((8, 2), 128),
                                                                                         ((8, 1), 64)]], ids=spec_id)
def test_ragged_float32(backend, spec, cache):
    """GQA groups 1, 4 and 8 (tests/test_head_dims.py: the other head dims)."""
    _check(spec, backend, cache=cache, entries=ENTRIES, calls=_calls())


#: Head-major k [h_kv, Lk, d_qk], v [h_kv, Lk, d_v] (transformers' DynamicCache rows): d_qk != d_v
#: on the linalg lowering, bf16 on the fused one.
HND_CASES = [(RaggedPrefillSpec(8, 2, 64, 32, "float32", kv_order="hnd"), "linalg"),
             (RaggedPrefillSpec(8, 2, 64, 64, "bfloat16", kv_order="hnd"), "fused")]


@pytest.mark.compiles(passes=ENTRIES)
@pytest.mark.parametrize("spec, backend", on_backends(HND_CASES))
def test_ragged_head_major_kv(backend, spec, cache):
    """Head-major rows: the same entries, masks and RoPE as token-major ones (a swapped row and
    head index reads another key: the reference, which reads them through their transpose,
    catches it), the short entries in the serving passes (their element reads, mlir/decode.py)
    when RoPE is off."""
    run_against_reference(spec, backend, cache=cache, entries=ENTRIES, calls=_calls())


@pytest.mark.parametrize("backend", BACKENDS_WITHOUT_FUSED_CPU)
@pytest.mark.parametrize("spec", [RaggedPrefillSpec(4, 4, 192, 128, "float32")], ids=spec_id)
def test_ragged_dqk_differs_from_dv(backend, spec, cache):
    """The MLA self-attention shape: d_qk = 192 (nope + rope), d_v = 128."""
    _check(spec, backend, cache=cache, entries=ENTRIES, calls=_calls(rotary_modes=(0,)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", [RaggedPrefillSpec(8, 2, 64, 64, dtype, LLAMA3) for dtype in ("float16", "bfloat16")],
                         ids=spec_id)
def test_ragged_half(backend, spec, cache):
    _check(spec, backend, cache=cache, entries=ENTRIES, calls=_calls())


#: Every rope type, on the two lowerings in turn: the rotation is index maths both share
#: (mlir/rope.py), so one lowering per type reaches each type's code.
ROPE_CASES = [(RaggedPrefillSpec(4, 2, 64, 64, "float32", rope), LOWERINGS[i % 2])
              for i, rope in enumerate(ROPE_TYPES.values())]


@pytest.mark.parametrize("spec, backend", on_backends(ROPE_CASES))
def test_ragged_rope_types(backend, spec, cache):
    """Every rope type with rope_scale != 1."""
    _check(spec, backend, cache=cache, entries=SHORT_ENTRIES, calls=_calls((1,), rope_scale=0.5), seed=3)


# ---------------------------------------------------------------------------------------------
# paged


#: Every page size on the linalg lowering; on the fused one, one key per page, the serving
#: default (16) and the largest. Page size 8 runs tests/test_wrappers.py's kernel (GQA group 2).
PAGE_SIZE_CASES = [
    (PagedPrefillSpec(4, 2, 64, "float32", page_size=8), "linalg"),
    *((PagedPrefillSpec(8, 2, 64, "float32", page_size=page_size), lowering)
      for lowering, page_sizes in (("linalg", (1, 16, 32, 64)), ("fused", (1, 16, 64))) for page_size in page_sizes),
]


@pytest.mark.parametrize("spec, backend", on_backends(PAGE_SIZE_CASES))
def test_paged_page_sizes(backend, spec, cache):
    _check(spec, backend, cache=cache, entries=ENTRIES, calls=_calls())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", [PagedPrefillSpec(8, 1, 128, "float32", page_size=16)], ids=spec_id)
def test_paged_d128_gqa8(backend, spec, cache):
    _check(spec, backend, cache=cache, entries=ENTRIES, calls=_calls((0,)))


#: float32 on both lowerings (on linalg tests/test_wrappers.py's kernel, GQA group 2), each 16-bit
#: dtype on one.
WINDOW_CASES = [
    (PagedPrefillSpec(4, 2, 64, "float32", page_size=8, sliding_window=True), "linalg"),
    *((PagedPrefillSpec(8, 2, 64, dtype, page_size=8, sliding_window=True), lowering)
      for dtype, lowering in (("float32", "fused"), ("float16", "linalg"), ("bfloat16", "fused"))),
]


@pytest.mark.parametrize("spec, backend", on_backends(WINDOW_CASES))
def test_paged_sliding_window_with_sinks(backend, spec, cache):
    """length_info [3, B]: window offsets and sinks remap logical rows (§2)."""
    window = [(4, 2), (0, 0), (10, 4), (3, 1), (0, 0), (20, 6)]
    _check(spec, backend, cache=cache, entries=ENTRIES, window=window, calls=_calls((0,)))


#: Token-major pages [P, 2, page_size, h_kv, d] (FlashInfer's NHD, transformers' paged cache):
#: f32 on the linalg lowering, bf16 with a sliding window on the fused one.
NHD_CASES = [(PagedPrefillSpec(8, 2, 64, "float32", page_size=16, kv_order="nhd"), "linalg"),
             (PagedPrefillSpec(8, 2, 64, "bfloat16", page_size=8, sliding_window=True, kv_order="nhd"), "fused")]


@pytest.mark.compiles(passes=ENTRIES)
@pytest.mark.parametrize("spec, backend", on_backends(NHD_CASES))
def test_paged_nhd_pages(backend, spec, cache):
    """A page's rows token-major, its heads inside a row: the same entries, masks and RoPE as the
    head-major pages (a swapped head and slot index reads another key: the reference, which
    reads NHD pages through their HND transpose, catches it), the short entries in the serving
    passes when RoPE is off."""
    window = [(4, 2), (0, 0), (10, 4), (3, 1), (0, 0), (20, 6)] if spec.sliding_window else None
    run_against_reference(spec, backend, cache=cache, entries=ENTRIES, window=window, calls=_calls())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", [PagedPrefillSpec(4, 4, 128, dtype, page_size=16) for dtype in ("float16", "bfloat16")],
                         ids=spec_id)
def test_paged_half(backend, spec, cache):
    _check(spec, backend, cache=cache, entries=ENTRIES, calls=_calls((0,)))


# ---------------------------------------------------------------------------------------------
# MLA


#: DeepSeek's sm_scale, (qk_nope + qk_rope)^-0.5, not d_qk^-0.5 (§1.3), with both masks.
MLA_CALLS = [dict(causal=causal, sm_scale=192 ** -0.5) for causal in (0, 1)]


@pytest.mark.parametrize("backend", BACKENDS_WITHOUT_FUSED_CPU)
@pytest.mark.parametrize("spec", [MlaPagedPrefillSpec(16, 512, 64, dtype, page_size=16)
                                  for dtype in ("float32", "float16", "bfloat16")], ids=spec_id)
def test_mla_deepseek_sizes(backend, spec, cache):
    """d_latent 512 + d_rope 64, h_q = 16 (DeepSeek-V2-Lite)."""
    _check(spec, backend, cache=cache, entries=MLA_ENTRIES,
                          calls=MLA_CALLS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", [MlaPagedPrefillSpec(4, 64, 16, "float32", page_size=8, sliding_window=True)],
                         ids=spec_id)
def test_mla_sliding_window(backend, spec, cache):
    window = [(4, 2), (0, 0), (10, 4), (3, 1), (0, 0), (20, 6)]
    _check(spec, backend, cache=cache, entries=ENTRIES, window=window, calls=MLA_CALLS)


# ---------------------------------------------------------------------------------------------
# batch behaviour


@pytest.mark.parametrize("spec", [RaggedPrefillSpec(8, 2, 64, 64, "float32", q_tile=8, kv_tile=16)], ids=spec_id)
def test_ragged_small_tiles_walk_many_tiles(spec, cache):
    """Tiles far smaller than the entries: many query and KV steps per entry, partial last tiles."""
    _check(spec, cache=cache, entries=ENTRIES, calls=_calls((1,)))


@pytest.mark.compiles(RaggedPrefillSpec(8, 2, 64, 64, "float32"))
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


@pytest.mark.compiles(RaggedPrefillSpec(4, 2, 64, 64, "float32"), passes=SHORT_ENTRIES)
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
