"""Where the bfloat16 lse errors of rotating calls come from (issue: 0.011-0.015 in the fuzzer).

    .venv/bin/python bench/rope_rounding.py [--draws 3000]

Draws the fuzzer's paged sliding-window bfloat16 yarn calls (d=32, RoPE on, sm_scale up to 0.5)
and prints the kernel's lse error against the float64 reference, against the same reference with
the rotated q and k rounded to bfloat16 as the kernel rounds them (semantics §4), and against the
call's error bound (runtime/error_model.py). Not a timing: it times nothing and has no peer.
"""

from __future__ import annotations

import argparse
import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from linalg_prefill.bench import cpu_description  # noqa: E402
from linalg_prefill.mlir import PagedPrefillSpec  # noqa: E402
from linalg_prefill.runtime import open_kernel, reference  # noqa: E402
from linalg_prefill.runtime.compare import error_bound, reference_for  # noqa: E402
from linalg_prefill.runtime.examples import example_inputs  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}
SPEC = PagedPrefillSpec(4, 2, 32, "bfloat16", page_size=8, sliding_window=True, rope_scaling=YARN)
QUERY_LENS = (0, 1, 2, 5, 9, 16, 17, 24)


def _call(rng):
    """A call like tests/test_fuzz.py's: 1-4 entries, any window offset and up to 3 sinks."""
    entries, window = [], []
    for _ in range(rng.integers(1, 5)):
        physical = int(rng.integers(0, 33))
        off, sink = (int(rng.integers(0, physical + 1)), int(rng.integers(0, min(physical, 3) + 1))) if physical else (0, 0)
        entries.append((int(rng.choice(QUERY_LENS)), physical - off + sink if physical else 0))
        window.append((off, sink))
    return example_inputs(SPEC, rng, entries, window=window, causal=int(rng.integers(0, 2)), rotary_mode=1,
                          rope_scale=float(rng.choice([1.0, 0.5, 2.0])), rope_theta=float(rng.choice([1e4, 5e5])),
                          sm_scale=float(rng.choice([32 ** -0.5, 0.05, 0.5])))


def _rounded_rotation_reference(args):
    """The reference with every rotated q and k row rounded to bfloat16."""
    exact = reference.apply_rope

    def rounded(x, positions, **rope):
        return exact(x, positions, **rope).astype(ml_dtypes.bfloat16).astype(np.float64)

    reference.apply_rope = rounded
    try:
        return reference_for(SPEC, args)
    finally:
        reference.apply_rope = exact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=3000)
    options = parser.parse_args()
    kernel = open_kernel(SPEC)
    rng = np.random.default_rng(1)
    rows = []  # (lse error, against the rounded rotation, err/bound) of each call
    for _ in range(options.draws):
        args = _call(rng)
        want = reference_for(SPEC, args)
        got = kernel(*args)
        valid = want[1] != reference.EMPTY_ROW_LSE
        if not valid.any():
            continue
        lse = got[1].astype(np.float64)
        rounded = _rounded_rotation_reference(args)[1]
        rows.append((np.abs(lse - want[1])[valid].max(), np.abs(lse - rounded)[valid].max(),
                     error_bound(SPEC, args, want).ratio(got, want)[1]))
    errors, against_rounded, ratios = (np.array(column) for column in zip(*rows))
    large = errors >= 0.011
    print(f"CPU: {cpu_description()}; {SPEC.name}")
    print(f"{len(rows)} calls with a valid row; lse error vs the reference: median {np.median(errors):.4f}, "
          f"max {errors.max():.4f}; {large.sum()} calls at 0.011 or more")
    print(f"the same calls vs the reference with rotated q/k rounded to bf16: median {np.median(against_rounded):.1e}, "
          f"max {against_rounded.max():.1e} (calls >= 0.011: median {np.median(against_rounded[large]):.1e})")
    print(f"lse error / error bound: median {np.median(ratios):.3f}, max {ratios.max():.3f}")


if __name__ == "__main__":
    main()
