"""``linalg-prefill demo``: build the kernels, run them on the CPU against the reference, print a table."""

from __future__ import annotations

import time

import numpy as np

from ..mlir import MaskedSequencePrefillSpec, SequencePrefillSpec
from ..runtime import open_kernel, reference
from ..runtime.checks import NUMPY_DTYPES
from .compiler import compile
from .targets import Target


def _demo_cases():
    """(spec, inputs builder, reference call) for each variant shown in the demo."""
    rng = np.random.default_rng(0)

    def dense(spec, batch, qo_len, kv_len):
        dt = NUMPY_DTYPES[spec.dtype]
        q = rng.uniform(-1, 1, (batch, qo_len, spec.h_q, spec.d)).astype(dt)
        k = rng.uniform(-1, 1, (batch, kv_len, spec.h_kv, spec.d)).astype(dt)
        v = rng.uniform(-1, 1, (batch, kv_len, spec.h_kv, spec.d)).astype(dt)
        return q, k, v

    seq = SequencePrefillSpec(32, 8, 128, "float32", causal=True, sm_scale=128 ** -0.5)
    q, k, v = dense(seq, 2, 256, 512)
    yield seq, (q, k, v), reference.batch_sequence_prefill_kv(q, k, v, causal=True, sm_scale=seq.sm_scale)

    seq16 = SequencePrefillSpec(32, 8, 128, "bfloat16", causal=True, sm_scale=128 ** -0.5)
    q, k, v = dense(seq16, 1, 200, 200)
    yield seq16, (q, k, v), reference.batch_sequence_prefill_kv(q, k, v, causal=True, sm_scale=seq16.sm_scale)

    for mode in ("padded", "causal_padded_left"):
        masked = MaskedSequencePrefillSpec(8, 2, 64, "float16", mask_mode=mode, sm_scale=0.125)
        q, k, v = dense(masked, 3, 64, 64)
        lens = np.array([64, 17, 0], np.int32)
        want = reference.batch_sequence_prefill_kv_masked(q, k, v, lens, mask_mode=mode, sm_scale=0.125)
        yield masked, (q, k, v, lens), want


def run_demo(backends=("llvm-cpu", "cuda")) -> int:
    """Builds every demo variant for ``backends``, runs the llvm-cpu ones; returns an exit code."""
    rows = []
    failures = 0
    for spec, args, (want_out, want_lse) in _demo_cases():
        for backend in backends:
            t0 = time.perf_counter()
            compile(spec, Target(backend))
            build_s = time.perf_counter() - t0
            if backend != "llvm-cpu":
                rows.append((spec.name, backend, _shapes(args), "built only (no GPU run here)", f"{build_s:.1f}", "-"))
                continue
            kernel = open_kernel(spec, backend)
            kernel(*args)  # warm up
            t0 = time.perf_counter()
            out, lse = kernel(*args)
            run_ms = (time.perf_counter() - t0) * 1e3
            err = float(np.max(np.abs(out.astype(np.float64) - want_out)))
            lse_err = float(np.max(np.abs(lse - want_lse)))
            failures += err > {"float32": 1e-4}.get(spec.dtype, 2e-2)
            rows.append((spec.name, backend, _shapes(args), f"{err:.2e} / {lse_err:.2e}", f"{build_s:.1f}", f"{run_ms:.1f}"))
    header = ("variant", "backend", "shapes", "max err out / lse", "build s", "run ms")
    _print_table(header, rows)
    print(f"\n{len(rows)} builds, {sum(r[1] == 'llvm-cpu' for r in rows)} CPU runs checked against the float64 reference; "
          f"{'all within tolerance' if not failures else f'{failures} OUT OF TOLERANCE'}.")
    return 1 if failures else 0


def _shapes(args) -> str:
    return " ".join("x".join(map(str, a.shape)) for a in args)


def _print_table(header, rows) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
