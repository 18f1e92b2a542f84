"""Logits soft-capping (Gemma 2): score = cap * tanh(sm_scale * q.k / cap), before the mask, on
every variant and both lowerings, against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_matches_reference, on_backends
from linalg_prefill.mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec, SpecError,
)
from linalg_prefill.runtime import open_kernel
from linalg_prefill.runtime.compare import reference_for
from linalg_prefill.mlir.abi import argument_names
from linalg_prefill.runtime.examples import example_inputs

CAP = 5.0
#: Every variant, each lowering on two or three of them (the cap is one score transform per
#: lowering, shared by its variants; tests/test_decode_batches.py runs a capped paged kernel and
#: its passes on both).
CASES = [
    (SequencePrefillSpec(8, 2, 64, "float32", causal=True, sm_scale=1.0, logits_soft_cap=CAP), "linalg"),
    (MaskedSequencePrefillSpec(8, 2, 64, "float32", mask_mode="causal_padded_left", sm_scale=1.0,
                               logits_soft_cap=CAP), "fused"),
    (RaggedPrefillSpec(8, 2, 64, 64, "float32", logits_soft_cap=CAP), "fused"),
    (PagedPrefillSpec(8, 2, 64, "float32", page_size=16, sliding_window=True, logits_soft_cap=CAP), "linalg"),
    *((MlaPagedPrefillSpec(4, 64, 16, "float32", page_size=8, logits_soft_cap=CAP), lowering)
      for lowering in ("linalg", "fused")),
]
ENTRIES = [(5, 3), (0, 7), (70, 150), (9, 0), (20, 40)]
#: MLA's calls (no RoPE) take serving passes: built before the tests run (tests/conftest.py).
pytestmark = pytest.mark.compiles(passes=ENTRIES)


def _large_scores(spec, rng):
    """A valid call whose raw scores reach well past the cap: q scaled by 3, sm_scale 1."""
    unscaled = {"sm_scale": 1.0} if "sm_scale" in argument_names(spec) else {}  # dense: the spec's
    args = list(example_inputs(spec, rng, entries=ENTRIES, **unscaled))
    args[0] = (args[0].astype(np.float32) * 3).astype(args[0].dtype)
    return args


@pytest.mark.parametrize("spec, backend", on_backends(CASES))
def test_soft_cap_matches_the_reference(spec, backend, cache):
    args = _large_scores(spec, np.random.default_rng(1))
    got = open_kernel(spec, backend, cache=cache)(*args)
    want = reference_for(spec, args)
    assert_matches_reference(spec.name, got, spec, args, want)
    uncapped = reference_for(type(spec)(**{**spec.fields(), "logits_soft_cap": 0.0}), args)
    changed = np.abs(want[1] - uncapped[1])[want[1] != -5e4]
    assert changed.max() > 1.0  # the cap changes the result far beyond any tolerance


def test_soft_cap_names_the_artifact_and_is_validated():
    base = SequencePrefillSpec(8, 2, 64, "float32", causal=True, sm_scale=1.0)
    assert "cap" not in base.name and base.logits_soft_cap == 0.0
    assert SequencePrefillSpec(8, 2, 64, "float32", causal=True, sm_scale=1.0, logits_soft_cap=50).name.endswith("_cap50p0")
    for bad in (-1.0, float("nan"), float("inf"), "30"):
        with pytest.raises(SpecError, match="logits_soft_cap"):
            RaggedPrefillSpec(8, 2, 64, 64, "float32", logits_soft_cap=bad)
