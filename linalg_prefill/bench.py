"""``linalg-prefill bench``: time every artifact of a build folder, and torch SDPA on the same work.

Each variant runs one prefill from an empty cache: ``batch`` entries of ``tokens`` query tokens
against as many keys (dense variants: B = batch, qo_len = kv_len = tokens), causal except for a
non-causal dense spec and the right-padded mask. GFLOP/s count the unmasked query-key pairs only:
2 · pairs · h_q · (d_qk + d_v). When torch is installed, its ``scaled_dot_product_attention``
(CPU, same causality, ``enable_gqa=True``, one call per entry,
the threads torch was given) runs the same attention in the same process; ``ratio`` is torch's
time over ours (above 1: we are faster). Times are the best of ``repeat`` calls after one warm-up.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from .pipeline.cpu_tiles import AMX_FEATURES, host_cpu_features


@dataclass(frozen=True)
class BenchRow:
    """One variant on one backend; ``torch_ms``/``ratio`` are None when torch did not run."""

    variant: str
    backend: str
    dtype: str
    batch: int
    tokens: int
    ours_ms: float
    gflops: float
    torch_ms: float | None
    ratio: float | None


def cpu_description() -> str:
    """The CPU a bench's figures are from, for its first line: /proc/cpuinfo's model name and
    model number, the widest x86 vector extension, whether it has AMX tiles (the x86 lowering's
    condition, pipeline/cpu_tiles.py) and the cores, e.g. ``Intel(R) Xeon(R) Processor (model
    207; avx512, AMX yes; 2 cores)``."""
    fields: dict = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = host_cpu_features()
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    amx = "yes" if AMX_FEATURES <= flags else "no"
    return (f"{fields.get('model name', 'unknown CPU')} (model {fields.get('model', '?')}; {isa}, AMX {amx}; "
            f"{os.cpu_count()} cores)")


def is_causal(spec) -> bool:
    """Whether the benchmarked call is causal: the dense spec's choice (the right-padded mask is
    not), causal=1 for the KV-cache variants."""
    return getattr(spec, "causal", True)


def attention_flops(spec, batch: int, tokens: int) -> float:
    """FLOPs of the unmasked pairs of ``batch`` prefills of ``tokens`` (qo_len = kv_len)."""
    pairs = tokens * (tokens + 1) // 2 if is_causal(spec) else tokens * tokens
    return 2.0 * batch * pairs * spec.h_q * (spec.d_qk + spec.d_v)


def best_time(fn, repeat: int) -> float:
    """Seconds of the fastest of ``repeat`` calls of ``fn`` after one warm-up call."""
    return best_times([fn], repeat)[0]


#: Seconds :func:`best_times` sleeps before each burst.
SETTLE_S = 0.01


def best_times(fns, repeat: int, burst: int = 1, settle_s: float = SETTLE_S) -> list[float]:
    """Seconds of the fastest call of each of ``fns`` over ``repeat`` rounds, after one warm-up
    call each. Each round runs every fn ``burst`` times in a row, fn after fn, so that a slow phase
    of a noisy machine hits every contender rather than whichever ran during it.

    Use bursts of some tens of calls for calls under a few milliseconds: right after another
    library's call, a call finds its own worker threads asleep and the other's still spinning
    (torch's small prefill halves in bursts; ours took 10 calls of 0.6 ms to recover:
    docs/performance.md, timing in bursts). Before each burst the process sleeps ``settle_s``,
    longer than torch's OpenMP workers spin after a parallel region (3-4 ms here), so that a
    contender timed after torch does not share its CPUs with them: a dense bf16 call of 1024
    tokens took 10.7 ms right after SDPA and 8.9 after another of ours (IREE's workers do not
    spin, so torch's calls paid nothing the other way; docs/performance.md, tenth session).
    """
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, spent in zip(fns, times):
            time.sleep(settle_s)
            for _ in range(burst):
                start = time.perf_counter()
                fn()
                spent.append(time.perf_counter() - start)
    return [min(spent) for spent in times]


def torch_allocated(array: np.ndarray) -> np.ndarray:
    """``array`` copied into memory torch's CPU allocator gives (a large tensor's data starts 64
    bytes into a 4 KiB page; numpy's, 16 bytes in), as a numpy array of its shape and dtype: the
    KV pool a serving stack hands the kernels is a torch tensor. With numpy's 16 bytes, the last
    row of each 4 KiB run of a page's head rows ends past a 4 KiB boundary, and a load across one
    cost a Zen 4's bf16 decode pass 5-17% (docs/performance.md, twenty-second session)."""
    import torch

    data = torch.empty(array.nbytes, dtype=torch.uint8).numpy().view(array.dtype).reshape(array.shape)
    data[...] = array
    return data


def torch_sdpa(spec, batch: int, tokens: int, rng: np.random.Generator):
    """A callable running torch SDPA on the variant's attention (None without torch)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    from .mlir.kv_layouts import CacheLayout

    h_q, h_kv, d_qk, d_v = spec.h_q, spec.h_kv, spec.d_qk, spec.d_v
    dtype = getattr(torch, spec.dtype)
    calls, rows = (batch, 1) if isinstance(spec.layout, CacheLayout) else (1, batch)

    def tensor(heads, dim):
        return torch.from_numpy(rng.uniform(-1, 1, (rows, heads, tokens, dim)).astype(np.float32)).to(dtype)

    inputs = [(tensor(h_q, d_qk), tensor(h_kv, d_qk), tensor(h_kv, d_v)) for _ in range(calls)]
    causal = is_causal(spec)

    def run():
        for q, k, v in inputs:
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, scale=d_qk ** -0.5)

    return run


def bench_artifacts(out_dir: str, backends: list[str], *, tokens: int, batch: int, repeat: int,
                    seed: int = 0, log=print) -> list[BenchRow]:
    """Times every artifact of ``out_dir`` on each backend with a device here (see module doc)."""
    from .runtime.artifact_set import open_artifacts
    from .runtime.examples import example_inputs
    from .runtime.devices import device_available
    from .pipeline.targets import target_for

    from .pipeline.artifacts import load_manifest

    width = max([len("variant"), *(len(entry["variant"]) for entry in load_manifest(out_dir)["artifacts"])])
    log(header(width))
    rng = np.random.default_rng(seed)
    rows, peer_ms = [], {}
    for backend in backends:
        if not device_available(target_for(backend).driver):
            log(f"{backend}: no device here, skipped")
            continue
        artifacts = open_artifacts(out_dir, backend, aot_only=True)
        for spec in artifacts.specs():
            kernel = artifacts.kernel(spec)
            args = example_inputs(spec, rng, entries=[(tokens, tokens)] * batch)
            ours = best_time(lambda: kernel(*args), repeat)
            if spec.name not in peer_ms:
                peer = torch_sdpa(spec, batch, tokens, rng)
                peer_ms[spec.name] = None if peer is None else best_time(peer, repeat) * 1e3
            theirs = peer_ms[spec.name]
            rows.append(BenchRow(spec.name, backend, spec.dtype, batch, tokens, ours * 1e3,
                                 attention_flops(spec, batch, tokens) / ours / 1e9, theirs,
                                 None if theirs is None else theirs / (ours * 1e3)))
            log(format_row(rows[-1], width))
    return rows


def header(width: int) -> str:
    """The table's header with a variant column ``width`` wide (the longest variant name)."""
    return f"{'variant':<{width}} {'backend':<9} {'ours ms':>9} {'GFLOP/s':>8} {'torch ms':>9} {'ratio':>6}"


def format_row(row: BenchRow, width: int) -> str:
    torch_ms = "-" if row.torch_ms is None else f"{row.torch_ms:.1f}"
    ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
    return f"{row.variant:<{width}} {row.backend:<9} {row.ours_ms:>9.1f} {row.gflops:>8.1f} {torch_ms:>9} {ratio:>6}"


def write_json(rows: list[BenchRow], path: str) -> None:
    with open(path, "w") as f:
        json.dump([asdict(r) for r in rows], f, indent=2)
