"""Target-specific tiling for the kernels' contractions, chosen by measurement.

    ir_text = tuned_ir(spec, Target("llvm-cpu"))   # the spec's module, ready for iree-compile

The IR builder marks its two contractions per KV tile (scores = q.k and probs x values) with
``CONTRACTION_MARKER`` and each online_attention op with ``ATTENTION_MARKER``; the target's
backend record (pipeline/targets.py: BACKENDS) says what each becomes. llvm-cpu's contractions
get an ``iree_codegen.compilation_info`` that fixes the tiling (88-97 GFLOP/s against IREE's
default 56-68 on the dense kernel's shapes: docs/performance.md, contraction tiling); CUDA's
16-bit attention ops get a tensor-core configuration (:func:`cuda_attention_config`), ROCm's an
MFMA one where IREE's own has none or a worse one (:func:`rocm_attention_config`). The markers
are removed either way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..mlir import build_fused_module, build_mma_module, build_module, build_x86_module
from ..mlir.abi import with_output_storage
from ..mlir.attention_op import ATTENTION_MARKER, TILE
from ..mlir.ir import DISPATCH_MARKER, TILING_MARKER, ir, tiling_mark
from ..mlir.score_tiles import CONTRACTION_MARKER
from .cpu_tiles import x86_cpu

if TYPE_CHECKING:
    from .targets import Target

# One entry per loop (h, m, n, k); docs/performance.md has what they were measured against.
CPU_CONTRACTION_TILING = dict(distribution=[1, 32, 128, 0], vector_common_parallel=[1, 4, 16, 0],
                              vector_reduction=[0, 0, 0, 1])


# A leading batch loop (tiles whose batch dim is not a static 1) gets tile 1, no reduction.
_LEADING_LOOP = dict(distribution=1, vector_common_parallel=1, vector_reduction=0)


def cpu_contraction_config(op: ir.Operation) -> dict[str, ir.Attribute]:
    """The llvm-cpu tiling of a marked contraction (4 loops, or 5 with a batch loop): the
    ``tune_contraction`` hook of ``BACKENDS["llvm-cpu"]``."""
    loops = len(ir.ArrayAttr(op.attributes["iterator_types"]))
    levels = ", ".join(f"{name} = {[_LEADING_LOOP[name]] * (loops - len(sizes)) + sizes}"
                       for name, sizes in CPU_CONTRACTION_TILING.items())
    return {"compilation_info": ir.Attribute.parse(
        f"#iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<{levels}>, "
        "translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>")}


#: Tensor-core instruction per operand type on IREE 3.13's CUDA target (sm_80 mma.sync, f32 sums).
CUDA_MMA_KIND = {"f16": "NV_MMA_SYNC_F32_16x8x16_F16", "bf16": "NV_MMA_SYNC_F32_16x8x16_BF16"}
#: Warps of a fused attention workgroup.
CUDA_ATTENTION_WARPS = 4


@dataclass(frozen=True)
class AttentionTiling:
    """One GPU configuration of the online_attention op: ``rows`` query rows per workgroup, the
    whole head dim, TILE keys per step; the warps split the loop ``qk_split`` in Q.K^T and
    ``pv_split`` in P.V; ``promote_steps`` also stages the two contractions' operands in shared
    memory (the workgroup always stages Q, K and V); ``keys`` of the TILE a step reduces;
    ``col_major``: the matrix instructions' results column-major (ROCm's MFMA only)."""

    rows: int
    qk_split: str
    pv_split: str
    promote_steps: bool
    keys: int = TILE
    col_major: bool = False


#: Measured with ptxas -arch=sm_90 -v (registers / spill bytes of the 256- and 64-row bands):
#: d 64: 130-157 / 0; d 128: 248-250 / 0 (169-174 for the KV-cache kernels); d 256: 252-254 / 0.
ROWS_64 = AttentionTiling(rows=TILE, qk_split="qi", pv_split="qi", promote_steps=True)
#: Every other pair (d 72, 80, 96, 160; 192/128): the promoted steps fail in IREE 3.13 ("failed to
#: derive layout for promoted read-like op"); without them: d 72-96 167-175 regs, 0 spill (dense
#: d 80 48 B); d 160 and 192/128 255 regs, 48-92 B spill (docs/cuda.md, head dims and registers).
ROWS_64_UNSTAGED_STEPS = AttentionTiling(rows=TILE, qk_split="qi", pv_split="qi", promote_steps=False)
#: MLA (576/512): 64 rows hold a 64 x 512 f32 accumulator (256 registers a thread before
#: anything else); 16 rows with the warps splitting the keys and the value columns: 255 regs,
#: 0 spill in bf16, 232 B in f16 (ptxas sm_90, fifteenth session). IREE's default configuration
#: had no mma.sync; 64 rows unstaged spilled 16.9 KB.
ROWS_16_SPLIT = AttentionTiling(rows=16, qk_split="ki", pv_split="n", promote_steps=False)


def cuda_attention_tiling(d_qk: int, d_v: int, query_rows: int = TILE) -> AttentionTiling:
    """The configuration for a head-dim pair and the op's query rows per (entry, KV head) (every
    pair gets one; see the constants above). A decode pass (mlir/fused_decode.py) has fewer
    rows than a band, a multiple of 16: the 16-row tiles."""
    if d_v >= 512 or query_rows % TILE:
        return ROWS_16_SPLIT
    if d_qk == d_v and d_qk in (64, 128, 256):
        return ROWS_64
    return ROWS_64_UNSTAGED_STEPS


@dataclass(frozen=True)
class MatrixCores:
    """A GPU target's matrix instructions for the fused attention op: per operand type (``f16``,
    ``bf16``) the ``#iree_gpu`` layout attribute of the Q.K^T step and of the P.V step; the
    subgroup (warp, wavefront) width and the subgroups of a workgroup."""

    qk: dict[str, str]
    pv: dict[str, str]
    subgroup_size: int
    subgroups: int


#: sm_80 mma.sync, f32 sums, 4 warps of 32.
CUDA_CORES = MatrixCores(qk={t: f"#iree_gpu.mma_layout<{k}>" for t, k in CUDA_MMA_KIND.items()},
                         pv={t: f"#iree_gpu.mma_layout<{k}>" for t, k in CUDA_MMA_KIND.items()},
                         subgroup_size=32, subgroups=CUDA_ATTENTION_WARPS)


def gpu_attention_config(op: ir.Operation, loops: tuple[str, ...], cores: MatrixCores,
                         tiling_of) -> dict[str, ir.Attribute] | None:
    """compilation_info + decomposition_config of one online_attention op with ``loops`` (named
    as in ``attention_op.ALL_LOOPS`` or ``ENTRY_LOOPS``) on ``cores``, the tiling
    ``tiling_of(d_qk, d_v, query_rows)`` gives; None (the compiler's own configuration) for an
    operand type ``cores`` has no instruction for or where ``tiling_of`` gives None."""
    query_type, value_type, mask_type = (ir.RankedTensorType(op.operands[i].type) for i in (0, 2, 4))
    operand = str(query_type.element_type)
    if operand not in cores.qk:
        return None
    # the mask's dims end in (qi, kt, ki) (attention_op.OperandDims)
    tiling = tiling_of(query_type.shape[-1], value_type.shape[-1], mask_type.shape[-3])
    if tiling is None:
        return None

    def per_loop(**sizes):
        return [sizes.get(name, 0) for name in loops]

    def step(kind: str, split: str, skipped: str, promoted: list[int]) -> str:
        kind = kind.removesuffix(">") + ", col_major = true>" if tiling.col_major else kind
        counts = [cores.subgroups if name == split else 1 for name in loops]
        basis = f"subgroup_basis = [{counts}, {[i for i, name in enumerate(loops) if name != skipped]}]"
        promote = f"promote_operands = {promoted}, " if tiling.promote_steps else ""
        return f"{{lowering_config = #iree_gpu.lowering_config<{{mma_kind = {kind}, {promote}{basis}}}>}}"

    decomposition = ir.Attribute.parse(
        f"{{qk_attrs = {step(cores.qk[operand], tiling.qk_split, 'n', [0, 1])}, "
        f"pv_attrs = {step(cores.pv[operand], tiling.pv_split, 'k1', [1])}}}")
    compilation = ir.Attribute.parse(
        "#iree_codegen.compilation_info<lowering_config = #iree_gpu.lowering_config<{promote_operands = [0, 1, 2], "
        f"reduction = {per_loop(kt=1, ki=tiling.keys)}, workgroup = {per_loop(e=1, h=1, g=1, qi=tiling.rows)}}}>, "
        "translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<VectorDistribute> "
        f"workgroup_size = [{cores.subgroup_size * cores.subgroups}, 1, 1] subgroup_size = {cores.subgroup_size}>>")
    return {"decomposition_config": decomposition, "compilation_info": compilation}


def cuda_attention_config(op: ir.Operation, loops: tuple[str, ...]) -> dict[str, ir.Attribute] | None:
    """The tensor-core configuration of one online_attention op (:func:`cuda_attention_tiling`),
    or for f32 operands (no tensor cores on this target) :func:`cuda_f32_attention_config`: the
    ``tune_attention`` hook of ``BACKENDS["cuda"]``."""
    return gpu_attention_config(op, loops, CUDA_CORES, cuda_attention_tiling) or cuda_f32_attention_config(op, loops)


#: f32 on CUDA (SIMT, 8 warps of 32): IREE 3.13's own choice for d 128, one query row and 32 value
#: columns a workgroup, 64 keys a step across the warps (8 lanes each), 4 lanes x 4 elements of the
#: head dim in Q.K^T and of the value columns in P.V. Its own choice for other head dims (read for
#: d 160: 32 keys a step, 8 lanes across the head dim, 64 value columns) gave wrong results on an H200
#: (sm_80 PTX): errors ~1 against the reference in every f32 case of d_qk 160, 192, 256 and MLA's
#: 576, right with this one (docs/cuda.md, first GPU run).
F32_SIMT = dict(warps=8, lanes=32, value_columns=32, keys=64, key_lanes=8, inner_lanes=4, inner_elements=4)


def cuda_f32_attention_config(op: ir.Operation, loops: tuple[str, ...]) -> dict[str, ir.Attribute] | None:
    """compilation_info + decomposition_config of one f32 online_attention op with ``loops`` on
    CUDA's SIMT cores (:data:`F32_SIMT`, for every head dim), None for other operand types.
    Q.K^T runs over every loop but ``n``, P.V over every loop but ``k1``; each lays its lanes and
    warps on a basis of one component per loop."""
    if str(ir.RankedTensorType(op.operands[0].type).element_type) != "f32":
        return None
    c = F32_SIMT

    def per_loop(**sizes):
        return [sizes.get(name, 0) for name in loops]

    def step(skipped: str, inner: str) -> str:
        dims = [i for i, name in enumerate(loops) if name != skipped]
        lanes = per_loop(ki=c["key_lanes"], **{inner: c["inner_lanes"]})
        warps = per_loop(ki=c["warps"])
        thread = [c["inner_elements"] if loops[i] == inner else 0 for i in dims]
        return (f"{{lowering_config = #iree_gpu.lowering_config<{{lane_basis = [{[n or 1 for n in lanes]}, {dims}], "
                f"subgroup_basis = [{[n or 1 for n in warps]}, {dims}], thread = {thread}}}>}}")

    decomposition = ir.Attribute.parse(f"{{qk_attrs = {step('n', 'k1')}, pv_attrs = {step('k1', 'n')}}}")
    compilation = ir.Attribute.parse(
        "#iree_codegen.compilation_info<lowering_config = #iree_gpu.lowering_config<{"
        f"partial_reduction = {per_loop(kt=1, ki=c['keys'])}, "
        f"workgroup = {per_loop(e=1, h=1, g=1, qi=1, n=c['value_columns'])}}}>, "
        "translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<VectorDistribute> "
        f"workgroup_size = [{c['warps'] * c['lanes']}, 1, 1] subgroup_size = {c['lanes']}>>")
    return {"decomposition_config": decomposition, "compilation_info": compilation}


#: d 256 on CDNA: 64 KB of LDS a workgroup holds Q and K/V tiles of 32 keys but not of 64 (IREE
#: 3.13: "uses 106496 bytes of shared memory; exceeded the limit of 65536 bytes" for ROWS_64).
ROWS_64_KEYS_32 = AttentionTiling(rows=TILE, qk_split="qi", pv_split="qi", promote_steps=False, keys=TILE // 2,
                                  col_major=True)


def rocm_attention_tiling(d_qk: int, d_v: int, query_rows: int = TILE) -> AttentionTiling | None:
    """The CDNA configuration of a head-dim pair, or None for IREE's own (d 64 and 128 bands).

    Measured on gfx942's ISA (docs/rocm.md, configuration): IREE's own choice has MFMA for the
    64/128 bands and a smaller kernel than :func:`cuda_attention_tiling`'s (d 128 f16: 196
    VGPRs, 84 LDS reads, 940 instructions against 219, 148, 1385), but none for d 72-192 or MLA
    (a SIMT reduction) and, for d 256, 16 value columns a workgroup, so Q.K^T 16 times over.
    Those take CUDA's tiles with column-major MFMA results (MLA's VGPRs 264 -> 228) except the
    unstaged 64-row tiles (d 80: 125 -> 204, so row-major); d 256 half the keys a step
    (ROWS_64_KEYS_32), as 64 would overflow the 64 KB of LDS."""
    tiling = cuda_attention_tiling(d_qk, d_v, query_rows)
    if tiling == ROWS_64:
        return None
    if tiling.rows == TILE and max(d_qk, d_v) > 192:
        return ROWS_64_KEYS_32
    return tiling if tiling == ROWS_64_UNSTAGED_STEPS else dataclasses.replace(tiling, col_major=True)


#: CDNA MFMA (gfx90a, gfx942, gfx950), f32 sums, 4 wavefronts of 64.
ROCM_CORES = MatrixCores(qk={t: f"#iree_gpu.mma_layout<MFMA_F32_16x16x16_{t.upper()}>" for t in ("f16", "bf16")},
                         pv={t: f"#iree_gpu.mma_layout<MFMA_F32_16x16x16_{t.upper()}>" for t in ("f16", "bf16")},
                         subgroup_size=64, subgroups=4)


def rocm_attention_config(op: ir.Operation, loops: tuple[str, ...]) -> dict[str, ir.Attribute] | None:
    """The MFMA configuration of one online_attention op (:func:`rocm_attention_tiling`), or None
    for IREE's own (f32 operands, d 64/128 bands: MFMA either way, checked by the rocm record's
    structure checks): the ``tune_attention`` hook of ``BACKENDS["rocm"]``."""
    return gpu_attention_config(op, loops, ROCM_CORES, rocm_attention_tiling)


def cuda_dispatch_config(threads: int) -> dict[str, ir.Attribute]:
    """The translation_info of a hand-written CUDA dispatch of ``threads`` a workgroup (warps of
    32): IREE's BaseLowering pipeline (without one IREE picks none and launches one thread a
    workgroup: ``.maxntid 1, 1, 1``); the ``tune_dispatch`` hook of ``BACKENDS["cuda"]``."""
    return {"translation_info": ir.Attribute.parse(
        "#iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<BaseLowering> "
        f"workgroup_size = [{threads}, 1, 1] subgroup_size = 32>")}


def _marked(module: ir.Module, markers: tuple[str, ...]) -> dict[str, list[ir.Operation]]:
    """The ops of ``module`` that carry each of ``markers``, in one walk that does not enter a
    hand-written dispatch's function (a ``stream.executable``'s: mlir/amx.py, cuda_attention.py),
    whose body holds none: an x86 serving pass's is most of its module's ops (the suite's 448
    modules took 5.2 s of walking in four walks, docs/test-suite.md)."""
    found: dict[str, list[ir.Operation]] = {marker: [] for marker in markers}

    def visit(op):
        attributes = op.attributes
        for marker in markers:
            if marker in attributes:
                found[marker].append(op)
        return ir.WalkResult.SKIP if _dispatch_function(op) else ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def _dispatch_function(op: ir.Operation) -> bool:
    if op.name != "func.func":
        return False
    container = op.parent.parent
    return container is not None and container.name == "stream.executable"


def apply_tuning(module: ir.Module, target: Target) -> ir.Module:
    """Replaces every contraction, attention, tiling and dispatch marker in ``module`` (in place) by
    what the target's backend record's hooks give (``tune_contraction``, ``tune_attention``,
    ``tune_generic``, ``tune_dispatch``); returns it."""
    record = target.record
    with module.context:
        marked = _marked(module, (DISPATCH_MARKER, TILING_MARKER, CONTRACTION_MARKER, ATTENTION_MARKER))
        for op in marked[DISPATCH_MARKER]:
            threads = ir.IntegerAttr(ir.DictAttr(op.attributes[DISPATCH_MARKER])["threads"]).value
            del op.attributes[DISPATCH_MARKER]
            config = record.tune_dispatch(threads)
            if config is None:
                raise ValueError(f"backend {record.name} has no configuration for a hand-written dispatch")
            for name, value in config.items():
                op.attributes[name] = value
        for op in marked[TILING_MARKER]:
            role, sizes, unit_loops = tiling_mark(op)
            del op.attributes[TILING_MARKER]
            for name, value in (record.tune_generic(role, sizes, unit_loops) or {}).items():
                op.attributes[name] = value
        for op in marked[CONTRACTION_MARKER]:
            del op.attributes[CONTRACTION_MARKER]
            for name, value in (record.tune_contraction(op) or {}).items():
                op.attributes[name] = value
        for op in marked[ATTENTION_MARKER]:
            loops = tuple(ir.StringAttr(name).value for name in ir.ArrayAttr(op.attributes[ATTENTION_MARKER]))
            del op.attributes[ATTENTION_MARKER]
            for name, value in (record.tune_attention(op, loops) or {}).items():
                op.attributes[name] = value
    return module


def tuned_module(spec, target: Target) -> ir.Module:
    """The module iree-compile gets for ``spec`` on ``target``, in the target's lowering."""
    lowering = target.lowering_of(spec)
    if lowering == "x86":   # hand-written dispatches; a serving pass's chunk merge is marked
        module = build_x86_module(spec, x86_cpu(target.arch))
    elif lowering == "mma":
        module = build_mma_module(spec)
    elif lowering == "fused":
        module = build_fused_module(spec)
    else:
        module = build_module(spec, row_chunk=target.record.row_chunk,
                              score_tiles=target.record.score_tiles(target.arch, spec.dtype),
                              pass_vectors=target.record.pass_vectors(target.arch))
    if target.record.output_storage:
        with_output_storage(module)
    return apply_tuning(module, target)


def tuned_ir(spec, target: Target, *, locations: bool = False) -> str:
    """:func:`tuned_module` as text; ``locations``: with each op's builder line (mlir/ir.py:
    builder_location), which IREE's diagnostics then name. Without them the text depends on the
    IR alone (the cache's key)."""
    return tuned_module(spec, target).operation.get_asm(enable_debug_info=locations)
