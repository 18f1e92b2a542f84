"""merge_state (§1.6): against the float64 reference, and prefix + new tokens == one call."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import uniform
from linalg_prefill.mlir import PagedPrefillSpec, RaggedPrefillSpec
from linalg_prefill.runtime import InputError, open_kernel, reference
from linalg_prefill.runtime.compare import error_bound
from linalg_prefill.runtime.error_model import merge_bound
from linalg_prefill.runtime.examples import page_table
from linalg_prefill.runtime.merge import merge_state, merge_states
from linalg_prefill.runtime.reference import EMPTY_ROW_LSE
from support import LLAMA3


def _states(rng, rows=40, heads=3, d=16):
    out = [rng.uniform(-1, 1, (rows, heads, d)).astype(np.float32) for _ in range(2)]
    lse = [rng.uniform(-20, 20, (rows, heads)).astype(np.float32) for _ in range(2)]
    lse[0][:5] = EMPTY_ROW_LSE  # a empty
    lse[1][3:8] = EMPTY_ROW_LSE  # b empty (rows 3, 4: both empty)
    out[0][:5] = np.nan  # whatever an empty state holds must not leak
    return out, lse


def test_merge_matches_float64_reference():
    (out_a, out_b), (lse_a, lse_b) = _states(np.random.default_rng(0))
    out, lse = merge_state(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = reference.merge_state(np.nan_to_num(out_a), lse_a, out_b, lse_b)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    _assert_within_merge_bound(out, lse, want_out, want_lse, [np.nan_to_num(out_a), out_b], [lse_a, lse_b])
    both_empty = (lse_a <= EMPTY_ROW_LSE) & (lse_b <= EMPTY_ROW_LSE)
    assert both_empty.any() and np.all(lse[both_empty] == EMPTY_ROW_LSE) and np.all(out[both_empty] == 0)


def test_merge_with_an_empty_state_returns_the_other():
    (out_a, out_b), (lse_a, lse_b) = _states(np.random.default_rng(1))
    empty = np.full_like(lse_a, EMPTY_ROW_LSE)
    out, lse = merge_state(out_b, lse_b, np.zeros_like(out_a), empty)
    np.testing.assert_array_equal(lse, lse_b)
    np.testing.assert_array_equal(out, np.where((lse_b <= EMPTY_ROW_LSE)[..., None], 0, out_b))


def test_merge_states_is_order_independent_up_to_rounding():
    rng = np.random.default_rng(2)
    outs = [rng.uniform(-1, 1, (7, 2, 8)).astype(np.float32) for _ in range(4)]
    lses = [rng.uniform(-5, 5, (7, 2)).astype(np.float32) for _ in range(4)]
    want = (outs[0].astype(np.float64), lses[0].astype(np.float64))
    for out, lse in zip(outs[1:], lses[1:]):
        want = reference.merge_state(*want[:1], want[1], out, lse)
    for order in (outs, lses), (outs[::-1], lses[::-1]):
        _assert_within_merge_bound(*merge_states(*order), *want, *order)


def _assert_within_merge_bound(out, lse, want_out, want_lse, outs, lses):
    """A merge against the float64 merge, within runtime/error_model.merge_bound."""
    out_bound, lse_bound = merge_bound(outs, lses)
    assert np.all(np.abs(np.asarray(out, np.float64) - want_out) <= out_bound)
    assert np.all(np.abs(np.asarray(lse, np.float64) - want_lse) <= lse_bound)


@pytest.mark.parametrize("bad, match", [
    (dict(lse_a=np.zeros((40, 3), np.float64)), "lse_a"),
    (dict(lse_b=np.zeros((40, 2), np.float32)), "lse_b"),
    (dict(out_b=np.zeros((40, 3, 8), np.float32)), "out_b"),
])
def test_merge_rejects_mismatched_states(bad, match):
    (out_a, out_b), (lse_a, lse_b) = _states(np.random.default_rng(3))
    args = {**dict(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b), **bad}
    with pytest.raises(InputError, match=match):
        merge_state(**args)


@pytest.mark.compiles(PagedPrefillSpec(4, 2, 64, "float32", page_size=16, rope_scaling=LLAMA3),
                      RaggedPrefillSpec(4, 2, 64, 64, "float32", LLAMA3))  # test_wrappers.py's ragged kernel
def test_paged_prefix_plus_ragged_new_tokens_equals_full_attention(cache):
    """TVM's prefill: cached prefix through pages (causal=0) + new tokens through ragged (causal=1),
    merged, equals one causal attention over prefix ++ new tokens, RoPE on."""
    h_q, h_kv, d, page_size = 4, 2, 64, 16
    paged = open_kernel(PagedPrefillSpec(h_q, h_kv, d, "float32", page_size=page_size, rope_scaling=LLAMA3), cache=cache)
    ragged = open_kernel(RaggedPrefillSpec(h_q, h_kv, d, d, "float32", LLAMA3), cache=cache)
    rng = np.random.default_rng(4)
    prefix_lens, new_lens = [37, 0, 150], [20, 9, 70]
    batch = len(new_lens)
    q_indptr = np.concatenate([[0], np.cumsum(new_lens)]).astype(np.int32)
    q = uniform(rng, (q_indptr[-1], h_q, d), "float32")
    k_new = uniform(rng, (q_indptr[-1], h_kv, d), "float32")
    v_new = uniform(rng, (q_indptr[-1], h_kv, d), "float32")
    prefix_k = [uniform(rng, (n, h_kv, d), "float32") for n in prefix_lens]
    prefix_v = [uniform(rng, (n, h_kv, d), "float32") for n in prefix_lens]

    # Pages hold the prefix; entry b's pages are shuffled among all pages.
    table = page_table(rng, prefix_lens, page_size, spare_pages=0)
    page_ids, page_indptr = table.page_values, table.page_indptr
    pages = np.zeros((table.num_pages, 2, h_kv, page_size, d), np.float32)
    for b, n in enumerate(prefix_lens):
        for row in range(n):
            page = page_ids[page_indptr[b] + row // page_size]
            pages[page, 0, :, row % page_size] = prefix_k[b][row]
            pages[page, 1, :, row % page_size] = prefix_v[b][row]
    last_page_len = table.length_info
    q_pos = np.concatenate([p + np.arange(n) for p, n in zip(prefix_lens, new_lens)]).astype(np.int32)
    zeros = np.zeros(batch, np.int32)
    scalars = (1, 1.0, 1e4, d ** -0.5)  # rotary_mode, rope_scale, rope_theta, sm_scale

    out_prefix, lse_prefix = paged(q, q_indptr, pages, page_indptr, page_ids, last_page_len, zeros, q_pos, 0, *scalars)
    out_new, lse_new = ragged(q, q_indptr, k_new, v_new, q_indptr, q_pos, np.array(prefix_lens, np.int32), 1, *scalars)
    out, lse = merge_state(out_prefix, lse_prefix, out_new, lse_new)

    k_all = np.concatenate([x for b in range(batch) for x in (prefix_k[b], k_new[q_indptr[b]:q_indptr[b + 1]])])
    v_all = np.concatenate([x for b in range(batch) for x in (prefix_v[b], v_new[q_indptr[b]:q_indptr[b + 1]])])
    kv_indptr = np.concatenate([[0], np.cumsum(np.add(prefix_lens, new_lens))]).astype(np.int32)
    want_out, want_lse = reference.batch_prefill_ragged_kv(q, q_indptr, k_all, v_all, kv_indptr, q_pos, zeros, 1,
                                                           *scalars, rope_scaling=LLAMA3)
    # within the bound of the one call, plus the merge's own (runtime/error_model.py)
    call = (q, q_indptr, k_all, v_all, kv_indptr, q_pos, zeros, 1, *scalars)
    bound = error_bound(RaggedPrefillSpec(h_q, h_kv, d, d, "float32", LLAMA3), call, (want_out, want_lse))
    merge_out, merge_lse = merge_bound([out_prefix, out_new], [lse_prefix, lse_new])
    assert np.all(np.abs(out - want_out) <= bound.output + merge_out)
    assert np.all(np.abs(lse - want_lse) <= bound.lse + merge_lse)
