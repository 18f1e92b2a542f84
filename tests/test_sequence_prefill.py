"""Layer (b)/(c): dense and masked sequence prefill against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import BACKENDS, BACKENDS_WITHOUT_FUSED_CPU, assert_matches_reference, uniform
from linalg_prefill.mlir import MaskedSequencePrefillSpec, SequencePrefillSpec
from linalg_prefill.runtime import InputError, open_kernel
from linalg_prefill.runtime import reference
from linalg_prefill.runtime.reference import EMPTY_ROW_LSE

SHAPES = [(1, 1, 1), (3, 17, 17), (1, 64, 200), (3, 300, 300), (1, 129, 5), (3, 5, 129)]
HEADS_AND_DIMS = [((4, 4), 64), ((8, 2), 128), ((6, 1), 64)]
FP32_GRID = [(h, d) for h, _ in HEADS_AND_DIMS for d in (64, 128)]



def _run_sequence(spec, backend, cache, shapes=SHAPES, seed=0):
    kernel = open_kernel(spec, backend, cache=cache)
    rng = np.random.default_rng(seed)
    for batch, qo_len, kv_len in shapes:
        q = uniform(rng, (batch, qo_len, spec.h_q, spec.d), spec.dtype)
        k = uniform(rng, (batch, kv_len, spec.h_kv, spec.d), spec.dtype)
        v = uniform(rng, (batch, kv_len, spec.h_kv, spec.d), spec.dtype)
        want_out, want_lse = reference.batch_sequence_prefill_kv(q, k, v, causal=spec.causal, sm_scale=spec.sm_scale)
        out, lse = kernel(q, k, v)
        empty_rows = np.broadcast_to(
            (np.arange(qo_len) < qo_len - kv_len)[None, :, None] if spec.causal else np.zeros((1, qo_len, 1), bool),
            out.shape[:3],
        )
        assert_matches_reference(f"{batch}x{qo_len}x{kv_len}", (out, lse), spec, (q, k, v), (want_out, want_lse))
        assert np.all(np.asarray(out, np.float64)[empty_rows] == 0.0)
        assert np.all(lse[empty_rows] == EMPTY_ROW_LSE)


@pytest.mark.parametrize("backend", BACKENDS_WITHOUT_FUSED_CPU)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, d", FP32_GRID)
def test_sequence_prefill_float32(backend, causal, heads, d, cache):
    spec = SequencePrefillSpec(*heads, d, "float32", causal=causal, sm_scale=d ** -0.5)
    _run_sequence(spec, backend, cache)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, d", HEADS_AND_DIMS)
def test_sequence_prefill_half(backend, dtype, causal, heads, d, cache):
    spec = SequencePrefillSpec(*heads, d, dtype, causal=causal, sm_scale=d ** -0.5)
    _run_sequence(spec, backend, cache)


@pytest.mark.parametrize("causal", [False, True])
def test_small_tiles_walk_many_tiles(causal, cache):
    """Tiles much smaller than the lengths: many query and KV steps, partial last tiles."""
    spec = SequencePrefillSpec(8, 2, 64, "float32", causal=causal, sm_scale=0.3, q_tile=8, kv_tile=16)
    _run_sequence(spec, "llvm-cpu", cache, shapes=[(2, 45, 45), (1, 37, 100), (2, 100, 37)])


def test_tile_size_changes_rounding_only(cache):
    rng = np.random.default_rng(7)
    q, k, v = (uniform(rng, (2, 90, 4, 64), "float32") for _ in range(3))
    outs = []
    for q_tile, kv_tile in [(8, 16), (64, 256)]:
        spec = SequencePrefillSpec(4, 4, 64, "float32", causal=True, sm_scale=0.125, q_tile=q_tile, kv_tile=kv_tile)
        outs.append(open_kernel(spec, cache=cache)(q, k, v))
        assert_matches_reference(f"tiles {q_tile} x {kv_tile}", outs[-1], spec, (q, k, v))
    assert not np.array_equal(outs[0][0], outs[1][0])  # the tiles do change the rounding


def test_empty_kv_gives_zero_output_and_empty_lse(cache):
    spec = SequencePrefillSpec(4, 4, 64, "float32", causal=False, sm_scale=0.125)
    q = np.ones((2, 3, 4, 64), np.float32)
    kv = np.ones((2, 0, 4, 64), np.float32)
    out, lse = open_kernel(spec, cache=cache)(q, kv, kv)
    assert np.all(out == 0.0) and np.all(lse == EMPTY_ROW_LSE)


MASKED_VALID_LENS = {
    # (B, qo_len, kv_len): valid_lens, including 0 and full length
    (4, 33, 33): [0, 33, 10, 1],
    (3, 32, 48): [32, 0, 17],
    (2, 300, 300): [300, 123],
}


def _run_masked(spec, backend, cache, seed=0):
    kernel = open_kernel(spec, backend, cache=cache)
    rng = np.random.default_rng(seed)
    for (batch, qo_len, kv_len), lens in MASKED_VALID_LENS.items():
        q = uniform(rng, (batch, qo_len, spec.h_q, spec.d), spec.dtype)
        k = uniform(rng, (batch, kv_len, spec.h_kv, spec.d), spec.dtype)
        v = uniform(rng, (batch, kv_len, spec.h_kv, spec.d), spec.dtype)
        valid_lens = np.array(lens, np.int32)
        want_out, want_lse = reference.batch_sequence_prefill_kv_masked(
            q, k, v, valid_lens, mask_mode=spec.mask_mode, sm_scale=spec.sm_scale
        )
        out, lse = kernel(q, k, v, valid_lens)
        rows = np.arange(qo_len)[None, :]
        lens_col = valid_lens[:, None]
        if spec.mask_mode == "padded":
            valid_rows = rows < lens_col
        else:
            valid_rows = rows >= qo_len - lens_col
        keep = np.broadcast_to(valid_rows[:, :, None], out.shape[:3])
        assert_matches_reference(f"{batch}x{qo_len}x{kv_len}", (out, lse), spec, (q, k, v, valid_lens),
                                 (want_out, want_lse))
        # padding rows: exactly 0 and -5e4 (§11.3), in the kernel and in the reference
        assert np.all(np.asarray(out, np.float64)[~keep] == 0.0)
        assert np.all(lse[~keep] == EMPTY_ROW_LSE)
        assert np.all(want_lse[~keep] == EMPTY_ROW_LSE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mask_mode", ["padded", "causal_padded_left"])
@pytest.mark.parametrize("heads, d", [((4, 4), 64), ((8, 2), 128)])
def test_masked_sequence_prefill(backend, dtype, mask_mode, heads, d, cache):
    spec = MaskedSequencePrefillSpec(*heads, d, dtype, mask_mode=mask_mode, sm_scale=d ** -0.5)
    _run_masked(spec, backend, cache)


@pytest.mark.parametrize(
    "mutate, argument",
    [
        (lambda a: a.update(q=a["q"].astype(np.float16)), "q"),
        (lambda a: a.update(k=a["k"][:, :, :1]), "k"),
        (lambda a: a.update(v=a["v"][:, :-1]), "v.shape"),
        (lambda a: a.update(q=a["q"][0]), "q"),
        (lambda a: a.update(valid_lens=a["valid_lens"].astype(np.float32)), "valid_lens"),
        (lambda a: a.update(valid_lens=np.array([5, 17], np.int32)), "valid_lens"),
        (lambda a: a.update(valid_lens=np.array([-1, 2], np.int32)), "valid_lens"),
        (lambda a: a.update(valid_lens=np.array([1], np.int32)), "valid_lens"),
    ],
)
def test_bad_inputs_name_the_argument(mutate, argument, cache):
    spec = MaskedSequencePrefillSpec(4, 2, 64, "float32", mask_mode="padded", sm_scale=0.125)
    kernel = open_kernel(spec, cache=cache)
    rng = np.random.default_rng(0)
    args = dict(
        q=uniform(rng, (2, 16, 4, 64), "float32"),
        k=uniform(rng, (2, 16, 2, 64), "float32"),
        v=uniform(rng, (2, 16, 2, 64), "float32"),
        valid_lens=np.array([3, 16], np.int32),
    )
    mutate(args)
    with pytest.raises(InputError, match=argument):
        kernel(args["q"], args["k"], args["v"], args["valid_lens"])


def test_non_contiguous_inputs_are_copied(cache):
    spec = SequencePrefillSpec(4, 4, 64, "float32", causal=True, sm_scale=0.125)
    rng = np.random.default_rng(3)
    packed = uniform(rng, (1, 20, 12, 64), "float32")  # a fused qkv projection, sliced per tensor
    q, k, v = packed[:, :, 0:4], packed[:, :, 4:8], packed[:, :, 8:12]
    assert not q.flags.c_contiguous
    assert_matches_reference("non-contiguous", open_kernel(spec, cache=cache)(q, k, v), spec, (q, k, v))


def test_device_arrays_pass_through_without_a_host_copy(cache):
    """IREE DeviceArrays are checked by dtype and shape and used in place; a wrong one is still
    rejected by name. The result equals the numpy call's bitwise."""
    import iree.runtime as rt

    spec = SequencePrefillSpec(8, 2, 64, "bfloat16", causal=True, sm_scale=0.125)
    kernel = open_kernel(spec, cache=cache)
    rng = np.random.default_rng(9)
    q, k, v = (uniform(rng, (2, 40, h, 64), "bfloat16") for h in (8, 2, 2))
    on_device = [rt.asdevicearray(kernel.device, x) for x in (q, k, v)]
    out, lse = kernel(*on_device, to_host=False)
    assert isinstance(out, rt.DeviceArray)
    want = kernel(q, k, v)
    np.testing.assert_array_equal(out.to_host(), want[0])
    np.testing.assert_array_equal(lse.to_host(), want[1])
    wrong = rt.asdevicearray(kernel.device, q.astype(np.float32))
    with pytest.raises(InputError, match="^q: expected dtype bfloat16"):
        kernel(wrong, *on_device[1:])
    with pytest.raises(InputError, match="^k: expected shape"):
        kernel(on_device[0], rt.asdevicearray(kernel.device, q), on_device[2])
    elsewhere = rt.asdevicearray(rt.get_device("local-sync"), v)  # another device than the kernel's
    with pytest.raises(InputError, match="^v: is an IREE device array on another device"):
        kernel(*on_device[:2], elsewhere)
