"""Frozen spec dataclasses: the compile-time choices of each kernel variant.

A spec holds only structural choices (head counts, head dims, dtype, mask kind, tile sizes, and
``logits_soft_cap``: 0 = off, else every score is ``cap * tanh(sm_scale * q.k / cap)`` before the
mask, as Gemma 2 does; ``rotary_dim`` on the RoPE variants: only the first ``rotary_dim`` dims of
q and k rotate, Hugging Face's ``partial_rotary_factor``; ``head_sinks``: the call takes one sink
logit per query head, ``sinks [h_q]`` f32, that joins every row's softmax denominator, as gpt-oss
does, semantics §13). Its
``symbol`` is the seed's function name (the exported entry point); its ``name`` spells every field
and names the artifact; ``layout`` says where keys and values live (kv_layouts.py: ``DENSE`` (k, v
[B, Lk, h_kv, d]), ``RAGGED`` (k, v rows by kv_indptr), ``PAGED`` (pages [P, 2, h_kv, page_size,
d]; ``PAGED_NHD``: [P, 2, page_size, h_kv, d]) or ``LATENT`` (MLA: pages [P, page_size, d_qk], a key row whose first d_v columns are its
value)), ``kv_layout`` its name.
Runtime scalars and sequence lengths are kernel arguments, not fields.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from .dtypes import IR_DTYPES
from .kv_layouts import DENSE, LATENT, PAGED_ORDERS, RAGGED_ORDERS

DTYPES = tuple(name for name, dtype in IR_DTYPES.items() if dtype.compute)
#: The KV-cache dtypes a spec's ``kv_dtype`` may name besides its ``dtype`` (8-bit floats, read
#: through per-KV-head scales: semantics §15).
KV_DTYPES = tuple(name for name, dtype in IR_DTYPES.items() if not dtype.compute)

# Dense tiles: 256 x 256 read K/V and the query tile fewest times (fastest at L=2048 and 8192).
# The KV-cache variants keep 64 x 128: their entries are often short, and a tile of a short entry
# is mostly padding. A score tile is [1, h_kv, q_tile * G, kv_tile] f32. (docs/performance.md,
# dense and KV-cache tiles.)
DENSE_Q_TILE = 256
DENSE_KV_TILE = 256
# Query tile of a call (dense) or entry (KV cache) with at most this many query tokens (a 16-token
# chunk padded to a 128-token tile computes 8x the needed work).
SMALL_Q_TILE = 16
KV_CACHE_Q_TILE = 64
KV_CACHE_KV_TILE = 128
MASK_MODES = ("padded", "causal_padded_left", "custom")


class SpecError(ValueError):
    """A spec field is invalid; the message names the field and what was expected."""


def _scale_tag(value: float) -> str:
    """A float spelled exactly and filename-safe: 0.125 -> '0p125'."""
    return repr(float(value)).replace(".", "p").replace("-", "m").replace("+", "")


def _check_heads(h_q: int, h_kv: int) -> None:
    _check_positive(h_q=h_q, h_kv=h_kv)
    if h_q <= 0 or h_kv <= 0:
        raise SpecError(f"h_q and h_kv must be positive, got h_q={h_q}, h_kv={h_kv}")
    if h_q % h_kv:
        raise SpecError(f"h_q ({h_q}) must be a multiple of h_kv ({h_kv})")


def _check_scale(spec) -> None:
    """``sm_scale`` a finite positive float, ``causal`` a bool (0/1 accepted), ``d`` positive."""
    _check_positive(d=spec.d)
    scale = spec.sm_scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0.0 < scale < float("inf"):
        raise SpecError(f"sm_scale must be a finite float > 0, got {scale!r}")
    object.__setattr__(spec, "sm_scale", float(scale))
    if "causal" in {f.name for f in dataclasses.fields(spec)}:
        if spec.causal not in (True, False):
            raise SpecError(f"causal must be a bool, got {spec.causal!r}")
        object.__setattr__(spec, "causal", bool(spec.causal))


def _check_common(spec) -> None:
    cap = spec.logits_soft_cap
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 0.0 or cap == float("inf"):
        raise SpecError(f"logits_soft_cap must be a finite float >= 0 (0 = off), got {cap!r}")
    object.__setattr__(spec, "logits_soft_cap", float(cap))
    if spec.dtype not in DTYPES:
        raise SpecError(f"dtype must be one of {DTYPES}, got {spec.dtype!r}")
    _check_positive(q_tile=spec.q_tile, kv_tile=spec.kv_tile)
    if spec.head_sinks not in (True, False):
        raise SpecError(f"head_sinks must be a bool, got {spec.head_sinks!r}")
    object.__setattr__(spec, "head_sinks", bool(spec.head_sinks))


class _SpecBase:
    """What every spec derives the same way from its fields (the dataclasses inherit it)."""

    @property
    def mask_tag(self) -> str:
        """``_custommask`` in the artifact name of a custom-mask spec, else empty."""
        return "_custommask" if getattr(self, "custom_mask", False) else ""

    @property
    def cap_tag(self) -> str:
        """``_cap<value>`` in the artifact name when logits soft-capping is on, else empty."""
        return f"_cap{_scale_tag(self.logits_soft_cap)}" if self.logits_soft_cap else ""

    @property
    def sinks_tag(self) -> str:
        """``_sinks`` in the artifact name when the call takes per-head sink logits, else empty."""
        return "_sinks" if self.head_sinks else ""

    @property
    def kv_layout(self) -> str:
        """The layout's name: the plain value the reference and the error model key on."""
        return self.layout.name

    @property
    def kv_tag(self) -> str:
        """``_kv<format>`` in the artifact name of a spec with an 8-bit KV cache, else empty."""
        kv_dtype = getattr(self, "kv_dtype", None)
        return f"_kv{kv_dtype.replace('float8_', 'f8')}" if kv_dtype else ""

    @property
    def group_size(self) -> int:
        """G = h_q // h_kv query heads per KV head (h_q for MLA, whose h_kv is 1)."""
        return self.h_q // self.h_kv

    @classmethod
    def from_fields(cls, fields: dict):
        """The spec :meth:`fields` came from (an artifact manifest's)."""
        return cls(**fields)

    def fields(self) -> dict:
        """The spec's fields as plain values (``rope_scaling`` back as a dict)."""
        fields = dataclasses.asdict(self)
        if "rope_scaling" in fields:
            fields["rope_scaling"] = dict(self.rope_scaling)
        return fields


class _OneHeadDim(_SpecBase):
    """A variant whose q, k and v share one head dim ``d``; every spec has ``d_qk`` and ``d_v``."""

    @property
    def d_qk(self) -> int:
        return self.d

    @property
    def d_v(self) -> int:
        return self.d


@dataclass(frozen=True)
class SequencePrefillSpec(_OneHeadDim):
    """Dense batched prefill, ``batch_sequence_prefill_kv(q, k, v) -> (output, lse)``.

    q [B, qo_len, h_q, d], k/v [B, kv_len, h_kv, d] in ``dtype``; output like q, lse [B, qo_len,
    h_q] float32 (base 2). ``causal`` is bottom-right aligned. ``q_tile`` query tokens and
    ``kv_tile`` KV columns are processed per step (tile sizes change rounding order only).
    ``kv_dtype``: as :class:`PagedPrefillSpec`'s, for k and v (widened as the kernel stores its
    KV tiles).
    """

    h_q: int
    h_kv: int
    d: int
    dtype: str
    causal: bool
    sm_scale: float
    q_tile: int = DENSE_Q_TILE
    kv_tile: int = DENSE_KV_TILE
    logits_soft_cap: float = 0.0
    head_sinks: bool = False
    kv_dtype: str | None = None

    symbol = "batch_sequence_prefill_kv"
    layout = DENSE

    def __post_init__(self):
        _check_heads(self.h_q, self.h_kv)
        _check_scale(self)
        _check_kv_dtype(self)
        _check_common(self)

    @property
    def name(self) -> str:
        return (
            f"{self.symbol}_hq{self.h_q}_hkv{self.h_kv}_d{self.d}_{self.dtype}"
            f"_causal{int(self.causal)}_sm{_scale_tag(self.sm_scale)}"
            f"_qt{self.q_tile}_kt{self.kv_tile}{self.cap_tag}{self.sinks_tag}{self.kv_tag}"
        )


@dataclass(frozen=True)
class MaskedSequencePrefillSpec(_OneHeadDim):
    """Dense batched prefill with per-entry valid length,
    ``batch_sequence_prefill_kv_masked(q, k, v, valid_lens) -> (output, lse)``.

    Shapes as :class:`SequencePrefillSpec` plus valid_lens [B] int32. ``mask_mode`` is
    ``"padded"`` (right padding, bidirectional) or ``"causal_padded_left"`` (left padding, causal
    on the valid suffix), semantics §7, or ``"custom"``: ``custom_mask`` [B, Lq, Lk] (bool or
    uint8, 1 = the query may see the key) in place of valid_lens, semantics §14.
    """

    h_q: int
    h_kv: int
    d: int
    dtype: str
    mask_mode: str
    sm_scale: float
    q_tile: int = DENSE_Q_TILE
    kv_tile: int = DENSE_KV_TILE
    logits_soft_cap: float = 0.0
    head_sinks: bool = False
    kv_dtype: str | None = None

    symbol = "batch_sequence_prefill_kv_masked"
    layout = DENSE

    def __post_init__(self):
        _check_heads(self.h_q, self.h_kv)
        _check_scale(self)
        _check_kv_dtype(self)
        _check_common(self)
        if self.mask_mode not in MASK_MODES:
            raise SpecError(f"mask_mode must be one of {MASK_MODES}, got {self.mask_mode!r}")

    @property
    def causal(self) -> bool:
        return self.mask_mode == "causal_padded_left"

    @property
    def name(self) -> str:
        return (
            f"{self.symbol}_hq{self.h_q}_hkv{self.h_kv}_d{self.d}_{self.dtype}"
            f"_{self.mask_mode}_sm{_scale_tag(self.sm_scale)}_qt{self.q_tile}_kt{self.kv_tile}{self.cap_tag}"
            f"{self.sinks_tag}{self.kv_tag}"
        )


#: lse of a query row with no valid key (semantics §11.3); the empty state of a merge.
EMPTY_ROW_LSE = -5.0e4

#: The rope types ``rope_scaling`` may name, with the keys each needs. Other keys are optional
#: (``beta_fast``, ``beta_slow``, ``inv_theta_log_scale``; yarn's ``truncate`` and
#: ``attention_factor``, checked by :func:`_check_yarn_options`).
ROPE_FIELDS = {
    "default": (),
    "gptj": (),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "llama4": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("max_position_embeddings", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
#: Rope types whose rotation pairs dims (2i, 2i+1) instead of (i, i + d/2).
INTERLEAVED_ROPE = frozenset({"gptj", "llama4"})
PAGE_SIZES_TESTED = (1, 8, 16, 32, 64)


def freeze_rope_scaling(rope_scaling) -> tuple:
    """A Hugging Face style ``rope_scaling`` dict (``{}``/None for plain RoPE) as sorted items.

    Specs are frozen and hashable, so the dict is stored as ``(("factor", 8.0), ...)``. Unknown
    rope types and missing required keys raise ``ValueError`` here, at spec creation.
    """
    if isinstance(rope_scaling, tuple):
        rope_scaling = dict(rope_scaling)
    items = dict(rope_scaling or {})
    kind = items.get("rope_type") or items.get("type") or "default"
    if kind not in ROPE_FIELDS:
        raise SpecError(f"rope_scaling: unsupported rope_type {kind!r}; expected one of {tuple(ROPE_FIELDS)}")
    missing = [key for key in ROPE_FIELDS[kind] if key not in items]
    if missing:
        raise SpecError(f"rope_scaling: rope_type {kind!r} needs {missing}")
    if "type" in items and "rope_type" not in items:
        items["rope_type"] = items.pop("type")
    if kind == "yarn":
        _check_yarn_options(items)
    if kind == "longrope" and items.get("ext_factors") is not None:
        items["ext_factors"] = _ext_factors(items["ext_factors"])
    return tuple(sorted((key, value) for key, value in items.items() if value is not None))


def _ext_factors(factors) -> tuple:
    """LongRoPE's per-pair divisors of the frequencies (transformers' ``short_factor`` or
    ``long_factor``, the one a kernel is built for): finite floats > 0, as a tuple."""
    if isinstance(factors, (str, bytes)) or not hasattr(factors, "__len__") or not len(factors):
        raise SpecError(f"rope_scaling: longrope ext_factors must be a non-empty list of floats, got {factors!r}")
    if any(isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f < float("inf") for f in factors):
        raise SpecError(f"rope_scaling: longrope ext_factors must be finite floats > 0, got {list(factors)!r}")
    return tuple(float(f) for f in factors)


def _check_yarn_options(items: dict) -> None:
    """yarn's optional ``truncate`` (a bool: floor/ceil the ramp bounds, as transformers does) and
    ``attention_factor`` (the cos/sin multiplier, a finite float > 0); None means the default."""
    truncate = items.get("truncate")
    if truncate is not None:
        if truncate not in (True, False):
            raise SpecError(f"rope_scaling: yarn truncate must be a bool, got {truncate!r}")
        items["truncate"] = bool(truncate)
    factor = items.get("attention_factor")
    if factor is not None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0.0 < factor < float("inf"):
            raise SpecError(f"rope_scaling: yarn attention_factor must be a finite float > 0, got {factor!r}")
        items["attention_factor"] = float(factor)


def _rope_tag(rope_scaling: tuple) -> str:
    items = dict(rope_scaling)
    kind = items.get("rope_type", "default")
    if len(items) <= (1 if "rope_type" in items else 0):
        return kind
    digest = hashlib.sha256(repr(rope_scaling).encode()).hexdigest()[:8]
    return f"{kind}-{digest}"


def _check_ext_factors(spec, head_dim: int) -> None:
    """LongRoPE's ``ext_factors``: one a rotating pair (``rotary_dim / 2``, or ``head_dim / 2``)."""
    factors = dict(spec.rope_scaling).get("ext_factors")
    pairs = (spec.rotary_dim or head_dim) // 2
    if factors is not None and len(factors) != pairs:
        raise SpecError(f"rope_scaling: longrope ext_factors has {len(factors)} factors; the rotary dims have "
                        f"{pairs} pairs")


def _check_rotary_dim(spec, head_dim: int) -> None:
    """``rotary_dim``: None (the whole head) or an even int in [2, head_dim]; the whole head dim
    is stored as None, so both spellings name the same artifact."""
    value = spec.rotary_dim
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 2 or value > head_dim or value % 2:
        raise SpecError(f"rotary_dim must be None or an even int in [2, {head_dim}], got {value!r}")
    if value == head_dim:
        object.__setattr__(spec, "rotary_dim", None)


def _rotary_tag(spec) -> str:
    return "" if spec.rotary_dim is None else f"-rd{spec.rotary_dim}"


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise SpecError(f"{key} must be a positive int, got {value!r}")


def _check_custom_mask_flag(spec) -> None:
    if spec.custom_mask not in (True, False):
        raise SpecError(f"custom_mask must be a bool, got {spec.custom_mask!r}")
    object.__setattr__(spec, "custom_mask", bool(spec.custom_mask))


def _check_kv_dtype(spec) -> None:
    if spec.kv_dtype is not None and spec.kv_dtype not in KV_DTYPES:
        raise SpecError(f"kv_dtype must be None (K/V in dtype) or one of {KV_DTYPES}, got {spec.kv_dtype!r}")


def _check_window_flag(spec) -> None:
    if spec.sliding_window not in (True, False):
        raise SpecError(f"sliding_window must be a bool, got {spec.sliding_window!r}")
    object.__setattr__(spec, "sliding_window", bool(spec.sliding_window))


@dataclass(frozen=True)
class RaggedPrefillSpec(_SpecBase):
    """Ragged KV prefill, ``batch_prefill_ragged_kv`` (semantics §1.2).

    ``(q [Lq, h_q, d_qk], q_indptr [B+1], k [Lk, h_kv, d_qk], v [Lk, h_kv, d_v], kv_indptr [B+1],
    q_rope_position [Lq], k_rope_pos_offset [B], causal, rotary_mode, rope_scale, rope_theta,
    sm_scale) -> (output [Lq, h_q, d_v], lse [Lq, h_q] float32)``. With ``custom_mask`` the call
    also takes ``custom_mask`` [sum qo_len * kv_len] (bool or uint8) and ``mask_indptr`` [B+1]
    int32, and ``causal`` is ignored (semantics §14). ``kv_order``: ``"nhd"`` (k and v token-major,
    the seed's) or ``"hnd"`` (k [h_kv, Lk, d_qk], v [h_kv, Lk, d_v]: head-major, as transformers'
    DynamicCache holds a batch row). ``kv_dtype``: as :class:`PagedPrefillSpec`'s, for k and v.
    """

    h_q: int
    h_kv: int
    d_qk: int
    d_v: int
    dtype: str
    rope_scaling: tuple = ()
    q_tile: int = KV_CACHE_Q_TILE
    kv_tile: int = KV_CACHE_KV_TILE
    logits_soft_cap: float = 0.0
    rotary_dim: int | None = None
    head_sinks: bool = False
    custom_mask: bool = False
    kv_order: str = "nhd"
    kv_dtype: str | None = None

    symbol = "batch_prefill_ragged_kv"

    def __post_init__(self):
        object.__setattr__(self, "rope_scaling", freeze_rope_scaling(self.rope_scaling))
        _check_heads(self.h_q, self.h_kv)
        _check_positive(d_qk=self.d_qk, d_v=self.d_v)
        if self.kv_order not in RAGGED_ORDERS:
            raise SpecError(f"kv_order must be one of {sorted(RAGGED_ORDERS)}, got {self.kv_order!r}")
        _check_kv_dtype(self)
        _check_custom_mask_flag(self)
        _check_common(self)
        _check_rotary_dim(self, self.d_qk)
        _check_ext_factors(self, self.d_qk)

    @property
    def layout(self):
        """RAGGED or RAGGED_HND (kv_layouts.py), as ``kv_order`` says."""
        return RAGGED_ORDERS[self.kv_order]

    @property
    def name(self) -> str:
        hnd = "" if self.kv_order == "nhd" else f"_{self.kv_order}"
        return (
            f"{self.symbol}_hq{self.h_q}_hkv{self.h_kv}_dqk{self.d_qk}_dv{self.d_v}_{self.dtype}{hnd}"
            f"_rope-{_rope_tag(self.rope_scaling)}{_rotary_tag(self)}_qt{self.q_tile}_kt{self.kv_tile}{self.cap_tag}"
            f"{self.sinks_tag}{self.mask_tag}{self.kv_tag}"
        )


@dataclass(frozen=True)
class PagedPrefillSpec(_OneHeadDim):
    """Paged KV prefill, ``batch_prefill_paged_kv[_sliding_window]`` (semantics §1.1, §2).

    ``(q [Lq, h_q, d], q_indptr [B+1], pages [P, 2, h_kv, page_size, d], page_indptr [B+1],
    page_values [nnz], length_info [B] or [3, B], k_rope_pos_offset [B], q_rope_position [Lq],
    causal, rotary_mode, rope_scale, rope_theta, sm_scale) -> (output [Lq, h_q, d], lse [Lq, h_q])``.
    ``custom_mask``: as :class:`RaggedPrefillSpec`'s (columns are the logical KV rows, §2, §14).
    ``kv_order``: ``"hnd"`` (the seed's pages [P, 2, h_kv, page_size, d]) or ``"nhd"``
    (pages [P, 2, page_size, h_kv, d]: FlashInfer's NHD layout, and transformers' paged cache).
    ``kv_dtype``: None (pages in ``dtype``) or an 8-bit float (KV_DTYPES): the pages in that
    format, read through per-KV-head ``k_scale``/``v_scale`` [h_kv] float32 arguments (after the
    table's, before ``sinks``): an element is ``dtype(float32(x) * scale[head])`` (semantics §15).
    """

    h_q: int
    h_kv: int
    d: int
    dtype: str
    page_size: int = 16
    rope_scaling: tuple = ()
    sliding_window: bool = False
    q_tile: int = KV_CACHE_Q_TILE
    kv_tile: int = KV_CACHE_KV_TILE
    logits_soft_cap: float = 0.0
    rotary_dim: int | None = None
    head_sinks: bool = False
    custom_mask: bool = False
    kv_order: str = "hnd"
    kv_dtype: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "rope_scaling", freeze_rope_scaling(self.rope_scaling))
        _check_heads(self.h_q, self.h_kv)
        _check_positive(d=self.d, page_size=self.page_size)
        if self.kv_order not in PAGED_ORDERS:
            raise SpecError(f"kv_order must be one of {sorted(PAGED_ORDERS)}, got {self.kv_order!r}")
        _check_kv_dtype(self)
        _check_window_flag(self)
        _check_custom_mask_flag(self)
        _check_common(self)
        _check_rotary_dim(self, self.d)
        _check_ext_factors(self, self.d)

    @property
    def layout(self):
        """PAGED or PAGED_NHD (kv_layouts.py), as ``kv_order`` says."""
        return PAGED_ORDERS[self.kv_order]

    @property
    def symbol(self) -> str:
        return "batch_prefill_paged_kv" + ("_sliding_window" if self.sliding_window else "")

    @property
    def name(self) -> str:
        nhd = "" if self.kv_order == "hnd" else f"_{self.kv_order}"
        return (
            f"{self.symbol}_hq{self.h_q}_hkv{self.h_kv}_d{self.d}_{self.dtype}_ps{self.page_size}{nhd}"
            f"_rope-{_rope_tag(self.rope_scaling)}{_rotary_tag(self)}_qt{self.q_tile}_kt{self.kv_tile}{self.cap_tag}"
            f"{self.sinks_tag}{self.mask_tag}{self.kv_tag}"
        )


@dataclass(frozen=True)
class MlaPagedPrefillSpec(_SpecBase):
    """Paged MLA prefill over a latent cache, ``batch_prefill_paged_kv_mla[_sliding_window]`` (§1.3).

    ``(q [Lq, h_q, d_latent + d_rope], q_indptr [B+1], pages [P, page_size, d_latent + d_rope],
    page_indptr [B+1], page_values [nnz], length_info [B] or [3, B], causal, sm_scale)
    -> (output [Lq, h_q, d_latent], lse [Lq, h_q])``. One shared KV head; no RoPE inside.
    ``kv_dtype``: as :class:`PagedPrefillSpec`'s, for the latent pages; the keys and the values are
    the same rows, so ``k_scale`` and ``v_scale`` [1] must be equal (semantics §15).
    """

    h_q: int
    d_latent: int
    d_rope: int
    dtype: str
    page_size: int = 16
    sliding_window: bool = False
    q_tile: int = 16
    kv_tile: int = KV_CACHE_KV_TILE
    logits_soft_cap: float = 0.0
    head_sinks: bool = False
    kv_dtype: str | None = None

    def __post_init__(self):
        _check_positive(h_q=self.h_q, d_latent=self.d_latent, page_size=self.page_size)
        _check_window_flag(self)
        _check_kv_dtype(self)
        if not isinstance(self.d_rope, int) or self.d_rope < 0:
            raise SpecError(f"d_rope must be a non-negative int, got {self.d_rope!r}")
        _check_common(self)

    h_kv = 1
    layout = LATENT

    @property
    def symbol(self) -> str:
        return "batch_prefill_paged_kv_mla" + ("_sliding_window" if self.sliding_window else "")

    @property
    def d_qk(self) -> int:
        return self.d_latent + self.d_rope

    @property
    def d_v(self) -> int:
        return self.d_latent

    @property
    def name(self) -> str:
        return (
            f"{self.symbol}_hq{self.h_q}_dl{self.d_latent}_dr{self.d_rope}_{self.dtype}"
            f"_ps{self.page_size}_qt{self.q_tile}_kt{self.kv_tile}{self.cap_tag}{self.sinks_tag}{self.kv_tag}"
        )
