"""`trinity_trl/rollouts/envs/` and `environment.py`: the bundled environments (number guessing, calculator), their
datasets and the environment protocol."""

from __future__ import annotations

import re

import pytest

from trinity_trl.rollouts import (
    CalculatorEnv,
    Environment,
    NumberGuessEnv,
    StepResult,
    calculator_dataset,
    number_guess_dataset,
)
from trinity_trl.rollouts.envs.calculator import safe_eval


# ------------------------------------------------------------------------------------------------- number guess
def test_number_guess_environment():
    env = NumberGuessEnv()
    assert "between 1 and 100" in env.reset(target=42, low=1, high=100)
    assert env.step("I guess 50").observation.endswith("lower.")
    assert env.step("no idea").observation.startswith("Please")
    result = env.step("Is it 42?")
    assert result.done and result.reward == 1.0
    partial = NumberGuessEnv(partial_credit=True)
    partial.reset(target=10, low=1, high=100)
    assert partial.step("20").reward == pytest.approx(0.5 * (1 - 10 / 99))
    with pytest.raises(ValueError):
        NumberGuessEnv().reset(target=200, low=1, high=100)


def test_number_guess_feedback_and_rewards():
    env = NumberGuessEnv()
    env.reset(target=7, low=1, high=10)
    low = env.step("3")
    assert low == StepResult(
        "3 is wrong. The number is higher.", reward=0.0, done=False, info={"guess": 3, "env_state_hash": (4, 10)}
    )
    # the last number of the turn is the guess; the state is the range the hints leave
    assert env.step("between 2 and 9").info == {"guess": 9, "env_state_hash": (4, 8)}
    assert env.step("2").info == {"guess": 2, "env_state_hash": (4, 8)}  # outside the range: nothing learned
    assert env.step("no number").info == {"env_state_hash": (4, 8)}
    assert env.step("7").done


def test_number_guess_partial_credit_pays_the_closest_miss_so_far():
    env = NumberGuessEnv(partial_credit=True)
    env.reset(target=50, low=0, high=100)
    assert env.step("60").reward == pytest.approx(0.5 * (1 - 10 / 100))
    assert env.step("90").reward == pytest.approx(0.5 * (1 - 10 / 100))  # a worse guess keeps the best distance
    assert env.step("nothing").reward == pytest.approx(0.5 * (1 - 10 / 100))
    assert env.step("50").reward == 1.0
    assert NumberGuessEnv().reset(target=1, low=1, high=1)  # a one-number range is allowed


def test_number_guess_dataset():
    rows = number_guess_dataset(20, low=5, high=9, seed=3)
    assert rows.column_names == ["target", "low", "high"] and len(rows) == 20
    assert all(5 <= t <= 9 for t in rows["target"]) and set(rows["low"]) == {5} and set(rows["high"]) == {9}
    assert rows["target"] == number_guess_dataset(20, low=5, high=9, seed=3)["target"]  # seeded
    assert rows["target"] != number_guess_dataset(20, low=5, high=9, seed=4)["target"]


# --------------------------------------------------------------------------------------------------- calculator
def test_calculator_environment():
    env = CalculatorEnv()
    env.reset(question="What is 3*4-2?", answer=10)
    assert env.step("calc(3*4)").observation == "calc(3*4) = 12"
    assert "Error" in env.step("calc(x+1)").observation  # names are not evaluated
    assert "Error" in env.step("calc(2**64)").observation  # nor powers
    assert not env.step("hmm").done
    result = env.step("answer(10)")
    assert result.done and result.reward == 1.0
    assert safe_eval("-(2+3)*4") == -20
    rows = calculator_dataset(4)
    assert len(rows) == 4 and all(isinstance(a, int) for a in rows["answer"])


def test_calculator_wrong_answer_ends_the_episode_unrewarded():
    env = CalculatorEnv()
    prompt = env.reset(question="What is 2+2?", answer="4")
    assert prompt.startswith("What is 2+2?\n") and "calc(EXPRESSION)" in prompt and "answer(NUMBER)" in prompt
    assert env.step("answer( 5 )") == StepResult("Wrong.", reward=0.0, done=True)
    assert env.step("calc(1+1) then answer(4)") == StepResult("Correct.", reward=1.0, done=True)  # answer wins


@pytest.mark.parametrize("expression", ["__import__('os')", "abs(-1)", "2**3", "7/2", "True+1", "1 +", "'a'*3", "x"])
def test_safe_eval_refuses_anything_but_integer_arithmetic(expression):
    with pytest.raises(ValueError, match="unsupported expression"):
        safe_eval(expression)


def test_calculator_partial_credit():
    """partial_credit: 1 for the right answer, 0.5 for a wrong one after computing the right value, 0.1 for a wrong
    one after only well-formed calls, 0 after a malformed turn; the first message shows a worked exchange."""
    env = CalculatorEnv(partial_credit=True)
    prompt = env.reset(question="A shop sells 3 apples of 10. How many are left?", answer=7)
    assert prompt.endswith("Problem: A shop sells 3 apples of 10. How many are left?")
    assert "You: calc(4*20-13)" in prompt and "You: answer(67)" in prompt
    assert env.step("answer(7)") == StepResult("Correct.", reward=1.0, done=True)
    env.reset(question="q", answer=7)
    assert env.step("calc(10-3)").reward == 0.0  # a step's reward before the end
    assert env.step("answer(8)") == StepResult("Wrong.", reward=0.5, done=True)
    env.reset(question="q", answer=7)
    env.step("calc(10-2)")
    assert env.step("answer(8)").reward == 0.1
    env.reset(question="q", answer=7)
    assert env.step("answer(8)").reward == 0.1  # answering at once is well-formed too
    env.reset(question="q", answer=7)
    env.step("I think it is 7")
    assert env.step("answer(8)").reward == 0.0
    env.reset(question="q", answer=7)
    env.step("calc(x)")
    assert env.step("answer(8)").reward == 0.0
    assert CalculatorEnv().reset(question="q", answer=1).startswith("q\n")  # without partial credit: as before


def test_calculator_dataset_answers_its_questions():
    rows = calculator_dataset(16, seed=1)
    for question, answer in zip(rows["question"], rows["answer"]):
        c, a, b = map(
            int,
            re.fullmatch(
                r"A shop has (\d+) boxes with (\d+) apples each and sells (\d+) apples\. "
                r"How many apples are left\?",
                question,
            ).groups(),
        )
        assert answer == a * c - b
    assert rows["question"] == calculator_dataset(16, seed=1)["question"]


# -------------------------------------------------------------------------------------------------- protocol
def test_environment_base_class_methods_must_be_overridden():
    with pytest.raises(NotImplementedError):
        Environment().reset(target=1)
    with pytest.raises(NotImplementedError):
        Environment().step("hi")


def test_step_result_defaults():
    result = StepResult("obs")
    assert (result.reward, result.done, result.info) == (0.0, False, {})
    assert StepResult("a").info is not StepResult("b").info  # no shared mutable default
