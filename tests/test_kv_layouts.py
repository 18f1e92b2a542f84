"""The KV layouts as objects (mlir/kv_layouts.py, runtime/kv_layouts.py): every layout has both
halves under one name and defines every hook of its kind, a layout that misses one cannot be
created, an unknown layout is an error wherever a name is looked up, and the host hooks agree
with the example calls they describe. No compile: the kernels that read through the hooks are
tested against the reference elsewhere (test_kv_cache_prefill.py, test_decode_batches.py).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from linalg_prefill.mlir import (
    SPEC_TYPES, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from linalg_prefill.mlir.abi import argument_names
from linalg_prefill.mlir.decode import DecodeSpec
from linalg_prefill.mlir.kv_layouts import (
    LAYOUTS, PAGED_ORDERS, RAGGED_ORDERS, CacheLayout, KvLayout, RaggedLayout, cache_layout,
)
from linalg_prefill.runtime import reference
from linalg_prefill.runtime.error_model import CallFacts, bound_of_call
from linalg_prefill.runtime.examples import EXAMPLE_ENTRIES, example_inputs
from linalg_prefill.runtime.kv_layouts import HOST_LAYOUTS, CacheHostLayout, HostLayout, RaggedHost, host_layout

#: One spec of each KV-cache layout (the paged ones with and without a sliding window).
CACHE_SPECS = [
    RaggedPrefillSpec(4, 2, 16, 8, "float32"),
    RaggedPrefillSpec(4, 2, 16, 8, "float32", kv_order="hnd"),
    PagedPrefillSpec(4, 2, 16, "float32", page_size=4),
    PagedPrefillSpec(4, 2, 16, "float32", page_size=4, sliding_window=True),
    PagedPrefillSpec(4, 2, 16, "float32", page_size=4, kv_order="nhd"),
    MlaPagedPrefillSpec(4, 16, 4, "float32", page_size=4),
    MlaPagedPrefillSpec(4, 16, 4, "float32", page_size=4, sliding_window=True),
]


def _hooks(kind: type) -> set[str]:
    """The abstract hooks a concrete layout of ``kind`` must define."""
    return set(kind.__abstractmethods__)


def test_every_layout_has_both_halves_under_its_name():
    assert set(LAYOUTS) == set(HOST_LAYOUTS) == {"dense", "ragged", "ragged_hnd", "paged", "paged_nhd", "latent"}
    for name, layout in LAYOUTS.items():
        assert layout.name == name == HOST_LAYOUTS[name].name
        # a KV cache on one side is a KV cache on the other
        assert isinstance(layout, CacheLayout) == isinstance(HOST_LAYOUTS[name], CacheHostLayout)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_layout_defines_every_hook_of_its_kind(name):
    ir_half, host_half = LAYOUTS[name], HOST_LAYOUTS[name]
    for half, kinds in ((ir_half, (CacheLayout,)), (host_half, (HostLayout, CacheHostLayout))):
        assert not inspect.isabstract(type(half))
        for kind in kinds:
            if isinstance(half, kind):
                for hook in _hooks(kind):
                    assert not getattr(getattr(type(half), hook), "__isabstractmethod__", False), (name, hook)
    for attribute in ir_half.required:
        assert hasattr(ir_half, attribute), (name, attribute)


def test_the_hooks_a_new_layout_must_define():
    """What a new KV-cache layout defines, and that leaving out any one of them is caught when
    the layout is created (the registries create theirs at import)."""
    assert _hooks(CacheLayout) == {"entry_loader", "batch_kv", "element", "block", "kv_bytes_per_key"}
    assert CacheLayout.required == ("name", "operands", "host_readable", "vectorise_rows")
    assert _hooks(CacheHostLayout) == {"keys_and_values", "with_absolute_values", "dequantized", "example_arrays",
                                       "kv_lengths", "table_rows", "rest_arguments", "pass_entry_kv"}
    for hook in _hooks(CacheLayout):
        incomplete = type("Incomplete", (RaggedLayout,), {"name": "incomplete", hook: CacheLayout.__dict__[hook]})
        with pytest.raises(TypeError, match=hook):
            incomplete()
    hooks = {hook: RaggedLayout.__dict__[hook] for hook in _hooks(CacheLayout)}
    for attribute in ("operands", "host_readable", "vectorise_rows"):
        others = {other: getattr(RaggedLayout, other) for other in ("operands", "host_readable", "vectorise_rows")
                  if other != attribute}
        missing = type("Missing", (CacheLayout,), {"name": "missing", **hooks, **others})
        with pytest.raises(TypeError, match=attribute):
            missing()
    for hook in _hooks(CacheHostLayout):
        abstract = CacheHostLayout.__dict__.get(hook, HostLayout.__dict__.get(hook))
        incomplete = type("Incomplete", (RaggedHost,), {"name": "incomplete", hook: abstract})
        with pytest.raises(TypeError, match=hook):
            incomplete()
    # a complete new layout is its own object: the existing ones are untouched
    assert type("Copy", (RaggedLayout,), {"name": "copy"})().name == "copy"
    assert "copy" not in LAYOUTS


def test_every_spec_names_a_registered_layout():
    specs = [*CACHE_SPECS, *(DecodeSpec(spec) for spec in CACHE_SPECS)]
    for spec in specs:
        assert spec.layout is LAYOUTS[spec.kv_layout]
        assert cache_layout(spec) is spec.layout
    # the ragged and paged specs have one layout per kv_order, the others one of their own
    orders = {RaggedPrefillSpec: (RAGGED_ORDERS, lambda order: RaggedPrefillSpec(4, 2, 16, 16, "float32", kv_order=order)),
              PagedPrefillSpec: (PAGED_ORDERS, lambda order: PagedPrefillSpec(4, 2, 16, "float32", kv_order=order))}
    for spec_type in SPEC_TYPES:
        if spec_type in orders:
            by_order, make = orders[spec_type]
            for order, layout in by_order.items():
                assert make(order).layout is layout is LAYOUTS[layout.name]
            continue
        assert isinstance(spec_type.layout, KvLayout) and spec_type.layout is LAYOUTS[spec_type.layout.name]


def test_an_unknown_layout_is_an_error():
    with pytest.raises(ValueError, match="unknown KV layout 'columnar'"):
        host_layout("columnar")
    q = np.zeros((1, 1, 1, 4))
    with pytest.raises(ValueError, match="unknown KV layout"):
        reference.decode_entries(q, q, np.zeros((1, 1), np.int32), np.zeros((1, 4), np.int32), 1, 1.0,
                                 kv_layout="columnar", group_size=1, block=16, d_v=4)
    facts = CallFacts("float32", "columnar", 4)
    with pytest.raises(ValueError, match="unknown KV layout"):
        bound_of_call({"q": q, "k": q, "v": q, "sm_scale": 1.0}, facts,
                      lambda named: (np.zeros((1, 1, 1, 4)), np.zeros((1, 1, 1))))
    dense = SequencePrefillSpec(4, 2, 8, "float32", True, 0.5)
    with pytest.raises(TypeError, match="has no KV cache"):
        DecodeSpec(dense).block  # noqa: B018


@pytest.mark.parametrize("spec", CACHE_SPECS, ids=lambda spec: spec.name)
def test_host_hooks_describe_the_example_calls(spec):
    """kv_lengths gives the example entries' lengths; the rest call of half the entries keeps
    what its layout keeps; the pass table rows hold as many blocks as each entry's keys need."""
    layout = host_layout(spec)
    args = example_inputs(spec, np.random.default_rng(0))
    index = {name: value for name, value in zip(argument_names(spec), args) if isinstance(value, np.ndarray)
             and value.dtype == np.int32}
    kv_lens = np.array([kv for _, kv in EXAMPLE_ENTRIES])
    qo_lens = np.array([qo for qo, _ in EXAMPLE_ENTRIES])
    assert layout.kv_lengths(spec, index).tolist() == kv_lens.tolist()
    in_pass = np.array([True, False, True, False])
    rest = layout.rest_arguments(spec, index, in_pass, qo_lens)
    kept_queries = np.diff(rest["q_indptr"])
    assert kept_queries.sum() == qo_lens[~in_pass].sum()
    kept = layout.kv_lengths(spec, {**index, **rest})
    assert sorted(kept[kept_queries > 0].tolist()) == sorted(kv_lens[~in_pass].tolist())
    entries = np.arange(len(kv_lens))
    block = DecodeSpec(spec).block
    ids, blocks, sink, offset = layout.table_rows(spec, index, entries, kv_lens, block)
    assert len(ids) == len(blocks) == len(sink) == len(offset) == len(entries)
    assert (np.asarray(blocks) * block >= kv_lens).all()
