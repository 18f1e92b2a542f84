"""transformers' continuous batching (``generate_batch``) throughput: linalg_prefill vs the engine's
own ``sdpa`` and ``paged|eager``, in the same run.

    python bench/hf_generate_batch.py [--requests 32] [--prompts 256,1024] [--new 64]
        [--dtypes float32,bfloat16] [--impls linalg_prefill,sdpa,paged|eager] [--page-size 256]
        [--max-batch-tokens 512] [--repeat 1]

A Llama-3-8B-shaped model cut to 2 layers (hidden 4096, 32 query / 8 KV heads, head dim 128)
with a thin MLP (1024) and a 4096-token vocabulary, random weights, so that attention is a large
share of the work. ``--requests`` prompts of lengths drawn uniformly from ``--prompts`` (seeded),
``--new`` greedy tokens each, one ``generate_batch`` call per implementation with the same
``ContinuousBatchingConfig`` (page size, batch budget, enough blocks for every request at once).
Printed per implementation: seconds for the call (the fastest of ``--repeat``, after one warm-up
call of 2 short requests that compiles our kernels), generated tokens per second, the ratio of
ours to the peer's tokens/s (above 1: ours is faster), and how many requests' tokens equal ours.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import transformers
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import linalg_prefill.hf as hf
from linalg_prefill.bench import cpu_description


def model_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                    intermediate_size=1024, num_hidden_layers=2, vocab_size=4096,
                                    max_position_embeddings=16384)


def run(model, implementation: str, prompts, new: int, batching: dict) -> tuple[float, list]:
    """(seconds, tokens of every request) of one generate_batch call."""
    model.set_attn_implementation(implementation)
    config = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=model.config.vocab_size,
                                           pad_token_id=0)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate_batch(prompts, generation_config=config,
                                   continuous_batching_config=ContinuousBatchingConfig(**batching), progress_bar=False)
    seconds = time.perf_counter() - start
    return seconds, [out[key].generated_tokens for key in sorted(out, key=lambda k: int(k.split("_")[-1]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompts", default="256,1024", help="shortest,longest prompt")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--impls", default="linalg_prefill,sdpa,paged|eager")
    parser.add_argument("--page-size", type=int, default=256, help="transformers' default: 256")
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    ours = hf.register()
    names = {"linalg_prefill": ours}
    shortest, longest = (int(x) for x in args.prompts.split(","))
    rng = np.random.default_rng(0)
    lengths = rng.integers(shortest, longest, args.requests, endpoint=True)
    blocks = int(sum(-(-(n + args.new) // args.page_size) for n in lengths)) + 8
    batching = dict(page_size=args.page_size, max_batch_tokens=args.max_batch_tokens, num_blocks=blocks)
    print(f"CPU: {cpu_description()}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads; "
          f"{args.requests} requests, prompts {shortest}-{longest} ({int(lengths.sum())} tokens), {args.new} new "
          f"tokens each; {batching}")
    print("dtype     impl            seconds  tokens/s  ours/peer  same_tokens")
    for dtype in args.dtypes.split(","):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(model_config()).to(getattr(torch, dtype)).eval()
        prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in lengths]
        results = {}
        for label in args.impls.split(","):
            name = names.get(label, label)
            run(model, name, [prompts[0][:40], prompts[1][:300]], 4, batching)  # warm-up (our kernels compile)
            best = None
            for _ in range(args.repeat):
                seconds, tokens = run(model, name, prompts, args.new, batching)
                best = seconds if best is None else min(best, seconds)
            results[label] = (best, tokens)
            rate = args.requests * args.new / best
            ratio = "" if label == "linalg_prefill" or "linalg_prefill" not in results else \
                f"{best / results['linalg_prefill'][0]:9.2f}"
            same = "" if "linalg_prefill" not in results else \
                sum(a == b for a, b in zip(tokens, results["linalg_prefill"][1]))
            print(f"{dtype:9} {label:15} {best:7.1f}  {rate:8.1f}  {ratio:9}  {same}", flush=True)
        del model


if __name__ == "__main__":
    main()
