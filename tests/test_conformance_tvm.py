"""Conformance of the float64 reference with apache-tvm 0.27's own CPU prefill kernels.

The seed's ``_attention_prefill_cpu`` (paged) and ``_attention_prefill_ragged_cpu`` (ragged) are
compiled for LLVM and run on float32 data; their output and base-2 lse must match
``linalg_prefill.runtime.reference`` on every row that has at least one valid key.  Rows without
one are implementation-defined in the seed (§5, §9.2) and are left out.

Scope (semantics §11.5 / §11.7):

* RoPE: only the absent key (``{}``), llama3 and longrope are compared; gptj, llama4 and yarn
  differ from the seed on purpose.
* Sliding window: the PyPI kernels carry the post-seed window mask (§3.1,
  ``sliding_window_size`` = 1024 by default), so sliding-window calls are compared with
  ``causal=0``; the one ``causal=1`` case builds the kernel with ``sliding_window_size=0``, which
  selects the seed's plain causal mask (``_causal_or_sliding_cross_mask`` falls back to
  ``_causal_mask`` when the size is 0).

The seed kernels are scalar loops (the paged one walks ``max_num_pages * page_size`` rows per
query row), so sizes are small.
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest

from linalg_prefill.mlir import PagedPrefillSpec, RaggedPrefillSpec
from linalg_prefill.mlir.decode import DecodeSpec
from linalg_prefill.runtime import reference as R
from linalg_prefill.runtime.examples import indptr, page_table

if importlib.util.find_spec("tvm") is None:
    pytest.skip("apache-tvm is not installed (pip install -e '.[conformance]')", allow_module_level=True)

#: One worker runs the file, and imports apache-tvm (3.7 s) in its first test rather than at
#: collection in every worker (docs/test-suite.md).
pytestmark = [pytest.mark.conformance, pytest.mark.xdist_group("conformance_tvm")]


@functools.cache
def _tvm():
    """apache-tvm and the seed's prefill kernels (its ``_prefill_kernels`` module)."""
    import tvm
    from tvm.relax.frontend.nn.llm import _prefill_kernels

    return tvm, _prefill_kernels

# The seed's kernels are float32 attention too: they are held to the error bound of the same call
# (runtime/error_model.py) on the rows with a valid key.

ROPE = {
    "default": {},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "longrope": {"rope_type": "longrope", "max_position_embeddings": 4096, "original_max_position_embeddings": 256},
}


@functools.cache
def _paged_kernel(h_kv, h_q, d, page_size, sliding, rope_name, window_size=1024):
    tvm, prefill = _tvm()
    f = prefill._attention_prefill_cpu(
        h_kv, h_q, d, "float32", sliding, ROPE[rope_name], page_size=page_size, sliding_window_size=window_size
    )
    return tvm.compile(tvm.IRModule({"main": f}), target={"kind": "llvm"})["main"]


@functools.cache
def _ragged_kernel(h_kv, h_q, d_qk, d_v, rope_name):
    tvm, prefill = _tvm()
    f = prefill._attention_prefill_ragged_cpu(h_kv, h_q, d_qk, d_v, "float32", ROPE[rope_name])
    return tvm.compile(tvm.IRModule({"main": f}), target={"kind": "llvm"})["main"]


def _run(kernel, inputs, out_shape, lse_shape, scalars):
    tvm = _tvm()[0]
    dev = tvm.cpu()
    out = np.zeros(out_shape, np.float32)
    lse = np.zeros(lse_shape, np.float32)
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in (*inputs, out, lse)]
    causal, rotary, rope_scale, rope_theta, sm_scale = scalars
    kernel(*args, int(causal), int(rotary), float(rope_scale), float(rope_theta), float(sm_scale))
    return args[-2].numpy(), args[-1].numpy()


def _valid_rows(q_indptr, kv_lens, causal):
    """Boolean [total_q]: row has at least one valid key (§3)."""
    keep = np.zeros(int(q_indptr[-1]), bool)
    for b, kv in enumerate(kv_lens):
        qo = int(q_indptr[b + 1] - q_indptr[b])
        for i in range(qo):
            keep[q_indptr[b] + i] = kv > 0 and (not causal or i >= qo - kv)
    return keep


def _compare(got, want, keep, spec, call, bounds=1):
    """``got`` against the reference ``want`` of the seed-ABI ``call`` of ``spec`` on the rows
    ``keep``: within ``bounds`` times the call's error bound (2 for two kernels held to one each)."""
    from linalg_prefill.runtime.compare import error_bound

    out, lse = (np.asarray(x, np.float64) for x in got)
    bound = error_bound(spec, call)
    assert keep.any() and np.array_equal(keep, bound.valid.any(axis=-1))
    assert np.all(np.isfinite(out[keep])) and np.all(np.isfinite(lse[keep]))
    assert np.all(np.abs(out - want[0])[keep] <= bounds * bound.output[keep])
    assert np.all(np.abs(lse - want[1])[keep] <= bounds * bound.lse[keep])


def _paged_spec(h_q, h_kv, d, page_size, rope_name="default", sliding=False):
    from linalg_prefill.mlir import PagedPrefillSpec

    return PagedPrefillSpec(h_q, h_kv, d, "float32", page_size=page_size, rope_scaling=ROPE[rope_name],
                            sliding_window=sliding)


def _ragged_spec(h_q, h_kv, d_qk, d_v, rope_name="default"):
    from linalg_prefill.mlir import RaggedPrefillSpec

    return RaggedPrefillSpec(h_q, h_kv, d_qk, d_v, "float32", ROPE[rope_name])


def _paged_inputs(rng, qo_lens, phys_lens, page_size, h_q, h_kv, d, sw=None, extra_pages=2):
    """Paged inputs with shuffled page ids, partial last pages and entries without pages."""
    window = None if sw is None else [(o, s) if L else (0, 0) for (o, s), L in zip(sw, phys_lens)]
    table = page_table(rng, phys_lens, page_size, spare_pages=extra_pages, window=window, empty_last=0)
    kv_lens = list(phys_lens) if sw is None else [L - o + s if L else 0 for L, (o, s) in zip(phys_lens, window)]
    q_indptr = indptr(qo_lens)
    total = int(q_indptr[-1])
    inputs = (
        rng.uniform(-1, 1, (total, h_q, d)).astype(np.float32),
        q_indptr,
        rng.uniform(-1, 1, (table.num_pages, 2, h_kv, page_size, d)).astype(np.float32),
        table.page_indptr,
        table.page_values,
        table.length_info,
        rng.integers(0, 100, len(qo_lens)).astype(np.int32),  # k_rope_pos_offset
        rng.integers(0, 200, total).astype(np.int32),  # q_rope_position
    )
    return inputs, kv_lens


def _check_paged(rng, h_q, h_kv, d, page_size, causal, rope_name, rotary, rope_scale, qo, phys, sw=None, window=1024):
    sliding = sw is not None
    inputs, kv_lens = _paged_inputs(rng, qo, phys, page_size, h_q, h_kv, d, sw=sw)
    scalars = (causal, rotary, rope_scale, 1e4, d**-0.5)
    kernel = _paged_kernel(h_kv, h_q, d, page_size, sliding, rope_name, window)
    total = int(inputs[1][-1])
    got = _run(kernel, inputs, (total, h_q, d), (total, h_q), scalars)
    want = R.batch_prefill_paged_kv(*inputs, *scalars, rope_scaling=ROPE[rope_name], sliding_window=sliding)
    spec = _paged_spec(h_q, h_kv, d, page_size, rope_name, sliding)
    _compare(got, want, _valid_rows(inputs[1], kv_lens, causal), spec, (*inputs, *scalars))


# qo > kv for entry 1 (rows without a valid key under causal), no pages for entry 2, qo 0 for
# entry 3, partial last pages elsewhere.
PAGED_QO = [3, 6, 2, 0, 4]
PAGED_KV = [13, 4, 0, 9, 20]


@pytest.mark.parametrize("heads", [(2, 2), (4, 1), (8, 1)], ids=["g1", "g4", "g8"])
@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("causal", [0, 1])
def test_paged_no_rope(heads, page_size, causal):
    rng = np.random.default_rng(100 * heads[0] + page_size + causal)
    _check_paged(rng, heads[0], heads[1], 32, page_size, causal, "default", 0, 1.0, PAGED_QO, PAGED_KV)


@pytest.mark.parametrize("rope_name", ["default", "llama3"])
@pytest.mark.parametrize("rope_scale", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("causal", [0, 1])
def test_paged_inline_rope(rope_name, rope_scale, causal):
    rng = np.random.default_rng(int(rope_scale * 10) + causal)
    _check_paged(rng, 4, 1, 32, 8, causal, rope_name, 1, rope_scale, PAGED_QO, PAGED_KV)


@pytest.mark.parametrize("heads", [(2, 2), (8, 1)], ids=["g1", "g8"])
@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("rotary", [0, 1])
def test_paged_sliding_window(heads, page_size, rotary):
    """§2 remap: (sw_off, sink) per entry; entry 2 has no pages.  causal=0 (§11.7)."""
    rng = np.random.default_rng(7 * heads[0] + page_size + rotary)
    phys = [21, 9, 0, 12, 30]
    sw = [(10, 4), (5, 2), (0, 0), (6, 0), (17, 3)]
    _check_paged(rng, heads[0], heads[1], 32, page_size, 0, "llama3", rotary, 1.5, [3, 5, 2, 2, 4], phys, sw=sw)


def test_paged_sliding_window_causal_seed_mask():
    """causal=1 with the post-seed window mask switched off (``sliding_window_size=0``)."""
    rng = np.random.default_rng(5)
    phys = [21, 9, 12]
    sw = [(10, 4), (5, 2), (6, 0)]
    _check_paged(rng, 4, 1, 32, 8, 1, "default", 1, 1.0, [3, 9, 2], phys, sw=sw, window=0)


def _ragged_inputs(rng, qo, kv, h_q, h_kv, d_qk, d_v):
    q_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    return (
        rng.uniform(-1, 1, (q_indptr[-1], h_q, d_qk)).astype(np.float32),
        q_indptr,
        rng.uniform(-1, 1, (kv_indptr[-1], h_kv, d_qk)).astype(np.float32),
        rng.uniform(-1, 1, (kv_indptr[-1], h_kv, d_v)).astype(np.float32),
        kv_indptr,
        rng.integers(0, 200, q_indptr[-1]).astype(np.int32),  # q_rope_position
        rng.integers(0, 100, len(qo)).astype(np.int32),  # k_rope_pos_offset
    )


def _check_ragged(rng, h_q, h_kv, d_qk, d_v, causal, rope_name, rotary, rope_scale, qo, kv):
    inputs = _ragged_inputs(rng, qo, kv, h_q, h_kv, d_qk, d_v)
    scalars = (causal, rotary, rope_scale, 1e4, d_qk**-0.5)
    kernel = _ragged_kernel(h_kv, h_q, d_qk, d_v, rope_name)
    total = int(inputs[1][-1])
    got = _run(kernel, inputs, (total, h_q, d_v), (total, h_q), scalars)
    want = R.batch_prefill_ragged_kv(*inputs, *scalars, rope_scaling=ROPE[rope_name])
    spec = _ragged_spec(h_q, h_kv, d_qk, d_v, rope_name)
    _compare(got, want, _valid_rows(inputs[1], kv, causal), spec, (*inputs, *scalars))


RAGGED_QO = [5, 7, 2, 3]
RAGGED_KV = [5, 3, 0, 9]


@pytest.mark.parametrize("causal", [0, 1])
def test_ragged_mla_dims(causal):
    """d_qk = 192 != d_v = 128 (the runtime's MLA self-attention shape), no RoPE."""
    rng = np.random.default_rng(40 + causal)
    _check_ragged(rng, 2, 2, 192, 128, causal, "default", 0, 1.0, RAGGED_QO, RAGGED_KV)


@pytest.mark.parametrize("rope_name", ["default", "llama3", "longrope"])
@pytest.mark.parametrize("rope_scale", [1.0, 0.25])
@pytest.mark.parametrize("causal", [0, 1])
def test_ragged_gqa_rope(rope_name, rope_scale, causal):
    rng = np.random.default_rng(50 + causal + int(4 * rope_scale))
    _check_ragged(rng, 8, 2, 32, 32, causal, rope_name, 1, rope_scale, RAGGED_QO, RAGGED_KV)


def test_ragged_d_qk_ne_d_v_rope():
    rng = np.random.default_rng(60)
    _check_ragged(rng, 4, 1, 48, 16, 1, "llama3", 1, 2.0, RAGGED_QO, RAGGED_KV)


# ---------------------------------------------------------------------------------------------
# Our compiled kernels against the seed's kernels directly (llvm-cpu, float32), same inputs.

#: The seed's paged kernel's shape: 4 query heads on 1 KV head of dim 32, pages of 8, llama3 RoPE.
PAGED_SPEC = PagedPrefillSpec(4, 1, 32, "float32", page_size=8, rope_scaling=ROPE["llama3"])


def _compare_kernels(ours, seed, keep, spec, call):
    """Both kernels within the call's bound of the reference, so within twice it of each other."""
    from linalg_prefill.runtime.compare import reference_for

    _compare(ours, seed, keep, spec, call, bounds=2)
    _compare(ours, reference_for(spec, call), keep, spec, call)


@pytest.mark.parametrize("causal, rotary", [(0, 0), (1, 1), (0, 1)])
@pytest.mark.compiles(PAGED_SPEC, DecodeSpec(PAGED_SPEC, 4))  # and the 4-query pass its short entries take
def test_our_paged_kernel_matches_the_seed(causal, rotary, cache):
    from linalg_prefill.runtime import open_kernel

    rng = np.random.default_rng(40 + 2 * causal + rotary)
    inputs, kv_lens = _paged_inputs(rng, PAGED_QO, PAGED_KV, 8, 4, 1, 32)
    scalars = (causal, rotary, 0.5, 1e4, 32 ** -0.5)
    seed = _run(_paged_kernel(1, 4, 32, 8, False, "llama3"), inputs, (int(inputs[1][-1]), 4, 32),
                (int(inputs[1][-1]), 4), scalars)
    spec = PAGED_SPEC
    _compare_kernels(open_kernel(spec, cache=cache)(*inputs, *scalars), seed, _valid_rows(inputs[1], kv_lens, causal),
                     spec, (*inputs, *scalars))


WINDOW_SPEC = PagedPrefillSpec(4, 1, 32, "float32", page_size=8, sliding_window=True)


@pytest.mark.compiles(WINDOW_SPEC)
def test_our_sliding_window_kernel_matches_the_seed(cache):
    from linalg_prefill.runtime import open_kernel

    rng = np.random.default_rng(44)
    phys, sw = [21, 9, 0, 12, 30], [(10, 4), (5, 2), (0, 0), (6, 0), (17, 3)]
    inputs, kv_lens = _paged_inputs(rng, [3, 5, 2, 2, 4], phys, 8, 4, 1, 32, sw=sw)
    scalars = (0, 1, 1.5, 1e4, 32 ** -0.5)
    total = int(inputs[1][-1])
    seed = _run(_paged_kernel(1, 4, 32, 8, True, "default"), inputs, (total, 4, 32), (total, 4), scalars)
    spec = WINDOW_SPEC
    _compare_kernels(open_kernel(spec, cache=cache)(*inputs, *scalars), seed, _valid_rows(inputs[1], kv_lens, 0),
                     spec, (*inputs, *scalars))


RAGGED_SPEC = RaggedPrefillSpec(4, 2, 32, 16, "float32", ROPE["longrope"])


@pytest.mark.compiles(RAGGED_SPEC)
@pytest.mark.parametrize("causal, rotary", [(1, 0), (1, 1), (0, 1)])
def test_our_ragged_kernel_matches_the_seed(causal, rotary, cache):
    from linalg_prefill.runtime import open_kernel

    rng = np.random.default_rng(50 + 2 * causal + rotary)
    qo, kv = [3, 6, 2, 0, 4], [13, 4, 0, 9, 20]
    inputs = _ragged_inputs(rng, qo, kv, 4, 2, 32, 16)
    scalars = (causal, rotary, 2.0, 1e4, 32 ** -0.5)
    total = int(inputs[1][-1])
    seed = _run(_ragged_kernel(2, 4, 32, 16, "longrope"), inputs, (total, 4, 16), (total, 4), scalars)
    spec = RAGGED_SPEC
    _compare_kernels(open_kernel(spec, cache=cache)(*inputs, *scalars), seed, _valid_rows(inputs[1], kv, causal),
                     spec, (*inputs, *scalars))
