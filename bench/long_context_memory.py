"""Peak memory of long prefills: shows that no L x L score buffer is ever allocated.

    .venv/bin/python bench/long_context_memory.py [--length 32768] [--h-q 32] [--h-kv 8]
    .venv/bin/python bench/long_context_memory.py --entries 64 --length 512     # a ragged batch

One dense causal sequence of --length tokens (batch_sequence_prefill_kv), or with --entries N a
ragged causal batch of N sequences of --length tokens each (batch_prefill_ragged_kv, RoPE off).
Prints the growth of peak RSS during the call next to the bytes of q + k + v + output + lse (the
bound of the performance issue: growth < 2x those bytes) and the bytes an L x L f32 score matrix
per head would need. The last line is JSON, for tests.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np

from linalg_prefill.mlir import RaggedPrefillSpec, SequencePrefillSpec
from linalg_prefill.runtime import open_kernel


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def dense_call(args, rng):
    spec = SequencePrefillSpec(args.h_q, args.h_kv, args.d, "float32", causal=True, sm_scale=args.d ** -0.5)
    shapes = [(1, args.length, h, args.d) for h in (args.h_q, args.h_kv, args.h_kv)]
    warm = [np.zeros((1, 16, *s[2:]), np.float32) for s in shapes]
    return spec, warm, [rng.uniform(-1, 1, s).astype(np.float32) for s in shapes]


def ragged_call(args, rng):
    spec = RaggedPrefillSpec(args.h_q, args.h_kv, args.d, args.d, "float32")
    n, length = args.entries, args.length

    def call(entries, tokens):
        indptr = np.arange(entries + 1, dtype=np.int32) * tokens
        q = rng.uniform(-1, 1, (entries * tokens, args.h_q, args.d)).astype(np.float32)
        k, v = (rng.uniform(-1, 1, (entries * tokens, args.h_kv, args.d)).astype(np.float32) for _ in range(2))
        positions = np.tile(np.arange(tokens, dtype=np.int32), entries)
        return [q, indptr, k, v, indptr, positions, np.zeros(entries, np.int32), 1, 0, 1.0, 1e4, args.d ** -0.5]

    return spec, call(1, 16), call(n, length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=32768, help="tokens of the sequence (of each entry)")
    parser.add_argument("--entries", type=int, default=0, help="ragged batch of this many sequences (0: dense)")
    parser.add_argument("--h-q", type=int, default=32)
    parser.add_argument("--h-kv", type=int, default=8)
    parser.add_argument("--d", type=int, default=128)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    spec, warm, call = (ragged_call if args.entries else dense_call)(args, rng)
    kernel = open_kernel(spec)
    kernel(*warm)  # loads the module, so its memory is not counted
    before = peak_rss_bytes()
    start = time.perf_counter()
    out, lse = kernel(*call)
    elapsed = time.perf_counter() - start
    growth = peak_rss_bytes() - before
    arrays = [a for a in call[:5] if isinstance(a, np.ndarray) and a.dtype == np.float32] + [out, lse]
    io_bytes = sum(a.nbytes for a in arrays)
    scores = args.length * args.length * 4 * args.h_q
    shape = f"{args.entries} x {args.length} tokens (ragged)" if args.entries else f"L={args.length}"
    print(f"{shape} h_q={args.h_q} h_kv={args.h_kv} d={args.d} f32 causal: {elapsed:.1f} s")
    print(f"peak RSS growth during the call: {growth / 2**20:.0f} MiB; q+k+v+output+lse: {io_bytes / 2**20:.0f} MiB "
          f"(ratio {growth / io_bytes:.2f}); an L x L f32 score matrix for all heads would be {scores / 2**20:.0f} MiB")
    print(json.dumps(dict(seconds=elapsed, growth_bytes=growth, io_bytes=io_bytes, ratio=growth / io_bytes)))


if __name__ == "__main__":
    main()
