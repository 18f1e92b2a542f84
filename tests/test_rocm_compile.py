"""Every variant compiles for ROCm (gfx942) without an AMD GPU, and its artifact has the structure
a GPU needs: the structure checks of ``BACKENDS["rocm"]`` (pipeline/targets.py), ``v_mfma`` in the
ISA of f16/bf16 kernels and no host-blocking call inside the loops of the host program
(pipeline/vm_structure.py). Each variant in f16 or bf16 (both for the dense, ragged and paged
kernels), a serving pass, an 8-bit cache, one f32: the other head dims and options change the
tiling only where ``rocm_attention_tiling`` says (d 256 here). (The masked padded f16, MLA f16 and
the MLA 4-query pass were dropped for the suite's time: their CUDA artifacts and CPU numerics
stay, docs/test-suite.md.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from linalg_prefill.cli import main
from linalg_prefill.mlir import (
    DecodeSpec, MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec,
    SequencePrefillSpec,
)
from linalg_prefill.pipeline import Target
from linalg_prefill.pipeline.compiler import compile_ir
from linalg_prefill.pipeline.targets import structure_problems
from linalg_prefill.pipeline.tuning import tuned_ir
from linalg_prefill.pipeline.vm_structure import amdgpu_isa, amdgpu_kernels, isa_dump_flag, isa_folder

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
HALF_SPECS = [
    SequencePrefillSpec(32, 8, 128, "float16", causal=True, sm_scale=128 ** -0.5),
    SequencePrefillSpec(8, 2, 256, "bfloat16", causal=True, sm_scale=0.0625, logits_soft_cap=50.0),  # 32 keys a step
    MaskedSequencePrefillSpec(8, 2, 128, "bfloat16", mask_mode="causal_padded_left", sm_scale=0.1),
    RaggedPrefillSpec(32, 8, 128, 128, "float16", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    RaggedPrefillSpec(16, 16, 192, 128, "bfloat16"),
    PagedPrefillSpec(32, 8, 80, "float16", page_size=16),
    PagedPrefillSpec(64, 8, 64, "bfloat16", page_size=16, sliding_window=True, head_sinks=True),
    MlaPagedPrefillSpec(16, 512, 64, "bfloat16", page_size=64, sliding_window=True),
    DecodeSpec(PagedPrefillSpec(32, 8, 128, "float16", page_size=16), 1),
    # an 8-bit KV cache (semantics §15): widened in the gather, the attention's operands f16
    PagedPrefillSpec(32, 8, 128, "float16", page_size=16, kv_dtype="float8_e4m3fn"),
]
F32_SPEC = PagedPrefillSpec(8, 1, 64, "float32", page_size=1, rope_scaling={"rope_type": "gptj"})


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """The vmfb of a spec for a target, its ISA beside it (vm_structure.isa_folder), compiled once
    for the module (the ISA is written by iree-compile, so the artifact cache cannot serve it)."""
    built = {}

    def artifact(spec, target=Target("rocm")) -> Path:
        if (spec, target) not in built:
            path = tmp_path_factory.mktemp("rocm") / "kernel.vmfb"
            with_isa = Target(target.backend, target.arch, (isa_dump_flag(path),))
            path.write_bytes(compile_ir(tuned_ir(spec, target), with_isa, spec.name))
            built[spec, target] = path
        return built[spec, target]

    return artifact


@pytest.mark.parametrize("spec", [*HALF_SPECS, F32_SPEC], ids=lambda s: s.name)
def test_compiles_for_gfx942_with_the_structure_a_gpu_needs(spec, artifacts):
    """MFMA in every f16/bf16 attention dispatch (IREE's own configuration has none for d 80,
    192/128 or MLA), no register spills, and no host-blocking call in a loop of the host program.
    (IREE picks MFMA for f32 operands too, MFMA_F32_16x16x4_F32: not required.)"""
    path = artifacts(spec)
    vmfb = path.read_bytes()
    assert vmfb[:2] == b"PK" and spec.symbol.encode() in vmfb and b"rocm" in vmfb
    assert structure_problems(spec, Target("rocm"), path) == []
    attention = [kernel for kernel in amdgpu_kernels(amdgpu_isa(path)) if "attention" in kernel.name]
    assert attention, "the fused lowering's online_attention dispatches"
    assert all(kernel.vgpr_spills == kernel.sgpr_spills == 0 for kernel in attention), attention
    if spec.dtype != "float32":
        assert all(kernel.mfma > 0 for kernel in attention), attention


def test_the_mfma_check_fails_without_matrix_cores_or_without_the_isa(artifacts, tmp_path):
    """The same ISA without its v_mfma lines fails the check for 16-bit operands (f32 ones may
    use the scalar units); an artifact without its ISA beside it fails, naming the flag."""
    path = tmp_path / "kernel.vmfb"
    shutil.copy(artifacts(F32_SPEC), path)
    shutil.copytree(isa_folder(artifacts(F32_SPEC)), isa_folder(path))
    assert sum(kernel.mfma for kernel in amdgpu_kernels(amdgpu_isa(path))) > 0  # IREE's f32 MFMA
    as_half = PagedPrefillSpec(8, 1, 64, "float16", page_size=1, rope_scaling={"rope_type": "gptj"})
    assert structure_problems(as_half, Target("rocm"), path) == []
    for isa in isa_folder(path).glob("*.rocmasm"):
        isa.write_text("\n".join(line for line in isa.read_text().splitlines() if "v_mfma" not in line))
    assert structure_problems(F32_SPEC, Target("rocm"), path) == []
    (problem,) = structure_problems(as_half, Target("rocm"), path)
    assert "no v_mfma in the ISA" in problem
    elsewhere = tmp_path / "elsewhere.vmfb"
    elsewhere.write_bytes(path.read_bytes())
    (problem,) = structure_problems(as_half, Target("rocm"), elsewhere)
    assert "--iree-hal-dump-executable-intermediates-to=" in problem


@pytest.mark.parametrize("arch, spec", [("gfx950", HALF_SPECS[2]), ("gfx90a", HALF_SPECS[4])],
                         ids=["gfx950-iree-configuration", "gfx90a-bf16-configuration"])
def test_the_other_cdna_archs_compile_with_mfma(arch, spec, artifacts):
    """IREE's own configuration (d 128) on gfx950, ours (d 192/128) on gfx90a, whose bf16
    instruction differs (MFMA_F32_16x16x16_BF16 is v_mfma_f32_16x16x16bf16_1k there)."""
    path = artifacts(spec, Target("rocm", arch))
    assert f"--iree-rocm-target={arch}" in Target("rocm", arch).flags()
    assert structure_problems(spec, Target("rocm", arch), path) == []


def test_an_unknown_rocm_arch_names_the_accepted_ones(capsys, tmp_path):
    with pytest.raises(ValueError, match=r"^rocm arch 'gfx1100': known archs are gfx942, gfx950, gfx90a$"):
        Target("rocm", "gfx1100")
    assert main(["build", "--model", str(CONFIGS / "tiny.toml"), "--out", str(tmp_path), "--rocm-arch", "gfx908"]) == 2
    assert "known archs are gfx942, gfx950, gfx90a" in capsys.readouterr().err


def test_cli_builds_lists_and_checks_rocm_artifacts(tmp_path, monkeypatch, capsys, cache):
    """build --backends rocm (the paged kernel) writes rocm-gfx942/ with the arch in the manifest;
    list verifies it; check reports that rocm did not run here (no HIP device); show-config says
    why."""
    monkeypatch.setenv("LINALG_PREFILL_CACHE_DIR", str(cache.root))
    monkeypatch.delenv("LINALG_PREFILL_CACHE", raising=False)
    from linalg_prefill.runtime import devices

    monkeypatch.setattr(devices, "device_problem", lambda driver: None if driver.startswith("local-") else
                        "HIP runtime library 'libamdhip64.so' not available")
    out = tmp_path / "tiny"
    argv = ["build", "--model", str(CONFIGS / "tiny.toml"), "--dtype", "float16", "--backends", "rocm",
            "--arch", "rocm=gfx942", "--variants", "batch_prefill_paged_kv", "--out", str(out)]
    assert main(argv) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert {(entry["target"], entry["arch"]) for entry in manifest["artifacts"]} == {("rocm-gfx942", "gfx942")}
    assert all(entry["file"].startswith("rocm-gfx942/") for entry in manifest["artifacts"])
    assert main(["list", str(out)]) == 0
    capsys.readouterr()
    assert main(["check", str(out), "--backends", "rocm", "--strict"]) == 1
    assert "nothing ran" in capsys.readouterr().out
    assert main(["show-config"]) == 0
    shown = capsys.readouterr().out
    assert "backend rocm      driver hip, lowering fused, arch gfx942 (archs: gfx942, gfx950, gfx90a)" in shown
    assert "device hip        not usable: HIP runtime library" in shown
