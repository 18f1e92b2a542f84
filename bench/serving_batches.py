"""Serving-shaped batches: many sequences, a few new tokens each, against a cached prefix in pages.

    .venv/bin/python bench/serving_batches.py [--batches 8,32,128] [--new 1,4,16,64]
        [--cached 128,1024,4096,mixed] [--dtype float32] [--heads 32/8] [--repeat 3] [--json out.json]

Each row is one serving step of ``batch`` sequences, each appending ``new`` tokens to ``cached``
tokens already in the paged cache (``mixed``: cached lengths drawn from [16, 4096], seeded), so
entry b attends causally (bottom-right) over kv_len_b = cached_b + new keys. h_q=32, h_kv=8
(``--heads``: e.g. 8/1, one KV head as MQA models have), d=128, page size 16, pages shuffled, RoPE off. Ours: ``PagedPrefillWrapper``, planned once and run
once (the per-layer call; the plan's cost is printed apart), twice: with the pages uploaded to
the IREE device once (``ours ms``), as a serving stack may keep its cache there, and with the
numpy page pool passed to every call as it is (``numpy ms``: read in place, runtime/module.py).
Peer, in the same run: torch SDPA on
the same attention with the KV already gathered and padded to the longest entry, one batched
call with a boolean mask (q [B, h_q, new, d], k/v [B, h_kv, L_max, d], ``enable_gqa``), torch on
2 threads. ``ratio`` = torch time / ours (above 1: we are faster), ``np ratio`` the same for the
numpy-pool call, ``np/dev`` its time over the uploaded one's.

Bandwidth columns: KV bytes the step must read (sum of kv_len_b rows of K and V) per second, for
ours and torch, and the machine's read bandwidth measured in the same run (torch's ``sum`` over
as many bytes, capped at 512 MiB, already touched). First line: the time of a call with almost
no work (1 x 1 vs 16 cached) and of a step's planning (the plan and its serving schedule), the
fixed costs every layer's call and every step pay. Rows whose padded torch inputs would exceed
``--max-gib`` are skipped and listed. Needs the ``bench`` extra (torch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from linalg_prefill.mlir import PagedPrefillSpec  # noqa: E402
from linalg_prefill.bench import best_times, cpu_description, torch_allocated  # noqa: E402
from linalg_prefill.runtime import PagedPrefillWrapper  # noqa: E402
from linalg_prefill.runtime.checks import NUMPY_DTYPES  # noqa: E402
from linalg_prefill.runtime.examples import page_table, uniform  # noqa: E402
from linalg_prefill.runtime.module import as_device_arrays  # noqa: E402

H_Q, H_KV, D, PAGE_SIZE = 32, 8, 128, 16
MIXED_RANGE = (16, 4096)
STREAM_CAP_BYTES = 512 << 20


def cached_lengths(batch: int, cached: str, rng: np.random.Generator) -> np.ndarray:
    if cached == "mixed":
        return rng.integers(*MIXED_RANGE, size=batch, endpoint=True)
    return np.full(batch, int(cached))


def serving_step(batch: int, new: int, cached: np.ndarray, dtype: str, rng: np.random.Generator) -> dict:
    """One step's inputs: queries, shuffled pages holding every entry's KV (in memory torch
    allocates, as a serving stack's pool is), and the page table."""
    kv_lens = cached + new
    table = page_table(rng, kv_lens, PAGE_SIZE, spare_pages=0)
    pages = torch_allocated(uniform(rng, (table.num_pages, 2, H_KV, PAGE_SIZE, D), dtype))
    q = uniform(rng, (batch * new, H_Q, D), dtype)
    q_indptr = (np.arange(batch + 1) * new).astype(np.int32)
    return dict(q=q, q_indptr=q_indptr, pages=pages, page_indptr=table.page_indptr, page_values=table.page_values,
                last_page_len=table.length_info, kv_lens=kv_lens)


def gathered_kv(step: dict) -> tuple[np.ndarray, np.ndarray]:
    """Each entry's K and V rows in logical order, padded to the longest: [B, h_kv, L_max, d]."""
    kv_lens, batch = step["kv_lens"], len(step["kv_lens"])
    longest = int(kv_lens.max())
    k = np.zeros((batch, H_KV, longest, D), step["pages"].dtype)
    v = np.zeros_like(k)
    for b, n in enumerate(kv_lens):
        rows = np.arange(n)
        ids = step["page_values"][step["page_indptr"][b] + rows // PAGE_SIZE]
        k[b, :, :n] = step["pages"][ids, 0, :, rows % PAGE_SIZE].transpose(1, 0, 2)
        v[b, :, :n] = step["pages"][ids, 1, :, rows % PAGE_SIZE].transpose(1, 0, 2)
    return k, v


def torch_call(step: dict, new: int, dtype: str):
    """torch SDPA over the gathered, padded KV with a [B, 1, new, L_max] bottom-right causal mask."""
    import torch
    import torch.nn.functional as F

    k, v = gathered_kv(step)
    batch, longest = k.shape[0], k.shape[2]
    kv_lens = torch.from_numpy(step["kv_lens"].astype(np.int64))
    rows = torch.arange(new)[None, :, None]
    cols = torch.arange(longest)[None, None, :]
    mask = (cols <= rows + (kv_lens - new)[:, None, None]) & (cols < kv_lens[:, None, None])
    torch_dtype = getattr(torch, dtype)

    def tensor(x):
        return torch.from_numpy(np.ascontiguousarray(x.astype(np.float32))).to(torch_dtype)

    q = tensor(step["q"].reshape(batch, new, H_Q, D).transpose(0, 2, 1, 3))
    tk, tv, tmask = tensor(k), tensor(v), mask[:, None]

    def run():
        return F.scaled_dot_product_attention(q, tk, tv, attn_mask=tmask, enable_gqa=True)

    return run


def streaming_gbps(nbytes: int) -> float:
    """The machine's read bandwidth: GB/s of torch's ``sum`` (2 threads, reads only) over
    ``min(nbytes, 512 MiB)`` of float32 already touched, best of 3. (A numpy copy, read and
    written, gave 7-14 GB/s on the Intel VM, below what the passes read.)"""
    import torch

    data = torch.ones(max(min(nbytes, STREAM_CAP_BYTES) // 4, 1 << 20), dtype=torch.float32)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def fixed_cost_ms(wrapper: PagedPrefillWrapper, dtype: str, rng: np.random.Generator) -> tuple[float, float]:
    """(ms of a call with almost no work: 1 sequence x 1 new token vs 16 cached, planned; ms of
    a step's host planning: ``plan`` and the serving schedule its first call works out, i.e. a
    call after a new plan less a call): what every layer's call, and every step, pays before its
    keys (issue: decode at memory speed). Both timed as the calls are (best_times)."""
    step = serving_step(1, 1, np.array([16]), dtype, rng)
    plan = lambda: wrapper.plan(step["q_indptr"], step["page_indptr"], step["page_values"],  # noqa: E731
                                step["last_page_len"], causal=True)
    plan()   # the first opens the kernels
    call = lambda: wrapper.run(step["q"], step["pages"])  # noqa: E731
    planned_call = lambda: (plan(), call())  # noqa: E731
    call_s, planned_s = best_times([call, planned_call], 5, 200)
    return call_s * 1e3, max(planned_s - call_s, 0.0) * 1e3


def padded_torch_bytes(batch: int, new: int, kv_lens: np.ndarray) -> int:
    """Bytes of torch's padded K, V and mask (f32 staging) plus its [B, h_q, new, L_max] scores."""
    longest = int(kv_lens.max())
    return 4 * batch * longest * (2 * H_KV * D + 2 * H_Q * new) + batch * new * longest


#: Calls shorter than this run in bursts filling it (at most MAX_BURST calls): right after torch's
#: call its worker threads still spin and slow the next calls (32 x 1 vs 1024: ours 17 ms alone or
#: in bursts, 25-31 ms one call at a time after torch's), so each contender is timed after its own
#: calls. A 0.6-ms call took its first 10 calls after torch's to recover (one 16-query entry over
#: 256 keys, min by position in the burst: 1.0-1.25 ms for the first, 0.9-1.0 to the tenth, 0.65-0.70
#: from the 20th; torch after ours 0.88 for its first, 0.67-0.70 from its second: docs/performance.md).
BURST_SECONDS = 0.2
MAX_BURST = 50


def burst_for(first_call_s: float) -> int:
    """Calls per burst (``best_times``) for a row whose first call took ``first_call_s``."""
    return max(1, min(MAX_BURST, round(BURST_SECONDS / max(first_call_s, 1e-6))))


def measure_row(wrapper: PagedPrefillWrapper, batch: int, new: int, cached: str, dtype: str, repeat: int,
                rng: np.random.Generator) -> dict:
    step = serving_step(batch, new, cached_lengths(batch, cached, rng), dtype, rng)
    start = time.perf_counter()
    wrapper.plan(step["q_indptr"], step["page_indptr"], step["page_values"], step["last_page_len"], causal=True)
    plan_s = time.perf_counter() - start
    pages = as_device_arrays(wrapper.kernel.device, [step["pages"]])[0]  # the cache kept on the device
    ours = lambda: wrapper.run(step["q"], pages)  # noqa: E731
    ours_numpy = lambda: wrapper.run(step["q"], step["pages"])  # noqa: E731 - the caller's pool, in place
    peer = torch_call(step, new, dtype)
    ours_out = ours()[0]  # the first call may compile a serving pass
    start = time.perf_counter()
    ours()
    burst = burst_for(time.perf_counter() - start)
    peer_out = peer().float().numpy().transpose(0, 2, 1, 3).reshape(batch * new, H_Q, D)
    copied = wrapper.kernel.bytes_copied
    ours_s, numpy_s, peer_s = best_times([ours, ours_numpy, peer], repeat, burst)
    assert wrapper.kernel.bytes_copied == copied, "the numpy pool was copied"
    kv_bytes = int(step["kv_lens"].sum()) * 2 * H_KV * D * step["pages"].itemsize
    return dict(batch=batch, new=new, cached=cached, dtype=dtype, ours_ms=ours_s * 1e3, torch_ms=peer_s * 1e3,
                ratio=peer_s / ours_s, numpy_ms=numpy_s * 1e3, numpy_ratio=peer_s / numpy_s,
                pool_mib=step["pages"].nbytes / 2**20, plan_ms=plan_s * 1e3, kv_mib=kv_bytes / 2**20,
                ours_gbps=kv_bytes / ours_s / 1e9, torch_gbps=kv_bytes / peer_s / 1e9,
                stream_gbps=streaming_gbps(kv_bytes),
                max_abs_diff=float(np.abs(ours_out.astype(np.float32) - peer_out).max()))


HEADER = (f"{'batch':>5} {'new':>4} {'cached':>7} {'KV MiB':>8} {'ours ms':>9} {'numpy ms':>9} {'torch ms':>9} "
          f"{'ratio':>6} {'np ratio':>8} {'np/dev':>6} {'plan ms':>8} {'ours GB/s':>9} {'torch GB/s':>10} "
          f"{'stream GB/s':>11} {'max|diff|':>9}")


def format_row(r: dict) -> str:
    return (f"{r['batch']:>5} {r['new']:>4} {r['cached']:>7} {r['kv_mib']:>8.1f} {r['ours_ms']:>9.2f} "
            f"{r['numpy_ms']:>9.2f} {r['torch_ms']:>9.2f} {r['ratio']:>6.2f} {r['numpy_ratio']:>8.2f} "
            f"{r['numpy_ms'] / r['ours_ms']:>6.2f} {r['plan_ms']:>8.2f} {r['ours_gbps']:>9.2f} "
            f"{r['torch_gbps']:>10.2f} {r['stream_gbps']:>11.2f} {r['max_abs_diff']:>9.1e}")


def main() -> None:
    global H_Q, H_KV
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="8,32,128")
    parser.add_argument("--new", default="1,4,16,64")
    parser.add_argument("--cached", default="128,1024,4096,mixed")
    parser.add_argument("--dtype", default="float32", choices=sorted(NUMPY_DTYPES))
    parser.add_argument("--heads", default=f"{H_Q}/{H_KV}", help="h_q/h_kv (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-gib", type=float, default=8.0,
                        help="skip rows whose padded torch inputs and scores exceed this many GiB")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    H_Q, H_KV = (int(x) for x in args.heads.split("/"))
    import torch

    torch.set_num_threads(2)
    wrapper = PagedPrefillWrapper(PagedPrefillSpec(H_Q, H_KV, D, args.dtype, page_size=PAGE_SIZE))
    rng = np.random.default_rng(0)
    print(f"serving steps, paged KV, h_q={H_Q} h_kv={H_KV} d={D} page={PAGE_SIZE} {args.dtype}, llvm-cpu; "
          f"CPU: {cpu_description()}")
    fixed, plan = fixed_cost_ms(wrapper, args.dtype, rng)
    print(f"a call with almost no work (1 x 1 vs 16 cached): {fixed:.3f} ms; a step's planning on the host (plan, "
          f"serving schedule) {plan:.3f} ms")
    print(HEADER, flush=True)
    rows, skipped = [], []
    for batch in (int(x) for x in args.batches.split(",")):
        for new in (int(x) for x in args.new.split(",")):
            for cached in args.cached.split(","):
                longest = MIXED_RANGE[1] if cached == "mixed" else int(cached)
                need = padded_torch_bytes(batch, new, np.array([longest + new]))
                if need > args.max_gib * 2**30:
                    skipped.append(f"{batch}x{new} vs {cached} ({need / 2**30:.1f} GiB)")
                    continue
                row = measure_row(wrapper, batch, new, cached, args.dtype, args.repeat, rng)
                rows.append(row)
                print(format_row(row), flush=True)
    if skipped:
        print(f"skipped (over --max-gib {args.max_gib}): {', '.join(skipped)}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(dict(cpu=cpu_description(), rows=rows, skipped=skipped), out, indent=1)


if __name__ == "__main__":
    main()
