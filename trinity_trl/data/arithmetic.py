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

_NAMES = [
    "Anna",
    "Ben",
    "Carla",
    "David",
    "Emma",
    "Farid",
    "Grace",
    "Hugo",
    "Iris",
    "Jonas",
    "Kemal",
    "Lena",
    "Mia",
    "Noah",
    "Olga",
    "Pablo",
    "Rosa",
    "Sam",
    "Tara",
    "Yuki",
]
_ITEMS = ["apples", "books", "marbles", "pencils", "stickers", "coins", "cookies", "cards", "shells", "stamps"]


def _add(rng: random.Random, name: str, item: str):
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    return (
        f"{name} has {a} {item}. {name} buys {b} more {item}. How many {item} does {name} have now?",
        f"{name} starts with {a} {item} and buys {b} more, so {a} + {b} = {a + b}.",
        a + b,
    )


def _sub(rng: random.Random, name: str, item: str):
    b = rng.randint(2, 20)
    a = rng.randint(b + 1, 40)
    return (
        f"{name} has {a} {item} and gives {b} of them to a friend. How many {item} does {name} have left?",
        f"{name} starts with {a} {item} and gives away {b}, so {a} - {b} = {a - b}.",
        a - b,
    )


def _mul(rng: random.Random, name: str, item: str):
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return (
        f"{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have in total?",
        f"There are {a} boxes of {b} {item}, so {a} * {b} = {a * b}.",
        a * b,
    )


def _div(rng: random.Random, name: str, item: str):
    b, each = rng.randint(2, 9), rng.randint(2, 9)
    a = b * each
    return (
        f"{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?",
        f"{a} {item} shared among {b} friends gives {a} / {b} = {each} each.",
        each,
    )


def _two_step(rng: random.Random, name: str, item: str):
    a, b = rng.randint(5, 25), rng.randint(2, 15)
    c = rng.randint(1, a + b - 1)
    return (
        f"{name} has {a} {item}, buys {b} more and then gives {c} away. How many {item} does {name} have now?",
        f"{name} has {a} + {b} = {a + b} {item} after buying, then {a + b} - {c} = {a + b - c}.",
        a + b - c,
    )


TEMPLATES: dict[str, Callable[[random.Random, str, str], tuple[str, str, int]]] = {
    "add": _add,
    "sub": _sub,
    "mul": _mul,
    "div": _div,
    "two_step": _two_step,
}


def split_of(problem: str) -> str:
    """The split a problem belongs to: a stable hash of its text (``test`` for ~20 % of problems)."""
    digest = int.from_bytes(hashlib.sha256(problem.encode()).digest()[:4], "big")
    return "test" if digest % 1000 < TEST_FRACTION * 1000 else "train"


PROMPT_STYLES = ("user", "system")


def prompt_messages(problem: str, style: str = "user") -> list[dict[str, str]]:
    """The conversational prompt of a problem.

    ``style="user"``: one user turn, the problem then the answer format (a chat template adds its default
    system prompt, if it has one). ``"system"``: the answer format as the system message and the problem as
    the user turn, which replaces a default system prompt (SmolLM2's: 58 instead of 75 prompt tokens).
    """
    if style == "user":
        return [{"role": "user", "content": f"{problem}\n{INSTRUCTION}"}]
    if style == "system":
        return [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": problem}]
    raise ValueError(f"prompt style must be one of {PROMPT_STYLES}, got {style!r}")


def make_problems(
    split: str, num_rows: int, seed: int = 0, kinds: Sequence[str] = tuple(TEMPLATES), prompt_style: str = "user"
) -> list[dict[str, Any]]:
    """``num_rows`` distinct problems of ``split``: dicts with problem, prompt, solution, answer (str), kind.

    The kinds (templates) take turns, so each of ``kinds`` has ``num_rows / len(kinds)`` problems (rounded);
    ``prompt_style`` is that of `prompt_messages`.
    """
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")
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
        rows.append(
            {
                "problem": problem,
                "prompt": prompt_messages(problem, prompt_style),
                "solution": f"{steps} The answer is {answer}.",
                "answer": str(answer),
                "kind": kind,
            }
        )
    return rows


def arithmetic_dataset(
    split: str = "train",
    num_rows: int = 512,
    seed: int = 0,
    kinds: Sequence[str] = tuple(TEMPLATES),
    prompt_style: str = "user",
):
    """A `datasets.Dataset` of problems: ``prompt`` (messages), ``answer``, ``solution``, ``problem``, ``kind``."""
    from datasets import Dataset, DatasetInfo

    # the name model cards show for it (trainers read `info.dataset_name`, as datasets sets it for Hub datasets)
    info = DatasetInfo(dataset_name=f"trinity_trl arithmetic ({split})")
    return Dataset.from_list(make_problems(split, num_rows, seed, kinds, prompt_style), info=info)


def arithmetic_expert_dataset(
    num_rows: int = 256, seed: int = 1, kinds: Sequence[str] = tuple(TEMPLATES), prompt_style: str = "user"
):
    """Expert demonstrations for CHORD: ``prompt`` (messages) and ``completion`` (the worked solution).

    Drawn from the training split; use a different ``seed`` than the RL prompts to keep them apart. With
    ``kinds``, only those templates have demonstrations (e.g. to leave others to RL).
    """
    from datasets import Dataset

    rows = make_problems("train", num_rows, seed, kinds, prompt_style)
    return Dataset.from_list(
        [{"prompt": r["prompt"], "completion": [{"role": "assistant", "content": r["solution"]}]} for r in rows]
    )


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


arithmetic_reward.max_reward = 1.0  # declared maximum: the recipes' held-out evaluation reports the share that reach it


# "answer is <number>" followed by a character that cannot continue the number: the answer is complete
_ANSWER_DONE = re.compile(rf"answer\s+is\s*:?\s*\$?\s*(?:\\boxed\{{)?\s*{_NUMBER}(?:[^\d.,]|[.,]\D)", re.IGNORECASE)


def answer_is_complete(text: str) -> bool:
    """Whether ``text`` already states a complete final answer ("... The answer is 12." plus one more character).

    Used to stop a generation early: the number is complete once a character follows that cannot extend it
    (so "The answer is 1" and "The answer is 12." wait for the next token, "The answer is 12.\n" does not).
    """
    return _ANSWER_DONE.search(text) is not None


def _cache_keyword(model) -> str:
    """The forward's keyword for the KV cache: ``cache`` where the model's forward takes it (transformers 5.24
    renamed ``past_key_values``, which then warns on every call), else ``past_key_values``."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    called = getattr(base, "forward", base)  # a module's forward, or any callable standing in for a model
    return "cache" if "cache" in inspect.signature(called).parameters else "past_key_values"


def _eos_ids(model, tokenizer) -> set[int]:
    """The tokens that end a completion: the model's generation config's, as in ``generate``, else the tokenizer's."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])


def _needs_synced_forward(model) -> bool:
    """Whether every process must run the same number of forward passes (ZeRO-3 or FSDP shards parameters
    and gathers them inside forward), as ``generate(synced_gpus=...)`` decides."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from transformers.integrations import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    return is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)


def _any_process(flag: bool, synced: bool, device) -> bool:
    """``flag`` or'ed over processes when forward passes are synced, else ``flag``."""
    if not synced:
        return flag
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value)
    return bool(value.item() > 0)


def _greedy_batch(
    model, input_ids, attention_mask, max_new_tokens: int, eos: set[int], stop, synced: bool, idle_ids
) -> list[list[int]]:
    """Greedy completions (token ids, up to and with EOS) of one left-padded batch, with a KV cache.

    A row finishes at EOS, after ``max_new_tokens`` or when ``stop(ids)`` says its answer is complete;
    finished rows leave the batch (and the cache) once they are a quarter of it, so later steps run on
    the remaining rows. Positions follow the attention mask as in ``generate`` (``cumsum - 1``), so the
    logits are those of ``generate(do_sample=False)``. With ``synced``, a process without rows left runs
    a forward pass of ``idle_ids`` for each step of the others.
    """
    import torch
    from transformers import DynamicCache

    done: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
    batch_rows = list(range(input_ids.shape[0]))  # the dataset row of each row of the batch
    running = set(batch_rows)
    cache = DynamicCache(config=model.config)
    cache_keyword = _cache_keyword(model)
    tokens, mask = input_ids, attention_mask
    position = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    for step in range(max_new_tokens):
        if not _any_process(bool(running), synced, input_ids.device):
            break
        if not running:  # this process is done but others are not: take part in their forward passes
            model(input_ids=idle_ids, use_cache=False)
            continue
        logits = model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=position,
            use_cache=True,
            logits_to_keep=1,
            **{cache_keyword: cache},
        ).logits[:, -1, :]
        chosen = logits.argmax(dim=-1)
        for row, token in zip(batch_rows, chosen.tolist()):
            if row not in running:
                continue
            done[row].append(token)  # EOS included, as in generate's output (decoding skips special tokens)
            if token in eos or step + 1 == max_new_tokens or stop(done[row]):
                running.discard(row)
        if running and len(running) <= 0.75 * len(batch_rows):  # drop the finished rows (copies the cache)
            keep = torch.tensor(
                [i for i, row in enumerate(batch_rows) if row in running], dtype=torch.long, device=input_ids.device
            )
            batch_rows = [batch_rows[i] for i in keep.tolist()]
            chosen, mask, position = chosen[keep], mask[keep], position[keep]
            cache.batch_select_indices(keep)
        tokens = chosen.unsqueeze(1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        position = position[:, -1:] + 1
    return done


def evaluate_accuracy(
    model,
    tokenizer,
    dataset,
    batch_size: int = 32,
    max_new_tokens: int = 64,
    progress: bool = True,
    return_completions: bool = False,
    stop_at_answer: bool = True,
):
    """Greedy accuracy of ``model`` on ``dataset`` (rows with ``prompt`` and ``answer``; a prompt is a
    conversation, rendered with the chat template, or text, given as it is: TRL's two prompt formats).

    Generation is `greedy_completions`: greedy with a KV cache, in batches of ``batch_size`` prompts of similar
    length; a row stops at EOS, after ``max_new_tokens``, or (``stop_at_answer``) as soon as it has stated a complete
    final answer ("The answer is N." and one more token), and finished rows leave the batch. Without
    ``stop_at_answer`` the completions are those of ``model.generate(do_sample=False)``; with it they are
    their prefixes up to the first stated answer, so a completion that states two answers is scored on
    the first (``generate`` would score the last).

    Returns the accuracy in [0, 1] (and the decoded completions, in dataset order, when ``return_completions``).
    """
    if len(dataset) == 0:
        raise ValueError("evaluate_accuracy needs at least one row")
    completion_ids = greedy_completions(
        model,
        tokenizer,
        dataset["prompt"],
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        progress=progress,
        stop=answer_is_complete if stop_at_answer else None,
    )
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    rewards = arithmetic_reward(completions, list(dataset["answer"]))
    accuracy = sum(rewards) / len(rewards)
    return (accuracy, completions) if return_completions else accuracy


def greedy_completions(
    model,
    tokenizer,
    prompts: list,
    batch_size: int = 32,
    max_new_tokens: int = 64,
    progress: bool = True,
    stop=None,
) -> list[list[int]]:
    """The greedy completion (token ids, without the prompt) of each of ``prompts`` (conversations, rendered with the
    chat template, or text, given as it is), in order.

    Greedy with a KV cache, in batches of ``batch_size`` prompts of similar length; a row stops at EOS, after
    ``max_new_tokens``, or as soon as ``stop(decoded completion)`` is true, and finished rows leave the batch. Under
    ZeRO-3 / FSDP every process runs as many forward passes (an empty ``prompts`` too)."""
    import torch
    from tqdm.auto import tqdm

    from .loading import prompt_token_ids

    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size} and {max_new_tokens}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    eos = _eos_ids(model, tokenizer)
    if tokenizer.pad_token_id is None and not eos:
        raise ValueError("greedy evaluation needs a tokenizer with a pad or eos token (to pad batches)")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    prompts = prompt_token_ids(tokenizer, list(prompts))  # text or conversations, tokenized as TRL does
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths: little padding
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    synced = _needs_synced_forward(model)

    def stopped(ids: list[int]) -> bool:
        return stop is not None and stop(tokenizer.decode(ids, skip_special_tokens=True))

    completion_ids: list[list[int]] = [[] for _ in prompts]
    idle_ids = torch.tensor([prompts[0][-1:] if prompts else [pad_id]], device=device)
    num_batches = len(batches)
    if synced:  # every process runs as many batches (empty ones where its shard has fewer)
        count = torch.tensor([num_batches], device=device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        num_batches = int(count.item())
    try:
        with torch.inference_mode():
            for index in tqdm(range(num_batches), desc="evaluate", disable=not progress):
                rows = batches[index] if index < len(batches) else []
                width = max((len(prompts[i]) for i in rows), default=1)
                ids = torch.tensor(
                    [[pad_id] * (width - len(prompts[i])) + prompts[i] for i in rows], dtype=torch.long, device=device
                ).reshape(len(rows), width)
                mask = torch.tensor(
                    [[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in rows],
                    dtype=torch.long,
                    device=device,
                ).reshape(len(rows), width)
                completions = _greedy_batch(model, ids, mask, max_new_tokens, eos, stopped, synced, idle_ids)
                for i, completion in zip(rows, completions):
                    completion_ids[i] = completion
    finally:
        model.train(was_training)
    return completion_ids


def accuracy_by_kind(completions: list, dataset) -> dict[str, float]:
    """Accuracy of ``completions`` (in ``dataset`` order) over all rows (``"all"``) and per ``kind`` column value."""
    if len(completions) != len(dataset):
        raise ValueError(f"accuracy_by_kind got {len(completions)} completions for {len(dataset)} rows")
    rewards = arithmetic_reward(completions, list(dataset["answer"]))
    groups: dict[str, list[float]] = {"all": rewards}
    for kind, reward in zip(dataset["kind"], rewards):
        groups.setdefault(kind, []).append(reward)
    return {kind: sum(values) / len(values) for kind, values in groups.items()}


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
        rejected = (
            row["solution"]
            .replace(f"= {answer}", f"= {wrong}")
            .replace(f"The answer is {answer}.", f"The answer is {wrong}.")
        )
        pairs.append(
            {
                "prompt": row["prompt"],
                "chosen": [{"role": "assistant", "content": row["solution"]}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return Dataset.from_list(pairs)
