"""Several specs' modules as one module (``bundled``): a kernel and its serving passes compile in one
iree-compile run, which takes 17-23% less CPU time than compiling them one by one (each run pays
its own start and pipeline setup; on one CPU, `taskset -c 1`: paged bf16 h 32/8 d 128 and its
three passes 5.78 -> 4.80 s, paged f32 h 4/2 d 16 6.01 -> 4.62 s; docs/test-suite.md). The vmfb
then holds every member's function under its own symbol (``spec.symbol``, distinct among a
kernel's passes), and serves each member as its own vmfb would.

Kernels of one shape (variant, heads, head dims, dtype: the test suite's pre-build,
pipeline/compiler.py: bundle_tasks) share most of their dispatches (RoPE, gathers, the passes'
merges), which IREE compiles once per module: seven paged f32 h 4/2 d 16 kernels of the
linalg lowering with their passes compiled in 28.2 s one kernel at a time, 11.7 s as one module;
six x86 paged f32 h 8/2 d 64 kernels 14.0 -> 8.1 s (one CPU; docs/test-suite.md). Their public
functions share names (``batch_prefill_paged_kv``), so in such a module each member's is
renamed :func:`member_symbol` (``symbols``), and the entries of hand-written dispatches that
another member took already get a suffix (IREE links a target's dispatches into one library).
:func:`function_name` gives the function a vmfb holds for a spec.
"""

from __future__ import annotations

import hashlib
import re

from .ir import ir, module_context


class NotBundled(ValueError):
    """The modules cannot share one module (two public functions of one name, or module
    attributes that differ); compile them one by one."""


def member_symbol(spec) -> str:
    """The name of ``spec``'s function in a module it shares with kernels of its shape:
    ``spec.symbol`` and 12 hex digits of its name (unique among specs: the cache's and the
    artifact sets' file names)."""
    return f"{spec.symbol}__{hashlib.sha1(spec.name.encode()).hexdigest()[:12]}"


def function_name(spec, vmfb: bytes) -> str:
    """The function of ``spec`` in ``vmfb``: :func:`member_symbol` where the vmfb holds it (a
    module of kernels of one shape), else ``spec.symbol``."""
    member = member_symbol(spec)
    return member if member.encode() in vmfb else spec.symbol


def bundled(texts: list[str], symbols: list[str] | None = None) -> str:
    """One module holding every operation of the modules ``texts`` (their printed IR): the
    first module as it is, then each other module's top-level operations, a symbol that is
    already taken (a hand-written executable's, a private function's) renamed with its uses in
    its own module, and so is a hand-written dispatch's entry another module's took. Public
    functions keep their names (NotBundled where two share one), or with ``symbols`` (one a
    module) each module's public function is renamed to its own."""
    if symbols is not None:
        texts = [_public_renamed(text, symbol) for text, symbol in zip(texts, symbols, strict=True)]
    entries: set[str] = set()
    texts = [_entries_renamed(text, index, entries) for index, text in enumerate(texts)]
    with module_context():
        merged = ir.Module.parse(texts[0])
        names = {_name(op) for op in merged.body.operations} - {None}
        for index, text in enumerate(texts[1:], start=1):
            module = ir.Module.parse(text)
            if str(module.operation.attributes) != str(merged.operation.attributes):
                raise NotBundled(f"module {index}'s attributes differ from the first module's")
            for op in list(module.body.operations):
                name = _name(op)
                if name in names:
                    if _public_function(op):
                        raise NotBundled(f"two public functions named {name}")
                    renamed = _free(f"{name}_{index}", names)
                    ir.SymbolTable.replace_all_symbol_uses(name, renamed, module.operation)
                    ir.SymbolTable.set_symbol_name(op, renamed)
                    name = renamed
                names.add(name)
            end = ir.InsertionPoint(merged.body)
            for op in list(module.body.operations):
                end.insert(op.detach_from_parent())
        merged.operation.verify()
        return str(merged)


def _name(op) -> str | None:
    attribute = op.attributes["sym_name"] if "sym_name" in op.attributes else None
    return None if attribute is None else ir.StringAttr(attribute).value


def _public_function(op) -> bool:
    visibility = op.attributes["sym_visibility"] if "sym_visibility" in op.attributes else None
    return op.operation.name.endswith(".func") and (visibility is None or ir.StringAttr(visibility).value == "public")


def _free(name: str, taken: set) -> str:
    candidate, n = name, 0
    while candidate in taken:
        n += 1
        candidate = f"{name}_{n}"
    return candidate


_PUBLIC_FUNCTION = re.compile(r"^  (?:func\.func|util\.func public) @(\w+)\(", re.MULTILINE)
_ENTRY = re.compile(r"stream\.executable\.export public @(\w+)")


def _public_renamed(text: str, symbol: str) -> str:
    """``text`` with its one public function (and its uses) named ``symbol``."""
    names = set(_PUBLIC_FUNCTION.findall(text))
    if len(names) != 1:
        raise NotBundled(f"a module with {len(names)} public functions cannot take the name {symbol}")
    return re.sub(rf"@{names.pop()}\b", f"@{symbol}", text)


def _entries_renamed(text: str, index: int, taken: set) -> str:
    """``text`` with each hand-written dispatch entry whose name is in ``taken`` renamed
    (``<entry>_<index>``, free), its export, function and dispatches alike; the names added to
    ``taken``."""
    for entry in sorted(set(_ENTRY.findall(text))):
        if entry in taken:
            renamed = _free(f"{entry}_{index}", taken)
            text = re.sub(rf"@{entry}\b", f"@{renamed}", text)
            entry = renamed
        taken.add(entry)
    return text
