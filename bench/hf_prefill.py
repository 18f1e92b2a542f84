"""One prefill through a transformers model: linalg_prefill vs sdpa vs eager, in the same run.

    python bench/hf_prefill.py [--tokens 2048] [--reps 3] [--dtypes float32,bfloat16] [--models llama,gemma2]

Random-weight models with real shapes cut to 2 layers (no download):
* Llama-3-8B: hidden 4096, 32 query / 8 KV heads, head dim 128, MLP 14336;
* Gemma-2-9B: hidden 3584, 16 / 8 heads, head dim 256, soft cap 50 (transformers' sdpa refuses
  a soft cap, so Gemma 2 runs against eager only);
* DeepSeek-V2-Lite (``--models deepseek``): hidden 2048, MLA with 16 heads of d_qk 192 (128 +
  64 rotating) and d_v 128 (the adapter's dense kernel on V zero-padded to 192), dense MLPs.

For each row: the median time of a forward of the decoder (``model.model``: the 2 layers, not the
LM head, whose 2048 x 4096 x vocab product would dominate) and of the attention calls inside it
(the attention function timed per call, summed), after one warm-up forward each (ours compiles
its kernels, cached on disk), the implementations taking turns forward by forward in a shuffled
order. ``ratio`` = peer time / ours (above 1: ours is faster).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict

import torch
import transformers
from transformers.masking_utils import eager_mask, sdpa_mask
from transformers.models.deepseek_v2 import modeling_deepseek_v2
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.llama import modeling_llama

import linalg_prefill.hf as hf
from linalg_prefill.bench import cpu_description

MODELS = {
    "llama": lambda: transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
        num_hidden_layers=2, vocab_size=32000, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                "original_max_position_embeddings": 8192,
                                                                "rope_theta": 500000.0}),
    "gemma2": lambda: transformers.Gemma2Config(
        hidden_size=3584, num_attention_heads=16, num_key_value_heads=8, head_dim=256, intermediate_size=14336,
        num_hidden_layers=2, vocab_size=32000, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        sliding_window=4096),
    "deepseek": lambda: transformers.DeepseekV2Config(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, head_dim=64, intermediate_size=10944,
        num_hidden_layers=2, first_k_dense_replace=2, vocab_size=32000, max_position_embeddings=163840),
}
EAGER = {"llama": modeling_llama.eager_attention_forward, "gemma2": modeling_gemma2.eager_attention_forward,
         "deepseek": modeling_deepseek_v2.eager_attention_forward}
#: The peers of each model: transformers' sdpa refuses Gemma 2's soft cap.
PEERS = {"llama": ["sdpa", "eager"], "gemma2": ["eager"], "deepseek": ["sdpa", "eager"]}
attention_seconds: list[float] = []


def timed(attention):
    """``attention`` with its wall time added to ``attention_seconds``."""
    def run(*args, **kwargs):
        start = time.perf_counter()
        result = attention(*args, **kwargs)
        attention_seconds.append(time.perf_counter() - start)
        return result
    return run


def register_timed(model_name: str) -> dict:
    """implementation label -> registered name of its timed attention."""
    ours = hf.register()
    functions = {"linalg_prefill": (hf.attention, hf.attention_mask),
                 "sdpa": (transformers.integrations.sdpa_attention.sdpa_attention_forward, sdpa_mask),
                 "eager": (EAGER[model_name], eager_mask)}
    names = {}
    for label, (attention, mask) in functions.items():
        name = f"timed_{label}" if label != "linalg_prefill" else f"timed_{ours}"
        transformers.AttentionInterface.register(name, timed(attention))
        transformers.masking_utils.AttentionMaskInterface.register(name, mask)
        names[label] = name
    return names


def forward_times(model, names: dict, ids, reps: int) -> dict:
    """label -> median (forward seconds, attention seconds) over ``reps`` forwards after a warm-up
    each, the implementations (``names``: label -> registered name) taking turns forward by
    forward in an order shuffled each round (seeded): one after another, a slow phase of a noisy
    VM fell on one of them (ours 0.96x sdpa in one run, 1.04x in the one before)."""
    forwards, attentions = defaultdict(list), defaultdict(list)
    for rep in range(reps + 1):
        order = list(names.items())
        random.Random(rep).shuffle(order)
        for label, name in order:
            model.set_attn_implementation(name)
            attention_seconds.clear()
            start = time.perf_counter()
            with torch.no_grad():
                model.model(ids)
            if rep:
                forwards[label].append(time.perf_counter() - start)
                attentions[label].append(sum(attention_seconds))
    return {label: (statistics.median(forwards[label]), statistics.median(attentions[label])) for label in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--models", default="llama,gemma2")
    args = parser.parse_args()
    print(f"CPU: {cpu_description()}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"{args.tokens} tokens, median of {args.reps}")
    print("model   dtype     impl            forward_s  attention_s  fwd_ratio  attn_ratio")
    for model_name in args.models.split(","):
        names = register_timed(model_name)
        peers = PEERS[model_name]
        for dtype in args.dtypes.split(","):
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(MODELS[model_name]()).to(getattr(torch, dtype))
            model.eval()
            ids = torch.randint(0, 32000, (1, args.tokens))
            times = forward_times(model, {label: names[label] for label in ("linalg_prefill", *peers)}, ids, args.reps)
            ours = times["linalg_prefill"]
            print(f"{model_name:7} {dtype:9} {'linalg_prefill':15} {ours[0]:9.3f}  {ours[1]:11.3f}")
            for peer in peers:
                theirs = times[peer]
                print(f"{model_name:7} {dtype:9} {peer:15} {theirs[0]:9.3f}  {theirs[1]:11.3f}  "
                      f"{theirs[0] / ours[0]:9.2f}  {theirs[1] / ours[1]:10.2f}", flush=True)
            del model


if __name__ == "__main__":
    main()
