"""Session fixtures shared by every test: a tiny tokenizer and model built offline, tiny datasets.

Helpers (config kwargs, rewards, builders) live in `tests/helpers.py`; this file puts `tests/` on `sys.path` so
tests import them with `from helpers import tiny_grpo_kwargs, length_reward, answer_reward`.
"""

from __future__ import annotations

import os
import re
import sys

# Offline and quiet, before anything imports transformers or trl. `setdefault` lets a developer override them.
for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TRL_EXPERIMENTAL_SILENCE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "disabled",
}.items():
    os.environ.setdefault(_name, _value)

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import importlib.util

import peak_memory
import pytest
from launching import environment_extension_cache

# DeepSpeed's CPU ranks JIT-build an op into torch's extension cache; a build shared with another environment is
# rebuilt (minutes) whenever the other one used it last, so each environment gets its own (tests/launching.py)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", environment_extension_cache())

# tests/vllm_cpu needs vLLM (`make test-vllm` runs them in their own environment); `make test` does not collect them
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_cpu"]

# FutureWarnings raised by TRL's own helpers (`trl/models/utils.py`) calling deprecated transformers aliases during
# generation; user code cannot avoid them (notes/TRL_1_16.md §6.3, items 2 and 3).
HARMLESS_WARNING_FILTERS = (
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",
    "ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning",
    "ignore:`gradient_checkpointing_disable` is deprecated:FutureWarning",
)


# ------------------------------------------------------------------------------------------------ CPU paths
# `TRINITY_TEST_CPU_PATH` (comma-separated; `make test-cpu-paths` runs each) forces another CPU kernel path for the
# whole session, so that a test passing on this machine's defaults also passes where torch picks other kernels
# (another CPU, another thread count, another SDPA backend). Tolerances come from tests/tolerance.py, not from a path.
CPU_PATH_ENV = "TRINITY_TEST_CPU_PATH"
CPU_PATHS = {
    "mkldnn_off": "torch.backends.mkldnn.enabled = False (oneDNN kernels off: plain ATen/BLAS ones)",
    "threads_1": "torch.set_num_threads(1) everywhere (other blockings and reduction orders)",
    "threads_2": "torch.set_num_threads(2) everywhere, the trainer folders included",
    "math_sdpa": "the math SDPA backend only (flash/memory-efficient/cuDNN SDPA kernels off, CPU flash included)",
}
#: intra-op torch threads of the modules that train the tiny model (`one_torch_thread`); a `threads_N` path sets N
TEST_THREADS = 1


def _cpu_paths() -> list[str]:
    paths = [p.strip() for p in os.environ.get(CPU_PATH_ENV, "").split(",") if p.strip()]
    unknown = [p for p in paths if p not in CPU_PATHS and not re.fullmatch(r"threads_[1-9][0-9]*", p)]
    if unknown:
        raise pytest.UsageError(f"{CPU_PATH_ENV}: unknown CPU path(s) {unknown}; known: {sorted(CPU_PATHS)}")
    return paths


def _force_cpu_paths(paths: list[str]) -> None:
    global TEST_THREADS
    import torch

    for path in paths:
        if path == "mkldnn_off":
            torch.backends.mkldnn.enabled = False
        elif path.startswith("threads_"):
            TEST_THREADS = int(path.removeprefix("threads_"))
            torch.set_num_threads(TEST_THREADS)
            os.environ["OMP_NUM_THREADS"] = str(TEST_THREADS)  # else every config built sets trinity_trl's CPU default
        elif path == "math_sdpa":
            # the global switches behind torch.nn.attention.sdpa_kernel; CPU dispatch reads them too
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_cudnn_sdp(False)
            torch.backends.cuda.enable_math_sdp(True)


def pytest_addoption(parser: pytest.Parser) -> None:
    peak_memory.add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    for line in HARMLESS_WARNING_FILTERS:
        config.addinivalue_line("filterwarnings", line)
    _force_cpu_paths(_cpu_paths())
    peak_memory.register(config)  # each test's peak resident memory, the worst printed at the end


def pytest_report_header(config: pytest.Config) -> str:
    paths = _cpu_paths()
    return f"CPU paths ({CPU_PATH_ENV}): " + (", ".join(paths) if paths else "torch's defaults")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory holding only the tiny BPE tokenizer (vocab 512, ChatML, eos `<|im_end|>`, pad `<|endoftext|>`)."""
    from helpers import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: str) -> str:
    """Directory holding the tiny random Qwen2 and its tokenizer; pass it as `model=` (and to `from_pretrained`)."""
    from helpers import save_tiny_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), tokenizer=tokenizer)


@pytest.fixture
def tiny_tokenizer(tiny_tokenizer_dir: str):
    """A fresh `PreTrainedTokenizerFast` loaded from `tiny_tokenizer_dir` (per test, so tests may mutate it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_dataset():
    """32 conversational rows: `{"prompt": [{"role": "user", "content": "What is 3+4?"}], "answer": "7"}`."""
    from helpers import tiny_conversational_dataset

    return tiny_conversational_dataset(32)


@pytest.fixture(scope="session")
def tiny_text_dataset():
    """32 plain-text rows: `{"prompt": "Question: what is 3+4? Answer:", "answer": "7"}`."""
    from helpers import tiny_plain_text_dataset

    return tiny_plain_text_dataset(32)


@pytest.fixture
def fake_hub(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A local Hub-compatible HTTP server (`tests/fake_hub.py`), with `huggingface_hub` pointed at it.

    Yields the running `FakeHub`: `fake_hub.url` (the endpoint), `fake_hub.files(repo_id) -> {path: bytes}`,
    `fake_hub.commits(repo_id)` (commit titles), `fake_hub.requests` (every `(method, path)` served) and
    `fake_hub.blocked` (URLs of requests that tried to leave for another host; they fail instead).

    For the test's duration: `HF_ENDPOINT`/`constants.ENDPOINT`/`HUGGINGFACE_CO_URL_TEMPLATE` name the fake hub,
    offline mode is off (env and module constant), `HF_TOKEN=hf_dummy`, and `HF_HOME`/the hub cache live under
    `tmp_path/hf_home`, so every `from_pretrained("tester/<repo>")` downloads through the server into a fresh cache.
    Use any `tester/<name>` repo id (`tester` is the fake user), e.g. in a recipe test:

        def test_recipe_pushes(fake_hub, tmp_path):
            main([..., "--push_to_hub", "--hub_model_id", "tester/chord-recipe"])
            assert "adapter_model.safetensors" in fake_hub.files("tester/chord-recipe")

    With `report_to` trackio also pass `trackio_static_space_id=False`: left at None, transformers' Trackio callback
    syncs the project to a static Space and a Bucket on push, which fails here (`tests/test_tracking.py`).
    Subprocesses (e.g. `torchrun`) inherit the environment variables, so they also use the fake hub, but not the
    guard that refuses other hosts.
    """
    from fake_hub import FakeHub
    from huggingface_hub import constants, hf_api
    from huggingface_hub.utils import _http

    hub = FakeHub().start()
    home = tmp_path / "hf_home"
    for name, value in {
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": "hf_dummy",
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_OFFLINE": "0",
    }.items():
        monkeypatch.setenv(name, value)
    template = hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    for name, value in {
        "ENDPOINT": hub.url,
        "HUGGINGFACE_CO_URL_TEMPLATE": template,
        "HF_HUB_OFFLINE": False,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HUGGINGFACE_HUB_CACHE": str(home / "hub"),
        "HF_ASSETS_CACHE": str(home / "assets"),
        "HF_XET_CACHE": str(home / "xet"),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
    }.items():
        monkeypatch.setattr(constants, name, value)
    import transformers.utils.hub as transformers_hub

    # HfApi instances read the endpoint when created: huggingface_hub's module-level one (behind
    # `huggingface_hub.upload_folder` etc.) and transformers' cached one would keep the old endpoint
    monkeypatch.setattr(hf_api.api, "endpoint", hub.url)
    monkeypatch.setattr(transformers_hub, "_hf_api", None)

    # Any request for another host (e.g. a path that still builds a huggingface.co URL) fails at once and is recorded,
    # instead of reaching the network or stalling in retries.
    def only_the_fake_hub(request):
        if not str(request.url).startswith(hub.url + "/"):
            hub.blocked.append(str(request.url))
            raise RuntimeError(f"test tried to reach {request.url} outside the fake hub {hub.url}")

    previous_factory = _http._GLOBAL_CLIENT_FACTORY

    def guarded_client():
        client = previous_factory()
        hooks = client.event_hooks
        hooks["request"] = [only_the_fake_hub, *hooks["request"]]
        client.event_hooks = hooks
        return client

    _http.set_client_factory(guarded_client)
    try:
        yield hub
    finally:
        _http.set_client_factory(previous_factory)
        hub.stop()


# ------------------------------------------------------------------------------------------------ torch threads
# folders (under tests/) whose modules train the tiny model: every module there runs with one intra-op thread
ONE_THREAD_FOLDERS = ("trainers", "reliability")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for the module. The tiny model gains nothing from intra-op threads, and on a shared
    2-core machine OpenMP threads that spin-wait against other processes make a 0.4 s training run take several
    seconds (generation on the real bundled model too: 40 s with one thread or two on an idle machine, > 400 s with
    two against a 2-thread background job, 150 s with one)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)  # 1, or the N of a `threads_N` CPU path
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread_in_trainer_folders(request: pytest.FixtureRequest):
    """`one_torch_thread` for every module of `ONE_THREAD_FOLDERS`; elsewhere a module asks for it by name."""
    if os.path.relpath(request.path, _TESTS_DIR).split(os.sep)[0] in ONE_THREAD_FOLDERS:
        request.getfixturevalue("one_torch_thread")
    yield


@pytest.fixture(autouse=True, scope="session")
def _no_stale_extension_build_lock():
    """DeepSpeed JIT-builds its CPU op under a lock file in torch's extension cache, which every later launch waits on
    forever (torch's FileBaton polls it). A session interrupted mid-build leaves the lock behind; one older than any
    build is removed here, with a line saying so (a launch this session kills cleans up after itself: launching.py)."""
    from launching import STALE_BUILD_LOCK_S, clear_build_locks

    clear_build_locks(older_than_s=STALE_BUILD_LOCK_S)
    yield
