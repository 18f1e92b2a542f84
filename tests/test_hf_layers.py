"""The config a transformers model saves builds, through ``load_model_config``, the attention its
layers run: every layer's ragged kernel, RoPE inline on the pre-RoPE q and k the layer computed,
gives the layer's eager attention output.

Per layer: the kernel's output is within its error bound of the float64 reference of the same
call (the reference applies the loaded config's RoPE), and so is eager's output (eager rotates
and accumulates in float32 too; measured at 0.01-0.03 of the bound). Measured sensitivity: theta
off by 5% puts eager 80-700 bounds from the reference, sm_scale off by 2% 360-660 bounds.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # CI installs the hf extra: these never skip there
transformers = pytest.importorskip("transformers")

from linalg_prefill.pipeline.model_config import load_model_config  # noqa: E402
from linalg_prefill.runtime import error_bound, open_kernel  # noqa: E402
from linalg_prefill.runtime.compare import reference_for  # noqa: E402

from conftest import assert_matches_reference  # noqa: E402
from hf_models import tiny_model  # noqa: E402

#: How far eager may be from the float64 reference, in units of the kernel's bound.
EAGER_BOUNDS = 1.0
MODULES = {"llama3": "llama", "qwen2": "qwen2", "qwen2-yarn": "qwen2", "gemma2": "gemma2"}


def _record_layers(family: str, model, ids) -> list[dict]:
    """Per layer: the pre-RoPE q ``[S, H_q, D]`` and k, v ``[S, H_kv, D]`` and eager's output
    ``[S, H_q, D]`` of a batch of one."""
    modeling = importlib.import_module(f"transformers.models.{MODULES[family]}.modeling_{MODULES[family]}")
    layers: list[dict] = []
    rotate, eager = modeling.apply_rotary_pos_emb, modeling.eager_attention_forward

    def recording_rotate(q, k, cos, sin, *args, **kwargs):
        layers.append(dict(q=q[0].transpose(0, 1), k=k[0].transpose(0, 1)))
        return rotate(q, k, cos, sin, *args, **kwargs)

    def recording_eager(module, query, key, value, attention_mask, **kwargs):
        output, weights = eager(module, query, key, value, attention_mask, **kwargs)
        layers[-1].update(v=value[0].transpose(0, 1), output=output[0])
        return output, weights

    transformers.AttentionInterface.register("eager_recorded", recording_eager)
    transformers.masking_utils.AttentionMaskInterface.register("eager_recorded",
                                                               transformers.masking_utils.eager_mask)
    model.set_attn_implementation("eager_recorded")
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(modeling, "apply_rotary_pos_emb", recording_rotate)
        model(ids)
    return [{name: tensor.contiguous().numpy() for name, tensor in layer.items()} for layer in layers]


def _ragged_call(layer, recorded: dict) -> tuple:
    """The ragged kernel's seed-ABI call of one layer: one entry per query (its window of keys,
    the keys duplicated per entry) for a sliding layer, one causal entry otherwise."""
    q, k, v = recorded["q"], recorded["k"], recorded["v"]
    n = len(q)
    positions = np.arange(n, dtype=np.int32)
    if layer.sliding and layer.window and layer.window < n:
        lo = np.maximum(positions - layer.window + 1, 0)
        rows = np.concatenate([np.arange(a, i + 1) for i, a in enumerate(lo)])
        k, v = k[rows], v[rows]
        kv_indptr = np.concatenate([[0], np.cumsum(positions + 1 - lo)]).astype(np.int32)
        q_indptr, k_offset = np.arange(n + 1, dtype=np.int32), lo.astype(np.int32)
    else:
        q_indptr = kv_indptr = np.array([0, n], np.int32)
        k_offset = np.zeros(1, np.int32)
    return (q, q_indptr, k, v, kv_indptr, positions, k_offset, 1, 1, layer.rope_scale, layer.rope_theta,
            layer.sm_scale)


@pytest.mark.parametrize("family", list(MODULES))
def test_every_layer_from_the_saved_config_equals_eager(family, tmp_path):
    model = tiny_model(family)
    model.config.save_pretrained(tmp_path)
    config = load_model_config(tmp_path / "config.json", dtype="float32")
    ids = torch.randint(0, 96, (1, 41), generator=torch.Generator().manual_seed(5))
    recorded = _record_layers(family, model, ids)
    assert len(recorded) == model.config.num_hidden_layers
    for index, layer_record in enumerate(recorded):
        layer = config.layer(index)
        spec = config.ragged_spec(layer)
        args = _ragged_call(layer, layer_record)
        want = reference_for(spec, args)
        output, lse = open_kernel(spec)(*args)
        assert_matches_reference(f"{family} layer {index}", (output, lse), spec, args, want)
        bound = error_bound(spec, args, want)
        eager_error = np.abs(layer_record["output"].astype(np.float64) - want[0])
        assert np.all(eager_error <= EAGER_BOUNDS * bound.output), \
            f"{family} layer {index}: eager is {float(np.max(eager_error / bound.output)):.3g} bounds away"
