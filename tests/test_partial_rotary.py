"""Partial rotary embedding (Phi, GPT-NeoX style ``partial_rotary_factor``): only the first
``rotary_dim`` dims of q and k rotate, with frequencies over ``rotary_dim``; both lowerings."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_matches_reference, on_backends
from linalg_prefill.mlir import PagedPrefillSpec, RaggedPrefillSpec, SpecError
from linalg_prefill.runtime import open_kernel
from linalg_prefill.runtime.compare import reference_for
from linalg_prefill.runtime.examples import example_inputs
from linalg_prefill.runtime.rope import apply_rope

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
ENTRIES = [(5, 3), (0, 7), (70, 150), (9, 0), (20, 40)]


#: Ragged and paged on each lowering: the rotation is index maths both lowerings share (mlir/rope.py).
CASES = [
    (RaggedPrefillSpec(8, 2, 64, 64, "float32", rotary_dim=32), "linalg"),
    (RaggedPrefillSpec(8, 2, 64, 32, "float16", {"rope_type": "gptj"}, rotary_dim=16), "fused"),
    (PagedPrefillSpec(8, 2, 64, "float32", page_size=16, rope_scaling=LLAMA3, rotary_dim=48), "fused"),
    (PagedPrefillSpec(4, 4, 64, "bfloat16", page_size=8, sliding_window=True, rope_scaling=YARN, rotary_dim=32),
     "linalg"),
]


@pytest.mark.parametrize("spec, backend", on_backends(CASES))
def test_partial_rotary_matches_the_reference(spec, backend, cache):
    args = example_inputs(spec, np.random.default_rng(2), entries=ENTRIES)
    got = open_kernel(spec, backend, cache=cache)(*args)
    want = reference_for(spec, args)
    assert_matches_reference(spec.name, got, spec, args, want)
    whole = reference_for(type(spec)(**{**spec.fields(), "rotary_dim": None}), args)
    assert np.abs(whole[1] - want[1]).max() > 0.05  # rotating every dim gives another answer


def test_only_the_first_rotary_dims_rotate():
    x = np.random.default_rng(0).uniform(-1, 1, (5, 2, 64))
    positions = np.arange(5) + 7
    partial = apply_rope(x, positions, rope_theta=1e4, rope_scale=1.0, rope_scaling={}, rotary_dim=16)
    assert np.array_equal(partial[..., 16:], x[..., 16:])
    head = apply_rope(x[..., :16], positions, rope_theta=1e4, rope_scale=1.0, rope_scaling={})
    assert np.array_equal(partial[..., :16], head)


def test_rotary_dim_is_validated_and_named():
    assert RaggedPrefillSpec(8, 2, 64, 64, "float32", rotary_dim=64).rotary_dim is None  # the whole head
    assert "-rd32_" in PagedPrefillSpec(8, 2, 64, "float32", rotary_dim=32).name
    for bad in (0, 3, 66, 2.0, True):
        with pytest.raises(SpecError, match="rotary_dim"):
            RaggedPrefillSpec(8, 2, 64, 64, "float32", rotary_dim=bad)
