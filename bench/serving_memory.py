"""Scratch of one serving-pass call, measured: peak RSS of ``iree-run-module`` minus its inputs.

    .venv/bin/python bench/serving_memory.py [--lowerings linalg,fused]

For each configuration the script plans a serving step (``bench/gpu_bundle.py: serving_batch``,
runtime/decode.py), saves the pass call's inputs, runs the pass alone in ``iree-run-module`` on
llvm-cpu (local-task, where device memory is host memory) under ``/usr/bin/time``, and reports
``scratch = max RSS - input bytes`` (the runtime's own ~11 MB included) against the bytes of the
K/V rows of the step's pass entries (for a step of several calls, the largest call's scratch:
they run one after the other). The issue's bound: scratch under 2x the K/V bytes. ``fused`` is the CUDA lowering's
pass compiled for llvm-cpu: its gathered K/V copy is what it would allocate on the GPU. The
results' storage (the CPU artifacts take it) is the tool's (``--input=&N``), and its workers get
the x86 kernels' stack. On a CPU with AMX the bf16 passes cannot run there: the tool does not ask
Linux for the AMX tile state (it exits 252 at the call; f32 and the linalg and fused passes run).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bundle import serving_batch  # noqa: E402

from linalg_prefill.bench import cpu_description  # noqa: E402
from linalg_prefill.mlir import DecodeSpec, MlaPagedPrefillSpec, PagedPrefillSpec  # noqa: E402
from linalg_prefill.mlir.bundle import function_name  # noqa: E402
from linalg_prefill.pipeline import Target, compile_spec  # noqa: E402
from linalg_prefill.runtime.decode import DECODE_PASSES, decode_calls, kv_lengths, pass_queries  # noqa: E402
from linalg_prefill.mlir.x86_attention import WORKER_STACK_BYTES  # noqa: E402
from linalg_prefill.runtime.outputs import result_shapes  # noqa: E402

GQA = PagedPrefillSpec(32, 8, 128, "float32", page_size=16)
GQA_BF16 = PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16)
V2_LITE = MlaPagedPrefillSpec(16, 512, 64, "bfloat16", page_size=64)
V3 = MlaPagedPrefillSpec(128, 512, 64, "bfloat16", page_size=64)
#: (label, spec, sequences, new tokens, cached tokens per sequence or "mixed"). The MLA steps
#: read 72 MiB of K/V, so the runtime's own ~11 MB weighs little in their ratio.
CONFIGS = [
    ("GQA f32 h 32/8 d 128", GQA, 32, 1, 1024),
    ("GQA f32 h 32/8 d 128", GQA, 32, 4, 1024),
    ("GQA f32 h 32/8 d 128", GQA, 128, 1, 128),
    ("GQA f32 h 32/8 d 128", GQA, 32, 1, "mixed"),
    ("GQA f32 h 32/8 d 128", GQA, 32, 16, 1024),
    ("GQA bf16 h 32/8 d 128", GQA_BF16, 32, 16, 1024),
    ("MLA bf16 h 16, 512+64 (DeepSeek-V2-Lite)", V2_LITE, 64, 1, 1024),
    ("MLA bf16 h 16, 512+64 (DeepSeek-V2-Lite)", V2_LITE, 64, 4, 1024),
    ("MLA bf16 h 128, 512+64 (DeepSeek-V3)", V3, 64, 1, 1024),
    ("MLA bf16 h 128, 512+64 (DeepSeek-V3)", V3, 64, 4, 1024),
]
TOOL = os.path.join(os.path.dirname(sys.executable), "iree-run-module")


def kv_bytes(spec, kv_lens: np.ndarray) -> int:
    """Bytes of the K/V rows of entries with ``kv_lens`` keys (MLA: one latent row per key)."""
    return int(kv_lens.astype(np.int64).sum()) * DecodeSpec(spec).kv_bytes_per_key


def measure(spec, lowering: str, batch: int, new: int, cached, folder: str) -> dict:
    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 4097, batch) if cached == "mixed" else [cached] * batch
    args = serving_batch(spec, rng, [(new, int(n)) for n in lengths])
    passes = DECODE_PASSES[lowering]
    chosen = pass_queries(spec, args, passes)
    calls = decode_calls(spec, args, chosen, passes)
    peak = 0
    for call in calls:  # the bucketed (fused) plan makes several calls, one after the other
        module = os.path.join(folder, "pass.vmfb")
        vmfb = compile_spec(call.spec, Target("llvm-cpu", lowering=lowering))
        with open(module, "wb") as f:
            f.write(vmfb)
        inputs, input_bytes = [], 0
        for i, value in enumerate(call.args):
            if isinstance(value, np.ndarray):
                path = os.path.join(folder, f"arg{i}.npy")
                np.save(path, value.view(np.uint16) if value.dtype.name == "bfloat16" else value)
                inputs.append(f"--input={'x'.join(map(str, value.shape))}xbf16=@{path}"
                              if value.dtype.name == "bfloat16" else f"--input=@{path}")
                input_bytes += value.nbytes
            else:
                inputs.append(f"--input={value}")
        # the results' storage (the CPU artifacts take it: mlir/abi.py with_output_storage),
        # allocated by the tool: "&" and a size
        for shape, dtype in result_shapes(call.spec).shapes(call.args):
            inputs.append(f"--input=&{max(int(np.prod(shape)) * dtype.itemsize, 1)}xi8")
        run = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb %M", TOOL, f"--module={module}",
                              f"--function={function_name(call.spec, vmfb)}", "--device=local-task",
                              f"--task_worker_stack_size={WORKER_STACK_BYTES}", *inputs],
                             capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"iree-run-module failed ({run.returncode}): {run.stdout[-800:]} {run.stderr[-1500:]}")
        rss = int(run.stderr.rsplit("maxrss_kb", 1)[1]) * 1024
        peak = max(peak, rss - input_bytes)
    return dict(calls=len(calls), scratch=peak, kv=kv_bytes(spec, kv_lengths(spec, args)[chosen > 0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lowerings", default="linalg,fused")
    options = parser.parse_args()
    print(f"CPU: {cpu_description()}; scratch = peak RSS of iree-run-module - input bytes")
    print(f"{'configuration':<41} {'step':<16} {'lowering':<8} {'calls':>5} {'K/V MiB':>8} {'scratch MiB':>11} "
          f"{'ratio':>6}")
    with tempfile.TemporaryDirectory() as folder:
        for label, spec, batch, new, cached in CONFIGS:
            for lowering in options.lowerings.split(","):
                if lowering == "fused" and spec.d_qk > 128:
                    continue  # llvm-cpu's online_attention mis-tiles head dims above 128 (docs/iree-cpu-attention-bug.md)
                r = measure(spec, lowering, batch, new, cached, folder)
                print(f"{label:<41} {f'{batch} x {new} vs {cached}':<16} {lowering:<8} {r['calls']:>5} "
                      f"{r['kv'] / 2**20:>8.1f} {r['scratch'] / 2**20:>11.1f} {r['scratch'] / r['kv']:>6.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
