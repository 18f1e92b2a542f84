"""Makes a folder that checks the CUDA artifacts on a GPU machine with no registry (``make gpu-bundle``).

    .venv/bin/python bench/gpu_bundle.py [--out build/gpu-bundle] [--backend cuda] [--no-wheels]

The folder holds, next to ``gpu_runner.py`` (numpy + IREE runtime only):

* ``artifacts/``: every variant of the example models compiled for ``--backend`` (sm_80 for CUDA);
* ``cases/*.npz``: for each artifact a small seed-ABI call (``runtime.compare.example_inputs``:
  mixed lengths, a qo_len > kv_len entry, shuffled pages) with its float64 reference output
  (stored as float32), plus ``bench-*`` cases (dense causal L=2048, a mixed ragged batch) that
  the runner times on inputs it draws itself, so the bundle stays under the 64 MiB a device
  call can carry;
* ``wheels/``: the cp312 wheels of iree-base-runtime (same version as here), numpy and ml_dtypes.

Copy the folder to the GPU machine and run ``python3 gpu_runner.py`` there (well under 5 minutes).
``--backend llvm-cpu`` makes the same bundle for this machine's CPU, which is how the runner is
tested without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

from linalg_prefill.mlir import RaggedPrefillSpec, SequencePrefillSpec
from linalg_prefill.pipeline import Target, compile
from linalg_prefill.pipeline.model_config import load_model_config, specs_for_model
from linalg_prefill.runtime.compare import example_inputs, reference_for

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = ("tiny.toml", "mistral-7b.json", "deepseek-v2-lite.json")
WHEELS = ("iree-base-runtime==3.13.0", "numpy", "ml_dtypes")


def bench_cases(rng):
    """(name, spec, args, flops): dense causal L=2048 f16 and a mixed-length ragged f16 batch."""
    dense = SequencePrefillSpec(32, 8, 128, "float16", causal=True, sm_scale=128 ** -0.5)
    length = 2048
    q = rng.uniform(-1, 1, (1, length, 32, 128)).astype(np.float16)
    k, v = (rng.uniform(-1, 1, (1, length, 8, 128)).astype(np.float16) for _ in range(2))
    yield "bench-dense-causal-L2048", dense, (q, k, v), 4.0 * 128 * 32 * length * (length + 1) / 2
    ragged = RaggedPrefillSpec(32, 8, 128, 128, "float16")
    lengths = [37, 512, 1024, 96, 2048, 5]
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(indptr[-1])
    q = rng.uniform(-1, 1, (total, 32, 128)).astype(np.float16)
    k, v = (rng.uniform(-1, 1, (total, 8, 128)).astype(np.float16) for _ in range(2))
    zeros_b, zeros_q = np.zeros(len(lengths), np.int32), np.zeros(total, np.int32)
    args = (q, indptr, k, v, indptr, zeros_q, zeros_b, 1, 0, 1.0, 1e4, 128 ** -0.5)
    yield "bench-ragged-mixed-batch", ragged, args, 4.0 * 128 * 32 * sum(n * (n + 1) / 2 for n in lengths)


def save_case(path, name, spec, file, args, flops=0.0) -> None:
    """One .npz: the call's arrays and scalars, and (small cases) the float64 reference.

    ``bench-*`` cases store only the shapes of their large float inputs (the runner draws them)
    and no reference, so the bundle stays small enough to carry (its correctness is the small
    cases' job); their index arrays are stored as they are.
    """
    bench = name.startswith("bench-")
    arrays, meta_args = {}, []
    for i, a in enumerate(args):
        if isinstance(a, np.ndarray) and bench and a.dtype.kind == "f":
            meta_args.append(["random", list(a.shape), a.dtype.name])
        elif isinstance(a, np.ndarray):
            key = f"arg{i}"
            arrays[key] = a.view(np.uint16) if a.dtype.name == "bfloat16" else a
            meta_args.append(["array", key])
        else:
            meta_args.append(["scalar", a])
    if not bench:
        want_out, want_lse = reference_for(spec, args)
        arrays["want_out"], arrays["want_lse"] = np.asarray(want_out, np.float32), np.asarray(want_lse, np.float32)
    meta = dict(name=name, symbol=spec.symbol, dtype=spec.dtype, file=file, args=meta_args, flops=flops)
    np.savez_compressed(path, meta=json.dumps(meta), **arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "build", "gpu-bundle"))
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--no-wheels", action="store_true", help="skip downloading the cp312 wheels")
    args = parser.parse_args()
    target = Target(args.backend)
    for sub in ("artifacts", "cases"):
        shutil.rmtree(os.path.join(args.out, sub), ignore_errors=True)
        os.makedirs(os.path.join(args.out, sub))
    shutil.copy(os.path.join(HERE, "gpu_runner.py"), args.out)
    rng = np.random.default_rng(0)
    specs = {}
    for model in MODELS:
        for spec in specs_for_model(load_model_config(os.path.join(ROOT, "configs", model))):
            specs[spec.name] = spec
    cases = [(name, spec, example_inputs(spec, rng), 0.0) for name, spec in specs.items()]
    cases += list(bench_cases(rng))
    for name, spec, call, flops in cases:
        file = os.path.join("artifacts", f"{spec.name}.vmfb")
        with open(os.path.join(args.out, file), "wb") as f:
            f.write(compile(spec, target))
        save_case(os.path.join(args.out, "cases", f"{name}.npz"), name, spec, file, call, flops)
        print(f"built {file} and its case", file=sys.stderr)
    if not args.no_wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", *WHEELS, "--only-binary=:all:",
                        "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
                        "--platform", "manylinux_2_17_x86_64", "-d", os.path.join(args.out, "wheels")], check=True)
    print(f"bundle ready: {args.out} ({len(cases)} cases for {target.tag}); on the GPU machine run "
          f"`python3 gpu_runner.py` inside it")


if __name__ == "__main__":
    main()
