"""Which KV-step tile layout (mlir/score_tiles.py) and serving-pass vectors (mlir/decode.py) the
linalg lowering gets on a CPU: the one place that reads the CPU's features (the ``score_tiles``
and ``pass_vectors`` hooks of ``BACKENDS["llvm-cpu"]``).

    cpu_score_tiles("host", "bfloat16")    # PackedTiles(bf16, 16x16x2) on a CPU with avx512_bf16
    cpu_score_tiles("znver3", "bfloat16")  # ROW_TILES: no avx512_bf16

``host`` is the machine that compiles (IREE's ``--iree-llvmcpu-target-cpu=host`` builds for its
features too), read from /proc/cpuinfo; a named LLVM CPU has the features :data:`NAMED_CPU_FEATURES`
lists (an unlisted name gets none: the row tiles, which every CPU runs).
"""

from __future__ import annotations

import functools

from ..mlir.decode import NARROW_PASS_VECTORS, WIDE_PASS_VECTORS, PassVectors
from ..mlir.score_tiles import ROW_TILES, RowTiles, packed_tiles_for

#: Features (as /proc/cpuinfo spells them) of the named LLVM CPUs the packed tiles need.
NAMED_CPU_FEATURES = {
    **{name: frozenset({"avx2", "avx512f", "avx512_bf16"})
       for name in ("znver4", "znver5", "cooperlake", "sapphirerapids", "emeraldrapids", "graniterapids")},
    **{name: frozenset({"avx2", "avx512f"}) for name in ("skylake-avx512", "cascadelake", "icelake-server")},
    **{name: frozenset({"avx2"}) for name in ("znver2", "znver3", "haswell", "skylake", "alderlake", "x86-64-v3")},
}


@functools.cache
def host_cpu_features() -> frozenset:
    """The flags of the first processor in /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_features(arch: str) -> frozenset:
    """The features of LLVM CPU ``arch`` that the tile choice reads."""
    return host_cpu_features() if arch == "host" else NAMED_CPU_FEATURES.get(arch, frozenset())


def cpu_score_tiles(arch: str, dtype: str) -> RowTiles:
    """The linalg lowering's KV-step tiles for ``dtype`` on CPU ``arch``."""
    return packed_tiles_for(dtype, cpu_features(arch)) or ROW_TILES


def row_tiles(arch: str, dtype: str) -> RowTiles:
    """The row tiles whatever the arch (GPU backends' linalg lowering)."""
    return ROW_TILES


def cpu_pass_vectors(arch: str) -> PassVectors:
    """The serving passes' vectors on CPU ``arch``: the wide ones with AVX-512."""
    return WIDE_PASS_VECTORS if "avx512f" in cpu_features(arch) else NARROW_PASS_VECTORS


def narrow_pass_vectors(arch: str) -> PassVectors:
    """The narrow vectors whatever the arch (GPU backends' linalg lowering)."""
    return NARROW_PASS_VECTORS
