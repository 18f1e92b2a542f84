"""Plan/run wrappers (runtime.wrappers) and artifact sets (runtime.artifact_set) on llvm-cpu.

Small shapes only (h_q=4, h_kv=2, d=64, float32; MLA h_q=8, 64 + 16); every spec compiles once per
session through the shared ``cache`` fixture, and other tests run the same kernels.
"""

from __future__ import annotations

import importlib.util

import shutil
from concurrent.futures import ThreadPoolExecutor

import iree.runtime as rt
import numpy as np
import pytest

from conftest import TensorLike, assert_matches_reference, uniform
from linalg_prefill.mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from linalg_prefill.pipeline import Target
from linalg_prefill.pipeline.artifacts import ArtifactError, build_artifacts
from linalg_prefill.runtime import (
    InputError, MaskedSequencePrefillWrapper, MlaPagedPrefillWrapper, PagedPrefillWrapper, RaggedPrefillWrapper,
    SequencePrefillWrapper, open_artifacts,
)
from linalg_prefill.runtime.examples import indptr, page_table
from support import LLAMA3

RAGGED = RaggedPrefillSpec(4, 2, 64, 64, "float32", LLAMA3)
PAGED = PagedPrefillSpec(4, 2, 64, "float32", page_size=8)
SLIDING = PagedPrefillSpec(4, 2, 64, "float32", page_size=8, sliding_window=True)
MLA = MlaPagedPrefillSpec(8, 64, 16, "float32", page_size=16)  # tests/test_decode_batches.py's
SEQ = SequencePrefillSpec(4, 2, 64, "float32", causal=True, sm_scale=0.125)
MASKED = MaskedSequencePrefillSpec(4, 2, 64, "float32", mask_mode="causal_padded_left", sm_scale=0.125)

# (qo_len, kv_len): causal rows without a key, several pages and KV tiles, a square entry.
ENTRIES = [(5, 3), (12, 40), (7, 7)]
ROPE = {"rope_scale": 1.0, "rope_theta": 5e5}
#: Built before the tests run (tests/conftest.py). ENTRIES take no serving pass: RoPE is on, and
#: MLA's 16-query pass is over the scratch bound (h_q 8 over 80-wide rows).
pytestmark = pytest.mark.compiles(RAGGED, PAGED, SLIDING, MLA, SEQ, MASKED)


def _natural(entries):
    """Expected default positions: q at kv_len - qo_len + i, k at 0, both shifted when qo > kv."""
    offsets = np.array([max(qo - kv, 0) for qo, kv in entries], np.int32)
    q_pos = np.concatenate([off + kv - qo + np.arange(qo) for off, (qo, kv) in zip(offsets, entries)])
    return q_pos.astype(np.int32), offsets


def _check(name, got, spec, args):
    """A wrapper's result against the reference of the equivalent seed-ABI call ``args``."""
    assert_matches_reference(name, got, spec, args)


def _ragged_layer(rng, entries):
    rows, kv_rows = sum(e[0] for e in entries), sum(e[1] for e in entries)
    return (uniform(rng, (rows, 4, 64), "float32"), uniform(rng, (kv_rows, 2, 64), "float32"),
            uniform(rng, (kv_rows, 2, 64), "float32"))


def _ragged_call(entries, q, k, v, causal=1):
    """The seed-ABI call a ragged wrapper planned for ``entries`` (RoPE on, natural positions) runs."""
    q_pos, k_off = _natural(entries)
    qi, ki = indptr([e[0] for e in entries]), indptr([e[1] for e in entries])
    return q, qi, k, v, ki, q_pos, k_off, causal, 1, 1.0, 5e5, 64 ** -0.5


@pytest.fixture(scope="module")
def ragged(cache):
    """A ragged wrapper planned for ENTRIES (causal, RoPE on) and three layers of inputs."""
    wrapper = RaggedPrefillWrapper(RAGGED, cache=cache)
    wrapper.plan(indptr([e[0] for e in ENTRIES]), indptr([e[1] for e in ENTRIES]), rope=ROPE)
    rng = np.random.default_rng(0)
    return wrapper, [_ragged_layer(rng, ENTRIES) for _ in range(3)]


def _pages(rng, physical, page_size, row):
    """Shuffled pages for ``physical`` rows per entry: pages, page_indptr, page_values, last_page_len."""
    table = page_table(rng, physical, page_size, spare_pages=3)
    pages = uniform(rng, (table.num_pages, *row), "float32")
    return pages, table.page_indptr, table.page_values, table.length_info


# ----------------------------------------------------------------------------- KV-cache wrappers


def test_ragged_matches_reference(ragged):
    wrapper, layers = ragged
    plan = wrapper.current_plan
    assert plan.kv_lens.tolist() == [3, 40, 7] and plan.qo_lens.tolist() == [5, 12, 7]
    assert np.array_equal(plan.arrays["q_rope_position"], _natural(ENTRIES)[0])
    for i, (q, k, v) in enumerate(layers):
        _check(f"layer {i}", wrapper.run(q, k, v), RAGGED, _ragged_call(ENTRIES, q, k, v))


@pytest.mark.parametrize("spec", [PAGED, SLIDING], ids=["paged", "sliding_window"])
def test_paged_matches_reference(spec, cache):
    rng = np.random.default_rng(1)
    kv_lens = [e[1] for e in ENTRIES]
    if spec.sliding_window:  # 2 sinks, 4 evicted rows after them: physical = logical + 4
        pages, page_indptr, page_values, last = _pages(rng, [n + 4 for n in kv_lens], 8, (2, 2, 8, 64))
        length_info = np.stack([last, np.full(3, 6, np.int32), np.full(3, 2, np.int32)])
    else:
        pages, page_indptr, page_values, length_info = _pages(rng, kv_lens, 8, (2, 2, 8, 64))
    q_indptr = indptr([e[0] for e in ENTRIES])
    wrapper = PagedPrefillWrapper(spec, cache=cache)
    plan = wrapper.plan(q_indptr, page_indptr, page_values, length_info, causal=True, rope=ROPE)
    assert plan.kv_lens.tolist() == kv_lens
    q = uniform(rng, (q_indptr[-1], 4, 64), "float32")
    q_pos, k_off = _natural(ENTRIES)
    call = (q, q_indptr, pages, page_indptr, page_values, length_info, k_off, q_pos, 1, 1, 1.0, 5e5, 64 ** -0.5)
    _check("paged", wrapper.run(q, pages), spec, call)


#: Entries of 1 and 3 queries take the serving passes (RoPE off), the 17-query one the kernel.
SHORT = [(1, 20), (3, 40), (17, 600)]


@pytest.mark.compiles(PAGED, passes=SHORT)
def test_serving_schedule_is_worked_out_once_per_plan(cache, monkeypatch):
    """run() reuses the plan's host schedule of its serving passes (runtime/decode.py) on every
    layer, and a new plan replaces it; every layer still matches the reference."""
    import linalg_prefill.runtime.kernels as kernels

    schedules = []

    def counted(*args):
        schedules.append(kernels_decode_schedule(*args))
        return schedules[-1]

    kernels_decode_schedule = kernels.decode_schedule
    monkeypatch.setattr(kernels, "decode_schedule", counted)
    rng = np.random.default_rng(6)
    pages, page_indptr, page_values, length_info = _pages(rng, [e[1] for e in SHORT], 8, (2, 2, 8, 64))
    q_indptr = indptr([e[0] for e in SHORT])
    wrapper = PagedPrefillWrapper(PAGED, cache=cache)
    for plan_number in (1, 2):
        wrapper.plan(q_indptr, page_indptr, page_values, length_info, causal=True)
        for layer in range(2):
            q = uniform(rng, (q_indptr[-1], 4, 64), "float32")
            call = (q, q_indptr, pages, page_indptr, page_values, length_info, np.zeros(3, np.int32),
                    np.zeros(q_indptr[-1], np.int32), 1, 0, 1.0, 1e4, 64 ** -0.5)
            _check(f"plan {plan_number} layer {layer}", wrapper.run(q, pages), PAGED, call)
        assert len(schedules) == plan_number
    assert schedules[0].passes.tolist() == [1, 4, 0]


def test_mla_matches_reference(cache):
    rng = np.random.default_rng(2)
    pages, page_indptr, page_values, last = _pages(rng, [e[1] for e in ENTRIES], 16, (16, 80))
    q_indptr = indptr([e[0] for e in ENTRIES])
    q = uniform(rng, (q_indptr[-1], 8, 80), "float32")
    wrapper = MlaPagedPrefillWrapper(MLA, cache=cache)
    wrapper.plan(q_indptr, page_indptr, page_values, last, causal=True, sm_scale=48 ** -0.5)
    _check("mla", wrapper.run(q, pages), MLA, (q, q_indptr, pages, page_indptr, page_values, last, 1, 48 ** -0.5))
    with pytest.raises(TypeError, match="sm_scale"):
        wrapper.plan(q_indptr, page_indptr, page_values, last)


def test_sequence_and_masked_match_reference(cache):
    rng = np.random.default_rng(3)
    q, k, v = (uniform(rng, (2, n, h, 64), "float32") for n, h in ((20, 4), (17, 2), (17, 2)))
    seq = SequencePrefillWrapper(SEQ, cache=cache)
    _check("sequence", seq.run(q, k, v), SEQ, (q, k, v))
    masked = MaskedSequencePrefillWrapper(MASKED, cache=cache)
    lens = np.array([17, 4], np.int32)
    masked.plan(lens)
    _check("masked", masked.run(q, k, v), MASKED, (q, k, v, lens))
    with pytest.raises(InputError, match="^valid_lens: .* found 17"):
        masked.run(q[:, :10], k[:, :10], v[:, :10])


def test_tensor_like_inputs(ragged):
    """Torch-style tensors are read through detach().cpu().numpy() (torch is not a test dependency)."""
    wrapper, layers = ragged
    q, k, v = layers[0]
    got = wrapper.run(*(TensorLike(x) for x in (q, k, v)))
    want = wrapper.run(q, k, v)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


if importlib.util.find_spec("torch"):  # defined only where torch is installed

    def test_torch_inputs(ragged):
        import torch

        wrapper, layers = ragged
        q, k, v = layers[0]
        got = wrapper.run(*(torch.from_numpy(x) for x in (q, k, v)))
        want = wrapper.run(q, k, v)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))


# ----------------------------------------------------------------------------- errors, re-plan


def test_run_before_plan_is_an_error(cache):
    wrapper = RaggedPrefillWrapper(RAGGED, cache=cache)
    with pytest.raises(RuntimeError, match=r"run\(\) called before plan\(\)"):
        wrapper.run(*_ragged_layer(np.random.default_rng(0), ENTRIES))


def test_wrong_spec_type():
    with pytest.raises(InputError, match="^spec: PagedPrefillWrapper needs a PagedPrefillSpec"):
        PagedPrefillWrapper(RAGGED)


def test_shape_mismatch_names_the_argument(ragged):
    wrapper, layers = ragged
    q, k, v = layers[0]
    with pytest.raises(InputError, match=r"^q: expected 24 rows \(q_indptr\[-1\] of the plan\), got 23"):
        wrapper.run(q[:-1], k, v)
    with pytest.raises(InputError, match="^v: expected shape"):
        wrapper.run(q, k, v[:, :1])
    with pytest.raises(InputError, match="^k: expected dtype float32"):
        wrapper.run(q, k.astype(np.float16), v)


def test_plan_checks_index_arrays(cache):
    wrapper = PagedPrefillWrapper(PAGED, cache=cache)
    good = (indptr([2, 3]), indptr([1, 2]), np.array([0, 2, 1], np.int32), np.array([4, 8], np.int32))
    with pytest.raises(InputError, match="^q_indptr: expected non-decreasing"):
        wrapper.plan(np.array([0, 3, 2], np.int32), *good[1:])
    with pytest.raises(InputError, match="^length_info: last_page_len"):
        wrapper.plan(*good[:3], np.array([4, 9], np.int32))
    with pytest.raises(InputError, match="^rope: unknown keys"):
        wrapper.plan(*good, rope={"theta": 1e4})
    plan = wrapper.plan(*good)
    good[2][0] = 7  # the plan keeps its own read-only copies
    assert plan.arrays["page_values"].tolist() == [0, 2, 1] and not plan.arrays["page_values"].flags.writeable
    q = np.zeros((5, 4, 64), np.float32)
    with pytest.raises(InputError, match="^pages: expected at least 3 pages"):
        wrapper.run(q, np.zeros((2, 2, 2, 8, 64), np.float32))


def test_replan_with_a_different_batch(cache):
    wrapper = RaggedPrefillWrapper(RAGGED, cache=cache)
    rng = np.random.default_rng(4)
    for entries in (ENTRIES, [(1, 1), (30, 64)], [(0, 5), (9, 9)]):
        wrapper.plan(indptr([e[0] for e in entries]), indptr([e[1] for e in entries]), rope=ROPE)
        q, k, v = _ragged_layer(rng, entries)
        _check(f"{entries}", wrapper.run(q, k, v), RAGGED, _ragged_call(entries, q, k, v))


def test_empty_batch_is_not_launched(cache):
    wrapper = RaggedPrefillWrapper(RAGGED, cache=cache)
    wrapper.plan(np.zeros(3, np.int32), indptr([4, 2]))
    layer = _ragged_layer(np.random.default_rng(5), [(0, 4), (0, 2)])
    out, lse = wrapper.run(*layer)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)
    out, lse = wrapper.run(*layer, to_host=False)
    assert isinstance(out, rt.DeviceArray) and tuple(lse.shape) == (0, 4)


# ----------------------------------------------------------------------------- device arrays, threads


def test_outputs_stay_on_device(ragged):
    wrapper, layers = ragged
    q, k, v = layers[0]
    out, lse = wrapper.run(q, k, v, to_host=False)
    assert isinstance(out, rt.DeviceArray) and isinstance(lse, rt.DeviceArray)
    host_out, host_lse = wrapper.run(q, k, v)
    assert np.array_equal(out.to_host(), host_out) and np.array_equal(lse.to_host(), host_lse)
    # Device outputs of one kernel feed the next without a round trip (here: q on the device).
    device_q = rt.asdevicearray(wrapper.kernel.device, q)
    again = wrapper.run(device_q, k, v)  # device arrays in: device arrays out
    assert isinstance(again[0], rt.DeviceArray) and np.array_equal(again[0].to_host(), host_out)
    assert np.array_equal(wrapper.run(device_q, k, v, to_host=True)[0], host_out)
    with pytest.raises(InputError, match="^q: expected shape"):
        wrapper.run(rt.asdevicearray(wrapper.kernel.device, q[:, :2]), k, v)
    with pytest.raises(InputError, match="^k: is an IREE device array on another device"):
        wrapper.run(q, rt.asdevicearray(rt.get_device("local-sync"), k), v)


def test_threads_share_one_wrapper(ragged):
    wrapper, layers = ragged
    serial = [wrapper.run(*layer) for layer in layers]

    def work(thread):
        return [(i, wrapper.run(*layers[(thread + i) % len(layers)])) for i in range(5)]

    with ThreadPoolExecutor(8) as pool:
        for thread, results in enumerate(pool.map(work, range(8))):
            for i, (out, lse) in results:
                want_out, want_lse = serial[(thread + i) % len(layers)]
                assert np.array_equal(out, want_out) and np.array_equal(lse, want_lse)


# ----------------------------------------------------------------------------- artifact sets


@pytest.fixture(scope="module")
def build_dir(cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("build")
    build_artifacts([SEQ], [Target("llvm-cpu")], out, jobs=1, cache=cache, progress=False)
    return out


def test_artifact_set_loads_the_built_kernel(build_dir):
    artifacts = open_artifacts(build_dir, aot_only=True)
    assert [s.name for s in artifacts.specs()] == [SEQ.name]
    with ThreadPoolExecutor(8) as pool:
        kernels = list(pool.map(lambda _: artifacts.kernel(SEQ), range(8)))
    assert all(k is kernels[0] for k in kernels) and kernels[0].target.tag == "llvm-cpu-host"
    rng = np.random.default_rng(6)
    q, k, v = (uniform(rng, (1, 9, h, 64), "float32") for h in (4, 2, 2))
    wrapper = SequencePrefillWrapper(SEQ, artifacts=artifacts)
    _check("aot", wrapper.run(q, k, v), SEQ, (q, k, v))
    assert wrapper.kernel is kernels[0]


def test_aot_only_missing_spec_raises(build_dir):
    artifacts = open_artifacts(build_dir, aot_only=True)
    with pytest.raises(ArtifactError, match=f"^{MASKED.name}: no llvm-cpu artifact .*linalg-prefill build"):
        artifacts.kernel(MASKED)


def test_missing_spec_compiles_without_aot_only(build_dir, cache):
    kernel = open_artifacts(build_dir, cache=cache).kernel(MASKED)
    assert kernel.spec == MASKED


def test_modified_artifact_is_rejected(build_dir, tmp_path):
    copy = tmp_path / "build"
    shutil.copytree(build_dir, copy)
    vmfb = next(copy.rglob("*.vmfb"))
    data = vmfb.read_bytes()
    vmfb.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ArtifactError, match="does not match the manifest"):
        open_artifacts(copy).kernel(SEQ)
