"""What the tests share: rope configs, dtypes, the fuzzed spec lists, pairwise grids, the checks against the
float64 reference (``assert_matches_reference``, ``run_against_reference``) and the nesting of a
module's loops (``structure``) for structural IR asserts.

tests/conftest.py re-exports the names other test files import from it (``NUMPY_DTYPE``,
``assert_matches_reference``, ``TensorLike``); bench/bound_ratios.py imports the fuzzed spec lists.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Iterable

import ml_dtypes
import numpy as np
import pytest

from linalg_prefill.mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from linalg_prefill.mlir.abi import argument_names, ordered
from linalg_prefill.pipeline import Target, target_for
from linalg_prefill.pipeline.cpu_tiles import AMX_FEATURES, host_cpu_features
from linalg_prefill.runtime import kernels, open_kernel
from linalg_prefill.runtime.compare import error_bound, reference_for
from linalg_prefill.runtime.examples import example_inputs
from linalg_prefill.runtime.reference import EMPTY_ROW_LSE

NUMPY_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}

#: The x86 lowering's tests (tests/test_x86_*.py): whether this CPU has AMX (where the record picks
#: the lowering, and its numerics run; elsewhere they skip like the GPU tests), and a named AMX
#: CPU for the structure checks that run everywhere.
HOST_HAS_AMX = AMX_FEATURES <= host_cpu_features()
needs_amx = pytest.mark.skipif(not HOST_HAS_AMX, reason="no amx_tile/amx_bf16 on this CPU")
AMX_CPU = Target("llvm-cpu", "sapphirerapids")

# ------------------------------------------------------------------------------ rope configs
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
LLAMA4 = {**LLAMA3, "rope_type": "llama4"}
LONGROPE = {"rope_type": "longrope", "max_position_embeddings": 131072, "original_max_position_embeddings": 4096}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1}
#: One config per rope type of mlir/specs.py's ROPE_FIELDS.
ROPE_TYPES = {"default": {}, "gptj": {"rope_type": "gptj"}, "llama3": LLAMA3, "llama4": LLAMA4,
              "longrope": LONGROPE, "yarn": YARN}

#: Original contexts of 32-64 positions, so that short calls reach every band of the scaled types.
LLAMA3_64 = {**LLAMA3, "original_max_position_embeddings": 64}
LLAMA4_64 = {**LLAMA3_64, "rope_type": "llama4"}
YARN_32 = {**YARN, "original_max_position_embeddings": 32}
LONGROPE_64 = {"rope_type": "longrope", "max_position_embeddings": 1024, "original_max_position_embeddings": 64}

# ------------------------------------------------------------------------------ fuzzed specs
# (tests/test_fuzz.py, bench/bound_ratios.py)

KV_SPECS = [
    RaggedPrefillSpec(4, 2, 32, 16, "float32"),
    RaggedPrefillSpec(4, 1, 32, 32, "bfloat16", rope_scaling=LLAMA3_64),
    RaggedPrefillSpec(2, 2, 16, 16, "float16", q_tile=8, kv_tile=16),
    PagedPrefillSpec(4, 2, 32, "float32", page_size=4),
    PagedPrefillSpec(4, 2, 32, "bfloat16", page_size=8, sliding_window=True, rope_scaling=YARN_32),
    PagedPrefillSpec(8, 2, 16, "float16", page_size=1, q_tile=8, kv_tile=16),
    MlaPagedPrefillSpec(4, 32, 16, "float32", page_size=4),
    MlaPagedPrefillSpec(2, 16, 8, "bfloat16", page_size=8, sliding_window=True),
]
#: Every other rope type, soft-capping and partial rotary: fuzzed when LINALG_PREFILL_FUZZ is set
#: (CI covers them in tests/test_soft_cap.py, test_partial_rotary.py, test_kv_cache_prefill.py).
THOROUGH_KV_SPECS = [
    RaggedPrefillSpec(4, 2, 32, 32, "float16", rope_scaling={"rope_type": "gptj"}, logits_soft_cap=20.0),
    RaggedPrefillSpec(2, 1, 64, 32, "float32", rope_scaling=LONGROPE_64, rotary_dim=32),
    PagedPrefillSpec(4, 1, 32, "bfloat16", page_size=4, rope_scaling=LLAMA4_64, rotary_dim=16),
    PagedPrefillSpec(4, 2, 32, "float16", page_size=16, sliding_window=True, rope_scaling=LLAMA3_64,
                     logits_soft_cap=30.0),
    MlaPagedPrefillSpec(4, 32, 16, "float16", page_size=4, logits_soft_cap=30.0),
]
DENSE_SPECS = [
    SequencePrefillSpec(4, 2, 32, "float32", causal=True, sm_scale=32 ** -0.5),
    SequencePrefillSpec(4, 4, 16, "bfloat16", causal=False, sm_scale=0.3, q_tile=8, kv_tile=16),
    MaskedSequencePrefillSpec(4, 2, 32, "float16", "padded", sm_scale=32 ** -0.5),
    MaskedSequencePrefillSpec(2, 1, 32, "float32", "causal_padded_left", sm_scale=0.2, q_tile=8, kv_tile=16),
]
THOROUGH_DENSE_SPECS = [
    SequencePrefillSpec(4, 2, 32, "float16", causal=True, sm_scale=0.5, logits_soft_cap=10.0),
    MaskedSequencePrefillSpec(4, 4, 32, "bfloat16", "causal_padded_left", sm_scale=32 ** -0.5, logits_soft_cap=30.0),
]


def pairwise(**factors) -> list[dict]:
    """Rows, each a value of every factor (``factors``: name -> values), in which every pair of
    values of two different factors appears in some row (a covering array of strength 2): the
    grids of the numerics tests, where each row is a compile. Greedy (each row the candidate that
    covers the most pairs not yet covered), the smallest of 32 seeded candidate orders, so the
    same rows every run. E.g. 3 x 3 x 2 x 2 values: 9 rows, against 36 in the full product."""
    names = list(factors)

    def pairs(row: tuple) -> set:  # with each value alone, so that one factor gives all its values
        return {(x, row[x], y, row[y]) for x, y in itertools.combinations(range(len(names)), 2)} | \
            {(x, row[x]) for x in range(len(names))}

    product = list(itertools.product(*(range(len(factors[name])) for name in names)))
    best = None
    for seed in range(32):
        candidates = product if seed == 0 else random.Random(seed).sample(product, len(product))
        uncovered, rows = set().union(*map(pairs, product)), []
        while uncovered:
            rows.append(max(candidates, key=lambda candidate: len(pairs(candidate) & uncovered)))
            uncovered -= pairs(rows[-1])
        best = rows if best is None or len(rows) < len(best) else best
    return [{name: factors[name][i] for name, i in zip(names, row)} for row in best]


def spec_id(spec) -> str:
    """A short test id for a spec parameter: its artifact name without the entry point's."""
    return spec.name.removeprefix(spec.symbol + "_")


# ------------------------------------------------------------------------------ the reference
def assert_matches_reference(name: str, got, spec, args, want=None) -> None:
    """(output, lse) of the call ``args`` of ``spec`` against its float64 reference (``want``, or
    computed): rows with a visible key within the call's error bound (runtime/error_model.py),
    the rows without one (reference lse -5e4, semantics §11.3) exactly output 0 and lse -5e4."""
    want = reference_for(spec, args) if want is None else want
    bound = error_bound(spec, args, want)
    (out, lse), (want_out, want_lse) = (np.asarray(x, np.float64) for x in got), want
    assert out.shape == np.shape(want_out) and lse.shape == np.shape(want_lse), f"{name}: shapes differ"
    if not bound.holds((out, lse), want):
        out_ratio, lse_ratio = bound.ratio((out, lse), want)
        raise AssertionError(f"{name}: output error {out_ratio:.3g}, lse error {lse_ratio:.3g} x its bound "
                             f"({spec.dtype})")
    empty = ~bound.valid
    assert np.all(out[empty] == 0.0), f"{name}: empty rows must be 0"
    assert np.all(lse[empty] == EMPTY_ROW_LSE), f"{name}: empty rows must have lse -5e4"


def with_arguments(spec, args: tuple, **given) -> tuple:
    """The seed-ABI call ``args`` of ``spec`` with the arguments named in ``given`` replaced."""
    return ordered(spec, {**dict(zip(argument_names(spec), args)), **given})


_KERNELS: dict = {}


def kernel_for(spec, backend="llvm-cpu", cache=None, serving_passes: bool = True):
    """``open_kernel(spec, backend, cache=cache, serving_passes=serving_passes)``, opened once per
    session for the passes it loads (tests/conftest.py: declared_serving_passes)."""
    passes = tuple(p.queries for p in kernels.passes_at_open(spec, target_for(backend), serving_passes))
    key = (spec, backend, cache.root if cache else None, passes)
    if key not in _KERNELS:
        _KERNELS[key] = open_kernel(spec, backend, cache=cache, serving_passes=serving_passes)
    return _KERNELS[key]


def run_against_reference(spec, backend="llvm-cpu", *, cache=None, entries: Iterable | None = None,
                          calls: Iterable[dict] = ({},), window=None, seed: int = 0,
                          serving_passes: bool = True) -> None:
    """Opens ``spec`` on ``backend`` and checks one call per dict of ``calls`` (arguments by name
    replacing runtime/examples.py's defaults, e.g. ``dict(causal=0, rotary_mode=1)``) against the
    float64 reference. The tensors and index arrays are drawn once, by ``example_inputs(spec, rng,
    entries, window=window)``: ``entries`` (qo_len, kv_len) per batch entry; a dense spec takes B =
    len(entries) of the first entry's lengths. ``serving_passes=False``: every entry runs in the
    variant's own kernel (``open_kernel``)."""
    kernel = kernel_for(spec, backend, cache, serving_passes)
    rng = np.random.default_rng(seed)
    args = example_inputs(spec, rng, window=window) if entries is None else \
        example_inputs(spec, rng, list(entries), window=window)
    for given in calls:
        call = with_arguments(spec, args, **given)
        label = " ".join(f"{name}={value}" for name, value in given.items())
        assert_matches_reference(f"{spec.name} {label}".strip(), kernel(*call), spec, call)


class TensorLike:
    """The part of a torch CPU tensor that ``runtime.checks.as_array`` reads (detach, cpu, numpy,
    dtype): lets the torch adapter be tested without torch, which the test extra does not install."""

    def __init__(self, array):
        self._array = array
        self.dtype = f"torch.{array.dtype}"

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self._array


# ------------------------------------------------------------------------------ IR structure
#: The operations ``structure`` keeps: control flow, the fused lowering's attention op, and the
#: online softmax's exponentials (where the KV loop of the linalg lowering is).
STRUCTURE_OPS = ("func.func", "scf.for", "scf.if", "iree_linalg_ext.online_attention", "math.exp2")


@dataclass(eq=False)
class Op:
    """An operation of ``STRUCTURE_OPS`` and the ones of them nested in its regions."""

    name: str
    inner: list["Op"] = field(default_factory=list)

    def find(self, name: str) -> list["Op"]:
        """Every operation named ``name`` inside this one, outermost first."""
        found = []
        for op in self.inner:
            found += ([op] if op.name == name else []) + op.find(name)
        return found

    def paths(self, name: str) -> list[tuple[str, ...]]:
        """For every operation named ``name`` inside this one, the names of the operations around
        it (outermost first, this one excluded)."""
        found = []
        for op in self.inner:
            found += [()] if op.name == name else []
            found += [(op.name, *path) for path in op.paths(name)]
        return found

    def holding(self, name: str, kind: str = "scf.for") -> list["Op"]:
        """The operations named ``kind`` inside this one that hold an operation ``name`` directly
        (not inside a further ``kind``): e.g. the KV loops, around the online softmax's exp2."""
        return [op for op in self.find(kind) if any(inner.name == name for inner in op.inner)]

    def outline(self, depth: int = 0) -> str:
        """The tree as indented text, for failure messages."""
        return "\n".join(["  " * depth + self.name, *(op.outline(depth + 1) for op in self.inner)])


def structure(module) -> Op:
    """The nesting of ``module``'s STRUCTURE_OPS (read through the typed bindings): e.g.
    ``structure(m).paths("iree_linalg_ext.online_attention")`` gives the loops and branches
    around each attention op."""
    def visit(op, parent: Op) -> None:
        name = op.operation.name
        if name in STRUCTURE_OPS:
            parent.inner.append(Op(name))
            parent = parent.inner[-1]
        for region in op.operation.regions:
            for block in region.blocks:
                for inner in block.operations:
                    visit(inner, parent)

    root = Op("module")
    visit(module.operation, root)
    return root


def serving_call(spec, rng, entries, window=None, fill_unused=None):
    """Seed-ABI arguments of a KV-cache call (RoPE off, causal; runtime/examples.py) of ``entries``
    ((qo_len, kv_len) each; ``window``: (sink tokens, window offset) each); with
    ``fill_unused``, every page slot past an entry's rows and the unused pages hold it."""
    rope_off = {"rotary_mode": 0} if "rotary_mode" in argument_names(spec) else {}
    args = example_inputs(spec, rng, entries, window=window, **rope_off)
    if fill_unused is not None:
        named = dict(zip(argument_names(spec), args))
        page_indptr, page_values, pages = named["page_indptr"], named["page_values"], named["pages"]
        used = np.zeros((pages.shape[0], spec.page_size), bool)
        for b in range(len(page_indptr) - 1):
            used[page_values[page_indptr[b]:page_indptr[b + 1]]] = True
            last_page = page_values[page_indptr[b + 1] - 1] if page_indptr[b + 1] > page_indptr[b] else None
            if last_page is not None:
                used[last_page, last_page_len(named["length_info"], b):] = False
        slot_major = {"paged": (0, 3, 1, 2, 4), "paged_nhd": (0, 2, 1, 3, 4)}.get(spec.kv_layout)
        (pages.transpose(*slot_major) if slot_major else pages)[~used] = fill_unused
    return args


def last_page_len(length_info, b) -> int:
    return int(length_info[b] if length_info.ndim == 1 else length_info[0, b])
