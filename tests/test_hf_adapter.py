"""transformers models on the kernels (linalg_prefill.hf), against transformers' eager attention.

Every attention call a model makes through the adapter is also checked against the float64
reference of the same kernel call within its error bound (runtime/error_model.py), rows without a
key exactly 0: the ``checked`` implementation below. Logits are compared with eager's. In
float32 the attention outputs are within ~1e-6 relative of exact and the rest of the model is the
same torch code, so logits may differ by a small multiple of that after two layers: 1e-4 of their
scale. In bfloat16 eager's own rounding dominates: the logits must be at most twice as far from
the float32 model's (the same bf16 weights in float32, eager attention) as eager's bf16 logits are.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # CI installs the hf extra: these never skip there
transformers = pytest.importorskip("transformers")

import linalg_prefill.hf as hf  # noqa: E402
from linalg_prefill.mlir import PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec  # noqa: E402
from linalg_prefill.mlir.decode import DecodeSpec  # noqa: E402
from linalg_prefill.runtime import InputError  # noqa: E402
from linalg_prefill.runtime.checks import as_array  # noqa: E402

from conftest import assert_matches_reference  # noqa: E402
from hf_models import tiny_model  # noqa: E402

CHECKED = "linalg_prefill_checked"
FAMILIES = ["llama3", "qwen2", "qwen2-yarn", "gemma2", "llama4"]
LOGIT_TOLERANCE = 1e-4
calls: list = []  # (kernel variant, batch, S_q, S_kv) of every checked call of the running test
kv_dtypes: list = []  # the KV-cache dtype of every checked call's spec (None: the compute dtype)
sources: list = []  # (KV layout, whether the kernel's k is the model's key tensor's memory) of each call
rows_read: list = []  # (the kernel's K rows a head, the keys the model handed over) of each head-major call


def checked_attention(module, query, key, value, attention_mask, **kwargs):
    """The adapter's call, checked against the float64 reference of the same kernel call."""
    call = hf.plan_call(module, query, key, value, attention_mask, **{
        name: kwargs[name] for name in ("dropout", "scaling", "softcap", "sliding_window", "is_causal", "s_aux",
                                        "indices") if name in kwargs})
    outputs = []
    for args in call.rows or (call.args,):  # one call, or one per batch row (a batch's decode step)
        output, lse = hf.kernel_for(call.spec)(*args)
        host_args = tuple(as_array(str(i), a) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args))
        assert_matches_reference(call.spec.name, (as_array("output", output), as_array("lse", lse)), call.spec,
                                 host_args)
        kernel_k = args[2]
        sources.append((call.spec.kv_layout, isinstance(kernel_k, torch.Tensor)
                        and kernel_k.untyped_storage().data_ptr() == key.untyped_storage().data_ptr()))
        if call.spec.kv_layout == "ragged_hnd":
            rows_read.append((kernel_k.shape[1], key.shape[2]))
        outputs.append(output)
    calls.append((call.spec.symbol, query.shape[0], query.shape[2], key.shape[2]))
    kv_dtypes.append(getattr(call.spec, "kv_dtype", None))
    return call.value_columns(torch.stack(outputs).view(call.output_shape) if call.rows
                              else outputs[0].view(call.output_shape)), None


def register_checked() -> None:
    """Registers the adapter, and :func:`checked_attention` with the adapter's masks as ``CHECKED``."""
    hf.register()
    transformers.AttentionInterface.register(CHECKED, checked_attention)
    transformers.masking_utils.AttentionMaskInterface.register(CHECKED, hf.attention_mask)


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_checked()


@pytest.fixture(autouse=True)
def fresh_calls():
    calls.clear()
    sources.clear()
    kv_dtypes.clear()
    rows_read.clear()


def _logits(model, implementation: str, ids, **kwargs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(ids, **kwargs).logits.float()


def _assert_close(got, want, where=None):
    got, want = (got, want) if where is None else (got[where], want[where])
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= LOGIT_TOLERANCE * scale, "logits differ from eager's"


def _assert_like_eager(model, ids, **kwargs):
    """Logits through the kernels against eager's (module docstring), on the rows ``attention_mask`` keeps."""
    where = kwargs["attention_mask"].bool() if "attention_mask" in kwargs else None
    got, eager = _logits(model, CHECKED, ids, **kwargs), _logits(model, "eager", ids, **kwargs)
    assert torch.isfinite(got).all()
    if model.dtype == torch.float32:
        return _assert_close(got, eager, where)
    exact = _logits(copy.deepcopy(model).float(), "eager", ids, **kwargs)
    if where is not None:
        got, eager, exact = got[where], eager[where], exact[where]
    assert float((got - exact).abs().max()) <= 2 * float((eager - exact).abs().max()), "further from f32 than eager"


def test_the_test_models_attend_sharply():
    """At least half of the rows of every layer put over half their weight on one key (random
    weights alone give ~1/n): scale, cap and RoPE errors would show in the outputs."""
    for family in FAMILIES:
        model = tiny_model(family)
        with torch.no_grad():
            out = model(torch.arange(40).remainder(96)[None], output_attentions=True)
        for weights in out.attentions:
            assert float((weights.max(-1).values > 0.5).float().mean()) > 0.5, family


def _prefill_specs(family: str, dtype: str) -> list:
    """The kernels the adapter opens for ``family``'s tiny model (tests/hf_models.py: 4 query heads
    on 2 KV heads of dim 16) in a prefill and a left-padded batch: the dense one and the paged one
    with a window (Gemma 2: soft cap 20, query_pre_attn_scalar 32, and the paged one's decode
    pass); qwen2-yarn's are qwen2's (the model rotates q and k itself)."""
    cap = {"logits_soft_cap": 20.0} if family == "gemma2" else {}
    sm_scale = 32 ** -0.5 if family == "gemma2" else 16 ** -0.5
    paged = PagedPrefillSpec(4, 2, 16, dtype, page_size=hf.PAGE_SIZE, sliding_window=True, **cap)
    specs = [SequencePrefillSpec(4, 2, 16, dtype, causal=True, sm_scale=sm_scale, **cap), paged]
    return specs + [DecodeSpec(paged)] if family == "gemma2" else specs


@pytest.mark.parametrize("family, dtype", [
    pytest.param(family, dtype, id=f"{family}-{dtype_id}", marks=pytest.mark.compiles(*_prefill_specs(family, name)))
    for family in FAMILIES for dtype, name, dtype_id in ((torch.float32, "float32", "f32"),
                                                         (torch.bfloat16, "bfloat16", "bf16"))])
def test_prefill_and_left_padded_batch_match_eager(family, dtype):
    """One prompt of 37 tokens (the dense kernel; Gemma 2's window of 8 binds: the paged one on
    its sliding layer) and a left-padded batch of two (paged, padding rows give 0)."""
    model = tiny_model(family, dtype)
    ids = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(1))
    _assert_like_eager(model, ids[:1])
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    _assert_like_eager(model, ids, attention_mask=mask)
    assert {symbol for symbol, *_ in calls} >= {"batch_prefill_paged_kv_sliding_window"}


def _generate_specs(family: str) -> list:
    """``_prefill_specs`` in float32 (the padded prefill), with the head-major ragged kernel of the
    decode steps and its 1-query pass."""
    cap = {"logits_soft_cap": 20.0} if family == "gemma2" else {}
    decode = RaggedPrefillSpec(4, 2, 16, 16, "float32", kv_order="hnd", **cap)
    folded = [RaggedPrefillSpec(8, 4, 16, 16, "float32", kv_order="hnd", **cap)] if family == "gemma2" else []
    return [*_prefill_specs(family, "float32"), decode, DecodeSpec(decode), *folded, *map(DecodeSpec, folded)]


@pytest.mark.parametrize("family", [pytest.param(family, marks=pytest.mark.compiles(*_generate_specs(family)))
                                    for family in FAMILIES])
def test_greedy_generate_gives_eager_tokens(family):
    """Left-padded batch, 10 new tokens: a prefill, then decode steps (S_q = 1 against the cache),
    each batch row's step on its own cache tensors (no copy), its padding left out (Gemma 2's
    sliding layer: one call, the batch folded into the heads)."""
    model = tiny_model(family)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    tokens = {}
    for implementation in ("eager", CHECKED):
        model.set_attn_implementation(implementation)
        tokens[implementation] = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                                pad_token_id=0)
    assert torch.equal(tokens[CHECKED], tokens["eager"])
    assert any(q_len == 1 for *_, q_len, _kv in calls)
    steps = [shares for layout, shares in sources if layout == "ragged_hnd"]
    # 2 rows x 2 layers x 9 decode steps, in place; Gemma 2's sliding layer (a window of 8) leaves
    # the padding out, so both rows see the same keys there: one call a step, the batch folded
    assert len(steps) == (2 * 9 + 9 if family == "gemma2" else 2 * 2 * 9) and all(steps)


DECODE_HND = RaggedPrefillSpec(4, 2, 16, 16, "float32", kv_order="hnd")


@pytest.mark.compiles(DECODE_HND, DecodeSpec(DECODE_HND), *_prefill_specs("llama3", "float32")[:1])
def test_decode_steps_read_the_dynamic_cache_in_place():
    """One sequence through generate (DynamicCache): its decode steps run the ragged kernel on the
    cache's own head-major key and value tensors (no copy of the cache per layer per step), tokens
    as eager's."""
    model = tiny_model("llama3")
    ids = torch.randint(0, 96, (1, 23), generator=torch.Generator().manual_seed(6))
    tokens = {}
    for implementation in ("eager", CHECKED, hf.register()):  # the registered one: plan once a step
        model.set_attn_implementation(implementation)
        tokens[implementation] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                                do_sample=False, pad_token_id=0, eos_token_id=96)
    assert torch.equal(tokens[CHECKED], tokens["eager"]) and torch.equal(tokens[hf.DEFAULT_NAME], tokens["eager"])
    steps = [shares for layout, shares in sources if layout == "ragged_hnd"]
    assert len(steps) == 2 * 11 and all(steps)  # 2 layers x 11 decode steps, each on the cache's memory
    assert hf.kernel_for(DECODE_HND).bytes_copied == 0


def _decode_layer(generator, length: int, room: int) -> tuple:
    """One layer's decode call: query ``[1, 4, 1, 16]`` (peaked: scores spread over +-8) and key /
    value ``[1, 2, length, 16]``, views of buffers of ``room`` rows a head (a KvCache layer's)."""
    query = 8.0 * torch.randn(1, 4, 1, 16, generator=generator)
    key, value = (torch.randn(1, 2, room, 16, generator=generator)[:, :, :length] for _ in range(2))
    return query, key, value


@pytest.mark.compiles(DECODE_HND, DecodeSpec(DECODE_HND))
@pytest.mark.parametrize("room", [0, 11], ids=["contiguous", "buffer-with-room"])
def test_a_steps_later_layers_run_on_its_first_layers_plan(monkeypatch, room):
    """hf.attention's decode calls of one step: the first plans and checks (plan_call), the later
    ones of the same shapes (their own q and K/V: other layers) run on its kernel's PassLane; the
    next step's (one key more: on the same buffers, or on contiguous K/V one row longer, a
    DynamicCache's) plans its index arrays through the lane, and so does a call after the wrapper
    planned another batch. Every output equals the checked kernel call's on the same inputs, also
    once the later layers have run (the lane writes each into a tensor of its own)."""
    planned = []
    plan_call = hf.plan_call
    monkeypatch.setattr(hf, "plan_call", lambda *a, **k: planned.append(1) or plan_call(*a, **k))
    generator = torch.Generator().manual_seed(3)

    def assert_checked(layer, output):
        call = plan_call(_Module(), *layer, None)
        want, lse = hf.kernel_for(call.spec)(*call.args)
        host_args = tuple(as_array(str(i), a) if isinstance(a, torch.Tensor) else a for i, a in enumerate(call.args))
        assert_matches_reference(call.spec.name, (as_array("output", want), as_array("lse", lse)), call.spec, host_args)
        assert torch.equal(output, want.view(call.output_shape))

    layers = [_decode_layer(generator, 37, 37 + room) for _ in range(3)]
    outputs = [hf.attention(_Module(), *layer, None)[0] for layer in layers]
    for layer, output in zip(layers, outputs):   # each output its own memory, kept as written
        assert_checked(layer, output)
    assert len(planned) == 1, "the step's later layers planned again"
    layer = _decode_layer(generator, 38, max(38, 37 + room))
    assert_checked(layer, hf.attention(_Module(), *layer, None)[0])
    hf.hf_batching._wrappers[DECODE_HND].plan(np.array([0, 2], np.int32), np.array([0, 5], np.int32))  # another batch
    layer = _decode_layer(generator, 38, max(38, 37 + room))
    assert_checked(layer, hf.attention(_Module(), *layer, None)[0])
    assert len(planned) == 1


def _folded_specs(family: str) -> list:
    """The head-major ragged kernel of a two-row batch's decode steps, the batch folded into the
    heads (8 query heads on 4 KV heads), its 1-query pass, and the prefill's kernels."""
    options = {"gemma2": {"logits_soft_cap": 20.0}, "gpt_oss": {"head_sinks": True}}[family]
    folded = RaggedPrefillSpec(8, 4, 16, 16, "float32", kv_order="hnd", **options)
    sm_scale = (32 if family == "gemma2" else 16) ** -0.5
    prefill = [SequencePrefillSpec(4, 2, 16, "float32", causal=True, sm_scale=sm_scale, **options),
               PagedPrefillSpec(4, 2, 16, "float32", page_size=hf.PAGE_SIZE, sliding_window=True, **options)]
    return [*prefill, folded, DecodeSpec(folded)]


@pytest.mark.parametrize("family", [pytest.param(family, marks=pytest.mark.compiles(*_folded_specs(family)))
                                    for family in ("gemma2", "gpt_oss")])
def test_a_batch_without_padding_decodes_in_one_call_a_layer(family):
    """Two sequences without padding through generate: each decode step of a layer is one call with
    the batch folded into the heads (8 query heads over 4 KV heads: query head b H_q + h sees row
    b's KV heads only) on the cache's own memory, tokens as eager's: a full layer and a sliding
    one (a window of 8 binding every row alike: two entries, the keys before the window's without
    queries), Gemma 2's soft cap, gpt-oss's sinks (each row's heads keep their sink)."""
    model = tiny_model(family)
    ids = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(11))
    tokens = {}
    for implementation in ("eager", CHECKED):
        model.set_attn_implementation(implementation)
        tokens[implementation] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9,
                                                do_sample=False, pad_token_id=0, eos_token_id=96)
    assert torch.equal(tokens[CHECKED], tokens["eager"])
    in_place = [shares for layout, shares in sources if layout == "ragged_hnd"]
    assert len(in_place) == 2 * 8 and all(in_place)  # 2 layers x 8 steps, one call each, on the cache's memory


DECODE_FP8 = RaggedPrefillSpec(4, 2, 16, 16, "float32", kv_order="hnd", kv_dtype="float8_e4m3fn")


@pytest.mark.compiles(DECODE_FP8, DecodeSpec(DECODE_FP8), *_prefill_specs("llama3", "float32"))
@pytest.mark.parametrize("rows", [1, 2], ids=["one-sequence", "left-padded-pair"])
def test_generate_on_an_fp8_cache_reads_its_8_bit_states_in_place(rows):
    """generate over hf.Fp8KvCache (transformers' fp8 QuantizedCache: e4m3 states, one scale per
    tensor): each decode step runs the ragged kernel with kv_dtype on the layer's stored 8-bit K/V
    (no dequantised copy; each call within its float64 reference's bound), and the tokens are
    eager attention's over transformers' own fp8 cache, which dequantises the cache every step."""
    model = tiny_model("llama3")
    ids = torch.randint(0, 96, (rows, 23), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1:, :5] = 0
    tokens = {}
    for implementation, cache in (("eager", transformers.QuantizedCache("fp8", model.config)),
                                  (CHECKED, hf.Fp8KvCache(model.config))):
        model.set_attn_implementation(implementation)
        tokens[implementation] = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=12,
                                                do_sample=False, pad_token_id=0, eos_token_id=96)
    assert torch.equal(tokens[CHECKED], tokens["eager"])
    # the prefill (2 layers) on the states as they came, as transformers' does; then 2 layers x 11
    # decode steps on the 8-bit states
    assert kv_dtypes == [None] * 2 + ["float8_e4m3fn"] * 2 * 11
    steps = [shares for layout, shares in sources if layout == "ragged_hnd"]
    assert len(steps) == rows * 2 * 11 and all(steps)  # each row's call on the stored states' memory


@pytest.mark.compiles(DECODE_HND, DecodeSpec(DECODE_HND), *_prefill_specs("llama3", "float32"))
@pytest.mark.parametrize("rows", [1, 2], ids=["one-sequence", "left-padded-pair"])
def test_generate_on_a_kv_cache_reads_its_buffers_in_place(rows, monkeypatch):
    """generate over hf.KvCache (a DynamicCache whose steps write into buffers with room): each
    decode step's call reads the layer's buffer where it lies, its rows past the keys an entry
    without queries (each call within its float64 reference's bound), through a buffer that
    fills and is replaced by a larger one (8 rows of room here); the tokens are eager
    attention's over transformers' DynamicCache, and eager's over a KvCache are the same."""
    from linalg_prefill import hf_cache

    monkeypatch.setattr(hf_cache, "ROOM_ROWS", 8)
    model = tiny_model("llama3")
    ids = torch.randint(0, 96, (rows, 23), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[1:, :5] = 0
    tokens, buffers = {}, set()
    for implementation, cache in (("eager", transformers.DynamicCache(config=model.config)),
                                  ("eager", hf.KvCache(model.config)), (CHECKED, hf.KvCache(model.config))):
        model.set_attn_implementation(implementation)
        for layer in cache.layers:
            layer.update = _noting_buffers(layer.update, buffers)
        tokens[implementation, type(cache).__name__] = model.generate(
            ids, attention_mask=mask, cache=cache, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=96)
        layer = cache.layers[0]
        # 23 tokens in a buffer of 32 rows, full at the 33rd: a buffer of 48 since
        assert layer.keys.shape[2] == 23 + 11 and (type(cache) is not hf.KvCache or layer.keys._base.shape[2] == 48)
    want = tokens["eager", "DynamicCache"]
    assert torch.equal(tokens["eager", "KvCache"], want) and torch.equal(tokens[CHECKED, "KvCache"], want)
    steps = [shares for layout, shares in sources if layout == "ragged_hnd"]
    assert len(steps) == rows * 2 * 11 and all(steps)  # each row's call on the buffer's memory
    assert any(kernel_rows > keys for kernel_rows, keys in rows_read)  # the room, read in place
    assert len(buffers) > 2 * 2 * 2  # K and V of 2 layers, in both KvCaches, each replaced at least once


def _noting_buffers(update, buffers: set):
    """A cache layer's ``update`` that adds the memory of the states it returns to ``buffers``."""
    def noted(*args, **kwargs):
        states = update(*args, **kwargs)
        buffers.update(tensor.untyped_storage().data_ptr() for tensor in states)
        return states
    return noted


def test_a_kv_cache_writes_each_step_into_its_buffer():
    """hf_cache.appended: a step's rows written into the buffer's room (the same memory); a full
    buffer, or states that are not a buffer's view (beam reordering's copy), start a new one
    holding every row so far."""
    from linalg_prefill.hf_cache import appended, capacity

    rows = [torch.randn(2, 3, n, 4) for n in (5, 1, 1)]
    states = appended(torch.tensor([]), rows[0])
    assert states.shape == (2, 3, 5, 4) and states._base.shape == (2, 3, capacity(5), 4)
    grown = appended(appended(states, rows[1]), rows[2])
    assert grown.data_ptr() == states.data_ptr() and torch.equal(grown, torch.cat(rows, dim=2))
    full = appended(grown[:, :, :0].new_empty(0), rows[0])  # empty states: a new buffer
    assert full.data_ptr() != grown.data_ptr()
    crowded = states._base[:, :, :capacity(5)]  # a buffer with no room left
    moved = appended(crowded, rows[1])
    assert moved.data_ptr() != crowded.data_ptr() and torch.equal(moved[:, :, :-1], crowded)
    reordered = grown.index_select(0, torch.tensor([1, 0]))
    again = appended(reordered, rows[1])
    assert torch.equal(again, torch.cat([reordered, rows[1].to(reordered.dtype)], dim=2))
    assert again.data_ptr() not in (reordered.data_ptr(), grown.data_ptr())


def test_8_bit_states_without_their_scale_are_refused():
    query = torch.zeros(1, 4, 1, 16)
    key = torch.zeros(1, 2, 5, 16).to(torch.float8_e4m3fn)
    with pytest.raises(InputError, match="^key: torch.float8_e4m3fn states without their scale"):
        hf.plan_call(None, query, key, key.clone(), None)


@pytest.mark.compiles(*_prefill_specs("qwen2", "float32"), DecodeSpec(_prefill_specs("qwen2", "float32")[1]))
def test_chunked_prefill_and_right_padding():
    """Chunked prefill (S_q < S_kv through the cache, bottom-right causal) and a right-padded
    batch (rows past a sequence's end see all of its keys, as in eager)."""
    model = tiny_model("qwen2")
    ids = torch.randint(0, 96, (1, 45), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = _logits(model, "eager", ids)
        model.set_attn_implementation(CHECKED)
        cache = transformers.DynamicCache(config=model.config)
        first = model(ids[:, :20], cache=cache).logits.float()
        second = model(ids[:, 20:], cache=cache).logits.float()
    _assert_close(torch.cat([first, second], 1), want)
    assert (1, 25, 45) in [call[1:] for call in calls]
    batch = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(batch)
    mask[0, 21:] = 0
    _assert_like_eager(model, batch, attention_mask=mask)


def test_model_loaded_with_the_implementation_and_set_later():
    """from_config(attn_implementation=...) and set_attn_implementation both route to the kernels."""
    name = hf.register()
    model = tiny_model("llama3", attn_implementation=name)
    assert model.config._attn_implementation == name
    ids = torch.arange(12)[None]
    with torch.no_grad():
        got = model(ids).logits
    _assert_close(got, _logits(model, "eager", ids))


def _tree_and_packed(length: int = 24):
    """A boolean ``[2, 1, S, S]`` mask and its ``position_ids [2, S]``: batch row 0 a 14-token
    prompt then a speculative-decoding tree of 10 draft tokens (each sees the prompt, its ancestors
    and itself: rows with holes), batch row 1 two packed sequences of 11 and 13 tokens
    (block-diagonal causal)."""
    parents = [-1, 0, 0, 1, 1, 2, 2, 3, -1, 8]
    prompt = length - len(parents)
    mask = torch.zeros(2, 1, length, length, dtype=torch.bool)
    mask[0, 0] = torch.ones(length, length).tril().bool()
    mask[0, 0, prompt:, prompt:] = False
    depth = []
    for i in range(len(parents)):
        node, steps = i, 0
        while node >= 0:
            mask[0, 0, prompt + i, prompt + node] = True
            node, steps = parents[node], steps + 1
        depth.append(steps - 1)
    positions = torch.zeros(2, length, dtype=torch.long)
    positions[0, :prompt] = torch.arange(prompt)
    positions[0, prompt:] = prompt + torch.tensor(depth)
    for start, end in ((0, 11), (11, length)):
        mask[1, 0, start:end, start:end] = torch.ones(end - start, end - start).tril().bool()
        positions[1, start:end] = torch.arange(end - start)
    return mask, positions


def _additive(mask, dtype=torch.float32):
    """The boolean mask as eager attention adds it: 0 where allowed, the dtype's minimum elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


@pytest.mark.compiles(*(spec for sinks in (False, True) for spec in (
    RaggedPrefillSpec(4, 2, 16, 16, "float32", head_sinks=sinks, custom_mask=True),
    PagedPrefillSpec(4, 2, 16, "float32", page_size=hf.PAGE_SIZE, sliding_window=True, head_sinks=sinks))))
@pytest.mark.parametrize("family", ["llama3", "gpt_oss"])
def test_masks_with_holes_run_the_custom_mask_kernel(family):
    """A tree mask (rows whose keys are not one range) and packed sequences as one boolean 4-D
    attention_mask: the ragged custom-mask kernel (gpt-oss: with its sinks), logits as eager's
    with the same mask; a mask of the packed sequences alone keeps the paged key-range path."""
    model = tiny_model(family)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(5))
    mask, positions = _tree_and_packed()
    got = _logits(model, CHECKED, ids, attention_mask=mask, position_ids=positions)
    _assert_close(got, _logits(model, "eager", ids, attention_mask=_additive(mask), position_ids=positions))
    assert {symbol for symbol, *_ in calls} == {"batch_prefill_ragged_kv"}
    assert hf.plan_call(_Module(), *_qkv(2, 24), mask).spec.custom_mask
    calls.clear()
    packed = mask[1:].expand(2, 1, 24, 24).clone()
    got = _logits(model, CHECKED, ids, attention_mask=packed, position_ids=positions[1:].expand(2, 24))
    _assert_close(got, _logits(model, "eager", ids, attention_mask=_additive(packed),
                               position_ids=positions[1:].expand(2, 24)))
    assert {symbol for symbol, *_ in calls} == {"batch_prefill_paged_kv_sliding_window"}


@pytest.mark.compiles(DECODE_HND, DecodeSpec(DECODE_HND))
def test_a_binding_window_leaves_no_lane():
    """A decode call whose sliding window binds runs the keys before the window as an entry of
    their own: it leaves no lane, so a later call of the same shapes whose key length is that
    entry's (a new sequence on buffers of the same size) runs its own keys, as the checked kernel
    call does."""
    generator = torch.Generator().manual_seed(5)
    for length in (20, 12, 12, 7):   # a window of 8: 20 keys see their last 8 (an entry of 12 before them)
        layer = _decode_layer(generator, length, 40)
        output = hf.attention(_Module(), *layer, None, sliding_window=8)[0]
        call = hf.plan_call(_Module(), *layer, None, sliding_window=8)
        want, _ = hf.kernel_for(call.spec)(*call.args)
        assert torch.equal(output, want.view(call.output_shape)), length


@pytest.mark.compiles(DECODE_FP8, DecodeSpec(DECODE_FP8))
def test_a_steps_later_layers_on_an_8_bit_cache_take_their_own_scales(monkeypatch):
    """The step lane over e4m3 K/V (an Fp8KvCache's states, each layer's scale on its tensors):
    the later layers run on the first's plan with their own scales, each output equal to the
    checked kernel call's; a layer whose scale is not positive is refused by name."""
    planned = []
    plan_call = hf.plan_call
    monkeypatch.setattr(hf, "plan_call", lambda *a, **k: planned.append(1) or plan_call(*a, **k))
    generator = torch.Generator().manual_seed(4)
    layers = []
    for scale in (0.25, 0.5, 0.125):
        query, key, value = _decode_layer(generator, 29, 40)
        key, value = ((x._base / scale).to(torch.float8_e4m3fn)[:, :, :29] for x in (key, value))
        for x in (key, value):
            setattr(x, hf.SCALE_ATTRIBUTE, scale)
        layers.append((query, key, value))
    for layer in layers:
        output = hf.attention(_Module(), *layer, None)[0]
        call = plan_call(_Module(), *layer, None)
        want, lse = hf.kernel_for(call.spec)(*call.args)
        host_args = tuple(as_array(str(i), a) if isinstance(a, torch.Tensor) else a for i, a in enumerate(call.args))
        assert_matches_reference(call.spec.name, (as_array("output", want), as_array("lse", lse)), call.spec, host_args)
        assert torch.equal(output, want.view(call.output_shape))
    assert len(planned) == 1 and call.spec == DECODE_FP8
    query, key, value = layers[0]
    setattr(key, hf.SCALE_ATTRIBUTE, -1.0)
    with pytest.raises(InputError, match="k_scale"):
        hf.attention(_Module(), query, key, value, None)


def _qkv(batch: int, length: int) -> tuple:
    """Zero query, key and value ``[B, heads, S, 16]`` of the tiny models' head counts."""
    return torch.zeros(batch, 4, length, 16), torch.zeros(batch, 2, length, 16), torch.zeros(batch, 2, length, 16)


class _Module:
    is_causal = True


def test_bad_calls_name_the_argument():
    q, k = torch.zeros(1, 4, 3, 16), torch.zeros(1, 2, 3, 16)
    with pytest.raises(InputError, match="dropout"):
        hf.attention(_Module(), q, k, k, None, dropout=0.1)
    with pytest.raises(InputError, match="s_aux"):
        hf.attention(_Module(), q, k, k, None, s_aux=torch.zeros(5))  # 4 query heads
    with pytest.raises(InputError, match="key"):
        hf.attention(_Module(), q, torch.zeros(1, 3, 3, 16), torch.zeros(1, 3, 3, 16), None)
    with pytest.raises(InputError, match="dtype"):
        hf.attention(_Module(), q.double(), k.double(), k.double(), None)
    with pytest.raises(InputError, match="attention_mask: an additive mask"):
        hf.attention(_Module(), q, k, k, torch.full((1, 1, 3, 3), 0.5))


def test_key_ranges_plan_staircases_and_single_queries():
    """Left padding: one entry (empty rows, then the diagonal); a binding window: one entry per
    query past the window; right padding: the rows past the end one entry each."""
    from linalg_prefill.runtime.key_ranges import paged_arguments, plan_entries, rule_ranges

    lo, hi = rule_ranges(2, 6, 6, causal=True, window=None)
    lo[1], hi[1] = np.maximum(lo[1], 2), np.maximum(hi[1], 2)  # batch row 1: two padding keys
    entries = plan_entries(lo, hi)
    assert entries.q_indptr.tolist() == [0, 6, 12] and entries.lo.tolist() == [0, 2] and entries.hi.tolist() == [6, 6]
    lo, hi = rule_ranges(1, 6, 6, causal=True, window=3)
    entries = plan_entries(lo, hi)
    assert entries.q_indptr.tolist() == [0, 3, 4, 5, 6] and entries.lo.tolist() == [0, 1, 2, 3]
    page_indptr, page_values, length_info = paged_arguments(entries, pages_per_row=2, page_size=4)
    assert page_indptr.tolist() == [0, 1, 2, 4, 6] and page_values.tolist() == [0, 0, 0, 1, 0, 1]
    assert length_info.tolist() == [[3, 4, 1, 2], [0, 1, 2, 3], [0, 0, 0, 0]]


@pytest.mark.compiles(*_prefill_specs("llama3", "float32")[:1])
def test_a_compiled_model_runs_the_attention_outside_the_graph():
    """``torch.compile(model)`` with this attention: dynamo traced into the adapter and failed in
    the MLIR bindings building a kernel; the attention and mask functions now break the graph
    (``torch.compiler.disable``) and the rest compiles. A prompt's logits as eager's (aot_eager:
    dynamo's tracing is what failed, no C++ toolchain needed)."""
    model = tiny_model("llama3")
    ids = torch.randint(0, 96, (1, 19), generator=torch.Generator().manual_seed(7))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(ids).logits
    model.set_attn_implementation(hf.register())
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        got = compiled(ids).logits
    _assert_close(got, want)
