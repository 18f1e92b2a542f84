"""The error bound (runtime/error_model.py) is tight enough to catch real bugs: kernels built with
an off-by-one causal mask, a wrong page index, a wrong RoPE position or a missing ``sm_scale``
(the IR builders patched, then compiled) exceed it on every call where the bug changes the result,
in float16 or bfloat16 (the loosest bounds; the mutations alternate between them), on calls drawn like
the fuzzer's (tests/test_fuzz.py); the unpatched kernel of each dtype stays within it on the same calls.
"""

from __future__ import annotations

import numpy as np
import pytest

from linalg_prefill.mlir import (
    PagedPrefillSpec, decode, key_ranges, kv_layouts, mask_rules, online_softmax, x86_kv_cache,
)
from linalg_prefill.mlir import rope as rope_builder
from linalg_prefill.mlir.ir import arith_d, const_index, f32
from linalg_prefill.runtime import open_kernel
from linalg_prefill.pipeline.compiler import keyed_ir
from linalg_prefill.runtime.compare import error_bound, reference_for
from linalg_prefill.runtime.examples import example_inputs
from linalg_prefill.runtime.reference import EMPTY_ROW_LSE

#: The mutated kernels' dtypes: the 16-bit ones, whose bounds are the loosest (a mutation outside
#: them is caught where the tolerance is widest). Each mutation is a compile, so each runs in one
#: of them, the two in turn (the patched index maths is the same IR in both).
DTYPES = ("float16", "bfloat16")
DRAWS = 16
#: The fuzzer's query and KV lengths (tests/test_fuzz.py: kv_call).
QUERY_LENS, KV_LENS = (0, 1, 2, 5, 9, 16, 17, 24), (0, 1, 3, 8, 16, 33, 40)


def _off_by_one_mask():
    """The causal diagonal one column too far right: each row sees one key it must not."""
    original = mask_rules.KvCacheCausalRule.valid

    def shifted(self, values, lengths, row, col):
        moved = mask_rules.Lengths(lengths.q_len, lengths.kv_len, arith_d.addi(lengths.diagonal, const_index(1)))
        return original(self, values, moved, row, col)

    original_end = key_ranges.causal_end

    def shifted_end(token, diag, end):   # the hand-written dispatches' key range
        return original_end(token, arith_d.addi(diag, arith_d.constant(diag.type, 1)), end)

    return [(mask_rules.KvCacheCausalRule, "valid", shifted), (key_ranges, "causal_end", shifted_end)]


def _wrong_page():
    """Every page id read one too high (clamped into the cache)."""
    original = kv_layouts.clamped_page

    def next_page(page, pages):
        return original(arith_d.addi(page, const_index(1)), pages)

    return [(kv_layouts, "clamped_page", next_page)]


def _wrong_rope_position():
    """Keys rotated at their position + 1."""
    original = rope_builder.row_position

    def later(first):
        position = original(first)
        return arith_d.addi(position, arith_d.constant(position.type, 1))

    return [(rope_builder, "row_position", later)]


def _missing_scale():
    """Scores not multiplied by sm_scale (in the linalg emitters and the x86 entry dispatch)."""
    original = online_softmax.score_transform

    def unscaled(_sm_scale, soft_cap):
        return original(1.0, soft_cap)

    class UnscaledEntries(x86_kv_cache._EntryDispatch):
        def __init__(self, shapes, engine, pointers, scalars, _sm_scale):
            super().__init__(shapes, engine, pointers, scalars, arith_d.constant(f32(), 1.0))

    return [(online_softmax, "score_transform", unscaled), (decode, "score_transform", unscaled),
            (x86_kv_cache, "_EntryDispatch", UnscaledEntries)]


#: (patches, the arguments that make the bug reachable). RoPE is on in every call: the serving
#: passes (runtime/decode.py) then take no entry, so only the variant's kernel compiles, and the
#: bound of a rotating call is the looser one.
MUTATIONS = {
    "off-by-one-mask": (_off_by_one_mask, {"causal": 1, "rotary_mode": 1}),
    "wrong-page": (_wrong_page, {"rotary_mode": 1}),
    "wrong-rope-position": (_wrong_rope_position, {"rotary_mode": 1}),
    "missing-scale": (_missing_scale, {"rotary_mode": 1}),
}


def _calls(spec, given: dict, seed: int):
    """DRAWS calls of 1-4 entries with the fuzzer's lengths, causal and RoPE drawn (or ``given``)."""
    rng = np.random.default_rng(seed)
    for _ in range(DRAWS):
        entries = [(int(rng.choice(QUERY_LENS)), int(rng.choice(KV_LENS))) for _ in range(rng.integers(1, 5))]
        drawn = {"causal": int(rng.integers(0, 2)), "rotary_mode": int(rng.integers(0, 2))}
        yield example_inputs(spec, rng, entries, **{**drawn, **given})


def _outside(bound, want, got) -> bool:
    """Whether ``got`` breaks the call's bound, or the exactness of its rows without a key."""
    out, lse = (np.asarray(x, np.float64) for x in got)
    empty_exact = np.all(out[~bound.valid] == 0) and np.all(lse[~bound.valid] == EMPTY_ROW_LSE)
    return not bound.holds((out, lse), want) or not empty_exact


@pytest.mark.compiles(*(PagedPrefillSpec(4, 2, 32, dtype, page_size=4, q_tile=8, kv_tile=16) for dtype in DTYPES))
@pytest.mark.parametrize("mutation, dtype", [(mutation, DTYPES[i % 2]) for i, mutation in enumerate(MUTATIONS)])
def test_a_mutated_kernel_breaks_the_bound_wherever_it_differs(mutation, dtype, cache, monkeypatch, request):
    spec = PagedPrefillSpec(4, 2, 32, dtype, page_size=4, q_tile=8, kv_tile=16)
    patches, given = MUTATIONS[mutation]
    calls = list(_calls(spec, given, seed=len(mutation)))
    clean = open_kernel(spec, cache=cache)
    goods = [clean(*args) for args in calls]  # before patching: the serving passes compile on first use
    for module, name, replacement in patches():
        monkeypatch.setattr(module, name, replacement)
    keyed_ir.cache_clear()  # the mutated builders' IR (pipeline/compiler.py keeps a process's IR)
    request.addfinalizer(keyed_ir.cache_clear)
    mutated = open_kernel(spec, cache=cache)
    changed = 0
    for i, (args, good) in enumerate(zip(calls, goods)):
        bad = mutated(*args)
        want = reference_for(spec, args)
        bound = error_bound(spec, args, want)
        assert not _outside(bound, want, good), f"draw {i}: the unpatched kernel is outside its bound"
        if all(np.array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64), equal_nan=True)
               for a, b in zip(good, bad)):
            continue  # the bug does not reach this call (no key, no query, ...)
        changed += 1
        assert _outside(bound, want, bad), f"draw {i}: {mutation} changed the result within the bound"
    assert changed >= DRAWS // 2, f"{mutation} changed only {changed} of {DRAWS} calls"


def test_a_nan_result_is_outside_the_bound():
    """NaN in any element breaks the bound, whichever of output and lse holds it."""
    from linalg_prefill.runtime.compare import BackendResult
    from linalg_prefill.runtime.error_model import ErrorBound

    bound = ErrorBound(np.full((2, 1, 3), 1e-3), np.full((2, 1), 1e-3), np.ones((2, 1), bool))
    want = (np.zeros((2, 1, 3)), np.zeros((2, 1)))
    assert bound.holds(want, want) and bound.worst(want, want) == 0
    for got in ((np.full((2, 1, 3), np.nan), want[1]), (want[0], np.full((2, 1), np.nan))):
        assert not bound.holds(got, want) and np.isnan(bound.worst(got, want))
    assert not BackendResult("llvm-cpu", 0.0, 0.0, True, bound_ratio=(0.5, float("nan"))).ok
