"""The dense kernel with the KV-step tiles this CPU gets (pipeline/cpu_tiles.py) against the row
tiles, both built and timed alternately in one process (docs/performance.md, packed tiles).

    python bench/score_tiles.py --dtypes bfloat16,float32 --lengths 512,2048 [--arch znver3]

Prints each pair's times, the ratio and the largest output difference. ``--arch`` builds for
another LLVM CPU the machine can run (znver3: AVX2).
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from linalg_prefill.bench import best_times
from linalg_prefill.mlir import SequencePrefillSpec
from linalg_prefill.mlir.score_tiles import ROW_TILES
from linalg_prefill.pipeline import Target, targets
from linalg_prefill.pipeline.cpu_tiles import cpu_score_tiles
from linalg_prefill.runtime import open_kernel
from linalg_prefill.runtime.checks import NUMPY_DTYPES

H_Q, H_KV, D = 32, 8, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--arch", default="host")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="IREE task workers")
    args = parser.parse_args()
    import iree.runtime

    iree.runtime.flags.parse_flags(f"--task_topology_max_group_count={args.threads}")
    cpu = targets.BACKENDS["llvm-cpu"]
    row_record = dataclasses.replace(cpu, score_tiles=lambda arch, dtype: ROW_TILES)
    for dtype in args.dtypes.split(","):
        spec = SequencePrefillSpec(H_Q, H_KV, D, dtype, causal=True, sm_scale=D ** -0.5)
        own = open_kernel(spec, Target("llvm-cpu", args.arch))
        targets.BACKENDS["llvm-cpu"] = row_record  # the same flags and tuning, row tiles (its own cache key: the IR)
        try:
            rows = open_kernel(spec, Target("llvm-cpu", args.arch))
        finally:
            targets.BACKENDS["llvm-cpu"] = cpu
        layout = cpu_score_tiles(args.arch, dtype)
        for length in map(int, args.lengths.split(",")):
            rng = np.random.default_rng(0)
            q, k, v = (rng.uniform(-1, 1, (1, length, h, D)).astype(NUMPY_DTYPES[dtype]) for h in (H_Q, H_KV, H_KV))
            row_s, own_s = best_times([lambda: rows(q, k, v), lambda: own(q, k, v)], args.repeat)
            diff = np.abs(own(q, k, v)[0].astype(np.float32) - rows(q, k, v)[0].astype(np.float32)).max()
            flops = 4.0 * D * H_Q * length * (length + 1) / 2
            print(f"{dtype:<9} L={length:<5} rows {row_s * 1e3:8.1f} ms {flops / row_s / 1e9:6.1f} GFLOP/s   "
                  f"{type(layout).__name__} {own_s * 1e3:8.1f} ms {flops / own_s / 1e9:6.1f} GFLOP/s   "
                  f"x{row_s / own_s:.2f}   max |diff| {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
