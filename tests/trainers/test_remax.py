"""ReMax in TrinityTrainer (issue 13 item 8): the baseline of each prompt is the reward of one greedy completion,
generated through TRL's generation path in the same step (counted and logged, not trained on)."""

from __future__ import annotations

import pytest
import torch
from helpers import completion_text, tiny_conversational_dataset, tiny_grpo_kwargs
from tolerance import approx, assert_close
from transformers import AutoTokenizer

from trinity_trl.algorithms.advantage import scalar_rewards_to_token_level
from trinity_trl.trainers import TrinityConfig, TrinityTrainer

G = 4


def char_reward(completions, **kwargs):
    return [float(len(completion_text(c))) for c in completions]


def test_remax_baseline_is_the_reward_of_a_greedy_completion(tmp_path, tiny_model_dir):
    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=char_reward,
        train_dataset=tiny_conversational_dataset(),
        args=TrinityConfig(
            **tiny_grpo_kwargs(
                output_dir=str(tmp_path),
                algorithm="reinforceplusplus",
                advantage="remax",
                kl_loss="none",
                per_device_train_batch_size=8,
            )
        ),
    )
    trainer.model.train()
    rows = [dict(tiny_conversational_dataset()[i]) for i in (0, 1) for _ in range(G)]
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions(rows)
    # the greedy completion of each prompt, by transformers directly
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    baselines = []
    for i in (0, 1):
        ids = tokenizer.apply_chat_template(
            rows[i * G]["prompt"], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            out = trainer.model.generate(
                **ids,
                do_sample=False,
                max_new_tokens=trainer.max_completion_length,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        baselines += [float(len(text))] * G
    # ReMax: per-token returns of the sampled reward minus the greedy baseline on every trained token
    rewards = torch.tensor(
        [
            float(len(tokenizer.decode(ids[m.bool()], skip_special_tokens=True)))
            for ids, m in zip(batch["completion_ids"], batch["completion_mask"])
        ]
    )
    mask = batch["completion_mask"]
    returns = scalar_rewards_to_token_level(rewards, mask).flip(-1).cumsum(-1).flip(-1)
    expected = returns - torch.tensor(baselines).unsqueeze(1) * mask
    # returns: a reverse cumulative sum over the row's tokens, minus the greedy baseline
    assert_close(batch["advantages"], expected, terms=mask.shape[1], scale=rewards.abs().max())
    assert trainer._metrics["train"]["remax/greedy_completions"][-1] == 2.0  # one per prompt, not trained on
    assert trainer._metrics["train"]["remax/greedy_reward"][-1] == approx(sum(baselines[::G]) / 2, terms=2)
    assert batch["completion_ids"].shape[0] == 2 * G  # the greedy completions are not rows of the batch


def test_remax_needs_whole_groups_per_process(tmp_path):
    """With several processes TRL only needs the *global* generation batch to hold whole groups; ReMax scores
    one greedy completion per group on the process that holds it, so each process must hold whole groups."""
    from types import SimpleNamespace

    from trinity_trl.trainers.components import Components
    from trinity_trl.training.checks import check_components

    config = TrinityConfig(
        **tiny_grpo_kwargs(output_dir=str(tmp_path), algorithm="reinforceplusplus", advantage="remax")
    )
    algorithm = config.resolved_algorithm()
    components = Components.build(algorithm)
    two_processes = SimpleNamespace(**{**vars(config), "per_device_train_batch_size": 2, "steps_per_generation": 1})
    with pytest.raises(ValueError, match="must hold whole groups of num_generations=4"):
        check_components(TrinityTrainer, algorithm, components, two_processes, None)
    check_components(TrinityTrainer, algorithm, components, config, None)  # 4 rows per process: whole groups
