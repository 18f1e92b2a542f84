"""Llama 4's chunked attention on the paged sliding-window kernel (runtime/key_ranges.py:
chunked_call, semantics §16), against chunked attention written out in float64.

Three sequences over shuffled pages: a prefill crossing two chunk boundaries, a short chunk after
a long cached prefix whose queries start mid-chunk, a decode step; chunks of 12 with pages of 16,
so chunks start mid-page (sw_off > 0). Scores are peaked (q times 4), RoPE on (keys at their
sequence's offset plus their row), so a key read from the wrong chunk or rotated at the wrong
position moves the outputs by far more than the kernel's error bound.
"""

from __future__ import annotations

import numpy as np
import pytest

from linalg_prefill.mlir import PagedPrefillSpec
from linalg_prefill.runtime import open_kernel
from linalg_prefill.runtime.compare import reference_for
from linalg_prefill.runtime.examples import page_table
from linalg_prefill.runtime.key_ranges import chunked_call
from linalg_prefill.runtime.rope import apply_rope

from support import assert_matches_reference

#: The adapter's masked-path kernel (tests/test_hf_adapter.py compiles it too).
SPEC = PagedPrefillSpec(4, 2, 16, "float32", page_size=16, sliding_window=True)
CHUNK = 12
#: (q_len, kv_len) per sequence: the queries at the end of their keys.
SEQUENCES = ((30, 30), (5, 41), (1, 26))
ROPE = dict(rope_theta=10000.0, rope_scale=1.0, rope_scaling={})
SM_SCALE = 0.25


def _call(rng):
    """The caller's paged call: q [Lq, 4, 16], pages, the seed's table without a window, offsets."""
    q_lens, kv_lens = zip(*SEQUENCES)
    table = page_table(rng, physical_lens=kv_lens, page_size=16)
    pages = rng.uniform(-1, 1, (table.num_pages, 2, 2, 16, 16)).astype(np.float32)
    q = (4 * rng.uniform(-1, 1, (sum(q_lens), 4, 16))).astype(np.float32)
    q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    k_offsets = np.array([0, 100, 7], np.int32)
    return q, q_indptr, pages, table, k_offsets


def _chunked_attention(q, q_indptr, pages, table, k_offsets) -> np.ndarray:
    """float64 ``[Lq, 4, 16]``: query t of a sequence at position p = kv_len - q_len + t (RoPE at
    its sequence's offset plus p) attends to the keys at positions ``p - p % CHUNK`` to p."""
    out = np.zeros(q.shape)
    for b, (q_len, kv_len) in enumerate(SEQUENCES):
        ids = table.page_values[table.page_indptr[b]:table.page_indptr[b + 1]]
        k = pages[ids, 0].transpose(0, 2, 1, 3).reshape(-1, 2, 16)[:kv_len]    # [kv_len, h_kv, d]
        v = pages[ids, 1].transpose(0, 2, 1, 3).reshape(-1, 2, 16)[:kv_len]
        positions = np.arange(kv_len) + k_offsets[b]
        k = apply_rope(k, positions, **ROPE)
        rows = slice(q_indptr[b], q_indptr[b + 1])
        query = apply_rope(q[rows], positions[kv_len - q_len:], **ROPE)
        for t in range(q_len):
            p = kv_len - q_len + t
            seen = slice(p - p % CHUNK, p + 1)
            for h in range(4):
                scores = SM_SCALE * k[seen, h // 2] @ query[t, h]
                weights = np.exp(scores - scores.max())
                out[q_indptr[b] + t, h] = weights @ v[seen, h // 2] / weights.sum()
    return out


@pytest.mark.compiles(SPEC)
def test_chunked_entries_give_chunked_attention():
    rng = np.random.default_rng(12)
    q, q_indptr, pages, table, k_offsets = _call(rng)
    call = chunked_call(q_indptr, table.page_indptr, table.page_values, table.length_info, k_offsets, chunk=CHUNK,
                        page_size=16)
    # the prefill: 3 entries of 12, 12 and 6 queries; the second's 5 queries (positions 36-40) one
    # entry from the chunk at 36 (page 2, row 4); the decode step's from 24 (page 1, row 8)
    assert np.diff(call.q_indptr).tolist() == [12, 12, 6, 5, 1]
    assert call.length_info[1].tolist() == [0, 12, 8, 4, 8] and not call.length_info[2].any()
    q_positions = np.concatenate([np.arange(kv - n, kv) + off for (n, kv), off in zip(SEQUENCES, k_offsets)])
    args = (q, call.q_indptr, pages, call.page_indptr, call.page_values, call.length_info, call.k_rope_pos_offset,
            q_positions.astype(np.int32), 1, 1, 1.0, 10000.0, SM_SCALE)
    want = reference_for(SPEC, args)
    np.testing.assert_allclose(want[0], _chunked_attention(q, q_indptr, pages, table, k_offsets), rtol=1e-9,
                               atol=1e-12)
    output, lse = open_kernel(SPEC)(*args)
    assert_matches_reference("chunked", (output, lse), SPEC, args, want)


def test_a_sequence_whose_queries_have_no_keys_is_refused():
    with pytest.raises(ValueError, match="page_indptr: sequence 0 has 3 keys for 4 queries"):
        chunked_call([0, 4], [0, 1], [0], [3], [0], chunk=8, page_size=16)
