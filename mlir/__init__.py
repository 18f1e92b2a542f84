"""IR builders: typed MLIR bindings, one online-softmax emitter, one spec per variant."""

from .cuda_attention import build_cuda_sequence_prefill, unsupported as _dense_mma_unsupported
from .cuda_decode import build_cuda_decode, pass_unsupported as _pass_mma_unsupported
from .cuda_kv_cache import build_cuda_kv_cache_prefill, kv_cache_unsupported as _kv_cache_mma_unsupported
from .x86_attention import (
    ENGINES, XEON_WITH_AMX, X86Cpu, build_x86_sequence_prefill, engine_type as x86_engine_type,
    unsupported as _dense_x86_unsupported, uses_amx as x86_uses_amx,
)
from .x86_decode import build_x86_pass, pass_unsupported as _pass_x86_unsupported
from .x86_kv_cache import build_x86_kv_cache_prefill, kv_cache_unsupported as _kv_cache_x86_unsupported
from .fused_kernels import build_fused_kv_cache_prefill, build_fused_sequence_prefill
from .decode import NARROW_PASS_VECTORS, DecodeSpec, PassVectors, build_decode
from .fused_decode import build_fused_decode
from .kv_cache import build_kv_cache_prefill
from .score_tiles import ROW_TILES, RowTiles
from .sequence import build_sequence_prefill
from .specs import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec,
    SequencePrefillSpec, SpecError,
)

_BUILDERS = {
    SequencePrefillSpec: build_sequence_prefill,
    MaskedSequencePrefillSpec: build_sequence_prefill,
    RaggedPrefillSpec: build_kv_cache_prefill,
    PagedPrefillSpec: build_kv_cache_prefill,
    MlaPagedPrefillSpec: build_kv_cache_prefill,
}
SPEC_TYPES = tuple(_BUILDERS)
#: Passes a variant's kernel hands work to (not variants of their own: no seed function, no CLI name).
_PASS_BUILDERS = {DecodeSpec: build_decode}
_FUSED_BUILDERS = {
    SequencePrefillSpec: build_fused_sequence_prefill,
    MaskedSequencePrefillSpec: build_fused_sequence_prefill,
    RaggedPrefillSpec: build_fused_kv_cache_prefill,
    PagedPrefillSpec: build_fused_kv_cache_prefill,
    MlaPagedPrefillSpec: build_fused_kv_cache_prefill,
    DecodeSpec: build_fused_decode,
}


def build_module(spec, *, row_chunk: int | None = None, score_tiles: RowTiles = ROW_TILES,
                 pass_vectors: PassVectors = NARROW_PASS_VECTORS):
    """The verified MLIR module for any variant spec. ``row_chunk`` is the widest row the online
    softmax reduces in one op (None: whole rows); ``score_tiles`` the KV step's tile layout
    (mlir/score_tiles.py), ``pass_vectors`` a serving pass's (mlir/decode.py); pipeline/tuning.py
    picks them per target."""
    if type(spec) in _PASS_BUILDERS:
        return _PASS_BUILDERS[type(spec)](spec, vectors=pass_vectors)
    try:
        builder = _BUILDERS[type(spec)]
    except KeyError:
        raise TypeError(f"no IR builder for {type(spec).__name__}") from None
    return builder(spec, row_chunk=row_chunk, score_tiles=score_tiles)


#: The x86 lowering's builders (hand-written dispatches) and why each has no kernel for a spec.
#: Each takes the spec and the CPU (X86Cpu): without AMX tiles (an AMD Zen 4, an AVX-512 Xeon
#: before Sapphire Rapids) a kernel exists in the dtypes the CPU has an engine for
#: (x86_attention.engine_type: f32 and f16 on the FMA blocks, bf16 on DotEngine's pair dot
#: products where it has AVX-512 BF16). On a 2-core Zen 4 (docs/performance.md): dense causal
#: 1.45-5x the linalg kernels; the KV-cache prefills, with each entry's rows gathered by the row
#: packing dispatch, bf16 1.37-4.98x, f16 1.24-4.27x, f32 0.96-3.17x (0.96x at 2 entries of 64
#: new over 4096 cached, the linalg kernel's 64-query tile full), MLA 1.3-2.3x, e4m3 1.07-1.76x.
_X86_BUILDERS = {
    SequencePrefillSpec: (build_x86_sequence_prefill, _dense_x86_unsupported),
    MaskedSequencePrefillSpec: (build_x86_sequence_prefill, _dense_x86_unsupported),
    RaggedPrefillSpec: (build_x86_kv_cache_prefill, _kv_cache_x86_unsupported),
    PagedPrefillSpec: (build_x86_kv_cache_prefill, _kv_cache_x86_unsupported),
    MlaPagedPrefillSpec: (build_x86_kv_cache_prefill, _kv_cache_x86_unsupported),
}
_X86_PASS_BUILDERS = {DecodeSpec: (build_x86_pass, _pass_x86_unsupported)}


def x86_unsupported(spec, cpu: X86Cpu = XEON_WITH_AMX) -> str | None:
    """Why the x86 lowering has no kernel for ``spec`` (None where it has one) on ``cpu``: the
    dense sequence prefills (mlir/x86_attention.py), the ragged, paged and MLA KV-cache prefills
    (mlir/x86_kv_cache.py) and their serving passes (mlir/x86_decode.py); without AMX tiles the
    kernels in the dtypes ``cpu`` has an engine for."""
    if type(spec) in _X86_PASS_BUILDERS:
        return _X86_PASS_BUILDERS[type(spec)][1](spec, cpu)
    if type(spec) not in _X86_BUILDERS:
        return f"{type(spec).__name__} has no x86 kernel"
    engine = x86_engine_type(spec.dtype, cpu) if spec.dtype in ENGINES else None
    if not cpu.amx and engine is None:
        return f"{type(spec).__name__} in {spec.dtype} has no x86 kernel without AMX tiles here"
    return _X86_BUILDERS[type(spec)][1](spec, cpu)


def build_x86_module(spec, cpu: X86Cpu = XEON_WITH_AMX):
    """The verified MLIR module of the x86 lowering for ``cpu``; ValueError naming why for a
    spec it has no kernel for (:func:`x86_unsupported`)."""
    why = x86_unsupported(spec, cpu)
    if why:
        raise ValueError(f"no x86 lowering for {spec.name}: {why}")
    if type(spec) in _X86_PASS_BUILDERS:
        return _X86_PASS_BUILDERS[type(spec)][0](spec, cpu)
    return _X86_BUILDERS[type(spec)][0](spec, cpu)


#: The CUDA mma lowering's builders (hand-written dispatches: mlir/cuda_attention.py) and why
#: each has no kernel for a spec.
_MMA_BUILDERS = {
    SequencePrefillSpec: (build_cuda_sequence_prefill, _dense_mma_unsupported),
    MaskedSequencePrefillSpec: (build_cuda_sequence_prefill, _dense_mma_unsupported),
    RaggedPrefillSpec: (build_cuda_kv_cache_prefill, _kv_cache_mma_unsupported),
    PagedPrefillSpec: (build_cuda_kv_cache_prefill, _kv_cache_mma_unsupported),
    DecodeSpec: (build_cuda_decode, _pass_mma_unsupported),
}


def mma_unsupported(spec) -> str | None:
    """Why the CUDA mma lowering has no kernel for ``spec`` (None where it has one): the dense
    sequence prefills in float16 and bfloat16 (mlir/cuda_attention.py), the ragged and paged
    prefills (mlir/cuda_kv_cache.py) and their serving passes (mlir/cuda_decode.py)."""
    if type(spec) not in _MMA_BUILDERS:
        return f"{type(spec).__name__} has no mma kernel"
    return _MMA_BUILDERS[type(spec)][1](spec)


def build_mma_module(spec):
    """The verified MLIR module of the CUDA mma lowering; ValueError naming why for a spec it has
    no kernel for (:func:`mma_unsupported`)."""
    why = mma_unsupported(spec)
    if why:
        raise ValueError(f"no mma lowering for {spec.name}: {why}")
    return _MMA_BUILDERS[type(spec)][0](spec)


def build_fused_module(spec):
    """The verified MLIR module of the fused lowering (mlir/fused_kernels.py) for any spec."""
    try:
        builder = _FUSED_BUILDERS[type(spec)]
    except KeyError:
        raise TypeError(f"no IR builder for {type(spec).__name__}") from None
    return builder(spec)


__all__ = [
    "SequencePrefillSpec", "MaskedSequencePrefillSpec", "RaggedPrefillSpec", "PagedPrefillSpec",
    "MlaPagedPrefillSpec", "DecodeSpec", "SPEC_TYPES", "SpecError", "build_module", "build_fused_module",
    "build_x86_module", "x86_unsupported", "x86_uses_amx", "X86Cpu", "XEON_WITH_AMX", "build_mma_module",
    "mma_unsupported",
]
