"""Whether a CPU's kernels compile to the same dispatches as at an earlier commit: the check that a
change made (and measured) on one CPU leaves another CPU's code as it was.

    .venv/bin/python bench/same_dispatches.py REV [--arch znver4] [--jobs 2]

For the bench shapes (h_q 32, h_kv 8, d 128 dense, masked, ragged, paged, paged with a window and
sinks, MLA with 16 heads, each with its serving passes, float32, bfloat16 and float16, and an e4m3
paged cache) the IR of this tree and of ``REV`` (a git worktree in a temporary folder, imported in
a process of its own) is compiled for ``--arch`` up to IREE's executable sources; each kernel's
executables are compared as sets, with symbol names, locations and push-constant counts and
ordinals left out (a kernel whose results are written into the caller's storage reads fewer
constants). Prints one line a kernel: ``same`` or how many executables differ, and the total.
Run with ``--arch znver4`` (a CPU without AMX: AMD Zen 4) after work on an AMX host: identical
executables run as fast as they did (a Zen 4 builds x86 kernels and passes too, on DotEngine and
the FMA blocks, and the linalg kernels of the specs the x86 lowering has none of).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from linalg_prefill.pipeline import Target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Run in a process with ``sys.argv[1]`` (a folder holding a ``linalg_prefill`` package, or "-" for
#: the installed one) and ``sys.argv[2]`` (where the IR goes): writes one .mlir a spec.
WRITE_IR = r'''
import os, sys
if sys.argv[1] != "-":
    sys.meta_path = [finder for finder in sys.meta_path if "editable" not in str(finder)]
    sys.path.insert(0, sys.argv[1])
from linalg_prefill.mlir import (DecodeSpec, MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec,
                                 RaggedPrefillSpec, SequencePrefillSpec)
from linalg_prefill.pipeline import Target
from linalg_prefill.pipeline.tuning import tuned_ir
specs = []
for dtype in ("float32", "bfloat16", "float16"):
    specs += [SequencePrefillSpec(32, 8, 128, dtype, causal=True, sm_scale=128 ** -0.5),
              MaskedSequencePrefillSpec(32, 8, 128, dtype, mask_mode="padded", sm_scale=128 ** -0.5),
              PagedPrefillSpec(32, 8, 128, dtype, page_size=16, sliding_window=True, head_sinks=True)]
    for base in (PagedPrefillSpec(32, 8, 128, dtype, page_size=16), RaggedPrefillSpec(32, 8, 128, 128, dtype),
                 MlaPagedPrefillSpec(16, 512, 64, dtype, page_size=16)):
        specs += [base, *(DecodeSpec(base, queries) for queries in (1, 4, 16))]
fp8 = PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16, kv_dtype="float8_e4m3fn")
specs += [fp8, DecodeSpec(fp8, 1)]
for spec in specs:
    with open(os.path.join(sys.argv[2], spec.name + ".mlir"), "w") as f:
        f.write(tuned_ir(spec, Target("llvm-cpu", sys.argv[3])))
'''


def write_ir(package_root: str, out: str, arch: str) -> None:
    os.makedirs(out)
    subprocess.run([sys.executable, "-c", WRITE_IR, package_root, out, arch], check=True, cwd=tempfile.gettempdir())


def package_of(tree: str, folder: str) -> str:
    """A folder holding ``linalg_prefill`` as pyproject.toml maps it (mlir/, pipeline/ and
    runtime/ of ``tree`` as its subpackages), for the import in WRITE_IR."""
    package = os.path.join(folder, "linalg_prefill")
    shutil.copytree(os.path.join(tree, "linalg_prefill"), package)
    for sub in ("mlir", "pipeline", "runtime"):
        os.symlink(os.path.join(tree, sub), os.path.join(package, sub))
    return folder


@contextlib.contextmanager
def worktree(rev: str, folder: str):
    """A git worktree of ``rev`` at ``folder`` (yielded), removed on the way out."""
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", folder, rev], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", folder], check=True)


def executable_sources(ir_file: str, out: str, arch: str) -> None:
    """IREE's executable sources of ``ir_file`` in ``out``, compiled with the flags the library
    compiles for ``arch`` with (Target.flags)."""
    compiler = os.path.join(os.path.dirname(sys.executable), "iree-compile")
    subprocess.run([compiler, *Target("llvm-cpu", arch).flags(), "--compile-to=executable-sources",
                    f"--iree-hal-dump-executable-sources-to={out}", ir_file, "-o", os.devnull], check=True)


def canonical(text: str) -> str:
    """An executable's source without what names or numbers it: symbols, locations, push-constant
    counts and ordinals."""
    text = re.sub(r"@[\w$.]+", "@X", text)
    text = re.sub(r"loc\([^)]*\)", "", text)
    text = re.sub(r"constants = \d+", "constants = N", text)
    return re.sub(r"ordinal\(\d+\)", "ordinal(N)", text)


def executables(folder: str) -> collections.Counter:
    return collections.Counter(hashlib.sha1(canonical(open(os.path.join(folder, name)).read()).encode()).hexdigest()
                               for name in os.listdir(folder))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="the earlier commit")
    parser.add_argument("--arch", default="znver4", help="the LLVM CPU to compile for")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        with worktree(args.rev, os.path.join(scratch, "tree")) as old_tree:
            os.makedirs(os.path.join(scratch, "package"))
            write_ir(package_of(old_tree, os.path.join(scratch, "package")), os.path.join(scratch, "ir-old"), args.arch)
        write_ir("-", os.path.join(scratch, "ir-new"), args.arch)
        names = sorted(name[:-len(".mlir")] for name in os.listdir(os.path.join(scratch, "ir-new")))
        jobs = [(side, name) for side in ("old", "new") for name in names
                if os.path.exists(os.path.join(scratch, f"ir-{side}", name + ".mlir"))]
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda job: executable_sources(os.path.join(scratch, f"ir-{job[0]}", job[1] + ".mlir"),
                                                         os.path.join(scratch, job[0], job[1]), args.arch), jobs))
        same = 0
        for name in names:
            if not os.path.isdir(os.path.join(scratch, "old", name)):
                print(f"{name}: not in {args.rev}")
                continue
            old, new = (executables(os.path.join(scratch, side, name)) for side in ("old", "new"))
            differing = sum((new - old).values())
            same += differing == 0
            print(f"{name}: " + ("same" if differing == 0 else
                                 f"{differing} of {sum(new.values())} executables differ from {args.rev}'s"))
        print(f"{same} of {len(names)} kernels compile for {args.arch} to the executables they had at {args.rev}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
