"""The CPU line every bench prints first (linalg_prefill/bench.py: cpu_description): the figures
of a bench are only comparable on the CPU named with them (AMX or not picks the lowering)."""

from __future__ import annotations

import os
import re

import linalg_prefill.bench as bench
from linalg_prefill.pipeline.cpu_tiles import AMX_FEATURES, host_cpu_features


def _cpuinfo_field(name: str) -> str:
    with open("/proc/cpuinfo") as info:
        for line in info:
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    return "?"


def test_the_cpu_line_names_the_model_its_vectors_amx_and_the_cores():
    line = bench.cpu_description()
    amx = "yes" if AMX_FEATURES <= host_cpu_features() else "no"
    if os.path.exists("/proc/cpuinfo"):
        assert line.startswith(_cpuinfo_field("model name"))
        assert f"(model {_cpuinfo_field('model')};" in line
    assert re.search(rf"; (avx512|avx2|no avx2), AMX {amx}; {os.cpu_count()} cores\)$", line), line


def test_a_cpu_without_amx_tiles_says_so(monkeypatch):
    monkeypatch.setattr(bench, "host_cpu_features", lambda: frozenset({"avx2", "avx512f"}))
    assert "AMX no" in bench.cpu_description()
    monkeypatch.setattr(bench, "host_cpu_features", lambda: frozenset(AMX_FEATURES | {"avx512f"}))
    assert "AMX yes" in bench.cpu_description()
