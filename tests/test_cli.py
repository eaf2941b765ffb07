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
        ],
        capture_output=True,
        text=True,
        timeout=scaled_timeout(300),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # one short progress line per step instead of a dict of every metric, without --logging_steps (TRL's is 10)
    assert "step 1/1 | reward" in result.stdout + result.stderr
    assert "'completions/mean_length'" not in result.stdout + result.stderr
    assert "rollout_func" not in result.stderr and "gradient_checkpointing` is deprecated" not in result.stderr
    # a quiet console (issue 43): progress bars and our lines, no library notice (trinity_trl/notices.py)
    assert not foreign_console_lines(result.stdout + result.stderr), foreign_console_lines(
        result.stdout + result.stderr
    )


#: what a run's console may show besides progress bars: trinity_trl's lines
OUR_LINES = ("[trinity-trl] ", "step ", "No GPU or other accelerator: ")


def foreign_console_lines(text: str) -> list[str]:
    """The lines of a run's console that are neither a progress bar (tqdm's `... 3/8 [00:01<00:02, 2.1it/s]`, drawn
    with carriage returns) nor one of `OUR_LINES`."""
    bar = re.compile(r"(\d+%\|.*\||\[\d\d:\d\d[<,].*\]|examples/s\])")
    lines = [part.strip() for line in text.splitlines() for part in line.split("\r")]
    return [line for line in lines if line and not bar.search(line) and not line.startswith(OUR_LINES)]


# the 19 mistakes of a newcomer's first hour on a text task of their own (issue 43): each is one line and exit 2,
# before any model loads. (argv, the error's text); `capitals` is the user's folder, set up by the test.
NEWCOMER_MISTAKES = [
    (
        ["cispo", "--config", "cispo_cpu", "--learnig_rate", "1e-3"],
        r"--learnig_rate \(did you mean --learning_rate\?\)",
    ),
    (["cispo", "--config", "two.yaml"], r"max_steps in \S*two\.yaml must be an integer, got 'two'$"),
    (  # GSM8K's column names on another task: never a silent arithmetic instruction on every prompt
        ["cispo", "--config", "cispo_cpu", "--dataset_name", "qa.jsonl", "--reward_funcs", "capreward:capital_reward"],
        r"qa\.jsonl\[train\] has 'question' \+ 'answer' columns but no 'prompt'.*rename 'question' to 'prompt'",
    ),
    (["cispo", "--config", "cispo_cpu", "--dataset_name", "prompt_only.jsonl"], r"has no column 'answer'"),
    (  # a reward parameter that no column fills: refused before the model loads, not a traceback at step 1
        [
            "cispo",
            "--config",
            "cispo_cpu",
            "--dataset_name",
            "no_answer/",
            "--reward_funcs",
            "capreward:capital_reward",
        ],
        r"reward function 'capital_reward' takes 'answer', but no_answer/ \(training rows\) has no such column",
    ),
    (
        ["cispo", "--config", "cispo_cpu", "--dataset_name", "data/", "--reward_funcs", "capreward:capitol_reward"],
        r"cannot import reward function 'capreward:capitol_reward'",
    ),
    (  # a misspelt model id offline: one line (was a raw OSError, exit 1)
        ["cispo", "--config", "cispo_cpu", "--model_name_or_path", "HuggingFaceTB/SmolLM2-135M-Instuct"],
        r"model_name_or_path 'HuggingFaceTB/SmolLM2-135M-Instuct' is not a local path and not in the Hugging Face "
        r"cache .*HF_HUB_OFFLINE.*did you mean HuggingFaceTB/SmolLM2-135M-Instruct\?",
    ),
    (["cipso"], r"unknown recipe 'cipso' \(did you mean cispo\?\)"),
    (
        [
            "chord",
            "--config",
            "chord_cpu",
            "--dataset_name",
            "data/",
            "--reward_funcs",
            "capreward:capital_reward",
            "--expert_dataset_name",
            "expert_bad.jsonl",
        ],
        r"expert_bad\.jsonl\[train\] has no column 'messages'; its columns are \['question', 'response'\]",
    ),
    (["cispo", "--config", "cispo_cpu", "--num_generations", "3"], r"must be divisible by num_generations \(3\)"),
    (["cispo", "--config", "cispo_cpu", "--output_dir", "used"], r"output_dir 'used' already holds 1 file"),
    (["cispo", "--config", "cispo_cuda"], r"'cispo_cuda' is neither a file nor a bundled config \(did you mean"),
    (
        ["cispo", "--config", "cispo_cpu", "--reward_funcs", "capreward.py"],
        r"unknown reward function 'capreward\.py'",
    ),
    (
        ["cispo", "--config", "cispo_cpu", "--use_peft", "yes_please"],
        r"use_peft must be true or false, got 'yes_please'$",
    ),
    (["sapo", "--config", "sapo_gpu"], r"this config \(sapo_gpu\) needs a GPU .*; use sapo_cpu, its CPU twin$"),
    (  # a local look-alike: a missing folder, not a Hub id
        ["cispo", "--config", "cispo_cpu", "--dataset_name", "dat/"],
        r"dat/: no such file or folder \(looked for \S+/dat\); did you mean data/\?$",
    ),
    (["cispo", "--config", "cispo_cpu", "--dataset_name", "./dat/"], r"\./dat/: no such file or folder"),
    (  # a misspelt suffix: a missing file (was a ConnectionError traceback after 37 s)
        ["cispo", "--config", "cispo_cpu", "--dataset_name", "capitals.jsnol"],
        r"capitals\.jsnol: no such file or folder \(looked for \S+\); did you mean capitals\.jsonl\?$",
    ),
    (
        ["chord", "--config", "chord_cpu", "--dataset_name", "data/", "--reward_funcs", "capreward:capital_reward"],
        r"data/ has no reference solutions .* give expert_dataset_name",
    ),
]


def capitals_folder(folder: Path) -> None:
    """The newcomer's working folder: a capital-cities task (chat prompts + `answer`) as a folder and as one file,
    a reward in its own file, and the look-alikes of their mistakes."""

    def rows(path: Path, records: list[dict]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))

    pairs = [("France", "Paris"), ("Kenya", "Nairobi"), ("Japan", "Tokyo"), ("Peru", "Lima"), ("Chile", "Santiago")]
    prompt = [{"prompt": [{"role": "user", "content": f"What is the capital of {c}?"}], "answer": a} for c, a in pairs]
    rows(folder / "data" / "train.jsonl", prompt[:4])
    rows(folder / "data" / "test.jsonl", prompt[4:])
    rows(folder / "capitals.jsonl", prompt)
    rows(folder / "qa.jsonl", [{"question": f"What is the capital of {c}?", "answer": a} for c, a in pairs])
    rows(folder / "prompt_only.jsonl", [{"prompt": r["prompt"]} for r in prompt])
    rows(folder / "no_answer" / "train.jsonl", [{"prompt": r["prompt"]} for r in prompt[:4]])
    rows(folder / "no_answer" / "test.jsonl", [{"prompt": r["prompt"]} for r in prompt[4:]])
    rows(folder / "expert_bad.jsonl", [{"question": c, "response": f"The capital is {a}."} for c, a in pairs])
    (folder / "capreward.py").write_text(
        "def capital_reward(completions, answer, **kwargs):\n"
        "    return [float(a in c[-1]['content']) for c, a in zip(completions, answer)]\n"
    )
    (folder / "two.yaml").write_text("max_steps: two\n")
    (folder / "used").mkdir()
    (folder / "used" / "adapter_model.safetensors").write_text("")


def test_the_newcomer_mistakes_are_each_one_line_and_exit_2_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """Issue 43's 19 mistakes, through the command's entry point in-process, offline (HF_HUB_OFFLINE): each prints
    one line ``trinity-trl <recipe>: error: ...`` naming what is wrong and exits 2, and none gets as far as loading
    a model (which would fail the test: no model is reachable here)."""
    import huggingface_hub.constants
    import torch

    from trinity_trl.data import model as bundled

    capitals_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the GPU config, on any machine

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded: the mistake was not caught first")

    monkeypatch.setattr(bundled, "bundled_model_dir", no_model)
    assert len(NEWCOMER_MISTAKES) == 19
    wrong = []
    for number, (argv, message) in enumerate(NEWCOMER_MISTAKES, 1):
        given = argv if "--output_dir" in argv or len(argv) == 1 else [*argv, "--output_dir", f"out{number}"]
        try:
            main(given)
            code = 0
        except SystemExit as exit_info:
            code = exit_info.code
        except Exception as err:  # noqa: BLE001 - reported with the others below
            code = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
        err = capsys.readouterr().err.strip().splitlines()
        line = err[0].removesuffix(" (--debug shows the traceback)") if len(err) == 1 else None
        if code != 2 or line is None or not line.startswith(f"trinity-trl {argv[0]}: error: "):
            wrong.append(f"{number} {argv[1:]}: exit {code}, stderr {err[-3:]}")
        elif not re.search(message, line):
            wrong.append(f"{number}: {line!r} does not say {message!r}")
    assert not wrong, "\n".join(wrong)
