"""Custom masks (semantics §14): the ragged, paged and paged sliding-window kernels with
``custom_mask=True`` and the masked sequence kernel with ``mask_mode="custom"``, against the float64
reference on speculative-decoding trees, random masks, rows with no allowed key, empty entries and
short entries (which run in the main kernel: the serving passes know only the causal mask); bad
masks raise InputError naming the argument before any kernel runs; and the mask rule object
(mlir/mask_rules.py) is what both lowerings and the serving passes take.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import BACKENDS, assert_matches_reference
from linalg_prefill.mlir import (
    DecodeSpec, MaskedSequencePrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SpecError, build_fused_module,
    build_module,
)
from linalg_prefill.mlir.abi import argument_names, arguments
from linalg_prefill.mlir.decode import build_decode
from linalg_prefill.mlir.fused_decode import build_fused_decode
from linalg_prefill.mlir.fused_kernels import build_fused_kv_cache_prefill, build_fused_sequence_prefill
from linalg_prefill.mlir.ir import arith_d, const_index, le, lt
from linalg_prefill.mlir.kv_cache import build_kv_cache_prefill
from linalg_prefill.mlir.mask_rules import MaskRule, mask_rule
from linalg_prefill.mlir.sequence import build_sequence_prefill
from linalg_prefill.runtime import InputError, MaskedSequencePrefillWrapper, open_kernel
from linalg_prefill.runtime.examples import example_inputs, indptr
from linalg_prefill.runtime.masks import HOST_MASKS
from linalg_prefill.runtime.variants import checked

#: One spec per variant, shared by every test (f32 and one 16-bit dtype among them).
RAGGED = RaggedPrefillSpec(h_q=4, h_kv=2, d_qk=32, d_v=32, dtype="float32", custom_mask=True)
PAGED = PagedPrefillSpec(h_q=4, h_kv=2, d=32, dtype="float16", page_size=8, custom_mask=True)
PAGED_WINDOW = PagedPrefillSpec(h_q=4, h_kv=2, d=32, dtype="float32", page_size=8, sliding_window=True,
                                custom_mask=True)
MASKED = MaskedSequencePrefillSpec(h_q=4, h_kv=2, d=32, dtype="bfloat16", mask_mode="custom", sm_scale=32 ** -0.5)
KV_SPECS = [RAGGED, PAGED, PAGED_WINDOW]


def tree_mask(prefix: int, parents: list[int]) -> np.ndarray:
    """bool [n, prefix + n] of a speculative-decoding tree of n draft tokens (``parents[i]`` < i,
    or -1 for a child of the prefix): each token sees the whole prefix, its ancestors and itself."""
    n = len(parents)
    mask = np.zeros((n, prefix + n), bool)
    mask[:, :prefix] = True
    for i in range(n):
        node = i
        while node >= 0:
            mask[i, prefix + node] = True
            node = parents[node]
    return mask


def _call(spec, rng, blocks: list[np.ndarray], *, peak: float = 3.0):
    """A checked call of ``spec`` whose entries have the masks ``blocks`` (bool [qo_len, kv_len]
    each), queries scaled by ``peak`` (peaked scores), causal=1 (which the mask overrides)."""
    entries = [block.shape for block in blocks]
    args = example_inputs(spec, rng, entries=entries)
    named = dict(zip(argument_names(spec), args))
    named["q"] = (named["q"].astype(np.float32) * peak).astype(named["q"].dtype)
    named["custom_mask"] = np.concatenate([block.reshape(-1) for block in blocks]).astype(np.uint8)
    named["mask_indptr"] = indptr([block.size for block in blocks])
    return checked(spec, tuple(named[name] for name in argument_names(spec)))


def _tree_blocks() -> list[np.ndarray]:
    """A 7-token tree over a 150-row prefix (a short entry, several KV tiles), an empty entry, a
    chain of 3 over an odd prefix, a 70-token tree (several query tiles) with one row's keys all
    hidden, and an entry without KV."""
    wide = tree_mask(9, [-1] + [(i - 1) // 2 for i in range(1, 70)])
    wide[33] = False  # a row with no allowed key
    return [tree_mask(150, [-1, 0, 0, 1, 1, 2, 2]), np.zeros((0, 13), bool), tree_mask(41, [-1, 0, 1]), wide,
            np.zeros((2, 0), bool)]


def _random_blocks(rng) -> list[np.ndarray]:
    """Random masks of odd sizes, one all hidden, with an entry of no queries."""
    shapes = [(17, 5), (1, 131), (0, 9), (65, 77), (3, 3)]
    blocks = [rng.random(shape) < 0.3 for shape in shapes]
    blocks[4][:] = False
    return blocks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", KV_SPECS, ids=lambda s: s.symbol + "_" + s.dtype)
def test_speculative_trees_match_the_reference(spec, backend, cache):
    kernel = open_kernel(spec, backend, cache=cache)
    args = _call(spec, np.random.default_rng(0), _tree_blocks())
    assert_matches_reference(spec.name, kernel(*args), spec, args)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", KV_SPECS, ids=lambda s: s.symbol + "_" + s.dtype)
def test_random_masks_match_the_reference(spec, backend, cache):
    kernel = open_kernel(spec, backend, cache=cache)
    rng = np.random.default_rng(1)
    args = _call(spec, rng, _random_blocks(rng))
    assert_matches_reference(spec.name, kernel(*args), spec, args)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.compiles(dataclasses.replace(RAGGED, head_sinks=True))
def test_a_custom_mask_with_head_sinks(backend, cache):
    """The two options together: the mask decides which keys a row sees, the sink (semantics
    §13) joins the denominator of the rows that see one."""
    spec = dataclasses.replace(RAGGED, head_sinks=True)
    kernel = open_kernel(spec, backend, cache=cache)
    args = _call(spec, np.random.default_rng(6), _tree_blocks())
    assert argument_names(spec)[-3:] == ("custom_mask", "mask_indptr", "sinks")
    assert_matches_reference(spec.name, kernel(*args), spec, args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_short_entry_runs_its_mask_in_the_main_kernel(backend, cache):
    """A call of one 5-token tree (<= 16 queries, what the serving passes take for causal calls):
    the kernel keeps it, and the tree, not the causal mask, decides."""
    kernel = open_kernel(RAGGED, backend, cache=cache)
    assert kernel.serving_passes == ()
    block = tree_mask(20, [-1, 0, 0, 2, 2])
    args = _call(RAGGED, np.random.default_rng(2), [block])
    assert_matches_reference(RAGGED.name, kernel(*args), RAGGED, args)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.compiles(MASKED)
def test_masked_sequence_custom_mask(backend, cache):
    kernel = open_kernel(MASKED, backend, cache=cache)
    rng = np.random.default_rng(3)
    for batch, q_len, kv_len in ((3, 37, 301), (2, 7, 19)):  # several KV tiles; a call of <= 16 queries
        q, k, v, _ = example_inputs(MASKED, rng, entries=[(q_len, kv_len)] * batch)
        mask = rng.random((batch, q_len, kv_len)) < 0.4
        mask[0] = False
        mask[0, :, :kv_len - q_len] = True
        mask[0] |= tree_mask(kv_len - q_len, [-1] + list(range(q_len - 1)))  # a chain: causal by another name
        mask[1, 2] = False  # a row with no allowed key
        args = checked(MASKED, ((q.astype(np.float32) * 3).astype(q.dtype), k, v, mask))
        assert_matches_reference(MASKED.name, kernel(*args), MASKED, args)


# ---- bad masks: InputError naming the argument, before any kernel runs ----

def _good(spec):
    args = list(_call(spec, np.random.default_rng(4), [tree_mask(5, [-1, 0]), np.ones((3, 4), bool)]))
    names = argument_names(spec)
    return args, names.index("custom_mask"), names.index("mask_indptr")


@pytest.mark.parametrize("spec", KV_SPECS, ids=lambda s: s.symbol)
@pytest.mark.parametrize("change, name, message", [
    (lambda mask, ptr: (mask[:-1], ptr), "custom_mask", "expected sum of qo_len \\* kv_len = 26"),
    (lambda mask, ptr: (mask.astype(np.float32), ptr), "custom_mask", "expected dtype bool or uint8"),
    (lambda mask, ptr: (mask.astype(np.int32), ptr), "custom_mask", "expected dtype bool or uint8"),
    (lambda mask, ptr: (mask.astype(np.uint8) * 2, ptr), "custom_mask", "values must be 0 or 1"),
    (lambda mask, ptr: (mask.reshape(2, 13), ptr), "custom_mask", "expected rank 1"),
    (lambda mask, ptr: (mask, ptr + 1), "mask_indptr", "start at 0"),
    (lambda mask, ptr: (mask, ptr[[0, 2, 1]]), "mask_indptr", "non-decreasing"),
    (lambda mask, ptr: (mask, np.array([0, 14, 25], np.int32)), "mask_indptr", "end at"),
    (lambda mask, ptr: (mask, np.array([0, 12, 26], np.int32)), "mask_indptr", "entry 0 spans 12"),
    (lambda mask, ptr: (mask, ptr[:-1]), "mask_indptr", "expected shape"),
    (lambda mask, ptr: (mask, ptr.astype(np.float32)), "mask_indptr", "expected integers"),
])
def test_bad_masks_are_input_errors(spec, change, name, message):
    args, at_mask, at_ptr = _good(spec)
    args[at_mask], args[at_ptr] = change(np.asarray(args[at_mask]).astype(bool), args[at_ptr])
    with pytest.raises(InputError, match=f"^{name}: .*{message}"):
        checked(spec, tuple(args))


def test_bad_masks_are_rejected_before_the_kernel_runs(cache):
    kernel = open_kernel(RAGGED, cache=cache)
    args, at_mask, _ = _good(RAGGED)
    args[at_mask] = args[at_mask][:-1]
    with pytest.raises(InputError, match="^custom_mask: "):
        kernel(*args)


@pytest.mark.compiles(MASKED)
def test_a_layer_whose_shape_differs_from_the_planned_mask_is_refused(cache):
    """The dense wrapper plans a [B, Lq, Lk] mask once; a layer's q and k of other lengths are an
    error naming q before the kernel runs."""
    wrapper = MaskedSequencePrefillWrapper(MASKED, cache=cache)
    q, k, v, mask = example_inputs(MASKED, np.random.default_rng(6), entries=[(5, 7)] * 2)
    wrapper.plan(custom_mask=mask)
    assert_matches_reference("planned", wrapper.run(q, k, v), MASKED, (q, k, v, mask))
    with pytest.raises(InputError, match=r"^q: Lq 4 and Lk 7 \(k\) differ from the planned custom_mask's "
                                         r"\[B, Lq, Lk\] = \[2, 5, 7\]"):
        wrapper.run(q[:, :4], k, v)


@pytest.mark.parametrize("mask, message", [
    (np.ones((2, 5, 7), np.float16), "expected dtype bool or uint8"),
    (np.ones((2, 5, 6), bool), "expected shape"),
    (np.ones((2, 5), bool), "expected rank 3"),
])
def test_bad_dense_masks_are_input_errors(mask, message):
    q, k, v, _ = example_inputs(MASKED, np.random.default_rng(5), entries=[(5, 7)] * 2)
    with pytest.raises(InputError, match=f"^custom_mask: {message}"):
        checked(MASKED, (q, k, v, mask))


# ---- the rule object (IR structure only, no compile) ----

def test_every_rule_has_its_host_half_and_its_rows_in_the_table():
    """A new MaskRule without a HostMask (runtime/masks.py) fails here, not at a user's call; a
    rule's argument rows are its variant's last ones (before sinks)."""
    rules = set()
    pending = [MaskRule]
    while pending:
        rule = pending.pop()
        rules.add(rule)
        pending.extend(rule.__subclasses__())
    concrete = {rule for rule in rules - {MaskRule}
                if "valid" in rule.__dict__ and rule.__module__ == MaskRule.__module__}  # the library's
    assert len(concrete) == 6
    assert concrete - set(HOST_MASKS) == set()
    for spec in (*KV_SPECS, MASKED):
        rows = [arg.name for arg in arguments(spec) if arg.kind != "f32"]
        own = [arg.name for arg in mask_rule(spec).arguments]
        assert own and rows[-len(own):] == own, (spec.name, rows)


def test_the_specs_name_their_rules_and_artifacts():
    assert RAGGED.name.endswith("_custommask") and "custommask" not in RaggedPrefillSpec(4, 2, 32, 32, "float32").name
    assert all(type(spec)(**spec.fields()) == spec for spec in KV_SPECS)
    with pytest.raises(SpecError, match="custom_mask must be a bool"):
        PagedPrefillSpec(4, 2, 32, "float32", custom_mask="yes")
    assert argument_names(RAGGED)[-2:] == ("custom_mask", "mask_indptr") and argument_names(MASKED)[-1] == "custom_mask"
    for spec in (*KV_SPECS, MASKED):
        assert not mask_rule(spec).one_pass
    assert mask_rule(RaggedPrefillSpec(4, 2, 32, 32, "float32")).one_pass


def test_the_serving_passes_refuse_a_custom_mask():
    for build in (build_decode, build_fused_decode):
        with pytest.raises(ValueError, match="one-pass"):
            build(DecodeSpec(RAGGED, 4))


#: The marker constant of the fake rule below: found in a module, the rule's IR is there.
MARKER = 7919


class EveryOtherBlock(MaskRule):
    """A rule no builder knows: keys in even blocks of MARKER columns, inside kv_len, at or
    below a row-dependent bound; it reads the ``causal`` argument (as the KV-cache rule does)."""

    operands = ("causal",)
    one_pass = True

    def valid(self, values, lengths, row, col):
        even = arith_d.cmpi(arith_d.CmpIPredicate.eq,
                            arith_d.remui(arith_d.divui(col, const_index(MARKER)), const_index(2)), const_index(0))
        return arith_d.andi(arith_d.andi(lt(col, lengths.kv_len), even), le(col, arith_d.addi(row(), lengths.kv_len)))

    def visible_tiles(self, call, lengths, last_row_end, kv_tile, every):
        return arith_d.minsi(every, const_index(MARKER + 1))


def test_a_new_rule_is_taken_by_every_builder():
    """The builders take a rule they were never told of: its predicate lands in the score generic
    (linalg) and in the mask operand of online_attention (fused), its tile count in the KV loops,
    for the dense and KV-cache families and the serving passes."""
    dense = MaskedSequencePrefillSpec(4, 2, 32, "float32", mask_mode="padded", sm_scale=0.125)
    kv = RaggedPrefillSpec(4, 2, 32, 32, "float32")
    rule = EveryOtherBlock()
    dense_rule = type("DenseEveryOtherBlock", (EveryOtherBlock,), {"operands": ()})()
    modules = {
        "sequence": build_sequence_prefill(dense, row_chunk=None, rule=dense_rule),
        "fused sequence": build_fused_sequence_prefill(dense, rule=dense_rule),
        "ragged": build_kv_cache_prefill(kv, row_chunk=None, rule=rule),
        "fused ragged": build_fused_kv_cache_prefill(kv, rule=rule),
        "decode": build_decode(DecodeSpec(kv, 4), rule=rule),
        "fused decode": build_fused_decode(DecodeSpec(kv, 4), rule=rule),
    }
    for name, module in modules.items():
        text = str(module)
        assert f"arith.constant {MARKER} : index" in text, name
        if "decode" not in name:
            assert f"arith.constant {MARKER + 1} : index" in text, name  # the visible tiles
        if "fused" in name:
            assert "iree_linalg_ext.online_attention" in text, name
    # the default builders keep their own rule
    assert f"{MARKER} : index" not in str(build_module(dense)) + str(build_fused_module(kv))
