"""The recipes and the `trinity-trl` command: each recipe trains 2 steps on the tiny model from its YAML config plus
command-line overrides, writes what it promises, and pushes to a (local, fake) Hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trinity_trl.cli import run as cli
from trinity_trl.recipes import RECIPES, bundled_configs, config_path
from trinity_trl.recipes.common import RecipeArguments, load_task, parse, reward_functions, to_task_format
from trinity_trl.recipes.plot import curves
from trinity_trl.recipes.train import algorithm_from

REPO = Path(__file__).resolve().parent.parent

# what makes a bundled CPU config tiny enough for the tiny model and 2 steps
RL_TINY = ["--max_steps", "2", "--num_train_rows", "8", "--num_eval_rows", "4", "--eval_max_new_tokens", "8",
           "--eval_batch_size", "4", "--max_completion_length", "8", "--per_device_train_batch_size", "4",
           "--num_generations", "4", "--lora_r", "4", "--lora_alpha", "8"]
RUNS = {
    "chord": ("chord_cpu", RL_TINY + ["--expert_batch_size", "2", "--num_expert_rows", "8", "--mu_decay_steps", "2"]),
    "cispo": ("cispo_cpu", RL_TINY),
    "sapo": ("sapo_cpu", RL_TINY),
    "train": ("train_cpu", RL_TINY + ["--algorithm", "reinforceplusplus"]),
    "train-sft": ("sft_cpu", ["--max_steps", "2", "--num_expert_rows", "8", "--num_eval_rows", "4",
                              "--eval_max_new_tokens", "8", "--eval_batch_size", "4", "--per_device_train_batch_size", "4",
                              "--lora_r", "4", "--lora_alpha", "8"]),
    "train-dpo": ("dpo_cpu", ["--max_steps", "2", "--num_expert_rows", "8", "--num_eval_rows", "4",
                              "--eval_max_new_tokens", "8", "--eval_batch_size", "4", "--per_device_train_batch_size", "2",
                              "--lora_r", "4", "--lora_alpha", "8"]),
    "step_grpo": ("step_grpo_cpu", ["--max_steps", "2", "--num_tasks", "8", "--max_completion_length", "8",
                                    "--max_env_steps", "2"]),
}
if "ppo" in RECIPES and (REPO / "trinity_trl" / "recipes" / "ppo.py").exists():
    RUNS["ppo"] = ("ppo_cpu", RL_TINY)


def run_recipe(name: str, tiny_model_dir: str, output_dir: Path, *extra: str):
    config, tiny = RUNS[name]
    command = name.split("-")[0]
    return cli([command, "--config", config, "--model_name_or_path", tiny_model_dir, "--output_dir", str(output_dir),
                *tiny, *extra])


@pytest.mark.parametrize("name", list(RUNS))
def test_recipe_trains_two_steps_and_writes_its_outputs(name, tmp_path, tiny_model_dir, capsys):
    trainer = run_recipe(name, tiny_model_dir, tmp_path)
    assert trainer.state.global_step == 2
    files = set(os.listdir(tmp_path))
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "training_log.json",
            "training_curves.png"} <= files, files
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert log["summary"]["global_step"] == 2
    assert [e["step"] for e in log["log_history"] if "loss" in e and "train_runtime" not in e] == [1, 2]
    card = (tmp_path / "README.md").read_text()
    assert "## Algorithm:" in card
    assert "huggingface.co/None" not in card and "(a local model)" in card  # the base model is a local folder
    if name != "step_grpo":  # the arithmetic recipes measure accuracy before and after
        before, after = trainer.accuracy["before"], trainer.accuracy["after"]
        assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0
        assert log["summary"]["accuracy_before"] == before
        assert f"**{before:.3f}** before training, **{after:.3f}** after" in card
        printed = capsys.readouterr().out
        assert "held-out accuracy before training" in printed and "held-out accuracy after training" in printed
        assert f"accuracy {before:.3f} -> {after:.3f}; model, card, training_log.json and plot in {tmp_path}" in printed


def test_chord_recipe_logs_mu_and_both_losses_and_plots_them(tmp_path, tiny_model_dir):
    trainer = run_recipe("chord", tiny_model_dir, tmp_path, "--eval_accuracy", "false")
    panels = curves(trainer.state.log_history)
    assert set(panels) == {"reward", "μ (SFT weight)", "losses"}
    assert {"SFT loss", "RL loss", "total loss"} <= set(panels["losses"])
    steps, mu = panels["μ (SFT weight)"]["mu"]
    assert steps == [1, 2] and mu[0] > mu[1]  # mu decays from 0.9 over mu_decay_steps=2
    assert trainer.accuracy == {"before": None, "after": None}


@pytest.mark.parametrize("name", list(RUNS))
def test_recipe_pushes_adapter_tokenizer_and_card_to_the_hub(name, tmp_path, tiny_model_dir, fake_hub):
    repo = f"tester/{name}-recipe"
    no_eval = [] if name == "step_grpo" else ["--eval_accuracy", "false"]
    run_recipe(name, tiny_model_dir, tmp_path, "--push_to_hub", "--hub_model_id", repo, *no_eval)
    pushed = fake_hub.files(repo)
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "tokenizer_config.json",
            "README.md"} <= set(pushed), sorted(pushed)
    assert "## Algorithm:" in pushed["README.md"].decode()
    local = load_file(tmp_path / "adapter_model.safetensors")
    (tmp_path / "pushed.safetensors").write_bytes(pushed["adapter_model.safetensors"])
    remote = load_file(tmp_path / "pushed.safetensors")
    assert local.keys() == remote.keys() and all(torch.equal(local[k], remote[k]) for k in local)


def test_pushed_recipe_adapter_loads_with_from_pretrained(tmp_path, tiny_model_dir, fake_hub):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = run_recipe("chord", tiny_model_dir, tmp_path, "--push_to_hub", "--hub_model_id", "tester/chord-load",
                         "--eval_accuracy", "false")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), "tester/chord-load")
    trained = {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}
    pulled = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert trained.keys() == pulled.keys() and any(v.abs().sum() > 0 for k, v in trained.items() if "lora_B" in k)
    assert all(torch.equal(trained[k], pulled[k]) for k in trained)


def test_recipe_logs_to_trackio_offline(tmp_path, tiny_model_dir, monkeypatch):
    import sqlite3

    trackio_dir = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    for name, module in list(sys.modules.items()):  # trackio copies its storage path at import
        if name.startswith("trackio"):
            for attr, sub in (("TRACKIO_DIR", ""), ("MEDIA_DIR", "media"), ("ARTIFACTS_DIR", "artifacts")):
                if hasattr(module, attr):
                    monkeypatch.setattr(module, attr, trackio_dir / sub if sub else trackio_dir)
    run_recipe("chord", tiny_model_dir, tmp_path / "out", "--eval_accuracy", "false", "--report_to", "trackio",
               "--project", "recipe-tracking", "--trackio_static_space_id", "false")
    database = trackio_dir / "recipe-tracking.db"
    assert database.exists()
    rows = [json.loads(r[0]) for r in sqlite3.connect(database).execute("SELECT metrics FROM metrics")]
    assert any("train/actor/mu" in row for row in rows)


# ------------------------------------------------------------------------- the command and parsing


def test_cli_lists_recipes_and_configs(capsys):
    cli(["--help"])
    usage = capsys.readouterr().out
    assert all(name in usage for name in RECIPES) and "demo" in usage
    cli(["configs"])
    listed = capsys.readouterr().out.split()
    assert listed == bundled_configs() and {"chord_cpu", "chord_gpu", "cispo_cpu", "sapo_cpu", "step_grpo_cpu"} <= set(listed)


def test_cli_rejects_unknown_recipes_and_configs():
    with pytest.raises(SystemExit) as exit_info:
        cli(["chess"])
    assert exit_info.value.code == 2
    with pytest.raises(FileNotFoundError, match="neither a file nor a bundled config"):
        cli(["chord", "--config", "no_such_config"])


def test_console_script_is_installed_and_exits_zero_after_a_run(tmp_path, tiny_model_dir):
    script = Path(sys.executable).parent / "trinity-trl"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "usage: trinity-trl <recipe>" in result.stdout
    config, tiny = RUNS["sapo"]
    result = subprocess.run([str(script), "sapo", "--config", config, "--model_name_or_path", tiny_model_dir,
                             "--output_dir", str(tmp_path), *tiny, "--max_steps", "1", "--eval_accuracy", "false"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "adapter_model.safetensors").exists()


def test_bundled_configs_resolve_and_every_key_is_an_option():
    from trinity_trl.recipes.step_grpo import StepGRPOScriptArguments
    from trinity_trl.trainers import (
        ChordConfig, CISPOConfig, SAPOConfig, StepGRPOConfig, TrinityConfig, TrinityDPOConfig, TrinitySFTConfig,
    )

    classes = {"chord": ChordConfig, "cispo": CISPOConfig, "sapo": SAPOConfig, "train": TrinityConfig,
               "sft": TrinitySFTConfig, "dpo": TrinityDPOConfig, "step": StepGRPOConfig}
    import yaml

    for name in bundled_configs():
        with open(config_path(name)) as f:
            keys = set(yaml.safe_load(f))
        prefix = name.split("_")[0]
        if prefix == "ppo":
            continue  # its own test file
        script = StepGRPOScriptArguments if prefix == "step" else RecipeArguments
        fields = set(script.__dataclass_fields__) | set(classes[prefix].__dataclass_fields__)
        assert keys - fields <= {"algorithm"}, (name, keys - fields)
        assert config_path(name) == config_path(name + ".yaml")


def test_unknown_yaml_keys_are_errors_not_silently_dropped(tmp_path, tiny_model_dir):
    config = tmp_path / "bad.yaml"
    config.write_text(f"model_name_or_path: {tiny_model_dir}\nuse_cpu: true\nbf16: false\nlerning_rate: 0.1\n")
    with pytest.raises(ValueError, match="unknown options.*lerning_rate"):
        cli(["cispo", "--config", str(config), "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="unknown options.*--bogus"):
        cli(["cispo", "--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false", "--bogus", "1"])


def test_preset_runner_picks_the_algorithm_from_argv_or_yaml(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("algorithm: rloo\n")
    assert algorithm_from(["--config", str(config)]) == "rloo"
    assert algorithm_from(["--config", str(config), "--algorithm", "opmd"]) == "opmd"
    assert algorithm_from(["--algorithm=topr"]) == "topr"
    assert algorithm_from([]) == "grpo"
    with pytest.raises(ValueError, match="unknown algorithm 'grpoo'"):
        algorithm_from(["--algorithm", "grpoo"])


def test_on_policy_distill_teacher_only_with_that_preset(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="only used by the on_policy_distill"):
        cli(["train", "--algorithm", "grpo", "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path),
             "--use_cpu", "--bf16", "false", "--teacher_model_name_or_path", tiny_model_dir])


def test_reward_functions_by_name_or_import_path():
    from trinity_trl.data import arithmetic_reward

    assert reward_functions(["accuracy", "trinity_trl.data:arithmetic_reward"]) == [arithmetic_reward] * 2
    with pytest.raises(ValueError, match="unknown reward function 'speed'"):
        reward_functions(["speed"])
    with pytest.raises(ValueError, match="cannot import reward function"):
        reward_functions(["trinity_trl.data:nope"])


def test_math_verify_reward_accepts_equivalent_forms():
    pytest.importorskip("math_verify", reason="math-verify is in the recipes extra")
    (math_verify,) = reward_functions(["math_verify"])
    scores = math_verify(["So x = 1/2, the answer is $\\frac{1}{2}$", "The answer is 0.5.", "The answer is 3.", "no"],
                         ["0.5", "1/2", "4", "4"])
    assert scores == [1.0, 1.0, 0.0, 0.0]


def test_gsm8k_layout_becomes_prompt_answer_solution(tmp_path):
    from datasets import Dataset

    gsm8k = Dataset.from_list([
        {"question": "Tom has 3 bags of 4 apples. How many apples?", "answer": "3*4=<<3*4=12>>12 apples.\n#### 12"},
        {"question": "A pen costs 1,200 cents.", "answer": "It is 1,200.\n#### 1,200"},
    ])
    rows = to_task_format(gsm8k)
    assert rows[0]["answer"] == "12" and rows[1]["answer"] == "1200"
    assert rows[0]["solution"] == "3*4=12 apples. The answer is 12."
    assert rows[0]["prompt"][0]["role"] == "user" and "Tom has 3 bags" in rows[0]["prompt"][0]["content"]
    with pytest.raises(ValueError, match="needs a 'prompt' column"):
        to_task_format(Dataset.from_list([{"text": "x"}]))


def test_local_dataset_splits_demonstrations_from_rl_prompts(tmp_path):
    data = tmp_path / "gsm"
    data.mkdir()
    for split, count in (("train", 10), ("test", 3)):
        with open(data / f"{split}.jsonl", "w") as f:
            for i in range(count):
                f.write(json.dumps({"question": f"{split} question {i}?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"}) + "\n")
    (args,) = parse((RecipeArguments,), ["--dataset_name", str(data), "--num_expert_rows", "4", "--num_train_rows", "0"])
    task = load_task(args, with_expert=True)
    train_questions = {p[0]["content"] for p in task.train["prompt"]}
    expert_questions = {p[0]["content"] for p in task.expert["prompt"]}
    assert len(task.train) == 6 and len(task.expert) == 4 and not train_questions & expert_questions
    assert len(task.test) == 3 and task.expert[0]["completion"][0]["role"] == "assistant"
    assert load_task(args).expert is None and len(load_task(args).train) == 10


def test_recipe_arguments_reject_bad_values():
    with pytest.raises(ValueError, match="num_eval_rows must be >= 0"):
        RecipeArguments(num_eval_rows=-1)
    with pytest.raises(ValueError, match="at least one reward"):
        RecipeArguments(reward_funcs=[])
    with pytest.raises(ValueError, match="torch_threads must be >= 0, got -1"):
        RecipeArguments(torch_threads=-1)


def test_bundled_task_prompt_style_from_dataset_config():
    (args,) = parse((RecipeArguments,), ["--dataset_config", "system", "--num_train_rows", "4", "--num_eval_rows", "2",
                                         "--num_expert_rows", "2"])
    task = load_task(args, with_expert=True)
    for rows in (task.train, task.test, task.expert):
        assert [m["role"] for m in rows[0]["prompt"]] == ["system", "user"]
    assert [m["role"] for m in load_task(RecipeArguments(num_train_rows=4)).train[0]["prompt"]] == ["user"]
    with pytest.raises(ValueError, match="prompt style, one of .* got 'main'"):
        load_task(RecipeArguments(dataset_config="main"))


def test_repository_recipe_scripts_run_the_cli():
    result = subprocess.run([sys.executable, str(REPO / "recipes" / "chord.py"), "--help"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--mu_peak" in result.stdout and "--num_expert_rows" in result.stdout
    assert (REPO / "recipes" / "configs" / "chord_cpu.yaml").exists()


def test_accelerate_configs_load():
    from accelerate.commands.config.config_args import ClusterConfig

    kinds = {}
    for path in sorted((REPO / "recipes" / "accelerate").glob("*.yaml")):
        config = ClusterConfig.from_yaml_file(str(path))
        kinds[path.stem] = (config.distributed_type.value, (config.deepspeed_config or {}).get("zero_stage"))
    assert kinds == {"ddp": ("MULTI_GPU", None), "fsdp": ("FSDP", None), "zero2": ("DEEPSPEED", 2),
                     "zero3": ("DEEPSPEED", 3)}


def test_recipe_runs_on_two_processes_with_accelerate_launch(tmp_path, tiny_model_dir):
    """What the README's multi-GPU command does, on CPU: `accelerate launch` starts 2 processes of the recipe."""
    config, tiny = RUNS["chord"]
    command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--cpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               str(REPO / "recipes" / "chord.py"), "--config", config, "--model_name_or_path", tiny_model_dir,
               "--output_dir", str(tmp_path), *tiny, "--num_eval_rows", "6"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert log["summary"]["global_step"] == 2
    # the expert rows of both processes were trained: 2 per process per step
    assert [e["chord/expert_rows"] for e in log["log_history"] if "chord/expert_rows" in e] == [2.0, 2.0]
    assert (tmp_path / "adapter_model.safetensors").exists()
    # each process scored its half of the held-out rows; the printed accuracy counts all 6
    assert "held-out accuracy before training" in result.stdout and "(6 problems)" in result.stdout
    before = log["summary"]["accuracy_before"]
    assert before is not None and abs(before * 6 - round(before * 6)) < 1e-9
