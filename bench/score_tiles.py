"""The dense kernel (and a paged KV-cache batch) with the KV-step tiles this CPU gets
(pipeline/cpu_tiles.py) against the row tiles, both built and timed alternately in one process
(docs/performance.md, packed tiles).

    python bench/score_tiles.py --dtypes bfloat16,float32 --lengths 512,2048 [--arch znver3] [--paged]

Prints each pair's times, the ratio and the largest output difference. ``--arch`` builds for
another LLVM CPU the machine can run (znver3: AVX2). ``--paged``: also one paged call of
PAGED_ENTRIES (qo_len, kv_len), page size 16, RoPE on, causal.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from linalg_prefill.bench import best_times
from linalg_prefill.mlir import PagedPrefillSpec, SequencePrefillSpec
from linalg_prefill.mlir.score_tiles import ROW_TILES
from linalg_prefill.pipeline import Target, targets
from linalg_prefill.pipeline.cpu_tiles import cpu_score_tiles
from linalg_prefill.runtime import open_kernel
from linalg_prefill.runtime.checks import NUMPY_DTYPES
from linalg_prefill.runtime.examples import example_inputs
from report import D, H_KV, H_Q, causal_pairs, pair_flops  # bench/report.py: the dense rows' shapes
#: A prefill batch: two long prompts, a chunk against a long prefix, a short one.
PAGED_ENTRIES = [(1024, 1024), (512, 512), (96, 2048), (37, 37)]


def kernels(spec, arch: str) -> tuple:
    """(spec built with this CPU's tiles, spec built with the row tiles)."""
    cpu = targets.BACKENDS["llvm-cpu"]
    own = open_kernel(spec, Target("llvm-cpu", arch))
    targets.BACKENDS["llvm-cpu"] = dataclasses.replace(cpu, score_tiles=lambda arch, dtype: ROW_TILES)
    try:  # the same flags and tuning, row tiles (their own cache key: the IR differs)
        return own, open_kernel(spec, Target("llvm-cpu", arch))
    finally:
        targets.BACKENDS["llvm-cpu"] = cpu


def print_pair(label: str, layout, flops: float, own, rows, args: tuple, repeat: int) -> None:
    row_s, own_s = best_times([lambda: rows(*args), lambda: own(*args)], repeat)
    diff = np.abs(own(*args)[0].astype(np.float32) - rows(*args)[0].astype(np.float32)).max()
    print(f"{label:<24} rows {row_s * 1e3:8.1f} ms {flops / row_s / 1e9:6.1f} GFLOP/s   "
          f"{type(layout).__name__} {own_s * 1e3:8.1f} ms {flops / own_s / 1e9:6.1f} GFLOP/s   "
          f"x{row_s / own_s:.2f}   max |diff| {diff:.2e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048", help="dense lengths ('' for none)")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--arch", default="host")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="IREE task workers")
    parser.add_argument("--paged", action="store_true", help="also a paged KV-cache batch")
    args = parser.parse_args()
    import iree.runtime

    iree.runtime.flags.parse_flags(f"--task_topology_max_group_count={args.threads}")
    for dtype in args.dtypes.split(","):
        layout = cpu_score_tiles(args.arch, dtype)
        lengths = [int(x) for x in args.lengths.split(",") if x]
        if lengths:
            spec = SequencePrefillSpec(H_Q, H_KV, D, dtype, causal=True, sm_scale=D ** -0.5)
            own, rows = kernels(spec, args.arch)
        for length in lengths:
            rng = np.random.default_rng(0)
            q, k, v = (rng.uniform(-1, 1, (1, length, h, D)).astype(NUMPY_DTYPES[dtype]) for h in (H_Q, H_KV, H_KV))
            print_pair(f"{dtype} dense L={length}", layout, pair_flops(causal_pairs(length, length)), own, rows,
                   (q, k, v), args.repeat)
        if args.paged:
            spec = PagedPrefillSpec(H_Q, H_KV, D, dtype, page_size=16)
            own, rows = kernels(spec, args.arch)
            call = example_inputs(spec, np.random.default_rng(0), PAGED_ENTRIES)
            pairs = sum(causal_pairs(q_len, kv_len) for q_len, kv_len in PAGED_ENTRIES)
            print_pair(f"{dtype} paged batch", layout, pair_flops(pairs), own, rows, call, args.repeat)


if __name__ == "__main__":
    main()
