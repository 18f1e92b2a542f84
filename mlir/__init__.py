"""IR builders: typed MLIR bindings, one online-softmax emitter, one spec per variant."""

from .x86_attention import build_x86_sequence_prefill, unsupported as _dense_x86_unsupported, uses_amx as x86_uses_amx
from .x86_decode import build_x86_pass, pass_unsupported as _pass_x86_unsupported
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


def x86_unsupported(spec) -> str | None:
    """Why the x86 lowering has no kernel for ``spec`` (None where it has one): the dense sequence
    prefills (mlir/x86_attention.py) and the serving passes (mlir/x86_decode.py)."""
    return (_pass_x86_unsupported if isinstance(spec, DecodeSpec) else _dense_x86_unsupported)(spec)


def build_x86_module(spec):
    """The verified MLIR module of the x86 lowering (mlir/x86_attention.py, mlir/x86_decode.py);
    ValueError naming why for a spec it has no kernel for (:func:`x86_unsupported`)."""
    return (build_x86_pass if isinstance(spec, DecodeSpec) else build_x86_sequence_prefill)(spec)


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
    "build_x86_module", "x86_unsupported", "x86_uses_amx",
]
