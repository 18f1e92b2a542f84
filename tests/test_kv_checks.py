"""Host-side checks of the KV-cache variants (``linalg_prefill.runtime.kv_checks``, semantics §11.8).

Pure numpy, nothing is compiled. Each variant has a valid call builder (shuffled page ids, an
entry with no pages, an entry with no query rows, sliding window, float32 and bfloat16); the
catalogue breaks one rule per case. Every call the checks accept is also run through the float64
reference (``runtime/reference.py``), which must accept it too.
"""

from __future__ import annotations

import importlib.util
import re

import ml_dtypes

import numpy as np
import pytest

from conftest import TensorLike
from linalg_prefill.mlir.specs import MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec
from linalg_prefill.runtime import reference as R
from linalg_prefill.runtime.errors import InputError
from linalg_prefill.runtime.kv_checks import check_mla, check_paged, check_ragged, paged_kv_lengths

I32 = np.int32
INT32_MAX = 2**31 - 1
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
VARIANTS = ("ragged", "paged", "paged_sw", "mla", "mla_sw")
PAGE_SIZE = 4
NUM_PAGES = 6
# Page table shared by the paged and MLA builders: entry 0 has 2 pages (last 3 used slots, 7
# rows), entry 1 has none (its length_info is garbage and ignored), entry 2 has 3 pages (full).
PAGE_INDPTR = [0, 2, 2, 5]
PAGE_VALUES = [4, 1, 5, 0, 2]
LAST_PAGE_LEN = [3, 0, 4]
SW_OFFSET = [2, 99, 6]  # entry 0: phys 7 -> kv 7 - 2 + 1 = 6; entry 2: phys 12 -> 12 - 6 + 2 = 8
SINK = [1, -5, 2]
Q_INDPTR = [0, 3, 4, 6]  # entry 1 has a query row but no KV


def make_spec(variant: str, dtype: str = "float32", **fields):
    """The spec of a variant with the test's small sizes; ``fields`` override them. In float32
    the ragged, paged and MLA specs are tests/test_fuzz.py's (one compile each per session)."""
    if variant == "ragged":
        kw = dict(h_q=4, h_kv=2, d_qk=32, d_v=16, dtype=dtype)
        return RaggedPrefillSpec(**{**kw, **fields})
    if variant.startswith("paged"):
        kw = dict(h_q=4, h_kv=2, d=32, dtype=dtype, page_size=PAGE_SIZE)
        return PagedPrefillSpec(**{**kw, **fields}, sliding_window=variant.endswith("_sw"))
    kw = dict(h_q=4, d_latent=32, d_rope=16, dtype=dtype, page_size=PAGE_SIZE)
    return MlaPagedPrefillSpec(**{**kw, **fields}, sliding_window=variant.endswith("_sw"))


def rand(rng, shape, dtype: str) -> np.ndarray:
    return rng.uniform(-1, 1, size=shape).astype(DTYPES[dtype])


def build(variant: str, spec, seed: int = 0) -> dict:
    """A valid argument dict (ABI names and order) for ``spec``; scalars are given as numpy
    scalars / 0-d arrays so that normalisation to Python int/float is exercised."""
    rng = np.random.default_rng(seed)
    lq = Q_INDPTR[-1]
    if variant == "ragged":
        return dict(
            q=rand(rng, (lq, spec.h_q, spec.d_qk), spec.dtype),
            q_indptr=np.array(Q_INDPTR, I32),
            k=rand(rng, (6, spec.h_kv, spec.d_qk), spec.dtype),
            v=rand(rng, (6, spec.h_kv, spec.d_v), spec.dtype),
            kv_indptr=np.array([0, 4, 4, 6], I32),
            q_rope_position=np.array([1, 2, 3, 0, 9, 10], I32),
            k_rope_pos_offset=np.array([0, 5, 9], I32),
            causal=np.int32(1), rotary_mode=1, rope_scale=np.float32(1.0),
            rope_theta=np.array(1e4), sm_scale=0.25,
        )
    sliding = spec.sliding_window
    length_info = [LAST_PAGE_LEN, SW_OFFSET, SINK] if sliding else LAST_PAGE_LEN
    if variant.startswith("paged"):
        pages_shape = (NUM_PAGES, 2, spec.h_kv, PAGE_SIZE, spec.d)
        d_q = spec.d
    else:
        pages_shape = (NUM_PAGES, PAGE_SIZE, spec.d_qk)
        d_q = spec.d_qk
    args = dict(
        q=rand(rng, (lq, spec.h_q, d_q), spec.dtype),
        q_indptr=np.array(Q_INDPTR, I32),
        pages=rand(rng, pages_shape, spec.dtype),
        page_indptr=np.array(PAGE_INDPTR, I32),
        page_values=np.array(PAGE_VALUES, I32),
        length_info=np.array(length_info, I32),
    )
    if variant.startswith("mla"):
        return dict(args, causal=1, sm_scale=np.float64(0.2))
    return dict(
        args,
        k_rope_pos_offset=np.array([3, 0, 100], I32),
        q_rope_position=np.array([7, 8, 9, 0, 110, 111], I32),
        causal=0, rotary_mode=np.int64(1), rope_scale=2, rope_theta=5e5, sm_scale=np.array(0.25, np.float32),
    )


def check(variant: str, spec, args: dict) -> tuple:
    """The variant's check of ``args`` (by name), its results in the order of ``args``."""
    fn = {"ragged": check_ragged, "mla": check_mla}.get(variant.removesuffix("_sw"), check_paged)
    result = fn(spec, args)
    assert set(result) == set(args)  # every argument back, by name
    return tuple(result[name] for name in args)


def reference(variant: str, spec, args: dict):
    """The float64 reference on the same arguments; raises if it rejects them."""
    if variant == "ragged":
        return R.batch_prefill_ragged_kv(**args, rope_scaling=dict(spec.rope_scaling))
    if variant.startswith("paged"):
        return R.batch_prefill_paged_kv(**args, rope_scaling=dict(spec.rope_scaling),
                                        sliding_window=spec.sliding_window)
    return R.batch_prefill_paged_kv_mla(**args, d_latent=spec.d_latent, sliding_window=spec.sliding_window)


def assert_normalised(spec, args: dict, result: tuple) -> None:
    """Same order and values; arrays C-contiguous of the right dtype, scalars Python int/float."""
    assert len(result) == len(args)
    for (name, given), got in zip(args.items(), result):
        if name in ("causal", "rotary_mode"):
            assert type(got) is int and got == int(given), name
        elif name in ("rope_scale", "rope_theta", "sm_scale"):
            assert type(got) is float and got == float(given), name
        else:
            assert isinstance(got, np.ndarray) and got.flags.c_contiguous, name
            floating = name in ("q", "k", "v", "pages")
            assert got.dtype == (np.dtype(DTYPES[spec.dtype]) if floating else np.int32), name
            np.testing.assert_array_equal(got.astype(np.float64), np.asarray(given).astype(np.float64))


# ----------------------------------------------------------------------------- valid calls


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_valid_call_is_normalised_and_reference_agrees(variant, dtype):
    spec = make_spec(variant, dtype)
    args = build(variant, spec)
    result = check(variant, spec, args)
    assert_normalised(spec, args, result)
    out, lse = reference(variant, spec, dict(zip(args, result)))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))


def test_no_rope_skips_position_rules():
    """With rotary_mode 0 negative positions and odd dims are not read, so they pass."""
    spec = make_spec("ragged", d_qk=15)
    args = build("ragged", make_spec("ragged"))
    args.update(q=args["q"][..., :15].copy(), k=args["k"][..., :15].copy(), rotary_mode=0,
                q_rope_position=-np.ones(6, I32), rope_theta=0.0, rope_scale=-1.0)
    check("ragged", spec, args)
    reference("ragged", spec, args)


def strided(x: np.ndarray) -> np.ndarray:
    """A non-contiguous view with the values of ``x``."""
    y = np.zeros(x.shape + (2,), x.dtype)
    y[..., 0] = x
    return y[..., 0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_non_contiguous_input_is_copied(variant):
    spec = make_spec(variant, "bfloat16")
    args = build(variant, spec)
    views = {name: strided(v) if isinstance(v, np.ndarray) and v.ndim else v for name, v in args.items()}
    assert not views["q"].flags.c_contiguous and not views["q_indptr"].flags.c_contiguous
    want = check(variant, spec, args)
    got = check(variant, spec, views)
    for a, b in zip(want, got):
        if isinstance(a, np.ndarray):
            assert b.flags.c_contiguous and a.dtype == b.dtype
            np.testing.assert_array_equal(a.astype(np.float64), b.astype(np.float64))
        else:
            assert a == b and type(a) is type(b)


def test_tensor_like_objects_are_read_through_numpy():
    """Torch CPU tensors are read as torch exposes them (detach().cpu().numpy()); this duck-typed
    stand-in checks the adapter without torch, which the test extra does not install."""
    spec = make_spec("mla")
    args = build("mla", spec)
    as_tensors = dict(args, q=TensorLike(args["q"]), q_indptr=TensorLike(args["q_indptr"]))
    got = check("mla", spec, as_tensors)
    np.testing.assert_array_equal(got[0], args["q"])
    assert got[1].dtype == np.int32


if importlib.util.find_spec("torch"):  # defined only where torch is installed (not in the test extra)

    def test_torch_tensors_are_accepted():
        """Real torch tensors, bfloat16 included."""
        import torch

        spec = make_spec("mla", "bfloat16")
        args = build("mla", spec)
        as_torch = dict(args, q=torch.from_numpy(args["q"].astype(np.float32)).to(torch.bfloat16),
                        q_indptr=torch.from_numpy(args["q_indptr"]), causal=torch.tensor(1),
                        sm_scale=torch.tensor(0.2))
        got = check("mla", spec, as_torch)
        assert got[0].dtype == ml_dtypes.bfloat16 and got[1].dtype == np.int32
        assert type(got[6]) is int and type(got[7]) is float


def test_int64_arrays_and_lists_within_int32_are_converted():
    """Index arguments in any integer dtype, or as Python lists, are accepted and converted."""
    spec = make_spec("ragged")
    args = build("ragged", spec)
    as_int64 = dict(args, q_indptr=args["q_indptr"].astype(np.int64), kv_indptr=args["kv_indptr"].tolist(),
                    k_rope_pos_offset=args["k_rope_pos_offset"].astype(np.uint16))
    got = check("ragged", spec, as_int64)
    want = check("ragged", spec, args)
    for a, b in zip(got, want):
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_position_at_int32_limit_is_accepted():
    """k_rope_pos_offset + kv_len == INT32_MAX is the largest accepted offset."""
    spec = make_spec("paged")
    args = build("paged", spec)
    args["k_rope_pos_offset"] = np.array([0, INT32_MAX, INT32_MAX - 12], I32)  # kv_len 7, 0, 12
    check("paged", spec, args)
    reference("paged", spec, args)


def test_paged_kv_lengths():
    """§2's example (page 16, 2 pages, last 5, sw_off 10, sink 4 -> 15), an empty entry -> 0."""
    info = np.array([[5, 7], [10, 3], [4, 2]], I32)
    got = paged_kv_lengths(np.array([0, 2, 2], I32), info, 16, True)
    assert got.dtype == np.int64 and got.tolist() == [15, 0]
    assert paged_kv_lengths(np.array([0, 3, 3], I32), np.array([16, 1], I32), 16, False).tolist() == [48, 0]


def random_page_table(rng, batch: int, sliding: bool):
    """page_indptr, page_values (distinct shuffled ids) and length_info covering the whole
    accepted range: last_page_len in [1, page_size], sw_off and sink anywhere in [0, phys]."""
    n_pages = rng.integers(0, 3, size=batch)
    page_indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(I32)
    page_values = rng.permutation(NUM_PAGES)[: page_indptr[-1]].astype(I32)
    last = rng.integers(1, PAGE_SIZE + 1, size=batch)
    if not sliding:
        return page_indptr, page_values, last.astype(I32)
    phys = np.maximum(n_pages - 1, 0) * PAGE_SIZE + last
    sw_off = rng.integers(0, phys + 1)
    sink = rng.integers(0, phys + 1)
    return page_indptr, page_values, np.stack([last, sw_off, sink]).astype(I32)


@pytest.mark.parametrize("variant", VARIANTS)
def test_random_accepted_calls_are_accepted_by_reference(variant):
    """Random layouts at the edges of the rules (sw_off/sink anywhere in [0, phys], empty
    entries, causal 0/1, positions up to the int32 limit): ours accepts, so must the reference."""
    rng = np.random.default_rng(sum(map(ord, variant)))
    spec = make_spec(variant)
    for _ in range(25):
        batch = int(rng.integers(0, 4))
        q_lens = rng.integers(0, 4, size=batch)
        q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(I32)
        lq = int(q_indptr[-1])
        args = build(variant, spec)
        args.update(q=rand(rng, (lq,) + args["q"].shape[1:], spec.dtype), q_indptr=q_indptr,
                    causal=int(rng.integers(0, 2)))
        if variant == "ragged":
            kv_indptr = np.concatenate([[0], np.cumsum(rng.integers(0, 5, size=batch))]).astype(I32)
            lk = int(kv_indptr[-1])
            args.update(kv_indptr=kv_indptr, k=rand(rng, (lk, spec.h_kv, spec.d_qk), spec.dtype),
                        v=rand(rng, (lk, spec.h_kv, spec.d_v), spec.dtype))
            kv_len = np.diff(kv_indptr)
        else:
            page_indptr, page_values, length_info = random_page_table(rng, batch, spec.sliding_window)
            args.update(page_indptr=page_indptr, page_values=page_values, length_info=length_info)
            kv_len = paged_kv_lengths(page_indptr, length_info, PAGE_SIZE, spec.sliding_window)
        if "rotary_mode" in args:
            top = INT32_MAX - kv_len.astype(np.int64) if rng.integers(0, 2) else np.full(batch, 50)  # int32 + 1 wraps
            args.update(k_rope_pos_offset=rng.integers(0, top + 1).astype(I32),
                        q_rope_position=rng.integers(0, INT32_MAX, size=lq).astype(I32))
        normalised = dict(zip(args, check(variant, spec, args)))
        reference(variant, spec, normalised)


# ----------------------------------------------------------------------------- malformed calls


def _set(name, index, value):
    """Override: a copy of array ``name`` with ``[index] = value``."""
    def override(a):
        array = a[name].copy()
        array[index] = value
        return {name: array}
    return override


def _put(**values):
    """Override: replace whole arguments (callables get the valid argument dict)."""
    return lambda a: {k: v(a) if callable(v) else v for k, v in values.items()}


def _odd_dim(a):
    """q/k (ragged) or q/pages (paged) cut to 15 columns for a spec with an odd rotated dim."""
    keys = ("q", "k") if "k" in a else ("q", "pages")
    return {k: np.ascontiguousarray(a[k][..., :15]) for k in keys}


def _case(variant, name, override, case_id, **spec_fields):
    return pytest.param(variant, name, override, spec_fields, id=f"{variant}-{case_id}")


MALFORMED = [
    # ---- ragged: tensors
    _case("ragged", "q", _put(q=lambda a: a["q"].astype(np.float64)), "q-float64"),
    _case("ragged", "q", _put(q=lambda a: a["q"][:, 0]), "q-rank2"),
    _case("ragged", "q", _put(q=lambda a: a["q"][:, :2]), "q-heads"),
    _case("ragged", "k", _put(k=lambda a: a["k"][..., :8]), "k-d_qk"),
    _case("ragged", "v", _put(v=lambda a: a["v"][..., :4]), "v-d_v"),
    _case("ragged", "v", _put(v=lambda a: a["v"][:5]), "v-rows"),
    _case("ragged", "k", _put(k=lambda a: a["k"].astype(np.float16)), "k-float16"),
    # ---- ragged: indptr
    _case("ragged", "q_indptr", _put(q_indptr=lambda a: a["q_indptr"].astype(np.int64) + (1 << 40)),
          "q_indptr-int64-past-int32"),
    _case("ragged", "q_indptr", _put(q_indptr=lambda a: a["q_indptr"].astype(np.float32)), "q_indptr-float"),
    _case("ragged", "q_indptr", _put(q_indptr=np.zeros(0, I32)), "q_indptr-empty"),
    _case("ragged", "q_indptr", _set("q_indptr", 0, 1), "q_indptr-start1"),
    _case("ragged", "q_indptr", _set("q_indptr", 1, 5), "q_indptr-decreasing"),
    _case("ragged", "q_indptr", _set("q_indptr", 3, 7), "q_indptr-overrun"),
    _case("ragged", "q_indptr", _put(q_indptr=lambda a: a["q_indptr"][None]), "q_indptr-rank2"),
    _case("ragged", "kv_indptr", _put(kv_indptr=np.array([0, 4, 6], I32)), "kv_indptr-length"),
    _case("ragged", "kv_indptr", _set("kv_indptr", 3, 5), "kv_indptr-short"),
    _case("ragged", "kv_indptr", _set("kv_indptr", 2, 3), "kv_indptr-decreasing"),
    _case("ragged", "kv_indptr", _put(kv_indptr=lambda a: a["kv_indptr"].astype(np.uint32) + np.uint32(1 << 31)),
          "kv_indptr-uint32-past-int32"),
    # ---- ragged: positions
    _case("ragged", "q_rope_position", _put(q_rope_position=np.zeros(5, I32)), "q_pos-length"),
    _case("ragged", "q_rope_position", _set("q_rope_position", 2, -1), "q_pos-negative"),
    _case("ragged", "k_rope_pos_offset", _put(k_rope_pos_offset=np.zeros(3, np.bool_)), "k_off-bool"),
    _case("ragged", "k_rope_pos_offset", _put(k_rope_pos_offset=np.zeros(2, I32)), "k_off-length"),
    _case("ragged", "k_rope_pos_offset", _set("k_rope_pos_offset", 1, -3), "k_off-negative"),
    _case("ragged", "k_rope_pos_offset", _set("k_rope_pos_offset", 0, INT32_MAX - 3), "k_off-overflow"),
    # ---- ragged: scalars
    _case("ragged", "causal", _put(causal=2), "causal-2"),
    _case("ragged", "causal", _put(causal=1.0), "causal-float"),
    _case("ragged", "causal", _put(causal=True), "causal-bool"),
    _case("ragged", "rotary_mode", _put(rotary_mode=2), "rotary_mode-2"),
    _case("ragged", "rotary_mode", _put(rotary_mode=np.array([1])), "rotary_mode-array"),
    _case("ragged", "sm_scale", _put(sm_scale=float("nan")), "sm_scale-nan"),
    _case("ragged", "sm_scale", _put(sm_scale="0.25"), "sm_scale-str"),
    _case("ragged", "sm_scale", _put(sm_scale=1 + 2j), "sm_scale-complex"),
    _case("ragged", "rope_theta", _put(rope_theta=float("inf")), "rope_theta-inf"),
    _case("ragged", "rope_theta", _put(rope_theta=0.0), "rope_theta-zero"),
    _case("ragged", "rope_scale", _put(rope_scale=-1.0), "rope_scale-negative"),
    _case("ragged", "rope_scale", _put(rope_scale=1e39), "rope_scale-float32-overflow"),
    _case("ragged", "rotary_mode", _odd_dim, "rope-odd-d_qk", d_qk=15),
    # ---- paged
    _case("paged", "q", _put(q=lambda a: a["q"][..., :8]), "q-d"),
    _case("paged", "pages", _put(pages=lambda a: a["pages"][:, 0]), "pages-rank4"),
    _case("paged", "pages", _put(pages=lambda a: a["pages"][:, :, :, :3]), "pages-page_size"),
    _case("paged", "pages", _put(pages=lambda a: np.concatenate([a["pages"]] * 2, axis=1)), "pages-dim1"),
    _case("paged", "pages", _put(pages=lambda a: a["pages"].astype(np.float16)), "pages-float16"),
    _case("paged", "q_indptr", _put(q_indptr=np.zeros(0, I32)), "q_indptr-empty"),
    _case("paged", "page_indptr", _put(page_indptr=np.array([0, 2, 5], I32)), "page_indptr-length"),
    _case("paged", "page_indptr", _set("page_indptr", 3, 6), "page_indptr-overrun"),
    _case("paged", "page_indptr", _set("page_indptr", 2, 1), "page_indptr-decreasing"),
    _case("paged", "page_indptr", _set("page_indptr", 0, -1), "page_indptr-start"),
    _case("paged", "page_values", _set("page_values", 1, -1), "page_values-minus1"),
    _case("paged", "page_values", _set("page_values", 4, NUM_PAGES), "page_values-P"),
    _case("paged", "page_values", _put(page_values=lambda a: a["page_values"].astype(np.int64) - (1 << 33)),
          "page_values-int64-past-int32"),
    _case("paged", "page_values", _put(pages=lambda a: a["pages"][:0]), "page_values-no-pages"),
    _case("paged", "length_info", _set("length_info", 0, 0), "last_page_len-0"),
    _case("paged", "length_info", _set("length_info", 2, PAGE_SIZE + 1), "last_page_len-ps+1"),
    _case("paged", "length_info", _put(length_info=np.ones((3, 3), I32)), "length_info-3xB"),
    _case("paged", "length_info", _put(length_info=np.ones(4, I32)), "length_info-length"),
    _case("paged", "k_rope_pos_offset", _put(k_rope_pos_offset=np.zeros(4, I32)), "k_off-length"),
    _case("paged", "k_rope_pos_offset", _set("k_rope_pos_offset", 2, INT32_MAX - 11), "k_off-overflow"),
    _case("paged", "q_rope_position", _put(q_rope_position=lambda a: a["q_rope_position"][None]), "q_pos-rank2"),
    _case("paged", "causal", _put(causal=-1), "causal-minus1"),
    _case("paged", "rotary_mode", _put(rotary_mode=2), "rotary_mode-2"),
    _case("paged", "rope_theta", _put(rope_theta=-float("inf")), "rope_theta-minus-inf"),
    _case("paged", "rotary_mode", _odd_dim, "rope-odd-d", d=15),
    # ---- paged, sliding window
    _case("paged_sw", "length_info", _put(length_info=np.array(LAST_PAGE_LEN, I32)), "length_info-B"),
    _case("paged_sw", "length_info", _set("length_info", (0, 2), 0), "last_page_len-0"),
    _case("paged_sw", "length_info", _set("length_info", (1, 0), 8), "sw_off-beyond"),
    _case("paged_sw", "length_info", _set("length_info", (1, 2), -1), "sw_off-negative"),
    _case("paged_sw", "length_info", _set("length_info", (2, 0), -1), "sink-negative"),
    _case("paged_sw", "length_info", _set("length_info", (2, 2), 13), "sink-beyond"),
    # ---- MLA
    _case("mla", "q", _put(q=lambda a: a["q"][..., :32]), "q-d_latent-only"),
    _case("mla", "q", _put(q=lambda a: a["q"].astype(np.float64)), "q-float64"),
    _case("mla", "pages", _put(pages=lambda a: a["pages"][:, None]), "pages-rank4"),
    _case("mla", "pages", _put(pages=lambda a: a["pages"][:, :2]), "pages-page_size"),
    _case("mla", "q_indptr", _put(q_indptr=np.zeros(0, I32)), "q_indptr-empty"),
    _case("mla", "q_indptr", _set("q_indptr", 1, 7), "q_indptr-decreasing"),
    _case("mla", "page_indptr", _put(page_indptr=np.array([0, 5], I32)), "page_indptr-length"),
    _case("mla", "page_values", _set("page_values", 0, NUM_PAGES), "page_values-P"),
    _case("mla", "length_info", _set("length_info", 0, 0), "last_page_len-0"),
    _case("mla", "causal", _put(causal=2), "causal-2"),
    _case("mla", "sm_scale", _put(sm_scale=float("inf")), "sm_scale-inf"),
    _case("mla", "sm_scale", _put(sm_scale=np.bool_(True)), "sm_scale-bool"),
    _case("mla", "sm_scale", _put(sm_scale=np.ones(2)), "sm_scale-array"),
    # ---- MLA, sliding window
    _case("mla_sw", "length_info", _set("length_info", (0, 0), PAGE_SIZE + 1), "last_page_len-ps+1"),
    _case("mla_sw", "length_info", _set("length_info", (1, 2), 13), "sw_off-beyond"),
    _case("mla_sw", "length_info", _set("length_info", (2, 0), -2), "sink-negative"),
]


@pytest.mark.parametrize("variant, name, override, spec_fields", MALFORMED)
def test_malformed_call_is_rejected(variant, name, override, spec_fields):
    spec = make_spec(variant, **spec_fields)
    args = build(variant, make_spec(variant))  # _odd_dim cuts these to the spec's odd dim
    args.update(override(args))
    with pytest.raises(InputError, match=f"^{re.escape(name)}[:. ]"):
        check(variant, spec, args)


def test_message_states_expected_and_found():
    spec = make_spec("paged_sw")
    args = build("paged_sw", spec)
    args["length_info"] = args["length_info"].copy()
    args["length_info"][1, 0] = 8
    with pytest.raises(InputError) as info:
        check("paged_sw", spec, args)
    assert str(info.value) == (
        "length_info: sliding-window offset sw_off (length_info[1, 0]) of entry 0 (which has pages) "
        "expected in [0, 7], found 8")
