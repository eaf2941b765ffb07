"""`trinity_trl/training/trl_generation.py`: `TRLGeneration`, the rollouts' `Generator` over a TRL trainer, agrees with
the tokenizer's chat template and with transformers' own `generate` on the tiny model (greedy decoding, so the
comparison is exact). Multi-step rollouts through it: tests/trainers/test_step_grpo.py."""

from __future__ import annotations

import pytest
import torch
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs

from trinity_trl.rollouts import Generator
from trinity_trl.trainers import TrinityConfig, TrinityTrainer
from trinity_trl.training.trl_generation import TRLGeneration

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, tiny_model_dir):
    args = TrinityConfig(
        **tiny_grpo_kwargs(
            output_dir=str(tmp_path_factory.mktemp("generation")),
            max_completion_length=MAX_NEW_TOKENS,
            generation_kwargs={"do_sample": False},
        )
    )  # greedy: exact comparisons
    return TrinityTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_conversational_dataset()
    )


def chatml(messages, add_generation_prompt):
    """The tiny tokenizer's ChatML, written out."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def test_the_trainer_offers_a_generator(trainer):
    generation = trainer.generation
    assert isinstance(generation, TRLGeneration)
    for name in ("tokenize_conversations", "render", "generate", "decode"):
        assert callable(getattr(generation, name)) and hasattr(Generator, name)
    tokenizer = trainer.processing_class
    assert generation.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generation.eos_token_ids == set(trainer.eos_token_ids) and tokenizer.eos_token_id in generation.eos_token_ids


def test_tokenize_conversations_is_the_chat_template_with_the_generation_prompt(trainer):
    tokenizer = trainer.processing_class
    conversations = [
        [{"role": "user", "content": "What is 3+4?"}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "What is 12*7?"},
        ],
    ]
    ids = trainer.generation.tokenize_conversations(conversations)
    assert all(type(row) is list and all(type(t) is int for t in row) for row in ids)
    for row, conversation in zip(ids, conversations, strict=True):
        assert row == tokenizer(chatml(conversation, True), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_render_is_the_chat_template(trainer, add_generation_prompt):
    tokenizer = trainer.processing_class
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y"},
        {"role": "user", "content": "The number is higher."},
    ]
    ids = trainer.generation.render(messages, add_generation_prompt)
    assert ids == tokenizer(chatml(messages, add_generation_prompt), add_special_tokens=False)["input_ids"]


def test_generate_is_transformers_greedy_generation_cut_after_eos(trainer):
    tokenizer = trainer.processing_class
    prompts = trainer.generation.tokenize_conversations(
        [[{"role": "user", "content": "What is 1+2?"}], [{"role": "user", "content": "What is 3+4?"}]]
    )
    assert len(prompts[0]) == len(prompts[1])  # no padding: the batch and one-by-one generation see the same input
    completions, logprobs = trainer.generation.generate(prompts)
    assert logprobs is None  # transformers generation reports no sampling log-probs
    model = trainer.accelerator.unwrap_model(trainer.model)
    for prompt, completion in zip(prompts, completions, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        expected = out[0, len(prompt) :].tolist()
        if tokenizer.eos_token_id in expected:
            expected = expected[: expected.index(tokenizer.eos_token_id) + 1]
        assert completion == expected
        assert 1 <= len(completion) <= MAX_NEW_TOKENS


def test_decode_drops_special_tokens(trainer):
    tokenizer = trainer.processing_class
    ids = tokenizer("The answer is 7.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert trainer.generation.decode(ids) == "The answer is 7."
