"""Every variant compiles for CUDA without a GPU, and its artifact has the structure a GPU needs:
the structure checks of ``BACKENDS["cuda"]`` (pipeline/targets.py), tensor cores for f16/bf16
operands and no host-blocking call inside the loops of the host program (pipeline/vm_structure.py
reads both from the vmfb); and, where the CUDA toolkit's ptxas is installed, each tiling's kernels
within their registers (spills) on an H200."""

import pytest

from linalg_prefill.pipeline import vm_structure

from linalg_prefill.mlir import (
    DecodeSpec, MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec,
    SequencePrefillSpec,
)
from linalg_prefill.pipeline import Target, compile_spec
from linalg_prefill.pipeline.targets import structure_problems
from linalg_prefill.pipeline.vm_structure import (
    disassembly, host_blocking_calls_in_loops, loop_bodies, ptx_modules, ptxas_kernels, ptxas_tool, spilling_kernels,
    tensor_core_instructions,
)
from support import LLAMA3

HALF = ("float16", "bfloat16")
#: Every variant in a tensor-core dtype, each dtype in every family (dense, masked, paged, MLA), the
#: dense d 128 band in both (the two MMA kinds of one tiling), plus the head dims the tilings differ on.
DENSE_SPECS = [
    *(SequencePrefillSpec(32, 8, 128, dtype, causal=True, sm_scale=128 ** -0.5) for dtype in HALF),
    MaskedSequencePrefillSpec(8, 2, 64, "float16", mask_mode="padded", sm_scale=0.125),
    MaskedSequencePrefillSpec(8, 2, 128, "bfloat16", mask_mode="causal_padded_left", sm_scale=0.1),
    SequencePrefillSpec(4, 4, 64, "float16", causal=False, sm_scale=0.125),
    SequencePrefillSpec(8, 2, 256, "bfloat16", causal=True, sm_scale=0.0625),
    SequencePrefillSpec(32, 32, 80, "float16", causal=True, sm_scale=80 ** -0.5),
    SequencePrefillSpec(8, 4, 256, "bfloat16", causal=True, sm_scale=256 ** -0.5, logits_soft_cap=50.0),
    MaskedSequencePrefillSpec(8, 2, 64, "float16", mask_mode="custom", sm_scale=0.125),
]
KV_CACHE_SPECS = [
    RaggedPrefillSpec(32, 8, 128, 128, "float16", LLAMA3),
    RaggedPrefillSpec(16, 16, 192, 128, "bfloat16"),
    # Phi-3.5 and Phi-4-mini's forms: d 96, partial rotary, a LongRoPE table (semantics §11.14)
    RaggedPrefillSpec(32, 32, 96, 96, "float16", rotary_dim=32, rope_scaling={
        "rope_type": "longrope", "original_max_position_embeddings": 4096, "max_position_embeddings": 131072,
        "ext_factors": [1.0 + i * i / 8 for i in range(16)]}),
    PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16),
    PagedPrefillSpec(32, 8, 128, "float16", page_size=16, sliding_window=True, rope_scaling={"rope_type": "gptj"}),
    # gpt-oss: per-head sinks over a sliding window (semantics §13)
    PagedPrefillSpec(64, 8, 64, "bfloat16", page_size=16, sliding_window=True, head_sinks=True),
    # custom masks (semantics §14): the mask operand reads custom_mask inside the band's dispatch
    RaggedPrefillSpec(32, 8, 128, 128, "float16", custom_mask=True),
    PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16, sliding_window=True, custom_mask=True),
]
MLA_SPECS = [
    MlaPagedPrefillSpec(16, 512, 64, "float16", page_size=16),
    MlaPagedPrefillSpec(16, 512, 64, "bfloat16", page_size=64, sliding_window=True),
]
#: The serving passes (runtime/decode.py) of every KV-cache variant, 1, 4 and 16 queries per entry.
DECODE_SPECS = [
    DecodeSpec(PagedPrefillSpec(32, 8, 128, "float16", page_size=16), 1),
    DecodeSpec(PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16, sliding_window=True), 4),
    DecodeSpec(RaggedPrefillSpec(16, 16, 192, 128, "bfloat16"), 16),
    DecodeSpec(MlaPagedPrefillSpec(128, 512, 64, "bfloat16", page_size=64, sliding_window=True), 4),
    DecodeSpec(PagedPrefillSpec(64, 8, 64, "bfloat16", page_size=16, sliding_window=True, head_sinks=True), 16),
]
F32_SPECS = [
    SequencePrefillSpec(6, 1, 64, "float32", causal=False, sm_scale=0.125),
    PagedPrefillSpec(8, 1, 64, "float32", page_size=1, rope_scaling={"rope_type": "gptj"}),
]
#: 8-bit KV caches (semantics §15): read as bytes, widened as gathered; the attention's operands
#: in the compute dtype (tensor cores).
FP8_SPECS = [
    PagedPrefillSpec(32, 8, 128, "float16", page_size=16, kv_dtype="float8_e4m3fn"),
    MlaPagedPrefillSpec(16, 512, 64, "bfloat16", page_size=64, kv_dtype="float8_e4m3fn"),
    DecodeSpec(PagedPrefillSpec(32, 8, 128, "bfloat16", page_size=16, kv_dtype="float8_e5m2"), 4),
]
ALL_SPECS = DENSE_SPECS + KV_CACHE_SPECS + MLA_SPECS + DECODE_SPECS + F32_SPECS + FP8_SPECS
#: The spec parameters compile for sm_80, before the tests run (tests/conftest.py).
pytestmark = pytest.mark.compiles(backends=[Target("cuda", "sm_80")])


def _artifact(spec, cache, tmp_path, lowering=""):
    vmfb = compile_spec(spec, Target("cuda", "sm_80", lowering=lowering), cache=cache)
    path = tmp_path / "kernel.vmfb"
    path.write_bytes(vmfb)
    return vmfb, path


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_compiles_for_cuda_sm80_with_the_structure_a_gpu_needs(spec, cache, tmp_path):
    """The structure checks: tensor cores for f16/bf16 operands; no queue.alloca, queue.dealloca
    or fence.await inside a loop of the host program (the KV loop is inside each band's dispatch,
    bands are written in place, and the KV-cache kernels read their index arrays from host
    memory: mlir/ir.py: HostReadable)."""
    vmfb, path = _artifact(spec, cache, tmp_path)
    assert vmfb[:2] == b"PK"  # a vmfb is a zip-framed flatbuffer
    assert spec.symbol.encode() in vmfb and b"cuda" in vmfb
    assert structure_problems(spec, Target("cuda"), path) == []


@pytest.mark.parametrize("spec", DECODE_SPECS, ids=lambda s: s.name)
def test_a_serving_pass_has_no_loop_in_its_host_program(spec, cache, tmp_path):
    """A fixed sequence of dispatches per call, whatever the number of entries."""
    _, path = _artifact(spec, cache, tmp_path)
    text = disassembly(path)
    assert loop_bodies(text, function=spec.symbol) == []
    assert loop_bodies(text), "the module initializer's loop: the check reads loops"


#: One artifact per tiling of pipeline/tuning.py and per family (ptxas takes 0.4-1.2 s an
#: artifact): 64 rows promoted (d 128 dense, paged, 8-bit paged; d 256), 64 rows unstaged (d 80,
#: 192/128), MLA's 16 rows, a serving pass.
D80 = DENSE_SPECS[6]
PTXAS_SPECS = [DENSE_SPECS[0], D80, DENSE_SPECS[5], KV_CACHE_SPECS[3], KV_CACHE_SPECS[1], MLA_SPECS[0],
               DECODE_SPECS[0], FP8_SPECS[0]]
needs_ptxas = pytest.mark.skipif(ptxas_tool() is None, reason="no ptxas (CUDA toolkit)")


@needs_ptxas
@pytest.mark.parametrize("spec", PTXAS_SPECS, ids=lambda s: s.name)
def test_each_kernel_fits_its_registers_on_an_h200(spec, cache, tmp_path):
    """ptxas for sm_90 (an H200 compiles the sm_80 PTX so) spills at most
    vm_structure.spill_limit bytes a thread in any kernel, the attention dispatches included."""
    vmfb, path = _artifact(spec, cache, tmp_path)
    kernels = ptxas_kernels(ptx_modules(vmfb))
    assert any("online_attention" in kernel.name for kernel in kernels)
    assert all(0 < kernel.registers <= 255 for kernel in kernels)
    assert spilling_kernels(spec, path) is None


@needs_ptxas
def test_the_register_check_sees_a_spill(cache, tmp_path, monkeypatch):
    """d 80's 64-row band spills 48 bytes a thread (within its limit of 64): with no spill
    allowed the check names it."""
    spec = D80
    _, path = _artifact(spec, cache, tmp_path)
    monkeypatch.setattr(vm_structure, "spill_limit", lambda spec: 0)
    problem = spilling_kernels(spec, path)
    assert problem is not None and "online_attention" in problem and "more than 0 bytes" in problem


STALLING = SequencePrefillSpec(8, 2, 64, "float16", causal=True, sm_scale=0.125)


@pytest.mark.compiles(STALLING, backends=[Target("cuda", "sm_80", lowering="linalg")])
def test_the_check_sees_the_linalg_lowerings_stalls(cache, tmp_path):
    """The CPU lowering compiled for CUDA allocates and waits inside its KV-step loop: the
    structure checks above would fail on it."""
    spec = STALLING
    vmfb, path = _artifact(spec, cache, tmp_path, lowering="linalg")
    assert host_blocking_calls_in_loops(path, innermost=True)["hal.device.queue.alloca"] > 0
    assert host_blocking_calls_in_loops(path)["hal.fence.await"] > 0
    assert tensor_core_instructions(vmfb) == 0
    tensor_cores, stalls = structure_problems(spec, Target("cuda"), path)
    assert "no mma.sync in the PTX" in tensor_cores and "host-blocking calls inside host-program loops" in stalls
