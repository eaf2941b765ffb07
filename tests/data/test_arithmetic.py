"""`trinity_trl/data/arithmetic.py`: the bundled arithmetic task: verified answers, disjoint splits, demonstrations,
preference pairs and the reward."""

from __future__ import annotations

import re

import pytest

from trinity_trl.data.arithmetic import (
    TEMPLATES,
    arithmetic_dataset,
    arithmetic_expert_dataset,
    arithmetic_preference_dataset,
    arithmetic_reward,
    evaluate_accuracy,
    extract_answer,
    make_problems,
    split_of,
)


def _checked(expression: str) -> int:
    """Evaluate 'a op b' of a worked solution with Python's own arithmetic."""
    a, op, b = re.fullmatch(r"(\d+) ([-+*/]) (\d+)", expression).groups()
    a, b = int(a), int(b)
    return {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]


def test_every_step_of_every_solution_is_correct_and_ends_with_the_answer():
    for row in make_problems("train", 300, seed=3) + make_problems("test", 100, seed=3):
        steps = re.findall(r"(\d+ [-+*/] \d+) = (\d+)", row["solution"])
        assert steps, row
        for expression, result in steps:
            assert _checked(expression) == int(result), row
        assert row["solution"].endswith(f"The answer is {row['answer']}.")
        assert int(steps[-1][1]) == int(row["answer"]) >= 0
        if "/" in row["solution"]:
            a, b = map(int, re.search(r"(\d+) / (\d+)", row["solution"]).groups())
            assert a % b == 0  # shares are whole


def test_splits_are_disjoint_deterministic_and_of_the_requested_size():
    train = make_problems("train", 400, seed=0)
    test = make_problems("test", 100, seed=0)
    assert len(train) == 400 and len(test) == 100
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    assert len({r["problem"] for r in train}) == 400  # distinct
    assert all(split_of(r["problem"]) == "test" for r in test)
    assert make_problems("test", 100, seed=0) == test
    assert make_problems("test", 100, seed=1) != test
    assert {r["kind"] for r in train} == set(TEMPLATES)


def test_bad_arguments():
    with pytest.raises(ValueError, match="split must be one of"):
        make_problems("valid", 3)
    with pytest.raises(ValueError, match="unknown problem kinds"):
        make_problems("train", 3, kinds=("add", "pow"))
    with pytest.raises(ValueError, match="num_rows must be >= 0"):
        make_problems("train", -1)


def test_datasets_have_the_trainer_columns():
    rl = arithmetic_dataset("train", 5)
    assert set(rl.column_names) == {"prompt", "answer", "solution", "problem", "kind"}
    assert rl[0]["prompt"][0]["role"] == "user" and rl[0]["problem"] in rl[0]["prompt"][0]["content"]
    expert = arithmetic_expert_dataset(4)
    assert expert.column_names == ["prompt", "completion"]
    assert expert[0]["completion"][0]["role"] == "assistant"
    assert re.search(r"The answer is \d+\.$", expert[0]["completion"][0]["content"])


def test_preference_pairs_differ_only_in_a_wrong_answer():
    for row in arithmetic_preference_dataset(50, seed=0):
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        good, bad = extract_answer(chosen), extract_answer(rejected)
        assert good != bad and int(bad) >= 0
        assert re.sub(r"\d+", "N", chosen) == re.sub(r"\d+", "N", rejected)


@pytest.mark.parametrize("text, answer", [
    ("3 + 4 = 7. The answer is 7.", "7"),
    ("The answer is 12. Wait, 3 more: 15", "12"),          # the stated answer wins over later numbers
    ("so it is 1,234 in total", "1234"),
    ("The answer is: $\\boxed{42}$", "42"),
    ("The answer is -3.", "-3"),
    ("The answer is 6.50", "6.5"),
    ("no number here", None),
    ("first 3 then 9", "9"),                               # no 'answer is': the last number
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_reward_is_an_exact_check_on_text_and_messages():
    completions = ["The answer is 7.", [{"role": "assistant", "content": "so 3 + 4 = 7"}], "The answer is 8.", ""]
    assert arithmetic_reward(completions, answer=["7", "7", "7", "7"]) == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        arithmetic_reward(["1", "2"], answer=["1"])


def test_evaluate_accuracy_scores_greedy_generations(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = arithmetic_dataset("test", 6)
    accuracy, completions = evaluate_accuracy(model, tokenizer, data, batch_size=4, max_new_tokens=6,
                                              progress=False, return_completions=True)
    assert len(completions) == 6
    assert accuracy == sum(arithmetic_reward(completions, list(data["answer"]))) / 6
    model.train()  # evaluation switches to eval mode and back
    evaluate_accuracy(model, tokenizer, data.select(range(2)), max_new_tokens=2, progress=False)
    assert model.training and tokenizer.padding_side == AutoTokenizer.from_pretrained(tiny_model_dir).padding_side
    with pytest.raises(ValueError, match="at least one row"):
        evaluate_accuracy(model, tokenizer, data.select([]), progress=False)
