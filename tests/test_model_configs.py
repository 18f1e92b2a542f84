"""Each example model config derives exactly the attention its layers run (configs/)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from linalg_prefill.mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from linalg_prefill.pipeline.model_config import ModelConfig, load_model_config, specs_for_model
from linalg_prefill.runtime.rope import rope_pair_angles

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _specs(name: str) -> tuple:
    cfg = load_model_config(CONFIGS / name)
    return cfg, specs_for_model(cfg)


def _one(specs, kind, **match):
    found = [s for s in specs if type(s) is kind and all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (kind, match, [s.name for s in specs])
    return found[0]


def test_gemma_2_scale_soft_cap_and_alternating_windows():
    """query_pre_attn_scalar 144 (not head_dim 128), logits capped at 50, both paged kinds."""
    cfg, specs = _specs("gemma-2-27b.json")
    assert (cfg.h_q, cfg.h_kv, cfg.head_dim) == (32, 16, 128)
    assert cfg.attention_scale == 144 ** -0.5 and cfg.logits_soft_cap == 50.0
    assert all(s.logits_soft_cap == 50.0 for s in specs)
    assert _one(specs, SequencePrefillSpec).sm_scale == 144 ** -0.5
    assert {s.mask_mode: s.sm_scale for s in specs if isinstance(s, MaskedSequencePrefillSpec)} == {
        "padded": 144 ** -0.5, "causal_padded_left": 144 ** -0.5}
    assert [p.sliding_window for p in specs if isinstance(p, PagedPrefillSpec)] == [False, True]


def test_gemma_3_local_and_global_layers():
    """5 sliding layers per global one: both paged kinds; the local RoPE base is recorded for the
    caller (rope_theta is a runtime scalar); head_dim 256 and query_pre_attn_scalar 256."""
    cfg, specs = _specs("gemma-3-1b.json")
    assert (cfg.h_q, cfg.h_kv, cfg.head_dim, cfg.rope_theta, cfg.local_rope_theta) == (4, 1, 256, 1e6, 1e4)
    assert cfg.attention_scale == 256 ** -0.5 and cfg.logits_soft_cap == 0.0
    assert [p.sliding_window for p in specs if isinstance(p, PagedPrefillSpec)] == [False, True]


def test_gemma_3_multimodal_config_reads_its_text_config(tmp_path):
    raw = json.loads((CONFIGS / "gemma-3-1b.json").read_text())
    dtype = raw.pop("torch_dtype")
    path = tmp_path / "gemma-3-4b-it.json"
    path.write_text(json.dumps({"model_type": "gemma3", "torch_dtype": dtype, "text_config": raw,
                                "vision_config": {"hidden_size": 1152}}))
    assert specs_for_model(load_model_config(path)) == _specs("gemma-3-1b.json")[1]


def test_phi_3_head_dim_96_and_its_window():
    cfg, specs = _specs("phi-3-mini-4k.json")
    assert (cfg.h_q, cfg.h_kv, cfg.head_dim, cfg.sliding_window) == (32, 32, 96, True)
    assert _one(specs, RaggedPrefillSpec).d_qk == 96 and _one(specs, SequencePrefillSpec).sm_scale == 96 ** -0.5


def test_partial_rotary_factor_becomes_rotary_dim():
    cfg, specs = _specs("stablelm-2-1.6b.json")
    assert cfg.head_dim == 64 and cfg.rotary_dim == 16
    assert _one(specs, RaggedPrefillSpec).rotary_dim == 16
    assert _one(specs, PagedPrefillSpec).rotary_dim == 16


def test_qwen2_5_keeps_its_window_off():
    cfg, specs = _specs("qwen2.5-7b.json")
    assert (cfg.h_q, cfg.h_kv, cfg.head_dim, cfg.rope_theta, cfg.sliding_window) == (28, 4, 128, 1e6, False)
    assert len(specs) == 5 and all(s.logits_soft_cap == 0.0 for s in specs)


def test_llama_4_scout_chunked_and_nope_layers(tmp_path):
    """Every 4th layer NoPE (full attention, its q rows scaled by position), the others chunked in
    8192 tokens with llama3 bands on interleaved pairs (the kernels' ``llama4`` rope): one RoPE,
    so one ragged kernel and both paged kinds (the chunks are the sliding-window variant's
    entries). transformers reads the same layers and frequencies from the file."""
    cfg, specs = _specs("llama-4-scout-17b-16e.json")
    assert (cfg.h_q, cfg.h_kv, cfg.head_dim, cfg.dtype, cfg.attention_chunk) == (40, 8, 128, "bfloat16", 8192)
    assert cfg.nope_layers == tuple(range(3, 48, 4)) and cfg.temperature_tuning == (8192.0, 0.1, 1.0)
    assert cfg.layer_types == ("chunked_attention",) * 3 + ("full_attention",) + cfg.layer_types[4:]
    chunked, nope = cfg.layer(0), cfg.layer(3)
    assert (chunked.chunk, chunked.rope, chunked.temperature_tuning) == (8192, True, None)
    assert (nope.chunk, nope.rope, nope.temperature_tuning) == (None, False, (8192.0, 0.1, 1.0))
    np.testing.assert_allclose(nope.query_scales([0, 8190, 8191, 3 * 8192 - 1]),
                               [1.0, 1.0, 1.0 + 0.1 * math.log(2.0), 1.0 + 0.1 * math.log(4.0)])
    assert chunked.query_scales([9000]).tolist() == [1.0]
    rope = {"rope_type": "llama4", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192}
    assert cfg.rope_scaling == rope and _one(specs, RaggedPrefillSpec).fields()["rope_scaling"] == rope
    assert [p.sliding_window for p in specs if isinstance(p, PagedPrefillSpec)] == [False, True] and len(specs) == 6
    t = _transformers()
    (tmp_path / "config.json").write_text((CONFIGS / "llama-4-scout-17b-16e.json").read_text())
    text = t.AutoConfig.from_pretrained(tmp_path).get_text_config()
    assert list(cfg.layer_types) == text.layer_types and [int(i not in cfg.nope_layers) for i in range(48)] == \
        text.no_rope_layers
    _assert_layers_match_transformers(cfg, text)


def test_phi_3_5_longrope_short_and_long_factors(tmp_path):
    """LongRoPE's 48 per-pair factors of each table: the short ones' kernels for calls up to 4096
    tokens, the long ones' past them (transformers' switch), both with the multiplier of factor
    32; transformers gives the same frequencies for each table."""
    cfg, specs = _specs("phi-3.5-mini.json")
    assert ModelConfig(**cfg.to_dict()) == cfg
    raw = json.loads((CONFIGS / "phi-3.5-mini.json").read_text())["rope_scaling"]
    short, long = cfg.layer(0), cfg.layer(0).at_length(4097)
    assert cfg.layer(0).at_length(4096) == short and long.long_rope_scaling is None
    assert list(short.rope_scaling["ext_factors"]) == raw["short_factor"]
    assert list(long.rope_scaling["ext_factors"]) == raw["long_factor"]
    assert short.rope_scaling["max_position_embeddings"] == long.rope_scaling["max_position_embeddings"] == 131072
    assert [s.fields()["rope_scaling"]["ext_factors"] == short.rope_scaling["ext_factors"]
            for s in specs if isinstance(s, RaggedPrefillSpec)] == [True, False]
    assert len([s for s in specs if isinstance(s, PagedPrefillSpec)]) == 4
    t = _transformers()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    (tmp_path / "config.json").write_text((CONFIGS / "phi-3.5-mini.json").read_text())
    config = t.AutoConfig.from_pretrained(tmp_path)
    _assert_layers_match_transformers(cfg, config)   # the short table
    inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=4097)
    angles, mult = rope_pair_angles(np.ones(1), head_dim=96, rope_theta=long.rope_theta, rope_scale=1.0,
                                    rope_scaling=long.rope_scaling)
    np.testing.assert_allclose(angles[0], inv_freq.numpy().astype(np.float64), rtol=1e-6)
    assert mult == pytest.approx(factor, rel=1e-6)


def test_phi_4_mini_longrope_on_part_of_the_head(tmp_path):
    """Phi-4-mini's form: LongRoPE on 3/4 of the head, a factor a rotating pair (6 of head dim
    16); the short table all 1 is no table at all."""
    t = _transformers()
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
              "short_factor": [1.0] * 6, "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]}
    config = t.Phi3Config(**COMMON, max_position_embeddings=1024, original_max_position_embeddings=64,
                          rope_parameters=params)
    cfg = _saved(tmp_path, config)
    assert cfg.rotary_dim == 12 and "ext_factors" not in cfg.rope_scaling
    assert cfg.long_rope_scaling["ext_factors"] == (1.0, 1.5, 3.0, 6.0, 12.0, 24.0)
    assert len([s for s in specs_for_model(cfg) if isinstance(s, RaggedPrefillSpec)]) == 2


def test_long_factors_belong_to_the_layers_on_longrope():
    """A native config whose sliding layers have their own plain RoPE: only the full layers switch
    to the long table; long factors without LongRoPE are refused by name."""
    short = {"rope_type": "longrope", "original_max_position_embeddings": 64, "max_position_embeddings": 1024}
    long = {**short, "ext_factors": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 48.0, 64.0]}
    cfg = ModelConfig("m", 4, 2, 16, 16, "float32", rope_scaling=short, long_rope_scaling=long, local_rope_scaling={},
                      sliding_window=True, layer_types=["sliding_attention", "full_attention"])
    assert cfg.layer(0).at_length(10 ** 6).rope_scaling == {}
    assert cfg.layer(1).at_length(10 ** 6).rope_scaling["ext_factors"] == tuple(long["ext_factors"])
    assert cfg.layer(1).at_length(64) == cfg.layer(1)
    with pytest.raises(ValueError, match="long_rope_scaling: LongRoPE's long factors need a longrope"):
        ModelConfig("m", 4, 2, 16, 16, "float32", long_rope_scaling=long)


def test_llama_4_maverick_plain_rope_is_interleaved(tmp_path):
    """No rope scaling: the kernels' gptj (plain frequencies, pairs (2i, 2i + 1)); a NoPE layer
    every 2nd; the temperature off."""
    t = _transformers()
    config = t.Llama4TextConfig(**COMMON, head_dim=16, no_rope_layer_interval=2, attention_chunk_size=64,
                                attn_temperature_tuning=False, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 500000.0})
    cfg = _saved(tmp_path, config)
    assert (cfg.rope_scaling, cfg.nope_layers, cfg.temperature_tuning) == ({"rope_type": "gptj"}, (1,), None)
    assert (cfg.layer(0).chunk, cfg.layer(1).rope) == (64, False)


@pytest.mark.parametrize("change, key", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}},
     "rope_scaling.rope_type: 'yarn' on interleaved pairs"),
    ({"no_rope_layers": [1, 0, 1]}, "no_rope_layers: expected 48 flags"),
])
def test_bad_llama_4_configs_name_the_key(tmp_path, change, key):
    raw = json.loads((CONFIGS / "llama-4-scout-17b-16e.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**raw, "text_config": {**raw["text_config"], **change}}))
    with pytest.raises(ValueError, match=key):
        load_model_config(path)


def test_minimax_m2_legacy_rotary_dim_is_its_partial_rotary(tmp_path):
    """MiniMax-M2's released config.json says ``rotary_dim`` 64 of head dim 128, as transformers'
    MiniMaxM2Config reads it; the same key means nothing to other model types."""
    path = _qwen2_json(tmp_path, model_type="minimax_m2", head_dim=16, rotary_dim=8)
    assert load_model_config(path).rotary_dim == 8
    assert load_model_config(_qwen2_json(tmp_path, head_dim=16, rotary_dim=8)).rotary_dim is None


@pytest.mark.parametrize("model_type", ["gemma3n_text", "jamba", "minimax"])
def test_a_model_type_the_loader_does_not_know_is_refused_by_name(tmp_path, model_type):
    """Gemma 3n's shared KV and unit scale, Jamba's attention without RoPE, MiniMax's linear
    layers: their code changes attention where no key says so (pipeline/model_types.py)."""
    path = _qwen2_json(tmp_path, model_type=model_type)
    with pytest.raises(ValueError, match=f"model_type: '{model_type}' is not one whose attention"):
        load_model_config(path)


@pytest.mark.parametrize("fields, key", [
    ({"layer_types": ["chunked_attention", "full_attention"]}, "attention_chunk: set exactly when"),
    ({"attention_chunk": 64}, "attention_chunk: set exactly when"),
    ({"attention_chunk": 0, "layer_types": ["chunked_attention"]}, "attention_chunk: must be a positive int"),
    ({"nope_layers": [2], "layer_types": ["full_attention"] * 2}, "nope_layers: 2 is past"),
    ({"temperature_tuning": (8192, 0.1, 1)}, "temperature_tuning: set on the NoPE layers, but no layer"),
    ({"temperature_tuning": (8192, 0.1)}, "temperature_tuning: expected"),
    ({"temperature_tuning": (8192, 0.1, 0), "temperature_layers": "some"}, "temperature_layers: 'nope' or 'every'"),
    ({"nope_layers": [0], "temperature_tuning": (8192, -0.1)}, "temperature_tuning: expected"),
])
def test_bad_llama_4_fields_name_the_field(fields, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig("m", 4, 2, 16, 16, "float32", **fields)


def test_deepseek_v3_mla_with_its_yarn_softmax_scale():
    cfg, specs = _specs("deepseek-v3.json")
    assert specs == [RaggedPrefillSpec(128, 128, 192, 128, "bfloat16"),
                     MlaPagedPrefillSpec(128, 512, 64, "bfloat16", page_size=16)]
    assert cfg.attention_scale == pytest.approx(0.1352337788608801)  # DeepSeek's softmax_scale


def test_linear_rope_scaling_is_the_runtime_rope_scale(tmp_path):
    raw = json.loads((CONFIGS / "mistral-7b.json").read_text())
    path = tmp_path / "linear.json"
    path.write_text(json.dumps({**raw, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}))
    cfg = load_model_config(path)
    assert cfg.rope_scale == 0.25 and cfg.rope_scaling == {}


@pytest.mark.parametrize("name", ["llama-3-8b.json", "mistral-7b.json", "qwen2-0.5b.json", "qwen2.5-7b.json",
                                  "gemma-2-27b.json", "gemma-3-1b.json", "phi-3-mini-4k.json",
                                  "stablelm-2-1.6b.json", "deepseek-v2-lite.json", "deepseek-v3.json",
                                  "llama-4-scout-17b-16e.json", "phi-3.5-mini.json"])
def test_every_example_config_round_trips_through_the_manifest_fields(name):
    """The manifest records each spec's fields; they rebuild the same spec (cap and rotary_dim
    included)."""
    for spec in _specs(name)[1]:
        assert type(spec)(**spec.fields()) == spec


# Configs as transformers >= 5 writes them (rope_parameters), read as transformers reads them.

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              intermediate_size=128, vocab_size=128)
LLAMA3_PARAMS = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
YARN_PARAMS = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32}


def _transformers():
    return pytest.importorskip("transformers")


def _transformers_rope(config, layer_type: str | None) -> tuple[np.ndarray, float]:
    """transformers' (inv_freq [rotary_dim / 2] float64, attention_factor) of a layer type."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    nested = layer_type in config.rope_parameters
    params = config.rope_parameters[layer_type] if nested else config.rope_parameters
    if params["rope_type"] == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        return 1.0 / params["rope_theta"] ** (np.arange(0, dim, 2) / dim), 1.0
    inv_freq, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", layer_type=layer_type if nested else None)
    return inv_freq.numpy().astype(np.float64), factor


def _assert_layers_match_transformers(cfg, config):
    """Every layer's RoPE (frequencies at position 1 times rope_scale, multiplier), rotary dim and
    window are transformers' for that layer."""
    layer_types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
    for i, kind in enumerate(layer_types):
        layer = cfg.layer(i)
        inv_freq, factor = _transformers_rope(config, kind)
        rotary = layer.rotary_dim or cfg.head_dim
        angles, mult = rope_pair_angles(np.ones(1), head_dim=rotary, rope_theta=layer.rope_theta,
                                        rope_scale=layer.rope_scale, rope_scaling=layer.rope_scaling)
        assert 2 * inv_freq.size == rotary, (i, kind)
        np.testing.assert_allclose(angles[0], inv_freq, rtol=1e-6, err_msg=f"layer {i} ({kind})")
        assert mult == pytest.approx(factor, rel=1e-6)
        window = getattr(config, "sliding_window", None) if kind in ("sliding_attention", None) else None
        assert (layer.sliding, layer.window) == (window is not None, window), (i, kind)


def _saved(tmp_path, config):
    """``config`` through save_pretrained and load_model_config (float32: tiny configs carry no dtype)."""
    config.save_pretrained(tmp_path)
    cfg = load_model_config(tmp_path / "config.json", dtype="float32")
    assert ModelConfig(**cfg.to_dict()) == cfg
    _assert_layers_match_transformers(cfg, config)
    return cfg


def test_llama_3_rope_parameters(tmp_path):
    t = _transformers()
    cfg = _saved(tmp_path, t.LlamaConfig(**COMMON, max_position_embeddings=131072, rope_parameters=LLAMA3_PARAMS))
    assert cfg.rope_theta == 500000.0 and cfg.rope_scale == 1.0
    assert cfg.rope_scaling == {key: value for key, value in LLAMA3_PARAMS.items() if key != "rope_theta"}
    assert not cfg.sliding_window and cfg.layer(1) == cfg.layer(0)


def test_qwen2_plain_theta_from_rope_parameters(tmp_path):
    t = _transformers()
    cfg = _saved(tmp_path, t.Qwen2Config(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.layer_types) == (1e6, {}, ("full_attention",) * 2)
    assert not cfg.layer(0).sliding and len(specs_for_model(cfg)) == 5


def test_qwen2_yarn_is_transformers_yarn(tmp_path):
    t = _transformers()
    cfg = _saved(tmp_path, t.Qwen2Config(**COMMON, rope_parameters=YARN_PARAMS))
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                "beta_fast": 32, "beta_slow": 1, "truncate": True,
                                "attention_factor": 0.1 * math.log(4.0) + 1.0}
    assert _one(specs_for_model(cfg), RaggedPrefillSpec).fields()["rope_scaling"] == cfg.rope_scaling


def test_stablelm_partial_rotary_inside_rope_parameters(tmp_path):
    t = _transformers()
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    cfg = _saved(tmp_path, t.StableLmConfig(**COMMON, rope_parameters=params))
    assert (cfg.head_dim, cfg.rotary_dim, cfg.layer(0).rotary_dim) == (16, 4, 4)


def test_gemma_2_alternating_layers(tmp_path):
    t = _transformers()
    cfg = _saved(tmp_path, t.Gemma2Config(**COMMON, head_dim=16, sliding_window=64))
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.window == 64
    assert (cfg.layer(0).sliding, cfg.layer(1).sliding, cfg.layer(0).logits_soft_cap) == (True, False, 50.0)


def test_gemma_3_rope_per_layer_type(tmp_path):
    """Linear factor 8 on the full-attention layers only: their rope_scale is 1/8, the sliding
    layers' 1 with their own theta; one compile-time rope_scaling, so one ragged kernel."""
    t = _transformers()
    params = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
    config = t.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, head_dim=16, sliding_window=32,
                                rope_parameters=params)
    cfg = _saved(tmp_path, config)
    full, local = cfg.layer(5), cfg.layer(0)
    assert (full.sliding, full.rope_theta, full.rope_scale, full.window) == (False, 1e6, 0.125, None)
    assert (local.sliding, local.rope_theta, local.rope_scale, local.window) == (True, 1e4, 1.0, 32)
    assert len([s for s in specs_for_model(cfg) if isinstance(s, RaggedPrefillSpec)]) == 1


def test_a_rope_type_per_layer_type_gets_a_kernel_each(tmp_path):
    t = _transformers()
    params = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "full_attention": {**YARN_PARAMS, "original_max_position_embeddings": 4096}}
    cfg = _saved(tmp_path, t.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, head_dim=16,
                                              rope_parameters=params))
    assert cfg.local_rope_scaling == {} and cfg.rope_scaling["rope_type"] == "yarn"
    specs = specs_for_model(cfg)
    assert [s.fields()["rope_scaling"] for s in specs if isinstance(s, RaggedPrefillSpec)] == [cfg.rope_scaling, {}]
    assert [(dict(s.rope_scaling).get("rope_type"), s.sliding_window) for s in specs
            if isinstance(s, PagedPrefillSpec)] == [("yarn", False), ("yarn", True), (None, False), (None, True)]


def test_mistral_every_layer_slides(tmp_path):
    t = _transformers()
    cfg = _saved(tmp_path, t.MistralConfig(**COMMON, sliding_window=32))
    assert cfg.layer_types is None and cfg.window == 32 and cfg.layer(1).sliding


def test_phi_3(tmp_path):
    t = _transformers()
    cfg = _saved(tmp_path, t.Phi3Config(**COMMON, sliding_window=16))
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.window) == (None, 10000.0, 16)


@pytest.mark.parametrize("name", ["llama-3-8b.json", "mistral-7b.json", "qwen2-0.5b.json", "qwen2.5-7b.json",
                                  "gemma-2-27b.json", "gemma-3-1b.json", "phi-3-mini-4k.json",
                                  "stablelm-2-1.6b.json"])
def test_old_format_configs_read_as_transformers_reads_them(tmp_path, name):
    t = _transformers()
    (tmp_path / "config.json").write_text((CONFIGS / name).read_text())
    _assert_layers_match_transformers(load_model_config(CONFIGS / name), t.AutoConfig.from_pretrained(tmp_path))


def test_old_format_gemma_3_scales_its_full_layers_only(tmp_path):
    raw = json.loads((CONFIGS / "gemma-3-1b.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**raw, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}))
    cfg = load_model_config(path)
    assert (cfg.rope_scale, cfg.local_rope_scale, cfg.local_rope_theta) == (0.125, 1.0, 1e4)
    _assert_layers_match_transformers(cfg, _transformers().AutoConfig.from_pretrained(tmp_path))


def _qwen2_json(tmp_path, **change) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**COMMON, "model_type": "qwen2", "torch_dtype": "float32", **change}))
    return path


@pytest.mark.parametrize("rope_parameters, key", [
    ({"rope_type": "default", "rope_theta": 1e6, "foo": 1}, r"rope_parameters\.foo: unknown key"),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 4}, r"rope_parameters\.beta_fast: unknown key"),
    ({"rope_type": "dynamic", "factor": 2.0}, r"rope_parameters\.rope_type: 'dynamic'"),
    ({"rope_type": "proportional", "rope_theta": 1e4}, r"rope_parameters\.rope_type: 'proportional'"),
    ({"rope_type": "yarn", "rope_theta": 1e4}, r"rope_parameters\.factor: missing"),
    ({"full_attention": {"rope_type": "default", "foo": 1}}, r"rope_parameters\.full_attention\.foo: unknown key"),
])
def test_bad_rope_parameters_name_the_key(tmp_path, rope_parameters, key):
    path = _qwen2_json(tmp_path, rope_parameters=rope_parameters, layer_types=["full_attention"] * 2)
    with pytest.raises(ValueError, match=key):
        load_model_config(path)


def test_top_level_keys_fill_in_missing_rope_parameters(tmp_path):
    """rope_theta, partial_rotary_factor and original_max_position_embeddings from top level only
    where the dict lacks them."""
    path = _qwen2_json(tmp_path, rope_theta=7.0, partial_rotary_factor=0.5, original_max_position_embeddings=64,
                       rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e5})
    cfg = load_model_config(path)
    assert (cfg.rope_theta, cfg.rotary_dim, cfg.rope_scaling["original_max_position_embeddings"]) == (1e5, 8, 64)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("theta", [10000.0, 1e6])
@pytest.mark.parametrize("extra", [{}, {"mscale": 0.707, "mscale_all_dim": 1.0}, {"truncate": False},
                                   {"original_max_position_embeddings": 4096, "beta_fast": 0, "beta_slow": 2}])
def test_reference_yarn_is_transformers_yarn(tmp_path, head_dim, theta, extra):
    """The float64 reference with the loader's truncate / attention_factor gives transformers'
    inv_freq and attention_factor."""
    t = _transformers()
    config = t.Qwen2Config(**{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1}, head_dim=head_dim,
                           rope_parameters={**YARN_PARAMS, "rope_theta": theta, **extra})
    cfg = _saved(tmp_path, config)
    assert cfg.rope_scaling["truncate"] is extra.get("truncate", True)


def test_native_format_round_trips_the_new_fields(tmp_path):
    raw = json.loads((CONFIGS / "gemma-3-1b.json").read_text())
    path = tmp_path / "gemma3.json"
    path.write_text(json.dumps({**raw, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}))
    cfg = load_model_config(path)
    native = tmp_path / "native.json"
    native.write_text(json.dumps(cfg.to_dict()))
    assert load_model_config(native) == cfg and cfg.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)


def test_deepseek_v3_yarn_softmax_scale_from_rope_parameters(tmp_path):
    raw = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    rope = {**raw.pop("rope_scaling"), "rope_theta": raw.pop("rope_theta")}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**raw, "rope_parameters": rope}))
    cfg = load_model_config(path)
    assert cfg.attention_scale == load_model_config(CONFIGS / "deepseek-v3.json").attention_scale != 192 ** -0.5
