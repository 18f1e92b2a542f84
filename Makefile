# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pip skips byte-compiling the ~11,000 modules it installs (22 of the 43 s a fresh venv took):
# Python writes the bytecode of the modules that run, once, beside them, also where the
# environment sets PYTHONDONTWRITEBYTECODE (docs/test-suite.md).
PIP_INSTALL := $(PY) -m pip install --quiet --no-compile -c constraints.txt
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test test-as test-all bench bench-report gpu-bundle gpu-sweep gpu-session venv clean

venv: $(STAMP)

# The install: uv (the same pins from the same registry and local wheels, unpacked in parallel:
# 13-14 s against pip's 24 s for this venv, 2-core AMD EPYC, docs/test-suite.md), pip where uv
# cannot install. uv reads no pip configuration: it is given pip's find-links (a local CPU build of
# torch on the project's machines; a folder that does not exist is left out: uv would stop there) and
# keeps its cache in the venv, hard-linked to what it installs.
FIND_LINKS = $(foreach links,$(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null),\
	$(if $(or $(findstring ://,$(links)),$(wildcard $(links))),--find-links $(links)))
UV_INSTALL = $(VENV)/bin/uv pip install --quiet --native-tls --cache-dir $(VENV)/uv-cache --python $(PY) \
	$(FIND_LINKS) -c constraints.txt

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	($(PY) -m pip install --quiet --no-compile -c constraints.txt uv && $(UV_INSTALL) -e '.[test,conformance,hf]') || \
	  ($(PY) -m pip install --quiet --no-compile --upgrade pip && $(PIP_INSTALL) -e '.[test,conformance,hf]')
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/linalg-prefill demo

# One pytest-xdist worker per core; tests/conftest.py compiles every declared spec before the tests run.
# `make test JOBS=0` runs in this process alone.
JOBS ?= auto
PYTEST = $(PY) -m pytest -q -n $(JOBS) --dist loadgroup --max-worker-restart=2
test: $(STAMP)
	$(PYTEST)

# The suite as CPU $(CPU) (a named LLVM CPU of pipeline/cpu_tiles.py: znver4, icelake-server,
# znver3, ...) would choose its lowerings and skip its tests, on a host with at least its features:
# `make test-as CPU=znver4` on an Intel Xeon with AMX runs an AMD Zen 4's suite (docs/test-suite.md).
HIDDEN_FOR = $(PY) -c 'import sys, linalg_prefill.pipeline.cpu_tiles as c; print(c.features_to_hide(sys.argv[1]))'
test-as: $(STAMP)
	hidden=$$($(HIDDEN_FOR) '$(CPU)') && LINALG_PREFILL_HIDE_CPU_FEATURES=$$hidden $(PYTEST)

test-all: $(STAMP)
	$(PYTEST) --run-expensive

bench: $(STAMP)
	$(PIP_INSTALL) -e '.[bench]'
	$(PY) bench/dense_prefill.py

# The whole table against torch SDPA, IREE's fused op and the seed's TVM kernels: JSON + PNG
bench-report: $(STAMP)
	$(PIP_INSTALL) -e '.[bench]'
	$(PY) bench/report.py --tvm --out build/bench-report

# CUDA artifacts + the tests' recorded calls + cp312 wheels in build/gpu-bundle, the same for ROCm
# (gfx942, an MI300 host) in build/gpu-bundle-rocm; on the GPU machine: bash gpu_check.sh OUT_DIR
gpu-bundle: $(STAMP)
	rm -rf build/recorded-calls
	LINALG_PREFILL_RECORD_CASES=build/recorded-calls $(PY) -m pytest -q -p no:cacheprovider \
		tests/test_sequence_prefill.py tests/test_kv_cache_prefill.py -k "llvm-cpu and not fused"
	$(PY) bench/gpu_bundle.py --out build/gpu-bundle --recorded build/recorded-calls
	$(PY) bench/gpu_bundle.py --backend rocm --out build/gpu-bundle-rocm --recorded build/recorded-calls

# The CUDA sweep (bench/gpu_sweep.py: candidate configurations of the fused lowering, dense cases) in
# build/gpu-sweep; on the GPU machine, inside it: python3 gpu_runner.py --repeat 10 --log sweep.log
gpu-sweep: $(STAMP)
	$(PY) bench/gpu_sweep.py --out build/gpu-sweep

# Both folders for one device call (bench/gpu_session.sh): the sweep without wheels (it uses the
# bundle's), so that the two travel within a device call's 64 MiB (bench/carry_size.py checks)
gpu-session: gpu-bundle
	$(PY) bench/gpu_sweep.py --out build/gpu-sweep --no-wheels
	$(PY) bench/carry_size.py build/gpu-bundle build/gpu-sweep

clean:
	rm -rf $(VENV) build *.egg-info
