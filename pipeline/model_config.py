"""Model configs and the kernel variants a model's prefill needs.

``load_model_config`` reads either a Hugging Face ``config.json`` or the project's own TOML/JSON,
whose keys are the :class:`ModelConfig` field names (``mla`` a table of :class:`MlaConfig`
fields). From a Hugging Face config it takes exactly the attention each layer runs, read as
transformers reads it: ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` (else
``hidden_size / heads``), ``query_pre_attn_scalar`` (scale ``query_pre_attn_scalar ** -0.5``,
Gemma), ``attn_logit_softcapping`` (Gemma 2), ``sliding_window`` with ``use_sliding_window``,
``layer_types`` (else derived from ``sliding_window_pattern`` as transformers' Gemma 2 / Gemma 3
configs do; both paged variants are built when any layer slides), ``torch_dtype`` (or ``dtype``),
and DeepSeek's MLA keys (``kv_lora_rank``, ``qk_rope_head_dim``, ``qk_nope_head_dim``,
``v_head_dim``; the yarn ``mscale_all_dim`` folds into ``sm_scale``). ``model_type`` ``gpt_oss``
sets ``head_sinks``: every layer has one learned sink logit per query head (transformers'
``GptOssAttention.sinks``, passed to attention as ``s_aux``; semantics §13), so every kernel of
the model takes ``sinks``. ``model_type`` ``llama4`` / ``llama4_text``: chunked-attention layers
(``attention_chunk_size``), NoPE layers (``no_rope_layers``) with their query temperature
(``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``) and RoPE on interleaved pairs
(semantics §16); ``ministral3``: every layer's q rows scaled by position (its rope parameters'
``llama_4_scaling_beta``). What other model types' code changes (NoPE layers, interleaved pairs,
the softmax scale) is in :mod:`.model_types`; a ``model_type`` without a record there is an error.

RoPE comes in either transformers format:

* transformers >= 5: ``rope_parameters``, one flat dict (``{"rope_type": "default", "rope_theta":
  1e6}``, with ``partial_rotary_factor`` inside for StableLM / GPT-NeoX / Phi) or, when its keys
  are layer types of ``layer_types``, one dict per layer type (Gemma 3's ``sliding_attention`` and
  ``full_attention``);
* transformers 4: ``rope_theta``, ``rope_scaling``, ``partial_rotary_factor`` / ``rotary_pct``
  and Gemma 3's ``rope_local_base_freq`` at top level (a truthy ``rope_scaling`` wins over
  ``rope_parameters``, as in transformers; for Gemma 3 it scales the full-attention layers only).

Values inside the dict win; top-level ``rope_theta`` and ``partial_rotary_factor`` fill in missing
ones; llama3 / yarn / longrope without ``original_max_position_embeddings`` take the top-level one
(flat dicts only), else ``max_position_embeddings``. The rope types: ``default``; ``linear``
(the runtime ``rope_scale = 1 / factor``); ``llama3``; ``yarn`` (written with ``truncate`` and an
explicit ``attention_factor``, so the kernels compute transformers' yarn, docs/semantics.md §4);
``longrope`` without per-dimension factors. Any other type (``dynamic``, ``proportional``, ...)
and any key transformers' ``_validate_<type>_rope_parameters`` does not accept is an error naming
it (``rope_parameters.full_attention.foo: unknown key ...``), as is any other key that changes
attention and that the kernels do not implement.

``specs_for_model`` lists the variants TVM's KV cache instantiates for that model (semantics
§1.6): ragged causal self-attention of the new tokens, paged (or MLA) attention over the cached
prefix (both once per distinct compile-time ``rope_scaling`` of its layers), and the dense and
masked sequence kernels.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from ..mlir.specs import DTYPES, freeze_rope_scaling
from .model_types import interleaved, model_type_of, nope_layers

DEFAULT_PAGE_SIZE = 16
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek multi-head latent attention dims (Hugging Face key names)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int


#: The layer types the kernels run (Hugging Face ``layer_types`` values).
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
#: The masked-sequence kernels a model build makes: the seed's two padding modes. A custom mask
#: (speculative-decoding trees, semantics §14) is per call; build it on request.
MODEL_MASK_MODES = ("padded", "causal_padded_left")


@dataclass(frozen=True)
class LayerAttention:
    """The attention one layer runs: q [L, h_q, d_qk] against its keys, RoPE inline.

    ``sliding``: the layer attends through a window of ``window`` tokens (None: the caller's
    runtime window); ``rope_theta`` and ``rope_scale`` are the runtime RoPE scalars,
    ``rope_scaling`` the compile-time dict of its kernels, ``rotary_dim`` the rotating dims (None:
    the whole head), ``sm_scale`` and ``logits_soft_cap`` its softmax scale and cap,
    ``head_sinks`` whether it has per-head sink logits (its kernels take ``sinks [h_q]``).

    ``chunk`` (Llama 4): a chunked-attention layer: a query at position p sees the keys from
    ``p - p % chunk`` to p (its own chunk; entries split at multiples of ``chunk``, semantics
    §16); ``rope`` False, a NoPE layer (Llama 4, SmolLM3, Cohere 2, EXAONE 4): its kernels are
    called with ``rotary_mode`` 0; ``temperature_tuning`` ``(floor_scale, attn_scale,
    position_offset)`` (Llama 4's NoPE layers, every layer of Ministral 3): the caller scales the
    layer's q rows by :meth:`query_scales` before the call, as transformers'
    ``Llama4TextAttention`` and ``Ministral3Attention`` do (after RoPE there: a row's factor
    commutes with its rotation); ``long_rope_scaling``: LongRoPE's long
    table (semantics §11.14), which :meth:`at_length` picks.
    """

    sliding: bool
    window: int | None
    rope_theta: float
    rope_scale: float
    rope_scaling: dict
    rotary_dim: int | None
    sm_scale: float
    logits_soft_cap: float
    head_sinks: bool = False
    chunk: int | None = None
    rope: bool = True
    temperature_tuning: tuple[float, float, float] | None = None
    long_rope_scaling: dict | None = None

    def at_length(self, length: int) -> "LayerAttention":
        """The attention of a call whose sequence reaches ``length`` tokens (its largest position
        plus 1): LongRoPE's long factors (``long_rope_scaling``) past
        ``original_max_position_embeddings``, as transformers switches them
        (``longrope_frequency_update``); self otherwise."""
        if self.long_rope_scaling is None or length <= self.rope_scaling["original_max_position_embeddings"]:
            return self
        return dataclasses.replace(self, rope_scaling=self.long_rope_scaling, long_rope_scaling=None)

    def query_scales(self, positions) -> np.ndarray:
        """float64 ``[n]``: the factor each q row at ``positions [n]`` is multiplied by before the
        call, ``1 + attn_scale * log1p(floor((p + position_offset) / floor_scale))`` (ones without
        ``temperature_tuning``)."""
        positions = np.asarray(positions, dtype=np.float64)
        if self.temperature_tuning is None:
            return np.ones_like(positions)
        floor_scale, attn_scale, offset = self.temperature_tuning
        return 1.0 + attn_scale * np.log1p(np.floor((positions + offset) / floor_scale))


@dataclass(frozen=True)
class ModelConfig:
    """The attention shape of a model. ``head_dim`` is d_qk, ``v_head_dim`` is d_v.

    ``rope_scaling`` is a normalized Hugging Face dict (``rope_type`` key, ``{}`` for plain RoPE);
    ``rope_theta`` is recorded for the caller, since it is a runtime scalar of the kernels.
    ``rope_theta``, ``rope_scaling`` and ``rope_scale`` are the full-attention layers' RoPE; the
    ``local_*`` fields are the sliding-window layers' (None: the same as the full layers').
    ``layer_types`` names each layer's type (:data:`LAYER_TYPES`); None: every layer is
    ``sliding_attention`` when ``sliding_window``, else ``full_attention``. A sliding layer
    attends through a window only when ``sliding_window`` is on (``window`` tokens when known).
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
    #: Runtime RoPE scalar for the caller: 1 / factor of linear scaling.
    rope_scale: float = 1.0
    #: The sliding layers' RoPE where it differs (Gemma 3's ``rope_local_base_freq``; None: as
    #: the full-attention layers).
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    local_rope_scale: float | None = None
    #: LongRoPE's long factors (``rope_scaling`` with their ``ext_factors``) for the calls whose
    #: sequence reaches past ``original_max_position_embeddings``; None: one table (or not LongRoPE).
    long_rope_scaling: dict | None = None
    #: The sliding window in tokens (Hugging Face ``sliding_window``) when any layer slides.
    window: int | None = None
    layer_types: tuple[str, ...] | None = None
    #: Per-head sink logits in every layer (gpt-oss): every kernel takes ``sinks [h_q]``.
    head_sinks: bool = False
    #: The chunk of the ``chunked_attention`` layers in tokens (Hugging Face
    #: ``attention_chunk_size``, Llama 4), set when a layer is chunked.
    attention_chunk: int | None = None
    #: The layers without RoPE (NoPE layers: Llama 4, SmolLM3, Cohere 2, EXAONE 4; by index):
    #: called with ``rotary_mode`` 0.
    nope_layers: tuple[int, ...] = ()
    #: The query temperature, ``(floor_scale, attn_scale, position_offset)``
    #: (:meth:`LayerAttention.query_scales`): Llama 4's ``(floor_scale, attn_scale, 1)`` on its
    #: NoPE layers, Ministral 3's ``(original_max_position_embeddings, llama_4_scaling_beta, 0)``
    #: on every layer (``temperature_layers``); None: off.
    temperature_tuning: tuple[float, float, float] | None = None
    #: The layers the query temperature scales: ``"nope"`` (the NoPE layers) or ``"every"``.
    temperature_layers: str = "nope"

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
        if self.local_rope_scaling is not None:
            object.__setattr__(self, "local_rope_scaling", _normalize_rope(self.local_rope_scaling))
        if self.long_rope_scaling is not None:
            object.__setattr__(self, "long_rope_scaling", _normalize_rope(self.long_rope_scaling))
            if {self.rope_scaling.get("rope_type"), self.long_rope_scaling.get("rope_type")} != {"longrope"}:
                raise ValueError("long_rope_scaling: LongRoPE's long factors need a longrope rope_scaling")
        if self.mla is not None:
            mla = self.mla if isinstance(self.mla, MlaConfig) else MlaConfig(**self.mla)
            object.__setattr__(self, "mla", mla)
            if self.sliding_window or self.attention_chunk:
                key = "sliding_window" if self.sliding_window else "attention_chunk"
                raise ValueError(f"{key}: MLA models with a sliding window or chunks are not supported")
        if self.sm_scale is not None and not self.sm_scale > 0:
            raise ValueError(f"sm_scale: must be positive, got {self.sm_scale!r}")
        if not self.logits_soft_cap >= 0:
            raise ValueError(f"logits_soft_cap: must be >= 0 (0 = off), got {self.logits_soft_cap!r}")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 2 <= self.rotary_dim <= self.head_dim):
            raise ValueError(f"rotary_dim: must be an even int in [2, {self.head_dim}], got {self.rotary_dim!r}")
        if self.head_sinks not in (True, False):
            raise ValueError(f"head_sinks: must be a bool, got {self.head_sinks!r}")
        if self.mla is None and self.v_head_dim != self.head_dim:
            raise ValueError(f"v_head_dim ({self.v_head_dim}) must equal head_dim ({self.head_dim}) "
                             "without MLA: the paged kernel has one head dim")
        self._check_layers()

    def _check_layers(self) -> None:
        """``window`` a positive int only with ``sliding_window``; ``layer_types`` a non-empty
        sequence of :data:`LAYER_TYPES`, stored as a tuple; ``attention_chunk`` a positive int
        exactly when a layer is ``chunked_attention``; ``nope_layers`` layer indices, stored as a
        tuple; ``temperature_tuning`` (floor_scale > 0, attn_scale > 0, position_offset >= 0), on
        the NoPE layers (then some) or on every layer."""
        for key in ("window", "attention_chunk"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{key}: must be a positive int or None, got {value!r}")
        if self.window is not None and not self.sliding_window:
            raise ValueError("window: set, but sliding_window is off")
        if self.layer_types is not None:
            if isinstance(self.layer_types, str) or not self.layer_types:
                raise ValueError(f"layer_types: expected a non-empty list of layer types, got {self.layer_types!r}")
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            unknown = [kind for kind in self.layer_types if kind not in LAYER_TYPES]
            if unknown:
                raise ValueError(f"layer_types: {unknown[0]!r} is not supported; expected {LAYER_TYPES}")
        chunked = "chunked_attention" in (self.layer_types or ())
        if chunked != (self.attention_chunk is not None):
            raise ValueError("attention_chunk: set exactly when a layer is chunked_attention (layer_types)")
        self._check_nope_layers()

    def _check_nope_layers(self) -> None:
        nope = self.nope_layers
        if isinstance(nope, str) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in nope):
            raise ValueError(f"nope_layers: expected layer indices, got {nope!r}")
        object.__setattr__(self, "nope_layers", tuple(sorted(set(nope))))
        if self.layer_types is not None and any(i >= len(self.layer_types) for i in nope):
            raise ValueError(f"nope_layers: {max(nope)} is past the {len(self.layer_types)} layers of layer_types")
        if self.temperature_layers not in ("nope", "every"):
            raise ValueError(f"temperature_layers: 'nope' or 'every', got {self.temperature_layers!r}")
        tuning = self.temperature_tuning
        if tuning is None:
            return
        numbers = len(tuning) == 3 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in tuning)
        if not numbers or not (tuning[0] > 0 and tuning[1] > 0 and tuning[2] >= 0):
            raise ValueError(f"temperature_tuning: expected (floor_scale > 0, attn_scale > 0, position_offset >= 0), "
                             f"got {tuning!r}")
        if self.temperature_layers == "nope" and not nope:
            raise ValueError("temperature_tuning: set on the NoPE layers, but no layer is one (nope_layers)")
        object.__setattr__(self, "temperature_tuning", tuple(float(x) for x in tuning))

    @property
    def attention_scale(self) -> float:
        """The softmax scale every layer uses."""
        return self.head_dim ** -0.5 if self.sm_scale is None else self.sm_scale

    def layer_type(self, i: int) -> str:
        """The type of layer ``i`` (:data:`LAYER_TYPES`)."""
        if i < 0:
            raise IndexError(f"layer {i}: layers count from 0")
        if self.layer_types is not None:
            return self.layer_types[i]
        return "sliding_attention" if self.sliding_window else "full_attention"

    def layer(self, i: int) -> LayerAttention:
        """The attention layer ``i`` runs."""
        return self._attention_of(self.layer_type(i), rope=i not in self.nope_layers)

    def layer_attentions(self) -> list[LayerAttention]:
        """The distinct attentions of the model's layers, full-attention layers first."""
        count = len(self.layer_types) if self.layer_types else max(self.nope_layers, default=0) + 1
        order = sorted(range(count), key=lambda i: LAYER_TYPES.index(self.layer_type(i)))
        attentions = [self.layer(i) for i in order]
        return [a for n, a in enumerate(attentions) if a not in attentions[:n]]

    def _attention_of(self, kind: str, rope: bool = True) -> LayerAttention:
        local = kind == "sliding_attention"

        def pick(local_value, value):
            return local_value if local and local_value is not None else value

        sliding = local and self.sliding_window
        rope_scaling = pick(self.local_rope_scaling, self.rope_scaling)
        return LayerAttention(
            sliding=sliding, window=self.window if sliding else None,
            rope_theta=pick(self.local_rope_theta, self.rope_theta),
            rope_scale=pick(self.local_rope_scale, self.rope_scale),
            rope_scaling=rope_scaling,
            rotary_dim=self.rotary_dim, sm_scale=self.attention_scale, logits_soft_cap=self.logits_soft_cap,
            head_sinks=self.head_sinks, chunk=self.attention_chunk if kind == "chunked_attention" else None,
            rope=rope, temperature_tuning=self.temperature_tuning if not rope or self.temperature_layers == "every"
            else None,
            long_rope_scaling=self.long_rope_scaling if rope_scaling == self.rope_scaling else None)

    def ragged_spec(self, layer: LayerAttention) -> RaggedPrefillSpec:
        """The ragged self-attention kernel ``layer`` runs with its RoPE inline: d_qk = head_dim,
        d_v = v_head_dim (equal without MLA; MLA: h_kv = h_q, the model rotates itself)."""
        h_kv = self.h_q if self.mla is not None else self.h_kv
        return RaggedPrefillSpec(self.h_q, h_kv, self.head_dim, self.v_head_dim, self.dtype, layer.rope_scaling,
                                 logits_soft_cap=layer.logits_soft_cap, rotary_dim=layer.rotary_dim,
                                 head_sinks=layer.head_sinks)

    def to_dict(self) -> dict:
        """The fields as plain JSON-serializable values."""
        fields = dataclasses.asdict(self)
        if self.layer_types is not None:
            fields["layer_types"] = list(self.layer_types)
        fields["nope_layers"] = list(self.nope_layers)
        if self.temperature_tuning is not None:
            fields["temperature_tuning"] = list(self.temperature_tuning)
        return fields


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
    if fields.get("mla") is not None:
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
    kind = model_type_of(raw)
    _reject_unsupported(raw, kind.chunked)
    scaled = {}
    if kind.scaled_queries:
        raw, scaled = _ministral3_temperature(raw)
    slides = _slides(raw)
    layer_types = _hf_layer_types(raw)
    nope = nope_layers(kind, raw, layer_types, slides)
    fields = {
        "h_q": h_q,
        "h_kv": h_kv,
        "sliding_window": slides,
        "window": raw["sliding_window"] if slides else None,
        "layer_types": layer_types,
        "nope_layers": nope,
        "logits_soft_cap": float(raw.get("attn_logit_softcapping") or 0.0),
        "head_sinks": raw.get("model_type") in SINK_MODEL_TYPES,
        **(_llama4_layers(raw, nope) if kind.chunked else {}),
        **scaled,
    }
    torch_dtype = raw.get("torch_dtype", raw.get("dtype"))
    if torch_dtype is not None:
        if torch_dtype not in DTYPES:
            raise ValueError(f"torch_dtype: {torch_dtype!r} is not one of {DTYPES} (pass --dtype)")
        fields["dtype"] = torch_dtype
    if raw.get("kv_lora_rank") is not None:
        return {**fields, **_mla_fields(raw)}
    head_dim = raw.get("head_dim") or _required(raw, "hidden_size") // h_q
    if kind.rotary_dim_key and raw.get("rotary_dim") is not None and raw.get("partial_rotary_factor") is None:
        raw = {**raw, "partial_rotary_factor": raw["rotary_dim"] / head_dim}
    fields.update(head_dim=head_dim, v_head_dim=head_dim, **_hf_rope_fields(raw, fields["layer_types"], head_dim))
    if kind.interleaved:
        fields["rope_scaling"] = interleaved(fields["rope_scaling"])
    if raw.get("query_pre_attn_scalar") is not None:
        fields["sm_scale"] = float(raw["query_pre_attn_scalar"]) ** -0.5
    if kind.scale_key is not None:
        fields["sm_scale"] = float(_required(raw, kind.scale_key))
    return fields


def _mla_fields(raw: dict) -> dict:
    """DeepSeek MLA: the model applies RoPE to its MLA heads; yarn only changes the softmax scale."""
    mla = MlaConfig(**{key: _required(raw, key) for key in
                       ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")})
    head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    rope, _ = _hf_rope_source(raw)
    return dict(head_dim=head_dim, v_head_dim=mla.v_head_dim, mla=mla, rope_scaling={}, rope_scale=1.0,
                rope_theta=float(rope.get("rope_theta") or raw.get("rope_theta") or DEFAULT_ROPE_THETA),
                sm_scale=head_dim ** -0.5 * _deepseek_mscale(rope) ** 2)


def _llama4_layers(raw: dict, nope: tuple[int, ...]) -> dict:
    """Llama 4's layers as ``Llama4TextConfig`` derives them: the rotating layers (all but the
    NoPE layers ``nope``, model_types: ``no_rope_layers``) ``chunked_attention`` over
    ``attention_chunk_size`` tokens (default 8192; None: full) unless ``layer_types`` says
    otherwise, and the NoPE layers' query temperature (``attn_temperature_tuning``, default on,
    with ``floor_scale`` 8192 and ``attn_scale`` 0.1)."""
    chunk = raw.get("attention_chunk_size", 8192)
    layer_types = raw.get("layer_types") or [
        "full_attention" if i in nope or chunk is None else "chunked_attention"
        for i in range(raw["num_hidden_layers"])]
    tuning = None
    if nope and raw.get("attn_temperature_tuning", True):
        tuning = (float(raw.get("floor_scale", 8192)), float(raw.get("attn_scale", 0.1)), 1.0)
    return {"layer_types": tuple(layer_types), "temperature_tuning": tuning,
            "attention_chunk": chunk if "chunked_attention" in layer_types else None}


def _ministral3_temperature(raw: dict) -> tuple[dict, dict]:
    """Ministral 3's query scaling (``get_llama_4_attn_scale``: every layer's q rows times
    ``1 + beta * log1p(floor(p / original_max_position_embeddings))``), read from its rope
    parameters' ``llama_4_scaling_beta``: ``(raw without that key, the ModelConfig fields)``."""
    params, where = _hf_rope_source(raw)
    beta = params.pop("llama_4_scaling_beta", None)
    raw = {**raw, where: params}
    if not beta:
        return raw, {}
    original = params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    if not original:
        raise ValueError(f"{where}.original_max_position_embeddings: missing (llama_4_scaling_beta divides by it)")
    return raw, {"temperature_tuning": (float(original), float(beta), 0.0), "temperature_layers": "every"}


def _hf_layer_types(raw: dict) -> tuple[str, ...] | None:
    """``layer_types``, else derived from the sliding pattern as transformers derives it: Gemma 2
    alternates (every 2nd layer full), Gemma 3 has ``sliding_window_pattern`` (default 6) and
    layer ``i`` is full when ``(i + 1) % pattern == 0``; None when the config has neither."""
    if raw.get("layer_types") is not None:
        return tuple(raw["layer_types"])
    pattern = raw.get("sliding_window_pattern")
    if raw.get("model_type") == "gemma2":
        pattern = 2
    elif raw.get("model_type") in GEMMA3_TYPES:
        pattern = pattern or 6
    if pattern is None:
        return None
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise ValueError(f"sliding_window_pattern: must be a positive int, got {pattern!r}")
    layers = _required(raw, "num_hidden_layers")
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))


GEMMA3_TYPES = ("gemma3", "gemma3_text")

#: Keys each rope type accepts as transformers' ``_validate_<type>_rope_parameters`` do:
#: (required, optional). ``rope_type``, its old name ``type`` and ``partial_rotary_factor`` are
#: accepted by every type.
HF_ROPE_KEYS = {
    "default": ((), ("rope_theta",)),
    "linear": (("factor",), ("rope_theta",)),
    "llama3": (("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
               ("rope_theta",)),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("rope_theta", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"),
                 ("rope_theta", "attention_factor", "factor")),
}
HF_ROPE_ANY_TYPE = ("rope_type", "type", "partial_rotary_factor")
#: Rope types whose dict needs ``original_max_position_embeddings`` (transformers fills it in).
HF_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")


def _hf_rope_fields(raw: dict, layer_types: tuple[str, ...] | None, head_dim: int) -> dict:
    """The RoPE fields of ModelConfig: the full-attention layers' (the sliding ones' when every
    layer slides), ``local_*`` where the sliding layers' differ, and one ``rotary_dim``."""
    ropes = {kind: _kernel_rope(params, where, raw, head_dim)
             for kind, (where, params) in _hf_rope_parameters(raw, layer_types).items()}
    rotary_dims = {rope["rotary_dim"] for rope in ropes.values()}
    if len(rotary_dims) > 1:
        raise ValueError("partial_rotary_factor: differs between layer types; one rotary_dim is supported")
    full = ropes.get("full_attention") or next(iter(ropes.values()))
    local = ropes.get("sliding_attention", full)
    if ropes.get("chunked_attention", full) != full:
        raise ValueError("rope_parameters.chunked_attention: differs from the full layers' RoPE; not supported")
    if local["long_rope_scaling"] != full["long_rope_scaling"]:
        raise ValueError("rope_parameters.sliding_attention: LongRoPE factors that differ by layer type are not "
                         "supported")
    fields = {key: full[key] for key in ("rope_theta", "rope_scaling", "rope_scale", "rotary_dim",
                                         "long_rope_scaling")}
    for key in ("rope_theta", "rope_scaling", "rope_scale"):
        if local[key] != full[key]:
            fields[f"local_{key}"] = local[key]
    return fields


def _hf_rope_parameters(raw: dict, layer_types: tuple[str, ...] | None) -> dict[str, tuple[str, dict]]:
    """``{layer type: (where, params)}``: each layer type's transformers rope dict after
    transformers' standardization (``where`` names it in errors), for the layer types in use."""
    kinds = tuple(dict.fromkeys(layer_types or LAYER_TYPES))
    params, where = _hf_rope_source(raw)
    nested = [key for key in params if key in kinds]
    if not nested:
        flat = _standardize_rope(params, where, raw, nested=False)
        return {kind: (where, flat) for kind in kinds}
    unknown = [key for key in params if key not in LAYER_TYPES]
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown key; per-layer-type RoPE has keys {kinds}")
    out = {}
    for kind in kinds:
        if not isinstance(params.get(kind), dict):
            raise ValueError(f"{where}.{kind}: missing (layers without RoPE are not supported)")
        out[kind] = (f"{where}.{kind}", _standardize_rope(params[kind], f"{where}.{kind}", raw, nested=True))
    return out


def _hf_rope_source(raw: dict) -> tuple[dict, str]:
    """(the rope dict transformers starts from, its name): a truthy ``rope_scaling`` (the old
    format) wins over ``rope_parameters``; Gemma 3 nests it per layer type with its own thetas."""
    for key in ("rope_scaling", "rope_parameters"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ValueError(f"{key}: expected an object or null, got {raw[key]!r}")
    old, params = raw.get("rope_scaling"), raw.get("rope_parameters")
    gemma3 = raw.get("model_type") in GEMMA3_TYPES or "rope_local_base_freq" in raw
    if gemma3 and (params is None or "full_attention" in params):
        return _gemma3_rope(raw, params, old), "rope_parameters"
    if old:
        return dict(old), "rope_scaling"
    return dict(params or {}), "rope_parameters"


def _gemma3_rope(raw: dict, params: dict | None, old: dict | None) -> dict:
    """Gemma 3's rope dicts as its transformers config builds them: ``rope_scaling`` updates the
    full-attention dict; thetas default to ``rope_theta`` (else 1e6) for full attention and
    ``rope_local_base_freq`` (else 1e4) for sliding layers."""
    params = {key: dict(value) if isinstance(value, dict) else value for key, value in (params or {}).items()}
    full = params.get("full_attention") or {"rope_type": "default"}
    local = params.get("sliding_attention") or {"rope_type": "default"}
    full.update(old or {})
    full.setdefault("rope_theta", raw.get("rope_theta") or 1e6)
    local.setdefault("rope_theta", raw.get("rope_local_base_freq") or 1e4)
    return {**params, "full_attention": full, "sliding_attention": local}


def _standardize_rope(params: dict, where: str, raw: dict, *, nested: bool) -> dict:
    """One rope dict as transformers' ``convert_rope_params_to_dict`` / ``standardize_rope_params``
    leave it: ``rope_type`` set, top-level ``rope_theta`` / ``partial_rotary_factor`` (or
    ``rotary_pct``) filling missing ones, ``original_max_position_embeddings`` filled for the
    types that need it; then checked against :data:`HF_ROPE_KEYS`."""
    params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.pop("type", None) or "default"
    params.pop("type", None)
    if params.get("rope_theta") is None:
        params["rope_theta"] = raw.get("rope_theta") or DEFAULT_ROPE_THETA
    partial = raw.get("partial_rotary_factor", raw.get("rotary_pct"))
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    kind = params["rope_type"]
    _check_rope_keys(params, where)
    if kind in HF_ORIGINAL_LENGTH_TYPES and params.get("original_max_position_embeddings") is None:
        top = None if nested else raw.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = top or _required(raw, "max_position_embeddings")
    return params


def _check_rope_keys(params: dict, where: str) -> None:
    """A supported ``rope_type``, no key the type does not accept."""
    kind = params["rope_type"]
    if kind not in HF_ROPE_KEYS:
        raise ValueError(f"{where}.rope_type: {kind!r} is not supported by these kernels; "
                         f"expected one of {tuple(HF_ROPE_KEYS)}")
    required, optional = HF_ROPE_KEYS[kind]
    for key in params:
        if key not in required + optional + HF_ROPE_ANY_TYPE:
            raise ValueError(f"{where}.{key}: unknown key for rope_type {kind!r}; "
                             f"expected some of {sorted(required + optional + HF_ROPE_ANY_TYPE)}")
    for key in required:
        if key not in params and key != "original_max_position_embeddings":
            raise ValueError(f"{where}.{key}: missing (rope_type {kind!r})")


def _kernel_rope(params: dict, where: str, raw: dict, head_dim: int) -> dict:
    """One standardized rope dict as the kernels take it: ``rope_theta`` and ``rope_scale``
    (runtime), ``rope_scaling`` (compile time), ``long_rope_scaling`` (LongRoPE's long factors,
    else None) and ``rotary_dim``."""
    kind = params["rope_type"]
    rope_scale, scaling, long_scaling = 1.0, {}, None
    rotary_dim = _rotary_dim(params.get("partial_rotary_factor"), head_dim, where)
    if kind == "linear":
        rope_scale = 1.0 / float(params["factor"])
    elif kind == "llama3":
        scaling = {key: params[key] for key in ("rope_type",) + HF_ROPE_KEYS["llama3"][0]}
    elif kind == "yarn":
        scaling = _kernel_yarn(params, raw)
    elif kind == "longrope":
        scaling, long_scaling = _kernel_longrope(params, where, raw, (rotary_dim or head_dim) // 2)
    return {"rope_theta": float(params["rope_theta"]), "rope_scale": rope_scale, "rope_scaling": scaling,
            "long_rope_scaling": long_scaling, "rotary_dim": rotary_dim}


def _kernel_yarn(params: dict, raw: dict) -> dict:
    """transformers' yarn (``_compute_yarn_parameters``) in the kernels' keys: a missing factor is
    ``max_position_embeddings / original``; ``beta_fast`` / ``beta_slow`` 32 / 1 unless set (0 or
    None too); ``truncate`` True unless false; ``attention_factor`` given, else the ratio of the
    ``mscale`` / ``mscale_all_dim`` corrections when both are set, else ``0.1 ln(factor) + 1``."""
    orig = params["original_max_position_embeddings"]
    factor = params["factor"]
    if factor is None:
        factor = _required(raw, "max_position_embeddings") / orig
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = _yarn_mscale(factor, 1.0)
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": orig,
            "beta_fast": params.get("beta_fast") or 32, "beta_slow": params.get("beta_slow") or 1,
            "truncate": bool(params.get("truncate", True)), "attention_factor": float(attention_factor)}


def _yarn_mscale(factor: float, mscale: float) -> float:
    """transformers' yarn ``get_mscale``: ``0.1 * mscale * ln(factor) + 1``, 1 for factor <= 1."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _kernel_longrope(params: dict, where: str, raw: dict, pairs: int) -> tuple[dict, dict | None]:
    """transformers' LongRoPE (``_compute_longrope_parameters``) in the kernels' keys, as two
    rope dicts: the short factors' (``ext_factors``, left out when all 1) and the long ones' (None
    when they are the short ones), with the multiplier ``sqrt(1 + ln(factor) / ln(original))``,
    factor given or ``max_position_embeddings / original``. A call takes the long dict when its
    sequence reaches past ``original_max_position_embeddings`` (:meth:`LayerAttention.at_length`)."""
    if params.get("attention_factor") is not None:
        raise ValueError(f"{where}.attention_factor: an explicit LongRoPE attention_factor is not supported")
    orig = params["original_max_position_embeddings"]
    factor = params.get("factor") or _required(raw, "max_position_embeddings") / orig
    base = {"rope_type": "longrope", "original_max_position_embeddings": orig,
            "max_position_embeddings": float(factor) * orig}
    tables = []
    for key in ("short_factor", "long_factor"):
        factors = [float(f) for f in params.get(key) or [1.0] * pairs]
        if len(factors) != pairs:
            raise ValueError(f"{where}.{key}: {len(factors)} factors; the rotary dims have {pairs} pairs")
        tables.append(base if all(f == 1.0 for f in factors) else {**base, "ext_factors": factors})
    short, long = tables
    return short, (None if long == short else long)


#: Hugging Face keys that change a layer's attention in ways the kernels do not implement.
#: Hugging Face model types whose attention layers have per-head sink logits.
SINK_MODEL_TYPES = ("gpt_oss",)
UNSUPPORTED_ATTENTION_KEYS = {
    "alibi": "ALiBi position biases",
    "use_alibi": "ALiBi position biases",
    "alibi_bias_max": "ALiBi position biases",
    "attention_chunk_size": "chunked attention outside Llama 4 (model_type llama4)",
    "attn_temperature_tuning": "query temperature scaling outside Llama 4 (model_type llama4)",
    "attn_scale": "query temperature scaling outside Llama 4 (model_type llama4)",
}
#: The keys of UNSUPPORTED_ATTENTION_KEYS that Llama 4's configs hold and :func:`_llama4_layers` reads.
LLAMA4_KEYS = ("attention_chunk_size", "attn_temperature_tuning", "attn_scale")


def _reject_unsupported(raw: dict, chunked: bool) -> None:
    """An error naming the first key of :data:`UNSUPPORTED_ATTENTION_KEYS` that is set (Llama 4's
    own keys are read for Llama 4's model types: ``chunked``)."""
    for key, what in UNSUPPORTED_ATTENTION_KEYS.items():
        if chunked and key in LLAMA4_KEYS:
            continue
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


def _rotary_dim(factor, head_dim: int, where: str) -> int | None:
    """``partial_rotary_factor`` times head_dim, None for 1 (or None)."""
    if factor is None or float(factor) == 1.0:
        return None
    rotary_dim = int(head_dim * float(factor))
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"{where}.partial_rotary_factor: {factor} x head_dim {head_dim} must give an even "
                         "number of dims")
    return rotary_dim


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
    Otherwise, for each distinct compile-time ``rope_scaling`` of the layers (full-attention
    layers' first): ragged and paged with that RoPE (partial when ``rotary_dim``), the paged ones
    with and without the sliding window when any layer slides; then the dense causal kernel and
    both masked kernels (``attention_scale``); every spec carries the model's logits soft cap and
    ``head_sinks``.
    """
    sinks = cfg.head_sinks
    if cfg.mla is not None:
        mla = cfg.mla
        return [
            cfg.ragged_spec(cfg.layer(0)),
            MlaPagedPrefillSpec(cfg.h_q, mla.kv_lora_rank, mla.qk_rope_head_dim, cfg.dtype, page_size=cfg.page_size,
                                head_sinks=sinks),
        ]
    d, sm_scale, cap = cfg.head_dim, cfg.attention_scale, cfg.logits_soft_cap
    ropes = _distinct_ropes(cfg)
    windows = (False, True) if cfg.sliding_window or cfg.attention_chunk else (False,)
    return [
        *(cfg.ragged_spec(layer) for layer in ropes),
        *(PagedPrefillSpec(cfg.h_q, cfg.h_kv, d, cfg.dtype, cfg.page_size, layer.rope_scaling, sliding_window=sw,
                           logits_soft_cap=cap, rotary_dim=layer.rotary_dim, head_sinks=sinks)
          for layer in ropes for sw in windows),
        SequencePrefillSpec(cfg.h_q, cfg.h_kv, d, cfg.dtype, causal=True, sm_scale=sm_scale, logits_soft_cap=cap,
                            head_sinks=sinks),
        *(MaskedSequencePrefillSpec(cfg.h_q, cfg.h_kv, d, cfg.dtype, mask_mode=mode, sm_scale=sm_scale,
                                    logits_soft_cap=cap, head_sinks=sinks)
          for mode in MODEL_MASK_MODES),
    ]


def _distinct_ropes(cfg: ModelConfig) -> list[LayerAttention]:
    """One layer attention per distinct compile-time ``rope_scaling``, in layer-type order, then
    their LongRoPE long tables'."""
    layers = cfg.layer_attentions()
    layers += [layer.at_length(math.inf) for layer in layers if layer.long_rope_scaling is not None]
    return [layer for n, layer in enumerate(layers)
            if all(layer.rope_scaling != other.rope_scaling for other in layers[:n])]
