"""Layer (b)/(c): dense and masked sequence prefill against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_matches_reference, on_backends, uniform
from linalg_prefill.mlir import MaskedSequencePrefillSpec, SequencePrefillSpec
from linalg_prefill.pipeline import Target
from linalg_prefill.pipeline.targets import LOWERINGS
from linalg_prefill.runtime import InputError, open_kernel
from linalg_prefill.runtime.reference import EMPTY_ROW_LSE
from support import pairwise, run_against_reference, spec_id

#: (B, qo_len, kv_len); the float64 reference and error bound of the 300 x 300 call are most of a
#: test's time: two entries of it keep a batch over several query and KV tiles.
SHAPES = [(1, 1, 1), (3, 17, 17), (1, 64, 200), (2, 300, 300), (1, 129, 5), (3, 5, 129)]
#: Heads (GQA group 1, 4 and 6), head dim, dtype, mask and lowering, pairwise (support.pairwise):
#: every pair of values of two of them is in some spec; each spec runs on a GPU too, where there is one.
DENSE_CASES = [(SequencePrefillSpec(*row["heads"], row["d"], row["dtype"], causal=row["causal"],
                                    sm_scale=row["d"] ** -0.5), row["lowering"])
               for row in pairwise(heads=[(4, 4), (8, 2), (6, 1)], d=[64, 128], causal=[False, True],
                                   dtype=["float32", "float16", "bfloat16"], lowering=list(LOWERINGS))]


def _run_shapes(spec, backend, cache, shapes=SHAPES):
    """Each (B, qo_len, kv_len) of ``shapes`` against the reference; causal rows above the
    bottom-right diagonal see no key (output 0, lse -5e4)."""
    for batch, qo_len, kv_len in shapes:
        run_against_reference(spec, backend, cache=cache, entries=[(qo_len, kv_len)] * batch)


@pytest.mark.parametrize("spec, backend", on_backends(DENSE_CASES))
def test_sequence_prefill(spec, backend, cache):
    _run_shapes(spec, backend, cache)


TILED = [SequencePrefillSpec(4, 4, 64, "float32", causal=True, sm_scale=0.125, q_tile=q_tile, kv_tile=kv_tile)
         for q_tile, kv_tile in [(8, 16), (64, 256)]]


@pytest.mark.parametrize("spec", [SequencePrefillSpec(8, 2, 64, "float32", causal=False, sm_scale=0.3, q_tile=8,
                                                      kv_tile=16), TILED[0]], ids=spec_id)
def test_small_tiles_walk_many_tiles(spec, cache):
    """Tiles much smaller than the lengths: many query and KV steps, partial last tiles (GQA
    group 4 without the mask, MHA with it)."""
    _run_shapes(spec, "llvm-cpu", cache, shapes=[(2, 45, 45), (1, 37, 100), (2, 100, 37)])


PLAIN = SequencePrefillSpec(4, 4, 64, "float32", causal=False, sm_scale=0.125)
PADDED = MaskedSequencePrefillSpec(4, 2, 64, "float32", mask_mode="padded", sm_scale=0.125)
CAUSAL = SequencePrefillSpec(4, 4, 64, "float32", causal=True, sm_scale=0.125)
BF16 = SequencePrefillSpec(8, 2, 64, "bfloat16", causal=True, sm_scale=0.125)


#: The linalg lowering whatever the host (an AMX host's own builds these specs in the x86 lowering,
#: whose blocks do not follow q_tile / kv_tile): AVX2 code, which both CI CPUs run.
LINALG_TILES = Target("llvm-cpu", "x86-64-v3")


@pytest.mark.compiles(*TILED, backends=(LINALG_TILES,))
def test_tile_size_changes_rounding_only(cache):
    rng = np.random.default_rng(7)
    q, k, v = (uniform(rng, (2, 90, 4, 64), "float32") for _ in range(3))
    outs = []
    for spec in TILED:
        q_tile, kv_tile = spec.q_tile, spec.kv_tile
        assert LINALG_TILES.lowering_of(spec) == "linalg"
        outs.append(open_kernel(spec, LINALG_TILES, cache=cache)(q, k, v))
        assert_matches_reference(f"tiles {q_tile} x {kv_tile}", outs[-1], spec, (q, k, v))
    assert not np.array_equal(outs[0][0], outs[1][0])  # the tiles do change the rounding


@pytest.mark.compiles(PLAIN)
def test_empty_kv_gives_zero_output_and_empty_lse(cache):
    spec = PLAIN
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


MASKED_CASES = [(MaskedSequencePrefillSpec(*row["heads"], row["d"], row["dtype"], mask_mode=row["mask_mode"],
                                           sm_scale=row["d"] ** -0.5), row["lowering"])
                for row in pairwise(heads=[(4, 4), (8, 2)], d=[64, 128], mask_mode=["padded", "causal_padded_left"],
                                    dtype=["float32", "float16", "bfloat16"], lowering=list(LOWERINGS))]


@pytest.mark.parametrize("spec, backend", on_backends(MASKED_CASES))
def test_masked_sequence_prefill(backend, spec, cache):
    """Padding rows (and, left-padded causal, the rows above the diagonal) see no key: output 0,
    lse -5e4 (§11.3)."""
    for (batch, qo_len, kv_len), lens in MASKED_VALID_LENS.items():
        run_against_reference(spec, backend, cache=cache, entries=[(qo_len, kv_len)] * batch,
                              calls=[dict(valid_lens=np.array(lens, np.int32))])


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
@pytest.mark.compiles(PADDED)
def test_bad_inputs_name_the_argument(mutate, argument, cache):
    kernel = open_kernel(PADDED, cache=cache)
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


@pytest.mark.compiles(CAUSAL)
def test_non_contiguous_inputs_are_copied(cache):
    spec = CAUSAL
    rng = np.random.default_rng(3)
    packed = uniform(rng, (1, 20, 12, 64), "float32")  # a fused qkv projection, sliced per tensor
    q, k, v = packed[:, :, 0:4], packed[:, :, 4:8], packed[:, :, 8:12]
    assert not q.flags.c_contiguous
    assert_matches_reference("non-contiguous", open_kernel(spec, cache=cache)(q, k, v), spec, (q, k, v))


@pytest.mark.compiles(BF16)
def test_device_arrays_pass_through_without_a_host_copy(cache):
    """IREE DeviceArrays are checked by dtype and shape and used in place; a wrong one is still
    rejected by name. The result equals the numpy call's bitwise."""
    import iree.runtime as rt

    kernel = open_kernel(BF16, cache=cache)
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
