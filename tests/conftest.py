"""Shared fixtures: an isolated artifact cache per session, built in parallel before the tests
run; backend parameters; GPU detection.

**Pre-build.** After collection, every (spec, target) the collected tests declare is compiled
into the session's cache at once (one process per core; on llvm-cpu the kernels of one shape
with their passes as one module, whose dispatches they mostly share: pipeline/compiler.py
bundle_tasks(by_shape=True), mlir/bundle.py), so a test finds its kernels already built. A test
declares what it compiles in either of two ways:

* a parameter whose values are specs (``@pytest.mark.parametrize("spec", SPECS)``) of a test
  that uses the ``cache`` fixture: each value, for the test's ``backend`` (or ``target``) parameter
  if it has one, else llvm-cpu (a test that reads the IR only and takes no ``cache`` declares nothing);
* ``@pytest.mark.compiles(*specs, backends=(...))`` on the test (or ``pytestmark = ...`` for a
  whole module): those specs, for those backends (default as above); without specs, the mark
  names the backends of the test's spec parameters.

For example (tests/test_kv_cache_prefill.py, tests/test_head_sinks.py)::

    @pytest.mark.parametrize("backend", BACKENDS)
    @pytest.mark.parametrize("spec", SPECS, ids=spec_id)   # each spec on each backend
    def test_matches_the_reference(spec, backend, cache): ...

    pytestmark = pytest.mark.compiles(*SPECS.values(), passes=ENTRIES)   # a whole module

The serving passes (runtime/decode.py) that a KV-cache kernel's calls with short entries (and no
inline RoPE) take are declared with ``compiles(..., passes=ENTRIES)``: those that calls of
``ENTRIES`` ((qo_len, kv_len) per entry) take, for each KV-cache spec the test declares;
``passes=True``: all of them; none by default. ``open_kernel`` loads a kernel's passes at open,
and in a test it loads the declared ones (``declared_serving_passes``).
Tests that are skipped (a true ``skipif``, e.g. CUDA without a device) or deselected declare
nothing. A spec no test declares still works: it compiles when the test opens it, one after
another; the summary line at the end names how many did (``compiled during the tests``).
``--no-prebuild`` turns the pre-build off. Under pytest-xdist (``-n 2``) the workers share one
cache: each builds its share of the declared specs first, then takes what is left (the cache's
lock compiles each artifact once), and each runs IREE's local-task driver on its share of the cores.

The session's cache is also the environment's (``LINALG_PREFILL_CACHE_DIR``), so a test that opens
a kernel without ``cache=`` uses the same artifacts. ``LINALG_PREFILL_TEST_CACHE=DIR`` keeps it in
DIR instead of pytest's temporary folder: a rerun compiles only what changed, and a test that runs
pytest in a subprocess (tests/test_gpu_bundle.py) hands it its own cache.

**Grids.** A numerics grid is a list of (spec, lowering) cases, usually ``support.pairwise`` over
its factors (every pair of values of two factors in some spec, e.g. 9 compiles for heads x head dim
x mask x dtype x lowering instead of 72); ``on_backends(cases)`` makes them pytest parameters, each
spec on the host backend of its lowering and on every GPU backend (skipped without a device).
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import os
import pickle
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from xdist.scheduler import LoadGroupScheduling

from linalg_prefill.mlir.decode import DecodeSpec
from linalg_prefill.pipeline import ArtifactCache, CompileError, Target, compiler, target_for
from linalg_prefill.pipeline.artifacts import CacheFill, fill_cache
from linalg_prefill.pipeline.cpu_tiles import host_cpu_features
from linalg_prefill.pipeline.compiler import bundle_tasks, cached_bundle
from linalg_prefill.pipeline.targets import BACKENDS as TARGET_BACKENDS, LOWERINGS
from linalg_prefill.runtime import examples, kernels
from linalg_prefill.distributed import pin_rank_threads, rank_cpus
from linalg_prefill.runtime.devices import backend_available
from linalg_prefill.runtime.examples import uniform as _uniform
from linalg_prefill.runtime.variants import VARIANTS

import support
from support import NUMPY_DTYPE, TensorLike, assert_matches_reference, spec_id  # noqa: F401 (imported from here too)

__all__ = ["BACKENDS", "BACKENDS_WITHOUT_FUSED_CPU", "FUSED_CPU", "NUMPY_DTYPE", "TensorLike", "assert_matches_reference",
           "on_backends", "uniform"]

#: Every numerics test runs on each backend of pipeline/targets.py: BACKENDS: llvm-cpu (its linalg
#: lowering), then, for a backend on the host CPU, its other lowerings (the fused lowering CUDA
#: uses compiled for llvm-cpu: same IR structure, so a wrong mask or index shows up without a
#: GPU), and CUDA itself (marked ``device``) where a device exists.
#: The fused lowering compiled for the CPU: a check of the GPUs' IR (its masks, indices, page
#: remaps) without a GPU, whose speed on the CPU nobody uses. Built for x86-64-v3 (AVX2, FMA,
#: F16C: every x86 server CPU since 2013-2015) rather than the host where the host has those, its
#: LLVM code generation costs about a third less (2.3-2.6 s -> 1.6-1.8 s a bundle, AMX Xeon model
#: 167). Not x86-64-v2: without F16C LLVM's float16 conversions took a peaked-score float16 call
#: to 406x its error bound (docs/test-suite.md, fourteenth session).
FUSED_CPU = Target("llvm-cpu", "x86-64-v3" if {"avx2", "fma", "f16c"} <= host_cpu_features() else "host",
                   lowering="fused")
BACKENDS = []
#: Per lowering, the backend that runs it on this machine (the fused lowering CUDA uses compiled
#: for llvm-cpu), as a pytest parameter; and the GPU backends, skipped without a device.
HOST_LOWERINGS: dict = {}
DEVICE_BACKENDS = []
#: The same without the host backends' other lowerings, for two kinds of test:
#: - query/key head dims above 128: IREE 3.13's llvm-cpu code for online_attention tiles the head
#:   dim of Q.K^T and treats each partial dot product as a score (measured: ragged d_qk 160, 192,
#:   256, 320 and 576 off by 0.24-0.39 in the output, 96 and 128 exact; reproducer:
#:   docs/iree-cpu-attention-bug.md), so the fused lowering cannot be checked there; the CUDA
#:   configuration keeps the head dim whole;
#: - the float32 grids of the dense and ragged kernels, whose fused runs repeat what the other
#:   tests check (they kept the suite near 20 minutes on 2 cores).
BACKENDS_WITHOUT_FUSED_CPU = []
for _name, _record in TARGET_BACKENDS.items():
    if _record.on_host:
        HOST_LOWERINGS[_record.lowering] = pytest.param(_name, id=_name)
        HOST_LOWERINGS.update({lowering: pytest.param(FUSED_CPU if (_name, lowering) == ("llvm-cpu", "fused")
                                                      else Target(_name, lowering=lowering), id=f"{_name}-{lowering}")
                               for lowering in LOWERINGS if lowering != _record.lowering})
        BACKENDS += [_name, *(HOST_LOWERINGS[lowering] for lowering in LOWERINGS if lowering != _record.lowering)]
        BACKENDS_WITHOUT_FUSED_CPU.append(_name)
    else:
        _param = pytest.param(_name, id=_name, marks=[pytest.mark.device, pytest.mark.skipif(
            not backend_available(_name), reason=f"no {_record.driver} device")])
        BACKENDS.append(_param)
        BACKENDS_WITHOUT_FUSED_CPU.append(_param)
        DEVICE_BACKENDS.append(_param)


def on_backends(cases) -> list:
    """``(spec, backend)`` pytest parameters for ``cases``, (spec, lowering) pairs (e.g. from
    ``support.pairwise``): each spec on the host backend of its lowering, and every spec on each
    GPU backend (skipped without a device)."""
    params = []
    for spec, lowering in cases:
        host = HOST_LOWERINGS[lowering]
        params.append(pytest.param(spec, host.values[0], id=f"{spec_id(spec)}-{host.id}"))
    for spec in dict.fromkeys(spec for spec, _ in cases):
        params += [pytest.param(spec, device.values[0], id=f"{spec_id(spec)}-{device.id}", marks=device.marks)
                   for device in DEVICE_BACKENDS]
    return params


#: What the pre-build found and did: the (spec, target) pairs, the fill's result, the artifacts
#: compiled in this process outside it (``late``), and (xdist's controller) the workers' reports.
_PREBUILD: dict = {"tasks": [], "result": None, "running": False, "late": [], "workers": [], "crashes": [],
                   "compile_ir": None, "lookups": None, "test": None, "opened": set(), "announced": False}


def pytest_addoption(parser):
    parser.addoption("--run-expensive", action="store_true", help="run the large grids")
    parser.addoption("--no-prebuild", action="store_true", help="compile each spec when a test opens it")


def xdist_worker(config) -> tuple[int, int] | None:
    """(this worker's index, the number of workers) in a pytest-xdist worker, else None (also in a
    pytest that a worker's test starts, which inherits the worker's environment). A worker that
    replaces a crashed one (``--max-worker-restart``) comes with the next id (gw2 of 2 workers):
    it takes index ``id % workers``, a share of the cores, instead of failing its configure."""
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return None
    count = int(worker["workercount"])
    return int(worker["workerid"].removeprefix("gw")) % count, count


#: What xdist's workers (one per core) inherit: one thread each for torch's OpenMP pool and
#: OpenBLAS (numpy's reference maths). Each library otherwise starts a thread per core in every
#: worker, and its threads spin after each operation on the core another worker is using: the
#: whole suite on a warm cache, 2 workers, 178-187 s -> 124 s (docs/test-suite.md).
MATH_THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def one_math_thread_per_worker() -> None:
    """Sets :data:`MATH_THREADS` in this (xdist's controller) process's environment, before it
    starts its workers, unless the caller set them."""
    for name, value in MATH_THREADS.items():
        os.environ.setdefault(name, value)


def pytest_configure(config):
    worker = xdist_worker(config)
    if worker:
        # n test processes share the cores: each runs IREE's local-task workers on its own share of
        # them (IREE's default puts every process's workers on the first CPUs: both workers' kernels
        # ran on CPU 0) and compiles its part of the pre-build there (_fill_share)
        pin_rank_threads(*worker)
    elif (getattr(config.option, "numprocesses", None) or 0) > 1:
        one_math_thread_per_worker()
    real_compile_ir = _PREBUILD["compile_ir"] = compiler.compile_ir

    def counted_compile_ir(ir_text, target, name="module"):
        if not _PREBUILD["running"]:
            _PREBUILD["late"].append(f"{target.tag}/{name} ({_PREBUILD['test']})")
        return real_compile_ir(ir_text, target, name)

    compiler.compile_ir = counted_compile_ir  # counts the compiles outside the pre-build
    _PREBUILD["lookups"] = ArtifactCache.cached, ArtifactCache.get_or_build

    def noted(lookup):
        def looked_up(cache, spec, target, *rest):
            if not _PREBUILD["running"]:
                _PREBUILD["opened"].add(f"{target.tag}/{spec.name}")
            return lookup(cache, spec, target, *rest)
        return looked_up

    # what the tests look up (open_kernel, compile_spec), for the summary
    ArtifactCache.cached, ArtifactCache.get_or_build = (noted(lookup) for lookup in _PREBUILD["lookups"])


def pytest_runtest_setup(item):
    _PREBUILD["test"] = item.nodeid  # names the test in the list of late compiles


def pytest_unconfigure(config):
    compiler.compile_ir = _PREBUILD["compile_ir"]
    ArtifactCache.cached, ArtifactCache.get_or_build = _PREBUILD["lookups"]
    _release_kernels()


def _release_kernels() -> None:
    """Drops the kernels the tests kept (support's memo, the malformed catalogue's) and the
    library's shared ones before the interpreter tears IREE's module down, so that a test run
    ends without nanobind's "leaked" reports (as a script does: runtime.kernels.release_shared)."""
    support._KERNELS.clear()
    catalogue = sys.modules.get("malformed_catalogue")
    if catalogue is not None:
        catalogue._KERNELS.clear()
        catalogue._WRAPPED.clear()
    kernels.release_shared()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Large runs (marked ``expensive``) are deselected, not skipped, unless --run-expensive. In a
    ``--dist loadgroup`` worker, a test marked ``xdist_group`` must carry its group in its id (how
    xdist sends a group to one worker): pytest 9.2 with xdist 3.8 silently lost it (constraints.txt)."""
    if getattr(config.option, "loadgroup", False) and any("@" not in item.nodeid for item in items
                                            if item.get_closest_marker("xdist_group")):
        raise pytest.UsageError("--dist loadgroup: pytest-xdist could not group the xdist_group tests "
                                "with this pytest (constraints.txt pins the pair that works)")
    if config.getoption("--run-expensive"):
        return
    expensive = [item for item in items if "expensive" in item.keywords]
    if expensive:
        config.hook.pytest_deselected(items=expensive)
        items[:] = [item for item in items if "expensive" not in item.keywords]


def _is_spec(value) -> bool:
    return type(value) in VARIANTS or isinstance(value, DecodeSpec)


def _skipped(item) -> bool:
    return any(mark.name == "skip" or (mark.name == "skipif" and mark.args and mark.args[0] is True)
               for mark in item.iter_markers())


def compiled_by(item) -> list[tuple]:
    """The (spec, target) pairs ``item`` declares (module docstring), with the serving passes of
    its KV-cache specs."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    marks = list(item.iter_markers("compiles"))
    function = getattr(item, "function", None)
    takes_cache = function is not None and "cache" in inspect.signature(function).parameters
    if _skipped(item) or not marks and not takes_cache:  # a test of the IR alone
        return []
    backend = params.get("backend", params.get("target"))
    default = ["llvm-cpu" if backend is None else backend]
    groups = [([value for value in params.values() if _is_spec(value)] if takes_cache else [], default)]
    passes = next((mark.kwargs["passes"] for mark in marks if "passes" in mark.kwargs), False)  # the closest
    for mark in marks:
        if mark.args:
            groups.append((mark.args, mark.kwargs.get("backends") or default))
        elif mark.kwargs.get("backends"):  # the backends of the spec parameters
            groups[0] = (groups[0][0], mark.kwargs["backends"])
    pairs = []
    for specs, backends in groups:
        for target in map(target_for, backends):
            for spec in specs:
                pairs.append((spec, target))
                if passes is not False and not isinstance(spec, DecodeSpec) and spec.kv_layout != "dense":
                    pairs += [(DecodeSpec(spec, queries), target) for queries in _passes(spec, target, passes)]
    return pairs


def _passes(spec, target: Target, entries) -> list[int]:
    """The query counts of the serving passes of ``spec`` on ``target`` that calls of ``entries``
    ((qo_len, kv_len) per entry, rotary_mode 0) take (runtime/decode.py's pass_queries), or all
    of them for True."""
    passes = target.decode_passes(spec)
    usable = passes.usable(spec)
    if entries is True or not usable:
        return list(usable)
    largest = max(passes.queries)
    in_pieces = largest if largest in usable else None  # long entries over short caches
    own = {next((count for count in sorted(passes.queries) if qo_len <= count),
                in_pieces if kv_len <= passes.pieces_up_to else None)
           for qo_len, kv_len in entries if qo_len >= 1 and kv_len >= 1}
    return sorted({passes.taken(count, usable) for count in own if count is not None} - {0})


@pytest.fixture(autouse=True)
def declared_serving_passes(request, monkeypatch):
    """In a test, ``open_kernel(..., serving_passes=True)`` (the default) loads the serving passes
    the test declares (module docstring) instead of every pass the target has: opening compiles
    what the calls take, not up to 211 more artifacts (docs/architecture.md). An entry whose pass
    is not loaded runs in a loaded one or the main kernel (runtime/decode.py)."""
    declared = {(spec, target) for spec, target in compiled_by(request.node) if isinstance(spec, DecodeSpec)}
    real = kernels.passes_at_open

    def passes_at_open(spec, target, serving_passes=True):
        passes = real(spec, target, serving_passes)
        return [p for p in passes if (p, target) in declared] if serving_passes is True else passes

    monkeypatch.setattr(kernels, "passes_at_open", passes_at_open)


def pytest_collection_finish(session):
    if not session.config.getoption("--no-prebuild") and not session.config.getoption("--collect-only"):
        _PREBUILD["tasks"] = list(dict.fromkeys(pair for item in session.items for pair in compiled_by(item)))
        if _PREBUILD["tasks"] and not xdist_worker(session.config):
            _announce(session.config, f"{len(_PREBUILD['tasks'])} artifacts")


#: What a run prints before its pre-build: without it a fresh clone's run shows nothing for minutes.
PREBUILD_NOTICE = ("pre-build: compiling the {what} the collected tests declare before the first test "
                   "(tests/conftest.py; the whole suite's from an empty cache: about 4 minutes on 2 cores)")


def _announce(config, what: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not _PREBUILD["announced"]:
        _PREBUILD["announced"] = True
        reporter.write_line(PREBUILD_NOTICE.format(what=what))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist's controller, as the first worker has collected: the pre-build's notice."""
    if not node.config.getoption("--no-prebuild"):
        _announce(node.config, "kernels")


def pytest_sessionfinish(session):
    if xdist_worker(session.config):  # to the controller (pytest_testnodedown)
        result = _PREBUILD["result"]
        session.config.workeroutput["prebuild"] = dict(
            compiled=result.compiled if result else None, seconds=result.seconds if result else 0.0,
            late=_PREBUILD["late"], opened=sorted(_PREBUILD["opened"]), declared=_declared())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: the workers' pre-build figures, summed for the summary line; a worker
    that died is named with its exit status (a signal's name: a SIGKILL leaves no traceback)."""
    report = getattr(node, "workeroutput", {}).get("prebuild")
    if report:
        _PREBUILD["workers"].append(report)
    if error:
        line = f"xdist worker {node.gateway.id} went down ({error}): {_exit_status(node)}"
        print(f"\n{line}", file=sys.stderr, flush=True)
        _PREBUILD["crashes"].append(line)


class _LoadGroupScheduling(LoadGroupScheduling):
    """xdist's ``--dist loadgroup`` scheduler, with a worker started after another died given work
    it can run. xdist's worker runs a test only once it knows the next one (or that none
    follows), and the scheduler gives a late worker one unit, a single test under loadgroup, then
    waits for it: the run stalled for good after a worker died (docs/test-suite.md, reproduced
    with a suite whose test kills its worker). Here a worker holds two tests whenever there are."""

    def _reschedule(self, node) -> None:
        super()._reschedule(node)
        while (not node.shutting_down and self.workqueue and node in self.assigned_work
               and self._pending_of(self.assigned_work[node]) < 2):
            self._assign_work_unit(node)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return _LoadGroupScheduling(config, log)


#: Tests whose worker died under them once: the scheduler runs each again on another worker
#: (loadgroup puts a dead worker's tests back in the queue), so the first death is reported as a
#: rerun ("R"), its worker's exit status printed; a second one fails the test.
_CRASHED: set = set()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    if crashitem not in _CRASHED:
        _CRASHED.add(crashitem)
        report.outcome = "rerun"


def pytest_report_teststatus(report):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})


def _exit_status(node) -> str:
    """How the worker process of xdist ``node`` ended, from its Popen (execnet's popen gateway)."""
    popen = getattr(getattr(node.gateway, "_io", None), "popen", None)
    if popen is None:
        return "exit status unknown"
    try:
        code = popen.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return "still running"
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _declared() -> list[str]:
    return [f"{target.tag}/{spec.name}" for spec, target in _PREBUILD["tasks"]]


def pytest_terminal_summary(terminalreporter):
    for line in _PREBUILD["crashes"]:
        terminalreporter.write_line(line)
    result, late, workers = _PREBUILD["result"], list(_PREBUILD["late"]), _PREBUILD["workers"]
    declared = set(_declared()).union(*(report.get("declared", ()) for report in workers))
    unopened = sorted(declared - _PREBUILD["opened"].union(*(report.get("opened", ()) for report in workers)))
    if result is not None:
        terminalreporter.write_line(f"pre-built {result.compiled + result.reused} artifacts ({result.compiled} "
                                    f"compiled) in {result.seconds:.0f} s")
    late += [name for report in workers for name in report["late"]]
    workers = [report for report in workers if report["compiled"] is not None]
    if workers:
        terminalreporter.write_line(f"pre-built: {sum(r['compiled'] for r in workers)} artifacts compiled by "
                                    f"{len(workers)} workers in {max(r['seconds'] for r in workers):.0f} s")
    if late:
        terminalreporter.write_line(f"compiled during the tests: {len(late)} artifacts no test declares "
                                    f"(tests/conftest.py), e.g. {', '.join(late[:3])}")
        if terminalreporter.config.option.verbose > 0:
            terminalreporter.write_line("\n".join(f"  late: {name}" for name in late))
    if unopened and terminalreporter.config.option.verbose > 0:  # declared, opened by no test in these processes
        terminalreporter.write_line(f"pre-built, never opened here: {len(unopened)} (a subprocess may open them)")
        terminalreporter.write_line("\n".join(f"  unopened: {name}" for name in unopened))


RECORD_DIR = os.environ.get("LINALG_PREFILL_RECORD_CASES")
_RECORDED = itertools.count()
# id(array) -> (array, how ``uniform`` drew it), kept while recording: a recorded call stores the
# draw (PCG64 state, shape, dtype) instead of the array, so a replay bundle stays small.
_UNIFORM_DRAWS: dict[int, tuple] = {}


def _recorded_argument(value):
    """A kernel argument as recorded: ("uniform", draw + sha1 of the array's bytes now) for arrays
    drawn by ``uniform`` (the replay redraws them and keeps the draw only when the bytes match),
    else ("value", value)."""
    drawn = _UNIFORM_DRAWS.get(id(value))
    if drawn is not None and drawn[0] is value:
        return "uniform", dict(drawn[1], sha1=hashlib.sha1(value.tobytes()).hexdigest())
    return "value", value


@pytest.fixture(autouse=True)
def record_backend_cases(request, monkeypatch):
    """With ``LINALG_PREFILL_RECORD_CASES=DIR``, every llvm-cpu kernel call of a test parametrized
    over BACKENDS is pickled into DIR as ``{test, spec, args}`` (``args``: see
    ``_recorded_argument``), so that
    ``bench/gpu_bundle.py --recorded DIR`` can replay the same calls on CUDA on a GPU machine, where
    the compiler these tests need cannot be installed (and check them against their error bound,
    runtime/error_model.py)."""
    directory = RECORD_DIR
    callspec = getattr(request.node, "callspec", None)
    if not directory or callspec is None or callspec.params.get("backend") != "llvm-cpu":
        return
    os.makedirs(directory, exist_ok=True)
    monkeypatch.setattr(examples, "uniform", uniform)  # the draws of runtime/examples.py are recorded too
    real_open_kernel = support.open_kernel

    def recording_open_kernel(spec, *args, **kwargs):
        kernel = real_open_kernel(spec, *args, **kwargs)

        def call(*call_args):
            case = dict(test=request.node.nodeid, spec=spec, args=[_recorded_argument(a) for a in call_args])
            with open(os.path.join(directory, f"case-{os.getpid()}-{next(_RECORDED):05d}.pkl"), "wb") as f:
                pickle.dump(case, f)
            return kernel(*call_args)

        return call

    for module in (request.module, support):  # the test's own calls and run_against_reference's
        if hasattr(module, "open_kernel"):
            monkeypatch.setattr(module, "open_kernel", recording_open_kernel)
    monkeypatch.setattr(support, "_KERNELS", {})  # kernels opened in this test record under its name


#: A folder for the session's artifact cache, kept after the run (a rerun compiles only what
#: changed; a test that starts pytest in a subprocess passes its own cache on), instead of a fresh
#: one under pytest's temporary folder.
TEST_CACHE_VARIABLE = "LINALG_PREFILL_TEST_CACHE"


@pytest.fixture(scope="session")
def cache(request, tmp_path_factory) -> ArtifactCache:
    """One cache for the session (shared by xdist's workers): each spec compiles once however many
    tests use it. ``LINALG_PREFILL_TEST_CACHE=DIR`` keeps it in DIR."""
    if os.environ.get(TEST_CACHE_VARIABLE):
        return ArtifactCache(os.environ[TEST_CACHE_VARIABLE])
    root = tmp_path_factory.getbasetemp()
    return ArtifactCache((root.parent if xdist_worker(request.config) else root) / "artifacts")


@pytest.fixture(scope="session", autouse=True)
def prebuilt(request, cache, tmp_path_factory):
    """The session's cache as the environment's, filled with every declared spec (module docstring)."""
    os.environ["LINALG_PREFILL_CACHE_DIR"] = str(cache.root)
    tasks = _PREBUILD["tasks"]
    if not tasks:
        return
    _PREBUILD["running"] = True
    try:
        worker = xdist_worker(request.config)
        if worker:
            claims = tmp_path_factory.getbasetemp().parent / "prebuild-claims"  # the run's, shared by its workers
            _PREBUILD["result"] = _fill_share(tasks, cache, claims, *worker)
        else:
            _PREBUILD["result"] = fill_cache(tasks, cache=cache, progress=False)
    except CompileError as err:  # the tests that need these compile them again and fail there
        warnings.warn(f"pre-build: {err}")
    finally:
        _PREBUILD["running"] = False


def _fill_share(tasks, cache: ArtifactCache, claims: Path, worker: int, workers: int):
    """One xdist worker's part of the pre-build, in this process: its share (every ``workers``-th
    bundle, largest first: kernels of one shape with their passes, compiled as one module), then
    the others' from the end.
    A worker claims a bundle before it builds its IR (a file named by the bundle's index in
    ``claims``, created exclusively) and passes over one another worker has claimed: it neither
    builds that bundle's IR again to look it up in the cache nor waits on a compile in progress."""
    start = time.perf_counter()
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, rank_cpus(worker, workers))  # its compiles, one at a time, on its CPUs (pytest_configure)
    claims.mkdir(exist_ok=True)
    bundles = list(enumerate(bundle_tasks(tasks, by_shape=True)))
    own = bundles[worker::workers]
    rest = [bundle for bundle in bundles if bundle[0] % workers != worker][::-1]
    compiled = taken = 0
    try:
        for index, (target, specs) in own + rest:
            try:
                os.close(os.open(claims / str(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
            taken += len(specs)
            try:
                compiled += sum(ran for _, ran in cached_bundle(specs, target, cache))
            except CompileError as err:
                warnings.warn(f"pre-build of {', '.join(spec.name for spec in specs)} for {target.tag}: {err}")
    finally:
        os.sched_setaffinity(0, allowed)
    return CacheFill(compiled, taken - compiled, time.perf_counter() - start)


def uniform(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    """runtime/examples.py's inputs in [-1, 1) in the kernel dtype, their draws recorded when
    recording."""
    state = rng.bit_generator.state if RECORD_DIR else None
    drawn = _uniform(rng, shape, dtype)
    if RECORD_DIR and isinstance(rng.bit_generator, np.random.PCG64):
        _UNIFORM_DRAWS[id(drawn)] = (drawn, dict(state=state, shape=list(np.shape(drawn)), dtype=dtype))
    return drawn
