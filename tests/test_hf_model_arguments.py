"""Models whose attention hands the kernels more than Llama's (linalg_prefill/hf_model_arguments.py),
against transformers' eager attention, every kernel call also within its float64 reference's
bound (tests/test_hf_adapter.py's ``checked_attention``): DeepSeek V3's MLA (d_qk 24, d_v 16: the
dense and paged kernels on V zero-padded, the ragged ones on both head dims), V3.2's sparse
attention (its indexer's 6 keys a query folded into the mask), V4's compressed KV slots (their
bias appended to an additive mask) with its per-head sinks; and the arguments refused by name.
Each family's test also runs the adapter without what it reads for that family, and those
logits must differ from eager's: the test can fail.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")  # CI installs the hf extra: these never skip there
transformers = pytest.importorskip("transformers")

import linalg_prefill.hf as hf  # noqa: E402
from linalg_prefill import hf_model_arguments  # noqa: E402
from linalg_prefill.mlir import PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec  # noqa: E402
from linalg_prefill.mlir.decode import DecodeSpec  # noqa: E402
from linalg_prefill.runtime import InputError  # noqa: E402

from hf_models import tiny_model  # noqa: E402
from test_hf_adapter import CHECKED, LOGIT_TOLERANCE, calls  # noqa: E402
# the adapter tests' autouse fixtures: the checked attention registered, its records cleared each test
from test_hf_adapter import fresh_calls, registered  # noqa: E402,F401

FAMILIES = ("deepseek_v3", "deepseek_v32", "deepseek_v4")
MLA_HND = RaggedPrefillSpec(4, 4, 24, 16, "float32", kv_order="hnd")
#: V3.2's decode steps: each row's 6 chosen keys gathered, the two rows folded into 8 heads.
DSA_HND = RaggedPrefillSpec(8, 8, 24, 16, "float32", kv_order="hnd")
V4_HND = RaggedPrefillSpec(8, 2, 32, 32, "float32", kv_order="hnd", head_sinks=True)
#: What each family's prompt, left-padded batch and generate open: V3's dense and paged kernels
#: of one head dim (24, V padded), its decode steps' head-major ragged one (24 / 16) and pass;
#: V3.2's mask with the indexer's choice (holes: the custom-mask kernel) and its decode steps on
#: the chosen keys gathered; V4's custom-mask
#: kernel (one KV head of 32, sinks) and the decode steps whose keys are one range (two rows
#: folded into 8 heads).
SPECS = {
    "deepseek_v3": [SequencePrefillSpec(4, 4, 24, "float32", causal=True, sm_scale=24 ** -0.5),
                    PagedPrefillSpec(4, 4, 24, "float32", page_size=hf.PAGE_SIZE, sliding_window=True),
                    MLA_HND, DecodeSpec(MLA_HND)],
    "deepseek_v32": [RaggedPrefillSpec(4, 4, 24, 16, "float32", custom_mask=True), DSA_HND, DecodeSpec(DSA_HND)],
    "deepseek_v4": [RaggedPrefillSpec(4, 1, 32, 32, "float32", head_sinks=True, custom_mask=True), V4_HND,
                    DecodeSpec(V4_HND)],
}
#: What each family's run without the adapter's reading of it gives (the logits must then differ).
WITHOUT = {
    "deepseek_v32": ("with_selected_keys", lambda indices, mask, *args, **kwargs: mask),
    "deepseek_v4": ("wants_additive_mask", lambda config: False),
}


def _run(model, implementation: str, ids, mask) -> tuple:
    """(the prompt's logits, the padded batch's, 10 greedy tokens of the batch, the logits of its
    decode steps ``[10, B, vocab]``) under ``implementation``."""
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                                   output_logits=True, return_dict_in_generate=True)
        return (model(ids[:1]).logits, model(ids, attention_mask=mask).logits, generated.sequences,
                torch.stack(generated.logits))


def _differ(got, want, where) -> float:
    """max |got - want| over the rows ``where`` keeps, relative to ``want``'s scale there."""
    return float((got[where] - want[where]).abs().max() / want[where].abs().max())


@pytest.mark.parametrize("family", [pytest.param(family, marks=pytest.mark.compiles(*SPECS[family]))
                                    for family in FAMILIES])
def test_prompt_padded_batch_and_generate_match_eager(family, monkeypatch):
    """A prompt of 37 tokens, a batch of two left-padded by 11 and its 10 greedy tokens, each call
    checked and then as the registered attention runs them: logits (the decode steps' too) within
    LOGIT_TOLERANCE of eager's, the same tokens; the attention sharply peaked (at least half the rows over half
    their weight on one key)."""
    model = tiny_model(family)
    ids = torch.randint(3, 96, (2, 37), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    with torch.no_grad():
        weights = model(ids[:1], output_attentions=True).attentions
    assert all(float((w.max(-1).values > 0.5).float().mean()) > 0.5 for w in weights)
    eager = _run(model, "eager", ids, mask)
    everything, kept = torch.ones_like(ids[:1], dtype=torch.bool), mask.bool()
    for implementation in (CHECKED, hf.register()):   # each call checked; as a model runs it
        ours = _run(model, implementation, ids, mask)
        assert _differ(ours[0], eager[0], everything) <= LOGIT_TOLERANCE
        assert _differ(ours[1], eager[1], kept) <= LOGIT_TOLERANCE
        assert torch.equal(ours[2], eager[2])
        assert _differ(ours[3], eager[3], torch.ones(ours[3].shape[:2], dtype=torch.bool)) <= LOGIT_TOLERANCE
    assert {spec for spec, *_ in calls} >= {s.symbol for s in SPECS[family] if not isinstance(s, DecodeSpec)}
    if family in WITHOUT:   # the same without the adapter's reading of the family: not eager's
        monkeypatch.setattr(hf_model_arguments, *WITHOUT[family])
        without = _run(model, hf.register(), ids, mask)
        assert _differ(without[1], eager[1], kept) > 100 * LOGIT_TOLERANCE


def _tensors(h_q=4, h_kv=2, q_len=3, kv_len=5, d=16):
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(1, h_q, q_len, d, generator=generator), torch.randn(1, h_kv, kv_len, d, generator=generator),
            torch.randn(1, h_kv, kv_len, d, generator=generator))


class _Module:
    is_causal = True


def test_arguments_the_kernels_cannot_run_are_refused_by_name():
    q, k, v = _tensors()
    cases = {
        "position_bias": dict(position_bias=torch.zeros(1, 4, 3, 5)),
        "block_indices": dict(block_indices=torch.zeros(1, 3, 2, dtype=torch.int32)),
        "sinks": dict(sinks=torch.zeros(1, 4, 3, 1)),   # Inkling's per-token sinks
        "indices": dict(indices=torch.zeros(1, 3, 2, dtype=torch.int32),
                        cu_seq_lens_q=torch.tensor([0, 3]), cu_seq_lens_k=torch.tensor([0, 5])),
    }
    for name, kwargs in cases.items():
        with pytest.raises(InputError, match=f"^{name}:"):
            hf.attention(_Module(), q, k, v, None, **kwargs)
    with pytest.raises(InputError, match="^sinks: given with s_aux"):
        hf.attention(_Module(), q, k, v, None, s_aux=torch.zeros(4), sinks=torch.zeros(4))
    for indices, why in ((torch.zeros(1, 3, dtype=torch.int32), "expected"),
                         (torch.full((1, 3, 2), 5, dtype=torch.int32), r"in \[0, 5\)"),
                         (torch.full((1, 3, 2), -2, dtype=torch.int32), r"in \[0, 5\)"),
                         (torch.zeros(1, 3, 2), "integer")):
        with pytest.raises(InputError, match=f"^indices: .*{why}"):
            hf.attention(_Module(), q, k, v, None, indices=indices)
    with pytest.raises(InputError, match="^attention_mask: an additive mask"):
        hf.attention(_Module(), q, k, v, torch.full((1, 1, 3, 5), 0.5), indices=torch.zeros(1, 3, 2, dtype=torch.int32))


@pytest.mark.compiles(RaggedPrefillSpec(4, 2, 16, 16, "float32", kv_order="hnd", head_sinks=True))
def test_a_models_per_head_sinks_named_sinks_are_its_s_aux():
    """``sinks`` of one logit a query head run as gpt-oss's ``s_aux`` do: the same output."""
    q, k, v = _tensors(q_len=1, kv_len=7)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    named, aux = (hf.attention(_Module(), q, k, v, None, **{key: sinks})[0] for key in ("sinks", "s_aux"))
    assert torch.equal(named, aux)


WIDE_VALUES = SequencePrefillSpec(4, 2, 24, "float32", causal=True, sm_scale=16 ** -0.5)


@pytest.mark.compiles(WIDE_VALUES)
def test_values_wider_than_the_keys_run_on_zero_padded_queries_and_keys():
    """d_v 24 > d_qk 16 (the other way round from MLA): q and k zero-padded to 24 for the dense
    kernel, the scores unchanged; against torch's SDPA of the unpadded tensors."""
    generator = torch.Generator().manual_seed(3)
    q, k = (4.0 * torch.randn(1, heads, 29, 16, generator=generator) for heads in (4, 2))
    v = torch.randn(1, 2, 29, 24, generator=generator)
    output, _ = hf.attention(_Module(), q, k, v, None)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert output.shape == (1, 29, 4, 24)
    assert float((output - want.transpose(1, 2)).abs().max()) <= 1e-5


def test_a_model_that_computes_attention_itself_is_refused():
    """Bloom and MPT (ALiBi in their own code) never call the attention interface: with this
    implementation they ran their eager code on its boolean mask, logits 0.04-0.6 off eager's,
    and no kernel. Refused by name when the model asks for its mask; eager still runs them."""
    for config in (transformers.BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=96),
                   transformers.MptConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=96)):
        ids = torch.arange(3, 12)[None]
        for implementation in (hf.register(), "eager"):
            model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                                  attn_implementation=implementation).eval()
            with torch.no_grad():
                if implementation == "eager":
                    assert torch.isfinite(model(ids).logits).all()
                    continue
                with pytest.raises(InputError, match=f"^attn_implementation: {config.model_type}'s model"):
                    model(ids)
    hf_model_arguments.check_model(transformers.PretrainedConfig())   # no model class to read: not refused
    hf_model_arguments.check_model(None)



@pytest.mark.compiles(RaggedPrefillSpec(4, 2, 16, 16, "float32", custom_mask=True))
def test_indices_of_minus_one_choose_no_key():
    """Sparse-attention kernels pad a query's top-k with -1: those choose nothing. A query whose
    only index is -1 sees no key (output 0); one listing keys 0 and 2 sees those two, as torch's
    SDPA with that mask."""
    q, k, v = _tensors(q_len=2, kv_len=5)
    indices = torch.tensor([[[-1, -1], [0, 2]]], dtype=torch.int32)
    mask = torch.ones(1, 1, 2, 5, dtype=torch.bool)
    output, _ = hf.attention(_Module(), q, k, v, mask, indices=indices)
    assert float(output[0, 0].abs().max()) == 0.0
    chosen = torch.zeros(1, 1, 1, 5, dtype=torch.bool)
    chosen[..., [0, 2]] = True
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, 1:], k, v, attn_mask=chosen, enable_gqa=True)
    assert float((output[0, 1] - want[0, :, 0]).abs().max()) <= 1e-5


GATHERED = RaggedPrefillSpec(4, 2, 16, 16, "float32", kv_order="hnd")


@pytest.mark.compiles(GATHERED, DecodeSpec(GATHERED))
def test_a_decode_step_reads_only_the_chosen_keys():
    """A decode step of two rows over 9 keys whose indexer keeps 3 and 1 (-1 padding): each row's
    chosen keys gathered and attended, one call a row (their counts differ), as torch's SDPA with
    the chosen keys as its mask."""
    generator = torch.Generator().manual_seed(5)
    q = 4.0 * torch.randn(2, 4, 1, 16, generator=generator)
    k, v = (torch.randn(2, 2, 9, 16, generator=generator) for _ in range(2))
    indices = torch.tensor([[[1, 4, 7]], [[2, -1, -1]]], dtype=torch.int32)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    call = hf.plan_call(_Module(), q, k, v, mask, indices=indices)
    assert call.spec == GATHERED and [args[2].shape[1] for args in call.rows] == [3, 3]
    chosen = torch.zeros(2, 1, 1, 9, dtype=torch.bool)
    chosen[0, ..., [1, 4, 7]] = True
    chosen[1, ..., 2] = True
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=chosen, enable_gqa=True)
    output, _ = hf.attention(_Module(), q, k, v, mask, indices=indices)
    assert float((output - want.transpose(1, 2)).abs().max()) <= 1e-5
