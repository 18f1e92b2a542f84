"""How a Hugging Face model type's attention differs from Llama's, as transformers (5.24) runs it.

``load_model_config`` (pipeline/model_config.py) reads a ``config.json`` by its keys; some model
types also change attention in their code, where no key says so. Each model type the loader reads
has a :class:`ModelType` here (:data:`MODEL_TYPES`); any other ``model_type`` is an error naming it,
so that a model whose attention the record does not describe is refused instead of built wrong.
A config without ``model_type`` is read by its keys alone.

What the records say (every model type here but four checked against transformers' own layers
by tests/test_hf_layers.py or tests/test_model_configs.py; those four share a checked type's
attention code: Mixtral's is Mistral's, Qwen2-MoE's Llama's, Qwen3-MoE's Qwen3's in transformers'
modular files, and GLM rotates interleaved pairs as GLM-4 does):

* ``interleaved``: RoPE rotates the pairs ``(2i, 2i + 1)`` (Cohere, GLM, ERNIE 4.5, Helium and Llama 4:
  their ``rotate_half`` takes ``x[..., ::2]``); written as the kernels' ``gptj`` / ``llama4``;
* ``nope``: the layers that do not rotate (their kernels run with ``rotary_mode`` 0):
  ``"no_rope_layers"`` the 0s of ``no_rope_layers`` (else every ``no_rope_layer_interval``-th,
  default 4: SmolLM3, Llama 4), ``"unwindowed"`` the layers without a sliding window (Cohere 2:
  every layer when the model has no window), ``"unwindowed_if_windowed"`` the same when the model
  has a window, none otherwise (EXAONE 4);
* ``scale_key``: the key holding the softmax scale (Granite's ``attention_multiplier``);
* ``chunked``: Llama 4's chunked layers and query temperature (``model_config._llama4_layers``);
* ``scaled_queries``: every layer's q rows scaled by position (Ministral 3: its rope parameters'
  ``llama_4_scaling_beta``, ``model_config._ministral3_temperature``);
* ``rotary_dim_key``: partial rotary as a count of dims, ``rotary_dim`` (MiniMax-M2's released
  checkpoints), where ``partial_rotary_factor`` is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelType", "MODEL_TYPES", "model_type_of", "nope_layers", "interleaved"]


@dataclass(frozen=True)
class ModelType:
    """What a model type's attention does beyond its config's keys (module docstring)."""

    interleaved: bool = False
    nope: str | None = None
    scale_key: str | None = None
    chunked: bool = False
    scaled_queries: bool = False
    rotary_dim_key: bool = False


PLAIN = ModelType()
MODEL_TYPES = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi", "phi3",
                     "stablelm", "gemma", "gemma2", "gemma3", "gemma3_text", "deepseek_v2", "deepseek_v3", "gpt_oss",
                     "olmo2", "olmo3", "apertus", "starcoder2", "seed_oss", "glm4_moe", "olmo", "olmoe", "phimoe",
                     "arcee", "solar_open"), PLAIN),
    **dict.fromkeys(("cohere", "glm", "glm4", "ernie4_5", "helium"), ModelType(interleaved=True)),
    "cohere2": ModelType(interleaved=True, nope="unwindowed"),
    "exaone4": ModelType(nope="unwindowed_if_windowed"),
    "smollm3": ModelType(nope="no_rope_layers"),
    **dict.fromkeys(("granite", "granitemoe"), ModelType(scale_key="attention_multiplier")),
    "ministral3": ModelType(scaled_queries=True),
    "minimax_m2": ModelType(rotary_dim_key=True),
    "llama4": ModelType(interleaved=True, nope="no_rope_layers", chunked=True),
    "llama4_text": ModelType(interleaved=True, nope="no_rope_layers", chunked=True),
}


def model_type_of(raw: dict) -> ModelType:
    """The record of ``raw``'s ``model_type`` (:data:`PLAIN` without one); ValueError naming an
    unknown one."""
    name = raw.get("model_type")
    if name is None:
        return PLAIN
    if name not in MODEL_TYPES:
        raise ValueError(f"model_type: {name!r} is not one whose attention this loader knows "
                         f"({', '.join(sorted(MODEL_TYPES))}); its attention may differ from what the "
                         "keys say: describe it in the project's TOML format instead")
    return MODEL_TYPES[name]


def nope_layers(kind: ModelType, raw: dict, layer_types: tuple[str, ...] | None, windowed: bool) -> tuple[int, ...]:
    """The indices of the layers without RoPE (module docstring); ``windowed``: the model has a
    sliding window."""
    if kind.nope == "no_rope_layers":
        layers = raw.get("num_hidden_layers")
        if not isinstance(layers, int) or layers <= 0:
            raise ValueError(f"num_hidden_layers: expected a positive int, got {layers!r}")
        interval = raw.get("no_rope_layer_interval") or 4
        rotates = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        if len(rotates) != layers or any(flag not in (0, 1) for flag in rotates):
            raise ValueError(f"no_rope_layers: expected {layers} flags of 0 or 1, got {rotates!r}")
        return tuple(i for i, flag in enumerate(rotates) if not flag)
    if kind.nope == "unwindowed" or (kind.nope == "unwindowed_if_windowed" and windowed):
        if layer_types is None:
            raise ValueError("layer_types: missing (it says which layers rotate)")
        return tuple(i for i, layer in enumerate(layer_types) if not windowed or layer != "sliding_attention")
    return ()


def interleaved(rope_scaling: dict) -> dict:
    """The kernels' form of ``rope_scaling`` for a model that rotates the pairs (2i, 2i + 1):
    plain RoPE is ``gptj``, llama3's bands ``llama4``; other scalings have no interleaved form."""
    kind = rope_scaling.get("rope_type", "default")
    if kind not in ("default", "llama3"):
        raise ValueError(f"rope_scaling.rope_type: {kind!r} on interleaved pairs is not supported "
                         "(default, linear or llama3)")
    return {**rope_scaling, "rope_type": "llama4" if kind == "llama3" else "gptj"}
