# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all bench bench-report gpu-bundle venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,conformance,hf]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/linalg-prefill demo

# One pytest-xdist worker per core; tests/conftest.py compiles every declared spec before the tests run.
# `make test JOBS=0` runs in this process alone.
JOBS ?= auto
test: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --dist loadgroup

test-all: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --dist loadgroup --run-expensive

bench: $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[bench]'
	$(PY) bench/dense_prefill.py

# The whole table against torch SDPA, IREE's fused op and the seed's TVM kernels: JSON + PNG
bench-report: $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[bench]'
	$(PY) bench/report.py --tvm --out build/bench-report

# CUDA artifacts + the tests' recorded calls + cp312 wheels in build/gpu-bundle, the same for ROCm
# (gfx942, an MI300 host) in build/gpu-bundle-rocm; on the GPU machine: bash gpu_check.sh OUT_DIR
gpu-bundle: $(STAMP)
	rm -rf build/recorded-calls
	LINALG_PREFILL_RECORD_CASES=build/recorded-calls $(PY) -m pytest -q -p no:cacheprovider \
		tests/test_sequence_prefill.py tests/test_kv_cache_prefill.py -k "llvm-cpu and not fused"
	$(PY) bench/gpu_bundle.py --out build/gpu-bundle --recorded build/recorded-calls
	$(PY) bench/gpu_bundle.py --backend rocm --out build/gpu-bundle-rocm --recorded build/recorded-calls

clean:
	rm -rf $(VENV) build *.egg-info
