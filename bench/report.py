"""The performance table against the peers, as JSON and a PNG chart, in one run.

    .venv/bin/python bench/report.py [--lengths 512,2048,8192] [--dtypes float32,bfloat16,float16]
                                     [--tvm] [--dense-only] [--out build/bench-report]

The first line names the CPU (/proc/cpuinfo's model name and number, AMX yes/no), as does each
row of the JSON (``cpu``); a dense row names the lowering our kernel ran in (``x86`` on a CPU with
AMX: hand-written dispatches, AMX tiles for bf16, FMA blocks for f32; else ``linalg``).

Every figure is ours and the peer's from the same process (torch on 2 threads), calls alternating
between ours and the peer's (``best_times``; calls under 0.2 s in bursts filling it, up to 50 calls
(``serving_batches.burst_for``), the small prefill in bursts of 50, see there):

* dense causal prefill, B=1, h_q=32, h_kv=8, d=128, per dtype and length, vs torch SDPA;
* IREE's fused ``iree_linalg_ext.attention`` against our decomposition (non-causal f32, L=1024);
* a small prefill: 16 new tokens against 256 cached ones (ragged kernel) vs torch SDPA with the
  bottom-right causal mask, with our inputs and output on the IREE device and with numpy in/out;
* the mixed-length ragged and paged batches of ``kv_cache_batches.py`` vs the dense kernel and a
  torch SDPA loop over the entries;
* serving steps (``serving_batches.py``): 8 and 32 sequences with 1 and 4 new tokens each
  against 1024 cached tokens and mixed cached lengths, vs torch SDPA on the gathered padded KV;
* with ``--tvm``: the seed's own CPU kernels (apache-tvm 0.27) on one 512-token sequence, paged
  and ragged.

GFLOP/s count the unmasked query-key pairs (4 * d * h_q per pair; the serving rows give KV GB/s
in ``serving_batches.py``'s JSON fields instead). ``ratio`` is the peer's time over ours (above
1: we are faster). ``of GEMM`` (dense rows): our GFLOP/s as a share of torch.matmul's on two
2048 x 2048 matrices of the same dtype, timed in the same run (the contraction rate the machine
reaches in that dtype); where torch's GEMM is slower than our attention (float16 on a CPU
without AVX512-FP16: no fast half-precision matmul in torch) the column gives its GFLOP/s alone. Writes ``report.json`` and ``report.png`` (matplotlib: GFLOP/s against
sequence length, one panel per dtype, and a panel of the serving ratios) into ``--out``. Needs the ``bench`` extra (torch,
matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from linalg_prefill.mlir import PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec  # noqa: E402
from linalg_prefill.bench import best_time, best_times, cpu_description  # noqa: E402
from linalg_prefill.runtime import open_kernel  # noqa: E402
from linalg_prefill.runtime.checks import NUMPY_DTYPES  # noqa: E402
from serving_batches import burst_for  # noqa: E402

H_Q, H_KV, D = 32, 8, 128


def pair_flops(pairs: int, heads: int = H_Q, d: int = D) -> float:
    return 4.0 * d * heads * pairs


def causal_pairs(q_len: int, kv_len: int) -> int:
    """Unmasked pairs of a bottom-right causal q_len x kv_len block."""
    rows = np.arange(q_len)
    return int(np.clip(rows + kv_len - q_len + 1, 0, kv_len).sum())


def to_torch(x: np.ndarray, dtype: str):
    """[L, h, d] or [1, L, h, d] numpy -> [1, h, L, d] torch tensor of ``dtype``."""
    import torch

    x = x if x.ndim == 3 else x[0]
    return torch.from_numpy(np.ascontiguousarray(x.astype(np.float32).transpose(1, 0, 2))[None]).to(
        getattr(torch, dtype))


def row(section: str, name: str, dtype: str, length, ours_s: float, peer: str, peer_s: float | None,
        flops: float) -> dict:
    return dict(section=section, name=name, dtype=dtype, L=length, ours_ms=ours_s * 1e3,
                ours_gflops=flops / ours_s / 1e9, peer=peer, peer_ms=None if peer_s is None else peer_s * 1e3,
                peer_gflops=None if peer_s is None else flops / peer_s / 1e9,
                ratio=None if peer_s is None else peer_s / ours_s)


#: The same-dtype GEMM a dense row is measured against: torch.matmul of two N x N matrices.
GEMM_N = 2048


def gemm_gflops(dtype: str, repeat: int = 3) -> float:
    """GFLOP/s of torch.matmul, ``GEMM_N``^3 in ``dtype``, in this process (torch's threads): the
    machine's contraction rate in that dtype, which the dense rows are a share of."""
    import torch

    a, b = (torch.rand(GEMM_N, GEMM_N).to(getattr(torch, dtype)) for _ in range(2))
    return 2.0 * GEMM_N ** 3 / best_time(lambda: torch.matmul(a, b), repeat) / 1e9


def dense_rows(lengths, dtypes, rng) -> list[dict]:
    """Each dtype's causal rows vs torch SDPA, each with ``gemm_gflops`` (the same-dtype GEMM,
    timed in the same run) and ``of_gemm`` (our GFLOP/s over it)."""
    import torch.nn.functional as F

    rows = []
    for dtype in dtypes:
        spec = SequencePrefillSpec(H_Q, H_KV, D, dtype, causal=True, sm_scale=D ** -0.5)
        kernel = open_kernel(spec)
        gemm = gemm_gflops(dtype)
        for length in lengths:
            q, k, v = (rng.uniform(-1, 1, (1, length, h, D)).astype(NUMPY_DTYPES[dtype]) for h in (H_Q, H_KV, H_KV))
            tq, tk, tv = (to_torch(x, dtype) for x in (q, k, v))
            repeat = 2 if length >= 8192 else 5
            start = time.perf_counter()
            kernel(q, k, v)
            ours, peer = best_times([lambda: kernel(q, k, v),
                                     lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)],
                                    repeat, burst_for(time.perf_counter() - start))
            rows.append(row("dense", f"causal prefill ({kernel.target.lowering_of(spec)})", dtype, length, ours,
                            "torch SDPA", peer,
                            pair_flops(causal_pairs(length, length))))
            rows[-1].update(gemm_gflops=gemm, of_gemm=rows[-1]["ours_gflops"] / gemm)
            print(format_row(rows[-1]), flush=True)
    return rows


def fused_row(length: int = 1024) -> dict:
    from dense_prefill import bench_fused

    fused = bench_fused(length, 3)
    flops = pair_flops(length * length, heads=fused["heads"])
    ours_s, fused_s = flops / fused["ours_gflops"] / 1e9, flops / fused["fused_gflops"] / 1e9
    return row("fused", "non-causal, 8 heads", "float32", length, ours_s, "IREE fused attention", fused_s, flops)


def small_prefill_rows(rng, q_len: int = 16, kv_len: int = 256) -> list[dict]:
    """Two rows for one call of ``q_len`` new tokens against ``kv_len`` cached ones: our kernel with
    q, k and v already on the IREE device and the output left there (a serving stack's steady
    state, as torch gets and returns torch tensors), and the same call with numpy in and out,
    which adds IREE's host copies (about 0.1-0.2 ms each way here)."""
    import torch
    import torch.nn.functional as F

    from linalg_prefill.runtime.module import as_device_arrays

    kernel = open_kernel(RaggedPrefillSpec(H_Q, H_KV, D, D, "float32"))
    q = rng.uniform(-1, 1, (q_len, H_Q, D)).astype(np.float32)
    k, v = (rng.uniform(-1, 1, (kv_len, H_KV, D)).astype(np.float32) for _ in range(2))
    indices = (np.array([0, kv_len], np.int32), np.arange(kv_len - q_len, kv_len, dtype=np.int32),
               np.zeros(1, np.int32))
    scalars = (1, 0, 1.0, 1e4, D ** -0.5)
    q_dev, k_dev, v_dev = as_device_arrays(kernel.device, [q, k, v])
    q_indptr = np.array([0, q_len], np.int32)
    tq, tk, tv = (to_torch(x, "float32") for x in (q, k, v))
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    resident, on_host, peer = best_times(
        [lambda: kernel(q_dev, q_indptr, k_dev, v_dev, *indices, *scalars, to_host=False),
         lambda: kernel(q, q_indptr, k, v, *indices, *scalars),
         lambda: F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True)],
        repeat=10, burst=50)
    flops = pair_flops(causal_pairs(q_len, kv_len))
    name = f"{q_len} new vs {kv_len} cached"
    return [row("small", f"{name}, on device", "float32", q_len, resident, "torch SDPA", peer, flops),
            row("small", f"{name}, numpy i/o", "float32", q_len, on_host, "torch SDPA", peer, flops)]


def batch_rows(rng, lengths=(37, 512, 1024, 96, 2048, 5), dense_length: int = 1024) -> list[dict]:
    from kv_cache_batches import PAGE_SIZE, paged_inputs, ragged_inputs, torch_loop

    q, indptr, k, v = ragged_inputs(list(lengths), rng)
    pages, page_indptr, page_values, last = paged_inputs(k, v, indptr, list(lengths), rng)
    zeros_b, zeros_q = np.zeros(len(lengths), np.int32), np.zeros(q.shape[0], np.int32)
    scalars = (1, 0, 1.0, 1e4, D ** -0.5)
    ragged = open_kernel(RaggedPrefillSpec(H_Q, H_KV, D, D, "float32"))
    paged = open_kernel(PagedPrefillSpec(H_Q, H_KV, D, "float32", page_size=PAGE_SIZE))
    dense = open_kernel(SequencePrefillSpec(H_Q, H_KV, D, "float32", causal=True, sm_scale=D ** -0.5))
    dq, dk, dv = (rng.uniform(-1, 1, (1, dense_length, h, D)).astype(np.float32) for h in (H_Q, H_KV, H_KV))
    flops = pair_flops(sum(causal_pairs(n, n) for n in lengths))
    calls = [lambda: dense(dq, dk, dv), torch_loop(q, k, v, indptr),
             lambda: ragged(q, indptr, k, v, indptr, zeros_q, zeros_b, *scalars),
             lambda: paged(q, indptr, pages, page_indptr, page_values, last, zeros_b, zeros_q, *scalars)]
    dense_s, peer_s, *batch_s = best_times(calls, 3)
    dense_rate = pair_flops(causal_pairs(dense_length, dense_length)) / dense_s
    rows = []
    for name, ours in zip(("ragged batch", "paged batch"), batch_s):
        rows.append(row("batch", name, "float32", int(q.shape[0]), ours, "torch SDPA loop", peer_s, flops))
        rows[-1]["vs_dense"] = flops / ours / dense_rate
    return rows


def tvm_rows(rng, length: int = 512) -> list[dict]:
    """The seed's CPU kernels against ours on one causal sequence of ``length`` tokens."""
    import tvm
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_cpu, _attention_prefill_ragged_cpu

    from kv_cache_batches import PAGE_SIZE, paged_inputs, ragged_inputs

    q, indptr, k, v = ragged_inputs([length], rng)
    pages, page_indptr, page_values, last = paged_inputs(k, v, indptr, [length], rng)
    zeros_b, zeros_q = np.zeros(1, np.int32), np.zeros(length, np.int32)
    scalars = (1, 0, 1.0, 1e4, D ** -0.5)
    dev = tvm.cpu()
    out = [tvm.runtime.tensor(x, dev) for x in (np.zeros((length, H_Q, D), np.float32),
                                                 np.zeros((length, H_Q), np.float32))]
    build = lambda f: tvm.compile(tvm.IRModule({"main": f}), target={"kind": "llvm"})["main"]  # noqa: E731
    seed_ragged = build(_attention_prefill_ragged_cpu(H_KV, H_Q, D, D, "float32", {}))
    seed_paged = build(_attention_prefill_cpu(H_KV, H_Q, D, "float32", False, {}, page_size=PAGE_SIZE))
    tensors = lambda *xs: [tvm.runtime.tensor(x, dev) for x in xs]  # noqa: E731
    ragged_args = tensors(q, indptr, k, v, indptr, zeros_q, zeros_b) + out
    paged_args = tensors(q, indptr, pages, page_indptr, page_values, last, zeros_b, zeros_q) + out
    flops = pair_flops(causal_pairs(length, length))
    ragged = open_kernel(RaggedPrefillSpec(H_Q, H_KV, D, D, "float32"))
    paged = open_kernel(PagedPrefillSpec(H_Q, H_KV, D, "float32", page_size=PAGE_SIZE))
    rows = []
    for name, ours_call, seed_call in (
            ("ragged", lambda: ragged(q, indptr, k, v, indptr, zeros_q, zeros_b, *scalars),
             lambda: seed_ragged(*ragged_args, *scalars)),
            ("paged", lambda: paged(q, indptr, pages, page_indptr, page_values, last, zeros_b, zeros_q, *scalars),
             lambda: seed_paged(*paged_args, *scalars))):
        rows.append(row("seed", name, "float32", length, best_time(ours_call, 3), "seed TVM CPU kernel",
                        best_time(seed_call, 1), flops))
    return rows


def serving_rows(rng, batches=(8, 32), new_tokens=(1, 4), cached=("1024", "mixed")) -> list[dict]:
    """Serving steps through ``PagedPrefillWrapper`` vs torch SDPA (serving_batches.measure_row)."""
    from serving_batches import H_Q as S_H_Q, H_KV as S_H_KV, D as S_D, PAGE_SIZE, measure_row
    from linalg_prefill.runtime import PagedPrefillWrapper

    wrapper = PagedPrefillWrapper(PagedPrefillSpec(S_H_Q, S_H_KV, S_D, "float32", page_size=PAGE_SIZE))
    rows = []
    for batch in batches:
        for new in new_tokens:
            for kv in cached:
                r = measure_row(wrapper, batch, new, kv, "float32", 3, rng)
                rows.append(dict(r, section="serve", name=f"{batch} x {new} new vs {kv} cached", L=kv,
                                 ours_gflops=None, peer="torch SDPA (padded)", peer_ms=r["torch_ms"],
                                 peer_gflops=None))
    return rows


def format_row(r: dict) -> str:
    peer = "-" if r["peer_ms"] is None else f"{r['peer_ms']:.1f}"
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
    gflops = "-" if r["ours_gflops"] is None else f"{r['ours_gflops']:.1f}"
    of_gemm = "-" if "of_gemm" not in r else f"{100 * r['of_gemm']:.0f}% of {r['gemm_gflops']:.0f}" \
        if r["of_gemm"] <= 1 else f"GEMM {r['gemm_gflops']:.1f}"  # a GEMM slower than the attention: no share
    return (f"{r['section']:<6} {r['name']:<32} {r['dtype']:<9} {r['L']!s:>6} {r['ours_ms']:>10.1f} "
            f"{gflops:>8} {r['peer']:<22} {peer:>10} {ratio:>6} {of_gemm:>12}")


HEADER = (f"{'what':<6} {'case':<32} {'dtype':<9} {'L':>6} {'ours ms':>10} {'GFLOP/s':>8} {'peer':<22} "
          f"{'peer ms':>10} {'ratio':>6} {'of GEMM':>12}")


def draw(rows: list[dict], path: str) -> None:
    """GFLOP/s against L for the dense rows, one panel per dtype; the fused and seed rows as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = [r for r in rows if r["section"] == "dense"]
    serving = [r for r in rows if r["section"] == "serve"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in dense))
    panels = len(dtypes) + bool(serving)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    if serving:
        ax = axes[0][-1]
        ax.barh([r["name"] for r in serving], [r["ratio"] for r in serving])
        ax.axvline(1.0, color="k", linewidth=0.8)
        ax.set(title="serving steps, paged f32", xlabel="torch time / ours")
        ax.tick_params(axis="y", labelsize=7)
    for ax, dtype in zip(axes[0], dtypes):
        mine = [r for r in dense if r["dtype"] == dtype]
        lengths = [r["L"] for r in mine]
        ax.plot(lengths, [r["ours_gflops"] for r in mine], "o-", label="linalg-prefill (llvm-cpu)")
        ax.plot(lengths, [r["peer_gflops"] for r in mine], "s--", label="torch SDPA")
        gemm = mine[0].get("gemm_gflops") if mine else None
        if gemm and gemm >= max(r["ours_gflops"] for r in mine):
            ax.axhline(gemm, color="gray", linestyle=":", label=f"torch.matmul {GEMM_N}^3, {dtype}")
        for r in rows:
            if r["dtype"] == dtype and r["section"] in ("fused", "seed"):
                ax.plot([r["L"]], [r["peer_gflops"]], "x", markersize=9, label=f"{r['peer']} ({r['name']})")
        ax.set(title=f"causal prefill, {dtype}", xlabel="sequence length", ylabel="GFLOP/s", xscale="log")
        ax.minorticks_off()
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("B=1, h_q=32, h_kv=8, d=128, 2 CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--tvm", action="store_true", help="also time the seed's TVM CPU kernels (slow)")
    parser.add_argument("--dense-only", action="store_true", help="the dense rows alone")
    parser.add_argument("--out", default="build/bench-report")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    os.makedirs(args.out, exist_ok=True)
    cpu = cpu_description()
    print(f"CPU: {cpu}; torch {torch.__version__} on 2 threads", flush=True)
    print(HEADER, flush=True)
    rows = dense_rows([int(x) for x in args.lengths.split(",")], args.dtypes.split(","), rng)
    sections = [] if args.dense_only else [[fused_row()], small_prefill_rows(rng), batch_rows(rng), serving_rows(rng),
                                           tvm_rows(rng) if args.tvm else []]
    for extra in sections:
        for r in extra:
            rows.append(r)
            print(format_row(r), flush=True)
    for r in rows:
        r["cpu"] = cpu
        if "vs_dense" in r:
            print(f"{r['name']}: {r['vs_dense']:.2f} of the dense kernel's throughput")
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(rows, f, indent=2)
    draw(rows, os.path.join(args.out, "report.png"))
    print(f"wrote {args.out}/report.json and {args.out}/report.png")


if __name__ == "__main__":
    main()
