"""The x86 lowering against the linalg lowering it replaced on AMX CPUs and torch SDPA, one run.

    .venv/bin/python bench/x86_before_after.py [--length 2048]

Dense causal prefill, h_q 32, h_kv 8, d 128, bf16 and f32, best of 3 calls each; the linalg
lowering is built for ``cooperlake`` (avx512_bf16 without AMX: the packed tiles an AMX host got
before the x86 lowering), ours for the host. Prints the CPU (linalg_prefill/bench.py: cpu_description) first.
"""
import argparse
import os
import sys

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from linalg_prefill.bench import best_time, cpu_description  # noqa: E402
from linalg_prefill.mlir import SequencePrefillSpec  # noqa: E402
from linalg_prefill.pipeline import Target  # noqa: E402
from linalg_prefill.runtime import open_kernel  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--length", type=int, default=2048)
L = parser.parse_args().length
torch.set_num_threads(2)
print(f"CPU: {cpu_description()}; torch {torch.__version__} on 2 threads; L = {L}")
rng = np.random.default_rng(0)


for dtype, np_dt, tdt in [("bfloat16", ml_dtypes.bfloat16, torch.bfloat16), ("float32", np.float32, torch.float32)]:
    spec = SequencePrefillSpec(32, 8, 128, dtype, causal=True, sm_scale=128 ** -0.5)
    q, k, v = (rng.uniform(-1, 1, (1, L, heads, 128)).astype(np_dt) for heads in (32, 8, 8))
    tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to(tdt).transpose(1, 2).contiguous() for x in (q, k, v))
    flops = 2 * 32 * L * L * 128
    for name, target in [("linalg (cooperlake)", Target("llvm-cpu", "cooperlake")), ("x86 (host)", Target("llvm-cpu"))]:
        kern = open_kernel(spec, target)
        ours = best_time(lambda: kern(q, k, v), 3)
        sd = best_time(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True), 3)
        print(f"{dtype:9} {name:22} {target.lowering_of(spec):7} ours {ours*1e3:7.1f} ms "
              f"{flops/ours/1e9:6.0f} GFLOP/s  SDPA {sd*1e3:7.1f} ms  ratio {sd/ours:.2f}")
