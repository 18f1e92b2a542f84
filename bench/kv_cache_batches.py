"""Mixed-length batches through the ragged and paged kernels against the dense kernel (llvm-cpu).

    .venv/bin/python bench/kv_cache_batches.py [--lengths 37,512,1024,96,2048,5] [--dtype bfloat16]
                                               [--arch cooperlake] [--repeat 3] [--tvm]

Causal self-attention of every entry (q_indptr == kv_indptr, the prefill of new tokens), h_q=32,
h_kv=8, d=128, float32 (or --dtype bfloat16), RoPE off; ``--arch``: the CPU the kernels are built
for (default the host; ``cooperlake`` on an AMX host builds the linalg lowering it had before the
x86 one). Effective GFLOP/s counts only unmasked (query, key) pairs:
4 * d * h_q * sum_b n_b (n_b + 1) / 2. The dense kernel runs one sequence of --dense-length
tokens with the same heads; the ratios say whether a ragged batch costs what its tokens cost.
torch SDPA (2 threads), looping over the entries, is timed in the same run as the CPU peer, and
with --tvm the seed's own CPU kernels (apache-tvm 0.27, scalar loops; slow: tens of seconds).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from linalg_prefill.mlir import PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec  # noqa: E402
from linalg_prefill.bench import best_time, cpu_description  # noqa: E402
from linalg_prefill.pipeline import Target  # noqa: E402
from linalg_prefill.runtime import open_kernel  # noqa: E402
from linalg_prefill.runtime.checks import NUMPY_DTYPES  # noqa: E402
from linalg_prefill.runtime.examples import page_table  # noqa: E402
from linalg_prefill.runtime.interop import to_torch  # noqa: E402

H_Q, H_KV, D, PAGE_SIZE = 32, 8, 128, 16


def causal_pairs(lengths) -> int:
    return sum(n * (n + 1) // 2 for n in lengths)


def gflops(pairs: int, seconds: float) -> float:
    return 4.0 * D * H_Q * pairs / seconds / 1e9


def ragged_inputs(lengths, rng, dtype):
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(indptr[-1])
    q, k, v = (rng.uniform(-1, 1, (total, h, D)).astype(dtype) for h in (H_Q, H_KV, H_KV))
    return q, indptr, k, v


def paged_inputs(k, v, indptr, lengths, rng):
    """The same KV written into shuffled pages: (pages, page_indptr, page_values, last_page_len)."""
    table = page_table(rng, lengths, PAGE_SIZE, spare_pages=0)
    page_indptr, page_values = table.page_indptr, table.page_values
    pages = np.zeros((table.num_pages, 2, H_KV, PAGE_SIZE, D), k.dtype)
    for b, n in enumerate(lengths):
        rows = np.arange(n)
        ids = page_values[page_indptr[b] + rows // PAGE_SIZE]
        pages[ids, 0, :, rows % PAGE_SIZE] = k[indptr[b]:indptr[b] + n]
        pages[ids, 1, :, rows % PAGE_SIZE] = v[indptr[b]:indptr[b] + n]
    return pages, page_indptr, page_values, table.length_info


def torch_loop(q, k, v, indptr):
    import torch.nn.functional as F

    def heads_major(x):  # [n, h, d] -> [1, h, n, d]: the 4-D layout SDPA's fast CPU path takes
        return to_torch(x.transpose(1, 0, 2)[None])

    entries = [(heads_major(q[a:b]), heads_major(k[a:b]), heads_major(v[a:b])) for a, b in zip(indptr[:-1], indptr[1:])]

    def run():
        for tq, tk, tv in entries:
            F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)

    return run


def tvm_ragged(q, indptr, k, v):
    """The seed's ragged CPU kernel (apache-tvm 0.27) on the same batch."""
    import tvm
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_ragged_cpu

    func = _attention_prefill_ragged_cpu(H_KV, H_Q, D, D, "float32", {})
    kernel = tvm.compile(tvm.IRModule({"main": func}), target={"kind": "llvm"})["main"]
    dev = tvm.cpu()
    total, batch = q.shape[0], len(indptr) - 1
    args = [tvm.runtime.tensor(x, dev) for x in (q, indptr, k, v, indptr, np.zeros(total, np.int32),
                                                  np.zeros(batch, np.int32), np.zeros((total, H_Q, D), np.float32),
                                                  np.zeros((total, H_Q), np.float32))]
    return lambda: kernel(*args, 1, 0, 1.0, 1e4, D ** -0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="37,512,1024,96,2048,5")
    parser.add_argument("--dense-length", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--arch", default="host")
    parser.add_argument("--tvm", action="store_true", help="also time the seed's CPU ragged kernel")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = np.random.default_rng(0)
    q, indptr, k, v = ragged_inputs(lengths, rng, NUMPY_DTYPES[args.dtype])
    pages, page_indptr, page_values, last = paged_inputs(k, v, indptr, lengths, rng)
    batch = len(lengths)
    zeros_b, zeros_q = np.zeros(batch, np.int32), np.zeros(q.shape[0], np.int32)
    scalars = (1, 0, 1.0, 1e4, D ** -0.5)  # causal, rotary_mode, rope_scale, rope_theta, sm_scale

    target = Target("llvm-cpu", args.arch)
    ragged = open_kernel(RaggedPrefillSpec(H_Q, H_KV, D, D, args.dtype), target)
    paged = open_kernel(PagedPrefillSpec(H_Q, H_KV, D, args.dtype, page_size=PAGE_SIZE), target)
    dense = open_kernel(SequencePrefillSpec(H_Q, H_KV, D, args.dtype, causal=True, sm_scale=D ** -0.5), target)
    dq, dk, dv = (rng.uniform(-1, 1, (1, args.dense_length, h, D)).astype(q.dtype) for h in (H_Q, H_KV, H_KV))

    pairs = causal_pairs(lengths)
    timings = {
        "dense (1 x %d)" % args.dense_length: (best_time(lambda: dense(dq, dk, dv), args.repeat),
                                               causal_pairs([args.dense_length])),
        "ragged batch": (best_time(lambda: ragged(q, indptr, k, v, indptr, zeros_q, zeros_b, *scalars), args.repeat),
                         pairs),
        "paged batch": (best_time(lambda: paged(q, indptr, pages, page_indptr, page_values, last, zeros_b, zeros_q,
                                                *scalars), args.repeat), pairs),
        "torch SDPA loop": (best_time(torch_loop(q, k, v, indptr), args.repeat), pairs),
    }
    if args.tvm:
        timings["seed TVM ragged (cpu)"] = (best_time(tvm_ragged(q, indptr, k, v), 1), pairs)
    print(f"causal prefill, lengths {lengths} ({q.shape[0]} tokens), h_q={H_Q} h_kv={H_KV} d={D} {args.dtype}, "
          f"llvm-cpu {args.arch} ({target.lowering_of(ragged.spec)} lowering); CPU: {cpu_description()}")
    dense_rate = None
    print(f"{'kernel':<26} {'ms':>9} {'GFLOP/s':>9} {'vs dense':>9}")
    for name, (seconds, n_pairs) in timings.items():
        rate = gflops(n_pairs, seconds)
        dense_rate = dense_rate or rate
        print(f"{name:<26} {seconds * 1e3:>9.1f} {rate:>9.1f} {rate / dense_rate:>9.2f}")
    ragged_s, paged_s = timings["ragged batch"][0], timings["paged batch"][0]
    print(f"\npaged / ragged time: {paged_s / ragged_s:.2f}; ours vs torch loop: "
          f"{timings['torch SDPA loop'][0] / ragged_s:.2f}x")


if __name__ == "__main__":
    main()
