"""Which KV-step tile layout (mlir/score_tiles.py) and serving-pass vectors (mlir/decode.py) the
linalg lowering gets on a CPU: the one place that reads the CPU's features (the ``score_tiles``
and ``pass_vectors`` hooks of ``BACKENDS["llvm-cpu"]``); and the llvm-cpu tiling of each generic
the IR builders mark with a role (``mlir.ir.mark_tiling``; the ``tune_generic`` hook,
:func:`cpu_generic_tiling`).

    cpu_score_tiles("host", "bfloat16")    # PackedTiles(bf16, 16x16x2) on a CPU with avx512_bf16
    cpu_score_tiles("znver3", "bfloat16")  # ROW_TILES: no avx512_bf16
    cpu_spec_lowering("host", spec, "linalg")  # "x86" for a bf16/f32 dense spec on a CPU with amx_bf16

``host`` is the machine that compiles (IREE's ``--iree-llvmcpu-target-cpu=host`` builds for its
features too), read from /proc/cpuinfo; a named LLVM CPU has the features :data:`NAMED_CPU_FEATURES`
lists (an unlisted name gets none: the row tiles, which every CPU runs).
"""

from __future__ import annotations

import functools
import os

from ..mlir import X86Cpu, x86_unsupported
from ..mlir.decode import NARROW_PASS_VECTORS, ROW_VECTOR, WIDE_PASS_VECTORS, PassVectors
from ..mlir.ir import ir
from ..mlir.score_tiles import ROW_TILES, RowTiles, packed_tiles_for

#: Features (as /proc/cpuinfo spells them) of the named LLVM CPUs the packed tiles and the AMX
#: kernels need.
NAMED_CPU_FEATURES = {
    **{name: frozenset({"avx2", "avx512f", "avx512_bf16", "avx512vbmi"}) for name in ("znver4", "znver5")},
    "cooperlake": frozenset({"avx2", "avx512f", "avx512_bf16"}),
    **{name: frozenset({"avx2", "avx512f", "avx512_bf16", "avx512vbmi", "amx_tile", "amx_bf16"})
       for name in ("sapphirerapids", "emeraldrapids")},
    "graniterapids": frozenset({"avx2", "avx512f", "avx512_bf16", "avx512vbmi", "amx_tile", "amx_bf16", "amx_fp16"}),
    **{name: frozenset({"avx2", "avx512f"}) for name in ("skylake-avx512", "cascadelake")},
    "icelake-server": frozenset({"avx2", "avx512f", "avx512vbmi"}),
    **{name: frozenset({"avx2"}) for name in ("znver2", "znver3", "haswell", "skylake", "alderlake", "x86-64-v3")},
}


#: CPU features (comma-separated, as /proc/cpuinfo spells them) the library takes the host not to
#: have: ``LINALG_PREFILL_HIDE_CPU_FEATURES=amx_tile,amx_bf16 make test`` runs on an AMX Xeon the
#: suite a CPU without AMX runs (an AMD Zen 4's: x86 kernels and passes without AMX tiles, bf16
#: on pair dot products, the AMX tests skipped;
#: docs/test-suite.md; ``make test-as CPU=znver4`` names them from :func:`features_to_hide`). Read
#: once a process.
HIDDEN_FEATURES_VARIABLE = "LINALG_PREFILL_HIDE_CPU_FEATURES"
#: Every feature a choice here reads (those of the named CPUs).
READ_FEATURES = frozenset().union(*NAMED_CPU_FEATURES.values())


def features_to_hide(arch: str) -> str:
    """The HIDDEN_FEATURES_VARIABLE value under which this host chooses as named LLVM CPU ``arch``
    does: the features read here that ``arch`` lacks (hidden on the host too where it lacks them:
    harmless). ValueError for an arch without a features entry, or one with features the host's
    hardware lacks (hiding cannot add them)."""
    if arch not in NAMED_CPU_FEATURES:
        raise ValueError(f"CPU {arch!r}: no features listed for it; one of {', '.join(sorted(NAMED_CPU_FEATURES))}")
    missing = NAMED_CPU_FEATURES[arch] - proc_cpu_flags()
    if missing:
        raise ValueError(f"CPU {arch!r} has {', '.join(sorted(missing))}, which this host has not")
    return ",".join(sorted(READ_FEATURES - NAMED_CPU_FEATURES[arch]))


@functools.cache
def host_cpu_features() -> frozenset:
    """The flags of the first processor in /proc/cpuinfo (empty where there is none), less the
    ones HIDDEN_FEATURES_VARIABLE names."""
    hidden = {name.strip() for name in os.environ.get(HIDDEN_FEATURES_VARIABLE, "").split(",")}
    return proc_cpu_flags() - hidden


def proc_cpu_flags() -> frozenset:
    """The flags of the first processor in /proc/cpuinfo as the kernel reports them (empty where
    there is none): what the hardware does, whatever HIDDEN_FEATURES_VARIABLE says."""
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


#: The CPU features (as /proc/cpuinfo spells them) the x86 lowering is chosen on.
AMX_FEATURES = frozenset({"amx_tile", "amx_bf16"})
#: ... and those its serving passes and f32 / f16 dense kernels need without AMX (AVX-512 FMA and
#: bf16 pair-dot blocks: mlir/x86_decode.py pass_engine_type), where they replace the linalg ones
#: (an AMD Zen 4: docs/performance.md, twentieth to twenty-second sessions).
FMA_PASS_FEATURES = frozenset({"avx512f"})
#: The feature the x86 passes' byte tables need (AVX-512 VBMI's vpermi2b; Skylake-SP and Cascade
#: Lake lack it, Ice Lake, Zen 4 and every AMX Xeon have it).
VBMI_FEATURE = "avx512vbmi"
#: The feature of the pair dot products (vdpbf16ps) the bf16 passes run on without AMX (Zen 4,
#: Cooper Lake; not Skylake-SP to Ice Lake).
BF16_DOT_FEATURE = "avx512_bf16"


def x86_cpu(arch: str) -> X86Cpu:
    """What the x86 lowering's kernels for CPU ``arch`` may use (mlir.X86Cpu): AMX tiles where it
    has them (else its serving passes run on the FMA or the bf16 pair-dot blocks), AVX-512 VBMI's
    byte permutes, AVX-512 BF16's pair dot products."""
    features = cpu_features(arch)
    return X86Cpu(amx=AMX_FEATURES <= features, vbmi=VBMI_FEATURE in features, bf16_dot=BF16_DOT_FEATURE in features)


def cpu_spec_lowering(arch: str, spec, lowering: str) -> str:
    """The lowering ``spec`` gets on CPU ``arch`` where ``lowering`` is asked: "x86" (hand-written
    dispatches, mlir/x86_attention.py: bf16 on AMX tiles, f32 and f16 in AVX-512 FMA blocks) in
    place of the linalg lowering on an Intel Xeon with AMX tiles (amx_tile, amx_bf16), where it
    was measured (docs/performance.md: dense causal bf16 5-8x, f32 1.8x the linalg lowering), for
    the specs it builds; on an AVX-512 CPU without AMX (an AMD Zen 4) for the specs in the dtypes
    it has an engine for (mlir.x86_unsupported: f32 and f16, bf16 where avx512_bf16 is): the
    serving passes 1.5-2x the linalg passes there, dense causal 1.45-5x, the KV-cache prefills
    0.96-4.98x; else as asked. "x86" asked on a CPU without AMX for a spec it builds no x86 kernel
    of there is an error."""
    features, cpu = cpu_features(arch), x86_cpu(arch)
    x86_here = (cpu.amx or FMA_PASS_FEATURES <= features) and x86_unsupported(spec, cpu) is None
    if lowering == "x86" and not cpu.amx and not x86_here:
        has = "not both" if arch != "host" else "neither here"
        raise ValueError(f"lowering 'x86' for {type(spec).__name__} in {spec.dtype} needs a CPU with "
                         f"{' and '.join(sorted(AMX_FEATURES))}; {arch!r} has {has}")
    if lowering == "linalg" and x86_here:
        return "x86"
    return lowering


def row_tiles(arch: str, dtype: str) -> RowTiles:
    """The row tiles whatever the arch (GPU backends' linalg lowering)."""
    return ROW_TILES


def cpu_pass_vectors(arch: str) -> PassVectors:
    """The serving passes' vectors on CPU ``arch``: the wide ones with AVX-512."""
    return WIDE_PASS_VECTORS if "avx512f" in cpu_features(arch) else NARROW_PASS_VECTORS


def narrow_pass_vectors(arch: str) -> PassVectors:
    """The narrow vectors whatever the arch (GPU backends' linalg lowering)."""
    return NARROW_PASS_VECTORS


# ---- the tiling of the marked generics (mlir.ir.mark_tiling)

#: The serving passes' chunk merge reads each chunk's products in head-dim vectors of this width.
VALUE_VECTOR = 32
#: The chunk softmax (mlir/decode.py: _chunk_softmax) works on SOFTMAX_ROWS (entry, chunk, head)
#: rows a workgroup: key-major, in vectors of up to KEY_MAJOR_ROWS query rows of a key (16-lane
#: vectors: 8.2 + 13.3 us on one entry of 16 queries over 256 keys, against 3.5 + 10.7 with 64);
#: row-major, in tiles of the rows by SOFTMAX_VECTOR keys (at most a block).
SOFTMAX_ROWS = 8
KEY_MAJOR_ROWS = 64
SOFTMAX_VECTOR = 16
#: The dense query packing (score_tiles.PackedTiles.query_rows) moves [QUERY_PACK_COLUMNS
#: head-dim columns x m0 rows] tiles (a transpose in registers), QUERY_PACK_TILES row tiles of
#: one KV head a workgroup: left to IREE, 1.92 ms of a dense f32 L=512 call, with these tiles
#: 0.34 ms (docs/performance.md).
QUERY_PACK_COLUMNS = 16
QUERY_PACK_TILES = 4


def vector_width(vector: int, size: int) -> int:
    """The widest power-of-two vector up to ``vector`` that divides ``size``."""
    while size % vector:
        vector //= 2
    return vector


def _pass_scores(block, group, **by):
    """The serving pass's scores [n, c, h, p, s, R] over d_qk (loops i, c, h, p, s, g, k): along
    the query rows, each key element broadcast over up to ROW_VECTOR rows (``pass.scores.rows``),
    or a key row's head-dim vector dotted with one query row (``pass.scores.dots``)."""
    if not by:
        return dict(distribution=[1, 1, 1, 1, block, group, 0],
                    vector_common_parallel=[1, 1, 1, 1, 1, vector_width(ROW_VECTOR, group), 0],
                    vector_reduction=[0] * 6 + [1])
    return dict(distribution=[1, 1, 1, 1, block, group, 0], vector_common_parallel=[1, 1, 1, 1, 1, 1, 0],
                vector_reduction=[0, 0, 0, 0, 0, 0, vector_width(by["head_vector"], by["d_qk"])])


#: role -> the llvm-cpu tile sizes of each level (one per loop), from the sizes the mark carries.
CPU_GENERIC_TILINGS = {
    "pass.scores.rows": _pass_scores,
    "pass.scores.dots": _pass_scores,
    "pass.softmax.key_major": lambda rows: dict(
        distribution=[SOFTMAX_ROWS, min(rows, KEY_MAJOR_ROWS), 0],
        vector_common_parallel=[1, min(rows, KEY_MAJOR_ROWS), 0], vector_reduction=[0, 0, 1]),
    "pass.softmax.row_major": lambda rows, block: dict(
        distribution=[SOFTMAX_ROWS, rows, 0], vector_common_parallel=[1, rows, 0],
        vector_reduction=[0, 0, vector_width(SOFTMAX_VECTOR, block)]),
    "pass.probs_values": lambda outer, group: dict(
        distribution=[1, 1, 1, outer, group, 0, 0],
        vector_common_parallel=[1, 1, 1, 1, vector_width(ROW_VECTOR, group), 0, 0],
        vector_reduction=[0, 0, 0, 0, 0, 1, 1]),
    "pass.merge.rows": lambda group: dict(
        distribution=[1, 1, group, 0], vector_common_parallel=[1, 1, 1, 0], vector_reduction=[0, 0, 0, 1]),
    "pass.merge.values": lambda group, d_v: dict(
        distribution=[1, 1, group, d_v, 0], vector_common_parallel=[1, 1, 1, vector_width(VALUE_VECTOR, d_v), 0],
        vector_reduction=[0, 0, 0, 0, 1]),
    "dense.query_packing": lambda columns, tokens, group, k0: dict(
        distribution=[1, 1, QUERY_PACK_TILES, 0, 0, 0, 0],
        vector_common_parallel=[1, 1, 1, vector_width(QUERY_PACK_COLUMNS, columns), tokens, group, k0]),
}


def cpu_generic_tiling(role: str, sizes: dict, unit_loops: tuple[int, ...] = ()) -> dict[str, ir.Attribute]:
    """The ``compilation_info`` of a marked generic on llvm-cpu (the ``tune_generic`` hook of
    ``BACKENDS["llvm-cpu"]``): its role's tile sizes under IREE's DoubleTilingExpert pipeline,
    without those of the ``unit_loops`` the op was built without (mlir.ir.mark_tiling)."""
    levels = ", ".join(f"{name} = {[size for loop, size in enumerate(tiles) if loop not in unit_loops]}"
                       for name, tiles in CPU_GENERIC_TILINGS[role](**sizes).items())
    return {"compilation_info": ir.Attribute.parse(
        f"#iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<{levels}>, "
        "translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>")}
