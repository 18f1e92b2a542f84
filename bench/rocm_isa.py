"""What the ROCm artifacts of the example models would run on an AMD GPU, read without one
(docs/rocm.md's table).

    .venv/bin/python bench/rocm_isa.py [--arch gfx942] [--models llama-3-8b.json ...] [--out build/rocm-isa]

For each model config's artifacts (``linalg-prefill build --backends rocm``, the same IR and flags)
one markdown row: the online_attention dispatches, their ``v_mfma`` instructions, the most VGPRs
and AGPRs one of them uses, VGPR/SGPR spills of every kernel of the artifact, host-blocking HAL
calls inside loops of the host program, and the problems of the rocm record's structure checks
(pipeline/vm_structure.py), from the AMDGPU assembly iree-compile dumps beside each vmfb.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import time
from pathlib import Path

from linalg_prefill.pipeline import Target
from linalg_prefill.pipeline.compiler import compile_ir
from linalg_prefill.pipeline.model_config import load_model_config, specs_for_model
from linalg_prefill.pipeline.targets import structure_problems
from linalg_prefill.pipeline.tuning import tuned_ir
from linalg_prefill.pipeline.vm_structure import (
    amdgpu_isa, amdgpu_kernels, host_blocking_calls_in_loops, isa_dump_flag,
)

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="gfx942")
    parser.add_argument("--models", nargs="+", default=[os.path.basename(path) for path in
                                                        sorted(glob.glob(str(ROOT / "configs" / "*.json")))])
    parser.add_argument("--out", default="build/rocm-isa")
    args = parser.parse_args()
    target = Target("rocm", args.arch)
    print("| model | artifact | attention dispatches | v_mfma | VGPRs (max) | AGPRs (max) | spills (VGPR/SGPR) "
          "| blocking calls in loops | compile s | problems |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for model in args.models:
        for spec in specs_for_model(load_model_config(ROOT / "configs" / model)):
            folder = Path(args.out) / target.tag / spec.name
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            path = folder / "kernel.vmfb"
            start = time.perf_counter()
            path.write_bytes(compile_ir(tuned_ir(spec, target), Target("rocm", args.arch, (isa_dump_flag(path),)),
                                        spec.name))
            seconds = time.perf_counter() - start
            kernels = amdgpu_kernels(amdgpu_isa(path))
            attention = [kernel for kernel in kernels if "attention" in kernel.name]
            spills = (sum(k.vgpr_spills for k in kernels), sum(k.sgpr_spills for k in kernels))
            blocking = sum(host_blocking_calls_in_loops(path).values())
            problems = "; ".join(structure_problems(spec, target, path)) or "none"
            print(f"| {model.removesuffix('.json')} | `{spec.name}` | {len(attention)} "
                  f"| {sum(k.mfma for k in attention)} | {max(k.vgprs for k in attention)} "
                  f"| {max(k.agprs for k in attention)} | {spills[0]}/{spills[1]} | {blocking} | {seconds:.1f} "
                  f"| {problems} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
