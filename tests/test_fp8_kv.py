"""8-bit KV caches (issue 44, semantics §15): paged, ragged, MLA and dense KV in float8_e4m3fn or
float8_e5m2 (and gfx942's fnuz variants of both) with per-KV-head scales, on llvm-cpu's linalg lowering (the variant's kernel and its
serving passes), against the float64 reference of the dequantised cache within the compute
dtype's bound.

The grid: each format with each compute dtype once, both page orders and both ragged orders, a
sliding window, d_v != d_qk, scales per head (drawn) and per tensor (one value repeated); entries
with no keys, causal rows with no key, RoPE inline (the kernel) and off (short entries through
the passes). The format's largest values stay finite; every finite bit pattern reads as its
value; bad scales and K/V in another dtype are refused by name; the wrappers take the scales;
the fused lowering (CUDA's and ROCm's, compiled for llvm-cpu) against the same reference.
"""

from __future__ import annotations

import dataclasses
import re

import ml_dtypes
import numpy as np
import pytest

from conftest import FUSED_CPU, assert_matches_reference
from linalg_prefill.mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from linalg_prefill.mlir.abi import argument_names, ordered
from linalg_prefill.mlir.specs import SpecError
from linalg_prefill.pipeline import Target
from linalg_prefill.pipeline.tuning import tuned_ir
from linalg_prefill.runtime import (
    InputError, MlaPagedPrefillWrapper, PagedPrefillWrapper, RaggedPrefillWrapper, SequencePrefillWrapper,
    open_kernel,
)
from linalg_prefill.runtime.compare import error_bound, reference_for
from linalg_prefill.runtime.examples import example_inputs
from linalg_prefill.runtime.kv_quant import dequantized_call, quantize_kv, quantize_latent, quantize_pages
from support import with_arguments

SPECS = {
    "e4m3-f16": PagedPrefillSpec(4, 2, 32, "float16", page_size=16, kv_dtype="float8_e4m3fn"),
    # d 64 and GQA 2: a bf16 pass of one query on a Zen 4 takes its scores as the keys are widened
    # (mlir/x86_decode.py: ByteKeysDotEngine), the passes with more rows stage them
    "e5m2-bf16-nhd": PagedPrefillSpec(4, 2, 64, "bfloat16", page_size=16, kv_order="nhd", kv_dtype="float8_e5m2"),
    "e4m3-f32-window": PagedPrefillSpec(8, 2, 32, "float32", page_size=8, sliding_window=True,
                                        kv_dtype="float8_e4m3fn"),
    "ragged-e4m3-f16-dv16": RaggedPrefillSpec(4, 2, 32, 16, "float16", kv_dtype="float8_e4m3fn"),
    "ragged-e5m2-bf16-hnd": RaggedPrefillSpec(4, 2, 64, 32, "bfloat16", kv_order="hnd", kv_dtype="float8_e5m2"),
    "mla-e5m2-f16": MlaPagedPrefillSpec(4, 32, 16, "float16", page_size=16, kv_dtype="float8_e5m2"),
    # gfx942's own formats (fnuz: no negative zero, one more exponent bias)
    "e4m3fnuz-f16": PagedPrefillSpec(4, 2, 32, "float16", page_size=16, kv_dtype="float8_e4m3fnuz"),
    "ragged-e5m2fnuz-bf16": RaggedPrefillSpec(4, 2, 32, 32, "bfloat16", kv_dtype="float8_e5m2fnuz"),
    "dense-e4m3-bf16": SequencePrefillSpec(4, 2, 32, "bfloat16", causal=True, sm_scale=32 ** -0.5,
                                           kv_dtype="float8_e4m3fn"),
    "masked-e5m2-f16": MaskedSequencePrefillSpec(4, 2, 32, "float16", mask_mode="causal_padded_left",
                                                 sm_scale=32 ** -0.5, kv_dtype="float8_e5m2"),
}
#: Prefill entries (several pages, causal rows with no key, no KV) and serving-shaped ones.
PREFILL = [(5, 3), (12, 40), (1, 9), (3, 0)]
SERVING = [(1, 37), (4, 100), (1, 1), (16, 60), (2, 0), (1, 130)]

pytestmark = pytest.mark.compiles(*SPECS.values(), passes=SERVING)


def _no_rope(spec) -> dict:
    """RoPE off where the variant has it (short entries then take the serving passes; MLA has none)."""
    return {"rotary_mode": 0} if "rotary_mode" in argument_names(spec) else {}


def _per_tensor(args, spec):
    """The call with each scale one value repeated over the KV heads (a per-tensor scale; MLA's
    one scale for its shared rows)."""
    v_scale = 0.75 if spec.layout.one_scale else 1.5
    return with_arguments(spec, args, k_scale=np.full(spec.h_kv, 0.75, np.float32),
                          v_scale=np.full(spec.h_kv, v_scale, np.float32))


@pytest.mark.parametrize("case", sorted(SPECS))
def test_matches_the_reference_of_the_dequantised_cache(case, cache):
    spec = SPECS[case]
    kernel = open_kernel(spec, cache=cache)
    rng = np.random.default_rng(len(case))
    prefill = example_inputs(spec, rng, PREFILL)
    serving = example_inputs(spec, rng, SERVING, **_no_rope(spec))  # RoPE off: short entries take the passes
    assert len(set(np.asarray(prefill[-1]).tolist())) == spec.h_kv  # per-head scales
    for label, args in (("prefill", prefill), ("serving", serving), ("per-tensor", _per_tensor(serving, spec))):
        assert_matches_reference(f"{spec.name} {label}", kernel(*args), spec, args)


def test_the_passes_and_the_kernel_read_the_same_elements(cache):
    """A serving call through the passes and through the variant's kernel alone: both within the
    bound of one reference, and the pass rows' lse equal to within float32 rounding."""
    spec = SPECS["e5m2-bf16-nhd"]
    args = example_inputs(spec, np.random.default_rng(3), SERVING, **_no_rope(spec))
    with_passes = open_kernel(spec, cache=cache)(*args)
    alone = open_kernel(spec, cache=cache, serving_passes=False)(*args)
    for got in (with_passes, alone):
        assert_matches_reference(spec.name, got, spec, args)
    np.testing.assert_allclose(np.asarray(with_passes[1]), np.asarray(alone[1]), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", ["e4m3-f16", "e5m2-bf16-nhd"])
def test_the_largest_values_of_the_format_stay_finite(case, cache):
    """Every page element the format's largest finite value (alternating sign along the head
    dim), scale 1, queries of about 1 / largest (scores of a few units): a finite output, values
    of +-largest, within a finite bound of the reference's."""
    spec = SPECS[case]
    named = dict(zip(argument_names(spec), example_inputs(spec, np.random.default_rng(0), PREFILL)))
    largest = float(ml_dtypes.finfo(named["pages"].dtype).max)
    signs = np.where(np.arange(spec.d) % 2 == 0, 1.0, -1.0)
    named["pages"] = np.broadcast_to(largest * signs, named["pages"].shape).astype(named["pages"].dtype)
    named["k_scale"] = named["v_scale"] = np.ones(spec.h_kv, np.float32)
    named["q"] = (named["q"].astype(np.float32) * (4.0 / largest)).astype(named["q"].dtype)
    args = ordered(spec, named)
    out, lse = (np.asarray(x, np.float64) for x in open_kernel(spec, cache=cache)(*args))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    bound = error_bound(spec, args)
    assert np.all(np.isfinite(bound.output)) and np.all(np.isfinite(bound.lse))
    assert np.abs(out).max() == largest
    assert_matches_reference(spec.name, (out, lse), spec, args)


def _place_values(spec, named: dict, values: np.ndarray) -> None:
    """Each entry's first value row (entry e's key 0) set to ``values[e]`` [h_kv, d_v]."""
    if spec.kv_layout == "dense":  # entry e is batch row e, its key 0
        named["v"][:, 0] = values
    elif spec.layout.one_scale:  # MLA: a value row is the first d_latent columns of the latent row
        named["pages"][named["page_values"][named["page_indptr"][:-1]], 0, :spec.d_v] = values[:, 0]
    elif "pages" in named:
        first_pages = named["page_values"][named["page_indptr"][:-1]]
        if spec.kv_order == "hnd":
            named["pages"][first_pages, 1, :, 0] = values
        else:
            named["pages"][first_pages, 1, 0] = values
    elif spec.kv_order == "nhd":
        named["v"][named["kv_indptr"][:-1]] = values
    else:
        named["v"][:, named["kv_indptr"][:-1]] = values.transpose(1, 0, 2)


@pytest.mark.parametrize("case", ["e4m3-f16", "e5m2-bf16-nhd", "ragged-e4m3-f16-dv16", "ragged-e5m2-bf16-hnd",
                                  "mla-e5m2-f16", "dense-e4m3-bf16", "e4m3fnuz-f16", "ragged-e5m2fnuz-bf16"])
@pytest.mark.parametrize("passes", [True, False], ids=["passes", "kernel"])
def test_every_finite_bit_pattern_reads_as_its_value(case, passes, cache):
    """Entries of one key each: the output is that key's value row, so every finite pattern of the
    format (placed in the values, scale 1) must come out as ml_dtypes reads it (each is exact in
    the compute dtype: e4m3 in float16, e5m2 in bfloat16), through the passes and the kernel."""
    spec = SPECS[case]
    fmt = np.dtype(getattr(ml_dtypes, spec.kv_dtype))
    patterns = np.arange(256, dtype=np.uint8).view(fmt)
    patterns = patterns[np.isfinite(patterns.astype(np.float32))]
    per_row = spec.h_kv * spec.d_v
    entries = [(1, 1)] * -(-len(patterns) // per_row)
    named = dict(zip(argument_names(spec), example_inputs(spec, np.random.default_rng(0), entries, **_no_rope(spec))))
    values = np.resize(patterns, len(entries) * per_row).reshape(len(entries), spec.h_kv, spec.d_v)
    _place_values(spec, named, values)
    named["k_scale"] = named["v_scale"] = np.ones(spec.h_kv, np.float32)
    out, _ = open_kernel(spec, cache=cache, serving_passes=passes)(*ordered(spec, named))
    got = np.asarray(out, np.float32).reshape(len(entries), spec.h_kv, spec.group_size, spec.d_v)
    want = values.astype(np.float32)[:, :, None, :]
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))


@pytest.mark.parametrize("form", ["number", "float32 scalar", "float16 scalar", "shape []", "shape [1]"])
def test_one_scale_for_every_head_is_a_number_or_one_element(form, cache):
    """A per-tensor scale as vLLM and FlashInfer take it (issue 54): the same bits as that scale
    repeated over the KV heads; other shapes stay refused by name (below)."""
    spec = SPECS["e5m2-bf16-nhd"]
    args = example_inputs(spec, np.random.default_rng(4), SERVING, **_no_rope(spec))
    kernel = open_kernel(spec, cache=cache)
    want = kernel(*_per_tensor(args, spec))
    as_form = {"number": float, "float32 scalar": np.float32, "float16 scalar": np.float16,  # numbers: any numpy one
               "shape []": lambda x: np.array(x, np.float32),
               "shape [1]": lambda x: np.full(1, x, np.float32)}[form]
    got = kernel(*with_arguments(spec, args, k_scale=as_form(0.75), v_scale=as_form(1.5)))
    for a, b in zip(want, got):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("case, name, value, message", [
    ("e4m3-f16", "k_scale", np.zeros(2, np.float32), "k_scale: scales must be positive"),
    ("e4m3-f16", "v_scale", np.array([1.0, -2.0], np.float32), "v_scale: scales must be positive"),
    ("e4m3-f16", "k_scale", np.array([1.0, np.nan], np.float32), "k_scale: values must be finite"),
    ("e4m3-f16", "v_scale", np.ones(3, np.float32), "v_scale"),
    ("e4m3-f16", "k_scale", np.ones((1, 1), np.float32), "k_scale"),
    ("e4m3-f16", "k_scale", 0.0, "k_scale: scales must be positive"),
    ("e4m3-f16", "k_scale", np.ones(2, np.float16), "k_scale: expected dtype float32"),
    ("e4m3-f16", "pages", None, "pages: expected dtype float8_e4m3fn"),
    ("ragged-e4m3-f16-dv16", "v", None, "v: expected dtype float8_e4m3fn"),
    ("ragged-e4m3-f16-dv16", "k_scale", np.ones((2, 1), np.float32), "k_scale"),
    ("mla-e5m2-f16", "pages", None, "pages: expected dtype float8_e5m2"),
    ("mla-e5m2-f16", "v_scale", np.full(1, 3.0, np.float32), "v_scale: .* must equal k_scale"),
    ("dense-e4m3-bf16", "k", None, "k: expected dtype float8_e4m3fn"),
])
def test_bad_scales_and_kv_are_refused_by_name(case, name, value, message, cache):
    spec = SPECS[case]
    args = example_inputs(spec, np.random.default_rng(0), PREFILL)
    if value is None:  # K/V in the compute dtype instead of the cache's
        value = np.asarray(dict(zip(argument_names(spec), args))[name]).astype(np.float16)
    with pytest.raises(InputError, match=f"^{message}"):
        open_kernel(spec, cache=cache)(*with_arguments(spec, args, **{name: value}))


#: One spec of each of the fused lowering's readers (paged, ragged, latent, dense tiles): both
#: formats, in the GPUs' compute dtypes (float16, bfloat16).
FUSED_CASES = ["e5m2-bf16-nhd", "ragged-e4m3-f16-dv16", "mla-e5m2-f16", "masked-e5m2-f16"]


@pytest.mark.compiles(*(SPECS[case] for case in FUSED_CASES), backends=[FUSED_CPU], passes=SERVING)
@pytest.mark.parametrize("case", FUSED_CASES)
def test_the_fused_lowering_reads_8_bit_caches(case, cache):
    """The fused lowering CUDA and ROCm run (compiled for llvm-cpu: the same IR), kernels and
    serving passes, against the reference of the dequantised cache; its IR reads the 8-bit K/V
    as they are (tests/test_cuda_compile.py and test_rocm_compile.py compile it for the GPUs)."""
    spec = SPECS[case]
    kernel = open_kernel(spec, FUSED_CPU, cache=cache)
    rng = np.random.default_rng(8)
    for label, args in (("prefill", example_inputs(spec, rng, PREFILL)),
                        ("serving", example_inputs(spec, rng, SERVING, **_no_rope(spec)))):
        assert_matches_reference(f"{spec.name} fused {label}", kernel(*args), spec, args)
    assert f"x{spec.kv_dtype.replace('float8_e4m3fn', 'f8E4M3FN').replace('float8_e5m2', 'f8E5M2')}>" in \
        tuned_ir(spec, FUSED_CPU)


@pytest.mark.parametrize("plain", [PagedPrefillSpec(4, 2, 32, "float16"), RaggedPrefillSpec(4, 2, 32, 16, "float16"),
                                   MlaPagedPrefillSpec(4, 32, 16, "float16"),
                                   SequencePrefillSpec(4, 2, 32, "float16", causal=True, sm_scale=0.2)],
                         ids=["paged", "ragged", "mla", "dense"])
def test_a_kv_dtype_must_be_an_8_bit_format(plain):
    with pytest.raises(SpecError, match="^kv_dtype must be None"):
        dataclasses.replace(plain, kv_dtype="float16")
    assert plain.name + "_kvf8e4m3fn" == dataclasses.replace(plain, kv_dtype="float8_e4m3fn").name


def test_the_pages_are_read_as_they_are_and_widened_in_the_kernel():
    """The kernel's pages argument is the 8-bit pool itself; no tensor of the pool's shape in the
    compute dtype exists (each entry's rows are widened as they are gathered)."""
    spec = SPECS["e4m3-f16"]
    ir = tuned_ir(spec, Target("llvm-cpu"))
    assert "tensor<?x2x2x16x32xf8E4M3FN>" in ir
    assert "tensor<?x2x2x16x32xf16>" not in ir
    ragged = tuned_ir(SPECS["ragged-e4m3-f16-dv16"], Target("llvm-cpu"))  # k [Lk, 2, 32], v [Lk, 2, 16]
    assert "tensor<?x2x32xf8E4M3FN>" in ragged and "tensor<?x2x16xf8E4M3FN>" in ragged
    # k and v are read one element at a time (tensor.extract in each entry's gather), never as
    # the input of an op that would widen them whole
    assert not re.search(r"ins\([^)]*f8E4M3FN>", ragged)


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"])
@pytest.mark.parametrize("per", ["head", "tensor"])
def test_quantize_pages_rounds_to_the_nearest_value_under_each_scale(kv_dtype, per):
    """Each element within half a step of the format (relative to its scale) of the original, the
    largest magnitude of each scale's group mapped to the format's largest value; torch in, torch
    out, the same bytes; an all-zero half gets scale 1."""
    rng = np.random.default_rng(1)
    pages = (rng.standard_normal((5, 2, 3, 4, 8)) * np.array([1.0, 10.0, 0.1])[:, None, None]).astype(np.float32)
    pages[:, 1] = 0.0
    q8, k_scale, v_scale = quantize_pages(pages, kv_dtype, per=per)
    assert q8.dtype == np.dtype(getattr(ml_dtypes, kv_dtype)) and k_scale.shape == v_scale.shape == (3,)
    assert np.all(v_scale == 1.0)
    largest = float(ml_dtypes.finfo(q8.dtype).max)
    half_step = float(ml_dtypes.finfo(q8.dtype).eps) / 2
    deq = q8.astype(np.float32)[:, 0] * k_scale[None, :, None, None]
    assert np.all(np.abs(deq - pages[:, 0]) <= half_step * np.abs(pages[:, 0]) + k_scale[None, :, None, None] *
                  float(ml_dtypes.finfo(q8.dtype).smallest_subnormal))
    peaks = np.abs(q8.astype(np.float32)[:, 0]).max(axis=(0, 2, 3))
    assert np.all(peaks == largest) if per == "head" else peaks.max() == largest
    if per == "tensor":
        assert len(set(k_scale.tolist())) == 1
    torch = pytest.importorskip("torch")
    t8, tk, tv = quantize_pages(torch.from_numpy(pages), kv_dtype, per=per)
    assert t8.dtype == getattr(torch, kv_dtype)
    np.testing.assert_array_equal(t8.view(torch.uint8).numpy(), q8.view(np.uint8))
    np.testing.assert_array_equal(tk.numpy(), k_scale)


def test_the_reference_reads_the_dequantised_cache():
    """reference_for of a quantised call is the plain spec's reference of dequantized_call: pages
    dtype(f32(x) * scale[head]); a wrong scale moves it (the check can fail)."""
    spec = SPECS["e4m3-f16"]
    args = example_inputs(spec, np.random.default_rng(2), PREFILL)
    plain, plain_args = dequantized_call(spec, args)
    assert plain.kv_dtype is None and len(plain_args) == len(args) - 2
    want = reference_for(spec, args)
    np.testing.assert_array_equal(want[0], reference_for(plain, plain_args)[0])
    moved = reference_for(spec, with_arguments(spec, args, k_scale=np.asarray(args[-2]) * 2))
    assert not np.allclose(moved[1], want[1])


def test_the_reference_reads_the_dequantised_ragged_kv():
    """As above for ragged k and v (head-major): each dequantised through its own scale."""
    spec = SPECS["ragged-e5m2-bf16-hnd"]
    args = example_inputs(spec, np.random.default_rng(4), PREFILL)
    plain, plain_args = dequantized_call(spec, args)
    named, plain_named = dict(zip(argument_names(spec), args)), dict(zip(argument_names(plain), plain_args))
    want_v = (named["v"].astype(np.float32) * named["v_scale"][:, None, None]).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(plain_named["v"], want_v)
    np.testing.assert_array_equal(reference_for(spec, args)[0], reference_for(plain, plain_args)[0])
    moved = reference_for(spec, with_arguments(spec, args, v_scale=named["v_scale"] * 2))
    assert not np.allclose(moved[0], reference_for(spec, args)[0])


@pytest.mark.parametrize("kv_order", ["nhd", "hnd"])
def test_quantize_kv_matches_quantize_pages_per_head(kv_order):
    """Ragged k and v quantise as the same rows in pages would (the same scales and bytes), numpy
    and torch alike; v with its own head dim."""
    rng = np.random.default_rng(5)
    k = (rng.standard_normal((12, 3, 8)) * np.array([1.0, 10.0, 0.1])[None, :, None]).astype(np.float32)
    v = rng.standard_normal((12, 3, 8)).astype(np.float32)
    pages = np.stack([k, v], axis=1).reshape(3, 4, 2, 3, 8).transpose(0, 2, 1, 3, 4)  # [P, 2, page, h, d]: nhd
    p8, pk, pv = quantize_pages(pages, "float8_e4m3fn", kv_order="nhd")
    as_order = (lambda x: x) if kv_order == "nhd" else (lambda x: x.transpose(1, 0, 2))
    k8, v8, k_scale, v_scale = quantize_kv(as_order(k), as_order(v), "float8_e4m3fn", kv_order=kv_order)
    np.testing.assert_array_equal(k_scale, pk)
    np.testing.assert_array_equal(v_scale, pv)
    np.testing.assert_array_equal(as_order(k8).view(np.uint8), p8[:, 0].reshape(12, 3, 8).view(np.uint8))
    torch = pytest.importorskip("torch")
    t8 = quantize_kv(torch.from_numpy(as_order(k)), torch.from_numpy(as_order(v)), "float8_e4m3fn", kv_order=kv_order)
    np.testing.assert_array_equal(t8[0].view(torch.uint8).numpy(), k8.view(np.uint8))
    dense = quantize_kv(k[None], v[None], "float8_e4m3fn")  # [B, Lk, h_kv, d]: the same heads
    np.testing.assert_array_equal(dense[2], pk)
    np.testing.assert_array_equal(dense[0][0].view(np.uint8), p8[:, 0].reshape(12, 3, 8).view(np.uint8))
    with pytest.raises(InputError, match="^k: expected rank 3"):
        quantize_kv(k[0], v, "float8_e4m3fn")


@pytest.mark.parametrize("case", ["e5m2-bf16-nhd", "ragged-e4m3-f16-dv16", "mla-e5m2-f16", "dense-e4m3-bf16"])
def test_the_wrappers_take_the_scales(case, cache):
    """plan/run with k_scale and v_scale (arrays, or one number for every head): within the
    reference's bound, a number the same as its array repeated; missing scales refused by name."""
    spec = SPECS[case]
    named = dict(zip(argument_names(spec), example_inputs(spec, np.random.default_rng(6), SERVING, **_no_rope(spec))))
    named["k_scale"] = np.full(spec.h_kv, 0.5, np.float32)
    if spec.kv_layout == "dense":
        wrapper, kv = SequencePrefillWrapper(spec, cache=cache), (named["k"], named["v"])
    elif spec.layout.one_scale:
        named["v_scale"] = named["k_scale"]
        wrapper = MlaPagedPrefillWrapper(spec, cache=cache)
        wrapper.plan(named["q_indptr"], named["page_indptr"], named["page_values"], named["length_info"],
                     causal=named["causal"], sm_scale=named["sm_scale"])
        kv = (named["pages"],)
    elif "pages" in named:
        wrapper = PagedPrefillWrapper(spec, cache=cache)
        wrapper.plan(named["q_indptr"], named["page_indptr"], named["page_values"], named["length_info"],
                     causal=named["causal"], sm_scale=named["sm_scale"], q_rope_position=named["q_rope_position"],
                     k_rope_pos_offset=named["k_rope_pos_offset"])
        kv = (named["pages"],)
    else:
        wrapper = RaggedPrefillWrapper(spec, cache=cache)
        wrapper.plan(named["q_indptr"], named["kv_indptr"], causal=named["causal"], sm_scale=named["sm_scale"],
                     q_rope_position=named["q_rope_position"], k_rope_pos_offset=named["k_rope_pos_offset"])
        kv = (named["k"], named["v"])
    out, lse = wrapper.run(named["q"], *kv, k_scale=named["k_scale"], v_scale=named["v_scale"], to_host=True)
    assert_matches_reference(spec.name, (out, lse), spec, ordered(spec, named))
    by_number = wrapper.run(named["q"], *kv, k_scale=0.5, v_scale=named["v_scale"], to_host=True)
    np.testing.assert_array_equal(np.asarray(by_number[0]), np.asarray(out))
    with pytest.raises(InputError, match="^v_scale: .* pass k_scale and v_scale"):
        wrapper.run(named["q"], *kv, k_scale=0.5)


def test_quantize_latent_has_one_scale_for_the_shared_rows():
    """MLA's latent pages: one scale (k_scale == v_scale, [1]) mapping the largest magnitude to the
    format's largest value; numpy and torch give the same bytes."""
    rng = np.random.default_rng(7)
    pages = (rng.standard_normal((3, 4, 24)) * 5).astype(np.float32)
    p8, k_scale, v_scale = quantize_latent(pages, "float8_e5m2")
    assert k_scale.shape == (1,) and np.array_equal(k_scale, v_scale)
    assert np.abs(p8.astype(np.float32)).max() == float(ml_dtypes.finfo(p8.dtype).max)
    torch = pytest.importorskip("torch")
    t8, tk, _ = quantize_latent(torch.from_numpy(pages), "float8_e5m2")
    np.testing.assert_array_equal(t8.view(torch.uint8).numpy(), p8.view(np.uint8))
    np.testing.assert_array_equal(tk.numpy(), k_scale)
