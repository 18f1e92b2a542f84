"""Layer (a): the built IR, without compiling anything."""

import pytest
from iree.compiler import ir

from linalg_prefill.mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
    build_module,
)
from support import structure


def _ir(spec) -> str:
    return str(build_module(spec))


def test_sequence_module_has_seed_symbol_and_dynamic_signature():
    text = _ir(SequencePrefillSpec(8, 2, 64, "float16", causal=True, sm_scale=0.125))
    assert "func.func @batch_sequence_prefill_kv(" in text
    assert "tensor<?x?x8x64xf16>, %arg1: tensor<?x?x2x64xf16>, %arg2: tensor<?x?x2x64xf16>" in text
    assert "-> (tensor<?x?x8x64xf16>, tensor<?x?x8xf32>)" in text


def test_masked_module_takes_valid_lens():
    text = _ir(MaskedSequencePrefillSpec(4, 4, 64, "bfloat16", mask_mode="padded", sm_scale=0.125))
    assert "func.func @batch_sequence_prefill_kv_masked(" in text
    assert "%arg3: tensor<?xi32>" in text


def _kv_loops(tree) -> list:
    """The KV tile loops of the linalg lowering (the loops around the online softmax's exp2) in
    ``tree`` (support.structure), after checking that each sits in a query-tile loop inside the
    entry loop and holds no loop."""
    kv_loops = tree.holding("math.exp2")
    assert kv_loops, tree.outline()
    for path in tree.paths("math.exp2"):
        if path[-1] == "scf.for":  # (the others are RoPE's, in branches)
            assert path.count("scf.for") == 3, f"exp2 at {path}:\n{tree.outline()}"
    assert not any(loop.find("scf.for") for loop in kv_loops), tree.outline()
    return kv_loops


def test_online_softmax_is_an_scf_loop_of_linalg_ops_in_log2_domain():
    module = build_module(SequencePrefillSpec(4, 4, 64, "float32", causal=False, sm_scale=0.125, kv_tile=32))
    text = str(module)
    # per tile size (16-token tiles for calls of at most 16 queries, SMALL_Q_TILE, and spec.q_tile
    # ones otherwise): batch entries > query tiles > two KV loops (the tiles the mask holds on
    # everywhere, without it; then the rest)
    tree = structure(module)
    kv_loops = _kv_loops(tree)
    kv_loops_per_loop = [sum(inner in kv_loops for inner in loop.inner) for loop in tree.find("scf.for")]
    assert [count for count in kv_loops_per_loop if count] == [2, 2], tree.outline()
    assert "math.exp2" in text and "math.log2" in text
    assert "math.exp " not in text
    assert "iree_linalg_ext" not in text
    # score tiles are [1, h_kv, q_tile * G, kv_tile], static: never Lq x Lk
    assert "tensor<1x4x64x32xf32>" in text


def test_row_reductions_are_chunked_for_cuda_and_whole_for_llvm_cpu():
    """The linalg lowering on each target (CUDA compiles it only when asked: its own lowering
    is the fused one, tests/test_fused_ir.py)."""
    from linalg_prefill.pipeline import Target
    from linalg_prefill.pipeline.tuning import tuned_ir

    spec = SequencePrefillSpec(8, 2, 64, "float32", causal=True, sm_scale=0.125, q_tile=32, kv_tile=256)
    chunked = "tensor<1x2x128x2x128xf32>"  # [1, h_kv, q_tile * G rows, 2 chunks, 128 columns]
    assert chunked in tuned_ir(spec, Target("cuda", lowering="linalg"))
    assert chunked not in _ir(spec)  # the IR layer makes no target's choice: whole rows by default
    cpu = tuned_ir(spec, Target("llvm-cpu", "znver3"))  # AVX2: the row tiles (pipeline/cpu_tiles.py)
    assert chunked not in cpu and "tensor<1x2x128x256xf32>" in cpu


def test_score_tile_folds_gqa_group_into_rows():
    text = _ir(SequencePrefillSpec(8, 2, 64, "float32", causal=True, sm_scale=1.0, q_tile=16, kv_tile=32))
    assert "tensor<1x2x64x32xf32>" in text  # 16 tokens x G=4 rows, one KV head axis of 2


def test_causal_adds_a_diagonal_predicate_and_tile_bound():
    causal = _ir(SequencePrefillSpec(4, 4, 64, "float32", causal=True, sm_scale=1.0))
    plain = _ir(SequencePrefillSpec(4, 4, 64, "float32", causal=False, sm_scale=1.0))
    assert causal.count("arith.cmpi sle") > plain.count("arith.cmpi sle")
    assert causal.count("arith.minsi") > plain.count("arith.minsi")  # the causal KV tile bound


def test_spec_name_spells_every_field_and_differs_per_field():
    base = SequencePrefillSpec(8, 2, 64, "float32", causal=True, sm_scale=0.125)
    name = base.name
    assert name.startswith("batch_sequence_prefill_kv_hq8_hkv2_d64_float32_causal1_sm0p125")
    variants = [
        SequencePrefillSpec(8, 2, 64, "float16", causal=True, sm_scale=0.125),
        SequencePrefillSpec(8, 2, 64, "float32", causal=False, sm_scale=0.125),
        SequencePrefillSpec(8, 2, 64, "float32", causal=True, sm_scale=0.25),
        SequencePrefillSpec(8, 2, 64, "float32", causal=True, sm_scale=0.125, kv_tile=64),
    ]
    assert len({name, *(v.name for v in variants)}) == 5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(h_q=6, h_kv=4), "multiple of h_kv"),
        (dict(dtype="float64"), "dtype"),
        (dict(kv_tile=0), "kv_tile"),
        (dict(d=0), "d must be a positive int"),
        (dict(h_q=8.0), "h_q must be a positive int"),
        (dict(sm_scale=float("nan")), "sm_scale"),
        (dict(sm_scale=0.0), "sm_scale"),
        (dict(causal="yes"), "causal must be a bool"),
        (dict(q_tile=True), "q_tile"),
        (dict(logits_soft_cap=-1.0), "logits_soft_cap"),
    ],
)
def test_spec_rejects_bad_fields(kwargs, message):
    fields = dict(h_q=8, h_kv=2, d=64, dtype="float32", causal=False, sm_scale=1.0) | kwargs
    with pytest.raises(ValueError, match=message):
        SequencePrefillSpec(**fields)


def test_kv_cache_specs_reject_bad_fields():
    from linalg_prefill.mlir import MlaPagedPrefillSpec, PagedPrefillSpec, SpecError

    with pytest.raises(SpecError, match="sliding_window must be a bool"):
        PagedPrefillSpec(8, 2, 64, "float32", sliding_window="yes")
    with pytest.raises(SpecError, match="page_size"):
        MlaPagedPrefillSpec(16, 512, 64, "float32", page_size=0)
    with pytest.raises(SpecError, match="d_rope"):
        MlaPagedPrefillSpec(16, 512, -1, "float32")


def test_masked_spec_rejects_unknown_mask_mode():
    with pytest.raises(ValueError, match="mask_mode"):
        MaskedSequencePrefillSpec(4, 4, 64, "float32", mask_mode="causal", sm_scale=1.0)


def test_kv_cache_modules_keep_the_seed_abi():
    """Argument order and types of the seed (§1.1-§1.3); the rope arguments differ in order
    between paged and ragged (§9.5) and both keep it."""
    ragged = _ir(RaggedPrefillSpec(8, 2, 192, 128, "float16"))
    assert ("func.func @batch_prefill_ragged_kv(%arg0: tensor<?x8x192xf16>, %arg1: tensor<?xi32>, "
            "%arg2: tensor<?x2x192xf16>, %arg3: tensor<?x2x128xf16>, %arg4: tensor<?xi32>, %arg5: tensor<?xi32>, "
            "%arg6: tensor<?xi32>, %arg7: i32, %arg8: i32, %arg9: f32, %arg10: f32, %arg11: f32) "
            "-> (tensor<?x8x128xf16>, tensor<?x8xf32>)") in ragged
    paged = _ir(PagedPrefillSpec(8, 2, 64, "bfloat16", page_size=16, sliding_window=True))
    assert ("func.func @batch_prefill_paged_kv_sliding_window(%arg0: tensor<?x8x64xbf16>, %arg1: tensor<?xi32>, "
            "%arg2: tensor<?x2x2x16x64xbf16>, %arg3: tensor<?xi32>, %arg4: tensor<?xi32>, %arg5: tensor<3x?xi32>, "
            "%arg6: tensor<?xi32>, %arg7: tensor<?xi32>, %arg8: i32, %arg9: i32, %arg10: f32, %arg11: f32, %arg12: f32)"
            ) in paged
    mla = _ir(MlaPagedPrefillSpec(16, 512, 64, "float16", page_size=16))
    assert ("func.func @batch_prefill_paged_kv_mla(%arg0: tensor<?x16x576xf16>, %arg1: tensor<?xi32>, "
            "%arg2: tensor<?x16x576xf16>, %arg3: tensor<?xi32>, %arg4: tensor<?xi32>, %arg5: tensor<?xi32>, "
            "%arg6: i32, %arg7: f32) -> (tensor<?x16x512xf16>, tensor<?x16xf32>)") in mla


def test_kv_cache_variants_share_the_one_emitter():
    """Entries, their query tiles, then the emitter's two KV loops (tiles the mask holds on
    everywhere, then the rest); scores are static [1, h_kv, rows, N] tiles (G folded into rows)
    and MLA folds all h_q heads onto its single latent head."""
    ragged_module = build_module(RaggedPrefillSpec(8, 2, 64, 64, "float32", q_tile=16, kv_tile=32))
    mla_module = build_module(MlaPagedPrefillSpec(16, 512, 64, "float32", q_tile=16, kv_tile=32))
    assert len(_kv_loops(structure(ragged_module))) == len(_kv_loops(structure(mla_module))) == 2
    ragged, mla = str(ragged_module), str(mla_module)
    assert "tensor<1x2x64x32xf32>" in ragged
    assert "tensor<1x1x256x32xf32>" in mla
    assert "math.cos" not in mla  # MLA applies no RoPE (§1.3)
    assert "math.cos" in ragged and "scf.if" in ragged  # inline RoPE under rotary_mode == 1


LOOP_SPECS = [
    SequencePrefillSpec(8, 2, 64, "float32", causal=True, sm_scale=0.125),
    MaskedSequencePrefillSpec(8, 2, 64, "bfloat16", "padded", 0.125),
    RaggedPrefillSpec(8, 2, 64, 32, "float32"),
    PagedPrefillSpec(8, 2, 64, "float16", page_size=16, sliding_window=True),
    MlaPagedPrefillSpec(4, 64, 16, "float32", page_size=16),
]


@pytest.mark.parametrize("spec", LOOP_SPECS, ids=lambda s: s.symbol)
def test_every_loop_starts_on_the_target_device(spec):
    """Each scf.for's carried tensors enter the loop through flow.tensor.transfer (or are the
    enclosing loop's own carried values): see mlir/ir.py on_target_device."""
    module = build_module(spec)
    loops = []

    def visit(op):
        if op.operation.name == "scf.for":
            loops.append(op.operation)
        for region in op.operation.regions:
            for block in region.blocks:
                for inner in block.operations:
                    visit(inner)

    visit(module.operation)
    assert loops
    for loop in loops:
        for init in list(loop.operands)[3:]:
            if not str(init.type).startswith("tensor<"):
                continue
            owner = _defining_op(init)
            if owner is not None and owner.name == "flow.tensor.transfer":
                continue
            assert _carried_from_enclosing_loop(init), f"loop init {init}"


@pytest.mark.parametrize("spec", LOOP_SPECS[::2], ids=lambda s: s.symbol)
def test_stream_ir_copies_no_loop_carried_tensor(spec):
    """Compiled to IREE's stream phase, the only copies left inside the host loops are scalar
    reads (index arrays, at most 128 bytes): without on_target_device IREE 3.13 copies every
    carried tensor whole on every iteration."""
    import re

    from iree.compiler import tools

    from linalg_prefill.pipeline import Target

    flags = [*Target("llvm-cpu").flags(), "--compile-to=stream", "--mlir-print-debuginfo=false"]
    stream = tools.compile_str(str(build_module(spec)), input_type="auto", extra_args=flags)
    text = stream.decode() if isinstance(stream, bytes) else stream
    host = text[text.index(f"util.func public @{spec.symbol}("):]
    sizes = [size for block in _loop_blocks(host)
             for size in re.findall(r"stream\.cmd\.copy %\w+\[%\w+\], %\w+\[%\w+\], (%\w+)", block)]
    assert sizes, "expected the scalar index reads inside the loops"
    for size in sizes:
        constant = re.fullmatch(r"%c(\d+)", size)
        assert constant and int(constant.group(1)) <= 128, f"copy of {size} bytes inside a host loop"


def _carried_from_enclosing_loop(value) -> bool:
    """A block argument (an enclosing loop's carried value), possibly tied or passed on by scf.if."""
    owner = _defining_op(value)
    if owner is None:
        return True
    if owner.name == "flow.tensor.tie_shape":
        return _carried_from_enclosing_loop(owner.operands[0])
    return owner.name == "scf.if"


def _defining_op(value):
    """The operation that defines ``value``, or None for a block argument."""
    owner = value.owner
    return None if isinstance(owner, ir.Block) else getattr(owner, "operation", owner)


def _loop_blocks(host: str) -> list[str]:
    """The blocks of a function in IREE's stream IR (loops lowered to cf) that belong to a loop: a
    branch back to an earlier block ^bbH from block ^bbE puts every block from H to E in a loop."""
    import re

    parts = re.split(r"\n  \^bb(\d+)", host)
    blocks = [("entry", parts[0])] + list(zip(parts[1::2], parts[2::2]))
    position = {name: i for i, (name, _) in enumerate(blocks)}
    inside = set()
    for i, (_, body) in enumerate(blocks):
        for target in re.findall(r"cf\.(?:cond_)?br [^\n]*?\^bb(\d+)", body):
            if position[target] <= i:
                inside.update(range(position[target], i + 1))
    return [blocks[i][1] for i in sorted(inside)]
