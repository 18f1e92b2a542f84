"""Tiny random-weight transformers models whose attention is peaked (no download).

Random init attends almost uniformly, which hides scale, soft-cap and RoPE errors: the q and k
projections are scaled by ``QK_GAIN`` so scores are O(10) and most rows put most of their weight on
a few keys (``tests/test_hf_adapter.py`` checks that they do).
"""

from __future__ import annotations

import torch
import transformers

QK_GAIN = 15.0
#: gpt-oss's per-head sink logits: from below the peaked scores to above most of them.
SINK_RANGE = (-2.0, 4.0)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
            vocab_size=96, max_position_embeddings=256)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1000000.0}
#: Phi-3.5's LongRoPE, scaled down: per-pair divisors of the frequencies, the long ones past 16 tokens.
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 16, "rope_theta": 10000.0,
            "short_factor": [1.0, 1.02, 1.05, 1.1, 1.3, 1.6, 2.1, 2.5],
            "long_factor": [1.0, 1.3, 2.2, 4.1, 7.9, 13.0, 21.5, 32.0]}


def configs() -> dict:
    """Family name -> transformers config: Llama 3 (llama3 scaling), Qwen2 (theta 1e6, and yarn
    with factor 4), Llama with LongRoPE's per-pair factors (:data:`LONGROPE`, 16x: 41 tokens take
    the long ones), Gemma 2 (soft cap 20, query_pre_attn_scalar 32, a sliding window of 8 on
    alternate layers), gpt-oss (per-head sinks, a window of 8 on alternate layers, 4 experts),
    Llama 4 (a chunked-attention layer, chunks of 8, with llama3 bands on interleaved pairs, then a
    NoPE full-attention layer whose q rows the model scales by position: ``floor_scale`` 8 and
    ``attn_scale`` 0.5, up to 1.9x at 40 tokens; no qk norm, as Maverick: a norm would bound the
    scores that QK_GAIN peaks)."""
    return {
        "llama3": transformers.LlamaConfig(num_hidden_layers=2, rope_parameters=dict(LLAMA3), **TINY),
        "qwen2": transformers.Qwen2Config(num_hidden_layers=2, rope_parameters={"rope_type": "default",
                                                                                  "rope_theta": 1000000.0}, **TINY),
        "qwen2-yarn": transformers.Qwen2Config(num_hidden_layers=2, rope_parameters=dict(YARN),
                                                **dict(TINY, max_position_embeddings=128)),
        "llama-longrope": transformers.LlamaConfig(num_hidden_layers=2, rope_parameters=dict(LONGROPE), **TINY),
        "gemma2": transformers.Gemma2Config(num_hidden_layers=2, query_pre_attn_scalar=32, attn_logit_softcapping=20.0,
                                            final_logit_softcapping=None, sliding_window=8,
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **TINY),
        "gpt_oss": transformers.GptOssConfig(num_hidden_layers=2, sliding_window=8, num_local_experts=4,
                                             num_experts_per_tok=2, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 10000.0},
                                             **TINY),
        "llama4": transformers.Llama4TextConfig(num_hidden_layers=2, no_rope_layer_interval=2, attention_chunk_size=8,
                                                use_qk_norm=False, floor_scale=8, attn_scale=0.5, num_local_experts=2,
                                                num_experts_per_tok=1, interleave_moe_layer_step=2,
                                                intermediate_size_mlp=96, rope_parameters=dict(LLAMA3), **TINY),
        **_attention_variants(),
        **_deepseek_attentions(),
    }


def _deepseek_attentions() -> dict:
    """DeepSeek's attentions, for tests/test_hf_model_arguments.py: V3's MLA as transformers runs it
    (4 heads of d_qk 24 = 16 + 8 rotating, d_v 16), V3.2's sparse attention on it (its indexer
    keeps 6 keys a query), V4's (one KV head of 32 that is K and V, per-head sinks, a window of 8,
    compressed KV slots every 4 tokens (CSA, 6 of them chosen a query) and every 8 (HCA))."""
    mla = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96, vocab_size=96,
               max_position_embeddings=256, num_hidden_layers=2, moe_intermediate_size=32, n_routed_experts=4,
               num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32,
               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8, n_group=1, topk_group=1,
               pad_token_id=0)
    return {
        "deepseek_v3": transformers.DeepseekV3Config(**mla),
        "deepseek_v32": transformers.DeepseekV32Config(index_n_heads=2, index_head_dim=16, index_topk=6, **mla),
        "deepseek_v4": transformers.DeepseekV4Config(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
            intermediate_size=96, moe_intermediate_size=32, vocab_size=96, max_position_embeddings=256,
            num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=16,
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
            mlp_layer_types=["moe", "moe"], compress_rates={"compressed_sparse_attention": 4,
                                                            "heavily_compressed_attention": 8},
            sliding_window=8, index_n_heads=2, index_head_dim=16, index_topk=6, hc_mult=2, pad_token_id=0),
    }


def _attention_variants() -> dict:
    """Models whose attention differs from Llama's in their code (pipeline/model_types.py), for
    tests/test_hf_layers.py: SmolLM3 (its 2nd layer NoPE), Cohere 2 (a window of 8, interleaved
    pairs, the full layer NoPE), EXAONE 4 (the same with half-split pairs and qk norms), Granite
    (softmax scale 0.15, not head_dim ** -0.5), GLM-4 (interleaved pairs on half the head, q/k
    biases), Cohere and ERNIE 4.5 (interleaved pairs), Qwen3 and OLMo 2 (qk norms); and plain
    ones: OLMo 3 (qk norms, a window of 8), Apertus (qk norms, llama3 bands), Granite-MoE (the
    scale), Phi-2 (half the head rotates), StarCoder2 and Seed-OSS (biases), Gemma; Ministral 3
    (yarn, every layer's q rows scaled by position: 1.35x from position 8, 1.9x at 40); GLM-4.5
    (qk norms, half-split pairs on half the head) and MiniMax-M2 (qk norms over all heads, half the
    head rotating by its legacy ``rotary_dim``)."""
    windowed = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    return {
        "smollm3": transformers.SmolLM3Config(num_hidden_layers=2, no_rope_layer_interval=2, pad_token_id=0, **TINY),
        "cohere2": transformers.Cohere2Config(num_hidden_layers=2, **windowed, **TINY),
        "exaone4": transformers.Exaone4Config(num_hidden_layers=2, **windowed, **TINY),
        "granite": transformers.GraniteConfig(num_hidden_layers=2, attention_multiplier=0.15, **TINY),
        "glm4": transformers.Glm4Config(num_hidden_layers=2, pad_token_id=0, **TINY),
        "cohere": transformers.CohereConfig(num_hidden_layers=2, **TINY),
        "ernie4_5": transformers.Ernie4_5Config(num_hidden_layers=2, **TINY),
        "qwen3": transformers.Qwen3Config(num_hidden_layers=2, **TINY),
        "olmo2": transformers.Olmo2Config(num_hidden_layers=2, **TINY),
        "olmo3": transformers.Olmo3Config(num_hidden_layers=2, **windowed, **TINY),
        "apertus": transformers.ApertusConfig(num_hidden_layers=2, rope_parameters=dict(LLAMA3), **TINY),
        "granitemoe": transformers.GraniteMoeConfig(num_hidden_layers=2, attention_multiplier=0.15, **TINY),
        "phi": transformers.PhiConfig(num_hidden_layers=2, **TINY),
        "starcoder2": transformers.Starcoder2Config(num_hidden_layers=2, **TINY),
        "seed_oss": transformers.SeedOssConfig(num_hidden_layers=2, **TINY),
        "gemma": transformers.GemmaConfig(num_hidden_layers=2, **TINY),
        "ministral3": transformers.Ministral3Config(num_hidden_layers=2, pad_token_id=0, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 1e6,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5},
            **TINY),
        "glm4_moe": transformers.Glm4MoeConfig(num_hidden_layers=2, use_qk_norm=True, n_routed_experts=4,
                                               num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                                               pad_token_id=0, **TINY),
        "minimax_m2": transformers.MiniMaxM2Config(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                                   rotary_dim=8, pad_token_id=0, **TINY),
        **_plain_attentions(),
    }


def _plain_attentions() -> dict:
    """Model types whose attention is Llama's (pipeline/model_types.py's plain records, and
    Helium's on interleaved pairs), each checked layer by layer: OLMo (its q/k/v clipped, here at
    8), OLMoE (qk norms over all heads), PhiMoE, Helium, Arcee, Solar Open."""
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    return {
        "olmo": transformers.OlmoConfig(num_hidden_layers=2, clip_qkv=8.0, **TINY),
        "olmoe": transformers.OlmoeConfig(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, **TINY),
        "phimoe": transformers.PhimoeConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, **TINY),
        "helium": transformers.HeliumConfig(num_hidden_layers=2, **TINY),
        "arcee": transformers.ArceeConfig(num_hidden_layers=2, **TINY),
        "solar_open": transformers.SolarOpenConfig(num_hidden_layers=2, n_routed_experts=4, **moe, **TINY),
    }


#: The parts (``{name}_norm`` or ``{name}_proj``) whose weights peak a family's scores, and by how
#: much, where not q's and k's by QK_GAIN: DeepSeek's MLA (q after its low-rank norm; k's no-RoPE
#: part and v through ``kv_b``), V4's (q normalised without a weight; its one K=V head's norm).
_PEAKED = {"deepseek_v3": {"q_b": 20.0, "kv_b": 20.0}, "deepseek_v32": {"q_b": 20.0, "kv_b": 20.0},
           "deepseek_v4": {"kv": 4.0}}


def tiny_model(family: str, dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"):
    """A seeded random-weight causal LM of ``family`` in eval mode, q/k projections (or the qk
    norms' weights) scaled by QK_GAIN (gpt-oss: its sink logits uniform in SINK_RANGE, so that
    they matter)."""
    torch.manual_seed(0)
    config = configs()[family]
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            for name, gain in _PEAKED.get(family, {"q": QK_GAIN, "k": QK_GAIN}).items():
                # the qk norms' weights where the model normalises q and k
                part = getattr(attention, f"{name}_norm", None) or getattr(attention, f"{name}_proj")
                part.weight.mul_(gain)
            if hasattr(layer.self_attn, "sinks"):
                layer.self_attn.sinks.uniform_(*SINK_RANGE)
    return model.to(dtype).eval()
