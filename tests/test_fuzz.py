"""Differential fuzzing: Hypothesis draws variants, batch layouts, lengths (0 and 1 included), page
tables (shuffled, shared between sequences, unused pages), RoPE settings and dtypes, and the
compiled llvm-cpu kernel must be within each call's error bound (runtime/error_model.py) on every
draw.

CI runs a fixed, derandomised set over 12 specs (every variant and dtype): 100 draws for the
KV-cache variants, 30 serving-shaped KV-cache batches (many single-query entries), 100 for the
dense ones, plus the batch-order and NaN-isolation properties (60 + 40): 330 draws.
``LINALG_PREFILL_FUZZ=N`` draws N fresh random examples for each of the five properties instead,
over 19 specs: the 7 more bring every rope type, soft-capping and partial rotary. Specs compile
once per session (small heads and dims, some with tiny tiles so that short entries still walk
several query and KV tiles).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import assert_matches_reference
from linalg_prefill.mlir.abi import argument_names, ordered
from linalg_prefill.runtime.examples import PageTable, draw_tensors, indptr, page_table
from linalg_prefill.runtime.kv_checks import natural_positions, paged_kv_lengths
from support import DENSE_SPECS, KV_SPECS, THOROUGH_DENSE_SPECS, THOROUGH_KV_SPECS, kernel_for

FUZZ_EXAMPLES = int(os.environ.get("LINALG_PREFILL_FUZZ", "0"))
THOROUGH = FUZZ_EXAMPLES > 0


def fuzz_settings(ci_examples: int):
    """``ci_examples`` derandomised draws in CI; LINALG_PREFILL_FUZZ random draws when set."""
    return settings(max_examples=FUZZ_EXAMPLES or ci_examples, deadline=None, derandomize=not THOROUGH,
                    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                         HealthCheck.function_scoped_fixture])


FUZZED_KV_SPECS = KV_SPECS + (THOROUGH_KV_SPECS if THOROUGH else [])
FUZZED_DENSE_SPECS = DENSE_SPECS + (THOROUGH_DENSE_SPECS if THOROUGH else [])
pytestmark = pytest.mark.compiles(*FUZZED_KV_SPECS, *FUZZED_DENSE_SPECS, passes=True)  # serving-shaped draws

# ----------------------------------------------------------------------------- drawing calls


@st.composite
def kv_call(draw, spec, *, share_pages=None, serving=False):
    """A valid seed-ABI call of a KV-cache ``spec``: (args tuple, q_indptr, kv_lens). ``serving``:
    a serving-shaped batch, 4-16 entries of mostly one query against up to ~600 cached rows.
    Index arrays and scalars are drawn by ABI name; the tensors come from the variant's table."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    batch = draw(st.integers(4, 16) if serving else st.integers(1, 4))
    query_lens = [1, 1, 1, 1, 2, 0, 7] if serving else [0, 1, 2, 5, 9, 16, 17, 24]
    qo_lens = [draw(st.sampled_from(query_lens)) for _ in range(batch)]
    q_indptr = indptr(qo_lens)
    sm_scale = draw(st.sampled_from([None, 0.05, 0.5]))
    named = {"q_indptr": q_indptr, "causal": draw(st.integers(0, 1)),
             "rotary_mode": draw(st.integers(0, 1)), "rope_scale": draw(st.sampled_from([1.0, 0.5, 2.0])),
             "rope_theta": draw(st.sampled_from([1e4, 5e5])),
             "sm_scale": spec.d_qk ** -0.5 if sm_scale is None else sm_scale}
    sizes = {"Lq": int(q_indptr[-1])}
    if spec.kv_layout == "ragged":
        kv_choices = [0, 1, 5, 40, 257, 600] if serving else [0, 1, 3, 8, 16, 33, 40]
        kv_lens = np.array([draw(st.sampled_from(kv_choices)) for _ in range(batch)], np.int64)
        named["kv_indptr"], sizes["Lk"] = indptr(kv_lens), int(kv_lens.sum())
    else:
        max_pages = max(4, 600 // spec.page_size) if serving else 4
        table = _page_table(draw, rng, spec, batch, share_pages, max_pages)
        named.update(page_indptr=table.page_indptr, page_values=table.page_values, length_info=table.length_info)
        sizes["P"] = table.num_pages
        kv_lens = paged_kv_lengths(table.page_indptr, table.length_info, spec.page_size, spec.sliding_window)
    named.update(draw_tensors(spec, rng, sizes))
    named["q_rope_position"], named["k_rope_pos_offset"] = _positions(draw, rng, q_indptr, kv_lens)
    return ordered(spec, named), q_indptr, kv_lens


def _positions(draw, rng, q_indptr, kv_lens):
    """Natural positions after a random offset per entry, or random positions."""
    batch = len(kv_lens)
    k_off = rng.integers(0, 100, batch).astype(np.int32)
    if draw(st.booleans()):
        return rng.integers(0, 300, int(q_indptr[-1])).astype(np.int32), k_off
    qo_lens = np.diff(q_indptr)
    k_off = k_off + np.maximum(qo_lens - kv_lens, 0).astype(np.int32)
    return natural_positions(q_indptr, kv_lens, k_rope_pos_offset=k_off)


def _page_table(draw, rng, spec, batch: int, share_pages, max_pages: int = 4) -> PageTable:
    """0 to ``max_pages`` pages per entry with any last-page length (an entry without pages too),
    0-3 spare pages, ids shuffled or drawn with repeats so that sequences share pages; with a
    sliding window, any offset and up to 3 sinks."""
    n_pages = np.array([draw(st.integers(0, max_pages)) for _ in range(batch)], np.int64)
    spare = draw(st.integers(0, 3)) + (n_pages.sum() == 0)
    shared = draw(st.booleans()) if share_pages is None else share_pages
    last = np.array([draw(st.integers(1, spec.page_size)) for _ in range(batch)], np.int64)
    physical = np.where(n_pages > 0, (n_pages - 1) * spec.page_size + last, 0)
    window = None
    if spec.sliding_window:
        window = [(draw(st.integers(0, int(p))), draw(st.integers(0, min(int(p), 3)))) for p in physical]
    return page_table(rng, physical, spec.page_size, spare_pages=int(spare), window=window, shared=shared,
                      empty_last=last)


@st.composite
def dense_call(draw, spec):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    batch = draw(st.integers(1, 3))
    qo_len = draw(st.sampled_from([1, 2, 7, 16, 31]))
    masked = "valid_lens" in argument_names(spec)
    kv_len = qo_len if masked else draw(st.sampled_from([1, 5, 16, 40]))
    valid = np.array([draw(st.integers(0, min(qo_len, kv_len))) for _ in range(batch)], np.int32)
    named = {"valid_lens": valid, **draw_tensors(spec, rng, {"B": batch, "Lq": qo_len, "Lk": kv_len})}
    return ordered(spec, named)


# ----------------------------------------------------------------------------- properties


@fuzz_settings(100)
@given(data=st.data())
def test_kv_cache_variants_match_the_reference(cache, data):
    spec = data.draw(st.sampled_from(FUZZED_KV_SPECS), label="spec")
    args, _, _ = data.draw(kv_call(spec), label="call")
    got = kernel_for(spec, cache=cache)(*args)
    assert_matches_reference(spec.name, got, spec, args)


@fuzz_settings(30)
@given(data=st.data())
def test_serving_shaped_batches_match_the_reference(cache, data):
    """Many entries with one query each (runtime/decode.py runs them in one pass) among others."""
    spec = data.draw(st.sampled_from(FUZZED_KV_SPECS), label="spec")
    args, _, _ = data.draw(kv_call(spec, serving=True), label="call")
    got = kernel_for(spec, cache=cache)(*args)
    assert_matches_reference(spec.name, got, spec, args)


@fuzz_settings(100)
@given(data=st.data())
def test_dense_variants_match_the_reference(cache, data):
    spec = data.draw(st.sampled_from(FUZZED_DENSE_SPECS), label="spec")
    args = data.draw(dense_call(spec), label="call")
    got = kernel_for(spec, cache=cache)(*args)
    assert_matches_reference(spec.name, got, spec, args)


@fuzz_settings(60)
@given(data=st.data())
def test_entry_results_do_not_depend_on_batch_order(cache, data):
    """Reversing a ragged float32 batch gives each entry bitwise the same output and lse."""
    spec = KV_SPECS[0]
    args, q_indptr, kv_lens = data.draw(kv_call(spec), label="call")
    q, _, k, v, kv_indptr, q_pos, k_off, *scalars = args
    kernel = kernel_for(spec, cache=cache)
    out, lse = kernel(*args)
    order = np.arange(len(kv_lens))[::-1]
    q_rows = [np.arange(q_indptr[b], q_indptr[b + 1]) for b in order]
    kv_rows = [np.arange(kv_indptr[b], kv_indptr[b + 1]) for b in order]
    rq, rkv = np.concatenate(q_rows), np.concatenate(kv_rows)
    out_r, lse_r = kernel(q[rq], indptr([len(r) for r in q_rows]), k[rkv], v[rkv],
                          indptr([len(r) for r in kv_rows]), q_pos[rq], k_off[order], *scalars)
    np.testing.assert_array_equal(out_r, out[rq])
    np.testing.assert_array_equal(lse_r, lse[rq])


@fuzz_settings(40)
@given(data=st.data())
def test_nan_in_one_sequence_never_reaches_another(cache, data):
    """NaN in every page of one paged entry (pages not shared) changes no other entry's rows."""
    spec = KV_SPECS[3]
    args, q_indptr, _ = data.draw(kv_call(spec, share_pages=False), label="call")
    q, _, pages, page_indptr, page_values, *rest = args
    batch = len(q_indptr) - 1
    victim = data.draw(st.integers(0, batch - 1), label="victim")
    kernel = kernel_for(spec, cache=cache)
    clean = kernel(*args)
    poisoned = pages.copy()
    poisoned[page_values[page_indptr[victim]:page_indptr[victim + 1]]] = np.nan
    dirty = kernel(q, q_indptr, poisoned, page_indptr, page_values, *rest)
    others = np.ones(q_indptr[-1], bool)
    others[q_indptr[victim]:q_indptr[victim + 1]] = False
    np.testing.assert_array_equal(dirty[0][others], clean[0][others])
    np.testing.assert_array_equal(dirty[1][others], clean[1][others])
