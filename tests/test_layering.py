"""Imports run one way: mlir <- pipeline <- runtime <- the front ends (cli, demo, bench, and the
torch/transformers integrations hf and torch_ops, and the context-parallel distributed).

Every module of the package is parsed (nothing is imported); an import of a later layer from an
earlier one, at module level or inside a function, fails the test with the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Source folder -> the package it installs as (pyproject.toml's package-dir).
PACKAGES = {"mlir": "linalg_prefill.mlir", "pipeline": "linalg_prefill.pipeline", "runtime": "linalg_prefill.runtime",
            "linalg_prefill": "linalg_prefill"}
#: Layer of each module: the subpackages in order, then the front ends. The package's own
#: ``__init__`` (version, logging) imports no layer and any layer may read it.
LAYERS = {"linalg_prefill.mlir": 0, "linalg_prefill.pipeline": 1, "linalg_prefill.runtime": 2,
          "linalg_prefill.cli": 3, "linalg_prefill.demo": 3, "linalg_prefill.bench": 3, "linalg_prefill.hf": 3,
          "linalg_prefill.hf_batching": 3, "linalg_prefill.hf_model_arguments": 3,
          "linalg_prefill.torch_ops": 3, "linalg_prefill.distributed": 3}


def layer_of(module: str) -> int | None:
    """The layer of a ``linalg_prefill`` module name (None: the package itself or not ours)."""
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, a module of ``package``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.append((node.lineno, name))
            if not node.module:  # ``from . import reference`` names modules
                found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return found


def upward_imports(source: str, module: str, package: str) -> list[str]:
    """``line: module -> imported`` for each import of a later layer than ``module``'s."""
    own = layer_of(module)
    if own is None:
        own = -1  # linalg_prefill/__init__.py: may import no layer at all
    return [f"{line}: {module} -> {name}" for line, name in imported_modules(source, package)
            if layer_of(name) is not None and layer_of(name) > own]


def _modules():
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            module = package if path.stem == "__init__" else f"{package}.{path.stem}"
            yield path, module, package


@pytest.mark.parametrize("path, module, package", list(_modules()), ids=lambda v: str(v).rsplit("/", 1)[-1])
def test_no_module_imports_a_later_layer(path, module, package):
    assert not upward_imports(path.read_text(), module, package), path


def test_the_check_finds_an_upward_import():
    """Relative and absolute, at module level and inside a function."""
    source = "from ..runtime import open_kernel\n\ndef f():\n    import linalg_prefill.cli\n    from . import ir\n"
    assert upward_imports(source, "linalg_prefill.mlir.specs", "linalg_prefill.mlir") == [
        "1: linalg_prefill.mlir.specs -> linalg_prefill.runtime",
        "4: linalg_prefill.mlir.specs -> linalg_prefill.cli"]
    assert upward_imports("from .runtime import reference\n", "linalg_prefill", "linalg_prefill")
    assert not upward_imports("from ..mlir.specs import DTYPES\n", "linalg_prefill.pipeline.cache",
                              "linalg_prefill.pipeline")
