"""Serving steps over an 8-bit KV cache against the same steps over a bfloat16 one, in the same run.

    .venv/bin/python bench/fp8_kv.py [--variant paged|ragged|mla] [--batches 8,32] [--new 1,4,16]
        [--cached 1024,4096] [--kv-dtype float8_e4m3fn] [--repeat 3] [--json out.json]

The steps of bench/serving_batches.py (h_q=32, h_kv=8, d=128, page size 16, shuffled pages, RoPE
off, causal, bfloat16 queries and outputs): the pool drawn in bfloat16, then quantised with one
scale per KV head (runtime.kv_quant.quantize_pages); each planned once, both pools read in place
by ``PagedPrefillWrapper.run``. ``--variant ragged``: the same entries' K/V rows gathered into
ragged k and v [Lk, h_kv, d] (quantize_kv), read by ``RaggedPrefillWrapper.run``. ``--variant
mla``: bench/mla_serving.py's steps (h_q=16, d_latent=512, d_rope=64, one latent row a key), the
latent pages quantised with one scale (quantize_latent), read by ``MlaPagedPrefillWrapper.run``. ``ratio`` = bf16 ms / fp8 ms (above 1: the 8-bit cache is faster);
GB/s columns: the KV bytes each step reads (sum of kv_len rows of K and V, in each pool's dtype)
per second; ``stream GB/s``: the machine's read bandwidth in the same run (torch's ``sum``,
serving_batches.streaming_gbps), and each pool's share of it. ``max|diff|``: the two outputs'
largest difference (the quantisation's effect).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from linalg_prefill.bench import best_times, cpu_description, torch_allocated  # noqa: E402
from linalg_prefill.mlir import MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec  # noqa: E402
from linalg_prefill.runtime import MlaPagedPrefillWrapper, PagedPrefillWrapper, RaggedPrefillWrapper  # noqa: E402
from linalg_prefill.runtime.kv_quant import quantize_kv, quantize_latent, quantize_pages  # noqa: E402
from mla_serving import D_LATENT as MLA_D_LATENT, D_QK as MLA_D_QK, H_Q as MLA_H_Q  # noqa: E402
from mla_serving import SM_SCALE as MLA_SM_SCALE, step_inputs as mla_step  # noqa: E402
from serving_batches import (  # noqa: E402
    D, H_KV, H_Q, PAGE_SIZE, burst_for, cached_lengths, gathered_kv, serving_step, streaming_gbps,
)


def measure_row(wrappers, batch: int, new: int, cached: str, repeat: int, rng) -> dict:
    """One step, timed over the bf16 cache and its 8-bit copy."""
    plain, quantised = wrappers
    step = serving_step(batch, new, cached_lengths(batch, cached, rng), "bfloat16", rng)
    kv_dtype = quantised.spec.kv_dtype
    if isinstance(plain, MlaPagedPrefillWrapper):
        return _mla_row(wrappers, batch, new, cached, repeat, rng)
    if isinstance(plain, PagedPrefillWrapper):
        pages8, k_scale, v_scale = quantize_pages(step["pages"], kv_dtype)
        pages8 = torch_allocated(pages8)
        for wrapper in wrappers:
            wrapper.plan(step["q_indptr"], step["page_indptr"], step["page_values"], step["last_page_len"], causal=True)
        kv, kv8 = (step["pages"],), (pages8,)
    else:
        k, v = (torch_allocated(x) for x in ragged_kv(step))
        k8, v8, k_scale, v_scale = quantize_kv(k, v, kv_dtype)
        k8, v8 = torch_allocated(k8), torch_allocated(v8)
        kv_indptr = np.concatenate([[0], np.cumsum(step["kv_lens"])]).astype(np.int32)
        for wrapper in wrappers:
            wrapper.plan(step["q_indptr"], kv_indptr, causal=True)
        kv, kv8 = (k, v), (k8, v8)
    runs = [lambda: plain.run(step["q"], *kv),
            lambda: quantised.run(step["q"], *kv8, k_scale=k_scale, v_scale=v_scale)]
    outs = [run()[0] for run in runs]
    burst = burst_for(min(_once(run) for run in runs))
    plain_s, fp8_s = best_times(runs, repeat, burst)
    return _row(batch, new, cached, plain_s, fp8_s, int(step["kv_lens"].sum()) * 2 * H_KV * D, outs)


def _mla_row(wrappers, batch: int, new: int, cached: str, repeat: int, rng) -> dict:
    """measure_row for MLA: one latent row (d_latent + d_rope columns) is a key and its value."""
    plain, quantised = wrappers
    step = mla_step(batch, new, int(cached_lengths(batch, cached, rng).max()), "bfloat16", rng)
    pages8, k_scale, v_scale = quantize_latent(step["pages"], quantised.spec.kv_dtype)
    pages8 = torch_allocated(pages8)
    table = step["table"]
    for wrapper in wrappers:
        wrapper.plan(step["q_indptr"], table.page_indptr, table.page_values, table.length_info, causal=True,
                     sm_scale=MLA_SM_SCALE)
    runs = [lambda: plain.run(step["q"], step["pages"]),
            lambda: quantised.run(step["q"], pages8, k_scale=k_scale, v_scale=v_scale)]
    outs = [run()[0] for run in runs]
    burst = burst_for(min(_once(run) for run in runs))
    plain_s, fp8_s = best_times(runs, repeat, burst)
    return _row(batch, new, cached, plain_s, fp8_s, int(step["kv_lens"].sum()) * MLA_D_QK, outs)


def _row(batch: int, new: int, cached: str, plain_s: float, fp8_s: float, elements: int, outs) -> dict:
    """A row's figures: ``elements`` the KV elements a step reads (one byte each in the 8-bit pool,
    two in the bf16 one); the machine's read bandwidth (serving_batches.streaming_gbps over the
    bf16 pool's bytes) measured after the row's calls, and each pool's share of it."""
    stream = streaming_gbps(elements * 2)
    bf16_gbps, fp8_gbps = elements * 2 / plain_s / 1e9, elements / fp8_s / 1e9
    return dict(batch=batch, new=new, cached=cached, bf16_ms=plain_s * 1e3, fp8_ms=fp8_s * 1e3, ratio=plain_s / fp8_s,
                bf16_gbps=bf16_gbps, fp8_gbps=fp8_gbps, stream_gbps=stream, bf16_share=bf16_gbps / stream,
                fp8_share=fp8_gbps / stream,
                max_abs_diff=float(np.abs(outs[0].astype(np.float32) - outs[1].astype(np.float32)).max()))


def ragged_kv(step: dict) -> tuple[np.ndarray, np.ndarray]:
    """The step's entries' K and V rows back to back, token-major: k, v [sum kv_len, h_kv, d]."""
    k, v = gathered_kv(step)  # [B, h_kv, L_max, d]
    return tuple(np.concatenate([x[b, :, :n].transpose(1, 0, 2) for b, n in enumerate(step["kv_lens"])])
                 for x in (k, v))


def _once(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


HEADER = (f"{'batch':>5} {'new':>4} {'cached':>7} {'bf16 ms':>9} {'fp8 ms':>9} {'ratio':>6} {'bf16 GB/s':>9} "
          f"{'fp8 GB/s':>9} {'stream GB/s':>11} {'bf16 share':>10} {'fp8 share':>9} {'max|diff|':>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="paged", choices=["paged", "ragged", "mla"])
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--new", default="1,4,16")
    parser.add_argument("--cached", default="1024,4096")
    parser.add_argument("--kv-dtype", default="float8_e4m3fn", choices=["float8_e4m3fn", "float8_e5m2"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    if args.variant == "paged":
        spec, wrapper = PagedPrefillSpec(H_Q, H_KV, D, "bfloat16", page_size=PAGE_SIZE), PagedPrefillWrapper
    elif args.variant == "ragged":
        spec, wrapper = RaggedPrefillSpec(H_Q, H_KV, D, D, "bfloat16"), RaggedPrefillWrapper
    else:
        spec = MlaPagedPrefillSpec(MLA_H_Q, MLA_D_LATENT, MLA_D_QK - MLA_D_LATENT, "bfloat16", page_size=PAGE_SIZE)
        wrapper = MlaPagedPrefillWrapper
    wrappers = (wrapper(spec), wrapper(dataclasses.replace(spec, kv_dtype=args.kv_dtype)))
    rng = np.random.default_rng(0)
    print(f"serving steps, {args.variant} KV ({spec.name}), KV bf16 vs {args.kv_dtype}, llvm-cpu; "
          f"CPU: {cpu_description()}")
    print(HEADER, flush=True)
    rows = []
    for batch in (int(x) for x in args.batches.split(",")):
        for new in (int(x) for x in args.new.split(",")):
            for cached in args.cached.split(","):
                r = measure_row(wrappers, batch, new, cached, args.repeat, rng)
                rows.append(r)
                print(f"{r['batch']:>5} {r['new']:>4} {r['cached']:>7} {r['bf16_ms']:>9.2f} {r['fp8_ms']:>9.2f} "
                      f"{r['ratio']:>6.2f} {r['bf16_gbps']:>9.2f} {r['fp8_gbps']:>9.2f} {r['stream_gbps']:>11.2f} "
                      f"{r['bf16_share']:>10.2f} {r['fp8_share']:>9.2f} {r['max_abs_diff']:>9.1e}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(dict(cpu=cpu_description(), rows=rows), out, indent=1)


if __name__ == "__main__":
    main()
