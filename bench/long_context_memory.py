"""Peak memory of one long sequence: shows that no L x L score buffer is ever allocated.

    .venv/bin/python bench/long_context_memory.py [--length 8192] [--h-q 4] [--h-kv 1]

Prints the growth of peak RSS during the call next to the bytes of q + k + v + output and the
bytes an L x L f32 score matrix per head would need.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

from linalg_prefill.mlir import SequencePrefillSpec
from linalg_prefill.runtime import open_kernel


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--h-q", type=int, default=4)
    parser.add_argument("--h-kv", type=int, default=1)
    parser.add_argument("--d", type=int, default=128)
    args = parser.parse_args()
    spec = SequencePrefillSpec(args.h_q, args.h_kv, args.d, "float32", causal=True, sm_scale=args.d ** -0.5)
    kernel = open_kernel(spec)
    kernel(*(np.zeros((1, 16, h, args.d), np.float32) for h in (args.h_q, args.h_kv, args.h_kv)))  # load
    rng = np.random.default_rng(0)
    q = rng.uniform(-1, 1, (1, args.length, args.h_q, args.d)).astype(np.float32)
    k = rng.uniform(-1, 1, (1, args.length, args.h_kv, args.d)).astype(np.float32)
    v = rng.uniform(-1, 1, (1, args.length, args.h_kv, args.d)).astype(np.float32)
    before = peak_rss_bytes()
    t0 = time.perf_counter()
    out, lse = kernel(q, k, v)
    elapsed = time.perf_counter() - t0
    growth = peak_rss_bytes() - before
    io_bytes = q.nbytes + k.nbytes + v.nbytes + out.nbytes + lse.nbytes
    scores = args.length * args.length * 4 * args.h_q
    print(f"L={args.length} h_q={args.h_q} h_kv={args.h_kv} d={args.d} f32 causal: {elapsed:.1f} s")
    print(f"peak RSS growth during the call: {growth / 2**20:.0f} MiB; q+k+v+output+lse: {io_bytes / 2**20:.0f} MiB "
          f"(ratio {growth / io_bytes:.2f}); an L x L f32 score matrix for all heads would be {scores / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
