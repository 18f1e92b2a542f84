"""What a serving call costs when the caller passes a large page pool it touches a little of.

    python bench/in_place_pool.py [--pool-gib 1] [--batch 8] [--new 4] [--cached 156] [--repeat 10]

One paged call (h_q 32, h_kv 8, d 128, f32, pages of 16) of ``--batch`` sequences, each ``--new``
tokens over ``--cached`` cached ones, against a ``--pool-gib`` numpy page pool (zeros, with the
call's pages filled: 1% of a 1 GiB pool by default). Timed in the same run, fastest of
``--repeat`` calls each:

* ``numpy, in place``: the pool as the caller holds it (runtime/module.py: used in place);
* ``uploaded once``: the pool copied to an IREE device array beforehand (the benchmarks' way);
* ``numpy, copied``: the same numpy pool marked read-only, which the runtime cannot hand over in
  place and copies into a new buffer on every call: what every numpy call cost before.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from linalg_prefill.mlir import PagedPrefillSpec
from linalg_prefill.runtime import PagedPrefillWrapper
from linalg_prefill.runtime.module import as_device_arrays

H_Q, H_KV, D, PAGE = 32, 8, 128, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-gib", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new", type=int, default=4)
    parser.add_argument("--cached", type=int, default=156)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    page_bytes = 2 * H_KV * PAGE * D * 4
    pool = np.zeros((int(args.pool_gib * 2**30) // page_bytes, 2, H_KV, PAGE, D), np.float32)
    kv = args.cached + args.new
    per_entry = -(-kv // PAGE)
    ids = rng.choice(pool.shape[0], args.batch * per_entry, replace=False).astype(np.int32)
    pool[ids] = rng.uniform(-1, 1, (len(ids), 2, H_KV, PAGE, D)).astype(np.float32)
    q = rng.uniform(-1, 1, (args.batch * args.new, H_Q, D)).astype(np.float32)
    wrapper = PagedPrefillWrapper(PagedPrefillSpec(H_Q, H_KV, D, "float32", page_size=PAGE))
    wrapper.plan((np.arange(args.batch + 1) * args.new).astype(np.int32),
                 (np.arange(args.batch + 1) * per_entry).astype(np.int32), ids,
                 np.full(args.batch, kv - (per_entry - 1) * PAGE, np.int32), causal=True)
    read_only = pool.view()
    read_only.flags.writeable = False
    uploaded = as_device_arrays(wrapper.kernel.device, [pool])[0]
    calls = {"numpy, in place": pool, "uploaded once": uploaded, "numpy, copied": read_only}
    want = wrapper.run(q, pool)[0]
    print(f"pool {pool.nbytes / 2**30:.2f} GiB, call reads {len(ids) / pool.shape[0]:.1%} of it "
          f"({args.batch} x {args.new} new vs {args.cached} cached); fastest of {args.repeat}")
    times = {}
    for label, pages in calls.items():
        best = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            got = wrapper.run(q, pages, to_host=True)[0]
            best = min(best, time.perf_counter() - start)
        assert np.array_equal(got, want)
        times[label] = best
        print(f"{label:18} {best * 1e3:9.2f} ms  ({best / times['numpy, in place']:.2f}x the in-place call)")
    print(f"bytes the runtime copied: {wrapper.kernel.bytes_copied / 2**30:.2f} GiB (the read-only calls)")


if __name__ == "__main__":
    main()
