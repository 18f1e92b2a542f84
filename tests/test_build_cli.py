"""Model configs -> specs, AOT artifact builds with a manifest, and the build/list/show-config/bench CLI."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from linalg_prefill.mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from linalg_prefill.mlir.bundle import function_name, member_symbol
from linalg_prefill.pipeline import COMPILER_VERSION, ArtifactCache, CompileError, Target
from linalg_prefill.pipeline.artifacts import (
    ArtifactError, build_artifacts, fill_cache, load_manifest, verify_artifact,
)
from linalg_prefill.bench import attention_flops
from linalg_prefill.cli import main
from linalg_prefill.pipeline.model_config import load_model_config, specs_for_model
from linalg_prefill.runtime.artifact_set import spec_from_entry

LLVM_CPU = Target("llvm-cpu")

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = CONFIGS / "tiny.toml"


def _by_type(specs) -> dict:
    out: dict = {}
    for spec in specs:
        out.setdefault(type(spec), []).append(spec)
    return out


def test_llama_3_8b_specs():
    cfg = load_model_config(CONFIGS / "llama-3-8b.json")
    assert (cfg.h_q, cfg.h_kv, cfg.head_dim, cfg.v_head_dim, cfg.dtype) == (32, 8, 128, 128, "bfloat16")
    assert cfg.rope_theta == 500000.0 and not cfg.sliding_window and cfg.mla is None
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    specs = _by_type(specs_for_model(cfg))
    assert {t: len(s) for t, s in specs.items()} == {
        RaggedPrefillSpec: 1, PagedPrefillSpec: 1, SequencePrefillSpec: 1, MaskedSequencePrefillSpec: 2}
    ragged, paged = specs[RaggedPrefillSpec][0], specs[PagedPrefillSpec][0]
    assert ragged == RaggedPrefillSpec(32, 8, 128, 128, "bfloat16", cfg.rope_scaling)
    assert paged.fields()["rope_scaling"] == cfg.rope_scaling
    assert (paged.page_size, paged.sliding_window) == (16, False)
    assert specs[SequencePrefillSpec][0] == SequencePrefillSpec(32, 8, 128, "bfloat16", True, 128 ** -0.5)
    assert sorted(s.mask_mode for s in specs[MaskedSequencePrefillSpec]) == ["causal_padded_left", "padded"]


def test_mistral_gets_a_sliding_window_paged_spec():
    cfg = load_model_config(CONFIGS / "mistral-7b.json")
    assert cfg.sliding_window and cfg.rope_scaling == {} and cfg.rope_theta == 10000.0
    paged = [s for s in specs_for_model(cfg) if isinstance(s, PagedPrefillSpec)]
    assert [p.sliding_window for p in paged] == [False, True]
    assert paged[1].symbol == "batch_prefill_paged_kv_sliding_window"
    assert len(specs_for_model(cfg)) == 6


def test_qwen2_window_off_when_use_sliding_window_is_false():
    cfg = load_model_config(CONFIGS / "qwen2-0.5b.json")
    assert (cfg.h_q, cfg.h_kv, cfg.head_dim, cfg.rope_theta) == (14, 2, 64, 1e6)
    assert not cfg.sliding_window and len(specs_for_model(cfg)) == 5


def test_deepseek_v2_lite_is_mla():
    """The model rotates its MLA heads itself: yarn reaches the kernels only as the softmax scale."""
    cfg = load_model_config(CONFIGS / "deepseek-v2-lite.json")
    assert cfg.mla is not None and cfg.rope_scaling == {}
    assert cfg.attention_scale == pytest.approx(192 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2)
    assert specs_for_model(cfg) == [
        RaggedPrefillSpec(16, 16, 192, 128, "bfloat16", rope_scaling={}),
        MlaPagedPrefillSpec(16, 512, 64, "bfloat16", page_size=16),
    ]


def test_tiny_toml_and_overrides():
    cfg = load_model_config(TINY)
    assert (cfg.name, cfg.h_q, cfg.h_kv, cfg.head_dim, cfg.dtype) == ("tiny", 4, 2, 64, "float32")
    specs = specs_for_model(load_model_config(TINY, dtype="float16", page_size=32))
    assert {s.dtype for s in specs} == {"float16"}
    assert [s.page_size for s in specs if isinstance(s, PagedPrefillSpec)] == [32]


HF = {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512, "torch_dtype": "float16"}


@pytest.mark.parametrize("name, change, key", [
    ("missing_heads", {"num_attention_heads": None}, "num_attention_heads"),
    ("bad_kv_heads", {"num_key_value_heads": 3}, "num_key_value_heads"),
    ("bad_dtype", {"torch_dtype": "float8_e4m3fn"}, "torch_dtype"),
    ("no_dtype", {"torch_dtype": None}, "torch_dtype"),
    ("dynamic_rope", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ("longrope_factor_count", {"rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 4096,
                                                "long_factor": [1.0, 2.0], "short_factor": [1.0, 1.0]},
                               "max_position_embeddings": 131072},
     "rope_scaling.short_factor: 2 factors; the rotary dims have 32 pairs"),
    ("alibi", {"alibi": True}, "alibi"),
    ("chunked", {"attention_chunk_size": 8192}, "attention_chunk_size"),
    ("odd_partial", {"partial_rotary_factor": 0.3}, "partial_rotary_factor"),
    ("native_typo", {"h_q": 4, "h_kv": 2, "head_dim": 64, "dtype": "float32", "heads": 4}, "heads"),
    ("native_missing", {"h_q": 4, "h_kv": 2, "dtype": "float32"}, "head_dim"),
    ("native_no_dtype", {"h_q": 4, "h_kv": 2, "head_dim": 64}, "dtype: missing"),
])
def test_bad_config_names_the_key(tmp_path, name, change, key):
    raw = change if "h_q" in change else {k: v for k, v in {**HF, **change}.items() if v is not None}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=key):
        load_model_config(path)


TINY_SPECS = specs_for_model(load_model_config(TINY))
#: The serving passes a build adds for the tiny KV-cache variants (mlir/decode.py).
TINY_PASSES = [pass_spec for spec in TINY_SPECS for pass_spec in LLVM_CPU.serving_passes(spec)]
#: The CUDA build: a spec tests/test_cuda_compile.py compiles too (the session's pre-build).
CUDA_SPEC = SequencePrefillSpec(4, 4, 64, "float16", causal=False, sm_scale=0.125)

#: The module's builds share a cache of its own (one xdist worker runs them all), seeded from the
#: session's pre-built cache with all but the first tiny spec, so the first build compiles one and
#: reuses the others.
pytestmark = [pytest.mark.xdist_group("build_cli"), pytest.mark.compiles(*TINY_SPECS, *TINY_PASSES),
              pytest.mark.compiles(CUDA_SPEC, backends=("cuda",))]


def _seed(cache: ArtifactCache, session_cache: ArtifactCache, specs, target: Target) -> None:
    """Copies the session cache's entries of ``specs`` on ``target`` into ``cache``."""
    for spec in specs:
        for entry in session_cache.root.glob(f"{COMPILER_VERSION}/{target.tag}/{spec.name}-*"):
            if entry.is_dir():
                shutil.copytree(entry, cache.root / COMPILER_VERSION / target.tag / entry.name)


@pytest.fixture(scope="module")
def build_cache(tmp_path_factory, cache) -> ArtifactCache:
    """A cache of this module's own holding the pre-built artifacts of every tiny spec but the
    first (so the first build really compiles one) and of ``CUDA_SPEC``."""
    own = ArtifactCache(tmp_path_factory.mktemp("build-cache"))
    _seed(own, cache, [*TINY_SPECS[1:], *TINY_PASSES], Target("llvm-cpu"))
    _seed(own, cache, [CUDA_SPEC], Target("cuda"))
    return own


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory, build_cache):
    """configs/tiny.toml built for llvm-cpu: (specs, out dir, first report, second report, progress text)."""
    cfg = load_model_config(TINY)
    specs = specs_for_model(cfg)
    assert specs == TINY_SPECS
    out = tmp_path_factory.mktemp("tiny-build")
    first = build_artifacts(specs, ["llvm-cpu"], out, jobs=2, cache=build_cache, progress=False, model=cfg)
    progress = io.StringIO()
    second = build_artifacts(specs, ["llvm-cpu"], out, jobs=2, cache=build_cache, progress=progress, model=cfg)
    return specs, out, first, second, progress.getvalue()


def test_build_writes_verified_manifest(tiny_build, cache):
    specs, out, first, _, _ = tiny_build
    built = [*specs, *TINY_PASSES]  # the variants, then each KV-cache variant's serving passes
    seeded = sum(any(cache.root.glob(f"{COMPILER_VERSION}/llvm-cpu-host/{spec.name}-*")) for spec in built[1:])
    assert (first.compiled, first.reused) == (len(built) - seeded, seeded)  # seeded: pre-built (all but one)
    manifest = load_manifest(out)
    assert manifest["format"] == 1 and manifest["compiler_version"] == COMPILER_VERSION
    assert manifest["model"] == "tiny" and manifest["model_config"]["head_dim"] == 64
    entries = manifest["artifacts"]
    assert [e["variant"] for e in entries] == [s.name for s in built]
    assert [e.get("pass_of") for e in entries] == [None] * len(specs) + [p.base.name for p in TINY_PASSES]
    assert TINY_PASSES and all(spec_from_entry(e) == spec for spec, e in zip(built, entries))
    assert entries[0]["symbol"] == specs[0].symbol   # compiled here, alone
    for spec, entry in zip(built, entries):
        assert entry["spec_type"] == type(spec).__name__
        assert entry["spec"] == spec.fields()
        assert (entry["backend"], entry["target"]) == ("llvm-cpu", "llvm-cpu-host")
        assert "--iree-llvmcpu-target-cpu=host" in entry["flags"]
        assert entry["file"] == f"llvm-cpu-host/{spec.name}.vmfb"
        path = verify_artifact(entry, out)
        assert path.stat().st_size == entry["bytes"] > 0
        # the function it holds (a pre-built one may share a module with kernels of its shape)
        assert entry["symbol"] == function_name(spec, path.read_bytes()) in (spec.symbol, member_symbol(spec))


def test_second_build_compiles_nothing(tiny_build):
    specs, out, first, second, progress = tiny_build
    assert (second.compiled, second.reused) == (0, len(specs) + len(TINY_PASSES))
    assert "0 compiled" in second.summary()
    assert progress.count("cached") == len(specs) + len(TINY_PASSES) and "compiled" not in progress
    assert second.entries == first.entries


def test_fill_cache_builds_pairs_into_the_cache_only(tiny_build, build_cache, tmp_path, monkeypatch):
    """The test suite's pre-build (tests/conftest.py): (spec, target) pairs, each once, from the
    cache the build filled, and no file written anywhere else."""
    specs = tiny_build[0][:2]
    monkeypatch.chdir(tmp_path)
    done = fill_cache([(specs[0], "llvm-cpu"), (specs[1], Target("llvm-cpu")), (specs[0], "llvm-cpu")], jobs=2,
                      cache=build_cache, progress=False)
    assert (done.compiled, done.reused) == (0, 2)
    assert not list(tmp_path.iterdir())
    assert fill_cache([], cache=build_cache).compiled == 0


def test_concurrent_builds_into_one_folder(tiny_build, build_cache, tmp_path):
    specs = tiny_build[0][:2]
    reports, errors = [], []

    def build():
        try:
            reports.append(build_artifacts(specs, ["llvm-cpu"], tmp_path, jobs=1, cache=build_cache, progress=False))
        except Exception as err:  # noqa: BLE001 (reported by the assert below)
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(reports) == 2
    for entry in load_manifest(tmp_path)["artifacts"]:
        verify_artifact(entry, tmp_path)


def test_tampered_artifact_is_bad(tiny_build, tmp_path, capsys):
    out = tmp_path / "copy"
    shutil.copytree(tiny_build[1], out)
    entries = load_manifest(out)["artifacts"]
    with open(out / entries[0]["file"], "r+b") as f:
        f.seek(100)
        f.write(b"\xff\x00\xff")
    (out / entries[1]["file"]).unlink()
    assert main(["list", str(out)]) == 1
    lines = capsys.readouterr().out.splitlines()
    status = {line.split()[0]: line.split()[-1] for line in lines if line.startswith("batch_")}
    assert status[entries[0]["variant"]] == "BAD" and status[entries[1]["variant"]] == "BAD"
    assert status[entries[2]["variant"]] == "ok"
    with pytest.raises(ArtifactError, match="sha256.*linalg-prefill build"):
        verify_artifact(entries[0], out)
    with pytest.raises(ArtifactError, match="missing.*linalg-prefill build"):
        verify_artifact(entries[1], out)


def test_manifest_from_another_compiler_raises(tiny_build, tmp_path, capsys):
    manifest = json.loads((tiny_build[1] / "manifest.json").read_text())
    manifest["compiler_version"] = "0.0.1"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="IREE compiler 0.0.1.*linalg-prefill build"):
        load_manifest(tmp_path)
    assert main(["list", str(tmp_path)]) == 1
    assert "0.0.1" in capsys.readouterr().err
    with pytest.raises(ArtifactError, match="no manifest"):
        load_manifest(tmp_path / "nothing")


def test_cuda_artifact_builds_without_a_gpu(build_cache, tmp_path):
    spec = CUDA_SPEC
    report = build_artifacts([spec], ["cuda"], tmp_path, jobs=1, cache=build_cache, progress=False)
    (entry,) = report.entries
    assert (entry["backend"], entry["target"]) == ("cuda", "cuda-sm_80")
    assert "--iree-cuda-target=sm_80" in entry["flags"]
    verify_artifact(entry, tmp_path)


def test_failed_compile_raises_and_writes_no_manifest(build_cache, tmp_path):
    spec = SequencePrefillSpec(4, 2, 64, "float32", causal=True, sm_scale=0.125)
    broken = Target("llvm-cpu", "host", ("--no-such-iree-flag",))
    with pytest.raises(CompileError, match="1 of 1 artifacts failed"):
        build_artifacts([spec], [broken], tmp_path, jobs=1, cache=build_cache, progress=False)
    assert not (tmp_path / "manifest.json").exists()


def test_cli_build_list_show_config(tiny_build, build_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LINALG_PREFILL_CACHE_DIR", str(build_cache.root))
    monkeypatch.delenv("LINALG_PREFILL_CACHE", raising=False)
    out = tmp_path / "out"
    assert main(["build", "--model", str(TINY), "--backends", "llvm-cpu", "--out", str(out), "--jobs", "2"]) == 0
    captured = capsys.readouterr()
    artifacts = len(TINY_SPECS) + len(TINY_PASSES)
    assert f"{artifacts} artifacts: 0 compiled, {artifacts} reused" in captured.out
    assert captured.err.count("cached") == artifacts
    assert main(["list", str(out)]) == 0
    listing = capsys.readouterr().out
    assert listing.count(" ok") == artifacts and "BAD" not in listing
    assert main(["show-config"]) == 0
    shown = capsys.readouterr().out
    assert f"IREE compiler     {COMPILER_VERSION}" in shown
    assert "device local-task usable" in shown and "device cuda" in shown


def test_cli_build_rejects_a_bad_config(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**HF, "torch_dtype": "int8"}))
    assert main(["build", "--model", str(path), "--backends", "llvm-cpu", "--out", str(tmp_path / "o")]) == 2
    assert "torch_dtype" in capsys.readouterr().err


def test_cli_bench_times_every_artifact(tiny_build, tmp_path, capsys):
    specs, out = tiny_build[0], tiny_build[1]
    report = tmp_path / "bench.json"
    assert main(["bench", str(out), "--backends", "llvm-cpu", "--tokens", "40", "--batch", "2", "--repeat", "1",
                 "--json", str(report)]) == 0
    rows = json.loads(report.read_text())
    assert [r["variant"] for r in rows] == [s.name for s in specs]
    for spec, row in zip(specs, rows):
        assert row["backend"] == "llvm-cpu" and row["ours_ms"] > 0
        assert row["gflops"] == pytest.approx(attention_flops(spec, 2, 40) / row["ours_ms"] / 1e6)
        assert (row["torch_ms"] is None) == (importlib.util.find_spec("torch") is None)
    printed = capsys.readouterr().out
    assert printed.count("llvm-cpu") == len(specs) and f"wrote {len(specs)} rows" in printed
    assert main(["bench", str(out), "--tokens", "0"]) == 2
    assert "--tokens must be at least 1" in capsys.readouterr().err
    assert main(["bench", str(tmp_path / "missing")]) == 2
    assert "no manifest" in capsys.readouterr().err


@pytest.mark.parametrize("mask_mode, causal", [("padded", False), ("causal_padded_left", True)])
def test_bench_flops_count_the_unmasked_pairs(mask_mode, causal):
    spec = MaskedSequencePrefillSpec(8, 2, 64, "float32", mask_mode=mask_mode, sm_scale=0.125)
    tokens = 13
    visible = np.tril(np.ones((tokens, tokens))) if causal else np.ones((tokens, tokens))
    assert attention_flops(spec, 3, tokens) == 3 * visible.sum() * 2 * 8 * (64 + 64)
    mla = MlaPagedPrefillSpec(16, 512, 64, "float32", page_size=16)
    assert attention_flops(mla, 1, tokens) == np.tril(np.ones((tokens, tokens))).sum() * 2 * 16 * (576 + 512)


def test_cli_version(capsys):
    import linalg_prefill

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"linalg-prefill {linalg_prefill.__version__} (IREE compiler ")


@pytest.mark.parametrize("argv, message", [
    (["--cuda-arch", "sm_90"], "--arch 'cuda=sm_90': cuda arch 'sm_90': known archs are sm_80, sm_86"),
    (["--arch", "cuda=sm_90"], "--arch 'cuda=sm_90': cuda arch 'sm_90': known archs are sm_80, sm_86"),
    (["--arch", "metal=m3"], "--arch 'metal=m3': unknown backend 'metal': known backends are llvm-cpu, cuda"),
    (["--arch", "sm_86"], "--arch 'sm_86': expected BACKEND=ARCH"),
    (["--backends", "llvm-cpu, metal"], "--backends 'llvm-cpu, metal': expected comma-separated names"),
])
def test_cli_build_errors_are_one_line(argv, message, tmp_path, capsys):
    code = _exit_code(["build", "--model", str(TINY), "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_cli_build_out_must_be_a_folder_and_configs_name_their_line(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert _exit_code(["build", "--model", str(TINY), "--out", str(afile)]) == 2
    assert f"--out {afile}: is a file" in capsys.readouterr().err and afile.read_text() == "mine"
    bad = tmp_path / "bad.json"
    bad.write_text('{"num_attention_heads": 8,\n "hidden_size": 512,, }')
    assert main(["build", "--model", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert f"{bad}: line 2, column 21: malformed JSON" in capsys.readouterr().err
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text('name = "x"\nh_q = = 4\n')
    assert main(["build", "--model", str(bad_toml), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{bad_toml}: malformed TOML" in err and "line 2" in err


def test_cli_arch_takes_backend_arch_pairs_and_the_old_aliases(monkeypatch, tmp_path):
    from linalg_prefill import cli

    built = []
    monkeypatch.setattr(cli, "_build", lambda args: built.append(args.arch) or 0)
    base = ["build", "--model", str(TINY), "--out", str(tmp_path / "o")]
    assert main(base) == 0
    assert main([*base, "--arch", "cuda=sm_86", "--cpu", "x86-64-v3", "--arch", " llvm-cpu = znver4 "]) == 0
    assert main([*base, "--cuda-arch", "sm_120"]) == 0
    assert built == [{}, {"cuda": "sm_86", "llvm-cpu": "znver4"}, {"cuda": "sm_120"}]


def test_cli_backends_tolerate_spaces():
    from linalg_prefill.cli import backend_list

    assert backend_list(" llvm-cpu , cuda,") == ["llvm-cpu", "cuda"]


def test_cli_check_strict_fails_when_a_backend_did_not_run(tiny_build, capsys):
    out = tiny_build[1]
    assert main(["check", str(out), "--backends", "llvm-cpu, cuda"]) == 0
    assert "requested but not run: cuda (--strict makes this a failure)" in capsys.readouterr().out
    assert main(["check", str(out), "--backends", "llvm-cpu,cuda", "--strict"]) == 1
    assert "error: requested but not run: cuda" in capsys.readouterr().out
    assert main(["check", str(out), "--backends", "llvm-cpu", "--strict"]) == 0


def test_cli_show_config_says_why_a_device_is_unusable(capsys, monkeypatch):
    from linalg_prefill.runtime import devices

    monkeypatch.setattr(devices, "device_problem", lambda driver: None if driver == "local-task" else "no GPU driver")
    assert main(["show-config"]) == 0
    assert "device cuda       not usable: no GPU driver" in capsys.readouterr().out


def test_cli_bench_table_is_aligned(tiny_build, capsys):
    assert main(["bench", str(tiny_build[1]), "--backends", "llvm-cpu", "--tokens", "8", "--repeat", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    header, rows = lines[0], lines[1:]
    assert rows and all(row.index(" llvm-cpu ") + 1 == header.index("backend") for row in rows), lines
    assert len({len(line) for line in lines}) == 1, lines


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as done:  # argparse errors
        return done.code


DEMO_SPEC = SequencePrefillSpec(4, 2, 64, "float32", causal=True, sm_scale=0.125)


@pytest.mark.compiles(DEMO_SPEC)
def test_demo_reports_progress_on_stderr(monkeypatch, cache, capsys):
    """The progress line comes before each build, compiled or cached (here pre-built)."""
    from linalg_prefill import demo
    from linalg_prefill.runtime import reference

    spec = DEMO_SPEC
    q, k, v = (np.random.default_rng(0).uniform(-1, 1, (1, 9, h, 64)).astype(np.float32) for h in (4, 2, 2))
    want = reference.batch_sequence_prefill_kv(q, k, v, causal=True, sm_scale=0.125)
    monkeypatch.setattr(demo, "_demo_cases", lambda: iter([(spec, (q, k, v), want)]))
    monkeypatch.setenv("LINALG_PREFILL_CACHE_DIR", str(cache.root))
    assert demo.run_demo(("llvm-cpu",)) == 0
    captured = capsys.readouterr()
    assert "[1/1] batch_sequence_prefill_kv (float32) for llvm-cpu" in captured.err
    assert "all within their error bounds" in captured.out


@pytest.mark.compiles(TINY_SPECS[1])
def test_build_variants_builds_only_those_and_names_the_known_ones(tmp_path, monkeypatch, capsys, cache):
    monkeypatch.setenv("LINALG_PREFILL_CACHE_DIR", str(cache.root))
    paged = TINY_SPECS[1]
    assert paged.symbol == "batch_prefill_paged_kv"
    out = tmp_path / "paged"
    argv = ["build", "--model", str(TINY), "--backends", "llvm-cpu", "--out", str(out)]
    assert main([*argv, "--variants", paged.symbol]) == 0
    assert [entry["variant"] for entry in load_manifest(out)["artifacts"]] == \
        [paged.name, *(p.name for p in LLVM_CPU.serving_passes(paged))]
    capsys.readouterr()
    assert main([*argv, "--variants", "batch_prefill_paged_kv,batch_decode"]) == 2
    err = capsys.readouterr().err
    assert "--variants: batch_decode not among tiny's variants (batch_prefill_ragged_kv, batch_prefill_paged_kv," in err


def test_an_aot_kernel_takes_its_serving_passes_from_the_folder(tiny_build, tmp_path, monkeypatch):
    """A KV-cache kernel from a build folder runs its short entries in the folder's serving
    passes, compiling nothing; from a folder without them (aot_only), every entry runs in the
    kernel itself. Both match the reference."""
    from conftest import assert_matches_reference
    from linalg_prefill.pipeline import compiler
    from linalg_prefill.runtime import open_artifacts
    from linalg_prefill.runtime.examples import example_inputs

    _, out, *_ = tiny_build
    paged = TINY_SPECS[1]
    monkeypatch.setattr(compiler, "compile_ir", lambda *args, **kwargs: pytest.fail("compiled a serving pass"))
    args = example_inputs(paged, np.random.default_rng(3), [(1, 40), (3, 17), (9, 30), (20, 50)], rotary_mode=0)
    without = tmp_path / "without-passes"
    shutil.copytree(out, without)
    manifest = load_manifest(without)
    manifest["artifacts"] = [entry for entry in manifest["artifacts"] if "pass_of" not in entry]
    (without / "manifest.json").write_text(json.dumps(manifest))
    for folder, want in ((out, [p.queries for p in LLVM_CPU.serving_passes(paged)]), (without, [])):
        kernel = open_artifacts(folder, "llvm-cpu", aot_only=True).kernel(paged)
        ran = []
        run_decode = kernel._run_decode
        monkeypatch.setattr(kernel, "_run_decode", lambda queries, *call, **kw: ran.append(queries) or run_decode(queries, *call, **kw))
        assert_matches_reference(f"{folder.name}", kernel(*args), paged, args)
        assert sorted(set(ran)) == want
