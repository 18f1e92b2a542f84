"""MLA serving steps (DeepSeek's latent cache) against torch SDPA, timed in the same run.

    .venv/bin/python bench/mla_serving.py [--batches 8,32] [--new 1,4] [--cached 1024,4096]
        [--dtype float32] [--repeat 3] [--json out.json]

Each row: ``batch`` sequences append ``new`` tokens to ``cached`` ones already in a paged latent
cache (h_q=16, d_latent=512, d_rope=64, page size 16, pages shuffled), bottom-right causal;
ours: ``MlaPagedPrefillWrapper`` (planned once, run on the numpy pool in place; the short
entries take the serving passes). Peer: torch SDPA with the latent rows gathered and padded to
the longest entry, keys [B, 1, L, 576], values their first 512 columns, ``enable_gqa``, a
boolean mask; and the same attention as two torch matmuls around a softmax (the absorbed-MLA
form, the latent rows shared by every head), torch on 2 threads. Each ``ratio`` = torch ms / ours
(above 1: we are faster); ``max|diff|`` against the matmul form.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from linalg_prefill.bench import best_times, cpu_description, torch_allocated  # noqa: E402
from linalg_prefill.mlir import MlaPagedPrefillSpec  # noqa: E402
from linalg_prefill.runtime import MlaPagedPrefillWrapper  # noqa: E402
from linalg_prefill.runtime.examples import page_table, uniform  # noqa: E402
from serving_batches import burst_for  # noqa: E402

H_Q, D_LATENT, D_ROPE, PAGE_SIZE = 16, 512, 64, 16
D_QK = D_LATENT + D_ROPE
SM_SCALE = 192 ** -0.5  # DeepSeek-V3: (qk_nope 128 + qk_rope 64)^-0.5


def step_inputs(batch: int, new: int, cached: int, dtype: str, rng) -> dict:
    kv_lens = np.full(batch, cached + new)
    table = page_table(rng, kv_lens, PAGE_SIZE, spare_pages=0)
    return dict(q=uniform(rng, (batch * new, H_Q, D_QK), dtype), q_indptr=(np.arange(batch + 1) * new).astype(np.int32),
                pages=torch_allocated(uniform(rng, (table.num_pages, PAGE_SIZE, D_QK), dtype)), table=table,
                kv_lens=kv_lens)


def torch_call(step: dict, new: int, dtype: str):
    """torch SDPA over the gathered latent rows, padded, with a bottom-right causal mask."""
    import torch
    import torch.nn.functional as F

    table, kv_lens = step["table"], step["kv_lens"]
    batch, longest = len(kv_lens), int(kv_lens.max())
    rows = np.zeros((batch, longest, D_QK), step["pages"].dtype)
    for b, n in enumerate(kv_lens):
        logical = np.arange(n)
        ids = table.page_values[table.page_indptr[b] + logical // PAGE_SIZE]
        rows[b, :n] = step["pages"][ids, logical % PAGE_SIZE]
    torch_dtype = getattr(torch, dtype)
    latent = torch.from_numpy(rows.astype(np.float32)).to(torch_dtype)[:, None]  # [B, 1, L, 576]
    k, v = latent, latent[..., :D_LATENT]
    q = torch.from_numpy(step["q"].astype(np.float32)).to(torch_dtype).reshape(batch, new, H_Q, D_QK).transpose(1, 2)
    lens = torch.from_numpy(kv_lens.astype(np.int64))
    mask = (torch.arange(longest)[None, None, :] <= torch.arange(new)[None, :, None] + (lens - new)[:, None, None])
    mask = mask[:, None]

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SM_SCALE, enable_gqa=True)

    rows_q = q.reshape(batch, H_Q * new, D_QK)  # [B, h x new, 576]: every head's rows against one latent
    rows_mask = mask.expand(batch, H_Q, new, longest).reshape(batch, H_Q * new, longest)
    latent_rows, values = k[:, 0], v[:, 0]

    def matmul():  # the absorbed-MLA form: one batched matmul per product, the latent rows shared
        scores = torch.bmm(rows_q, latent_rows.transpose(1, 2)).float() * SM_SCALE
        probs = torch.softmax(scores.masked_fill(~rows_mask, float("-inf")), dim=-1).to(torch_dtype)
        return torch.bmm(probs, values).reshape(batch, H_Q, new, D_LATENT)

    return sdpa, matmul


def measure_row(wrapper, batch: int, new: int, cached: int, dtype: str, repeat: int, rng) -> dict:
    step = step_inputs(batch, new, cached, dtype, rng)
    table = step["table"]
    wrapper.plan(step["q_indptr"], table.page_indptr, table.page_values, table.length_info, causal=True,
                 sm_scale=SM_SCALE)
    ours = lambda: wrapper.run(step["q"], step["pages"])  # noqa: E731
    sdpa, matmul = torch_call(step, new, dtype)
    ours_out = ours()[0]
    start = time.perf_counter()
    ours()
    burst = burst_for(time.perf_counter() - start)
    peer_out = matmul().float().numpy().transpose(0, 2, 1, 3).reshape(batch * new, H_Q, D_LATENT)
    ours_s, sdpa_s, matmul_s = best_times([ours, sdpa, matmul], repeat, burst)
    kv_bytes = int(step["kv_lens"].sum()) * D_QK * step["pages"].itemsize
    return dict(batch=batch, new=new, cached=cached, dtype=dtype, ours_ms=ours_s * 1e3, sdpa_ms=sdpa_s * 1e3,
                matmul_ms=matmul_s * 1e3, sdpa_ratio=sdpa_s / ours_s, matmul_ratio=matmul_s / ours_s,
                ours_gbps=kv_bytes / ours_s / 1e9, max_abs_diff=float(np.abs(ours_out.astype(np.float32) - peer_out).max()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--new", default="1,4")
    parser.add_argument("--cached", default="1024,4096")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    wrapper = MlaPagedPrefillWrapper(MlaPagedPrefillSpec(H_Q, D_LATENT, D_ROPE, args.dtype, page_size=PAGE_SIZE))
    rng = np.random.default_rng(0)
    print(f"MLA serving steps, h_q={H_Q} d_latent={D_LATENT} d_rope={D_ROPE} page={PAGE_SIZE} {args.dtype}, "
          f"llvm-cpu vs torch SDPA (2 threads); CPU: {cpu_description()}")
    print(f"{'batch':>5} {'new':>4} {'cached':>7} {'ours ms':>9} {'sdpa ms':>9} {'ratio':>6} {'matmul ms':>9} "
          f"{'ratio':>6} {'ours GB/s':>9} {'max|diff|':>9}", flush=True)
    rows = []
    for batch in (int(x) for x in args.batches.split(",")):
        for new in (int(x) for x in args.new.split(",")):
            for cached in (int(x) for x in args.cached.split(",")):
                r = measure_row(wrapper, batch, new, cached, args.dtype, args.repeat, rng)
                rows.append(r)
                print(f"{r['batch']:>5} {r['new']:>4} {r['cached']:>7} {r['ours_ms']:>9.2f} {r['sdpa_ms']:>9.2f} "
                      f"{r['sdpa_ratio']:>6.2f} {r['matmul_ms']:>9.2f} {r['matmul_ratio']:>6.2f} {r['ours_gbps']:>9.2f} "
                      f"{r['max_abs_diff']:>9.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(dict(cpu=cpu_description(), rows=rows), out, indent=1)


if __name__ == "__main__":
    main()
