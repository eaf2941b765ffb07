"""`trinity_trl/data/arithmetic.py`: the bundled arithmetic task: verified answers, disjoint splits, demonstrations,
preference pairs and the reward."""

from __future__ import annotations

import re

import pytest

from trinity_trl.data.arithmetic import (
    INSTRUCTION,
    TEMPLATES,
    accuracy_by_kind,
    answer_is_complete,
    arithmetic_dataset,
    arithmetic_expert_dataset,
    arithmetic_preference_dataset,
    arithmetic_reward,
    evaluate_accuracy,
    extract_answer,
    make_problems,
    prompt_messages,
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


@pytest.mark.parametrize(
    "text, answer",
    [
        ("3 + 4 = 7. The answer is 7.", "7"),
        ("The answer is 12. Wait, 3 more: 15", "12"),  # the stated answer wins over later numbers
        ("so it is 1,234 in total", "1234"),
        ("The answer is: $\\boxed{42}$", "42"),
        ("The answer is -3.", "-3"),
        ("The answer is 6.50", "6.5"),
        ("no number here", None),
        ("first 3 then 9", "9"),  # no 'answer is': the last number
    ],
)
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
    accuracy, completions = evaluate_accuracy(
        model, tokenizer, data, batch_size=4, max_new_tokens=6, progress=False, return_completions=True
    )
    assert len(completions) == 6
    assert accuracy == sum(arithmetic_reward(completions, list(data["answer"]))) / 6
    model.train()  # evaluation switches to eval mode and back
    evaluate_accuracy(model, tokenizer, data.select(range(2)), max_new_tokens=2, progress=False)
    assert model.training and tokenizer.padding_side == AutoTokenizer.from_pretrained(tiny_model_dir).padding_side
    with pytest.raises(ValueError, match="at least one row"):
        evaluate_accuracy(model, tokenizer, data.select([]), progress=False)


@pytest.mark.parametrize(
    "text, complete",
    [
        ("so 3 + 4 = 7. The answer is 7.\n", True),
        ("The answer is 7 apples", True),
        ("The answer is: $\\boxed{42}$", True),
        ("The answer is 12.", False),  # the next token could still be a digit of 12.5
        ("The answer is 1", False),  # ... or of 14
        ("The answer is 1,2", False),
        ("so 3 + 4 = 7.", False),
    ],
)
def test_answer_is_complete(text, complete):
    assert answer_is_complete(text) is complete


def _generate_completions(model, tokenizer, data, batch_size, max_new_tokens):
    """The previous evaluation path: ``model.generate`` greedy on left-padded batches in dataset order."""
    import torch

    tokenizer.padding_side = "left"
    completions = []
    for start in range(0, len(data), batch_size):
        rows = data[start : start + batch_size]
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in rows["prompt"]]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        completions += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return completions


def _scaled_tiny_model(model_dir: str):
    """The tiny random model with 10x weights: greedy completions that depend on the prompt (not one repeated
    token)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.mul_(10.0)
    return model


def _second_eos(model, tokenizer, data) -> int:
    """A token the random model says in some completions (not all): made a second EOS, rows finish at different
    steps (the model itself never says EOS)."""
    from collections import Counter

    free = [
        tokenizer(c, add_special_tokens=False)["input_ids"]
        for c in _generate_completions(model, tokenizer, data, batch_size=len(data), max_new_tokens=24)
    ]
    counts = Counter(t for ids in free for t in set(ids[1:]))
    return next(t for t, n in counts.most_common() if n < len(free))


def test_evaluate_accuracy_gives_the_completions_of_greedy_generate(tiny_model_dir):
    from transformers import AutoTokenizer

    model = _scaled_tiny_model(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = arithmetic_dataset("test", 10, seed=4)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, _second_eos(model, tokenizer, data)]
    expected = _generate_completions(model, tokenizer, data, batch_size=4, max_new_tokens=24)
    assert len({len(c) for c in expected}) > 2
    for batch_size in (3, 10):  # other batches and orders (sorted by prompt length) give the same completions
        _, completions = evaluate_accuracy(
            model,
            tokenizer,
            data,
            batch_size=batch_size,
            max_new_tokens=24,
            progress=False,
            return_completions=True,
            stop_at_answer=False,
        )
        assert completions == expected


class _ScriptedModel:
    """A stand-in causal LM that greedily 'generates' a fixed token script per row.

    Which rows are still in the batch is read back from the KV cache (the evaluation drops finished rows from
    it), and the step from the cache length; each call returns logits whose argmax is the row's next token.
    """

    def __init__(self, scripts: list[list[int]], vocab_size: int, eos: int):
        from transformers import GenerationConfig, Qwen2Config

        self.scripts, self.vocab_size = scripts, vocab_size
        self.config = Qwen2Config(
            num_hidden_layers=1, hidden_size=8, num_attention_heads=1, num_key_value_heads=1, vocab_size=vocab_size
        )
        self.generation_config = GenerationConfig(eos_token_id=eos)
        self.training, self.rows_per_call = False, []

    def parameters(self):
        import torch

        yield torch.zeros(1)

    def eval(self):
        self.training = False

    def train(self, mode=True):
        self.training = mode

    def __call__(self, input_ids, past_key_values=None, **kwargs):
        from types import SimpleNamespace

        import torch

        if past_key_values.get_seq_length() == 0:  # prefill: remember each row's index in the cache
            rows = torch.arange(input_ids.shape[0], dtype=torch.float).view(-1, 1, 1, 1)
        else:
            rows = past_key_values.layers[0].keys[:, :, -1:, :]
        step = past_key_values.get_seq_length()
        past_key_values.update(rows, rows, 0)
        self.rows_per_call.append(rows.shape[0])
        tokens = [self.scripts[int(r)][step] for r in rows.flatten().tolist()]
        logits = torch.zeros(len(tokens), 1, self.vocab_size)
        logits[torch.arange(len(tokens)), 0, torch.tensor(tokens)] = 1.0
        return SimpleNamespace(logits=logits)


def test_evaluate_accuracy_stops_a_row_at_its_stated_answer(tiny_tokenizer):
    from datasets import Dataset

    eos = tiny_tokenizer.eos_token_id
    texts = ["The answer is 7. The answer is 9.", "3 + 4 = 7, then 9", "The answer is 7."]
    scripts = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    scripts[2] = scripts[2] + [eos]
    width = max(len(s) for s in scripts) + 8
    scripts = [s + [tiny_tokenizer.convert_tokens_to_ids("x")] * (width - len(s)) for s in scripts]
    # one prompt per row, all of the same length (so the sort keeps the dataset order)
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"problem {i}"}], "answer": "7"} for i in range(3)]
    )
    model = _ScriptedModel(scripts, len(tiny_tokenizer), eos)
    accuracy, completions = evaluate_accuracy(
        model, tiny_tokenizer, data, max_new_tokens=width - 2, progress=False, return_completions=True
    )
    assert completions[0].startswith("The answer is 7.") and "9" not in completions[0]  # stopped at the first answer
    assert completions[1].startswith(texts[1]) and len(completions[1]) > len(texts[1])  # no answer: ran on
    assert completions[2] == "The answer is 7."  # stopped at EOS
    assert accuracy == 2 / 3
    assert model.rows_per_call[0] == 3 and model.rows_per_call[-1] == 1  # finished rows left the batch
    model.rows_per_call.clear()
    _, completions = evaluate_accuracy(
        model,
        tiny_tokenizer,
        data,
        max_new_tokens=width - 2,
        progress=False,
        return_completions=True,
        stop_at_answer=False,
    )
    assert completions[0].startswith(texts[0])  # without the stop, generate's completion (scored on the last answer)
    assert arithmetic_reward(completions, ["7"] * 3) == [0.0, 0.0, 1.0]


def test_prompt_styles():
    assert prompt_messages("P") == [{"role": "user", "content": f"P\n{INSTRUCTION}"}]
    assert prompt_messages("P", "system") == [
        {"role": "system", "content": INSTRUCTION},
        {"role": "user", "content": "P"},
    ]
    rows = make_problems("test", 4, prompt_style="system")
    assert [r["prompt"] for r in rows] == [prompt_messages(r["problem"], "system") for r in rows]
    assert [r["problem"] for r in rows] == [r["problem"] for r in make_problems("test", 4)]  # same problems
    expert = arithmetic_expert_dataset(2, prompt_style="system")
    assert expert[0]["prompt"][0]["role"] == "system"
    with pytest.raises(ValueError, match="prompt style must be one of"):
        prompt_messages("P", "assistant")
    with pytest.raises(ValueError, match="prompt_style must be one of"):
        make_problems("test", 1, prompt_style="none")


def test_template_coverage_split():
    """Demonstrations of some templates only (the others left to RL), prompts and held-out rows of all."""
    covered = ("add", "sub", "mul")
    expert = make_problems("train", 60, seed=1, kinds=covered)
    assert {r["kind"] for r in expert} == set(covered)
    assert [r["solution"] for r in expert] == [
        c[0]["content"] for c in arithmetic_expert_dataset(60, seed=1, kinds=covered)["completion"]
    ]
    test = arithmetic_dataset("test", 50, seed=0)
    kinds = test["kind"]
    assert {k: kinds.count(k) for k in TEMPLATES} == dict.fromkeys(TEMPLATES, 10)  # templates take turns
    # a held-out problem is never a demonstration, whatever the templates
    assert not {r["problem"] for r in expert} & set(test["problem"])


def test_accuracy_by_kind():
    data = arithmetic_dataset("test", 10, seed=0)
    completions = [
        f"The answer is {a}." if k in ("add", "div") or i == 2 else "no idea"
        for i, (a, k) in enumerate(zip(data["answer"], data["kind"]))
    ]
    result = accuracy_by_kind(completions, data)
    assert result["all"] == pytest.approx(5 / 10)
    assert result["add"] == result["div"] == 1.0
    assert result[data["kind"][2]] == 0.5 and set(result) == {"all", *TEMPLATES}
    with pytest.raises(ValueError, match="2 completions for 10 rows"):
        accuracy_by_kind(["a", "b"], data)


def _synced_worker(rank: int, model_dir: str, store: str, eos: list[int], out: str) -> None:
    """One of two gloo processes: evaluates its shard with synced forward passes (as under ZeRO-3 / FSDP)."""
    import json

    import torch.distributed as dist
    from transformers import AutoTokenizer

    from trinity_trl.data import arithmetic as module

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        module._needs_synced_forward = lambda model: True  # what ZeRO-3 or FSDP would decide
        model = _scaled_tiny_model(model_dir)
        model.generation_config.eos_token_id = eos
        calls = [0]
        model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        shard = arithmetic_dataset("test", 10, seed=4).select(range(7) if rank == 0 else range(7, 10))
        _, completions = module.evaluate_accuracy(
            model,
            tokenizer,
            shard,
            batch_size=2,
            max_new_tokens=24,
            progress=False,
            return_completions=True,
            stop_at_answer=False,
        )
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"completions": completions, "forward_calls": calls[0]}, f)
        # without the barrier a process can abort in gloo's teardown with SIGABRT (notes/TRL_1_16.md §7; seen once
        # here: "terminate called without an active exception"), as in tests/trainers/dist_scripts/
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_evaluate_accuracy_synced_processes_run_the_same_forward_passes(tiny_model_dir, tmp_path):
    """Under ZeRO-3 / FSDP every process must run as many forward passes as the others (parameters are gathered
    inside forward): shards with more batches or longer completions than the other's must not hang it."""
    import json

    import torch.multiprocessing as mp
    from transformers import AutoTokenizer

    model = _scaled_tiny_model(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = arithmetic_dataset("test", 10, seed=4)
    eos = [tokenizer.eos_token_id, _second_eos(model, tokenizer, data)]
    model.generation_config.eos_token_id = eos
    expected = _generate_completions(model, tokenizer, data, batch_size=10, max_new_tokens=24)
    mp.spawn(
        _synced_worker, args=(tiny_model_dir, str(tmp_path / "store"), eos, str(tmp_path / "out")), nprocs=2, join=True
    )
    results = [json.loads((tmp_path / f"out.{rank}").read_text()) for rank in range(2)]
    assert results[0]["completions"] + results[1]["completions"] == expected
    calls = [result["forward_calls"] for result in results]
    assert calls[0] == calls[1] and calls[0] > 4 * 2  # 4 batches (rank 1's last two empty), >= 2 passes each


def test_the_task_dataset_names_itself_for_model_cards():
    from trinity_trl.data import arithmetic_dataset

    assert arithmetic_dataset("train", num_rows=2).info.dataset_name == "trinity_trl arithmetic (train)"
    assert arithmetic_dataset("test", num_rows=2).info.dataset_name == "trinity_trl arithmetic (test)"
