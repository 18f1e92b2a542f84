"""The config a transformers model saves builds, through ``load_model_config``, the attention its
layers run: every layer's ragged kernel, RoPE inline on the pre-RoPE q and k the layer computed,
gives the layer's eager attention output.

Per layer: the kernel's output is within its error bound of the float64 reference of the same
call (the reference applies the loaded config's RoPE), and so is eager's output (eager rotates
and accumulates in float32 too; measured at 0.01-0.03 of the bound). Measured sensitivity: theta
off by 5% puts eager 80-700 bounds from the reference, sm_scale off by 2% 360-660 bounds.

Llama 4 (tests/hf_models.py): its chunked layer runs one entry per chunk, its NoPE layer
``rotary_mode`` 0 on q scaled by the config's query temperature (semantics §16). Each of these
read wrong fails it: half-split pairs instead of interleaved ones, the temperature left out, the
chunks left out. The model types whose code changes attention (pipeline/model_types.py: SmolLM3,
Cohere 2 and EXAONE 4's NoPE layers, interleaved pairs of Cohere, GLM-4 and ERNIE 4.5, Granite's
scale) each fail it read as a plain Llama; Qwen3, OLMo 2 and 3 and Apertus normalise q and k
before RoPE (q and k recorded after the norms); Ministral 3's q rows are scaled by the config's
query temperature (off by one position, it fails).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # CI installs the hf extra: these never skip there
transformers = pytest.importorskip("transformers")

from linalg_prefill.mlir import RaggedPrefillSpec  # noqa: E402
from linalg_prefill.pipeline.model_config import load_model_config  # noqa: E402
from linalg_prefill.runtime import error_bound, open_kernel  # noqa: E402
from linalg_prefill.runtime.compare import reference_for  # noqa: E402

from conftest import assert_matches_reference  # noqa: E402
from hf_models import LLAMA3, LONGROPE, tiny_model  # noqa: E402

#: How far eager may be from the float64 reference, in units of the kernel's bound.
EAGER_BOUNDS = 1.0
MODULES = {"llama3": "llama", "qwen2": "qwen2", "qwen2-yarn": "qwen2", "gemma2": "gemma2", "llama4": "llama4",
           "llama-longrope": "llama",
           **{family: family for family in ("smollm3", "cohere2", "exaone4", "granite", "glm4", "cohere", "ernie4_5",
                                            "qwen3", "olmo2", "olmo3", "apertus", "granitemoe", "phi", "starcoder2",
                                            "seed_oss", "gemma", "ministral3", "glm4_moe", "minimax_m2", "olmo", "olmoe",
                                            "phimoe", "helium", "arcee", "solar_open")}}
#: The kernels no other test compiles: those of the families on interleaved pairs (Llama 4's with
#: llama3's bands; Cohere's, Cohere 2's, ERNIE 4.5's and Helium's plain; GLM-4's plain on half the head) and
#: Phi-2's (half the head, half-split pairs), the long LongRoPE table of 41 tokens and Ministral 3's
#: yarn.
OWN_SPECS = {
    "phi": RaggedPrefillSpec(4, 2, 16, 16, "float32", rotary_dim=8),
    "ministral3": RaggedPrefillSpec(4, 2, 16, 16, "float32", {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": True, "attention_factor": 1.0}),
    "llama-longrope": RaggedPrefillSpec(4, 2, 16, 16, "float32", {
        "rope_type": "longrope", "original_max_position_embeddings": 16, "max_position_embeddings": 256.0,
        "ext_factors": LONGROPE["long_factor"]}),
    "llama4": RaggedPrefillSpec(4, 2, 16, 16, "float32", {**{key: value for key, value in LLAMA3.items()
                                                             if key != "rope_theta"}, "rope_type": "llama4"}),
    **dict.fromkeys(("cohere", "cohere2", "ernie4_5", "helium"),
                    RaggedPrefillSpec(4, 2, 16, 16, "float32", {"rope_type": "gptj"})),
    "glm4": RaggedPrefillSpec(4, 2, 16, 16, "float32", {"rope_type": "gptj"}, rotary_dim=8),
}


def _record_layers(family: str, model, ids) -> list[dict]:
    """Per layer: q ``[S, H_q, D]`` and k ``[S, H_kv, D]`` as the layer's projections give them
    (before RoPE and Llama 4's query temperature), v ``[S, H_kv, D]`` and eager's output
    ``[S, H_q, D]`` of a batch of one."""
    modeling = importlib.import_module(f"transformers.models.{MODULES[family]}.modeling_{MODULES[family]}")
    layers: list[dict] = [{} for _ in model.model.layers]
    eager = modeling.eager_attention_forward

    length = ids.shape[1]

    def projected(record: dict, name: str, head_dim: int):
        def hook(module, args, output):   # [1, S, H * D], [1, S, H, D] or (EXAONE 4's qk norms) [1, H, S, D]
            tokens_first = output[0] if output.dim() < 4 or output.shape[1] == length else output[0].transpose(0, 1)
            record[name] = tokens_first.reshape(length, -1, head_dim)
        return hook

    def recording_eager(module, query, key, value, attention_mask, **kwargs):
        output, weights = eager(module, query, key, value, attention_mask, **kwargs)
        layers[module.layer_idx].update(v=value[0].transpose(0, 1), output=output[0])
        return output, weights

    attentions = [layer.self_attn for layer in model.model.layers]
    hooks = [getattr(attention, f"{name}_norm", getattr(attention, f"{name}_proj")).register_forward_hook(
        projected(record, name, attention.head_dim)) for record, attention in zip(layers, attentions) for name in "qk"]
    transformers.AttentionInterface.register("eager_recorded", recording_eager)
    transformers.masking_utils.AttentionMaskInterface.register("eager_recorded",
                                                               transformers.masking_utils.eager_mask)
    model.set_attn_implementation("eager_recorded")
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return [{name: tensor.contiguous().numpy() for name, tensor in layer.items()} for layer in layers]


def _ragged_call(layer, recorded: dict) -> tuple:
    """The ragged kernel's seed-ABI call of one layer: one entry per query (its window of keys,
    the keys duplicated per entry) for a sliding layer, one causal entry per chunk for a chunked
    one (its keys from the chunk's start, ``k_rope_pos_offset`` there: semantics §16), one causal
    entry otherwise; q scaled by the layer's query temperature, RoPE inline unless a NoPE layer."""
    k, v = recorded["k"], recorded["v"]
    n = len(k)
    positions = np.arange(n, dtype=np.int32)
    q = (recorded["q"] * layer.query_scales(positions)[:, None, None]).astype(np.float32)
    if layer.sliding and layer.window and layer.window < n:
        lo = np.maximum(positions - layer.window + 1, 0)
        rows = np.concatenate([np.arange(a, i + 1) for i, a in enumerate(lo)])
        k, v = k[rows], v[rows]
        kv_indptr = np.concatenate([[0], np.cumsum(positions + 1 - lo)]).astype(np.int32)
        q_indptr, k_offset = np.arange(n + 1, dtype=np.int32), lo.astype(np.int32)
    elif layer.chunk and layer.chunk < n:
        starts = np.arange(0, n, layer.chunk, dtype=np.int32)
        q_indptr = kv_indptr = np.append(starts, n).astype(np.int32)
        k_offset = starts
    else:
        q_indptr = kv_indptr = np.array([0, n], np.int32)
        k_offset = np.zeros(1, np.int32)
    return (q, q_indptr, k, v, kv_indptr, positions, k_offset, 1, int(layer.rope), layer.rope_scale, layer.rope_theta,
            layer.sm_scale)


@pytest.mark.parametrize("family", [
    pytest.param(family, marks=[pytest.mark.compiles(spec) for spec in [OWN_SPECS.get(family)] if spec])
    for family in MODULES])
def test_every_layer_from_the_saved_config_equals_eager(family, tmp_path):
    model = tiny_model(family)
    model.config.save_pretrained(tmp_path)
    config = load_model_config(tmp_path / "config.json", dtype="float32")
    ids = torch.randint(0, 96, (1, 41), generator=torch.Generator().manual_seed(5))
    recorded = _record_layers(family, model, ids)
    assert len(recorded) == model.config.num_hidden_layers
    for index, layer_record in enumerate(recorded):
        layer = config.layer(index).at_length(len(layer_record["k"]))
        spec = config.ragged_spec(layer)
        args = _ragged_call(layer, layer_record)
        want = reference_for(spec, args)
        output, lse = open_kernel(spec)(*args)
        assert_matches_reference(f"{family} layer {index}", (output, lse), spec, args, want)
        bound = error_bound(spec, args, want)
        eager_error = np.abs(layer_record["output"].astype(np.float64) - want[0])
        assert np.all(eager_error <= EAGER_BOUNDS * bound.output), \
            f"{family} layer {index}: eager is {float(np.max(eager_error / bound.output)):.3g} bounds away"
