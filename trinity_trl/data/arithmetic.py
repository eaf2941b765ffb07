"""Bundled task: arithmetic word problems with verified answers and worked expert solutions.

Problems are made by code from templates (one or two operations on small whole numbers), so the
answer of every problem is known exactly, and each comes with a short worked solution that ends
with ``The answer is N.`` (CHORD's expert demonstrations). The split of a problem (``train`` or
``test``) is a stable hash of its text, so the held-out split never shares a problem with the
training split, whatever the seeds and sizes::

    from trinity_trl.data import arithmetic_dataset, arithmetic_expert_dataset, arithmetic_reward

    train = arithmetic_dataset("train", 512, seed=0)     # columns: prompt (messages), answer, solution
    test = arithmetic_dataset("test", 100, seed=0)
    expert = arithmetic_expert_dataset(256, seed=1)      # columns: prompt, completion (messages)
    arithmetic_reward(completions=[[{"role": "assistant", "content": "... The answer is 12."}]], answer=["12"])

The reward is an exact check of the final answer: the number after the last "answer is" when the
completion has one, otherwise the last number in the completion. Answers are whole numbers, so an
exact comparison is a complete check (a symbolic checker such as math-verify adds nothing here).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from typing import Any

INSTRUCTION = "Solve the problem. Reason briefly, then end with 'The answer is <number>.'"
SPLITS = ("train", "test")
TEST_FRACTION = 0.2

_NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kemal", "Lena",
          "Mia", "Noah", "Olga", "Pablo", "Rosa", "Sam", "Tara", "Yuki"]
_ITEMS = ["apples", "books", "marbles", "pencils", "stickers", "coins", "cookies", "cards", "shells", "stamps"]


def _add(rng: random.Random, name: str, item: str):
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    return (f"{name} has {a} {item}. {name} buys {b} more {item}. How many {item} does {name} have now?",
            f"{name} starts with {a} {item} and buys {b} more, so {a} + {b} = {a + b}.", a + b)


def _sub(rng: random.Random, name: str, item: str):
    b = rng.randint(2, 20)
    a = rng.randint(b + 1, 40)
    return (f"{name} has {a} {item} and gives {b} of them to a friend. How many {item} does {name} have left?",
            f"{name} starts with {a} {item} and gives away {b}, so {a} - {b} = {a - b}.", a - b)


def _mul(rng: random.Random, name: str, item: str):
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return (f"{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have in total?",
            f"There are {a} boxes of {b} {item}, so {a} * {b} = {a * b}.", a * b)


def _div(rng: random.Random, name: str, item: str):
    b, each = rng.randint(2, 9), rng.randint(2, 9)
    a = b * each
    return (f"{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?",
            f"{a} {item} shared among {b} friends gives {a} / {b} = {each} each.", each)


def _two_step(rng: random.Random, name: str, item: str):
    a, b = rng.randint(5, 25), rng.randint(2, 15)
    c = rng.randint(1, a + b - 1)
    return (f"{name} has {a} {item}, buys {b} more and then gives {c} away. How many {item} does {name} have now?",
            f"{name} has {a} + {b} = {a + b} {item} after buying, then {a + b} - {c} = {a + b - c}.", a + b - c)


TEMPLATES: dict[str, Callable[[random.Random, str, str], tuple[str, str, int]]] = {
    "add": _add, "sub": _sub, "mul": _mul, "div": _div, "two_step": _two_step,
}


def split_of(problem: str) -> str:
    """The split a problem belongs to: a stable hash of its text (``test`` for ~20 % of problems)."""
    digest = int.from_bytes(hashlib.sha256(problem.encode()).digest()[:4], "big")
    return "test" if digest % 1000 < TEST_FRACTION * 1000 else "train"


def prompt_messages(problem: str) -> list[dict[str, str]]:
    """The conversational prompt of a problem (one user turn: the problem and the answer format)."""
    return [{"role": "user", "content": f"{problem}\n{INSTRUCTION}"}]


def make_problems(split: str, num_rows: int, seed: int = 0,
                  kinds: Sequence[str] = tuple(TEMPLATES)) -> list[dict[str, Any]]:
    """``num_rows`` distinct problems of ``split``: dicts with problem, prompt, solution, answer (str), kind."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    unknown = sorted(set(kinds) - set(TEMPLATES))
    if unknown or not kinds:
        raise ValueError(f"unknown problem kinds {unknown or list(kinds)}; choose from {sorted(TEMPLATES)}")
    rng = random.Random(f"arithmetic-{split}-{seed}")
    rows, seen = [], set()
    attempts = 0
    while len(rows) < num_rows:
        attempts += 1
        if attempts > 100 * num_rows + 1000:
            raise ValueError(f"could not make {num_rows} distinct {split} problems of kinds {list(kinds)}")
        kind = kinds[len(rows) % len(kinds)]
        problem, steps, answer = TEMPLATES[kind](rng, rng.choice(_NAMES), rng.choice(_ITEMS))
        if problem in seen or split_of(problem) != split:
            continue
        seen.add(problem)
        rows.append({"problem": problem, "prompt": prompt_messages(problem),
                     "solution": f"{steps} The answer is {answer}.", "answer": str(answer), "kind": kind})
    return rows


def arithmetic_dataset(split: str = "train", num_rows: int = 512, seed: int = 0,
                       kinds: Sequence[str] = tuple(TEMPLATES)):
    """A `datasets.Dataset` of problems: ``prompt`` (messages), ``answer``, ``solution``, ``problem``, ``kind``."""
    from datasets import Dataset

    return Dataset.from_list(make_problems(split, num_rows, seed, kinds))


def arithmetic_expert_dataset(num_rows: int = 256, seed: int = 1, kinds: Sequence[str] = tuple(TEMPLATES)):
    """Expert demonstrations for CHORD: ``prompt`` (messages) and ``completion`` (the worked solution).

    Drawn from the training split; use a different ``seed`` than the RL prompts to keep them apart.
    """
    from datasets import Dataset

    rows = make_problems("train", num_rows, seed, kinds)
    return Dataset.from_list([{"prompt": r["prompt"], "completion": [{"role": "assistant", "content": r["solution"]}]}
                              for r in rows])


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_ANSWER_IS = re.compile(rf"answer\s+is\s*:?\s*\$?\s*(?:\\boxed\{{)?\s*({_NUMBER})", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: after the last "answer is", else the last number; None if no number."""
    found = _ANSWER_IS.findall(text)
    if not found:
        found = _ANY_NUMBER.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "")
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    return value


def _completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):  # conversational: the assistant messages of the completion
        return "".join(m["content"] if isinstance(m.get("content"), str) else "" for m in completion)
    raise TypeError(f"a completion must be a string or a list of messages, got {type(completion).__name__}")


def arithmetic_reward(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when the completion's final answer equals the reference answer exactly, else 0.0 (TRL reward function)."""
    if len(completions) != len(answer):
        raise ValueError(f"arithmetic_reward got {len(completions)} completions but {len(answer)} answers")
    return [float(extract_answer(_completion_text(c)) == str(a).strip()) for c, a in zip(completions, answer)]


def evaluate_accuracy(model, tokenizer, dataset, batch_size: int = 32, max_new_tokens: int = 64,
                      progress: bool = True, return_completions: bool = False):
    """Greedy accuracy of ``model`` on ``dataset`` (rows with ``prompt`` messages and ``answer``).

    Returns the accuracy in [0, 1] (and the decoded completions when ``return_completions``).
    """
    import torch
    from tqdm.auto import tqdm

    if len(dataset) == 0:
        raise ValueError("evaluate_accuracy needs at least one row")
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    completions: list[str] = []
    try:
        for start in tqdm(range(0, len(dataset), batch_size), desc="evaluate", disable=not progress):
            rows = dataset[start:start + batch_size]
            texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in rows["prompt"]]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with torch.no_grad():
                out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
            completions += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    rewards = arithmetic_reward(completions, list(dataset["answer"]))
    accuracy = sum(rewards) / len(rewards)
    return (accuracy, completions) if return_completions else accuracy


def arithmetic_preference_dataset(num_rows: int = 256, seed: int = 2, kinds: Sequence[str] = tuple(TEMPLATES)):
    """Preference pairs for DPO: ``prompt``, ``chosen`` (the worked solution), ``rejected`` (a wrong final answer).

    The rejected answer repeats the solution with its final result off by 1 to 5, so the pair differs
    only in the numbers that make it wrong.
    """
    from datasets import Dataset

    rng = random.Random(f"arithmetic-preference-{seed}")
    pairs = []
    for row in make_problems("train", num_rows, seed, kinds):
        answer = int(row["answer"])
        wrong = answer + rng.choice([-1, 1]) * rng.randint(1, 5)
        if wrong < 0:
            wrong = answer + rng.randint(1, 5)
        rejected = row["solution"].replace(f"= {answer}", f"= {wrong}").replace(f"The answer is {answer}.",
                                                                               f"The answer is {wrong}.")
        pairs.append({"prompt": row["prompt"], "chosen": [{"role": "assistant", "content": row["solution"]}],
                      "rejected": [{"role": "assistant", "content": rejected}]})
    return Dataset.from_list(pairs)
