"""Target-specific tiling for the kernels' contractions, chosen by measurement.

    ir_text = tuned_ir(spec, Target("llvm-cpu"))   # the spec's module, ready for iree-compile

The IR builder marks its two contractions per KV tile (scores = q.k and probs x values) with
``CONTRACTION_MARKER``. For llvm-cpu the marker becomes an ``iree_codegen.compilation_info`` that
fixes the tiling; other targets keep IREE's own choice. The marker is removed either way.

Measured (2-core EPYC znver3, AVX2, IREE 3.13): the same contraction alone, [8, 512, 128] x
[8, 128, 128] f32 (the dense L=2048 kernel's shapes), under 18 tilings, each compiled with its
compilation_info and timed with iree-benchmark-module:

    IREE's default (distribution [8, 64, 64], vector [1, 8, 8], reduction 8)    56-68 GFLOP/s
    distribution [1, 32, 128], vector [1, 4, 16], reduction 1 (chosen)           88-97 GFLOP/s
    6x16, 8x16 and 4x32 register tiles                                            14-38 GFLOP/s

In the dense causal f32 kernel at L=2048 (iree-profile, 136 KV steps) the scores dispatch went
from 352 to 205 ms and the probs x values one from 320 to 230 ms. The keys must reach the
contraction k-major ([h, d, N]); with [h, N, d] every tiling tried stayed near 40 GFLOP/s.
"""

from __future__ import annotations

from ..mlir import build_module
from ..mlir.ir import ir
from ..mlir.online_softmax import CONTRACTION_MARKER, CUDA_ROW_CHUNK
from .targets import Target

# One entry per loop (h, m, n, k); see the module docstring for what they were measured against.
CPU_CONTRACTION_TILING = dict(distribution=[1, 32, 128, 0], vector_common_parallel=[1, 4, 16, 0],
                              vector_reduction=[0, 0, 0, 1])


# A leading batch loop (tiles whose batch dim is not a static 1) gets tile 1, no reduction.
_LEADING_LOOP = dict(distribution=1, vector_common_parallel=1, vector_reduction=0)


def _cpu_compilation_info(loops: int) -> ir.Attribute:
    """The llvm-cpu tiling for a contraction with ``loops`` loops (4, or 5 with a batch loop)."""
    levels = ", ".join(f"{name} = {[_LEADING_LOOP[name]] * (loops - len(sizes)) + sizes}"
                       for name, sizes in CPU_CONTRACTION_TILING.items())
    return ir.Attribute.parse(
        f"#iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<{levels}>, "
        "translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>")


def apply_tuning(module: ir.Module, target: Target) -> ir.Module:
    """Replaces every contraction marker in ``module`` (in place) for ``target``; returns it."""
    marked = []

    def visit(op):
        if CONTRACTION_MARKER in op.attributes:
            marked.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    with module.context:
        for op in marked:
            del op.attributes[CONTRACTION_MARKER]
            if target.backend == "llvm-cpu":
                loops = len(ir.ArrayAttr(op.attributes["iterator_types"]))
                op.attributes["compilation_info"] = _cpu_compilation_info(loops)
    return module


#: The widest row the online softmax reduces in one op, per backend (``build_module(row_chunk=)``).
#: CUDA needs 128-column chunks (online_softmax.CUDA_ROW_CHUNK). llvm-cpu reduces the dense
#: kernels' 256-column rows whole: each KV step is then 3 dispatches instead of 6 (the chunked
#: max and sum became dispatches of their own, and so did the accumulator update). Dense causal f32,
#: iree-benchmark-module median of 3, six alternating rounds, chunked vs whole: L=2048 540-750 vs
#: 512-579 ms (whole faster in 5 rounds), L=512 57-73 vs 56-69 ms (faster in 4).
ROW_CHUNK = {"llvm-cpu": None, "cuda": CUDA_ROW_CHUNK}


def tuned_ir(spec, target: Target) -> str:
    """The MLIR text iree-compile gets for ``spec`` on ``target``."""
    return str(apply_tuning(build_module(spec, row_chunk=ROW_CHUNK[target.backend]), target))
