"""Layer (a) for the fused lowering (mlir/fused_kernels.py): the IR CUDA compiles, read without
compiling it."""

from __future__ import annotations

import math
import re

import pytest

from linalg_prefill.mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from linalg_prefill.pipeline import Target
from linalg_prefill.pipeline.tuning import tuned_ir, tuned_module
from support import structure

SPECS = [
    SequencePrefillSpec(32, 8, 128, "float16", causal=True, sm_scale=128 ** -0.5),
    MaskedSequencePrefillSpec(8, 2, 64, "bfloat16", mask_mode="causal_padded_left", sm_scale=0.125),
    RaggedPrefillSpec(8, 2, 64, 64, "float16", {"rope_type": "gptj"}),
    PagedPrefillSpec(8, 2, 128, "bfloat16", page_size=16, sliding_window=True),
    MlaPagedPrefillSpec(16, 512, 64, "float16", page_size=16),
]
MMA = {"float16": "NV_MMA_SYNC_F32_16x8x16_F16", "bfloat16": "NV_MMA_SYNC_F32_16x8x16_BF16"}


def _attention_ops(text: str) -> list[str]:
    return [line for line in text.splitlines() if "iree_linalg_ext.online_attention" in line]


def test_each_target_has_its_lowering():
    assert Target("cuda").lowering == "fused" and Target("llvm-cpu").lowering == "linalg"
    spec = SPECS[0]
    assert not _attention_ops(tuned_ir(spec, Target("llvm-cpu")))
    assert _attention_ops(tuned_ir(spec, Target("cuda")))
    assert Target("llvm-cpu", lowering="fused").tag == "llvm-cpu-host-fused"
    with pytest.raises(ValueError, match="lowering"):
        Target("cuda", lowering="tiled")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_operands_stay_in_their_dtype_and_the_kv_loop_is_inside_the_op(spec):
    """One online_attention per band size (short and long), on the input dtype, with no host
    scf.for over KV tiles: the loops left on the host walk entries and query bands only."""
    module = tuned_module(spec, Target("cuda"))
    ops = _attention_ops(str(module))
    assert len(ops) == 2
    elem = {"float16": "f16", "bfloat16": "bf16"}[spec.dtype]
    for op in ops:
        operand_types = re.search(r"ins\(.*?: (.*?)\) outs", op).group(1)
        assert operand_types.count(f"x{elem}>") == 3 and "xf32>" not in operand_types.split(", f32,")[0]
    # each op inside an entry loop and a band loop (dense: per band size; KV cache: the band loops
    # of both sizes inside one entry loop), with no loop of its own or around it over KV tiles
    tree = structure(module)
    paths = tree.paths("iree_linalg_ext.online_attention")
    assert len(paths) == 2 and all(path.count("scf.for") == 2 for path in paths), tree.outline()
    assert not any(op.inner for op in tree.find("iree_linalg_ext.online_attention")), tree.outline()
    assert len(tree.find("scf.for")) == (4 if spec.kv_layout == "dense" else 3), tree.outline()


@pytest.mark.parametrize("spec", SPECS[:4], ids=lambda s: s.name)
def test_half_precision_gets_the_tensor_core_configuration(spec):
    text = tuned_ir(spec, Target("cuda"))
    assert text.count(MMA[spec.dtype]) == 2 * len(_attention_ops(text))  # Q.K^T and P.V of each op
    assert text.count("compilation_info = #") == 2 or text.count("#iree_codegen.compilation_info") >= 1
    assert "linalg_prefill.attention" not in text  # the marker is consumed


@pytest.mark.parametrize("spec", [SequencePrefillSpec(8, 2, 64, "float32", causal=True, sm_scale=0.125),
                                  RaggedPrefillSpec(4, 4, 192, 128, "float32"),
                                  MlaPagedPrefillSpec(16, 512, 64, "float32", page_size=16)], ids=lambda s: s.name)
def test_f32_gets_the_simt_configuration_for_every_head_dim(spec):
    """IREE's own f32 choice gave wrong results for d_qk 160-576 on an H200 (pipeline/tuning.py:
    F32_SIMT): each op gets the one that was right there, a warp's 32 lanes and 8 warps laid on
    the keys (and 4 lanes on the head dim or value columns) in both steps, no tensor cores."""
    text = tuned_ir(spec, Target("cuda"))
    ops = _attention_ops(text)
    assert ops and "mma_kind" not in text
    steps = re.findall(r"lane_basis = \[\[([\d, ]+)\], \[[\d, ]+\]\], subgroup_basis = \[\[([\d, ]+)\]", text)
    assert len(steps) == 2 * len(ops), text  # Q.K^T and P.V of each op
    product = lambda counts: math.prod(int(n) for n in counts.split(","))  # noqa: E731
    assert all(product(lanes) == 32 and product(warps) == 8 for lanes, warps in steps), steps
    assert text.count("workgroup_size = [256, 1, 1] subgroup_size = 32") >= 1


def test_masks_are_generated_per_band_not_stored():
    """The mask is [h_kv, G, band, KV tiles, 64] i1 from indices: one dynamic dim, no L x L."""
    text = tuned_ir(SPECS[0], Target("cuda"))
    masks = set(re.findall(r"tensor<(\d+x\d+x\d+x\?x64xi1)>", text))
    assert masks == {"8x4x64x?x64xi1", "8x4x256x?x64xi1"}


def test_scores_are_scaled_in_f32_inside_the_op():
    """The op's scale is ln 2 (Q times exactly 1) and its region multiplies the f32 score by
    sm_scale * log2(e)."""
    text = tuned_ir(SequencePrefillSpec(8, 2, 64, "float16", causal=True, sm_scale=0.125), Target("cuda"))
    assert "0.693147182 : f32" in text
    assert f"{0.125 / 0.6931471805599453:.7f}"[:7] in text
