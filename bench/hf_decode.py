"""Decode steps of transformers' ``generate`` path (DynamicCache) at a long cached prefix:
linalg_prefill vs sdpa vs eager, in the same run.

    python bench/hf_decode.py [--cached 2048] [--steps 16] [--dtypes float32,bfloat16] [--batch 1]
        [--cache dynamic|fp8|inplace] [--per-module] [--model llama|deepseek]

``--cache fp8``: transformers' 8-bit cache (``QuantizedCache("fp8")``: e4m3 states, one scale per
tensor) for sdpa and eager, which it dequantises whole every step, and ``hf.Fp8KvCache`` (the
same cache, its decode steps read in place) for linalg_prefill; the step time is the comparison
(transformers' dequantisation runs in its cache update, outside the attention). ``--cache
inplace``: ``hf.KvCache`` (a DynamicCache whose steps write their keys into buffers with room,
linalg_prefill/hf_cache.py) for linalg_prefill, transformers' DynamicCache (what ``generate``
makes) for sdpa and eager, and sdpa on a KvCache too (``sdpa+KvCache``: the same cache under
torch's attention, which reads its views as they lie).

A Llama-3-8B-shaped model cut to 2 layers (hidden 4096, 32 query / 8 KV heads, head dim 128) with a
thin MLP (1024) and a 4096-token vocabulary, random weights: attention and its cache dominate a
step. ``--model deepseek``: DeepSeek-V2-Lite's MLA instead (hidden 2048, 16 heads of d_qk 192 and
d_v 128; transformers caches the latents and expands every cached key and value each step, so the
expansion, not the attention, dominates its step). The prompt (``--cached`` tokens) is prefilled
once per implementation, each into its own DynamicCache; then ``--steps`` decode steps run as
``generate`` runs them (``model(next_token, cache=cache)``, the cache appending each step's keys),
the implementations taking turns step by step, so that a slow phase of a noisy machine hits each of
them. Printed: the median ms a step, the attention calls' share of it (the attention function timed
per call), and ``ratio`` = peer ms / ours (above 1: ours is faster). The greedy tokens of every
implementation are compared with eager's (``tokens_as_eager``: True, or the first step that
differs). ``--per-module``: also each module's median ms a step (forward hooks down to the
projections) and each attention call's, per implementation: where a step's difference lies.

torch's OpenMP threads spin for a while after each parallel op (libgomp's default wait), on the
cores the kernels' IREE workers then need; ``OMP_WAIT_POLICY=PASSIVE`` or ``GOMP_SPINCOUNT``
change that for the whole run (torch's own ops included) and the header says which is set
(docs/performance.md, eighth session, measures both).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import defaultdict

import torch
import transformers
from transformers.masking_utils import eager_mask, sdpa_mask
from transformers.models.deepseek_v2 import modeling_deepseek_v2
from transformers.models.llama import modeling_llama

import linalg_prefill.hf as hf
from linalg_prefill.bench import cpu_description

attention_seconds: list[float] = []


MODELS = {
    "llama": lambda: transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=1024,
        num_hidden_layers=2, vocab_size=4096, max_position_embeddings=16384),
    "deepseek": lambda: transformers.DeepseekV2Config(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, head_dim=64, intermediate_size=1024,
        num_hidden_layers=2, first_k_dense_replace=2, vocab_size=4096, max_position_embeddings=16384),
}
EAGER = {"llama": modeling_llama.eager_attention_forward, "deepseek": modeling_deepseek_v2.eager_attention_forward}


def timed(attention):
    def run(*args, **kwargs):
        start = time.perf_counter()
        result = attention(*args, **kwargs)
        attention_seconds.append(time.perf_counter() - start)
        return result
    return run


def register_timed(model_name: str) -> dict:
    """implementation label -> registered name of its timed attention."""
    hf.register()
    functions = {"linalg_prefill": (hf.attention, hf.attention_mask),
                 "sdpa": (transformers.integrations.sdpa_attention.sdpa_attention_forward, sdpa_mask),
                 "eager": (EAGER[model_name], eager_mask)}
    for label, (attention, mask) in functions.items():
        transformers.AttentionInterface.register(f"timed_{label}", timed(attention))
        transformers.masking_utils.AttentionMaskInterface.register(f"timed_{label}", mask)
    return {label: f"timed_{label}" for label in functions}


def new_cache(label: str, kind: str, config):
    """The cache ``label``'s implementation decodes over: DynamicCache, an 8-bit one, or a
    KvCache (for linalg_prefill and sdpa+KvCache under ``inplace``)."""
    if kind == "fp8":
        return hf.Fp8KvCache(config) if label == "linalg_prefill" else transformers.QuantizedCache("fp8", config)
    if kind == "inplace" and label in ("linalg_prefill", "sdpa+KvCache"):
        return hf.KvCache(config)
    return transformers.DynamicCache(config=config)


class ModuleTimes:
    """Seconds of each module's forward in the timed steps, per implementation (``label``, set
    before each step; None: not timed): forward hooks on the model's modules whose names have
    fewer than ``depth`` dots (down to a layer's projections)."""

    def __init__(self, model, depth: int = 5):
        self.label, self.seconds, self.order, self._start = None, defaultdict(list), [], {}
        for name, module in model.named_modules():
            if name and name.count(".") < depth:
                self.order.append(name)
                module.register_forward_pre_hook(lambda _m, _a, name=name: self._begin(name))
                module.register_forward_hook(lambda _m, _a, _o, name=name: self._stop(name))

    def _begin(self, name: str) -> None:
        self._start[name] = time.perf_counter()

    def _stop(self, name: str) -> None:
        if self.label is not None:
            self.seconds[self.label, name].append(time.perf_counter() - self._start[name])

    def note_calls(self, calls: list) -> None:
        """Each attention call's seconds of the step just run, by its index in the step."""
        for i, seconds in enumerate(calls):
            self.seconds[self.label, f"attention call {i}"].append(seconds)

    def print(self, labels) -> None:
        calls = sorted({name for _, name in self.seconds if name not in self.order})
        names = calls + [name for name in self.order if any(self.seconds[label, name] for label in labels)]
        print("  per module, median ms a step: " + "  ".join(f"{label:>14}" for label in labels))
        for name in names:
            medians = [statistics.median(self.seconds[label, name]) * 1e3 if self.seconds[label, name] else 0.0
                       for label in labels]
            if max(medians) >= 0.05:
                print(f"  {name:42}" + "  ".join(f"{m:14.3f}" for m in medians))


def decode(model, names: dict, prompt: torch.Tensor, steps: int, cache_kind: str = "dynamic",
           timer: ModuleTimes | None = None) -> dict:
    """label -> (median step seconds, median attention seconds a step, greedy tokens) of ``steps``
    decode steps after a prefill of ``prompt``, the implementations (``names``: label -> registered
    name) taking turns step by step in an order shuffled each step (seeded), after one untimed
    step each; ``timer`` times the modules of the timed steps. In a fixed order the step after
    eager's (which streams its score matrices through the caches) started cold: batch 4, bf16,
    the first label's step 24.75 ms against 22.09 for sdpa on the same KvCache, 23.6 against 25.1
    with the two alone (docs/performance.md, thirteenth session)."""
    state = {}
    with torch.no_grad():
        for label, name in names.items():
            model.set_attn_implementation(name)
            cache = new_cache(label, cache_kind, model.config)
            token = model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
            state[label] = dict(cache=cache, token=token, tokens=[int(token[0, 0])], step_s=[], attention_s=[])
        for step in range(steps + 1):
            order = list(names.items())
            random.Random(step).shuffle(order)
            for label, name in order:
                run = state[label]
                model.set_attn_implementation(name)
                attention_seconds.clear()
                if timer is not None:
                    timer.label = label if step else None
                start = time.perf_counter()
                out = model(run["token"], cache=run["cache"], use_cache=True)
                run["token"] = out.logits[:, -1:].argmax(-1)
                if step:
                    run["step_s"].append(time.perf_counter() - start)
                    run["attention_s"].append(sum(attention_seconds))
                    if timer is not None:
                        timer.note_calls(list(attention_seconds))
                run["tokens"].append(int(run["token"][0, 0]))
    return {label: (statistics.median(run["step_s"]), statistics.median(run["attention_s"]), run["tokens"])
            for label, run in state.items()}


def same_tokens(tokens: list, eager: list) -> str:
    """"True", or the first step whose greedy token differs from eager's: in bf16 two logits one
    ulp apart can round to a tie (docs/performance.md, twelfth session), after which the
    sequences part."""
    step = next((i for i, (a, b) in enumerate(zip(tokens, eager)) if a != b), None)
    return "True" if step is None and len(tokens) == len(eager) else f"from step {step}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cached", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cache", default="dynamic", choices=["dynamic", "fp8", "inplace"])
    parser.add_argument("--per-module", action="store_true", help="each module's and attention call's ms a step")
    parser.add_argument("--model", default="llama", choices=sorted(MODELS))
    args = parser.parse_args()
    names = register_timed(args.model)
    if args.cache == "inplace":
        names = {"linalg_prefill": names["linalg_prefill"], "sdpa": names["sdpa"], "sdpa+KvCache": names["sdpa"],
                 "eager": names["eager"]}
    waits = ", ".join(f"{name}={os.environ[name]}" for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if name in os.environ)
    print(f"CPU: {cpu_description()}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads"
          f" ({waits or 'OpenMP waits as by default'}); decode steps at {args.cached} cached, batch {args.batch}, "
          f"{args.cache} cache, median of {args.steps}")
    print("dtype     impl            step_ms  attention_ms  step_ratio  attn_ratio  tokens_as_eager")
    for dtype in args.dtypes.split(","):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(MODELS[args.model]()).to(getattr(torch, dtype)).eval()
        prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.cached))
        timer = ModuleTimes(model) if args.per_module else None
        results = decode(model, names, prompt, args.steps, args.cache, timer)
        ours = results["linalg_prefill"]
        for label, (step, attention, tokens) in results.items():
            ratio = "" if label == "linalg_prefill" else f"{step / ours[0]:10.2f}  {attention / ours[1]:10.2f}"
            print(f"{dtype:9} {label:15} {step * 1e3:7.2f}  {attention * 1e3:12.2f}  {ratio:22}  "
                  f"{same_tokens(tokens, results['eager'][2])}", flush=True)
        if timer is not None:
            timer.print(list(results))
        del model


if __name__ == "__main__":
    main()
