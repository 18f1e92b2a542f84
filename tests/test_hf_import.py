"""Without torch or transformers, importing the integrations names the extra that brings them."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("missing", ["torch", "transformers"])
@pytest.mark.parametrize("module", ["linalg_prefill.hf", "linalg_prefill.torch_ops"])
def test_import_without_the_extra_names_it(module, missing):
    code = f"import sys; sys.modules[{missing!r}] = None\ntry:\n    import {module}\nexcept ImportError as e:\n" \
           "    print(e)\nelse:\n    print('imported')"
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'linalg-prefill[hf]'" in printed, printed
