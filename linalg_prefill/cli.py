"""The ``linalg-prefill`` command.

    linalg-prefill build --model configs/llama-3-8b.json --backends llvm-cpu,cuda --out build/llama
    linalg-prefill build --model configs/llama-3-8b.json --arch cuda=sm_86 --out build/llama-sm86
    linalg-prefill build --model configs/llama-3-8b.json --backends rocm --rocm-arch gfx942 --out build/llama-mi300
    linalg-prefill list build/llama
    linalg-prefill check build/llama --backends llvm-cpu,cuda
    linalg-prefill bench build/llama --backends llvm-cpu --tokens 1024 --json bench.json
    linalg-prefill show-config
    linalg-prefill demo
    linalg-prefill clear-cache
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .mlir.specs import DTYPES
from .pipeline.cache import default_cache
from .pipeline.targets import BACKENDS, Target



def _all_backends() -> str:
    """Every backend of pipeline/targets.py: BACKENDS, comma-separated (the --backends default)."""
    return ",".join(BACKENDS)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="linalg-prefill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build the kernels, run them on the CPU against the reference")
    demo.add_argument("--backends", default=_all_backends(), help="comma-separated backends to build")
    sub.add_parser("clear-cache", help="remove every cached artifact")
    build = sub.add_parser("build", help="compile every kernel variant a model needs into a folder with a manifest")
    build.add_argument("--model", required=True, help="Hugging Face config.json or a project TOML/JSON config")
    build.add_argument("--out", required=True, help="output folder (vmfb files and manifest.json)")
    build.add_argument("--backends", default=_all_backends(), help="comma-separated, from " + _all_backends())
    build.add_argument("--dtype", choices=DTYPES, help="override the config's dtype")
    build.add_argument("--page-size", type=int, help="override the config's KV-cache page size (default 16)")
    build.add_argument("--jobs", type=int, help="parallel compiles (default: CPU count)")
    build.add_argument("--variants", help="comma-separated entry points to build, e.g. batch_prefill_paged_kv "
                                          "(default: every variant the model needs)")
    build.add_argument("--arch", action="append", default=[], metavar="BACKEND=ARCH",
                       help="a backend's arch, repeatable, e.g. cuda=sm_86 or llvm-cpu=x86-64-v3 (default: "
                            + ", ".join(f"{name}={record.default_arch}" for name, record in BACKENDS.items()) + ")")
    build.add_argument("--cpu", action="append", dest="arch", type=lambda arch: f"llvm-cpu={arch}",
                       help="the same as --arch llvm-cpu=CPU")
    build.add_argument("--cuda-arch", action="append", dest="arch", type=lambda arch: f"cuda={arch}",
                       help="the same as --arch cuda=ARCH")
    build.add_argument("--rocm-arch", action="append", dest="arch", type=lambda arch: f"rocm={arch}",
                       help="the same as --arch rocm=ARCH (" + ", ".join(BACKENDS["rocm"].archs) + ")")
    listing = sub.add_parser("list", help="list a build folder's artifacts and check their sha256")
    listing.add_argument("dir", help="a folder written by `linalg-prefill build`")
    check = sub.add_parser("check", help="run every artifact of a build folder on small random inputs "
                                          "against the float64 reference and across backends")
    _add_folder_and_backends(check)
    check.add_argument("--seed", type=int, default=0, help="random seed of the inputs")
    check.add_argument("--strict", action="store_true",
                       help="fail (exit 1) when a requested backend did not run, e.g. no device here")
    bench = sub.add_parser("bench", help="time every artifact of a build folder (and torch SDPA on the same "
                                         "work when torch is installed)")
    _add_folder_and_backends(bench)
    bench.add_argument("--tokens", type=int, default=1024, help="query tokens = keys per entry (default 1024)")
    bench.add_argument("--batch", type=int, default=1, help="batch entries (default 1)")
    bench.add_argument("--repeat", type=int, default=3, help="timed calls per figure, best kept (default 3)")
    bench.add_argument("--json", help="also write the rows to this JSON file")
    sub.add_parser("show-config", help="IREE versions, HAL drivers, usable devices")
    args = parser.parse_args(argv)
    problem = _argument_problem(args)
    if problem:
        print(f"linalg-prefill {args.command}: error: {problem}", file=sys.stderr)
        return 2
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(tuple(args.backends))
    if args.command == "clear-cache":
        cache = default_cache()
        print(f"removed {cache.clear()} artifacts from {cache.root}")
        return 0
    if args.command == "build":
        return _build(args)
    if args.command == "list":
        return _list(args.dir)
    if args.command == "check":
        return _check(args.dir, args.backends, args.seed, strict=args.strict)
    if args.command == "bench":
        return _bench(args)
    if args.command == "show-config":
        return _show_config()
    return 2


def _argument_problem(args) -> str | None:
    """One line saying what is wrong with the parsed arguments (``--backends`` becomes a list)."""
    if hasattr(args, "backends"):
        try:
            args.backends = backend_list(args.backends)
        except ValueError as err:
            return str(err)
    if args.command == "build" and Path(args.out).exists() and not Path(args.out).is_dir():
        return f"--out {args.out}: is a file; give a folder (created if missing)"
    if args.command == "build":
        try:
            args.arch = arch_choices(args.arch)
        except ValueError as err:
            return str(err)
    return None


def arch_choices(items: list[str]) -> dict[str, str]:
    """``--arch BACKEND=ARCH`` items as {backend: arch}, the last one of a backend winning; each
    backend and arch known (pipeline/targets.py: BACKENDS), else ValueError."""
    choices = {}
    for item in items:
        name, sep, arch = (part.strip() for part in item.partition("="))
        if not sep or not arch:
            raise ValueError(f"--arch {item!r}: expected BACKEND=ARCH, e.g. cuda=sm_86")
        try:
            choices[name] = Target(name, arch).arch
        except ValueError as err:
            raise ValueError(f"--arch {item!r}: {err}") from None
    return choices


def backend_list(text: str) -> list[str]:
    """``--backends`` as a list: comma-separated, spaces around names ignored, each one known."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BACKENDS]
    if unknown or not names:
        raise ValueError(f"--backends {text!r}: expected comma-separated names from {', '.join(BACKENDS)}")
    return names


def _version_line() -> str:
    from iree.compiler.version import VERSION as COMPILER_VERSION
    from iree.runtime.version import VERSION as RUNTIME_VERSION

    from linalg_prefill import __version__

    return f"linalg-prefill {__version__} (IREE compiler {COMPILER_VERSION}, runtime {RUNTIME_VERSION})"


def _add_folder_and_backends(parser) -> None:
    """The build-folder argument and --backends of the commands that run a folder's artifacts."""
    parser.add_argument("dir", help="a folder written by `linalg-prefill build`")
    parser.add_argument("--backends", default=_all_backends(),
                        help="comma-separated; a backend without a device here is skipped")


def _build(args) -> int:
    """``build``: model config -> specs -> artifacts; prints the summary line."""
    from .pipeline.artifacts import build_artifacts
    from .pipeline.compiler import CompileError
    from .pipeline.model_config import load_model_config, specs_for_model

    try:
        cfg = load_model_config(args.model, dtype=args.dtype, page_size=args.page_size)
        targets = [Target(b, args.arch.get(b, "")) for b in args.backends]
    except (OSError, ValueError) as err:
        print(f"linalg-prefill build: error: {err}", file=sys.stderr)
        return 2
    specs = specs_for_model(cfg)
    if args.variants:
        wanted, known = args.variants.split(","), list(dict.fromkeys(spec.symbol for spec in specs))
        unknown = [name for name in wanted if name not in known]
        if unknown:
            print(f"linalg-prefill build: error: --variants: {', '.join(unknown)} not among {cfg.name}'s variants "
                  f"({', '.join(known)})", file=sys.stderr)
            return 2
        specs = [spec for spec in specs if spec.symbol in wanted]
    print(f"{cfg.name}: {len(specs)} variants for {', '.join(t.tag for t in targets)}")
    try:
        report = build_artifacts(specs, targets, args.out, jobs=args.jobs, model=cfg)
    except CompileError as err:
        print(f"linalg-prefill build: error: {err}", file=sys.stderr)
        return 1
    print(report.summary())
    return 0


def _list(out_dir: str) -> int:
    """``list``: one row per artifact with its sha256 check; 1 if any is BAD or missing."""
    from .pipeline.artifacts import ArtifactError, load_manifest, verify_artifact
    from .demo import _print_table

    try:
        manifest = load_manifest(out_dir)
    except ArtifactError as err:
        print(f"linalg-prefill list: error: {err}", file=sys.stderr)
        return 1
    rows, bad = [], 0
    for entry in manifest["artifacts"]:
        try:
            verify_artifact(entry, out_dir)
            check = "ok"
        except ArtifactError:
            check = "BAD"
            bad += 1
        rows.append((entry["variant"], entry["target"], entry["file"], _size(entry["bytes"]), check))
    print(f"model {manifest['model']}, IREE compiler {manifest['compiler_version']}")
    _print_table(("variant", "backend", "file", "size", "sha256"), rows)
    if bad:
        print(f"\n{bad} of {len(rows)} artifacts BAD (modified or missing): rebuild with `linalg-prefill build`")
    return 1 if bad else 0


def _check(out_dir: str, backends: list, seed: int, *, strict: bool = False) -> int:
    """``check``: each variant on the requested backends it was built for, against the reference;
    prints one table per variant; 0 when all ran within their error bounds, 1 otherwise or if nothing ran
    (``strict``: also when a requested backend did not run at all)."""
    import numpy as np

    from .runtime.artifact_set import open_artifacts, spec_from_entry
    from .runtime.compare import compare_backends
    from .runtime.examples import example_inputs
    from .pipeline.artifacts import ArtifactError, load_manifest

    try:
        manifest = load_manifest(out_dir)
        sets = {backend: open_artifacts(out_dir, backend, aot_only=True) for backend in backends}
    except ValueError as err:  # ArtifactError or an unknown backend
        print(f"linalg-prefill check: error: {err}", file=sys.stderr)
        return 2
    variants: dict = {}
    for entry in manifest["artifacts"]:  # a variant's serving passes run inside its calls
        if entry["backend"] in sets and "pass_of" not in entry:
            variants.setdefault(entry["variant"], (spec_from_entry(entry), []))[1].append(entry["backend"])
    rng = np.random.default_rng(seed)
    failures, ran, backends_run = 0, 0, set()
    for spec, built in variants.values():
        try:
            report = compare_backends(spec, example_inputs(spec, rng), tuple(dict.fromkeys(built)), artifacts=sets)
        except (ArtifactError, RuntimeError) as err:
            print(f"{spec.name}: error: {err}\n")
            failures += 1
            continue
        print(report.table() + "\n")
        failures += not report.ok
        ran += len(report.ran)
        backends_run.update(report.ran)
    verdict = "all within their error bounds" if not failures else f"{failures} OUT OF BOUND or failed"
    print(f"{len(variants)} variants, {ran} backend runs: {verdict}")
    if not ran:
        print(f"nothing ran: no artifact for {', '.join(backends)} with a device here")
    missing = [backend for backend in backends if backend not in backends_run]
    if missing:
        print(f"{'error' if strict else 'note'}: requested but not run: {', '.join(missing)}"
              f"{'' if strict else ' (--strict makes this a failure)'}")
    return 1 if failures or not ran or (strict and missing) else 0


def _bench(args) -> int:
    """``bench``: one row per artifact and backend; 1 if nothing ran."""
    from .bench import bench_artifacts, write_json

    for name in ("tokens", "batch", "repeat"):
        if getattr(args, name) < 1:
            print(f"linalg-prefill bench: error: --{name} must be at least 1", file=sys.stderr)
            return 2
    try:
        rows = bench_artifacts(args.dir, args.backends, tokens=args.tokens,
                               batch=args.batch, repeat=args.repeat)
    except ValueError as err:  # ArtifactError or an unknown backend
        print(f"linalg-prefill bench: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        write_json(rows, args.json)
        print(f"wrote {len(rows)} rows to {args.json}")
    return 0 if rows else 1


def _size(count: int) -> str:
    return f"{count / 1024:.0f} KiB" if count < 1 << 20 else f"{count / (1 << 20):.1f} MiB"


def _show_config() -> int:
    """``show-config``: compiler and runtime versions, HAL drivers, the backends (pipeline/targets.py:
    BACKENDS) and which of their devices can be created."""
    import iree.runtime as rt
    from iree.runtime.version import VERSION as RUNTIME_VERSION

    from .mlir.specs import DTYPES
    from .runtime.devices import device_problem
    from .pipeline.compiler import COMPILER_VERSION
    from .pipeline.cpu_tiles import cpu_score_tiles

    cache = default_cache()
    print(f"IREE compiler     {COMPILER_VERSION}")
    print(f"IREE runtime      {RUNTIME_VERSION}")
    print(f"HAL drivers       {', '.join(rt.query_available_drivers())}")
    for name, record in BACKENDS.items():
        archs = "any" if record.archs is None else ", ".join(record.archs)
        print(f"backend {name:<9} driver {record.driver}, lowering {record.lowering}, "
              f"arch {record.default_arch} (archs: {archs})")
    for dtype in DTYPES:
        print(f"llvm-cpu host {dtype:<9} {cpu_score_tiles('host', dtype).describe()}")
    for driver in dict.fromkeys(record.driver for record in BACKENDS.values()):
        reason = device_problem(driver)
        print(f"device {driver:<10} {'usable' if reason is None else 'not usable: ' + reason}")
    print(f"artifact cache    {cache.root}{'' if cache.enabled else ' (disabled)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
