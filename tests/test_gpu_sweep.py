"""The CUDA sweep (bench/gpu_sweep.py), offline: each candidate builds the IR it names, the record
and the band size come back after it, and the folder holds a timed and a checked case per
candidate and dtype, each naming its own artifact (run on the GPU machine by bench/gpu_runner.py,
which tests/test_gpu_bundle.py runs for the CPU)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FUSED_CPU
from linalg_prefill.mlir import (
    DecodeSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec, cuda_attention, cuda_decode, fused_kernels,
)
from linalg_prefill.pipeline import Target, compiler, targets
from linalg_prefill.pipeline.vm_structure import tensor_core_instructions

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_sweep  # noqa: E402

SPEC = SequencePrefillSpec(32, 8, 128, "float16", causal=True, sm_scale=128 ** -0.5)
CANDIDATES = {c.label: c for c in gpu_sweep.CANDIDATES}


def _settings(text: str) -> tuple:
    """((keys a step, query rows a workgroup) of every online_attention op in ``text``: the
    largest entries of its reduction and workgroup tiles), (threads a workgroup, ...)."""
    tiles = re.findall(r"reduction = (\[[^\]]*\]), workgroup = (\[[^\]]*\])", text)
    return (tuple((max(json.loads(r)), max(json.loads(w))) for r, w in tiles),
            tuple(re.findall(r"workgroup_size = \[(\d+), 1, 1\]", text)))


def test_each_candidate_builds_the_configuration_it_names():
    """default is the committed record's IR; a candidate's rows, keys and warps reach every
    attention op; a longer band changes the host loop, not the ops' tiles; the record and the band
    size are the committed ones again afterwards, also after an error inside the context."""
    target = Target("cuda")
    record, band_tiles = targets.BACKENDS["cuda"], fused_kernels.BAND_TILES
    committed = compiler.keyed_ir(SPEC, target)
    assert gpu_sweep.candidate_ir(SPEC, CANDIDATES["default"], target) == committed
    tiles, sizes = _settings(committed)
    assert tiles and set(tiles) == {(64, 64)} and set(sizes) == {"128"}
    assert _settings(gpu_sweep.candidate_ir(SPEC, CANDIDATES["r16-w1"], target)) == (((64, 16),) * len(tiles),
                                                                                       ("32",) * len(sizes))
    keys = _settings(gpu_sweep.candidate_ir(SPEC, CANDIDATES["r64-w4-k32"], target))
    assert keys == (((32, 64),) * len(tiles), sizes)
    band = gpu_sweep.candidate_ir(SPEC, CANDIDATES["r64-w4-band16"], target)
    assert band != committed and _settings(band) == _settings(committed)
    with pytest.raises(RuntimeError):
        with gpu_sweep.configured(CANDIDATES["r16-w1"]):
            raise RuntimeError
    assert targets.BACKENDS["cuda"] is record and fused_kernels.BAND_TILES == band_tiles
    assert compiler.keyed_ir(SPEC, target) == committed


def test_an_mma_candidate_builds_the_hand_written_dispatch_in_its_tiling():
    """The mma candidates build mlir/cuda_attention.py's dispatch (no online_attention op) with
    their warps; the committed tiling is back afterwards."""
    target = Target("cuda")
    committed = cuda_attention.MMA_TILING
    text = gpu_sweep.candidate_ir(SPEC, CANDIDATES["mma-w8-k32"], target)
    assert "online_attention" not in text and "nvvm.ldmatrix" in text
    assert re.findall(r"workgroup_size = \[(\d+), 1, 1\]", text) == ["256"]
    assert gpu_sweep.candidate_ir(SPEC, CANDIDATES["mma-w4-k64"], target) == \
        compiler.keyed_ir(SPEC, Target("cuda", lowering="mma"))
    ragged = RaggedPrefillSpec(32, 8, 128, 128, "float16")   # a mixed-batch kernel takes the tiling too
    assert re.findall(r"workgroup_size = \[(\d+), 1, 1\]", gpu_sweep.candidate_ir(
        ragged, CANDIDATES["mma-w8-k64"], target)) == ["256"]
    assert cuda_attention.MMA_TILING is committed


def test_an_mma_pass_candidate_builds_the_chunked_pass():
    """The mma pass candidates build mlir/cuda_decode.py's pass with their chunk size; the
    committed one is back afterwards."""
    target = Target("cuda")
    pass_spec = DecodeSpec(PagedPrefillSpec(32, 8, 128, "float16", page_size=16), 4)
    passes = {c.label: c for c in gpu_sweep.PASS_CANDIDATES}
    committed = cuda_decode.CHUNK_TILES
    text = gpu_sweep.candidate_ir(pass_spec, passes["mma-c8"], target)
    assert "@cuda_serving_pass" in text and "online_attention" not in text
    assert text != gpu_sweep.candidate_ir(pass_spec, passes["mma-c2"], target)
    assert cuda_decode.CHUNK_TILES == committed


def test_a_pass_candidate_reaches_the_serving_pass():
    """The serving passes' candidates set their attention op's warps and keys a step (16 query
    rows a workgroup, the passes' tiles); default keeps the record's."""
    target = Target("cuda")
    pass_spec = DecodeSpec(PagedPrefillSpec(32, 8, 128, "float16", page_size=16), 4)
    passes = {c.label: c for c in gpu_sweep.PASS_CANDIDATES}
    committed = compiler.keyed_ir(pass_spec, target)
    assert gpu_sweep.candidate_ir(pass_spec, passes["default"], target) == committed
    tiles, sizes = _settings(committed)
    assert tiles and {rows for _, rows in tiles} == {16} and set(sizes) == {"128"}
    assert _settings(gpu_sweep.candidate_ir(pass_spec, passes["p16-w8-split"], target))[1] == ("256",) * len(sizes)
    assert _settings(gpu_sweep.candidate_ir(pass_spec, passes["p16-w4-split-k32"], target)) == (
        tuple((32, rows) for _, rows in tiles), sizes)


def test_the_sweep_folder_holds_each_candidates_cases(tmp_path):
    """A candidate compiled for sm_80 at one length: a timed dense case (its inputs drawn by the
    runner) and a checked one (stored inputs, the reference call), both on the candidate's own
    artifact, which has tensor-core instructions; sweep.json lists what was built."""
    labels = ["r16-w1"]
    report = gpu_sweep.build(str(tmp_path), [256], ["float16"], [CANDIDATES[label] for label in labels],
                             Target("cuda"))
    assert list(report["candidates"]) == labels and not report["failed"]
    assert report["candidates"]["r16-w1"]["lowering"] == "fused"
    assert json.loads((tmp_path / "sweep.json").read_text()) == report
    artifacts = sorted(p.name for p in (tmp_path / "artifacts").iterdir())
    assert artifacts == sorted(f"{SPEC.name}-{label}.vmfb" for label in labels)
    for artifact in artifacts:
        assert tensor_core_instructions((tmp_path / "artifacts" / artifact).read_bytes()) > 0
    for label in labels:
        timed = json.loads(str(np.load(tmp_path / "cases" / f"bench-sweep-dense-causal-L256-float16-{label}.npz")["meta"]))
        checked = json.loads(str(np.load(tmp_path / "cases" / f"sweep-check-float16-{label}.npz")["meta"]))
        assert timed["file"] == checked["file"] == f"artifacts/{SPEC.name}-{label}.vmfb"
        assert timed["flops"] > 0 and [a[0] for a in timed["args"]] == ["random"] * 3
        assert "reference" in checked and "reference" not in timed
        assert (timed["sweep_case"], timed["candidate"]) == ("bench-sweep-dense-causal-L256-float16", label)
    assert (tmp_path / "gpu_runner.py").exists() and (tmp_path / "reference" / "error_model.py").exists()


def test_grouped_bands_match_the_reference(monkeypatch, cache):
    """Several bands a step of the dense band loop (fused_kernels.BAND_GROUP, a sweep candidate):
    the fused lowering compiled for llvm-cpu (the IR CUDA gets) with bands of 64 rows, 2 a step,
    matches the reference at lengths whose last step has one band (3 bands), both (4), and one
    short call; causal, GQA, sinks, peaked scores (q scaled by 4). The default (1) builds the
    committed IR."""
    spec = SequencePrefillSpec(4, 2, 32, "float16", causal=True, sm_scale=0.2, head_sinks=True)
    from linalg_prefill.runtime import open_kernel
    from linalg_prefill.runtime.examples import example_inputs
    from support import assert_matches_reference

    fused = FUSED_CPU
    committed = compiler.keyed_ir(spec, fused)
    monkeypatch.setattr(fused_kernels, "BAND_TILES", 1)
    monkeypatch.setattr(fused_kernels, "BAND_GROUP", 2)
    compiler.keyed_ir.cache_clear()
    assert compiler.keyed_ir(spec, fused) != committed
    kernel = open_kernel(spec, fused, cache=cache)
    rng = np.random.default_rng(7)
    for length in (150, 256, 40):
        args = list(example_inputs(spec, rng, [(length, length)]))
        args[0] = (args[0].astype(np.float32) * 4).astype(args[0].dtype)   # peaked scores
        assert_matches_reference(f"{spec.name} L={length}", kernel(*args), spec, args)
    monkeypatch.undo()
    compiler.keyed_ir.cache_clear()
    assert compiler.keyed_ir(spec, fused) == committed


def test_the_runner_ranks_each_sweep_case_fastest_first():
    """The GPU runner's summary of a sweep: one line a case, its candidates fastest first with
    their ratio to torch (torch time / ours) where torch ran."""
    import gpu_runner

    rows = [("bench-sweep-a", "default", 2e-3, 1e-3), ("bench-sweep-a", "r16-w1", 1e-3, 1e-3),
            ("bench-sweep-b", "default", 5e-3, None)]
    assert gpu_runner.sweep_summary(rows) == [
        "sweep bench-sweep-a: r16-w1 1.00 ms (1.00x), default 2.00 ms (0.50x)",
        "sweep bench-sweep-b: default 5.00 ms"]
    assert gpu_runner.sweep_summary([]) == []
