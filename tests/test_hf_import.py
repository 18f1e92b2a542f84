"""Without torch or transformers, importing the integrations names the extra that brings them;
the torch ops need torch only."""

from __future__ import annotations

import subprocess
import sys

import pytest


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
