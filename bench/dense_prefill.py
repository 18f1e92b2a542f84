"""Dense causal prefill on llvm-cpu against torch SDPA (CPU, 2 threads), timed in the same run.

    .venv/bin/python bench/dense_prefill.py [--lengths 512,2048,4096] [--dtype float32] [--heads 32/8] [--repeat 3]

Shape: B=1, h_q=32, h_kv=8, d=128 (GQA 4; ``--heads 32/32``: MHA, ``32/1``: MQA). GFLOP/s counts 4 * L * L * d * h_q, halved for causal
(only the unmasked pairs). Each figure is the best of --repeat runs, ours and torch's interleaved.
Also times IREE's fused ``iree_linalg_ext.attention`` (non-causal, one size) against ours.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from linalg_prefill.mlir import SequencePrefillSpec  # noqa: E402
from linalg_prefill.bench import best_time, cpu_description  # noqa: E402
from linalg_prefill.runtime import open_kernel  # noqa: E402
from linalg_prefill.runtime.checks import NUMPY_DTYPES  # noqa: E402

H_Q, H_KV, D = 32, 8, 128


def attention_flops(q_len: int, kv_len: int, heads: int, d: int, causal: bool) -> float:
    return 4.0 * q_len * kv_len * d * heads * (0.5 if causal else 1.0)


def torch_sdpa(q, k, v, causal: bool):
    import torch
    import torch.nn.functional as F

    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3).astype(np.float32))) for x in (q, k, v))
    return lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=True)


def bench_dense(lengths, dtype: str, repeat: int, causal: bool = True) -> list[dict]:
    import torch

    torch.set_num_threads(2)
    spec = SequencePrefillSpec(H_Q, H_KV, D, dtype, causal=causal, sm_scale=D ** -0.5)
    kernel = open_kernel(spec)
    rng = np.random.default_rng(0)
    rows = []
    for length in lengths:
        dt = NUMPY_DTYPES[dtype]
        q = rng.uniform(-1, 1, (1, length, H_Q, D)).astype(dt)
        k = rng.uniform(-1, 1, (1, length, H_KV, D)).astype(dt)
        v = rng.uniform(-1, 1, (1, length, H_KV, D)).astype(dt)
        flops = attention_flops(length, length, H_Q, D, causal)
        ours = best_time(lambda: kernel(q, k, v), repeat)
        peer = best_time(torch_sdpa(q, k, v, causal), repeat)
        rows.append(dict(L=length, dtype=dtype, causal=causal, ours_ms=ours * 1e3, torch_ms=peer * 1e3,
                         ours_gflops=flops / ours / 1e9, torch_gflops=flops / peer / 1e9, ratio=peer / ours))
    return rows


def bench_fused(length: int, repeat: int) -> dict:
    """IREE fused attention vs our decomposition, non-causal f32, B*H = 8 (MHA, 8 heads)."""
    from fused_attention import build_fused_attention
    from linalg_prefill.pipeline import Target, compile_ir
    from linalg_prefill.runtime.module import LoadedKernel

    heads = 8
    fused = LoadedKernel(compile_ir(build_fused_attention(heads, length, D), Target("llvm-cpu")), "attention", "local-task")
    ours = open_kernel(SequencePrefillSpec(heads, heads, D, "float32", causal=False, sm_scale=D ** -0.5))
    rng = np.random.default_rng(0)
    q, k, v = (rng.uniform(-1, 1, (1, length, heads, D)).astype(np.float32) for _ in range(3))
    qf, kf, vf = (np.ascontiguousarray(x[0].transpose(1, 0, 2)) for x in (q, k, v))
    flops = attention_flops(length, length, heads, D, False)
    t_fused = best_time(lambda: fused(qf, kf, vf), max(1, repeat // 2))
    t_ours = best_time(lambda: ours(q, k, v), repeat)
    err = float(np.max(np.abs(fused(qf, kf, vf)[0] - ours(q, k, v)[0][0].transpose(1, 0, 2))))
    return dict(L=length, heads=heads, fused_gflops=flops / t_fused / 1e9, ours_gflops=flops / t_ours / 1e9,
                speedup=t_fused / t_ours, max_diff=err)


def main() -> None:
    global H_Q, H_KV
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048,4096")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--heads", default=f"{H_Q}/{H_KV}", help="h_q/h_kv (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--fused-length", type=int, default=1024)
    args = parser.parse_args()
    H_Q, H_KV = (int(x) for x in args.heads.split("/"))
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"CPU: {cpu_description()}")
    print(f"dense causal prefill, B=1 h_q={H_Q} h_kv={H_KV} d={D} {args.dtype}, llvm-cpu vs torch SDPA (2 threads)")
    print(f"{'L':>6} {'ours ms':>9} {'torch ms':>9} {'ours GFLOP/s':>13} {'torch GFLOP/s':>14} {'ratio':>6}")
    for r in bench_dense(lengths, args.dtype, args.repeat):
        print(f"{r['L']:>6} {r['ours_ms']:>9.1f} {r['torch_ms']:>9.1f} {r['ours_gflops']:>13.1f} "
              f"{r['torch_gflops']:>14.1f} {r['ratio']:>6.2f}")
    if args.fused_length:
        f = bench_fused(args.fused_length, args.repeat)
        print(f"\nIREE fused iree_linalg_ext.attention, non-causal f32, {f['heads']} heads, L={f['L']}: "
              f"{f['fused_gflops']:.1f} GFLOP/s; ours {f['ours_gflops']:.1f} GFLOP/s "
              f"({f['speedup']:.1f}x faster; max |diff| {f['max_diff']:.1e})")


if __name__ == "__main__":
    main()
