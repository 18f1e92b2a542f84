"""Without torch or transformers, importing the integrations names the extra that brings them;
the torch ops need torch only."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from linalg_prefill.mlir import PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec


def _import_without(module: str, missing: str) -> str:
    """What importing ``module`` prints with ``missing`` unimportable: the error, or 'imported'."""
    code = f"import sys; sys.modules[{missing!r}] = None\ntry:\n    import {module}\nexcept ImportError as e:\n" \
           "    print(e)\nelse:\n    print('imported')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("module, missing", [("linalg_prefill.hf", "torch"), ("linalg_prefill.hf", "transformers"),
                                             ("linalg_prefill.torch_ops", "torch")])
def test_import_without_the_extra_names_it(module, missing):
    printed = _import_without(module, missing)
    assert "pip install 'linalg-prefill[hf]'" in printed, printed


def test_torch_ops_import_without_transformers():
    assert _import_without("linalg_prefill.torch_ops", "transformers").strip() == "imported"


#: The kernels the clean-exit script opens (declared, so the pre-build compiles them; the script
#: rebuilds each from its repr): test_malformed_catalogue's and test_fuzz's, with their passes.
EXIT_SPECS = (SequencePrefillSpec(4, 2, 32, "float32", causal=True, sm_scale=32 ** -0.5),
              PagedPrefillSpec(4, 2, 32, "float32", page_size=4))


@pytest.mark.compiles(*EXIT_SPECS, RaggedPrefillSpec(4, 2, 16, 16, "float32", kv_order="hnd"),  # the tiny model's
                      passes=[(4, 4), (1, 5)])
def test_a_script_on_the_integration_exits_without_leak_reports(cache):
    """A script that imports linalg_prefill.hf, runs a dense and a paged kernel and a tiny model's
    generate on the adapter exits 0 with nothing about leaks on stderr: the library releases
    what it holds of IREE at exit (runtime/kernels.py: release_shared), before nanobind checks
    (it printed 75-153 lines of "leaked" reports)."""
    tests = os.path.dirname(__file__)
    code = "\n".join([
        f"import sys; sys.path.insert(0, {tests!r})",
        "import numpy as np, torch",
        "from linalg_prefill import hf",
        "from linalg_prefill.mlir import PagedPrefillSpec, SequencePrefillSpec",
        "from linalg_prefill.runtime import shared_kernel",
        "from linalg_prefill.runtime.examples import example_inputs",
        *(f"shared_kernel({spec!r})(*example_inputs({spec!r}, np.random.default_rng(0)))" for spec in EXIT_SPECS),
        "from hf_models import tiny_model",
        "model = tiny_model('llama3', attn_implementation=hf.register())",
        "ids = torch.tensor([[1, 5, 9, 3]])",
        "model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)",
        "print('ran')",
    ])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip().endswith("ran"), result.stderr[-3000:]
    assert "leak" not in result.stderr, result.stderr[-3000:]
