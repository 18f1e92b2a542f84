"""What the CUDA artifacts would do on a GPU, read without one (the CUDA issue's proxies).

    .venv/bin/python bench/cuda_proxies.py [--out build/cuda-proxies]

For each spec of the GPU table (bench/gpu_bundle.py) and one of every other variant: mma.sync
instructions in the PTX, host-blocking HAL calls inside loops of the host program (all loops, and
the innermost ones: the query-band loops), IREE's static scheduling statistics of the whole
program (dispatch sites, submissions, device-to-host syncs), and, with ``ptxas`` on the PATH, the
registers and spills of each attention kernel as Hopper's JIT would build it (``-arch=sm_90``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from iree.compiler import tools as iree_tools

from linalg_prefill.mlir import MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec
from linalg_prefill.mlir import DecodeSpec, SequencePrefillSpec
from linalg_prefill.pipeline import Target
from linalg_prefill.pipeline.compiler import run_flags
from linalg_prefill.pipeline.tuning import tuned_ir
from linalg_prefill.pipeline.vm_structure import host_blocking_calls_in_loops, tensor_core_instructions

SPECS = [
    SequencePrefillSpec(32, 8, 128, "float16", causal=True, sm_scale=128 ** -0.5),
    SequencePrefillSpec(32, 8, 128, "bfloat16", causal=True, sm_scale=128 ** -0.5),
    SequencePrefillSpec(32, 8, 128, "float32", causal=True, sm_scale=128 ** -0.5),
    MaskedSequencePrefillSpec(32, 8, 128, "float16", mask_mode="causal_padded_left", sm_scale=128 ** -0.5),
    RaggedPrefillSpec(32, 8, 128, 128, "float16"),
    RaggedPrefillSpec(32, 8, 128, 128, "bfloat16"),
    RaggedPrefillSpec(16, 16, 192, 128, "bfloat16"),
    PagedPrefillSpec(32, 8, 128, "float16", page_size=16),
    PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16, sliding_window=True),
    PagedPrefillSpec(8, 1, 256, "float16", page_size=64),
    SequencePrefillSpec(8, 8, 64, "float16", causal=True, sm_scale=0.125),
    SequencePrefillSpec(32, 32, 80, "float16", causal=True, sm_scale=80 ** -0.5),
    SequencePrefillSpec(16, 8, 96, "bfloat16", causal=True, sm_scale=96 ** -0.5),
    MlaPagedPrefillSpec(16, 512, 64, "float16", page_size=16),
    MlaPagedPrefillSpec(128, 512, 64, "bfloat16", page_size=64, sliding_window=True),
    # the serving passes (runtime/decode.py): 1, 4 and 16 queries per entry
    DecodeSpec(PagedPrefillSpec(32, 8, 128, "float16", page_size=16), 1),
    DecodeSpec(PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16, sliding_window=True), 4),
    DecodeSpec(PagedPrefillSpec(32, 8, 128, "float16", page_size=16), 16),
    DecodeSpec(RaggedPrefillSpec(16, 16, 192, 128, "bfloat16"), 4),
    DecodeSpec(MlaPagedPrefillSpec(16, 512, 64, "float16", page_size=16), 1),
    DecodeSpec(MlaPagedPrefillSpec(128, 512, 64, "bfloat16", page_size=64, sliding_window=True), 4),
]
STATS = ("D->H Syncs", "Submissions", "Dispatches", "Executables")


def _statistics(path: Path) -> dict[str, str]:
    text = path.read_text()
    return {key: re.search(rf"{re.escape(key)}: (\d+)", text).group(1) for key in STATS}


def _ptxas(ptx_files: list[Path]) -> list[str]:
    """'registers/spill bytes' of every online_attention kernel (ptxas -arch=sm_90 -v)."""
    if not shutil.which("ptxas"):
        return ["ptxas not found"]
    found = []
    for ptx in ptx_files:
        log = subprocess.run(["ptxas", "-arch=sm_90", "-v", str(ptx), "-o", os.devnull],
                             capture_output=True, text=True).stderr
        for name, body in re.findall(r"Function properties for (\S+)\n(.*?)(?=ptxas info    : (?:Compiling|Function)|\Z)",
                                     log, re.S):
            if "online_attention" in name:
                spill = re.search(r"(\d+) bytes spill stores", body).group(1)
                registers = re.search(r"Used (\d+) registers", body)
                found.append(f"{registers.group(1) if registers else '?'} regs / {spill} B spill")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="build/cuda-proxies")
    parser.add_argument("--only", default="", help="only the specs whose name contains this")
    args = parser.parse_args()
    target = Target("cuda")
    print(f"{'artifact':<62} {'mma.sync':>8} {'blocking in loops':>18} {'in band loops':>14} "
          f"{'dispatch sites':>14} {'submits':>7} {'D->H':>4}  attention kernels (sm_90)")
    for spec in SPECS if not args.only else [s for s in SPECS if args.only in s.name]:
        folder = Path(args.out) / spec.name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        vmfb_path, stats = folder / "kernel.vmfb", folder / "statistics.txt"
        iree_tools.compile_str(tuned_ir(spec, target), input_type="auto", output_file=str(vmfb_path), extra_args=[
            *target.flags(), *run_flags(), f"--iree-hal-dump-executable-binaries-to={folder}",
            f"--iree-scheduling-dump-statistics-file={stats}", "--iree-scheduling-dump-statistics-format=pretty"])
        everywhere = sum(host_blocking_calls_in_loops(vmfb_path).values())
        innermost = sum(host_blocking_calls_in_loops(vmfb_path, innermost=True).values())
        counts = _statistics(stats)
        name = spec.name if len(spec.name) <= 62 else f"{spec.name[:40]}..{spec.name[-20:]}"
        print(f"{name:<62} {tensor_core_instructions(vmfb_path.read_bytes()):>8} {everywhere:>18} "
              f"{innermost:>14} {counts['Dispatches']:>14} {counts['Submissions']:>7} {counts['D->H Syncs']:>4}  "
              f"{', '.join(_ptxas(sorted(folder.glob('*.ptx'))))}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
