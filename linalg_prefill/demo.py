"""``linalg-prefill demo``: build the kernels, run them on the CPU against the reference, print a table."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from .mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from .runtime import open_kernel, reference
from .runtime.checks import NUMPY_DTYPES
from .runtime.examples import page_table, uniform
from .runtime.compare import error_bound
from .runtime.kernels import passes_at_open
from .pipeline import default_cache
from .pipeline.artifacts import fill_cache
from .pipeline.compiler import keyed_ir
from .pipeline.targets import BACKENDS, Target


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

    yield from _kv_cache_cases(rng)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _kv_cache_cases(rng):
    """Ragged self-attention of new tokens, paged (± sliding window) prefix, and MLA, with RoPE."""
    new_lens, prefix_lens = [37, 128, 5], [100, 0, 300]
    q_indptr = np.concatenate([[0], np.cumsum(new_lens)]).astype(np.int32)
    q_pos = np.concatenate([p + np.arange(n) for p, n in zip(prefix_lens, new_lens)]).astype(np.int32)

    ragged = RaggedPrefillSpec(32, 8, 128, 128, "float16", LLAMA3)
    dt = NUMPY_DTYPES[ragged.dtype]
    q = rng.uniform(-1, 1, (int(q_indptr[-1]), 32, 128)).astype(dt)
    k = rng.uniform(-1, 1, (int(q_indptr[-1]), 8, 128)).astype(dt)
    v = rng.uniform(-1, 1, (int(q_indptr[-1]), 8, 128)).astype(dt)
    offsets = np.array(prefix_lens, np.int32)
    args = (q, q_indptr, k, v, q_indptr, q_pos, offsets, 1, 1, 1.0, 5e5, 128 ** -0.5)
    yield ragged, args, reference.batch_prefill_ragged_kv(*args, rope_scaling=LLAMA3)

    for sliding in (False, True):
        paged = PagedPrefillSpec(32, 8, 128, "float32", page_size=16, rope_scaling=LLAMA3, sliding_window=sliding)
        physical = [n + 6 if sliding and n else n for n in prefix_lens]  # 6 evicted rows after 2 sinks
        table = page_table(rng, physical, 16, window=[(8, 2)] * 3 if sliding else None)
        pages = uniform(rng, (table.num_pages, 2, 8, 16, 128), "float32")
        qf = q.astype(np.float32)
        args = (qf, q_indptr, pages, table.page_indptr, table.page_values, table.length_info,
                np.zeros(3, np.int32), q_pos, 0, 1, 1.0, 5e5, 128 ** -0.5)
        yield paged, args, reference.batch_prefill_paged_kv(*args, rope_scaling=LLAMA3, sliding_window=sliding)

    mla = MlaPagedPrefillSpec(16, 512, 64, "bfloat16", page_size=64)
    dt = NUMPY_DTYPES[mla.dtype]
    table = page_table(rng, prefix_lens, 64)
    pages = uniform(rng, (table.num_pages, 64, 576), mla.dtype)
    q = rng.uniform(-1, 1, (int(q_indptr[-1]), 16, 576)).astype(dt)
    args = (q, q_indptr, pages, table.page_indptr, table.page_values, table.length_info, 0, 192 ** -0.5)
    yield mla, args, reference.batch_prefill_paged_kv_mla(*args, d_latent=512)


def run_demo(backends: tuple[str, ...] | None = None) -> int:
    """Builds every demo variant for ``backends`` (names in pipeline/targets.py: BACKENDS, default
    all), runs those of the backends that run on the host CPU; returns an exit code."""
    backends = tuple(BACKENDS) if backends is None else backends
    rows = []
    failures = runs = 0
    cases = list(_demo_cases())
    built = build_all([spec for spec, _, _ in cases], backends)
    total = len(cases) * len(backends)
    for spec, args, (want_out, want_lse) in cases:
        for backend in backends:
            print(f"[{len(rows) + 1}/{total}] {spec.symbol} ({spec.dtype}) for {backend}", file=sys.stderr, flush=True)
            target = Target(backend)
            if not target.record.on_host:
                rows.append((spec.name, backend, _shapes(args), f"built only (no {target.driver} run here)", "-", "-"))
                continue
            runs += 1
            kernel = open_kernel(spec, backend)
            kernel(*args)  # warm up
            t0 = time.perf_counter()
            out, lse = kernel(*args)
            run_ms = (time.perf_counter() - t0) * 1e3
            bound = error_bound(spec, args, (want_out, want_lse))  # runtime/error_model.py
            valid = bound.valid  # rows with a valid key (the others are exact)
            err = float(np.max(np.abs(out.astype(np.float64) - want_out), initial=0.0))
            lse_err = float(np.max(np.abs(lse - want_lse)[valid], initial=0.0))
            ratio = bound.worst((out, lse), (want_out, want_lse))
            failures += not bound.holds((out, lse), (want_out, want_lse))
            rows.append((spec.name, backend, _shapes(args), f"{err:.2e} / {lse_err:.2e}", f"{ratio:.3f}",
                         f"{run_ms:.1f}"))
    header = ("variant", "backend", "shapes", "max err out / lse", "err/bound", "run ms")
    _print_table(header, rows)
    print(f"\n{len(rows)} builds ({built}), {runs} CPU runs checked against the float64 reference; "
          f"{'all within their error bounds' if not failures else f'{failures} OUT OF BOUND'}.")
    return 1 if failures else 0


def build_all(specs, backends) -> str:
    """Compiles ``specs`` for ``backends``, with the serving passes the host's kernels open
    with, into the environment's cache, the missing ones at once in one process per core
    (pipeline.artifacts.fill_cache: a cold demo on 2 cores of an Intel Xeon took 56.6 s one
    kernel after another, 36.1 s so); returns what it did, in words."""
    tasks = []
    for backend in backends:
        target = Target(backend)
        for spec in specs:
            passes = passes_at_open(spec, target) if target.record.on_host else []
            tasks += [(member, target) for member in (spec, *passes)]
    cache = default_cache()
    missing = [(spec, target) for spec, target in tasks if cache.cached(spec, target, keyed_ir(spec, target)) is None]
    if not missing:
        return f"{len(tasks)} artifacts from the cache"
    jobs = os.cpu_count() or 1
    # A cold build compiles for a minute or more: say what is happening (stderr keeps stdout a table).
    print(f"building {len(missing)} of {len(tasks)} artifacts on {min(jobs, len(missing))} processes "
          f"(cache: {cache.root})", file=sys.stderr, flush=True)
    fill = fill_cache(missing, jobs=jobs, cache=cache)
    return f"{fill.compiled} artifacts compiled in {fill.seconds:.1f} s, {len(tasks) - fill.compiled} from the cache"


def _shapes(args) -> str:
    """The shapes of the array arguments: q first, then the KV (or pages) argument."""
    arrays = [a for a in args if isinstance(a, np.ndarray)]
    return " ".join("x".join(map(str, a.shape)) for a in arrays[:4])


def _print_table(header, rows) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
