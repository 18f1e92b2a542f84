"""This tree's kernels against an earlier commit's, timed on this machine: the check that a change
made (and measured) on one CPU left another CPU no slower (issue 51: "nothing slower on Zen 4").

    .venv/bin/python bench/against_revision.py REV [--lengths 2048] [--dtypes float32,bfloat16]
                                               [--decode 32x1x1024] [--rounds 3]

Each round runs one process on ``REV``'s package (a git worktree in a temporary folder, imported
as bench/same_dispatches.py imports it, its own bench helpers) and one on this tree's, in turn;
each process times, on its own kernels, the dense causal prefill (B 1, h_q 32, h_kv 8, d 128,
``--lengths`` x ``--dtypes``) against torch SDPA on the same shapes, and the paged serving steps
``--decode`` (BATCHxNEWxCACHED, pages of 16, the same dtypes) against the torch call of
bench/serving_batches.py, the calls alternating (``best_times``). torch is the same in both
processes: its time is the machine's pace, and a row's ``new/old`` is the ratio of the two trees'
times each taken over torch's in its own process (over 1: this tree is faster), the median over
the rounds. Kernels compile into the usual cache (``LINALG_PREFILL_CACHE_DIR``) before the timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from linalg_prefill.bench import cpu_description
from same_dispatches import ROOT, package_of, worktree

#: Run with ``sys.argv[1]`` (a folder holding a ``linalg_prefill`` package, or "-" for the
#: installed one), ``sys.argv[2]`` (that tree's bench folder) and ``sys.argv[3]`` (the rows, JSON):
#: prints {row: [ours s, torch s]} as JSON on its last line.
TIME_ROWS = r'''
import json, sys
if sys.argv[1] != "-":
    sys.meta_path = [finder for finder in sys.meta_path if "editable" not in str(finder)]
    sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
import ml_dtypes, numpy as np, torch
from linalg_prefill.bench import best_times, torch_sdpa
from linalg_prefill.mlir import PagedPrefillSpec, SequencePrefillSpec
from linalg_prefill.runtime import PagedPrefillWrapper, open_kernel
from serving_batches import serving_step, torch_call
numpy_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
rng, times = np.random.default_rng(0), {}
for name, row in json.loads(sys.argv[3]).items():
    if row["kind"] == "dense":
        spec = SequencePrefillSpec(32, 8, 128, row["dtype"], causal=True, sm_scale=128 ** -0.5)
        q, k, v = (rng.uniform(-1, 1, (1, row["length"], h, 128)).astype(numpy_dtype[row["dtype"]]) for h in (32, 8, 8))
        kernel, peer = open_kernel(spec), torch_sdpa(spec, 1, row["length"], rng)
        ours = lambda: kernel(q, k, v)
    else:
        wrapper = PagedPrefillWrapper(PagedPrefillSpec(32, 8, 128, row["dtype"], page_size=16))
        step = serving_step(row["batch"], row["new"], np.full(row["batch"], row["cached"]), row["dtype"], rng)
        wrapper.plan(step["q_indptr"], step["page_indptr"], step["page_values"], step["last_page_len"], causal=True)
        peer = torch_call(step, row["new"], row["dtype"])
        ours = lambda: wrapper.run(step["q"], step["pages"])
    ours(), peer()
    times[name] = best_times([ours, peer], row["repeat"], row["burst"])
print(json.dumps(times))
'''


def rows(lengths: list[int], dtypes: list[str], decode: list[str]) -> dict:
    """The rows each process times, by name."""
    table = {}
    for dtype in dtypes:
        for length in lengths:
            table[f"dense causal {dtype} L={length}"] = {"kind": "dense", "dtype": dtype, "length": length,
                                                         "repeat": 3 if length < 8192 else 2, "burst": 1}
        for step in decode:
            batch, new, cached = map(int, step.split("x"))
            table[f"paged {dtype} {batch} x {new} vs {cached}"] = {
                "kind": "decode", "dtype": dtype, "batch": batch, "new": new, "cached": cached, "repeat": 5,
                "burst": 10}
    return table


def timed(package: str, bench: str, table: dict) -> dict:
    """{row: (ours s, torch s)} from one process on ``package`` ("-": this tree's)."""
    result = subprocess.run([sys.executable, "-c", TIME_ROWS, package, bench, json.dumps(table)], check=True,
                            capture_output=True, text=True, cwd=tempfile.gettempdir())
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="the earlier commit")
    parser.add_argument("--lengths", default="2048")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--decode", default="32x1x1024", help="BATCHxNEWxCACHED serving steps, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    table = rows([int(x) for x in args.lengths.split(",")], args.dtypes.split(","),
                 [x for x in args.decode.split(",") if x])
    print(f"CPU: {cpu_description()}; {args.rev} against this tree, {args.rounds} rounds", flush=True)
    runs = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as scratch:
        with worktree(args.rev, os.path.join(scratch, "tree")) as old_tree:
            os.makedirs(os.path.join(scratch, "package"))
            sides = {"old": (package_of(old_tree, os.path.join(scratch, "package")), os.path.join(old_tree, "bench")),
                     "new": ("-", os.path.join(ROOT, "bench"))}
            for _ in range(args.rounds):
                for side, (package, bench) in sides.items():
                    runs[side].append(timed(package, bench, table))
    print(f"{'row':34s} {'old ms':>8s} {'torch':>8s} {'new ms':>8s} {'torch':>8s} {'new/old':>8s}")
    for name in table:
        old, new = ([run[name] for run in runs[side]] for side in ("old", "new"))
        ratio = statistics.median((o[0] / o[1]) / (n[0] / n[1]) for o, n in zip(old, new))
        medians = [statistics.median(t[i] for t in side) * 1e3 for side in (old, new) for i in (0, 1)]
        print(f"{name:34s} " + " ".join(f"{m:8.2f}" for m in medians) + f" {ratio:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
