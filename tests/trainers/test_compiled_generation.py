"""Compiled decoding and one prefill per group in a trainer (`trinity_trl.training.decoding`, docs/generation.md):
across training steps, prompts of different lengths and switches to evaluation, with activation checkpointing ON
(TRL toggles it around every generation) and full fine-tuning or LoRA, decoding compiles once per mode and nothing
after, the model keeps its hooks, and what the optimizer changed in place is what the next compiled generation
decodes with. Compiled with torch's ``eager`` backend (about 2 s a graph here); float64 so that tokens compare
exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from helpers import TINY_MODEL_TERMS, completion_text, lora_config, tiny_grpo_kwargs
from tolerance import assert_close, tolerance
from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig
from trl.models.utils import unwrap_model_for_generation

from trinity_trl import TrinityConfig, TrinityTrainer

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

WORDS = "the apples and books of my friends are more than yours".split()


def varied_prompts(n: int) -> Dataset:
    """Conversational prompts from 1 to about 3n words: each batch pads to another width."""
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": " ".join(WORDS * 3)[: 1 + 11 * i]}] for i in range(n)]}
    )


def distinct_characters(completions, **kwargs) -> list[float]:
    """Varies between samples (unlike the completions' lengths, all cut at the limit): the steps train."""
    return [float(len(set(completion_text(c)))) for c in completions]


def train_compiled(tmp_path, model_dir, peft: bool):
    args = TrinityConfig(
        **tiny_grpo_kwargs(
            output_dir=str(tmp_path),
            activation_checkpointing=True,  # the CPU default turns it off, which would hide TRL's toggle
            max_steps=3,
            learning_rate=0.05,  # greedy tokens change after the steps
            compile_generation="on",
            generation_kwargs={"compile_config": CompileConfig(backend="eager", mode="default")},
            eval_strategy="steps",
            eval_steps=2,
            per_device_eval_batch_size=4,
            num_generations_eval=4,
        )
    )
    data = varied_prompts(6)
    trainer = TrinityTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64),  # TRL loads no float64
        processing_class=AutoTokenizer.from_pretrained(model_dir, padding_side="left"),
        reward_funcs=distinct_characters,
        args=args,
        train_dataset=data.select(range(4)),
        eval_dataset=data.select(range(4, 6)),
        peft_config=lora_config() if peft else None,
    )
    calls = []
    generate = trainer._generate_single_turn
    embeddings = trainer.accelerator.unwrap_model(trainer.model).get_input_embeddings()

    def recording(*args, **kwargs):
        out = generate(*args, **kwargs)
        calls.append((trainer.model.training, trainer.decoding.compilations, len(embeddings._forward_hooks)))
        return out

    trainer._generate_single_turn = recording
    trainer.train()
    return trainer, calls


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_decoding_compiles_once_per_mode_and_sees_the_optimizers_updates(tmp_path, tiny_model_dir, peft):
    trainer, calls = train_compiled(tmp_path, tiny_model_dir, peft)
    assert trainer.decoding.choice.compiled and trainer.decoding.choice.grouped
    modes = [training for training, _, _ in calls]
    assert modes.count(True) == 3 and modes[2:4] == [False, False]  # 3 steps, an evaluation of 2 batches after 2
    seen, compiled = set(), 0
    for training, count, _ in calls:  # after each mode's first generation the count stays constant
        assert count == compiled or training not in seen, f"compiled again: {calls}"
        seen.add(training)
        compiled = count
    assert compiled >= 2 and trainer.decoding.recompilations == 0
    assert len({hooks for _, _, hooks in calls}) == 1  # TRL's checkpointing toggles left no hook behind
    # one compile budget per run: every (mode, batch, length) decoded is counted beside compiled layers' graphs
    assert (
        trainer.compile_budget.by_user() == {"generation": len(trainer.decoding._seen)}
        and len(trainer.decoding._seen) >= 2
    )

    # the optimizer changed the weights in place: the next compiled generation decodes with them (float64 logits of
    # every step: those of eager decoding with the trained weights, not those of the weights before the steps)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    policy.train()
    ids = torch.tensor([[0, 0, 7, 8, 9, 10, 11]] * 2 + [[0, 0, 0, 0, 12, 13, 14]] * 2)  # a batch shape decoded before
    mask = (ids != 0).long()
    settings = {"output_logits": True, "return_dict_in_generate": True, "do_sample": False}
    with (
        torch.no_grad(),
        trainer.decoding.around(policy),
        unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator),  # TRL's checkpointing toggle
    ):
        compiled_logits = logits_of(policy, ids, mask, trainer.generation_config, **settings)
    assert trainer.decoding.compilations == compiled
    eager = dict(settings, disable_compile=True, compile_config=None, cache_implementation=None, max_cache_len=None)
    with torch.no_grad():
        trained = logits_of(policy, ids, mask, trainer.generation_config, **eager)
        # the weights the run started from (with LoRA too: its B matrices start at zero); a deepcopy of the model
        # would not do, its TRL-patched forward still runs the original's modules
        initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
        before = logits_of(initial, ids, mask, trainer.generation_config, **eager)
    assert_close(compiled_logits, trained, terms=TINY_MODEL_TERMS)
    assert (before - trained).abs().max() > 1e3 * tolerance(torch.float64, terms=TINY_MODEL_TERMS)["atol"]


def logits_of(model, ids, mask, config, **settings) -> torch.Tensor:
    """``(rows, steps, vocabulary)``: every decoding step's logits of ``model.generate`` with ``config`` (a copy) and
    ``settings``."""
    config = copy.deepcopy(config)
    for name in ("temperature", "top_p", "top_k", "min_p"):
        setattr(config, name, None)
    for name, value in settings.items():
        setattr(config, name, value)
    return torch.stack(model.generate(input_ids=ids, attention_mask=mask, generation_config=config).logits, dim=1)
