"""The wrappers with the spec options of issue 28 on llvm-cpu: custom masks (semantics §14) given
to ``plan`` as FlashInfer's wrappers take them (flattened per-entry blocks, ``mask_indptr``
computed or given), per-head sinks (§13) given to ``plan`` or per layer to ``run``, and the masked
sequence wrapper's ``[B, Lq, Lk]`` mask; against the float64 reference with peaked scores and rows
that see no key; bad masks and missing sinks raise InputError naming the argument at plan (run)
time. One spec per variant, the ones tests/test_custom_mask.py compiles.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_matches_reference, uniform
from linalg_prefill.mlir import MaskedSequencePrefillSpec, PagedPrefillSpec, RaggedPrefillSpec
from linalg_prefill.runtime import (
    InputError, MaskedSequencePrefillWrapper, PagedPrefillWrapper, RaggedPrefillWrapper,
)
from linalg_prefill.runtime.examples import indptr, page_table

RAGGED = RaggedPrefillSpec(h_q=4, h_kv=2, d_qk=32, d_v=32, dtype="float32", custom_mask=True, head_sinks=True)
PAGED_WINDOW = PagedPrefillSpec(h_q=4, h_kv=2, d=32, dtype="float32", page_size=8, sliding_window=True,
                                custom_mask=True)
MASKED = MaskedSequencePrefillSpec(h_q=4, h_kv=2, d=32, dtype="bfloat16", mask_mode="custom", sm_scale=32 ** -0.5)
pytestmark = pytest.mark.compiles(RAGGED, PAGED_WINDOW, MASKED)
#: Queries are multiplied by this: peaked scores, so a key the mask should hide moves the output.
PEAK = 3.0


def _tree(prefix: int, parents: list[int]) -> np.ndarray:
    """bool [n, prefix + n]: draft token i sees the prefix, its ancestors (``parents``, -1: the
    prefix) and itself, as a speculative-decoding tree."""
    mask = np.zeros((len(parents), prefix + len(parents)), bool)
    mask[:, :prefix] = True
    for i in range(len(parents)):
        node = i
        while node >= 0:
            mask[i, prefix + node] = True
            node = parents[node]
    return mask


def _blocks() -> list[np.ndarray]:
    """A 7-token tree over 37 keys with one row hiding every key, an entry without queries, and a
    random 9 x 20 block (several KV tiles, holes)."""
    tree = _tree(30, [-1, 0, 0, 1, 1, 2, 2])
    tree[4] = False
    return [tree, np.zeros((0, 5), bool), np.random.default_rng(7).random((9, 20)) < 0.4]


def _flat(blocks) -> np.ndarray:
    return np.concatenate([block.reshape(-1) for block in blocks]).astype(np.uint8)


def _natural_positions(blocks):
    """The default RoPE positions of a plan without RoPE arguments (q at kv_len - qo_len + i)."""
    q_pos = np.concatenate([kv - qo + np.arange(qo) for qo, kv in (b.shape for b in blocks)]).astype(np.int32)
    return q_pos, np.zeros(len(blocks), np.int32)


@pytest.fixture(scope="module")
def ragged(cache):
    """A ragged wrapper planned with the tree blocks (mask_indptr computed), and its index arrays."""
    blocks = _blocks()
    q_indptr, kv_indptr = indptr([b.shape[0] for b in blocks]), indptr([b.shape[1] for b in blocks])
    wrapper = RaggedPrefillWrapper(RAGGED, cache=cache)
    return wrapper, blocks, q_indptr, kv_indptr


def test_ragged_custom_mask_and_sinks_per_layer(ragged):
    wrapper, blocks, q_indptr, kv_indptr = ragged
    rng = np.random.default_rng(0)
    plan_sinks = rng.uniform(-2, 2, 4).astype(np.float32)
    plan = wrapper.plan(q_indptr, kv_indptr, custom_mask=_flat(blocks) != 0, sinks=plan_sinks)
    assert plan.arrays["mask_indptr"].tolist() == indptr([b.size for b in blocks]).tolist()
    q_pos, k_off = _natural_positions(blocks)
    for layer in range(2):
        q = uniform(rng, (q_indptr[-1], 4, 32), "float32") * np.float32(PEAK)
        k, v = (uniform(rng, (kv_indptr[-1], 2, 32), "float32") for _ in range(2))
        sinks = None if layer == 0 else rng.uniform(-2, 2, 4).astype(np.float32)
        call = (q, q_indptr, k, v, kv_indptr, q_pos, k_off, 1, 0, 1.0, 1e4, 32 ** -0.5, _flat(blocks),
                indptr([b.size for b in blocks]), plan_sinks if sinks is None else sinks)
        assert_matches_reference(f"layer {layer}", wrapper.run(q, k, v, sinks=sinks), RAGGED, call)


def test_ragged_plan_checks_the_mask(ragged):
    wrapper, blocks, q_indptr, kv_indptr = ragged
    flat, sizes = _flat(blocks), [b.size for b in blocks]
    sinks = np.zeros(4, np.float32)
    with pytest.raises(InputError, match="^custom_mask: .*needs custom_mask"):
        wrapper.plan(q_indptr, kv_indptr, sinks=sinks)
    with pytest.raises(InputError, match=f"^custom_mask: expected sum of qo_len \\* kv_len = {flat.size} "):
        wrapper.plan(q_indptr, kv_indptr, custom_mask=flat[:-1], sinks=sinks)
    with pytest.raises(InputError, match="^custom_mask: values must be 0 or 1"):
        wrapper.plan(q_indptr, kv_indptr, custom_mask=flat * 2, sinks=sinks)
    with pytest.raises(InputError, match="^custom_mask: expected dtype bool or uint8"):
        wrapper.plan(q_indptr, kv_indptr, custom_mask=flat.astype(np.float32), sinks=sinks)
    moved = indptr(sizes)
    moved[1] -= 1
    with pytest.raises(InputError, match="^mask_indptr: entry 0 spans"):
        wrapper.plan(q_indptr, kv_indptr, custom_mask=flat, mask_indptr=moved, sinks=sinks)
    plan = wrapper.plan(q_indptr, kv_indptr, custom_mask=flat, mask_indptr=indptr(sizes))  # explicit, no sinks
    with pytest.raises(InputError, match="^sinks: .*has head_sinks"):
        wrapper.run(np.zeros((q_indptr[-1], 4, 32), np.float32), *(np.zeros((kv_indptr[-1], 2, 32), np.float32),) * 2)
    with pytest.raises(InputError, match="^sinks: expected dtype float32"):
        wrapper.run(np.zeros((q_indptr[-1], 4, 32), np.float32), *(np.zeros((kv_indptr[-1], 2, 32), np.float32),) * 2,
                    sinks=np.zeros(4))
    assert wrapper.current_plan is plan


def test_paged_sliding_window_custom_mask(cache):
    """The mask's columns are the logical rows after the window's remap (2 sink tokens, 4 evicted)."""
    rng = np.random.default_rng(1)
    blocks = _blocks()
    kv_lens = [b.shape[1] for b in blocks]
    table = page_table(rng, [n + 4 for n in kv_lens], 8, spare_pages=3, window=[(6, 2)] * 3)
    pages = uniform(rng, (table.num_pages, 2, 2, 8, 32), "float32")
    length_info = table.length_info
    q_indptr = indptr([b.shape[0] for b in blocks])
    wrapper = PagedPrefillWrapper(PAGED_WINDOW, cache=cache)
    plan = wrapper.plan(q_indptr, table.page_indptr, table.page_values, length_info, custom_mask=_flat(blocks))
    assert plan.kv_lens.tolist() == kv_lens
    q = uniform(rng, (q_indptr[-1], 4, 32), "float32") * np.float32(PEAK)
    q_pos, k_off = _natural_positions(blocks)
    call = (q, q_indptr, pages, table.page_indptr, table.page_values, length_info, k_off, q_pos, 0, 0, 1.0, 1e4,
            32 ** -0.5, _flat(blocks), indptr([b.size for b in blocks]))
    assert_matches_reference("paged", wrapper.run(q, pages), PAGED_WINDOW, call)
    with pytest.raises(InputError, match="^sinks: .*no head_sinks"):
        wrapper.run(q, pages, sinks=np.zeros(4, np.float32))


def test_masked_sequence_custom_mask(cache):
    rng = np.random.default_rng(2)
    q = uniform(rng, (2, 9, 4, 32), "bfloat16")
    q = (q.astype(np.float32) * PEAK).astype(q.dtype)
    k, v = (uniform(rng, (2, 37, 2, 32), "bfloat16") for _ in range(2))
    mask = np.stack([_tree(28, [-1, 0, 1, 1, 0, 4, 4, 2, -1]), rng.random((9, 37)) < 0.3])
    mask[1, 3] = False
    wrapper = MaskedSequencePrefillWrapper(MASKED, cache=cache)
    with pytest.raises(InputError, match="^valid_lens: a mask_mode='custom' spec"):
        wrapper.plan(np.array([9, 9], np.int32))
    with pytest.raises(InputError, match="^custom_mask: expected rank 3"):
        wrapper.plan(custom_mask=mask[0])
    wrapper.plan(custom_mask=mask)
    assert_matches_reference("masked", wrapper.run(q, k, v), MASKED, (q, k, v, mask))
    with pytest.raises(InputError, match="^q: Lq 8 and Lk 37"):
        wrapper.run(q[:, :8], k, v)


def test_options_the_spec_lacks_are_refused(cache):
    """A custom mask for a spec without one names the argument (FlashInfer would silently ignore it)."""
    spec = PagedPrefillSpec(h_q=4, h_kv=2, d=32, dtype="float32", page_size=8)
    wrapper = PagedPrefillWrapper(spec, cache=cache)
    table = page_table(np.random.default_rng(3), [5], 8, spare_pages=0)
    with pytest.raises(InputError, match="^custom_mask: .*no custom mask"):
        wrapper.plan(indptr([2]), table.page_indptr, table.page_values, table.length_info,
                     custom_mask=np.ones(10, bool))
    with pytest.raises(InputError, match="^sinks: .*no head_sinks"):
        wrapper.plan(indptr([2]), table.page_indptr, table.page_values, table.length_info,
                     sinks=np.zeros(4, np.float32))
