"""The dense causal kernel built with extra iree-compile flags against the default build, in one
process, calls alternating (``best_times``): does a flag change the code, and how fast is it.

    .venv/bin/python bench/compile_flags.py --flags="--iree-opt-data-tiling --iree-llvmcpu-enable-ukernels=all"
        [--lengths 2048] [--dtypes float32,bfloat16] [--threads 2]

Prints per dtype and length each build's time, GFLOP/s (the causal half, 4 * d * h_q per pair) and
its output's largest difference from the default build's (0: most likely the same code).
"""

from __future__ import annotations

import argparse

import numpy as np

from linalg_prefill.bench import best_times
from linalg_prefill.mlir import SequencePrefillSpec
from linalg_prefill.pipeline import Target
from linalg_prefill.runtime import open_kernel
from linalg_prefill.runtime.checks import NUMPY_DTYPES
from report import D, H_KV, H_Q, causal_pairs, pair_flops  # bench/report.py: the dense rows' shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flags", required=True, help="extra iree-compile flags, space-separated")
    parser.add_argument("--lengths", default="2048")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="IREE task workers")
    args = parser.parse_args()
    import iree.runtime

    iree.runtime.flags.parse_flags(f"--task_topology_max_group_count={args.threads}")
    builds = {"default": (), "flags": tuple(args.flags.split())}
    for dtype in args.dtypes.split(","):
        spec = SequencePrefillSpec(H_Q, H_KV, D, dtype, causal=True, sm_scale=D ** -0.5)
        kernels = {name: open_kernel(spec, Target("llvm-cpu", "host", flags)) for name, flags in builds.items()}
        for length in map(int, args.lengths.split(",")):
            rng = np.random.default_rng(0)
            q, k, v = (rng.uniform(-1, 1, (1, length, h, D)).astype(NUMPY_DTYPES[dtype]) for h in (H_Q, H_KV, H_KV))
            times = best_times([lambda kernel=kernel: kernel(q, k, v) for kernel in kernels.values()], args.repeat)
            want = kernels["default"](q, k, v)[0].astype(np.float32)
            flops = pair_flops(causal_pairs(length, length))
            for (name, kernel), seconds in zip(kernels.items(), times):
                diff = np.abs(kernel(q, k, v)[0].astype(np.float32) - want).max()
                print(f"{dtype:<9} L={length:<6} {name:<8} {seconds * 1e3:9.1f} ms {flops / seconds / 1e9:7.1f} GFLOP/s"
                      f"  max |out - default| {diff:.2e}  x{times[0] / seconds:.2f} of default", flush=True)


if __name__ == "__main__":
    main()
