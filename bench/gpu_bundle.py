"""Makes a folder that checks the GPU artifacts on a GPU machine with no registry (``make gpu-bundle``:
CUDA in build/gpu-bundle, ROCm for an MI300 host in build/gpu-bundle-rocm).

    .venv/bin/python bench/gpu_bundle.py [--out build/gpu-bundle] [--backend cuda|rocm] [--models ...]
                                         [--recorded DIR] [--no-wheels]

The folder holds, next to ``gpu_runner.py`` (numpy + IREE runtime only), ``gpu_check.sh`` (the run
script: ``bash gpu_check.sh OUT_DIR``, on the driver ``backend.json`` names) and ``backend.json``:

* ``artifacts/``: every spec of its cases compiled for ``--backend`` (sm_80 for CUDA, gfx942 for
  ROCm: MI300X/MI300A/MI325X);
* ``cases/*.npz``: one seed-ABI call each, with the ``runtime.reference`` function and keyword
  arguments that evaluate it, its argument names and the spec's facts the error model needs
  (``runtime.compare.call_facts``): every element must be within the call's error bound
  (runtime/error_model.py, computed on the GPU machine's CPU as the reference is):
  - a small call per variant of the example models (``runtime.examples.example_inputs``: mixed
    lengths, a qo_len > kv_len entry, shuffled pages);
  - with ``--recorded DIR``, every llvm-cpu call the backend-parametrized tests made, as recorded by
    ``LINALG_PREFILL_RECORD_CASES=DIR make test`` (``tests/conftest.py``): the tests' CUDA layer,
    replayed where the compiler cannot be installed;
  - ``serving-*`` cases: the serving passes' own calls (runtime/decode.py) of a mixed step per
    KV-cache variant, checked against ``reference.decode_entries``;
  - ``bench-*`` cases (dense causal L=2048/8192, mixed ragged and paged batches, serving rows of
    32 and 128 sequences x 1-16 new tokens vs 1024 cached), timed only.
  Arrays the tests drew with their ``uniform`` helper are stored as the PCG64 state, shape and dtype
  that draw them again (and the sha1 the redraw must match), so the bundle stays well under the
  64 MiB a device call can carry; the reference and the bound are computed on the GPU machine's
  CPU from ``reference/`` (copies of ``runtime/reference.py``, ``runtime/rope.py``,
  ``runtime/kv_layouts.py`` and ``runtime/error_model.py``, numpy only);
* ``wheels/``: the cp312 wheels of iree-base-runtime (same version as here) and ml_dtypes, without
  their dependencies: the GPU machines' image has numpy (2.5.2 in 2026-11), and numpy's wheel
  (15.7 MB) took the bundle and the sweep over the 64 MiB a device call carries.

Copy the folder to the GPU machine and run ``python3 gpu_runner.py`` there.
``--backend llvm-cpu`` makes the same bundle for this machine's CPU, which is how the runner is
tested without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np

from linalg_prefill.mlir import (
    MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec, x86_uses_amx,
)
from linalg_prefill.pipeline import Target, compile_spec
from linalg_prefill.pipeline.cpu_tiles import x86_cpu
from linalg_prefill.pipeline.model_config import load_model_config, specs_for_model
from linalg_prefill.runtime.compare import call_facts, reference_call
from linalg_prefill.mlir.abi import argument_names
from linalg_prefill.mlir.bundle import function_name
from linalg_prefill.runtime.examples import example_inputs
from linalg_prefill.runtime.decode import DECODE_PASSES, decode_calls, pass_queries

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = ("tiny.toml", "mistral-7b.json", "deepseek-v2-lite.json")
#: The wheels the bundle ships (no dependencies: numpy is the GPU machine's own).
WHEELS = ("iree-base-runtime==3.13.0", "ml_dtypes")
REFERENCE_FILES = ("reference.py", "rope.py", "kv_layouts.py", "error_model.py", "dtypes.py")


def bench_cases(dense_lengths=(2048, 8192)):
    """(name, spec, args, flops): the CUDA issue's table. Dense causal B=1, h_q 32, h_kv 8, d 128 at
    L=2048 and 8192 in f16 and bf16 (and f32 at 2048), and the mixed-length batch of
    bench/kv_cache_batches.py (lengths 37, 512, 1024, 96, 2048, 5; causal, new tokens against
    themselves) through the ragged kernel in f16 and bf16 and the paged kernel (16-token pages)
    in f16. Float inputs are drawn by the runner; index arrays travel as they are."""
    runs = [(dtype, length) for length in dense_lengths for dtype in ("float16", "bfloat16")]
    for dtype, length in runs + [("float32", dense_lengths[0])]:
        dense = SequencePrefillSpec(32, 8, 128, dtype, causal=True, sm_scale=128 ** -0.5)
        q = np.zeros((1, length, 32, 128), np.float32)
        k = np.zeros((1, length, 8, 128), np.float32)
        yield f"bench-dense-causal-L{length}-{dtype}", dense, (q, k, k), 4.0 * 128 * 32 * length * (length + 1) / 2
    lengths = [37, 512, 1024, 96, 2048, 5]
    flops = 4.0 * 128 * 32 * sum(n * (n + 1) / 2 for n in lengths)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(indptr[-1])
    zeros_b, zeros_q = np.zeros(len(lengths), np.int32), np.zeros(total, np.int32)
    q = np.zeros((total, 32, 128), np.float32)
    for dtype in ("float16", "bfloat16"):
        ragged = RaggedPrefillSpec(32, 8, 128, 128, dtype)
        kv = np.zeros((total, 8, 128), np.float32)
        args = (q, indptr, kv, kv, indptr, zeros_q, zeros_b, 1, 0, 1.0, 1e4, 128 ** -0.5)
        yield f"bench-ragged-mixed-batch-{dtype}", ragged, args, flops
    paged = PagedPrefillSpec(32, 8, 128, "float16", page_size=16)
    pages_per_entry = [-(-n // 16) for n in lengths]
    page_indptr = np.concatenate([[0], np.cumsum(pages_per_entry)]).astype(np.int32)
    page_values = np.arange(page_indptr[-1], dtype=np.int32)
    last_page_len = np.array([n - 16 * (p - 1) for n, p in zip(lengths, pages_per_entry)], np.int32)
    pages = np.zeros((int(page_indptr[-1]), 2, 8, 16, 128), np.float32)
    args = (q, indptr, pages, page_indptr, page_values, last_page_len, zeros_b, zeros_q, 1, 0, 1.0, 1e4,
            128 ** -0.5)
    yield "bench-paged-mixed-batch-float16", paged, args, flops


def serving_batch(spec, rng, entries, window=False):
    """Seed-ABI arguments of a paged or MLA serving step (no RoPE, causal; runtime/examples.py):
    ``entries`` as (new tokens, cached tokens), pages shuffled; ``window`` gives every entry 3
    sink rows and a window that starts 5 rows in."""
    rope_off = {"rotary_mode": 0} if "rotary_mode" in argument_names(spec) else {}
    return example_inputs(spec, rng, entries, window=[(5, 3)] * len(entries) if window else None, **rope_off)


SERVING_VARIANTS = ("paged-f16", "paged-window-bf16", "mla-f16")
SERVING_ROWS = ("32x1", "128x1", "32x4", "32x16")


def serving_cases(target: Target, rng, variants=SERVING_VARIANTS, rows=SERVING_ROWS):
    """(name, spec, args, flops or None) of the serving passes' own calls (runtime/decode.py), as
    the runtime plans them for ``target``'s lowering: checked calls of a mixed step (1-16 new
    tokens against 1-700 cached) for each KV-cache variant, and timed serving rows (32 and 128
    sequences x 1, 4 and 16 new tokens vs 1024 cached, f16, h_q 32, h_kv 8, d 128)."""
    passes = DECODE_PASSES[target.lowering]
    mixed = [(1, 37), (3, 300), (1, 700), (16, 90), (2, 1), (1, 256), (5, 64), (1, 1000)]
    checked = {"paged-f16": (PagedPrefillSpec(32, 8, 128, "float16", page_size=16), False),
               "paged-window-bf16": (PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16, sliding_window=True), True),
               "mla-f16": (MlaPagedPrefillSpec(16, 512, 64, "float16", page_size=16), False)}
    for label in variants:
        spec, window = checked[label]
        args = serving_batch(spec, rng, mixed, window)
        for call in decode_calls(spec, args, pass_queries(spec, args, passes), passes):
            yield f"serving-{label}-{call.spec.name[-8:].strip('_')}-n{len(call.rows)}-w{call.args[-4].shape[1]}", \
                call.spec, [_redrawn(a) for a in call.args], None
    spec = PagedPrefillSpec(32, 8, 128, "float16", page_size=16)
    for batch, new in (tuple(int(x) for x in row.split("x")) for row in rows):
        if max(passes.queries) < new:
            continue
        args = serving_batch(spec, rng, [(new, 1024)] * batch)
        (call,) = decode_calls(spec, args, pass_queries(spec, args, passes), passes)
        flops = 4.0 * 128 * 32 * batch * new * 1024
        yield f"bench-serving-{batch}x{new}-vs-1024-float16", call.spec, call.args, flops


def _redrawn(a, seed=20261204, min_bytes=1 << 20):
    """An argument of a checked serving call as a (kind, value) pair: a float array of over
    ``min_bytes`` (1 MiB: the page pool every pass call reads in place) as the PCG64 state that
    draws other values of its shape and dtype (``redraw``; any values do: the runner computes the
    reference from the redrawn ones), so that a variant's calls do not each carry its pool; the
    rest as it is."""
    if not (isinstance(a, np.ndarray) and a.dtype.name in ("float32", "float16", "bfloat16") and a.nbytes > min_bytes):
        return "value", a
    draw = {"state": np.random.Generator(np.random.PCG64(seed)).bit_generator.state,
            "shape": list(a.shape), "dtype": a.dtype.name}
    return "uniform", {**draw, "sha1": hashlib.sha1(redraw(draw).tobytes()).hexdigest()}


def _in_dtype(a, spec):
    """A bench float input in the spec's dtype (only its shape and dtype travel)."""
    if isinstance(a, np.ndarray) and a.dtype.kind == "f":
        import ml_dtypes
        return a.astype({"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[spec.dtype])
    return a


def redraw(draw: dict) -> np.ndarray:
    """The array ``tests/conftest.py: uniform`` drew from this PCG64 state (the runner's twin)."""
    import ml_dtypes

    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = draw["state"]
    dtype = ml_dtypes.bfloat16 if draw["dtype"] == "bfloat16" else draw["dtype"]
    return rng.uniform(-1.0, 1.0, size=draw["shape"]).astype(dtype)


def recorded_cases(directory: str):
    """(name, spec, args as (kind, value) pairs) of every call recorded in ``directory``."""
    for path in sorted(glob.glob(os.path.join(directory, "*.pkl"))):
        with open(path, "rb") as f:
            case = pickle.load(f)
        for kind, value in case["args"]:
            if kind == "uniform" and hashlib.sha1(redraw(value).tobytes()).hexdigest() != value["sha1"]:
                raise SystemExit(f"{path}: an argument drawn by uniform() was changed before the call")
        test = case["test"].split("::")[-1]
        yield f"test-{os.path.basename(path)[:-4]}-{test}", case["spec"], case["args"]


def save_case(path, name, spec, file, args, flops=0.0, amx=False, extra=None, symbol=None) -> None:
    """One .npz: the call's arguments (``args``: (kind, value) pairs, kind "uniform" for a
    recorded draw, "value" otherwise), and for checked cases the reference call, the argument
    names and the spec's facts the error model needs; ``extra``: more fields of its meta (a sweep
    case's ``sweep_case`` and ``candidate``); ``symbol``: the artifact's function (``spec.symbol``
    unless given: mlir.bundle.function_name).

    ``bench-*`` cases store only the shapes of their large float inputs (the runner draws them)
    and no reference; their index arrays are stored as they are.
    """
    bench = name.startswith("bench-")
    arrays, meta_args = {}, []
    for i, (kind, a) in enumerate(args):
        if kind == "uniform":
            meta_args.append(["uniform", a])
        elif isinstance(a, np.ndarray) and bench and a.dtype.kind == "f":
            meta_args.append(["random", list(a.shape), a.dtype.name])
        elif isinstance(a, np.ndarray):
            key = f"arg{i}"
            arrays[key] = a.view(np.uint16) if a.dtype.name == "bfloat16" else a
            meta_args.append(["array", key])
        else:
            meta_args.append(["scalar", a.item() if isinstance(a, np.generic) else a])
    meta = dict(name=name, symbol=symbol or spec.symbol, dtype=spec.dtype, file=file, args=meta_args, flops=flops,
                amx=amx, q_position=argument_names(spec).index("q"),
                d_v=spec.d_v)   # the results' shapes (the runner's storage)
    if hasattr(spec, "base"):  # a serving pass: torch's timing needs the GQA group
        meta["group"] = spec.base.group_size
    if not bench:
        meta.update(reference=reference_call(spec), arguments=list(argument_names(spec)),
                    facts=dataclasses.asdict(call_facts(spec)))
    meta.update(extra or {})
    np.savez_compressed(path, meta=json.dumps(meta), **arrays)


def prepare_folder(out: str, target: Target) -> None:
    """``out`` emptied of artifacts, cases and reference, with the runner, the run script, the
    reference package (numpy only) and ``backend.json`` (the driver gpu_check.sh runs on)."""
    for sub in ("artifacts", "cases", "reference"):
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
        os.makedirs(os.path.join(out, sub))
    for tool in ("gpu_runner.py", "gpu_check.sh"):
        shutil.copy(os.path.join(HERE, tool), out)
    with open(os.path.join(out, "backend.json"), "w") as f:  # read by gpu_check.sh
        json.dump({"backend": target.backend, "target": target.tag, "driver": target.driver}, f)
    for file in REFERENCE_FILES:
        shutil.copy(os.path.join(ROOT, "runtime", file), os.path.join(out, "reference"))
    open(os.path.join(out, "reference", "__init__.py"), "w").close()


def download_wheels(out: str) -> None:
    """The cp312 wheels the runner unpacks on a machine without a registry, into ``out/wheels``
    (emptied first: a wheel left from an older bundle would travel too)."""
    shutil.rmtree(os.path.join(out, "wheels"), ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "download", *WHEELS, "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "-d", os.path.join(out, "wheels")], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "build", "gpu-bundle"))
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--models", nargs="+", default=MODELS, help="model configs under configs/ to take specs from")
    parser.add_argument("--recorded", help="a folder of calls recorded by LINALG_PREFILL_RECORD_CASES")
    parser.add_argument("--no-wheels", action="store_true", help="skip downloading the cp312 wheels")
    parser.add_argument("--bench-lengths", default="2048,8192", help="dense bench sequence lengths")
    parser.add_argument("--serving-variants", default=",".join(SERVING_VARIANTS),
                        help="KV-cache variants whose serving-pass calls are checked")
    parser.add_argument("--serving-rows", default=",".join(SERVING_ROWS),
                        help="timed serving rows, SEQUENCESxNEW_TOKENS against 1024 cached")
    args = parser.parse_args()
    target = Target(args.backend)
    prepare_folder(args.out, target)
    rng = np.random.default_rng(0)
    specs = {}
    for model in args.models:
        for spec in specs_for_model(load_model_config(os.path.join(ROOT, "configs", model))):
            specs[spec.name] = spec
    values = lambda call: [("value", a) for a in call]  # noqa: E731
    examples = {name: example_inputs(spec, rng) for name, spec in specs.items()}
    cases = [(name, spec, values(examples[name]), 0.0) for name, spec in specs.items()]
    if args.recorded:
        cases += [(name, spec, call, 0.0) for name, spec, call in recorded_cases(args.recorded)]
    cases += [(name, spec, [("value", _in_dtype(a, spec)) for a in call], flops)
              for name, spec, call, flops in bench_cases([int(n) for n in args.bench_lengths.split(",")])]
    cases += [(name, spec, call if flops is None else values(call), flops or 0.0)
              for name, spec, call, flops in serving_cases(target, rng, args.serving_variants.split(","),
                                                           args.serving_rows.split(","))]
    built = {}   # file -> the function it holds for its spec
    for name, spec, call, flops in cases:
        file = os.path.join("artifacts", f"{spec.name}.vmfb")
        if file not in built:
            vmfb = compile_spec(spec, target)
            with open(os.path.join(args.out, file), "wb") as f:
                f.write(vmfb)
            built[file] = function_name(spec, vmfb)
            print(f"built {file}", file=sys.stderr)
        amx = target.lowering_of(spec) == "x86" and x86_uses_amx(spec, x86_cpu(target.arch))
        save_case(os.path.join(args.out, "cases", f"{name}.npz"), name, spec, file, call, flops, amx=amx,
                  symbol=built[file])
    if not args.no_wheels:
        download_wheels(args.out)
    print(f"bundle ready: {args.out} ({len(cases)} cases, {len(built)} artifacts for {target.tag}); on the GPU "
          f"machine run `python3 gpu_runner.py` inside it")


if __name__ == "__main__":
    main()
