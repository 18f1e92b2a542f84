"""Model configs and the kernel variants a model's prefill needs.

``load_model_config`` reads either a Hugging Face ``config.json`` or the project's own TOML/JSON,
whose keys are the :class:`ModelConfig` field names (``mla`` a table of :class:`MlaConfig`
fields). From a Hugging Face config it takes exactly the attention each layer runs:
``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` (else ``hidden_size / heads``),
``query_pre_attn_scalar`` (scale ``query_pre_attn_scalar ** -0.5``, Gemma), ``attn_logit_softcapping``
(Gemma 2), ``partial_rotary_factor`` / ``rotary_pct`` (Phi, StableLM, GPT-NeoX),
``rope_theta``, ``rope_local_base_freq`` (Gemma 3's sliding layers), ``rope_scaling`` (``linear``
becomes the runtime ``rope_scale``), ``sliding_window`` with ``use_sliding_window``,
``sliding_window_pattern`` or ``layer_types`` (both paged variants are built when any layer
slides), ``torch_dtype``, and DeepSeek's MLA keys (``kv_lora_rank``, ``qk_rope_head_dim``,
``qk_nope_head_dim``, ``v_head_dim``; the yarn ``mscale_all_dim`` folds into ``sm_scale``). A key
that changes attention and that the kernels do not implement is an error naming the key.

``specs_for_model`` lists the variants TVM's KV cache instantiates for that model (semantics
§1.6): ragged causal self-attention of the new tokens, paged (or MLA) attention over the cached
prefix, and the dense and masked sequence kernels.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from ..mlir.specs import DTYPES, MASK_MODES, freeze_rope_scaling

DEFAULT_PAGE_SIZE = 16
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek multi-head latent attention dims (Hugging Face key names)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelConfig:
    """The attention shape of a model. ``head_dim`` is d_qk, ``v_head_dim`` is d_v.

    ``rope_scaling`` is a normalized Hugging Face dict (``rope_type`` key, ``{}`` for plain RoPE);
    ``rope_theta`` is recorded for the caller, since it is a runtime scalar of the kernels.
    """

    name: str
    h_q: int
    h_kv: int
    head_dim: int
    v_head_dim: int
    dtype: str
    page_size: int = DEFAULT_PAGE_SIZE
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict = field(default_factory=dict)
    sliding_window: bool = False
    mla: MlaConfig | None = None
    #: Softmax scale of every layer; None: head_dim ** -0.5. A compile-time field of the dense
    #: kernels, a runtime argument the caller passes to the KV-cache kernels.
    sm_scale: float | None = None
    logits_soft_cap: float = 0.0
    rotary_dim: int | None = None
    #: Runtime RoPE scalars for the caller: ``rope_scale`` (1 / factor of linear scaling) and the
    #: theta of sliding-window layers when it differs (Gemma 3's ``rope_local_base_freq``).
    rope_scale: float = 1.0
    local_rope_theta: float | None = None

    def __post_init__(self):
        for key in ("h_q", "h_kv", "head_dim", "v_head_dim", "page_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        if self.h_q % self.h_kv:
            raise ValueError(f"h_kv: h_q ({self.h_q}) must be a multiple of h_kv ({self.h_kv})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {DTYPES}, got {self.dtype!r}")
        object.__setattr__(self, "rope_scaling", _normalize_rope(self.rope_scaling))
        if self.mla is not None:
            mla = self.mla if isinstance(self.mla, MlaConfig) else MlaConfig(**self.mla)
            object.__setattr__(self, "mla", mla)
            if self.sliding_window:
                raise ValueError("sliding_window: MLA models with a sliding window are not supported")
        if self.sm_scale is not None and not self.sm_scale > 0:
            raise ValueError(f"sm_scale: must be positive, got {self.sm_scale!r}")
        if not self.logits_soft_cap >= 0:
            raise ValueError(f"logits_soft_cap: must be >= 0 (0 = off), got {self.logits_soft_cap!r}")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 2 <= self.rotary_dim <= self.head_dim):
            raise ValueError(f"rotary_dim: must be an even int in [2, {self.head_dim}], got {self.rotary_dim!r}")
        if self.mla is None and self.v_head_dim != self.head_dim:
            raise ValueError(f"v_head_dim ({self.v_head_dim}) must equal head_dim ({self.head_dim}) "
                             "without MLA: the paged kernel has one head dim")

    @property
    def attention_scale(self) -> float:
        """The softmax scale every layer uses."""
        return self.head_dim ** -0.5 if self.sm_scale is None else self.sm_scale

    def to_dict(self) -> dict:
        """The fields as plain JSON-serializable values."""
        return dataclasses.asdict(self)


def _normalize_rope(rope_scaling) -> dict:
    """A validated rope_scaling dict with ``rope_type``; plain RoPE (``default``) becomes ``{}``."""
    items = dict(freeze_rope_scaling(rope_scaling))
    return {} if items.get("rope_type", "default") == "default" else items


def load_model_config(path, *, dtype: str | None = None, page_size: int | None = None) -> ModelConfig:
    """A ModelConfig from a Hugging Face ``config.json`` or a project TOML/JSON file.

    ``dtype`` and ``page_size`` override the file. Missing or unsupported keys raise
    ``ValueError`` naming the key and the file.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"{path}: cannot read the model config ({err.strerror or err})") from None
    try:
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: line {err.lineno}, column {err.colno}: malformed JSON ({err.msg})") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: malformed TOML: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object or TOML table")
    try:
        native = "h_q" in raw
        fields = _native_fields(raw) if native else _hf_fields(raw)
        fields.setdefault("name", path.stem)
        if dtype is not None:
            fields["dtype"] = dtype
        if page_size is not None:
            fields["page_size"] = page_size
        if "dtype" not in fields:
            raise ValueError(f"{'dtype' if native else 'torch_dtype'}: missing (or pass --dtype)")
        return ModelConfig(**fields)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path}: {err}") from None


def _native_fields(raw: dict) -> dict:
    """The project's own format: ModelConfig field names; ``v_head_dim`` defaults to ``head_dim``."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown key; expected some of {sorted(known)}")
    for key in ("h_q", "h_kv", "head_dim"):
        if key not in raw:
            raise ValueError(f"{key}: missing")
    fields = dict(raw)
    fields.setdefault("v_head_dim", fields["head_dim"])
    if "mla" in fields:
        mla_keys = {f.name for f in dataclasses.fields(MlaConfig)}
        bad = sorted(set(fields["mla"]) ^ mla_keys)
        if bad:
            raise ValueError(f"mla.{bad[0]}: the mla table needs exactly {sorted(mla_keys)}")
    return fields


def _hf_fields(raw: dict) -> dict:
    """ModelConfig fields from Hugging Face ``config.json`` keys (unrelated keys are ignored; a
    multimodal config's ``text_config`` holds the language model's)."""
    if "num_attention_heads" not in raw and isinstance(raw.get("text_config"), dict):
        raw = {"torch_dtype": raw.get("torch_dtype"), **raw["text_config"]}
    h_q = _required(raw, "num_attention_heads")
    h_kv = raw.get("num_key_value_heads") or h_q
    if not isinstance(h_kv, int) or h_kv <= 0 or h_q % h_kv:
        raise ValueError(f"num_key_value_heads: {h_kv!r} must divide num_attention_heads ({h_q})")
    _reject_unsupported(raw)
    mla_model = raw.get("kv_lora_rank") is not None  # applies RoPE itself: rope_scaling set below
    rope_scaling, rope_scale = ({}, 1.0) if mla_model else _hf_rope_scaling(raw)
    fields = {
        "h_q": h_q,
        "h_kv": h_kv,
        "rope_theta": float(raw.get("rope_theta", DEFAULT_ROPE_THETA)),
        "rope_scaling": rope_scaling,
        "rope_scale": rope_scale,
        "sliding_window": _slides(raw),
        "logits_soft_cap": float(raw.get("attn_logit_softcapping") or 0.0),
    }
    if raw.get("rope_local_base_freq") is not None:
        fields["local_rope_theta"] = float(raw["rope_local_base_freq"])
    torch_dtype = raw.get("torch_dtype", raw.get("dtype"))
    if torch_dtype is not None:
        if torch_dtype not in DTYPES:
            raise ValueError(f"torch_dtype: {torch_dtype!r} is not one of {DTYPES} (pass --dtype)")
        fields["dtype"] = torch_dtype
    if mla_model:
        mla = MlaConfig(**{key: _required(raw, key) for key in
                           ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")})
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        # The model applies RoPE to its MLA heads; yarn only changes the softmax scale there.
        fields.update(head_dim=head_dim, v_head_dim=mla.v_head_dim, mla=mla, rope_scaling={}, rope_scale=1.0,
                      sm_scale=head_dim ** -0.5 * _deepseek_mscale(raw.get("rope_scaling") or {}) ** 2)
        return fields
    head_dim = raw.get("head_dim") or _required(raw, "hidden_size") // h_q
    fields.update(head_dim=head_dim, v_head_dim=head_dim, rotary_dim=_rotary_dim(raw, head_dim))
    if raw.get("query_pre_attn_scalar") is not None:
        fields["sm_scale"] = float(raw["query_pre_attn_scalar"]) ** -0.5
    return fields


#: Hugging Face keys that change a layer's attention in ways the kernels do not implement.
UNSUPPORTED_ATTENTION_KEYS = {
    "alibi": "ALiBi position biases",
    "use_alibi": "ALiBi position biases",
    "alibi_bias_max": "ALiBi position biases",
    "attention_chunk_size": "chunked attention (Llama 4)",
    "attn_temperature_tuning": "query temperature scaling (Llama 4)",
    "attn_scale": "query temperature scaling (Llama 4)",
}


def _reject_unsupported(raw: dict) -> None:
    for key, what in UNSUPPORTED_ATTENTION_KEYS.items():
        if raw.get(key) not in (None, False, 0):
            raise ValueError(f"{key}: {what} is not supported by these kernels")


def _slides(raw: dict) -> bool:
    """Whether any layer attends through a sliding window."""
    if raw.get("sliding_window") is None or raw.get("use_sliding_window", True) is False:
        return False
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        return "sliding_attention" in layer_types
    return True


def _rotary_dim(raw: dict, head_dim: int) -> int | None:
    """``partial_rotary_factor`` (or GPT-NeoX's ``rotary_pct``) times head_dim, None for 1."""
    factor = raw.get("partial_rotary_factor", raw.get("rotary_pct"))
    if factor is None or float(factor) == 1.0:
        return None
    rotary_dim = int(head_dim * float(factor))
    if rotary_dim <= 0 or rotary_dim % 2:
        key = "partial_rotary_factor" if "partial_rotary_factor" in raw else "rotary_pct"
        raise ValueError(f"{key}: {factor} x head_dim {head_dim} must give an even number of dims")
    return rotary_dim


def _hf_rope_scaling(raw: dict) -> tuple[dict, float]:
    """(``rope_scaling`` for the kernels, runtime ``rope_scale``): null is plain RoPE, ``linear``
    scaling becomes ``rope_scale = 1 / factor``; per-dimension LongRoPE factors and unknown types
    are errors naming the key (ModelConfig validates the rest)."""
    value = raw.get("rope_scaling") or {}
    if not isinstance(value, dict):
        raise ValueError(f"rope_scaling: expected an object or null, got {value!r}")
    kind = value.get("rope_type") or value.get("type") or "default"
    if kind == "linear":
        return {}, 1.0 / float(_required(value, "factor"))
    for key in ("short_factor", "long_factor"):
        factors = value.get(key)
        if factors is not None and any(float(f) != 1.0 for f in factors):
            raise ValueError(f"rope_scaling.{key}: per-dimension LongRoPE factors are not supported")
    for key in ("mscale", "mscale_all_dim"):
        if value.get(key) not in (None, 0, 1, 1.0):
            raise ValueError(f"rope_scaling.{key}: yarn attention scaling outside MLA is not supported")
    kept = {key: item for key, item in value.items() if key not in ("short_factor", "long_factor")}
    return kept, 1.0


def _deepseek_mscale(rope_scaling: dict) -> float:
    """DeepSeek's yarn softmax correction: ``0.1 * mscale_all_dim * ln(factor) + 1`` (1 without)."""
    factor, mscale_all_dim = rope_scaling.get("factor", 1.0), rope_scaling.get("mscale_all_dim", 0)
    if not mscale_all_dim or factor <= 1:
        return 1.0
    return 0.1 * mscale_all_dim * math.log(factor) + 1.0


def _required(raw: dict, key: str):
    if raw.get(key) is None:
        raise ValueError(f"{key}: missing")
    return raw[key]


def specs_for_model(cfg: ModelConfig) -> list:
    """Every kernel variant the model's prefill needs, as TVM's KV cache instantiates them.

    MLA: ragged self-attention with h_kv = h_q and d_qk = nope + rope, d_v = v_head_dim (RoPE is
    applied by the model, so no scaling inside), and the paged MLA kernel over the latent cache.
    Otherwise: ragged and paged with the model's RoPE (partial when ``rotary_dim``), the
    sliding-window paged kernel when any layer slides, the dense causal kernel and both masked
    kernels (``attention_scale``); every spec carries the model's logits soft cap.
    """
    if cfg.mla is not None:
        mla = cfg.mla
        return [
            RaggedPrefillSpec(cfg.h_q, cfg.h_q, cfg.head_dim, cfg.v_head_dim, cfg.dtype, rope_scaling={}),
            MlaPagedPrefillSpec(cfg.h_q, mla.kv_lora_rank, mla.qk_rope_head_dim, cfg.dtype, page_size=cfg.page_size),
        ]
    d, sm_scale, cap = cfg.head_dim, cfg.attention_scale, cfg.logits_soft_cap
    paged = [PagedPrefillSpec(cfg.h_q, cfg.h_kv, d, cfg.dtype, cfg.page_size, cfg.rope_scaling, sliding_window=sw,
                              logits_soft_cap=cap, rotary_dim=cfg.rotary_dim)
             for sw in ((False, True) if cfg.sliding_window else (False,))]
    return [
        RaggedPrefillSpec(cfg.h_q, cfg.h_kv, d, d, cfg.dtype, cfg.rope_scaling, logits_soft_cap=cap,
                          rotary_dim=cfg.rotary_dim),
        *paged,
        SequencePrefillSpec(cfg.h_q, cfg.h_kv, d, cfg.dtype, causal=True, sm_scale=sm_scale, logits_soft_cap=cap),
        *(MaskedSequencePrefillSpec(cfg.h_q, cfg.h_kv, d, cfg.dtype, mask_mode=mode, sm_scale=sm_scale,
                                    logits_soft_cap=cap)
          for mode in MASK_MODES),
    ]
