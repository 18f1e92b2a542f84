"""The README's Python examples run as written (they break when the API they show changes)."""

import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _readme_specs() -> list:
    """The specs the README's examples construct (calls without parentheses inside; ``llama3`` is
    the README's dict, tests/support.py's LLAMA3), and the 4-query decode pass its MLA call takes."""
    import linalg_prefill.mlir as specs
    from linalg_prefill.mlir.decode import DecodeSpec
    from support import LLAMA3

    found = [eval(call, {**vars(specs), "llama3": LLAMA3})  # noqa: S307 - our own README
             for block in BLOCKS for call in re.findall(r"\b\w+PrefillSpec\([^()]*\)", block)]
    return found + [DecodeSpec(spec, 4) for spec in found if isinstance(spec, specs.MlaPagedPrefillSpec)]


def _batching_specs() -> list:
    """The kernels the README's generate_batch opens (linalg_prefill/hf_batching.py): the NHD
    paged one of transformers' default pages (256 tokens) with its 1-query pass, the ragged one
    of the first chunks."""
    from linalg_prefill.mlir import PagedPrefillSpec, RaggedPrefillSpec
    from linalg_prefill.mlir.decode import DecodeSpec

    paged = PagedPrefillSpec(4, 2, 16, "float32", page_size=256, kv_order="nhd")
    return [paged, DecodeSpec(paged), RaggedPrefillSpec(4, 2, 16, 16, "float32")]


@pytest.mark.compiles(*_readme_specs(), *_batching_specs())
def test_readme_examples_run_and_agree_with_the_reference():
    blocks = BLOCKS
    assert len(blocks) >= 5
    dense = {}
    exec(blocks[0], dense)  # noqa: S102 - our own README
    bound, got, want = dense["bound"], (dense["output"], dense["lse"]), (dense["want"], dense["want_lse"])
    assert bound.holds(got, want) and bound.worst(got, want) > 0  # within the bound, and not exactly equal
    kv = {}
    exec(blocks[1], kv)  # noqa: S102
    assert kv["output"].shape == (25, 32, 128) and np.isfinite(kv["output"]).all()
    wrappers = {}
    exec(blocks[2], wrappers)  # noqa: S102
    assert wrappers["prefix_output"].shape == (25, 32, 128) and np.isfinite(wrappers["output"]).all()
    more = {}
    exec(blocks[3], more)  # noqa: S102
    assert more["dense_output"].shape == (2, 48, 8, 64) and more["masked_lse"].shape == (2, 48, 8)
    assert more["mla_output"].shape == (4, 16, 512) and np.isfinite(more["mla_output"]).all()
    compared = {}
    exec(blocks[4], compared)  # noqa: S102
    assert compared["report"].ok and "llvm-cpu" in compared["report"].ran
    model = {}
    exec(blocks[5], model)  # noqa: S102
    assert model["tokens"].shape == (2, 10)
    assert len(model["new_tokens"]) == 2 and all(1 <= len(tokens) <= 4 for tokens in model["new_tokens"].values())
