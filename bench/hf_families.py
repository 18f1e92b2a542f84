"""Which transformers model families run on linalg_prefill's attention: a tiny random-weight model
of each, its logits and greedy tokens on the adapter against eager's, in the same run.

    python bench/hf_families.py [--families LlamaConfig,DeepseekV4Config,...] [--dtype float32|bfloat16]
        [--timeout 300]

Each family (a transformers config class, with the tiny sizes of :data:`FAMILIES`) runs in a
process of its own (a crash or a hang is that family's row): the same weights, q and k peaked
(their projections' or norms' weights scaled, so that a wrong mask, scale or key shows), a batch
of two prompts of 23 tokens, the second left-padded by 5, then 8 greedy tokens. A row:

* ``ok``: logits within 1e-4 of eager's scale on the kept rows, the same tokens, the attention
  function called; in bfloat16 (``--dtype``), the logits at most twice as far from the float32
  eager model's as eager's bfloat16 ones are (``logits`` is that ratio; the tokens are printed,
  not required: bfloat16's near-ties);
* ``differs``: it ran, and the logits or tokens are not eager's (a bug, here or in the model);
* ``refused``: an InputError naming what the kernels do not run (e.g. Bloom's own attention code);
* ``error``: anything else (e.g. a family transformers cannot build at these sizes).

``calls``: the attention calls of the padded forward through the adapter (hybrid models call it
on their attention layers only). Not a benchmark of speed; a survey for a transformers upgrade.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys

#: Llama-like tiny sizes.
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
            vocab_size=96, max_position_embeddings=256, num_hidden_layers=2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
WINDOWED = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
#: DeepSeek's MLA at tiny sizes: d_qk 24 (16 + 8 rotating), d_v 16.
MLA = dict(TINY, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
           v_head_dim=16, head_dim=8, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
           topk_group=1, **MOE)
DSA = dict(MLA, index_n_heads=2, index_head_dim=16, index_topk=6)
#: config class -> its tiny kwargs.
FAMILIES = {
    "LlamaConfig": TINY, "MistralConfig": TINY, "Qwen2Config": TINY, "Qwen3Config": TINY,
    "Qwen3MoeConfig": dict(TINY, num_experts=4, **MOE), "Qwen2MoeConfig": dict(TINY, num_experts=4, **MOE),
    "MixtralConfig": dict(TINY, num_local_experts=4, num_experts_per_tok=2), "Phi3Config": TINY,
    "PhimoeConfig": dict(TINY, num_local_experts=4, num_experts_per_tok=2), "Gemma2Config": dict(TINY, **WINDOWED),
    "Gemma3TextConfig": dict(TINY, **WINDOWED), "VaultGemmaConfig": dict(TINY, **WINDOWED),
    "Gemma3nTextConfig": dict(TINY, num_hidden_layers=4, sliding_window=8, vocab_size_per_layer_input=96,
                              hidden_size_per_layer_input=16, num_kv_shared_layers=2, laurel_rank=8,
                              altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4,
                              layer_types=["sliding_attention", "full_attention"] * 2),
    "Gemma4TextConfig": dict(TINY, num_hidden_layers=4, sliding_window=8, vocab_size_per_layer_input=96,
                             hidden_size_per_layer_input=16, num_kv_shared_layers=2,
                             layer_types=["sliding_attention", "full_attention"] * 2),
    "GptOssConfig": dict(TINY, num_local_experts=4, num_experts_per_tok=2, **WINDOWED),
    "Llama4TextConfig": dict(TINY, no_rope_layer_interval=2, attention_chunk_size=8, num_local_experts=2,
                             num_experts_per_tok=1, interleave_moe_layer_step=2, intermediate_size_mlp=96),
    "SmolLM3Config": dict(TINY, no_rope_layer_interval=2), "Cohere2Config": dict(TINY, **WINDOWED),
    "Exaone4Config": dict(TINY, **WINDOWED), "GraniteConfig": dict(TINY, attention_multiplier=0.15),
    "Glm4Config": TINY, "Glm4MoeConfig": dict(TINY, n_routed_experts=4, first_k_dense_replace=1, **MOE),
    "Ernie4_5Config": TINY, "Olmo2Config": TINY, "Olmo3Config": dict(TINY, **WINDOWED), "OlmoConfig": TINY,
    "OlmoeConfig": dict(TINY, num_experts=4, num_experts_per_tok=2), "ApertusConfig": TINY, "PhiConfig": TINY,
    "Starcoder2Config": TINY, "SeedOssConfig": TINY, "GemmaConfig": TINY, "StableLmConfig": TINY,
    "Ministral3Config": TINY, "MinistralConfig": dict(TINY, **WINDOWED), "HeliumConfig": TINY,
    "ArceeConfig": TINY, "BitNetConfig": TINY, "InternLM3Config": TINY, "GPTNeoXConfig": TINY,
    "HunYuanDenseV1Config": TINY, "HYV3Config": TINY, "SolarOpenConfig": dict(TINY, n_routed_experts=4, **MOE),
    "Qwen3NextConfig": dict(TINY, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, num_experts=4, layer_types=["linear_attention", "full_attention"],
                            **MOE),
    "Qwen3_5TextConfig": dict(TINY, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                              linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"]),
    "Lfm2Config": TINY, "MiMoV2FlashConfig": dict(TINY, **WINDOWED), "GraniteSWAConfig": dict(TINY, **WINDOWED),
    "DeepseekV2Config": MLA, "DeepseekV3Config": MLA, "Glm4MoeLiteConfig": MLA,
    "MiniCPM3Config": dict(MLA, num_key_value_heads=4),
    "DeepseekV32Config": DSA, "GlmMoeDsaConfig": DSA,
    "HYV4Config": dict(MLA, index_topk=6, index_head_dim=16, index_n_heads=2, hc_mult=2),
    "DeepseekV4Config": dict(TINY, num_key_value_heads=1, head_dim=32, q_lora_rank=32, n_routed_experts=4,
                             o_groups=2, o_lora_rank=16, sliding_window=8, index_n_heads=2, index_head_dim=16,
                             index_topk=6, hc_mult=2, mlp_layer_types=["moe", "moe"],
                             layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                             **MOE),
    "GPT2Config": dict(n_embd=64, n_head=4, n_layer=2, vocab_size=96), "OPTConfig": dict(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, ffn_dim=96, vocab_size=96, word_embed_proj_dim=64),
    "BloomConfig": dict(hidden_size=64, n_head=4, n_layer=2, vocab_size=96),
    "MptConfig": dict(d_model=64, n_heads=4, n_layers=2, vocab_size=96),
}
#: Weight names whose scaling peaks the scores (suffixes; a module's q/k norms where it has them).
PEAK = {"q_norm.weight": 8.0, "k_norm.weight": 8.0, "q_proj.weight": 8.0, "k_proj.weight": 8.0,
        "q_b_proj.weight": 20.0, "kv_b_proj.weight": 20.0, "kv_norm.weight": 4.0}
TOLERANCE = 1e-4
#: In bfloat16: how much further from the float32 eager logits than eager's own bf16 ones.
BF16_RATIO = 2.0


def _peaked(state: dict) -> None:
    """Scales ``state``'s q/k weights in place (:data:`PEAK`): a module's norms where it has them,
    else its projections."""
    import torch
    with torch.no_grad():
        for name, tensor in state.items():
            suffix = next((s for s in PEAK if name.endswith(s)), None)
            if suffix is None:
                continue
            module = name[:-len(suffix)]
            if suffix.endswith("proj.weight") and suffix[0] in "qk" and f"{module}{suffix[0]}_norm.weight" in state:
                continue   # the norm after it is scaled instead
            tensor.mul_(PEAK[suffix])


def run_one(family: str, dtype: str = "float32") -> dict:
    """One family's row (module docstring)."""
    import torch
    import transformers
    import linalg_prefill.hf as hf
    from linalg_prefill.runtime import InputError

    row = {"family": family}
    name = hf.register()
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return hf.attention(*args, **kwargs)

    transformers.AttentionInterface.register(name, counted)
    try:
        config = getattr(transformers, family)(**FAMILIES[family])
        models = {}
        for implementation in ("eager", name):
            torch.manual_seed(0)
            models[implementation] = transformers.AutoModelForCausalLM.from_config(
                copy.deepcopy(config), attn_implementation=implementation).eval()
        state = models["eager"].state_dict()
        _peaked(state)
        models[name].load_state_dict(state)
        ids = torch.randint(3, 96, (2, 23), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        kept = mask.bool()
        with torch.no_grad():
            exact = models["eager"](input_ids=ids, attention_mask=mask).logits.float()
            if dtype != "float32":
                models = {key: model.to(getattr(torch, dtype)) for key, model in models.items()}
            want = models["eager"](input_ids=ids, attention_mask=mask).logits.float()
            calls[0] = 0
            got = models[name](input_ids=ids, attention_mask=mask).logits.float()
            row["calls"] = calls[0]
            if dtype == "float32":
                row["logits"] = float((got - want).abs()[kept].max() / want[kept].abs().max())
            else:
                row["logits"] = float((got - exact).abs()[kept].max() / (want - exact).abs()[kept].max())
            tokens = [models[i].generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                         pad_token_id=0) for i in ("eager", name)]
        row["tokens"] = bool(torch.equal(*tokens))
        close = row["logits"] <= TOLERANCE and row["tokens"] if dtype == "float32" else row["logits"] <= BF16_RATIO
        row["status"] = "ok" if close and row["calls"] else "differs"
    except InputError as err:
        row.update(status="refused", why=str(err)[:100])
    except Exception as err:  # noqa: BLE001 - a survey: every failure is a row
        row.update(status="error", why=f"{type(err).__name__}: {str(err)[:100]}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--timeout", type=int, default=300, help="seconds a family may take")
    parser.add_argument("--one", help=argparse.SUPPRESS)   # the child process's family
    args = parser.parse_args()
    if args.one:
        print("ROW " + json.dumps(run_one(args.one, args.dtype)), flush=True)
        return
    from linalg_prefill.bench import cpu_description
    import transformers
    print(f"CPU: {cpu_description()}; transformers {transformers.__version__}; {args.dtype}")
    print(f"{'family':26} {'status':8} {'calls':>5} {'logits':>9}  tokens  why   (logits: "
          + ("relative to eager's scale)" if args.dtype == "float32" else "distance from f32 eager over eager's)"))
    counts: dict = {}
    for family in args.families.split(","):
        try:
            done = subprocess.run([sys.executable, __file__, "--one", family, "--dtype", args.dtype],
                                  capture_output=True, text=True, timeout=args.timeout)
            rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
            row = json.loads(rows[-1]) if rows else {"status": "error", "why": f"exit {done.returncode}"}
        except subprocess.TimeoutExpired:
            row = {"status": "error", "why": f"over {args.timeout} s"}
        counts[row["status"]] = counts.get(row["status"], 0) + 1
        logits = f"{row['logits']:9.1e}" if "logits" in row else " " * 9
        print(f"{family:26} {row['status']:8} {row.get('calls', ''):>5} {logits}  {str(row.get('tokens', '')):6}  "
              f"{row.get('why', '')}", flush=True)
    print(", ".join(f"{count} {status}" for status, count in sorted(counts.items())))


if __name__ == "__main__":
    main()
