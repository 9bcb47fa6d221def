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

# Everything CI runs: vLLM's CPU venv first (.ci/vllm_venv.sh; about 3 minutes the first time,
# a second after), so the parity tests run rather than skip. A failed install fails the target.
# The 15 slowest tests are listed at the end. Three workers (pytest-xdist), each taking whole test
# files, so a module's servers and fixtures stay in one process (vLLM's files together on one:
# tests/conftest.py). Three on 2 cores because the suite waits on real time (processes starting,
# faults injected for seconds, streams): with two workers it used 1.3 cores on average. On this
# 2-core machine: 268 s with two workers, 205 s with three (1243 passed each).
test: $(NATIVE)
	@start=$$(date +%s); vllm_py=$$(bash .ci/vllm_venv.sh) || exit 1; \
	vllm_py=$$(printf '%s\n' "$$vllm_py" | tail -n 1); \
	echo "vLLM venv: $$vllm_py ($$(( $$(date +%s) - start )) s)"; \
	VLLM_VENV_PYTHON="$$vllm_py" $(BIN)/python -m pytest -q -n 3 --dist loadfile --durations=15 tests

lint: $(STAMP)
	$(BIN)/pip install -q ruff mypy
	$(BIN)/ruff check gateway routing semantic_cache policies vllm_sim bench tests
	$(BIN)/mypy gateway routing semantic_cache policies vllm_sim

clean:
	rm -rf $(VENV) build *.egg-info routing/*.so
