# Two commands: `make run` starts kvgate on embedded defaults, `make test` runs the whole suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The routing decision's modules compiled by mypyc (routing/_native.py), redone when routing changes.
NATIVE := $(VENV)/.compiled

.PHONY: run test install bench lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of PyTorch first, so sentence-transformers does not pull a CUDA build.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test,bench]"
	touch $(STAMP)

$(NATIVE): $(STAMP) setup.py $(wildcard routing/*.py)
	$(BIN)/python setup.py -q build_ext --inplace
	touch $(NATIVE)

install: $(NATIVE)

run: $(NATIVE)
	$(BIN)/kvgate demo

test: $(NATIVE)
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/pip install -q ruff mypy
	$(BIN)/ruff check gateway routing semantic_cache policies vllm_sim bench tests
	$(BIN)/mypy gateway routing semantic_cache policies vllm_sim

clean:
	rm -rf $(VENV) build *.egg-info routing/*.so
