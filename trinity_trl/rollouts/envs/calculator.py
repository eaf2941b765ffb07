"""Arithmetic word problems with a calculator tool: compute, read the result, then answer."""

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
    """

    def reset(self, question: str, answer: int, **row) -> str:
        self.answer = int(answer)
        return (f"{question}\nYou have a calculator: write calc(EXPRESSION), for example calc(12*7), and I "
                "will reply with the result. When you know the result, write answer(NUMBER).")

    def step(self, action: str) -> StepResult:
        final = _ANSWER.search(action)
        if final:
            correct = int(final.group(1)) == self.answer
            return StepResult("Correct." if correct else "Wrong.", reward=float(correct), done=True)
        call = _CALL.search(action)
        if call:
            try:
                return StepResult(f"calc({call.group(1)}) = {safe_eval(call.group(1))}")
            except ValueError as err:
                return StepResult(f"Error: {err}. Use + - * and whole numbers.")
        return StepResult("Write calc(EXPRESSION) to compute or answer(NUMBER) to finish.")


def calculator_dataset(n: int = 64, seed: int = 0):
    """``n`` two-operation word problems (columns ``question``, ``answer``)."""
    from datasets import Dataset

    rng = random.Random(seed)
    questions, answers = [], []
    for _ in range(n):
        a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(2, 9)
        questions.append(f"A shop has {c} boxes with {a} apples each and sells {b} apples. How many apples are left?")
        answers.append(a * c - b)
    return Dataset.from_dict({"question": questions, "answer": answers})
