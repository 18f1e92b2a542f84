"""Model configs and the kernel variants a model's prefill needs.

``load_model_config`` reads either a Hugging Face ``config.json`` (``num_attention_heads``,
``num_key_value_heads``, ``hidden_size``, ``head_dim``, ``rope_theta``, ``rope_scaling``,
``sliding_window``, ``torch_dtype``; DeepSeek MLA keys ``kv_lora_rank``, ``qk_rope_head_dim``,
``qk_nope_head_dim``, ``v_head_dim``) or the project's own TOML/JSON, whose keys are the
:class:`ModelConfig` field names (``mla`` a table of :class:`MlaConfig` fields).

``specs_for_model`` lists the variants TVM's KV cache instantiates for that model (semantics
§1.6): ragged causal self-attention of the new tokens, paged (or MLA) attention over the cached
prefix, and the dense and masked sequence kernels.
"""

from __future__ import annotations

import dataclasses
import json
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
        elif self.v_head_dim != self.head_dim:
            raise ValueError(f"v_head_dim ({self.v_head_dim}) must equal head_dim ({self.head_dim}) "
                             "without MLA: the paged kernel has one head dim")

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
    if path.suffix == ".toml":
        raw = tomllib.loads(path.read_text())
    else:
        raw = json.loads(path.read_text())
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
    """ModelConfig fields from Hugging Face ``config.json`` keys (unrelated keys are ignored)."""
    h_q = _required(raw, "num_attention_heads")
    h_kv = raw.get("num_key_value_heads") or h_q
    if not isinstance(h_kv, int) or h_kv <= 0 or h_q % h_kv:
        raise ValueError(f"num_key_value_heads: {h_kv!r} must divide num_attention_heads ({h_q})")
    fields = {
        "h_q": h_q,
        "h_kv": h_kv,
        "rope_theta": float(raw.get("rope_theta", DEFAULT_ROPE_THETA)),
        "rope_scaling": _hf_rope_scaling(raw),
        "sliding_window": raw.get("sliding_window") is not None and raw.get("use_sliding_window", True) is not False,
    }
    torch_dtype = raw.get("torch_dtype", raw.get("dtype"))
    if torch_dtype is not None:
        if torch_dtype not in DTYPES:
            raise ValueError(f"torch_dtype: {torch_dtype!r} is not one of {DTYPES} (pass --dtype)")
        fields["dtype"] = torch_dtype
    if raw.get("kv_lora_rank") is not None:
        mla = MlaConfig(**{key: _required(raw, key) for key in
                           ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")})
        fields.update(head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim, mla=mla)
        return fields
    head_dim = raw.get("head_dim") or _required(raw, "hidden_size") // h_q
    fields.update(head_dim=head_dim, v_head_dim=head_dim)
    return fields


def _hf_rope_scaling(raw: dict) -> dict:
    """``rope_scaling`` as a dict (null means plain RoPE); ModelConfig validates its type."""
    value = raw.get("rope_scaling") or {}
    if not isinstance(value, dict):
        raise ValueError(f"rope_scaling: expected an object or null, got {value!r}")
    return value


def _required(raw: dict, key: str):
    if raw.get(key) is None:
        raise ValueError(f"{key}: missing")
    return raw[key]


def specs_for_model(cfg: ModelConfig) -> list:
    """Every kernel variant the model's prefill needs, as TVM's KV cache instantiates them.

    MLA: ragged self-attention with h_kv = h_q and d_qk = nope + rope, d_v = v_head_dim (RoPE is
    applied by the model, so no scaling inside), and the paged MLA kernel over the latent cache.
    Otherwise: ragged and paged with the model's RoPE, the sliding-window paged kernel when the
    model has a window, the dense causal kernel and both masked kernels (sm_scale = d^-0.5).
    """
    if cfg.mla is not None:
        mla = cfg.mla
        return [
            RaggedPrefillSpec(cfg.h_q, cfg.h_q, cfg.head_dim, cfg.v_head_dim, cfg.dtype, rope_scaling={}),
            MlaPagedPrefillSpec(cfg.h_q, mla.kv_lora_rank, mla.qk_rope_head_dim, cfg.dtype, page_size=cfg.page_size),
        ]
    d, sm_scale = cfg.head_dim, cfg.head_dim ** -0.5
    paged = [PagedPrefillSpec(cfg.h_q, cfg.h_kv, d, cfg.dtype, cfg.page_size, cfg.rope_scaling, sliding_window=sw)
             for sw in ((False, True) if cfg.sliding_window else (False,))]
    return [
        RaggedPrefillSpec(cfg.h_q, cfg.h_kv, d, d, cfg.dtype, cfg.rope_scaling),
        *paged,
        SequencePrefillSpec(cfg.h_q, cfg.h_kv, d, cfg.dtype, causal=True, sm_scale=sm_scale),
        *(MaskedSequencePrefillSpec(cfg.h_q, cfg.h_kv, d, cfg.dtype, mask_mode=mode, sm_scale=sm_scale)
          for mode in MASK_MODES),
    ]
