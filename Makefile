# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,conformance]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/linalg-prefill demo

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q --run-expensive

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/dense_prefill.py

clean:
	rm -rf $(VENV) build *.egg-info
