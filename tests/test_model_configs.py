"""Each example model config derives exactly the attention its layers run (configs/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from linalg_prefill.mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from linalg_prefill.pipeline.model_config import load_model_config, specs_for_model

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
                                  "stablelm-2-1.6b.json", "deepseek-v2-lite.json", "deepseek-v3.json"])
def test_every_example_config_round_trips_through_the_manifest_fields(name):
    """The manifest records each spec's fields; they rebuild the same spec (cap and rotary_dim
    included)."""
    for spec in _specs(name)[1]:
        assert type(spec)(**spec.fields()) == spec
