"""Builds the CUDA sweep: candidate configurations of the fused lowering, compiled offline for a
fixed set of dense and serving cases, timed and checked on the GPU machine in one command (the
CUDA issue's item 3; docs/cuda.md). The winners go into the CUDA backend record by a commit, not
at run time.

    .venv/bin/python bench/gpu_sweep.py [--out build/gpu-sweep] [--lengths 2048,8192]
        [--dtypes float16,bfloat16] [--candidates default,r16-w1,...]
        [--pass-candidates default,p16-w1,...] [--serving-rows 32x1,128x1,32x4] [--no-wheels]

A candidate (:data:`CANDIDATES`) sets what pipeline/tuning.py's ``cuda_attention_tiling`` and
``CUDA_ATTENTION_WARPS`` give every online_attention op of a kernel (query rows a workgroup, warps,
keys a step, operands staged in shared memory, which loop the warps split) and the query tiles
of a band (mlir/fused_kernels.py: ``BAND_TILES``: a band's workgroups run at once, bands one
after another, so a band of 4 tiles of 64 rows over 32 query heads is 128 workgroups of 4 warps,
about one an SM of an H200). ``default`` is the record as committed.

The folder is a GPU bundle (bench/gpu_bundle.py: the same runner, run script, reference package
and wheels). For each candidate and dtype: ``bench-sweep-dense-L{L}-{dtype}-{candidate}``, dense
causal h_q 32, h_kv 8, d 128, timed next to torch SDPA on the same inputs (GFLOP/s and the ratio
torch time / ours); ``sweep-check-{dtype}-{candidate}``, a small dense causal call (mixed
lengths of ``runtime.examples.example_inputs``) checked against the float64 reference within its
error bound. Two mma candidates (``mixed``) also build the ragged and paged kernels of the GPU
check's mixed batch (``bench-sweep-ragged-mixed-batch-*``, ``-paged-*``), timed and checked the
same way (all five would pass a device call's 64 MiB with the bundle). The serving passes' candidates (:data:`PASS_CANDIDATES`) the same over paged f16
passes: ``bench-sweep-serving-{B}x{N}-vs-1024-float16-{candidate}`` timed (torch SDPA on the same
cache gathered and padded, with a mask) and the mixed step's pass calls checked. A candidate IREE
does not compile is left out and named in ``sweep.json``. On the GPU machine, inside the folder
(``--max-seconds`` bounds it; `--only L2048` or `--only serving` runs a part)::

    python3 gpu_runner.py --repeat 10 --log sweep.log
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from gpu_bundle import _in_dtype, _redrawn, bench_cases, download_wheels, prepare_folder, save_case, serving_cases  # noqa: E402
from linalg_prefill.mlir import SequencePrefillSpec, cuda_attention, cuda_decode, fused_kernels  # noqa: E402
from linalg_prefill.pipeline import CompileError, Target, compile_ir, compiler, targets, tuning  # noqa: E402
from linalg_prefill.runtime.examples import example_inputs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Candidate:
    """One configuration: ``tiling`` (None: the record's own per head dim), ``warps`` a
    workgroup, ``band_tiles`` query tiles (of 64 rows) a band, ``band_group`` bands a step of the
    band loop (mlir/fused_kernels.py: BAND_GROUP, dispatches that may run at once); or, with
    ``mma`` set, the hand-written mma lowering (mlir/cuda_attention.py) in that tiling, and with
    ``chunk_tiles`` its serving passes (mlir/cuda_decode.py) in chunks of that many 64-key tiles."""

    label: str
    tiling: tuning.AttentionTiling | None = None
    warps: int = tuning.CUDA_ATTENTION_WARPS
    band_tiles: int = fused_kernels.BAND_TILES
    band_group: int = fused_kernels.BAND_GROUP
    mma: cuda_attention.MmaTiling | None = None
    chunk_tiles: int | None = None
    mixed: bool = False   # also the mixed ragged and paged batches (the mma lowering's KV-cache kernels)

    @property
    def lowering(self) -> str:
        return "mma" if self.mma or self.chunk_tiles else "fused"


def _tiling(rows: int, keys: int = 64, promote: bool = True, qk: str = "qi", pv: str = "qi") -> tuning.AttentionTiling:
    return tuning.AttentionTiling(rows=rows, qk_split=qk, pv_split=pv, promote_steps=promote, keys=keys)


#: The sweep's candidates: the record's own; smaller workgroups (more of them a band); the warps
#: splitting the keys and the value columns instead of the rows; fewer keys a step; unstaged
#: steps; longer bands (more workgroups at once, more masked work on the causal diagonal: a band
#: sees the keys up to its last row); bands of 32 tiles (2048 rows: L = 2048 in one dispatch, its
#: masked half computed); 4 bands a step of the band loop, each over its own prefix (one
#: submission a step; IREE still orders the step's dispatches: fused_kernels.BAND_GROUP). Four
#: more (32 rows in bands of 8 tiles, 16 rows in bands of 32, 8 bands a step, 16 rows 4 bands a
#: step) were dropped for the mma candidates: the bundle and the sweep must fit a device call's
#: 64 MiB together.
CANDIDATES = (
    Candidate("default"),
    Candidate("r64-w4-nopromote", _tiling(64, promote=False)),
    Candidate("r64-w4-k32", _tiling(64, keys=32)),
    Candidate("r32-w2", _tiling(32), warps=2),
    Candidate("r16-w1", _tiling(16), warps=1),
    Candidate("r16-w4-split", _tiling(16, promote=False, qk="ki", pv="n"), warps=4),
    Candidate("r64-w4-band8", band_tiles=8),
    Candidate("r64-w4-band16", band_tiles=16),
    Candidate("r16-w1-band16", _tiling(16), warps=1, band_tiles=16),
    Candidate("r64-w4-band32", band_tiles=32),
    Candidate("r64-w4-group4", band_group=4),
    # the hand-written lowering: one dispatch a call, cp.async double buffering, ldmatrix,
    # fully masked tiles skipped; 16 query rows a warp, 4 or 8 warps, 32-128 keys a tile (128 keys
    # at d 128 spill 88-120 bytes a thread: ptxas for sm_90)
    Candidate("mma-w4-k64", mma=cuda_attention.MmaTiling(4, 64), mixed=True),
    Candidate("mma-w8-k64", mma=cuda_attention.MmaTiling(8, 64), mixed=True),
    Candidate("mma-w4-k32", mma=cuda_attention.MmaTiling(4, 32)),
    Candidate("mma-w8-k32", mma=cuda_attention.MmaTiling(8, 32)),
    Candidate("mma-w4-k128", mma=cuda_attention.MmaTiling(4, 128)),
)
#: The serving passes' candidates (their query rows, queries x group, come in 16-row tiles):
#: the record's own (16 rows, 4 warps splitting the keys and the value columns, unstaged); one
#: warp on the 16 rows; 2 and 8 warps splitting; 32 keys a step.
PASS_CANDIDATES = (
    Candidate("default"),
    Candidate("p16-w1", _tiling(16, promote=False), warps=1),
    Candidate("p16-w2-split", _tiling(16, promote=False, qk="ki", pv="n"), warps=2),
    Candidate("p16-w8-split", _tiling(16, promote=False, qk="ki", pv="n"), warps=8),
    Candidate("p16-w4-split-k32", _tiling(16, keys=32, promote=False, qk="ki", pv="n"), warps=4),
    # the mma passes: each entry's keys in chunks of 128, 256 or 512 that workgroups run at once
    Candidate("mma-c2", chunk_tiles=2),
    Candidate("mma-c4", chunk_tiles=4),
    Candidate("mma-c8", chunk_tiles=8),
)
#: Timed serving rows (sequences x new tokens against 1024 cached, paged f16; bench/gpu_bundle.py).
SERVING_ROWS = ("32x1", "128x1", "32x4")


@contextlib.contextmanager
def configured(candidate: Candidate):
    """CUDA's record and the fused lowering's band size as ``candidate`` sets them, while the
    context lasts (the IR built inside it, through pipeline.compiler.keyed_ir, is the
    candidate's)."""
    record, band_tiles, band_group = targets.BACKENDS["cuda"], fused_kernels.BAND_TILES, fused_kernels.BAND_GROUP
    mma_tiling, chunk_tiles = cuda_attention.MMA_TILING, cuda_decode.CHUNK_TILES
    cores = dataclasses.replace(tuning.CUDA_CORES, subgroups=candidate.warps)

    def tiling_of(d_qk: int, d_v: int, query_rows: int = tuning.TILE):
        return candidate.tiling or tuning.cuda_attention_tiling(d_qk, d_v, query_rows)

    def tune_attention(op, loops):
        return (tuning.gpu_attention_config(op, loops, cores, tiling_of)
                or tuning.cuda_f32_attention_config(op, loops))

    targets.BACKENDS["cuda"] = dataclasses.replace(record, tune_attention=tune_attention)
    fused_kernels.BAND_TILES, fused_kernels.BAND_GROUP = candidate.band_tiles, candidate.band_group
    cuda_attention.MMA_TILING = candidate.mma or mma_tiling
    cuda_decode.CHUNK_TILES = candidate.chunk_tiles or chunk_tiles
    compiler.keyed_ir.cache_clear()
    try:
        yield
    finally:
        targets.BACKENDS["cuda"], fused_kernels.BAND_TILES, fused_kernels.BAND_GROUP = record, band_tiles, band_group
        cuda_attention.MMA_TILING, cuda_decode.CHUNK_TILES = mma_tiling, chunk_tiles
        compiler.keyed_ir.cache_clear()


def candidate_target(candidate: Candidate, target: Target) -> Target:
    """``target`` in ``candidate``'s lowering."""
    return Target(target.backend, target.arch, target.extra_flags, lowering=candidate.lowering)


def candidate_ir(spec, candidate: Candidate, target: Target) -> str:
    """The IR of ``spec`` on ``target`` under ``candidate`` (in its lowering)."""
    with configured(candidate):
        return compiler.keyed_ir(spec, candidate_target(candidate, target))


def build(out: str, lengths, dtypes, candidates, target: Target, pass_candidates=(), serving_rows=()) -> dict:
    """The sweep's artifacts and cases into ``out`` (prepared as a GPU bundle): the dense cases
    under ``candidates``, the serving passes' (timed ``serving_rows``, checked mixed steps) under
    ``pass_candidates``; returns what was built and what did not compile (also written to
    ``out/sweep.json``)."""
    prepare_folder(out, target)
    rng = np.random.default_rng(0)
    report = {"target": target.tag, "candidates": {}, "failed": {}}
    built = {}

    def artifact(spec, candidate: Candidate) -> str | None:
        """The file of ``spec`` under ``candidate`` in ``out``, compiled once; None where IREE
        refuses it (named in the report)."""
        file = os.path.join("artifacts", f"{spec.name}-{candidate.label}.vmfb")
        if file not in built:
            try:
                vmfb = compile_ir(candidate_ir(spec, candidate, target), candidate_target(candidate, target),
                                  f"{spec.name} ({candidate.label})")
            except CompileError as error:
                report["failed"][f"{candidate.label}/{spec.name}"] = str(error).splitlines()[-1][:300]
                print(f"{candidate.label} {spec.name}: did not compile", file=sys.stderr)
                vmfb = None
            if vmfb is not None:
                with open(os.path.join(out, file), "wb") as f:
                    f.write(vmfb)
                report["candidates"].setdefault(candidate.label, {
                    "lowering": candidate.lowering, "mma": candidate.mma and dataclasses.asdict(candidate.mma),
                    "chunk_tiles": candidate.chunk_tiles,
                    "warps": candidate.warps, "band_tiles": candidate.band_tiles, "band_group": candidate.band_group,
                    "tiling": candidate.tiling and dataclasses.asdict(candidate.tiling), "specs": []})["specs"].append(
                        spec.name)
                print(f"built {file}", file=sys.stderr)
            built[file] = vmfb is not None
        return file if built[file] else None

    def save(name: str, spec, candidate: Candidate, args, flops: float = 0.0) -> None:
        file = artifact(spec, candidate)
        if file is not None:
            case = f"{name}-{candidate.label}"
            save_case(os.path.join(out, "cases", f"{case}.npz"), case, spec, file, args, flops,
                      extra={"sweep_case": name, "candidate": candidate.label})

    dense = [(name, spec, args, flops) for name, spec, args, flops in bench_cases(lengths)
             if name.startswith("bench-dense-") and spec.dtype in dtypes]
    mixed = [(name, spec, args, flops) for name, spec, args, flops in bench_cases(lengths[:1])
             if name.startswith(("bench-ragged-", "bench-paged-")) and spec.dtype in dtypes]
    for candidate in candidates:
        for dtype in dtypes:
            spec = SequencePrefillSpec(32, 8, 128, dtype, causal=True, sm_scale=128 ** -0.5)
            for name, _spec, args, flops in (case for case in dense if case[1].dtype == dtype):
                save(f"bench-sweep-{name.removeprefix('bench-')}", spec, candidate,
                     [("value", _in_dtype(a, spec)) for a in args], flops)
            save(f"sweep-check-{dtype}", spec, candidate,   # its floats drawn again by the runner: small files
                 [_redrawn(a, min_bytes=0) for a in example_inputs(spec, rng)])
        if candidate.mixed:   # its ragged and paged kernels on the GPU check's mixed batches
            for name, spec, args, flops in mixed:
                save(f"bench-sweep-{name.removeprefix('bench-')}", spec, candidate,
                     [("value", _in_dtype(a, spec)) for a in args], flops)
                save(f"sweep-check-{name.removeprefix('bench-')}", spec, candidate,
                     [_redrawn(a, min_bytes=0) for a in example_inputs(spec, rng)])
    serving = list(serving_cases(target, rng, ("paged-f16",), serving_rows)) if pass_candidates else []
    for candidate in pass_candidates:
        for name, spec, args, flops in serving:
            if flops is None:   # a checked pass call of a mixed step (its arguments drawn again)
                save(f"sweep-check-{name}", spec, candidate, args)
            else:
                save(f"bench-sweep-{name.removeprefix('bench-')}", spec, candidate, [("value", a) for a in args], flops)
    with open(os.path.join(out, "sweep.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "build", "gpu-sweep"))
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--candidates", default=",".join(c.label for c in CANDIDATES))
    parser.add_argument("--pass-candidates", default=",".join(c.label for c in PASS_CANDIDATES),
                        help="the serving passes' candidates ('' for none)")
    parser.add_argument("--serving-rows", default=",".join(SERVING_ROWS))
    parser.add_argument("--no-wheels", action="store_true", help="skip downloading the cp312 wheels")
    args = parser.parse_args()
    chosen = {}
    for option, listed in (("candidates", CANDIDATES), ("pass_candidates", PASS_CANDIDATES)):
        known = {c.label: c for c in listed}
        wanted = [label for label in getattr(args, option).split(",") if label]
        unknown = [label for label in wanted if label not in known]
        if unknown:
            parser.error(f"--{option.replace('_', '-')}: unknown {unknown}; known: {', '.join(known)}")
        chosen[option] = [known[label] for label in wanted]
    report = build(args.out, [int(n) for n in args.lengths.split(",")], args.dtypes.split(","),
                   chosen["candidates"], Target("cuda"), chosen["pass_candidates"], args.serving_rows.split(","))
    if not args.no_wheels:
        download_wheels(args.out)
    print(f"sweep ready: {args.out} ({len(report['candidates'])} candidates built, {len(report['failed'])} "
          f"did not compile); on the GPU machine run `python3 gpu_runner.py --repeat 10 --log sweep.log` inside it")


if __name__ == "__main__":
    main()
