"""trinity_trl/cli.py, the `trinity-trl` command: listings, exit codes, one-line usage errors, --debug, the demo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launching import scaled_timeout

from trinity_trl.cli import DEMO_OUTPUT_DIR, main, run
from trinity_trl.recipes import RECIPES, bundled_configs, config_path, config_summary


def test_bare_command_prints_the_recipes_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    usage = capsys.readouterr().err
    assert all(name in usage for name in RECIPES) and "demo" in usage and "configs" in usage


def test_help_lists_recipes_and_exits_0(capsys):
    main(["--help"])
    usage = capsys.readouterr().out
    assert usage.startswith("usage: trinity-trl <recipe>") and all(name in usage for name in RECIPES)


def configs_blocks(table: str) -> dict[str, tuple[list[str], str]]:
    """``{config: (row cells, the text wrapped beneath it, on one line)}`` of ``trinity-trl configs``."""
    blocks: dict[str, tuple[list[str], str]] = {}
    name = None
    for line in table.splitlines()[2:]:
        if not line.startswith(" "):
            name = line.split()[0]
            blocks[name] = (line.split(), "")
        else:
            blocks[name] = (blocks[name][0], " ".join(f"{blocks[name][1]} {line}".split()))
    return blocks


def test_configs_table_names_recipe_model_task_and_purpose(capsys):
    main(["configs"])
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0].split() == ["config", "recipe", "model", "task", "steps"]
    assert "measured: the held-out metric before -> after" in lines[1]
    blocks = configs_blocks(table)
    assert sorted(blocks) == bundled_configs()
    assert blocks["chord_cpu"][0][1:4] == ["chord", "bundled", "arithmetic"]
    assert blocks["chord_gpu"][0][1:4] == ["chord", "Qwen/Qwen2.5-1.5B-Instruct", "openai/gsm8k"]
    assert blocks["step_grpo_cpu"][0][1] == "step_grpo" and blocks["dpo_cpu"][0][1] == "train"
    for name, (_, text) in blocks.items():  # every config has a measured line and a purpose
        summary = config_summary(name)
        assert text == f"measured: {summary['measured'] or '-'} purpose: {summary['purpose']}", name


def test_configs_table_fits_100_columns(capsys):
    """Issue 35: its lines were about 400 characters (measured result and purpose on the row)."""
    main(["configs"])
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 100


RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "configs_learning.jsonl"
# "accuracy 0.080 -> 0.490 (8 steps, 6.1 min at load 3.1, 2 cores)"
MEASURED = re.compile(r"^(accuracy|reward) (\d\.\d{3}) -> (\d\.\d{3}) \((\d+) steps, [\d.]+ min at load [\d.]+")


def test_configs_table_shows_each_cpu_configs_measured_run_as_recorded(capsys):
    """The table's steps are the config's max_steps, and each CPU config's measured before -> after is a run of that
    config as shipped, recorded by benchmarks/configs_learning.py, at that many steps (or the config says why it
    is only a smoke run): editing a config's steps or results without measuring again fails here."""
    records = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    main(["configs"])
    table = capsys.readouterr().out
    for name in bundled_configs():
        summary = config_summary(name)
        row, text = configs_blocks(table)[name]
        assert f"measured: {summary['measured']} purpose:" in text and row[4] == summary["steps"]
        if not name.endswith("_cpu"):
            continue
        measured = summary["measured"]
        if measured.startswith("smoke: "):
            assert len(measured) > 20, f"{name}: a smoke config says why"
            continue
        if measured.startswith("not measured yet"):
            continue
        match = MEASURED.match(measured)
        assert match, f"{name}: unreadable measured line {measured!r}"
        steps = int(match[4])
        assert steps == int(summary["steps"]), f"{name}: measured at {steps} steps, configured for {summary['steps']}"
        assert any(
            r["label"] == name
            and not r.get("returncode")
            and r["steps"] == steps
            and f"{r['before']:.3f}" == match[2]
            and f"{r['after']:.3f}" == match[3]
            for r in records
        ), f"{name}: {measured!r} is not a run recorded in {RESULTS.name}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["chrod"], r"unknown recipe 'chrod' \(did you mean chord\?\)"),
        (["chord", "--config", "chord_cpx"], r"did you mean chord_cpu\?"),
        (["cispo", "--config", "cispo_cpu", "--max_step", "2"], r"--max_step \(did you mean --max_steps\?\)"),
        (["chord", "--config", "chord_cpu", "--mu_peek", "0.5"], r"--mu_peek \(did you mean --mu_peak\?\)"),
        (
            ["cispo", "--config", "cispo_cpu", "--per_device_train_batch_size", "3", "--num_generations", "4"],
            r"generation_batch_size \(3\) must be divisible by num_generations \(4\)",
        ),
        (["ppo", "--config", "ppo_cpu", "--max_steps", "2", "--critic_warmup_steps", "2"], r"policy would never train"),
        (
            ["cispo", "--config", "{tmp}/broken.yaml"],
            r"broken\.yaml:2: invalid YAML: while parsing a flow sequence, expected ',' or ']', .* \(at line 3",
        ),
        (["cispo", "--config", "cispo_cpu", "--max_steps", "abc"], r"max_steps must be an integer, got 'abc'$"),
        (["cispo", "--config", "{tmp}/two.yaml"], r"max_steps in \S+two\.yaml must be an integer, got 'two'$"),
        (["cispo", "--config", "cispo_cpu", "--use_peft", "maybe"], r"use_peft must be true or false, got 'maybe'$"),
        (
            ["cispo", "--config", "{tmp}/key.yaml"],
            r"unknown key learnin_rate \(did you mean learning_rate\?\) in \S+key",
        ),
        (["train", "--algorithm", "rlo"], r"unknown algorithm 'rlo' \(did you mean rloo\?\)"),
        (["cispo", "--config", "{tmp}/missing.yaml"], r"'\S+missing\.yaml' is neither a file nor a bundled config"),
        (["sapo", "--config", "sapo_gpu"], r"this config \(sapo_gpu\) needs a GPU .*; use sapo_cpu, its CPU twin$"),
        (["cispo", "--config", "{tmp}/bf16.yaml"], r"needs a GPU \(bf16: true\) and this machine has none"),
    ],
)
def test_usage_errors_print_one_line_and_exit_2(capsys, monkeypatch, tmp_path, argv, message):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the GPU cases, on any machine
    (tmp_path / "broken.yaml").write_text("max_steps: 2\nlora_target_modules: [q_proj\nlora_r: 8\n")
    (tmp_path / "two.yaml").write_text('max_steps: "two"\n')
    (tmp_path / "key.yaml").write_text("learnin_rate: 0.1\n")
    (tmp_path / "bf16.yaml").write_text("bf16: true\nuse_cpu: false\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("No GPU")]
    assert len(err) == 1 and err[0].startswith(f"trinity-trl {argv[0]}: error: "), err
    assert "usage:" not in err[0] and err[0].endswith(" (--debug shows the traceback)")
    import re

    assert re.search(message, err[0].removesuffix(" (--debug shows the traceback)")), err[0]


def test_version_is_the_installed_package_version(capsys):
    from importlib.metadata import version

    main(["--version"])
    assert capsys.readouterr().out.strip() == f"trinity-trl {version('trinity-trl')}"


def test_a_bug_keeps_its_traceback():
    """Only user errors become one line: anything else is a bug and propagates as it is."""
    from trinity_trl.cli import exit_on_user_error

    def broken(argv):
        raise RuntimeError("internal")

    with pytest.raises(RuntimeError, match="internal"):
        exit_on_user_error(broken, [], "trinity-trl x")


def test_script_form_prints_one_line_for_an_occupied_output_dir(tmp_path):
    """`python recipes/chord.py ...` handles user errors as the `trinity-trl` command does."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_text("")
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "chord.py"
    argv = [sys.executable, str(recipe), "--config", "chord_cpu", "--output_dir", str(tmp_path / "out")]
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 2, result.stderr[-2000:]
    err = [line for line in result.stderr.strip().splitlines() if not line.startswith("No GPU")]
    assert len(err) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert (
        err[0].startswith(f"python {recipe}: error: output_dir ")
        and "already holds 1 file (model.safetensors)" in err[0]
    )


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ValueError, match="did you mean --max_steps"):
        main(["cispo", "--config", "cispo_cpu", "--max_step", "2", "--output_dir", str(tmp_path), "--debug"])


def test_demo_writes_to_its_own_folder(monkeypatch):
    seen = {}
    import trinity_trl.recipes.chord as chord

    monkeypatch.setattr(chord, "main", lambda argv: seen.setdefault("argv", argv))
    run(["demo", "--max_steps", "1"])
    argv = seen["argv"]
    assert argv[argv.index("--config") + 1] == "chord_cpu"
    assert argv[argv.index("--output_dir") + 1] == DEMO_OUTPUT_DIR
    assert argv[-2:] == ["--max_steps", "1"]  # user overrides come last, so they win
    from trinity_trl.recipes.common import default_output_dir

    # short chord_cpu runs (no output_dir in the config: outputs/chord_cpu) never overwrite the demo
    assert default_output_dir("chord", config_path("chord_cpu"), ["--max_steps", "2"]) != DEMO_OUTPUT_DIR


def test_console_script_is_installed_and_exits_zero_after_a_run(tmp_path, tiny_model_dir):
    script = Path(sys.executable).parent / "trinity-trl"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=scaled_timeout(120))
    assert result.returncode == 0 and "usage: trinity-trl <recipe>" in result.stdout
    result = subprocess.run(
        [
            str(script),
            "sapo",
            "--config",
            "sapo_cpu",
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path),
            "--max_steps",
            "1",
            "--num_train_rows",
            "8",
            "--max_completion_length",
            "8",
            "--per_device_train_batch_size",
            "4",
            "--num_generations",
            "4",
            "--lora_r",
            "4",
            "--lora_alpha",
            "8",
            "--eval_accuracy",
            "false",
            "--logging_steps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=scaled_timeout(300),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # one short progress line per step instead of a dict of every metric
    assert "step 1/1 | reward" in result.stdout + result.stderr
    assert "'completions/mean_length'" not in result.stdout + result.stderr
    assert "rollout_func" not in result.stderr and "gradient_checkpointing` is deprecated" not in result.stderr
