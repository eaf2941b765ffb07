"""recipes/common.py: parsing (YAML + overrides, no abbreviations, unknown keys with suggestions, help), the task
data and rewards, and the output-folder guard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launching import scaled_timeout

from trinity_trl.recipes import bundled_configs, config_path, config_summary
from trinity_trl.recipes.common import (
    RecipeArguments,
    UsageError,
    check_output_dir,
    load_task,
    parse,
    read_config,
    reward_functions,
    save_outputs,
    to_task_format,
)
from trinity_trl.trainers import ChordConfig, CISPOConfig

REPO = Path(__file__).resolve().parent.parent.parent


def test_bundled_configs_resolve_and_every_key_is_an_option():
    from trinity_trl.recipes.step_grpo import StepGRPOScriptArguments
    from trinity_trl.recipes.train import TrainArguments
    from trinity_trl.trainers import (
        PPOConfig,
        SAPOConfig,
        StepGRPOConfig,
        TrinityConfig,
        TrinityDPOConfig,
        TrinitySFTConfig,
    )

    classes = {
        "chord": ChordConfig,
        "cispo": CISPOConfig,
        "sapo": SAPOConfig,
        "train": TrinityConfig,
        "sft": TrinitySFTConfig,
        "dpo": TrinityDPOConfig,
        "step": StepGRPOConfig,
        "ppo": PPOConfig,
    }
    import yaml

    for name in bundled_configs():
        with open(config_path(name)) as f:
            keys = set(yaml.safe_load(f))
        prefix = name.split("_")[0]
        script = StepGRPOScriptArguments if prefix == "step" else TrainArguments
        fields = set(script.__dataclass_fields__) | set(classes[prefix].__dataclass_fields__)
        assert keys - fields <= {"algorithm"}, (name, keys - fields)
        assert config_path(name) == config_path(name + ".yaml")
        summary = config_summary(name)
        assert summary["recipe"] in ("chord", "cispo", "sapo", "ppo", "train", "step_grpo"), (name, summary)
        assert summary["purpose"] and summary["model"] and summary["task"], (name, summary)


def test_config_names_get_a_suggestion():
    with pytest.raises(
        UsageError, match=r"'chord_cpx' is neither a file nor a bundled config \(did you mean chord_cpu\?\)"
    ):
        config_path("chord_cpx")


def test_unknown_yaml_keys_and_options_are_errors_with_suggestions(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("use_cpu: true\nbf16: false\nlerning_rate: 0.1\n")
    with pytest.raises(
        UsageError, match=r"unknown key lerning_rate \(did you mean learning_rate\?\) in \S*bad\.yaml: not an option"
    ):
        parse((RecipeArguments, CISPOConfig), ["--config", str(config), "--output_dir", str(tmp_path)], "cispo")
    with pytest.raises(UsageError, match=r"--mu_peek \(did you mean --mu_peak\?\)"):
        parse((RecipeArguments, ChordConfig), ["--output_dir", str(tmp_path), "--mu_peek", "0.5"], "chord")
    with pytest.raises(UsageError, match=r"--bogus"):
        parse((RecipeArguments, CISPOConfig), ["--output_dir", str(tmp_path), "--bogus", "1"], "cispo")


def test_the_removed_spellings_of_0_1_name_their_replacement(tmp_path):
    """Issue 37 item 2: a YAML key or a command-line option that 0.2 removed is one line giving the new spelling."""
    config = tmp_path / "old.yaml"
    config.write_text("use_cpu: true\nbf16: false\nclip_range_high: 5.0\n")
    with pytest.raises(
        UsageError,
        match=r"^CISPOConfig: clip_range_high was removed in trinity_trl 0.2; write policy_loss=\{'clip_range_high'",
    ):
        parse((RecipeArguments, CISPOConfig), ["--config", str(config), "--output_dir", str(tmp_path)], "cispo")
    with pytest.raises(
        UsageError, match=r"^ChordConfig: policy_loss_fn_args was removed .*--policy_loss.argument value"
    ):
        parse(
            (RecipeArguments, ChordConfig),
            ["--output_dir", str(tmp_path), "--policy_loss_fn_args", '{"mu_peak": 0.5}'],
            "chord",
        )


def test_options_are_never_abbreviated(tmp_path):
    """argparse would take --max_step for --max_steps; a recipe must not."""
    with pytest.raises(UsageError, match=r"--max_step \(did you mean --max_steps\?\)"):
        parse((RecipeArguments, CISPOConfig), ["--output_dir", str(tmp_path), "--max_step", "2"], "cispo")
    _, config = parse((RecipeArguments, CISPOConfig), ["--output_dir", str(tmp_path), "--max_steps", "2"], "cispo")
    assert config.max_steps == 2


def test_config_may_be_named_or_a_path_and_options_override_it(tmp_path):
    args, config = parse(
        (RecipeArguments, ChordConfig),
        ["--config", "chord_cpu", "--output_dir", str(tmp_path), "--mu_peak", "0.5"],
        "chord",
    )
    assert config.mu_peak == 0.5 and config.mu_valley == 0.05 and args.model_name_or_path == "bundled"
    _, again = parse(
        (RecipeArguments, ChordConfig), [f"--config={config_path('chord_cpu')}", "--output_dir", str(tmp_path)], "chord"
    )
    assert again.mu_peak == 0.9


def test_help_shows_config_and_the_recipes_own_options_first(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse((RecipeArguments, ChordConfig), ["--help"], "chord", "CHORD recipe.")
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: trinity-trl chord [--config FILE|NAME]")
    lines = text.splitlines()
    config_at = next(i for i, line in enumerate(lines) if line.strip().startswith("--config"))
    own_at = next(i for i, line in enumerate(lines) if line.strip() == "--mu_peak")
    assert config_at < own_at and "--learning_rate" not in "\n".join(lines[:-1])  # inherited ones only named at the end
    assert "--help-all" in lines[-1] and len(lines) < 200
    with pytest.raises(SystemExit):
        parse((RecipeArguments, ChordConfig), ["--help-all"], "chord")
    full = capsys.readouterr().out
    assert "--learning_rate" in full and "--mu_peak" in full and len(full.splitlines()) > 500


def test_output_dir_holding_files_needs_overwrite(tmp_path):
    (tmp_path / "old.txt").write_text("x")
    args, config = parse((RecipeArguments, CISPOConfig), ["--output_dir", str(tmp_path)], "cispo")
    with pytest.raises(UsageError, match="already holds 1 file .*--overwrite_output_dir"):
        check_output_dir(args, config)
    args, config = parse(
        (RecipeArguments, CISPOConfig), ["--output_dir", str(tmp_path), "--overwrite_output_dir", "true"], "cispo"
    )
    check_output_dir(args, config)
    args, config = parse((RecipeArguments, CISPOConfig), ["--output_dir", str(tmp_path / "new")], "cispo")
    check_output_dir(args, config)


def test_save_steps_without_a_save_strategy_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"save_steps=1(\.0)? writes no checkpoint with save_strategy='no'"):
        parse(
            (RecipeArguments, CISPOConfig),
            ["--config", "cispo_cpu", "--output_dir", str(tmp_path), "--save_steps", "1"],
            "cispo",
        )
    _, config = parse(
        (RecipeArguments, CISPOConfig),
        ["--config", "cispo_cpu", "--output_dir", str(tmp_path), "--save_steps", "1", "--save_strategy", "steps"],
        "cispo",
    )
    assert config.save_steps == 1


def test_reward_functions_by_name_or_import_path():
    from trinity_trl.data import arithmetic_reward

    assert reward_functions(["accuracy", "trinity_trl.data:arithmetic_reward"]) == [arithmetic_reward] * 2
    with pytest.raises(ValueError, match="unknown reward function 'speed'"):
        reward_functions(["speed"])
    with pytest.raises(ValueError, match="cannot import reward function"):
        reward_functions(["trinity_trl.data:nope"])
    with pytest.raises(ValueError, match=r"unknown reward function 'mine\.py'; name the function in it: 'mine\.py:<f"):
        reward_functions(["mine.py"])


def test_reward_function_from_a_file_in_the_working_folder_or_a_path(tmp_path, monkeypatch):
    """`--reward_funcs my_rewards:fn` with my_rewards.py beside the user (issue 35: the console script does not put
    the working folder on the Python path, so it failed with "No module named 'my_rewards'")."""
    (tmp_path / "my_rewards_35.py").write_text(
        "def short(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    (by_name,) = reward_functions(["my_rewards_35:short"])
    (by_path,) = reward_functions([f"{tmp_path / 'my_rewards_35.py'}:short"])
    assert by_name is by_path and by_name(["a", "b"]) == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"no module named 'elsewhere_35' .* or --import path/to/file.py$"):
        reward_functions(["elsewhere_35:short"])


def test_math_verify_reward_accepts_equivalent_forms():
    pytest.importorskip("math_verify", reason="math-verify is in the recipes extra")
    (math_verify,) = reward_functions(["math_verify"])
    scores = math_verify(
        ["So x = 1/2, the answer is $\\frac{1}{2}$", "The answer is 0.5.", "The answer is 3.", "no"],
        ["0.5", "1/2", "4", "4"],
    )
    assert scores == [1.0, 1.0, 0.0, 0.0]


def test_gsm8k_layout_becomes_prompt_answer_solution():
    from datasets import Dataset

    gsm8k = Dataset.from_list(
        [
            {"question": "Tom has 3 bags of 4 apples. How many apples?", "answer": "3*4=<<3*4=12>>12 apples.\n#### 12"},
            {"question": "A pen costs 1,200 cents.", "answer": "It is 1,200.\n#### 1,200"},
        ]
    )
    rows = to_task_format(gsm8k)
    assert rows[0]["answer"] == "12" and rows[1]["answer"] == "1200"
    assert rows[0]["solution"] == "3*4=12 apples. The answer is 12."
    assert rows[0]["prompt"][0]["role"] == "user" and "Tom has 3 bags" in rows[0]["prompt"][0]["content"]
    with pytest.raises(ValueError, match="has no column .prompt.; its columns are"):
        to_task_format(Dataset.from_list([{"text": "x"}]))


def test_local_dataset_splits_demonstrations_from_rl_prompts(tmp_path):
    data = tmp_path / "gsm"
    data.mkdir()
    for split, count in (("train", 10), ("test", 3)):
        with open(data / f"{split}.jsonl", "w") as f:
            for i in range(count):
                f.write(
                    json.dumps({"question": f"{split} question {i}?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"}) + "\n"
                )
    (args,) = parse(
        (RecipeArguments,), ["--dataset_name", str(data), "--num_expert_rows", "4", "--num_train_rows", "0"], "chord"
    )
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


@pytest.fixture
def restore_torch_threads():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_torch_threads_of_a_recipe_config_reach_torch(monkeypatch, tmp_path, restore_torch_threads):
    """`torch_threads` in a recipe's YAML or command line is the training config's field (it sets torch's count
    when the trainer starts), not a recipe argument that a Python user of the trainers would miss."""
    import torch

    from trinity_trl.trainers import CISPOConfig
    from trinity_trl.trainers.machine import start_on_this_machine

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(1)
    _, config = parse((RecipeArguments, CISPOConfig), ["--output_dir", str(tmp_path), "--torch_threads", "2"], "cispo")
    assert config.torch_threads == 2 and torch.get_num_threads() == 1  # parsing changes nothing process-wide
    start_on_this_machine(config)  # what every trainer does first
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="torch_threads must be a whole number >= 0, got -1"):
        parse((RecipeArguments, CISPOConfig), ["--output_dir", str(tmp_path), "--torch_threads", "-1"], "cispo")


def test_bundled_task_prompt_style_from_dataset_config():
    (args,) = parse(
        (RecipeArguments,),
        ["--dataset_config", "system", "--num_train_rows", "4", "--num_eval_rows", "2", "--num_expert_rows", "2"],
        "chord",
    )
    task = load_task(args, with_expert=True)
    for rows in (task.train, task.test, task.expert):
        assert [m["role"] for m in rows[0]["prompt"]] == ["system", "user"]
    assert [m["role"] for m in load_task(RecipeArguments(num_train_rows=4)).train[0]["prompt"]] == ["user"]
    with pytest.raises(ValueError, match="prompt style, one of .* got 'main'"):
        load_task(RecipeArguments(dataset_config="main"))


def test_repository_recipe_scripts_run_as_scripts():
    """`python recipes/chord.py ...` is the same recipe as `trinity-trl chord ...` (one file, no wrapper)."""
    result = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "chord.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=scaled_timeout(300),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--mu_peak" in result.stdout and "--num_expert_rows" in result.stdout
    assert (REPO / "recipes" / "configs" / "chord_cpu.yaml").is_file()
    assert not (REPO / "recipes" / "configs").is_symlink()


def test_component_arguments_on_the_command_line_and_in_yaml(tmp_path):
    from trinity_trl.trainers import TrinityConfig

    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(f"policy_loss: {{name: cispo, clip_range_low: 0.5}}\noutput_dir: {tmp_path}\nuse_cpu: true\n")
    _, config = parse(
        (RecipeArguments, TrinityConfig),
        ["--config", str(yaml_file), "--policy_loss.clip_range_high", "5.0", "--kl_loss.kl_coef=1e-3"],
        "train",
    )
    resolved = config.resolved_algorithm()
    assert resolved.policy_loss.name == "cispo"
    assert (resolved.policy_loss.args["clip_range_low"], resolved.policy_loss.args["clip_range_high"]) == (
        0.5,
        5.0,
    )
    assert resolved.kl_loss.args["kl_coef"] == 1e-3
    _, config = parse((RecipeArguments, CISPOConfig), ["--output_dir", str(tmp_path), "--use_cpu", "true"], "cispo")
    assert config.resolved_algorithm().policy_loss.args["clip_range_high"] == 0.28
    with pytest.raises(ValueError, match=r"takes no argument\(s\) \['clip_range_hi'\]"):
        parse(
            (RecipeArguments, CISPOConfig),
            ["--output_dir", str(tmp_path), "--use_cpu", "true", "--policy_loss.clip_range_hi", "5"],
            "cispo",
        )


def test_import_registers_a_module_from_a_file(tmp_path):
    from trinity_trl.algorithms import POLICY_LOSS_FN
    from trinity_trl.trainers import TrinityConfig

    plugin = tmp_path / "flat_losses.py"
    plugin.write_text(
        "from trinity_trl.algorithms import POLICY_LOSS_FN\n"
        "from trinity_trl.algorithms.policy_loss.ppo import PPOPolicyLossFn\n"
        "@POLICY_LOSS_FN.register('flat_ppo')\n"
        "class FlatPPO(PPOPolicyLossFn):\n"
        "    pass\n"
    )
    try:
        _, config = parse(
            (RecipeArguments, TrinityConfig),
            ["--import", str(plugin), "--policy_loss", "flat_ppo", "--output_dir", str(tmp_path), "--use_cpu", "true"],
            "train",
        )
        assert config.resolved_algorithm().policy_loss.name == "flat_ppo"
    finally:
        POLICY_LOSS_FN.unregister("flat_ppo")
    with pytest.raises(ImportError, match="no module named 'not_a_module_here'"):
        parse((RecipeArguments, TrinityConfig), ["--import", "not_a_module_here"], "train")


def test_yaml_import_is_relative_to_the_yaml_file(tmp_path, monkeypatch):
    """Issue 37 item 6: ``import: my_losses.py`` in a YAML file names the file beside the YAML file, whatever the
    current folder (it was read from the current folder)."""
    from trinity_trl.algorithms import POLICY_LOSS_FN
    from trinity_trl.trainers import TrinityConfig

    project = tmp_path / "project"
    project.mkdir()
    (project / "beside_losses.py").write_text(
        "from trinity_trl.algorithms import POLICY_LOSS_FN\n"
        "from trinity_trl.algorithms.policy_loss.ppo import PPOPolicyLossFn\n"
        "@POLICY_LOSS_FN.register('beside_ppo')\n"
        "class BesidePPO(PPOPolicyLossFn):\n"
        "    pass\n"
    )
    config = project / "run.yaml"
    config.write_text("import: beside_losses.py\npolicy_loss: beside_ppo\nuse_cpu: true\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    try:
        _, parsed = parse(
            (RecipeArguments, TrinityConfig), ["--config", str(config), "--output_dir", str(tmp_path / "o")], "train"
        )
        assert parsed.resolved_algorithm().policy_loss.name == "beside_ppo"
    finally:
        if "beside_ppo" in POLICY_LOSS_FN:
            POLICY_LOSS_FN.unregister("beside_ppo")
        sys.modules.pop("beside_losses", None)


def test_read_config_reports_yaml_syntax_as_file_and_line(tmp_path):
    config = tmp_path / "my.yaml"
    config.write_text("max_steps: 2\nlearning_rate: 1e-5\n  bad_indent: 1\n")
    with pytest.raises(UsageError, match=r"my\.yaml:3: invalid YAML: mapping values are not allowed here$"):
        read_config(str(config))
    config.write_text("max_steps: 2\n")
    assert read_config(str(config)) == {"max_steps": 2}


def test_gpu_config_on_a_cpu_names_its_cpu_twin(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match=r"this config \(chord_gpu\) needs a GPU .*; use chord_cpu, its CPU twin$"):
        parse((RecipeArguments, ChordConfig), ["--config", "chord_gpu", "--output_dir", str(tmp_path)], "chord")
    own = tmp_path / "mine_gpu.yaml"  # no twin beside it: how to run it on a CPU instead
    own.write_text("max_steps: 2\n")
    with pytest.raises(UsageError, match=r"\(mine_gpu\) needs a GPU .*; on a CPU set bf16: false"):
        parse((RecipeArguments, ChordConfig), ["--config", str(own), "--output_dir", str(tmp_path)], "chord")
    # asked for explicitly: the CPU runs it
    _, config = parse(
        (RecipeArguments, ChordConfig),
        ["--config", str(own), "--use_cpu", "true", "--output_dir", str(tmp_path)],
        "chord",
    )
    assert config.max_steps == 2


class _FakeTrainer:
    """What save_outputs uses of a trainer, with a log that has no step metrics (so nothing to plot)."""

    def __init__(self, output_dir, log_history):
        from types import SimpleNamespace

        self.args = SimpleNamespace(output_dir=str(output_dir), push_to_hub=False)
        self.state = SimpleNamespace(global_step=len(log_history), log_history=log_history)

    def save_model(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)

    def is_world_process_zero(self):
        return True


def test_closing_line_names_only_what_was_written(tmp_path, capsys):
    summary = {"global_step": 0, "accuracy_before": None, "accuracy_after": None}
    save_outputs(_FakeTrainer(tmp_path / "a", []), RecipeArguments(plot=True), summary)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert not (tmp_path / "a" / "training_curves.png").exists()
    assert last.endswith(f"model, card and training_log.json in {tmp_path / 'a'}") and "plot" not in last
    pytest.importorskip("matplotlib")
    log = [{"step": 1, "loss": 0.5, "reward": 0.1}, {"step": 2, "loss": 0.4, "reward": 0.3}]
    save_outputs(_FakeTrainer(tmp_path / "b", log), RecipeArguments(plot=True), summary)
    assert (tmp_path / "b" / "training_curves.png").is_file()
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(f"training_log.json and plot in {tmp_path / 'b'}")


def test_default_output_dir_is_named_after_what_ran(tmp_path):
    """`--environment calculator` on the number-guessing config must not write beside that config's own runs."""
    from trinity_trl.recipes.step_grpo import StepGRPOScriptArguments
    from trinity_trl.trainers import StepGRPOConfig, TrinityConfig

    classes = (StepGRPOScriptArguments, StepGRPOConfig)
    _, config = parse(classes, ["--config", "step_grpo_cpu"], "step_grpo")
    assert config.output_dir == os.path.join("outputs", "step_grpo_cpu")
    _, config = parse(classes, ["--config", "step_grpo_cpu", "--environment", "calculator"], "step_grpo")
    assert config.output_dir == os.path.join("outputs", "step_grpo_cpu-calculator")
    _, config = parse((RecipeArguments, TrinityConfig), ["--algorithm=rloo"], "train")
    assert config.output_dir == os.path.join("outputs", "train-rloo")
    # an output_dir of the command line or of the YAML file wins
    _, config = parse(classes, ["--config", "step_grpo_cpu", "--output-dir", str(tmp_path / "x")], "step_grpo")
    assert config.output_dir == str(tmp_path / "x")
    yaml_file = tmp_path / "mine.yaml"
    yaml_file.write_text("environment: calculator\noutput_dir: runs/mine\n")
    _, config = parse(classes, ["--config", str(yaml_file)], "step_grpo")
    assert config.output_dir == "runs/mine"


def _trainer_config_of(name: str):
    """The recipe of bundled config ``name`` and the trainer config its parse builds (``--use_cpu`` for a GPU one)."""
    from trinity_trl.recipes.step_grpo import StepGRPOScriptArguments
    from trinity_trl.recipes.train import TrainArguments, algorithm_from
    from trinity_trl.trainers import PPOConfig, SAPOConfig, StepGRPOConfig

    recipe = config_summary(name)["recipe"]
    argv = ["--config", name] + (["--use_cpu", "true"] if name.endswith("_gpu") else [])
    if recipe == "train":
        import trinity_trl.trainers as trainers
        from trinity_trl.algorithms import ALGORITHM_TYPE

        config_class = getattr(trainers, ALGORITHM_TYPE.get(algorithm_from(argv)).trainer).config_class
        return recipe, argv, parse((TrainArguments, config_class), argv, "train", ignore=("algorithm",))[1]
    config_class = {"chord": ChordConfig, "cispo": CISPOConfig, "sapo": SAPOConfig, "ppo": PPOConfig}.get(recipe)
    script = RecipeArguments
    if recipe == "step_grpo":
        config_class, script = StepGRPOConfig, StepGRPOScriptArguments
    return recipe, argv, parse((script, config_class), argv, recipe)[1]


@pytest.mark.parametrize("name", bundled_configs())
def test_print_config_shows_the_components_the_run_builds(name, capsys):
    """`trinity-trl <recipe> --config <name> --print_config` on every bundled config (so every recipe): YAML naming
    each component the trainer config builds, with the arguments it is built from, an off KL as `none`, and the TRL
    fields that differ from TRL's defaults; it exits 0 without loading anything."""
    import yaml

    from trinity_trl.cli import main
    from trinity_trl.trainers.config import changed_trl_fields

    recipe, argv, config = _trainer_config_of(name)
    with pytest.raises(SystemExit) as exit_info:
        main([recipe, *argv, "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    built = config.take_components()
    for field in ("policy_loss", "advantage", "kl_loss", "kl_penalty", "entropy_loss"):
        if field not in printed:
            assert not hasattr(config, field) or (field == "advantage" and not built.algorithm.uses_advantage), field
            continue
        component = getattr(built.algorithm, field)
        on = getattr(built, field if field != "advantage" else "advantage_fn").__class__
        if getattr(on, "enabled", True):
            expected = component.to_dict() if component.args else component.name
        else:
            expected = "none"
        assert printed[field] == expected, (name, field)
    assert (
        printed["algorithm"] == built.algorithm.algorithm and printed["loss_agg_mode"] == built.algorithm.loss_agg_mode
    )
    trl_changed = changed_trl_fields(config)
    assert printed["output_dir"] == config.output_dir and "beta" not in printed
    for key in ("learning_rate", "max_steps", "num_generations"):
        assert (key in printed) == (key in trl_changed), (name, key)
        if key in printed:
            assert printed[key] == getattr(config, key)
    assert printed["logging_steps"] == config.logging_steps == read_config(config_path(name)).get("logging_steps", 1)


def test_a_run_from_the_command_line_logs_every_step_unless_told_otherwise(tmp_path):
    """TRL's logging_steps is 10, which leaves a short run without a step line: the CLI's default is 1 (issue 43); a
    config or the command line still sets it."""
    (tmp_path / "every5.yaml").write_text("logging_steps: 5\n")
    (_, config) = parse((RecipeArguments, CISPOConfig), ["--output_dir", str(tmp_path)], "cispo")
    assert config.logging_steps == 1
    (_, config) = parse((RecipeArguments, CISPOConfig), ["--config", str(tmp_path / "every5.yaml")], "cispo")
    assert config.logging_steps == 5
    (_, config) = parse((RecipeArguments, CISPOConfig), ["--logging_steps", "3"], "cispo")
    assert config.logging_steps == 3
    assert CISPOConfig(output_dir=str(tmp_path), use_cpu=True).logging_steps == 10  # Python keeps TRL's default


def _one_score(completions, **kwargs):
    return [1.0]


def _half_scored(completions, **kwargs):
    return [None, 2.0]


def test_the_held_out_scoring_names_a_malformed_reward_function_as_given_and_sums_by_the_rule():
    """A reward function returning the wrong number of rewards is named as the command line gave it (it was named by
    its repr, ``<function one_score at 0x...>``), and the held-out rows' weighted sum follows the training rule."""
    import torch

    from trinity_trl.recipes.common import score_completions
    from trinity_trl.training.advantages import weighted_rewards

    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    with pytest.raises(ValueError) as info:
        score_completions([_one_score], rows, ["x", "y"], [[1], [2]], names=["badlen:one_score"])
    assert str(info.value).startswith("reward function 'badlen:one_score' returned 1 rewards for 2 completions")
    scores = score_completions([_half_scored], rows, ["x", "y"], [[1], [2]])
    assert torch.equal(
        weighted_rewards(scores, torch.ones(1, dtype=torch.float64)).isnan(), torch.tensor([True, False])
    )
