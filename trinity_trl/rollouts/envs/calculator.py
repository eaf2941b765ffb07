"""Arithmetic word problems with a calculator tool: compute, read the result, then answer.

Two versions of one task, one per environment protocol:

* `CalculatorEnv` (reset/step): the model writes ``calc(EXPR)`` or ``answer(N)`` as plain text.
* `CalculatorToolEnv` (TRL's tool protocol): ``calc(expression)`` and ``answer(number)`` are tools the
  model calls in its chat template's tool-call format; ``get_reward()`` checks the submitted answer.
"""

from __future__ import annotations

import ast
import operator
import random
import re

from ..environment import Environment, StepResult

_CALL = re.compile(r"calc\(([^()]*)\)")
_ANSWER = re.compile(r"answer\(\s*(-?\d+)\s*\)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def safe_eval(expression: str) -> int:
    """Evaluate ``+ - *`` integer arithmetic (no names, calls or powers); ``ValueError`` otherwise."""

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"unsupported expression: {expression!r}")

    try:
        return walk(ast.parse(expression.strip(), mode="eval"))
    except SyntaxError as err:
        raise ValueError(f"unsupported expression: {expression!r}") from err


class CalculatorEnv(Environment):
    """Solve ``question`` whose answer is ``answer``. Each turn the model may write ``calc(EXPR)``
    (the environment replies with the value) or ``answer(N)`` (ends the episode).

    Reward: 1.0 for a correct ``answer(N)``, else 0.0. A turn with neither gets a reminder.
    ``partial_credit=True`` gives a small model a denser signal: 0.5 for a wrong ``answer(N)`` after a ``calc`` that
    computed the right value, 0.1 for a wrong answer after only well-formed calls (``calc`` of a valid
    expression or ``answer(N)``), and the first message shows one worked exchange in the expected format (the
    bundled SmolLM2-135M almost never writes ``calc(...)`` without one).
    """

    EXAMPLE = (
        "Example: A shop has 4 boxes with 20 apples each and sells 13 apples. How many apples are left?\n"
        "You: calc(4*20-13)\nMe: calc(4*20-13) = 67\nYou: answer(67)\n\nProblem: "
    )

    def __init__(self, partial_credit: bool = False):
        self.partial_credit = partial_credit

    def reset(self, question: str, answer: int, **row) -> str:
        self.answer = int(answer)
        self.computed, self.well_formed = False, True
        instructions = (
            "You have a calculator: write calc(EXPRESSION), for example calc(12*7), and I "
            "will reply with the result. When you know the result, write answer(NUMBER)."
        )
        if self.partial_credit:
            return f"{instructions}\n{self.EXAMPLE}{question}"
        return f"{question}\n{instructions}"

    def step(self, action: str) -> StepResult:
        final = _ANSWER.search(action)
        if final:
            correct = int(final.group(1)) == self.answer
            reward = float(correct)
            if not correct and self.partial_credit:
                reward = 0.5 if self.computed else 0.1 if self.well_formed else 0.0
            return StepResult("Correct." if correct else "Wrong.", reward=reward, done=True)
        call = _CALL.search(action)
        if call:
            try:
                value = safe_eval(call.group(1))
            except ValueError as err:
                self.well_formed = False
                return StepResult(f"Error: {err}. Use + - * and whole numbers.")
            self.computed = self.computed or value == self.answer
            return StepResult(f"calc({call.group(1)}) = {value}")
        self.well_formed = False
        return StepResult("Write calc(EXPRESSION) to compute or answer(NUMBER) to finish.")


class CalculatorToolEnv:
    """The calculator task as a TRL tool environment (``GRPOTrainer``/``StepGRPOTrainer`` ``environment_factory``).

    Tools: ``calc(expression)`` returns the value of ``+ - *`` whole-number arithmetic (a bad expression raises,
    which TRL reports to the model as ``{"error": ...}``); ``answer(number)`` submits the final answer. A run
    ends at the first turn without a tool call. ``get_reward()``: 1.0 for a correct submitted answer, 0.2 when the
    right value was computed with ``calc`` but not submitted (a denser signal for small models), else 0.0.
    """

    def reset(self, answer: int, **row) -> None:
        self.target, self.submitted, self.results = int(answer), None, []
        return None  # the question is in the row's prompt

    def calc(self, expression: str) -> str:
        """Evaluate an arithmetic expression with whole numbers and the operators + - *.

        Args:
            expression: The expression to evaluate, for example "12*7-5".

        Returns:
            The value of the expression.
        """
        value = safe_eval(str(expression))
        self.results.append(value)
        return str(value)

    def answer(self, number: int) -> str:
        """Submit the final answer to the question.

        Args:
            number: The final answer, a whole number.

        Returns:
            A confirmation.
        """
        self.submitted = int(number)
        return f"Submitted {self.submitted}."

    def get_reward(self) -> float:
        if self.submitted == self.target:
            return 1.0
        return 0.2 if self.target in self.results else 0.0


CALCULATOR_TOOL_SYSTEM_PROMPT = (
    "You solve arithmetic word problems. First call the calc tool with the expression to compute, then call the "
    "answer tool with the result."
)


def _word_problems(n: int, seed: int) -> tuple[list[str], list[int]]:
    rng = random.Random(seed)
    questions, answers = [], []
    for _ in range(n):
        a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(2, 9)
        questions.append(f"A shop has {c} boxes with {a} apples each and sells {b} apples. How many apples are left?")
        answers.append(a * c - b)
    return questions, answers


def calculator_dataset(n: int = 64, seed: int = 0):
    """``n`` two-operation word problems (columns ``question``, ``answer``) for `CalculatorEnv`."""
    from datasets import Dataset

    questions, answers = _word_problems(n, seed)
    return Dataset.from_dict({"question": questions, "answer": answers})


def calculator_tool_dataset(n: int = 64, seed: int = 0):
    """The same problems for `CalculatorToolEnv`: columns ``prompt`` (a system message asking for the tools,
    and the question as the user message), ``question`` and ``answer``."""
    from datasets import Dataset

    questions, answers = _word_problems(n, seed)
    prompts = [
        [{"role": "system", "content": CALCULATOR_TOOL_SYSTEM_PROMPT}, {"role": "user", "content": q}]
        for q in questions
    ]
    return Dataset.from_dict({"prompt": prompts, "question": questions, "answer": answers})
