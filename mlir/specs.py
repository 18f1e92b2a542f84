"""Frozen spec dataclasses: the compile-time choices of each kernel variant.

A spec holds only structural choices (head counts, head dims, dtype, mask kind, tile sizes). Its
``symbol`` is the seed's function name (the exported entry point); its ``name`` spells every field
and names the artifact. Runtime scalars and sequence lengths are kernel arguments, not fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DTYPES = ("float32", "float16", "bfloat16")

# Default tiles, measured on llvm-cpu (2-core AMD EPYC, znver3) for B=1, h_q=32, h_kv=8, d=128,
# L=2048 causal f32 (tokens x columns -> ms): 64x256 1280, 64x128 1087, 128x128 1096, 32x64 1267,
# 128x64 1155. A score tile is [B, h_kv, q_tile * G, kv_tile] f32.
DEFAULT_Q_TILE = 64
DEFAULT_KV_TILE = 128
MASK_MODES = ("padded", "causal_padded_left")


def _scale_tag(value: float) -> str:
    """A float spelled exactly and filename-safe: 0.125 -> '0p125'."""
    return repr(float(value)).replace(".", "p").replace("-", "m").replace("+", "")


def _check_heads(h_q: int, h_kv: int) -> None:
    if h_q <= 0 or h_kv <= 0:
        raise ValueError(f"h_q and h_kv must be positive, got h_q={h_q}, h_kv={h_kv}")
    if h_q % h_kv:
        raise ValueError(f"h_q ({h_q}) must be a multiple of h_kv ({h_kv})")


def _check_common(spec) -> None:
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {spec.dtype!r}")
    if spec.q_tile <= 0 or spec.kv_tile <= 0:
        raise ValueError(f"q_tile and kv_tile must be positive, got {spec.q_tile}, {spec.kv_tile}")


@dataclass(frozen=True)
class SequencePrefillSpec:
    """Dense batched prefill, ``batch_sequence_prefill_kv(q, k, v) -> (output, lse)``.

    q [B, qo_len, h_q, d], k/v [B, kv_len, h_kv, d] in ``dtype``; output like q, lse [B, qo_len,
    h_q] float32 (base 2). ``causal`` is bottom-right aligned. ``q_tile`` query tokens and
    ``kv_tile`` KV columns are processed per step (tile sizes change rounding order only).
    """

    h_q: int
    h_kv: int
    d: int
    dtype: str
    causal: bool
    sm_scale: float
    q_tile: int = DEFAULT_Q_TILE
    kv_tile: int = DEFAULT_KV_TILE

    symbol = "batch_sequence_prefill_kv"

    def __post_init__(self):
        _check_heads(self.h_q, self.h_kv)
        _check_common(self)

    @property
    def group_size(self) -> int:
        return self.h_q // self.h_kv

    @property
    def name(self) -> str:
        return (
            f"{self.symbol}_hq{self.h_q}_hkv{self.h_kv}_d{self.d}_{self.dtype}"
            f"_causal{int(self.causal)}_sm{_scale_tag(self.sm_scale)}"
            f"_qt{self.q_tile}_kt{self.kv_tile}"
        )

    def fields(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class MaskedSequencePrefillSpec:
    """Dense batched prefill with per-entry valid length,
    ``batch_sequence_prefill_kv_masked(q, k, v, valid_lens) -> (output, lse)``.

    Shapes as :class:`SequencePrefillSpec` plus valid_lens [B] int32. ``mask_mode`` is
    ``"padded"`` (right padding, bidirectional) or ``"causal_padded_left"`` (left padding, causal
    on the valid suffix), semantics §7.
    """

    h_q: int
    h_kv: int
    d: int
    dtype: str
    mask_mode: str
    sm_scale: float
    q_tile: int = DEFAULT_Q_TILE
    kv_tile: int = DEFAULT_KV_TILE

    symbol = "batch_sequence_prefill_kv_masked"

    def __post_init__(self):
        _check_heads(self.h_q, self.h_kv)
        _check_common(self)
        if self.mask_mode not in MASK_MODES:
            raise ValueError(f"mask_mode must be one of {MASK_MODES}, got {self.mask_mode!r}")

    @property
    def group_size(self) -> int:
        return self.h_q // self.h_kv

    @property
    def causal(self) -> bool:
        return self.mask_mode == "causal_padded_left"

    @property
    def name(self) -> str:
        return (
            f"{self.symbol}_hq{self.h_q}_hkv{self.h_kv}_d{self.d}_{self.dtype}"
            f"_{self.mask_mode}_sm{_scale_tag(self.sm_scale)}_qt{self.q_tile}_kt{self.kv_tile}"
        )

    def fields(self) -> dict:
        return dataclasses.asdict(self)
