"""One seed-ABI call on several backends, each compared with the float64 reference and the others.

    report = compare_backends(spec, example_inputs(spec, np.random.default_rng(0)))
    print(report.table())     # max errors per backend, pairwise differences, skipped backends
    assert report.ok          # every error within runtime/tolerance.py's bound for the call
"""

from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass

import numpy as np

from ..mlir.decode import DecodeSpec
from ..mlir.specs import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from ..pipeline import ArtifactCache, target_for
from . import reference
from .checks import NUMPY_DTYPES, as_array
from .devices import device_available
from .kernels import open_kernel
from .kv_checks import natural_positions
from .tolerance import applies_rope, excess, tolerances

__all__ = ["BackendResult", "ComparisonReport", "compare_backends", "example_inputs", "reference_call",
           "reference_for"]

# (qo_len, kv_len) per entry of the KV-cache examples: causal rows with no key, several pages, a
# single row, an entry with no KV.
EXAMPLE_ENTRIES = ((5, 3), (12, 40), (1, 9), (3, 0))


@dataclass(frozen=True)
class BackendResult:
    """One backend's run: max abs errors over the rows that have a valid key (reference lse !=
    -5e4), whether every element of those rows is within the report's tolerance
    (runtime/tolerance.py), and whether the other rows are exactly output 0 / lse -5e4 (§11.3);
    or why it was skipped."""

    backend: str
    output_error: float | None = None
    lse_error: float | None = None
    empty_rows_exact: bool | None = None
    skipped: str | None = None
    within_tolerance: bool | None = None

    @property
    def ok(self) -> bool:
        """Skipped, or every error within tolerance and the empty rows exact."""
        return self.skipped is not None or bool(self.within_tolerance and self.empty_rows_exact)


@dataclass(frozen=True)
class ComparisonReport:
    """``results`` in backend order; ``tolerance``: ((atol, rtol) output, (atol, rtol) lse);
    ``pairwise``: (backend a, backend b, max |output a - output b|, max |lse a - lse b|) over all
    rows, for every pair of backends that ran."""

    spec: object
    tolerance: tuple
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
                rows.append((r.backend, "-", "-", "-", f"skipped: {r.skipped}"))
            else:
                rows.append((r.backend, f"{r.output_error:.2e}", f"{r.lse_error:.2e}",
                             "exact" if r.empty_rows_exact else "WRONG",
                             "ok" if r.ok else "OUT OF TOLERANCE"))
        rows += [(f"{a} vs {b}", f"{out:.2e}", f"{lse:.2e}", "", "difference") for a, b, out, lse in self.pairwise]
        (out_atol, out_rtol), (lse_atol, lse_rtol) = self.tolerance
        title = (f"{self.spec.name} ({self.spec.dtype}, tolerance atol {out_atol:g} + rtol {out_rtol:g} output, "
                 f"atol {lse_atol:g} + rtol {lse_rtol:g} lse)")
        return title + "\n" + _format_table(("backend", "output err", "lse err", "empty rows", "status"), rows)


def compare_backends(spec, args, backends=("llvm-cpu", "cuda"), *, cache: ArtifactCache | None = None,
                     artifacts=None) -> ComparisonReport:
    """Runs the seed-ABI call ``args`` of ``spec`` on each backend whose device exists.

    A backend is a name (``"cuda"``) or a :class:`Target` (reported by its tag, so two archs of one
    backend can be compared). Kernels come from ``artifacts`` (backend name -> :class:`ArtifactSet`)
    where given, else are compiled through ``cache``. A backend without a device is recorded as
    skipped, with the reason.
    """
    args = tuple(a if isinstance(a, numbers.Number) else as_array(f"args[{i}]", a) for i, a in enumerate(args))
    want_out, want_lse = reference_for(spec, args)
    valid = want_lse != reference.EMPTY_ROW_LSE
    out_tolerance, lse_tolerance = tolerance = tolerances(spec.dtype, applies_rope(spec, args))
    results, runs = [], {}
    for backend in backends:
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
            within_tolerance=excess(out[valid], want_out[valid], out_tolerance) <= 0
            and excess(lse[valid], want_lse[valid], lse_tolerance) <= 0))
    pairwise = tuple((a, b, _max_abs(runs[a][0], runs[b][0]), _max_abs(runs[a][1], runs[b][1]))
                     for a, b in itertools.combinations(runs, 2))
    return ComparisonReport(spec, tolerance, tuple(results), pairwise)


def reference_call(spec) -> tuple[str, dict]:
    """The ``runtime.reference`` function that evaluates ``spec``'s seed-ABI calls and the keyword
    arguments (plain JSON values) that carry the spec's compile-time choices to it."""
    extras = dict(logits_soft_cap=spec.logits_soft_cap) if getattr(spec, "logits_soft_cap", 0.0) else {}
    if getattr(spec, "rotary_dim", None) is not None:
        extras["rotary_dim"] = spec.rotary_dim
    if isinstance(spec, SequencePrefillSpec):
        return "batch_sequence_prefill_kv", dict(causal=spec.causal, sm_scale=spec.sm_scale, **extras)
    if isinstance(spec, MaskedSequencePrefillSpec):
        return "batch_sequence_prefill_kv_masked", dict(mask_mode=spec.mask_mode, sm_scale=spec.sm_scale, **extras)
    if isinstance(spec, RaggedPrefillSpec):
        return "batch_prefill_ragged_kv", dict(rope_scaling=dict(spec.rope_scaling), **extras)
    if isinstance(spec, PagedPrefillSpec):
        return "batch_prefill_paged_kv", dict(rope_scaling=dict(spec.rope_scaling),
                                              sliding_window=spec.sliding_window, **extras)
    if isinstance(spec, MlaPagedPrefillSpec):
        return "batch_prefill_paged_kv_mla", dict(d_latent=spec.d_latent, sliding_window=spec.sliding_window, **extras)
    if isinstance(spec, DecodeSpec):
        kind = {RaggedPrefillSpec: "ragged", PagedPrefillSpec: "paged", MlaPagedPrefillSpec: "mla"}[type(spec.base)]
        base_extras = dict(logits_soft_cap=spec.base.logits_soft_cap) if spec.base.logits_soft_cap else {}
        return "decode_entries", dict(kind=kind, group=spec.base.group_size, block=spec.block, d_v=spec.d_v,
                                      sliding_window=getattr(spec.base, "sliding_window", False), **base_extras)
    raise TypeError(f"spec: unsupported spec type {type(spec).__name__}")


def reference_for(spec, args) -> tuple[np.ndarray, np.ndarray]:
    """The float64 (output, lse) of the seed-ABI call ``args`` for ``spec`` (runtime.reference)."""
    name, kwargs = reference_call(spec)
    return getattr(reference, name)(*args, **kwargs)


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b), initial=0.0))


def _format_table(header: tuple, rows: list) -> str:
    """Left-aligned columns, a dashed rule under the header."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [header, tuple("-" * w for w in widths), *rows]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


# ----------------------------------------------------------------------------- example inputs


def example_inputs(spec, rng: np.random.Generator, entries=EXAMPLE_ENTRIES) -> tuple:
    """A valid seed-ABI call for ``spec`` (values in [-1, 1), causal, RoPE on where it exists).

    ``entries``: (qo_len, kv_len) per batch entry. KV-cache variants get random RoPE offsets and
    shuffled pages with unused ones; sliding-window entries keep 2 sinks and evict 5 rows. The
    dense variants take B = len(entries) and the first entry's lengths; the default entries give
    dense B=2, qo_len 20 > kv_len 17, and masked B=3, length 16, valid_lens [16, 5, 0].
    """
    default = entries is EXAMPLE_ENTRIES
    batch, qo_len, kv_len = (2, 20, 17) if default else (len(entries), *entries[0])
    if isinstance(spec, SequencePrefillSpec):
        return (_uniform(rng, spec, (batch, qo_len, spec.h_q, spec.d)),
                *(_uniform(rng, spec, (batch, kv_len, spec.h_kv, spec.d)) for _ in range(2)))
    if isinstance(spec, MaskedSequencePrefillSpec):
        batch, length = (3, 16) if default else (batch, min(qo_len, kv_len))
        q, k, v = (_uniform(rng, spec, (batch, length, h, spec.d)) for h in (spec.h_q, spec.h_kv, spec.h_kv))
        valid = [16, 5, 0] if default else [length] * batch
        return q, k, v, np.array(valid, np.int32)
    qo_lens, kv_lens = (np.array(x, np.int64) for x in zip(*entries))
    q_indptr = _indptr(qo_lens)
    rows = int(q_indptr[-1])
    if isinstance(spec, RaggedPrefillSpec):
        q = _uniform(rng, spec, (rows, spec.h_q, spec.d_qk))
        k = _uniform(rng, spec, (int(kv_lens.sum()), spec.h_kv, spec.d_qk))
        v = _uniform(rng, spec, (int(kv_lens.sum()), spec.h_kv, spec.d_v))
        q_pos, k_off = _example_positions(rng, q_indptr, qo_lens, kv_lens)
        return (q, q_indptr, k, v, _indptr(kv_lens), q_pos, k_off, *_example_scalars(spec.d_qk))
    page_table = _example_pages(rng, spec, kv_lens)
    if isinstance(spec, PagedPrefillSpec):
        q = _uniform(rng, spec, (rows, spec.h_q, spec.d))
        q_pos, k_off = _example_positions(rng, q_indptr, qo_lens, kv_lens)
        return (q, q_indptr, *page_table, k_off, q_pos, *_example_scalars(spec.d))
    if isinstance(spec, MlaPagedPrefillSpec):
        q = _uniform(rng, spec, (rows, spec.h_q, spec.d_qk))
        return (q, q_indptr, *page_table, 1, spec.d_qk ** -0.5)
    raise TypeError(f"spec: unsupported spec type {type(spec).__name__}")


def _uniform(rng, spec, shape) -> np.ndarray:
    return rng.uniform(-1.0, 1.0, shape).astype(NUMPY_DTYPES[spec.dtype])


def _indptr(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _example_positions(rng, q_indptr, qo_lens, kv_lens) -> tuple[np.ndarray, np.ndarray]:
    """Natural positions (queries at the end of their entry's KV) after a random offset per entry."""
    k_off = (rng.integers(0, 64, len(kv_lens)) + np.maximum(qo_lens - kv_lens, 0)).astype(np.int32)
    return natural_positions(q_indptr, kv_lens, k_rope_pos_offset=k_off)


def _example_scalars(dim: int) -> tuple:
    """causal 1, RoPE on (when ``dim`` is even), rope_scale 1, rope_theta 1e4, sm_scale dim^-0.5."""
    return 1, 1 - dim % 2, 1.0, 1e4, dim ** -0.5


def _example_pages(rng, spec, kv_lens) -> tuple:
    """(pages, page_indptr, page_values, length_info) holding ``kv_lens`` logical rows per entry,
    with shuffled page ids and 2 unused pages. Pages are [P, 2, h_kv, page_size, d] (paged) or
    [P, page_size, d_qk] (MLA)."""
    if spec.sliding_window:
        sink = np.minimum(kv_lens, 2)
        physical = np.where(kv_lens > 0, kv_lens + 5, 0)  # 5 evicted rows after the sinks
    else:
        physical = kv_lens
    page_indptr = _indptr(-(-physical // spec.page_size))
    nnz = int(page_indptr[-1])
    page_values = rng.permutation(nnz + 2)[:nnz].astype(np.int32)
    last = np.where(physical > 0, (physical - 1) % spec.page_size + 1, 1)
    length_info = np.stack([last, sink + 5, sink]) if spec.sliding_window else last
    row = (2, spec.h_kv, spec.page_size, spec.d) if isinstance(spec, PagedPrefillSpec) else (spec.page_size, spec.d_qk)
    pages = _uniform(rng, spec, (nnz + 2, *row))
    return pages, page_indptr, page_values, np.ascontiguousarray(length_info, np.int32)
