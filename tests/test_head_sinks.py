"""Per-head sink logits (``head_sinks``, semantics §13): every variant on both lowerings against
the float64 reference (rows with no visible key, and short entries through the serving passes),
bad ``sinks``, ``merge.apply_sinks`` after a split KV, and the IR of specs without sinks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import assert_matches_reference, on_backends
from linalg_prefill.mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
    build_module,
)
from linalg_prefill.mlir.abi import argument_names
from linalg_prefill.mlir.decode import DecodeSpec
from linalg_prefill.pipeline import Target
from linalg_prefill.runtime import InputError, open_kernel, reference
from linalg_prefill.runtime.compare import error_bound, reference_for
from linalg_prefill.runtime.decode import DECODE_PASSES, pass_queries
from linalg_prefill.runtime.error_model import merge_bound, sinks_bound
from linalg_prefill.runtime.examples import example_inputs
from linalg_prefill.runtime.merge import apply_sinks, merge_state
from linalg_prefill.runtime.reference import EMPTY_ROW_LSE

#: One spec per variant, each with one dtype (f32 or a half type).
SPECS = {
    "dense": SequencePrefillSpec(4, 2, 16, "float16", causal=True, sm_scale=0.25, head_sinks=True),
    "masked": MaskedSequencePrefillSpec(4, 2, 16, "float32", mask_mode="padded", sm_scale=0.25, head_sinks=True),
    "ragged": RaggedPrefillSpec(4, 2, 16, 16, "bfloat16", head_sinks=True),
    "paged": PagedPrefillSpec(4, 2, 16, "float32", page_size=8, head_sinks=True),
    "paged_window": PagedPrefillSpec(4, 1, 16, "float16", page_size=8, sliding_window=True, head_sinks=True),
    "mla": MlaPagedPrefillSpec(4, 16, 8, "float32", page_size=8, head_sinks=True),
}
#: (qo_len, kv_len): causal rows with no key in a long entry (20 queries: the variant's kernel)
#: and in a short one (4 queries: a serving pass, the 4-query one or one query at a time where
#: its scratch bound rules that out), an entry without KV, and a short entry that sees a long
#: cache.
ENTRIES = ((20, 12), (4, 2), (2, 0), (3, 40))
#: Each variant on one lowering, the lowerings in turn (the sinks are applied by code each lowering
#: shares across its variants: online_softmax._finalize, attention_op), and on every GPU.
CASES = [(SPECS[variant], lowering) for variant, lowering in [
    ("dense", "fused"), ("masked", "linalg"), ("ragged", "linalg"), ("paged", "fused"), ("paged_window", "linalg"),
    ("mla", "fused")]]


def _call(spec, seed=0):
    """A call with RoPE off (so short entries take the serving pass), peaked scores (q scaled by
    4) and sinks in [-2, 4) (examples.SINK_RANGE)."""
    rng = np.random.default_rng(seed)
    if spec.kv_layout == "dense":
        args = example_inputs(spec, rng)
    else:
        args = example_inputs(spec, rng, ENTRIES, **({"rotary_mode": 0} if spec.kv_layout != "latent" else {}))
    q = (np.asarray(args[0], np.float32) * 4).astype(args[0].dtype)
    return (q, *args[1:])


@pytest.mark.compiles(passes=ENTRIES)  # with the serving passes ENTRIES take (tests/conftest.py)
@pytest.mark.parametrize("spec, backend", on_backends(CASES))
def test_head_sinks_match_the_reference(spec, backend, cache):
    variant = spec.name
    args = _call(spec)
    want = reference_for(spec, args)
    assert np.any(want[1] == EMPTY_ROW_LSE), "the call must have rows with no visible key"
    if spec.kv_layout != "dense":
        lowering = "linalg" if backend == "llvm-cpu" else "fused"
        assert np.any(pass_queries(spec, args, DECODE_PASSES[lowering]) > 0), "an entry must take a serving pass"
    assert_matches_reference(variant, open_kernel(spec, backend, cache=cache)(*args), spec, args, want)


def test_the_sinks_change_the_result():
    """The reference with sinks is far outside the error bound of the one without (so the tests
    above would see a kernel that ignored them), and a sink of -inf is no sink."""
    spec = SPECS["ragged"]
    args = _call(spec)
    plain_spec = dataclasses.replace(spec, head_sinks=False)
    plain = reference_for(plain_spec, args[:-1])
    assert not error_bound(spec, args).holds(plain, reference_for(spec, args))
    no_sink = reference_for(spec, (*args[:-1], np.full(spec.h_q, -np.inf)))
    np.testing.assert_array_equal(no_sink[0], plain[0])
    np.testing.assert_array_equal(no_sink[1], plain[1])


def test_reference_sink_formula():
    """One row by hand: o = sum e^s v / (e^sink + sum e^s), lse = log2(e^sink + sum e^s)."""
    q = np.array([[[1.0, 0.0]]])  # [1 row, 1 head, d 2]
    k = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])  # scores 1 and 0 (sm_scale 1)
    v = np.array([[[2.0, 0.0]], [[0.0, 4.0]]])
    sink = 0.5
    out, lse = reference.batch_prefill_ragged_kv(q, [0, 1], k, v, [0, 2], [0], [0], 0, 0, 1.0, 1e4, 1.0,
                                                 np.array([sink]))
    total = np.e ** sink + np.e + 1.0
    np.testing.assert_allclose(out[0, 0], [2 * np.e / total, 4 / total])
    np.testing.assert_allclose(lse[0, 0], np.log2(total))


@pytest.mark.parametrize("bad, match", [
    (np.zeros(5, np.float32), r"sinks: expected shape \[4\]"),
    (np.zeros(4, np.float64), "sinks: expected dtype float32"),
    (np.array([0, np.nan, 0, 0], np.float32), "sinks: values must be finite"),
    (np.array([0, 0, np.inf, 0], np.float32), "sinks: values must be finite"),
])
@pytest.mark.compiles(SPECS["ragged"])
def test_bad_sinks_are_input_errors(bad, match, cache):
    spec = SPECS["ragged"]
    kernel = open_kernel(spec, "llvm-cpu", cache=cache)
    args = _call(spec)
    with pytest.raises(InputError, match=match):
        kernel(*args[:-1], bad)
    with pytest.raises(InputError, match="sinks: missing"):
        kernel(*args[:-1])


@pytest.mark.compiles(SPECS["ragged"], dataclasses.replace(SPECS["ragged"], head_sinks=False),  # and its 4-query pass
                      DecodeSpec(dataclasses.replace(SPECS["ragged"], head_sinks=False), 4), passes=False)
def test_apply_sinks_after_merging_a_split_kv(cache):
    """Keys split in two ragged calls without sinks, merged, then the sinks applied once: the
    ragged kernel with head_sinks over all the keys (within both their bounds) and the reference."""
    spec = SPECS["ragged"]
    plain = dataclasses.replace(spec, head_sinks=False)
    rng = np.random.default_rng(1)
    entries = ((6, 30), (3, 9), (5, 0))
    args = list(example_inputs(spec, rng, entries, causal=0, rotary_mode=0))
    named = dict(zip(argument_names(spec), args))
    named["q"] = (np.asarray(named["q"], np.float32) * 4).astype(named["q"].dtype)
    kv_indptr = named["kv_indptr"]
    cut = [(a + b) // 2 for a, b in zip(kv_indptr[:-1], kv_indptr[1:])]
    parts = []
    for first in (True, False):  # each entry's first half of its keys, then its second half
        rows = np.concatenate([np.arange(a, c) if first else np.arange(c, b)
                               for a, b, c in zip(kv_indptr[:-1], kv_indptr[1:], cut)]).astype(np.int64)
        lens = [c - a if first else b - c for a, b, c in zip(kv_indptr[:-1], kv_indptr[1:], cut)]
        part = dict(named, k=named["k"][rows], v=named["v"][rows],
                    kv_indptr=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        part.pop("sinks")
        parts.append(open_kernel(plain, "llvm-cpu", cache=cache)(*(part[n] for n in argument_names(plain))))
    merged = merge_state(*parts[0], *parts[1])
    out, lse = apply_sinks(*merged, named["sinks"])

    call = tuple(named[n] for n in argument_names(spec))
    want = reference_for(spec, call)
    bound = error_bound(spec, call, want)
    merge_out, merge_lse = merge_bound([p[0] for p in parts], [p[1] for p in parts])
    out_bound, lse_bound = sinks_bound(bound.output + merge_out, bound.lse + merge_lse, want[0], want[1], spec.dtype)
    assert np.all(np.abs(np.asarray(out, np.float64) - want[0]) <= out_bound)
    assert np.all(np.abs(np.asarray(lse, np.float64) - want[1]) <= lse_bound)
    empty = want[1] == EMPTY_ROW_LSE
    assert empty.any() and np.all(lse[empty] == EMPTY_ROW_LSE) and np.all(np.asarray(out[empty], np.float64) == 0)
    whole = open_kernel(spec, "llvm-cpu", cache=cache)(*call)
    whole_out, whole_lse = (np.asarray(x, np.float64) for x in whole)
    assert np.all(np.abs(np.asarray(out, np.float64) - whole_out) <= out_bound + bound.output)
    assert np.all(np.abs(np.asarray(lse, np.float64) - whole_lse) <= lse_bound + bound.lse)


def test_apply_sinks_is_stable_and_keeps_empty_rows():
    out = np.ones((3, 2, 4), np.float32)
    lse = np.array([[200.0, -200.0], [EMPTY_ROW_LSE, 0.0], [0.0, 0.0]], np.float32)
    sinks = np.array([150.0, -200.0], np.float32)  # e^150 = 2^216.4: far above; 2^-288.5: far below
    new_out, new_lse = apply_sinks(out, lse, sinks)
    assert np.all(np.isfinite(new_out)) and np.all(np.isfinite(new_lse))
    np.testing.assert_allclose(new_lse[0], [216.40, -200.0], atol=0.01)
    assert new_out[0, 0, 0] < 1e-4 and new_out[0, 1, 0] == 1.0
    np.testing.assert_array_equal(new_out[1, 0], out[1, 0])
    assert new_lse[1, 0] == EMPTY_ROW_LSE
    with pytest.raises(InputError, match="sinks"):
        apply_sinks(out, lse, np.zeros(3, np.float32))


def test_specs_without_sinks_keep_their_names_and_structure():
    """head_sinks=False (the default) names the artifact as before and builds no sinks argument;
    with it, the module gains only the last argument and element-wise ops: no loop or branch.
    (Byte-identical IR without sinks was checked with pipeline.tuning.tuned_ir before and after.)"""
    spec = PagedPrefillSpec(4, 2, 16, "float32", page_size=8)
    assert spec.name == "batch_prefill_paged_kv_hq4_hkv2_d16_float32_ps8_rope-default_qt64_kt128"
    assert dataclasses.replace(spec, head_sinks=True).name == spec.name + "_sinks"
    for with_sinks in SPECS.values():
        plain = dataclasses.replace(with_sinks, head_sinks=False)
        for target in (None, Target("llvm-cpu", lowering="fused")):
            from linalg_prefill.pipeline.tuning import tuned_ir

            text = str(build_module(plain)) if target is None else tuned_ir(plain, target)
            sinks_text = str(build_module(with_sinks)) if target is None else tuned_ir(with_sinks, target)
            assert "sinks" not in argument_names(plain) and argument_names(with_sinks)[-1] == "sinks"
            signature = sinks_text.split("func.func")[1].split(") ->")[0]
            parameters = signature.split("(", 1)[1].split(", ")   # the table's, then the results' storage
            assert parameters[len(argument_names(with_sinks)) - 1].endswith("tensor<4xf32>"), with_sinks.name
            for op in ("scf.for", "scf.if", "scf.while", "iree_linalg_ext.online_attention"):
                assert text.count(op) == sinks_text.count(op), (with_sinks.name, op)


def test_head_sinks_must_be_a_bool():
    with pytest.raises(ValueError, match="head_sinks"):
        RaggedPrefillSpec(4, 2, 16, 16, "float32", head_sinks="yes")


def test_gpt_oss_config_sets_head_sinks(tmp_path):
    """A gpt-oss config.json builds every kernel with head_sinks (its layers' ``sinks``); a
    Llama one without."""
    transformers = pytest.importorskip("transformers")
    from linalg_prefill.pipeline.model_config import load_model_config, specs_for_model

    common = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_hidden_layers=2)
    transformers.GptOssConfig(**common, sliding_window=128).save_pretrained(tmp_path / "gpt_oss")
    cfg = load_model_config(tmp_path / "gpt_oss" / "config.json", dtype="bfloat16")
    assert cfg.head_sinks and cfg.sliding_window and cfg.window == 128
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    assert all(cfg.layer(i).head_sinks for i in range(2))
    assert cfg.ragged_spec(cfg.layer(0)).head_sinks
    specs = specs_for_model(cfg)
    assert specs and all(spec.head_sinks for spec in specs)
    assert any(getattr(spec, "sliding_window", False) for spec in specs)
    transformers.LlamaConfig(**common).save_pretrained(tmp_path / "llama")
    llama = load_model_config(tmp_path / "llama" / "config.json", dtype="bfloat16")
    assert not llama.head_sinks and not any(spec.head_sinks for spec in specs_for_model(llama))


#: The kernels the adapter opens for tests/hf_models.py's gpt-oss in the test below.
GPT_OSS_PAGED = PagedPrefillSpec(4, 2, 16, "float32", page_size=16, sliding_window=True, head_sinks=True)
GPT_OSS = (SequencePrefillSpec(4, 2, 16, "float32", causal=True, sm_scale=0.25, head_sinks=True), GPT_OSS_PAGED,
           DecodeSpec(GPT_OSS_PAGED))


@pytest.mark.compiles(*GPT_OSS, passes=False)
def test_gpt_oss_through_the_adapter_matches_eager():
    """A tiny gpt-oss (peaked scores, sinks in [-2, 4)) through linalg_prefill.hf: its ``s_aux``
    reaches the kernels as ``sinks``; logits as eager's within 1e-4 of their scale, on one prompt
    (dense kernel, and the paged one where the window of 8 binds) and a left-padded batch (paged;
    padding rows give 0). Eager without the sinks is far off, so the sinks are what match."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import linalg_prefill.hf as hf
    from hf_models import tiny_model

    name = hf.register()
    model = tiny_model("gpt_oss")
    ids = torch.randint(0, 96, (2, 29), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0

    def logits(implementation, **kwargs):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            return model(ids if kwargs else ids[:1], **kwargs).logits.float()

    for kwargs in ({}, {"attention_mask": mask}):
        got, eager = logits(name, **kwargs), logits("eager", **kwargs)
        where = mask.bool() if kwargs else slice(None)
        scale = float(eager[where].abs().max())
        assert torch.isfinite(got).all()
        assert float((got[where] - eager[where]).abs().max()) <= 1e-4 * scale
    saved = [layer.self_attn.sinks.detach().clone() for layer in model.model.layers]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    without = logits("eager")
    with torch.no_grad():
        for layer, sinks in zip(model.model.layers, saved):
            layer.self_attn.sinks.copy_(sinks)
    assert float((without - logits("eager")).abs().max()) > 1e-2 * float(without.abs().max())
