"""One seed-ABI call on several backends, each compared with the float64 reference and the others.

    report = compare_backends(spec, example_inputs(spec, np.random.default_rng(0)))  # runtime/examples.py
    print(report.table())     # max errors per backend, pairwise differences, skipped backends
    assert report.ok          # every element within the call's error bound (runtime/error_model.py)
"""

from __future__ import annotations

import inspect
import itertools
import numbers
from dataclasses import dataclass

import numpy as np

from ..mlir.abi import argument_names, ordered
from ..mlir.dtypes import quantized_kv
from ..pipeline import BACKENDS, ArtifactCache, target_for
from . import reference
from .checks import as_array, on_host
from .devices import device_available
from .error_model import CallFacts, ErrorBound, bound_of_call
from .kernels import open_kernel
from .kv_quant import dequantized_call
from .variants import reference_options, variant

__all__ = ["BackendResult", "ComparisonReport", "compare_backends", "reference_call",
           "reference_for"]

@dataclass(frozen=True)
class BackendResult:
    """One backend's run: max abs errors over the rows that have a valid key (reference lse !=
    -5e4), the largest error / bound of any element of those rows (``bound_ratio``, output and
    lse; at most 1 within the call's error bound, runtime/error_model.py), and whether the other
    rows are exactly output 0 / lse -5e4 (§11.3); or why it was skipped."""

    backend: str
    output_error: float | None = None
    lse_error: float | None = None
    empty_rows_exact: bool | None = None
    skipped: str | None = None
    bound_ratio: tuple[float, float] | None = None

    @property
    def within_bound(self) -> bool:
        return self.bound_ratio is not None and all(ratio <= 1.0 for ratio in self.bound_ratio)  # NaN is not

    @property
    def ok(self) -> bool:
        """Skipped, or every error within the bound and the empty rows exact."""
        return self.skipped is not None or bool(self.within_bound and self.empty_rows_exact)


@dataclass(frozen=True)
class ComparisonReport:
    """``results`` in backend order; ``bound``: the call's ErrorBound; ``pairwise``: (backend a,
    backend b, max |output a - output b|, max |lse a - lse b|) over all rows, for every pair of
    backends that ran."""

    spec: object
    bound: ErrorBound
    results: tuple[BackendResult, ...]
    pairwise: tuple[tuple[str, str, float, float], ...]

    @property
    def ok(self) -> bool:
        return all(result.ok for result in self.results)

    @property
    def ran(self) -> tuple[str, ...]:
        return tuple(result.backend for result in self.results if result.skipped is None)

    def result(self, backend: str) -> BackendResult:
        return next(result for result in self.results if result.backend == backend)

    def table(self) -> str:
        rows = []
        for r in self.results:
            if r.skipped is not None:
                rows.append((r.backend, "-", "-", "-", "-", f"skipped: {r.skipped}"))
            else:
                rows.append((r.backend, f"{r.output_error:.2e}", f"{r.lse_error:.2e}",
                             f"{np.max(r.bound_ratio):.3f}", "exact" if r.empty_rows_exact else "WRONG",
                             "ok" if r.ok else "OUT OF BOUND"))
        rows += [(f"{a} vs {b}", f"{out:.2e}", f"{lse:.2e}", "", "", "difference") for a, b, out, lse in self.pairwise]
        valid = self.bound.valid
        title = (f"{self.spec.name} ({self.spec.dtype}; error bound per element, runtime/error_model.py: output up to "
                 f"{np.max(self.bound.output[valid], initial=0.0):.2e}, lse up to "
                 f"{np.max(self.bound.lse[valid], initial=0.0):.2e})")
        header = ("backend", "output err", "lse err", "err/bound", "empty rows", "status")
        return title + "\n" + _format_table(header, rows)


def compare_backends(spec, args, backends=None, *, cache: ArtifactCache | None = None,
                     artifacts=None) -> ComparisonReport:
    """Runs the seed-ABI call ``args`` of ``spec`` on each backend whose device exists (``backends``:
    default every backend of pipeline/targets.py: BACKENDS).

    A backend is a name (``"cuda"``) or a :class:`Target` (reported by its tag, so two archs of one
    backend can be compared). Kernels come from ``artifacts`` (backend name -> :class:`ArtifactSet`)
    where given, else are compiled through ``cache``. A backend without a device is recorded as
    skipped, with the reason. Each is held to the call's error bound (runtime/error_model.py).
    """
    args = tuple(a if isinstance(a, numbers.Number) else as_array(f"args[{i}]", a) for i, a in enumerate(args))
    want = want_out, want_lse = reference_for(spec, args)
    bound = error_bound(spec, args, want)
    valid = bound.valid
    results, runs = [], {}
    for backend in tuple(BACKENDS) if backends is None else backends:
        name, driver = backend if isinstance(backend, str) else backend.tag, target_for(backend).driver
        if not device_available(driver):
            results.append(BackendResult(name, skipped=f"no {driver} device here"))
            continue
        kernel = (artifacts[name].kernel(spec) if artifacts and name in artifacts
                  else open_kernel(spec, backend, cache=cache))
        out, lse = (np.asarray(x, np.float64) for x in kernel(*args))
        runs[name] = out, lse
        results.append(BackendResult(
            name, _max_abs(out[valid], want_out[valid]), _max_abs(lse[valid], want_lse[valid]),
            bool(np.all(out[~valid] == 0) and np.all(lse[~valid] == reference.EMPTY_ROW_LSE)),
            bound_ratio=bound.ratio((out, lse), want)))
    pairwise = tuple((a, b, _max_abs(runs[a][0], runs[b][0]), _max_abs(runs[a][1], runs[b][1]))
                     for a, b in itertools.combinations(runs, 2))
    return ComparisonReport(spec, bound, tuple(results), pairwise)


def reference_call(spec) -> tuple[str, dict]:
    """The ``runtime.reference`` function that evaluates ``spec``'s seed-ABI calls and the keyword
    arguments (plain JSON values) that carry the spec's compile-time choices to it."""
    return variant(spec).reference.__name__, reference_options(spec)


def reference_for(spec, args) -> tuple[np.ndarray, np.ndarray]:
    """The float64 (output, lse) of the seed-ABI call ``args`` (in the table's order) for ``spec``
    (runtime.reference): every argument by its table name (a serving pass's reference takes
    them in order); an 8-bit KV cache's, that of the call with its cache dequantised
    (runtime/kv_quant.py)."""
    if quantized_kv(spec):
        spec, args = dequantized_call(spec, args)
    reference = variant(spec).reference
    parameters = inspect.signature(reference).parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):  # a serving pass's: every argument in order
        return reference(*args, **reference_options(spec))
    return reference(**dict(zip(argument_names(spec), args, strict=True)), **reference_options(spec))


def call_facts(spec) -> CallFacts:
    """What runtime/error_model.py needs of ``spec`` (a variant or a serving pass)."""
    rope_scaling = getattr(spec, "rope_scaling", None)
    return CallFacts(spec.dtype, spec.kv_layout, spec.d_v, sm_scale=getattr(spec, "sm_scale", None),
                     logits_soft_cap=spec.logits_soft_cap, rope_scaling=dict(rope_scaling) if rope_scaling else None,
                     rotary_dim=getattr(spec, "rotary_dim", None), kv_tile=getattr(spec, "kv_tile", None))


def error_bound(spec, args, want=None) -> ErrorBound:
    """The error bound (runtime/error_model.py) of the seed-ABI call ``args`` of ``spec``;
    ``want``: its reference_for, computed when not given. An 8-bit KV cache's: the compute
    dtype's on the dequantised cache (runtime/kv_quant.py)."""
    if quantized_kv(spec):
        spec, args = dequantized_call(spec, tuple(on_host(a) for a in args))
    named = {name: value if isinstance(value, numbers.Number) else as_array(name, on_host(value))
             for name, value in zip(argument_names(spec), args)}
    return bound_of_call(named, call_facts(spec), lambda call: reference_for(spec, ordered(spec, call)), want)


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b), initial=0.0))


def _format_table(header: tuple, rows: list) -> str:
    """Left-aligned columns, a dashed rule under the header."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [header, tuple("-" * w for w in widths), *rows]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)
