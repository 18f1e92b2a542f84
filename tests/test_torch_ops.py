"""torch.ops.linalg_prefill.*: every variant as a custom op, checked by torch.library.opcheck
(schema, fake implementation, dynamic-shape tracing), against the float64 reference, and traced
by torch.compile(fullgraph=True)."""

from __future__ import annotations

import numbers

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # CI installs the hf extra: these never skip there

import linalg_prefill.torch_ops  # noqa: E402,F401 - registers the ops
from linalg_prefill.mlir import (  # noqa: E402
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from linalg_prefill.runtime import example_inputs  # noqa: E402
from linalg_prefill.runtime.checks import as_array  # noqa: E402

from conftest import assert_matches_reference  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
ENTRIES = [(5, 40), (17, 17), (1, 0)]
#: op name -> (spec, the op's arguments after the seed-ABI ones)
CASES = {
    "sequence_prefill": (SequencePrefillSpec(4, 2, 16, "float32", causal=True, sm_scale=0.25), (True, 0.25, 0.0)),
    "sequence_prefill_masked": (MaskedSequencePrefillSpec(4, 2, 16, "float32", "causal_padded_left", 0.25),
                                ("causal_padded_left", 0.25, 0.0)),
    "ragged_prefill": (RaggedPrefillSpec(4, 2, 16, 16, "float32", LLAMA3, rotary_dim=8),
                       ('{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, '
                        '"original_max_position_embeddings": 16}', 0.0, 8)),
    "paged_prefill": (PagedPrefillSpec(4, 2, 16, "bfloat16", page_size=16, sliding_window=True, logits_soft_cap=20.0),
                      ("{}", 20.0, 0)),
    "mla_paged_prefill": (MlaPagedPrefillSpec(4, 32, 16, "float32", page_size=4), (32, 0.0)),  # test_fuzz.py's kernel
}


def _torch_args(spec, seed: int = 0) -> tuple:
    """example_inputs of ``spec`` as the op takes them: tensors and Python scalars."""
    args = example_inputs(spec, np.random.default_rng(seed), entries=ENTRIES) if spec.kv_layout != "dense" else \
        example_inputs(spec, np.random.default_rng(seed), entries=[(7, 9)] * 2)
    converted = []
    for arg in args:
        if isinstance(arg, np.ndarray) and arg.dtype.name == "bfloat16":
            converted.append(torch.from_numpy(arg.view(np.int16)).view(torch.bfloat16))
        elif isinstance(arg, np.ndarray):
            converted.append(torch.from_numpy(arg))
        elif isinstance(arg, numbers.Integral):
            converted.append(int(arg))
        else:
            converted.append(float(arg))
    return args, tuple(converted)


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.compiles(spec))
                                  for name, (spec, _) in CASES.items()])
def test_op_passes_opcheck_and_matches_the_reference(name):
    spec, extra = CASES[name]
    host_args, args = _torch_args(spec)
    op = getattr(torch.ops.linalg_prefill, name)
    result = torch.library.opcheck(op.default, (*args, *extra))
    assert set(result.values()) == {"SUCCESS"}, result
    output, lse = op(*args, *extra)
    assert output.dtype == args[0].dtype and lse.dtype == torch.float32
    assert_matches_reference(name, (as_array("output", output), as_array("lse", lse)), spec, host_args)


def test_compiled_function_traces_through_the_op():
    """A torch.compile(fullgraph=True) function around the dense op is one graph (traced through
    the fake implementation, functionalised by AOTAutograd) and equals the eager call; the fake's
    results have the real ones' shapes, dtypes and strides, which a compiler's generated code
    assumes. (Backend aot_eager: inductor's C++ compile of the ops around it took 12-16 s of a
    fresh suite on a 2-core VM, docs/test-suite.md.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec, extra = CASES["sequence_prefill"]
    _host, (q, k, v) = _torch_args(spec)
    op = torch.ops.linalg_prefill.sequence_prefill

    @torch.compile(fullgraph=True, backend="aot_eager")
    def attend(q, k, v):
        output, lse = op(q * 0.5, k, v, *extra)
        return output.sum(-1) + lse

    inputs = (q * 0.5, k, v)
    want_out, want_lse = op(*inputs, *extra)
    torch.testing.assert_close(attend(q, k, v), want_out.sum(-1) + want_lse)
    with FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(x) for x in inputs), *extra)
    for got, real in zip(fake, (want_out, want_lse)):
        assert (got.shape, got.dtype, got.stride()) == (real.shape, real.dtype, real.stride())


@pytest.mark.parametrize("name", list(CASES))
def test_schema_is_the_argument_table_then_the_fields(name):
    """The registered schema names the variant's table arguments in the table's order, then the
    op's fields: a renamed or reordered table argument changes the op with it."""
    from linalg_prefill.mlir.abi import arguments
    from linalg_prefill.torch_ops import OPS

    registered = [arg.name for arg in getattr(torch.ops.linalg_prefill, name).default._schema.arguments]
    op = OPS[name]
    assert registered == [arg.name for arg in arguments(CASES[name][0])] + [field for field, _, _ in op.fields]


@pytest.mark.compiles(CASES["paged_prefill"][0])
def test_op_takes_its_arguments_by_name():
    """The paged op called with every argument by keyword, in reverse order, equals the positional
    call bitwise."""
    from linalg_prefill.torch_ops import OPS

    spec, extra = CASES["paged_prefill"]
    _host, args = _torch_args(spec)
    names = OPS["paged_prefill"].argument_names
    by_name = dict(zip(names, (*args, *extra)))
    positional = torch.ops.linalg_prefill.paged_prefill(*args, *extra)
    keyword = torch.ops.linalg_prefill.paged_prefill(**dict(reversed(list(by_name.items()))))
    for got, want in zip(keyword, positional):
        assert torch.equal(got, want)
