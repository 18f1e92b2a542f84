"""How close the kernels come to their error bound (runtime/error_model.py), per dtype.

    .venv/bin/python bench/bound_ratios.py [--draws 40]

For every spec the fuzzer compiles (tests/test_fuzz.py), draws calls with the fuzzer's lengths
(RoPE on and off, causal and not) and prints the largest and the median |error| / bound of
output and lse over the calls, per (dtype, RoPE): 1 would mean the bound is met exactly. Not a
timing: it times nothing and has no peer.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from linalg_prefill.bench import cpu_description  # noqa: E402
from linalg_prefill.mlir.abi import argument_names  # noqa: E402
from linalg_prefill.runtime import open_kernel  # noqa: E402
from linalg_prefill.runtime.compare import error_bound, reference_for  # noqa: E402
from linalg_prefill.runtime.examples import example_inputs  # noqa: E402
from support import DENSE_SPECS, KV_SPECS, THOROUGH_DENSE_SPECS, THOROUGH_KV_SPECS  # noqa: E402

QUERY_LENS, KV_LENS = (0, 1, 2, 5, 9, 16, 17, 24), (0, 1, 3, 8, 16, 33, 40)


def _call(spec, rng):
    entries = [(int(rng.choice(QUERY_LENS[1:])), int(rng.choice(KV_LENS[1:]))) for _ in range(rng.integers(1, 5))]
    given = {name: value for name, value in (("causal", int(rng.integers(0, 2))), ("rotary_mode", int(rng.integers(0, 2))))
             if name in argument_names(spec)}
    return example_inputs(spec, rng, entries, **given)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=40, help="calls per spec")
    options = parser.parse_args()
    rng = np.random.default_rng(0)
    ratios = collections.defaultdict(list)  # (dtype, rotated) -> [(output ratio, lse ratio)]
    specs = KV_SPECS + THOROUGH_KV_SPECS + DENSE_SPECS + THOROUGH_DENSE_SPECS
    for spec in specs:
        kernel = open_kernel(spec)
        for _ in range(options.draws):
            args = _call(spec, rng)
            want = reference_for(spec, args)
            rotated = dict(zip(argument_names(spec), args)).get("rotary_mode", 0) == 1
            ratios[spec.dtype, rotated].append(error_bound(spec, args, want).ratio(kernel(*args), want))
    print(f"CPU: {cpu_description()}; {options.draws} calls per spec, {len(specs)} specs")
    print(f"{'dtype':<9} {'RoPE':<5} {'calls':>5} {'output max':>10} {'median':>7} {'lse max':>8} {'median':>7}")
    for (dtype, rotated), rows in sorted(ratios.items()):
        out, lse = np.array(rows).T
        print(f"{dtype:<9} {'on' if rotated else 'off':<5} {len(rows):>5} {out.max():>10.3f} {np.median(out):>7.3f} "
              f"{lse.max():>8.3f} {np.median(lse):>7.3f}")


if __name__ == "__main__":
    main()
