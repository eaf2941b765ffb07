"""recipes/common.py's data (issue 27 item 1): a recipe's dataset_name may be a Hub id, a folder, one data file or
(in Python) a Dataset; prompts as text or conversations; the held-out evaluation takes every format training takes;
a missing path, a missing column or an empty split is one line and exit status 2."""

from __future__ import annotations

import json

import pytest

from trinity_trl.recipes.common import RecipeArguments, UsageError, load_task, parse

from .test_recipes import RUNS

TEXT_ROWS = [{"prompt": f"What is {i} plus 1? End with: The answer is N.", "answer": str(i + 1)} for i in range(8)]
CHAT_ROWS = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in TEXT_ROWS]


def jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def folder(tmp_path, rows, test_rows=None, name="data"):
    data = tmp_path / name
    data.mkdir()
    jsonl(data / "train.jsonl", rows)
    jsonl(data / "test.jsonl", rows[:3] if test_rows is None else test_rows)
    return str(data)


def args_for(source, *options: str) -> RecipeArguments:
    (args,) = parse((RecipeArguments,), ["--dataset_name", source, *options], "cispo")
    return args


@pytest.mark.parametrize("rows", [TEXT_ROWS, CHAT_ROWS], ids=["text", "conversations"])
def test_a_folder_of_text_or_conversation_prompts(tmp_path, rows):
    task = load_task(args_for(folder(tmp_path, rows), "--eval_accuracy", "true"))
    assert task.train["prompt"] == [r["prompt"] for r in rows] and len(task.test) == 3
    assert task.expert is None


def test_one_file_relative_or_absolute(tmp_path, monkeypatch):
    path = jsonl(tmp_path / "x.jsonl", TEXT_ROWS)
    monkeypatch.chdir(tmp_path)
    for given in ("./x.jsonl", path):
        task = load_task(args_for(given))
        assert task.train["answer"] == [r["answer"] for r in TEXT_ROWS] and task.test is None
    with pytest.raises(UsageError, match=r"eval_accuracy needs a held-out split 'test'; ./x.jsonl is one file"):
        load_task(args_for("./x.jsonl", "--eval_accuracy", "true"))


def test_in_memory_dataset_in_python():
    from datasets import Dataset, DatasetDict

    data = DatasetDict({"train": Dataset.from_list(CHAT_ROWS), "test": Dataset.from_list(TEXT_ROWS[:2])})
    task = load_task(RecipeArguments(dataset_name=data, eval_accuracy=True))
    assert len(task.train) == 8 and task.test["prompt"] == [r["prompt"] for r in TEXT_ROWS[:2]]
    task = load_task(RecipeArguments(dataset_name=Dataset.from_list(TEXT_ROWS)))
    assert len(task.train) == 8 and task.test is None


def test_expert_dataset_from_its_own_file(tmp_path):
    demos = [{"prompt": r["prompt"], "completion": f"The answer is {r['answer']}."} for r in TEXT_ROWS[:4]]
    expert = jsonl(tmp_path / "demos.jsonl", demos)
    task = load_task(
        args_for(folder(tmp_path, TEXT_ROWS), "--expert_dataset_name", expert, "--num_expert_rows", "3"),
        with_expert=True,
    )
    assert len(task.train) == 8 and task.expert["completion"] == [d["completion"] for d in demos[:3]]
    bundled = load_task(RecipeArguments(num_train_rows=4, expert_dataset_name=expert), with_expert=True)
    assert bundled.expert["prompt"] == [d["prompt"] for d in demos]  # the bundled task with the user's demos
    with pytest.raises(ValueError, match="demos.jsonl\\[train\\] has no column 'completion'"):
        bad = jsonl(tmp_path / "demos.jsonl", [{"prompt": "q"}])
        load_task(args_for(folder(tmp_path, TEXT_ROWS, name="d2"), "--expert_dataset_name", bad), with_expert=True)


def test_solution_column_of_text_prompts_gives_text_demonstrations(tmp_path):
    rows = [{**r, "solution": f"The answer is {r['answer']}."} for r in TEXT_ROWS]
    task = load_task(args_for(folder(tmp_path, rows), "--num_expert_rows", "2"), with_expert=True)
    assert len(task.train) == 6 and task.expert["completion"] == [rows[6]["solution"], rows[7]["solution"]]


def test_missing_answer_is_an_error_only_when_something_reads_it(tmp_path):
    source = folder(tmp_path, [{"prompt": r["prompt"]} for r in TEXT_ROWS])
    with pytest.raises(ValueError, match=r"data\[train\] has no column 'answer'; its columns are \['prompt'\]"):
        load_task(args_for(source))  # the default 'accuracy' reward reads 'answer'
    task = load_task(args_for(source, "--reward_funcs", "tests.helpers:length_reward"))
    assert len(task.train) == 8


def run_cli(argv, capsys) -> str:
    from trinity_trl.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()  # datasets' progress bars may come before it
    errors = [line for line in err if "error:" in line]
    assert len(errors) == 1 and err[-1] == errors[0], err
    return errors[0]


def test_cli_errors_are_one_line_naming_the_path_column_or_split(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base = ["cispo", "--config", "cispo_cpu", "--output_dir", str(tmp_path / "out")]
    err = run_cli([*base, "--dataset_name", "./x.jsonl"], capsys)
    assert "./x.jsonl: no such file or folder" in err
    jsonl(tmp_path / "q.jsonl", [{"question_text": "q", "answer": "1"}])
    err = run_cli([*base, "--dataset_name", "q.jsonl", "--eval_accuracy", "false"], capsys)
    assert "q.jsonl[train] has no column 'prompt'; its columns are ['question_text', 'answer']; expected" in err
    data = tmp_path / "empty_test"
    data.mkdir()
    jsonl(data / "train.jsonl", TEXT_ROWS)
    (data / "test.jsonl").write_text("")
    err = run_cli([*base, "--dataset_name", "empty_test"], capsys)
    assert err.startswith("trinity-trl cispo: error: empty_test/test.jsonl is empty (0 rows)"), err
    jsonl(data / "test.jsonl", TEXT_ROWS[:2])
    err = run_cli([*base, "--dataset_name", "empty_test", "--dataset_train_split", "training"], capsys)
    assert "empty_test has no split 'training' (dataset_train_split); it has ['test', 'train']" in err


def test_an_empty_split_from_memory_is_named():
    from datasets import Dataset, DatasetDict

    data = DatasetDict({"train": Dataset.from_list(TEXT_ROWS), "test": Dataset.from_dict({"prompt": [], "answer": []})})
    with pytest.raises(ValueError, match=r"^the dataset\[test\] is empty \(0 rows\)$"):
        load_task(RecipeArguments(dataset_name=data))


def test_held_out_accuracy_on_text_prompts():
    """The evaluation scores text prompts (given as they are) as it scores conversations (the issue's crash:
    "Chat messages should be dicts ... but got 'W'")."""
    from datasets import Dataset
    from helpers import build_tiny_model, build_tiny_tokenizer

    from trinity_trl.data.arithmetic import evaluate_accuracy

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer)
    for rows in (TEXT_ROWS[:3], CHAT_ROWS[:3]):
        accuracy, completions = evaluate_accuracy(
            model, tokenizer, Dataset.from_list(rows), batch_size=2, max_new_tokens=4, return_completions=True
        )
        assert 0.0 <= accuracy <= 1.0 and len(completions) == 3
    # a text prompt is given as it is: the completion is greedy generation from the prompt's own tokens
    import torch

    ids = tokenizer(TEXT_ROWS[0]["prompt"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, do_sample=False, max_new_tokens=4, pad_token_id=tokenizer.pad_token_id)
    _, completions = evaluate_accuracy(
        model, tokenizer, Dataset.from_list(TEXT_ROWS[:1]), max_new_tokens=4, return_completions=True
    )
    assert completions[0] == tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def test_pairs_and_demonstrations_need_no_answer_column():
    """The dpo/sft presets do not reward the training rows: no 'answer' needed there; the held-out split needs one
    only for the evaluation."""
    from datasets import Dataset, DatasetDict

    pairs = Dataset.from_list(
        [{"prompt": r["prompt"], "chosen": "The answer is 1.", "rejected": "No."} for r in TEXT_ROWS]
    )
    data = DatasetDict({"train": pairs, "test": Dataset.from_list(TEXT_ROWS[:2])})
    task = load_task(RecipeArguments(dataset_name=data, eval_accuracy=True), rewarded=False)
    assert task.train.column_names == ["prompt", "chosen", "rejected"] and len(task.test) == 2
    with pytest.raises(ValueError, match=r"the dataset\[train\] has no column 'answer'"):
        load_task(RecipeArguments(dataset_name=data))  # the RL presets reward them with the 'accuracy' reward
    no_answers = DatasetDict({"train": pairs, "test": pairs.select(range(2))})
    with pytest.raises(ValueError, match=r"the dataset\[test\] has no column 'answer'"):  # the accuracy check reads it
        load_task(RecipeArguments(dataset_name=no_answers, eval_accuracy=True, eval_metric="accuracy"), rewarded=False)
    assert len(load_task(RecipeArguments(dataset_name=no_answers), rewarded=False).test) == 2


def test_a_folder_whose_files_differ_in_columns_is_one_clear_error(tmp_path):
    pairs = [{"prompt": r["prompt"], "chosen": "a", "rejected": "b"} for r in TEXT_ROWS]
    with pytest.raises(ValueError, match=r"data: its files do not all have the same columns \(one has \["):
        load_task(args_for(folder(tmp_path, pairs, test_rows=TEXT_ROWS[:2])), rewarded=False)


def test_recipe_trains_and_evaluates_on_a_folder_of_text_prompts(tmp_path, tiny_model_dir):
    """The issue's run: a YAML recipe on a local folder with train.jsonl / test.jsonl (text 'prompt', 'answer'),
    held-out evaluation on, to the end (it crashed in the evaluation: "Chat messages should be dicts ...")."""
    from trinity_trl.cli import run

    source = folder(tmp_path, TEXT_ROWS, test_rows=TEXT_ROWS[:4])
    config = tmp_path / "mine.yaml"
    config.write_text(
        f"dataset_name: {source}\neval_accuracy: true\nmodel_name_or_path: {tiny_model_dir}\n"
        f"output_dir: {tmp_path / 'out'}\nmax_steps: 1\nper_device_train_batch_size: 4\nnum_generations: 4\n"
        "max_completion_length: 8\neval_max_new_tokens: 8\nuse_cpu: true\nbf16: false\nreport_to: none\n"
        'save_strategy: "no"\nplot: false\nlora_r: 4\nlora_alpha: 8\n'
    )
    trainer = run(["cispo", "--config", str(config)])
    log = json.loads((tmp_path / "out" / "training_log.json").read_text())
    assert trainer.state.global_step == 1 and log["summary"]["reward_after"] is not None
    assert f"held-out rows of `{source}`" in (tmp_path / "out" / "README.md").read_text()


def test_the_held_out_evaluation_scores_with_the_training_rewards(tmp_path, tiny_model_dir, capsys):
    """On one's own data the evaluation is the training reward functions on greedy completions (issue 43): the mean
    of the weighted reward sum, each function's mean over the rows it scores (None leaves a row out), and the share
    of rows at a declared maximum (`fn.max_reward`) for the functions that declare one. Rewards read from a column
    make every number known in advance, whatever the model writes."""
    from trinity_trl.cli import run

    (tmp_path / "my_scores.py").write_text(
        "def score_reward(completions, score, **kw):\n    return list(score)\n"
        "score_reward.max_reward = 1.0\n"
        "def not_first(completions, score, **kw):\n    return [None] + [1.0] * (len(score) - 1)\n"
    )
    rows = [dict(r, score=s) for r, s in zip(TEXT_ROWS, [1.0, 0.0, 1.0, 0.5] * 2)]
    source = folder(tmp_path, rows, test_rows=rows[:4])
    _, tiny = RUNS["cispo"]
    rewards = [f"{tmp_path / 'my_scores.py'}:score_reward", f"{tmp_path / 'my_scores.py'}:not_first"]
    run(
        ["cispo", "--config", "cispo_cpu", "--dataset_name", source, "--model_name_or_path", tiny_model_dir,
         "--output_dir", str(tmp_path / "out"), *tiny, "--max_steps", "1", "--plot", "false", "--reward_funcs",
         *rewards]
    )  # fmt: skip
    summary = json.loads((tmp_path / "out" / "training_log.json").read_text())["summary"]
    # rows: score 1, 0, 1, 0.5; not_first: None, 1, 1, 1 -> weighted sums 1, 1, 2, 1.5
    assert summary["eval_metric"] == "reward" and summary["reward_before"] == summary["reward_after"] == 1.375
    assert summary["success_after"] == {"score_reward": 0.5} and "accuracy_after" not in summary
    printed = capsys.readouterr()
    lines = [line for line in (printed.out + printed.err).splitlines() if "held-out evaluation" in line]
    assert lines[1] == (
        "[trinity-trl] held-out evaluation after training: mean reward 1.375 (score_reward 0.625, not_first 1.000), "
        "success 0.500 (score_reward = its maximum 1) (4 rows; greedy completions scored by the training reward "
        "functions)"
    ), lines
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"The training reward functions `score_reward`, `not_first` on 4 held-out rows of `{source}`" in card
    assert "Share of rows at `score_reward`'s declared maximum (1): **0.500** before, **0.500** after." in card


def test_the_held_out_evaluation_says_which_check_it_uses(tmp_path, tiny_model_dir, capsys):
    """Asked for (eval_metric accuracy), the evaluation is the exact final-answer check whatever the training reward
    (issue 35): the log line and the card say so, and name the user's reward functions it is not."""
    from trinity_trl.cli import run

    (tmp_path / "my_rewards_eval.py").write_text("def short(completions, **kw):\n    return [0.0] * len(completions)\n")
    source = folder(tmp_path, TEXT_ROWS, test_rows=TEXT_ROWS[:4])
    _, tiny = RUNS["cispo"]
    run(
        ["cispo", "--config", "cispo_cpu", "--dataset_name", source, "--model_name_or_path", tiny_model_dir,
         "--output_dir", str(tmp_path / "out"), *tiny, "--max_steps", "1", "--plot", "false", "--eval_accuracy",
         "true", "--eval_metric", "accuracy", "--reward_funcs", f"{tmp_path / 'my_rewards_eval.py'}:short"]
    )  # fmt: skip
    printed = capsys.readouterr()
    lines = [line for line in (printed.out + printed.err).splitlines() if "held-out accuracy" in line]
    check = f"exact final-answer check against the 'answer' column, not the reward function {tmp_path}/my_rewards_eval"
    assert len(lines) == 2 and all(f"(4 problems; greedy, {check}.py:short)" in line for line in lines), lines
    assert f"; {check}.py:short): **" in (tmp_path / "out" / "README.md").read_text()


def test_chord_on_ones_own_data_from_the_documented_command(tmp_path, tiny_model_dir, capsys):
    """docs/configuration.md#your-own-data: `trinity-trl chord --config chord_cpu --dataset_name data/
    --expert_dataset_name demos.jsonl` runs; chord_cpu's `rollout_kinds: [mul, div]` (bundled task only) is
    ignored with one line instead of stopping the run (issue 35)."""
    from trinity_trl.cli import run

    demos = [{"prompt": r["prompt"], "completion": f"The answer is {r['answer']}."} for r in TEXT_ROWS]
    expert = jsonl(tmp_path / "demos.jsonl", demos)
    source = folder(tmp_path, TEXT_ROWS)
    _, tiny = RUNS["chord"]
    trainer = run(
        ["chord", "--config", "chord_cpu", "--dataset_name", source, "--expert_dataset_name", expert,
         "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "out"), *tiny,
         "--eval_accuracy", "false", "--plot", "false"]
    )  # fmt: skip
    assert trainer.state.global_step == 2 and trainer.train_dataset["prompt"][0] == TEXT_ROWS[0]["prompt"]
    printed = capsys.readouterr()
    notes = [line for line in (printed.out + printed.err).splitlines() if "rollout_kinds" in line]
    assert notes == [
        f"[trinity-trl] rollout_kinds ['mul', 'div'] ignored: it selects templates of the bundled 'arithmetic' "
        f"task, and dataset_name is {source!r}"
    ]


def test_question_and_answer_columns_are_read_as_gsm8k_only_when_the_answers_are_gsm8ks(tmp_path, capsys):
    """Issue 43: GSM8K's layout is guessed from its columns only when every answer ends '#### <number>', and said
    in one line; another task's 'question' + 'answer' is a one-line error saying how to name the columns; the guess
    can be switched off (dataset_layout prompt) or forced (gsm8k)."""
    gsm8k = [
        {"question": f"Tom has {i} apples and buys 2. How many?", "answer": f"{i}+2={i + 2}\n#### {i + 2}"}
        for i in range(4)
    ]
    capitals = [{"question": "What is the capital of Kenya?", "answer": "Nairobi"}] * 4
    task = load_task(args_for(folder(tmp_path, gsm8k, name="gsm")))
    assert task.train[0]["answer"] == "2" and "The answer is" in str(task.train[0]["prompt"])
    said = [line for line in capsys.readouterr().out.splitlines() if "GSM8K" in line]
    assert len(said) == 1 and "read as GSM8K" in said[0] and "--dataset_layout prompt" in said[0], said
    with pytest.raises(ValueError, match=r"has no column 'prompt'"):
        load_task(args_for(str(tmp_path / "gsm"), "--dataset_layout", "prompt"))
    source = folder(tmp_path, capitals, name="capitals")
    with pytest.raises(
        UsageError,
        match=r"capitals\[train\] has 'question' \+ 'answer' columns but no 'prompt', and "
        r"its answers are not GSM8K's .* row 0: 'Nairobi'\): rename 'question' to 'prompt'",
    ):
        load_task(args_for(source))
    forced = load_task(args_for(source, "--dataset_layout", "gsm8k", "--eval_accuracy", "false"))
    assert forced.train[0]["answer"] == "Nairobi"
    assert not [line for line in capsys.readouterr().out.splitlines() if "GSM8K" in line]  # asked for: no note
