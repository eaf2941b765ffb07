"""Whole groups per micro-batch (`trinity_trl/packing/groups.py`, `prefix_packing_whole_groups`)."""

from __future__ import annotations

import logging

import torch
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs
from packing_helpers import GRAD_TERMS
from tolerance import assert_close

from trinity_trl.packing.groups import group_blocks_reason, resolve_whole_groups, shuffle_groups


def test_groups_move_as_blocks():
    prompts = torch.arange(6).repeat_interleave(3)[:, None].repeat(1, 4)  # 6 groups of 3 rows
    batch = {"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts), "names": list(range(18)), "x": None}
    assert group_blocks_reason(batch, 3) is None
    shuffled = shuffle_groups(batch, 3, torch.Generator().manual_seed(0))
    order = shuffled["names"]
    assert sorted(order) == list(range(18)) and order != list(range(18))
    for block in range(6):
        rows = order[3 * block : 3 * block + 3]
        assert rows == list(range(rows[0], rows[0] + 3)) and rows[0] % 3 == 0  # a whole group, in order
        assert (shuffled["prompt_ids"][3 * block : 3 * block + 3] == rows[0] // 3).all()
    assert shuffled["x"] is None
    assert "not whole groups" in group_blocks_reason(batch, 4)
    mixed = dict(batch, prompt_ids=prompts.roll(1, 0))
    assert "not consecutive groups" in group_blocks_reason(mixed, 3)


def test_the_default_is_on_exactly_where_the_gradient_is_unchanged():
    """``None`` resolves to whole groups only with global normalisation, an aggregation normalised over the step,
    whole generation batches per optimizer step and more than one micro-batch per generation batch; a set value
    wins."""
    base = dict(
        loss_normalization="global",
        loss_agg_mode="token-mean",
        steps_per_generation=4,
        gradient_accumulation_steps=4,
        per_device_train_batch_size=8,
        num_generations=8,
    )
    assert resolve_whole_groups(None, **base)[0]
    assert resolve_whole_groups(None, **dict(base, gradient_accumulation_steps=8))[0]  # 2 generation batches a step
    for change in (
        {"loss_normalization": "micro_batch"},  # TRL's row shuffle kept: each micro-batch's mean weighs its rows
        {"loss_agg_mode": "seq-mean-token-sum-norm"},
        {"gradient_accumulation_steps": 6},  # a step ends inside a generation batch
        {"steps_per_generation": 1, "gradient_accumulation_steps": 1},  # one micro-batch: whole groups already
        {"per_device_train_batch_size": 12},
    ):
        on, why = resolve_whole_groups(None, **dict(base, **change))
        assert not on and why, change
    assert resolve_whole_groups(True, **dict(base, loss_normalization="micro_batch")) == (True, "set")
    assert resolve_whole_groups(False, **base) == (False, "set")


def test_micro_batches_hold_whole_groups_and_others_keep_trl_shuffle(tmp_path, tiny_model_dir, caplog):
    """4 prompts x 2 completions per generation batch, split into 2 micro-batches of 4 rows: each micro-batch holds
    2 whole groups, and (global normalisation, one generation batch per optimizer step) the step's gradient norm and
    trained weights equal those of TRL's row shuffle on the same generated batch; the default (``None``) does the
    same there, and keeps TRL's row shuffle under ``"micro_batch"`` normalisation. With the option off TRL's row
    shuffle runs (checked: some micro-batch splits a group)."""
    from trinity_trl.trainers import TrinityConfig, TrinityTrainer

    def micro_batches(whole: bool | None, seed: int, normalization: str = "global"):
        args = TrinityConfig(
            **tiny_grpo_kwargs(
                output_dir=str(tmp_path / f"{whole}{normalization}"),
                per_device_train_batch_size=4,
                num_generations=2,
                gradient_accumulation_steps=2,
                loss_normalization=normalization,
                prefix_packing_whole_groups=whole,
                max_steps=1,
                seed=seed,
                optim="sgd",
                learning_rate=0.1,
            )
        )
        trainer = TrinityTrainer(
            model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_conversational_dataset(8)
        )
        seen = []
        compute_loss = trainer._compute_loss

        def recording(model, inputs):
            seen.append([tuple(r.tolist()) for r in inputs["prompt_ids"]])
            return compute_loss(model, inputs)

        trainer._compute_loss = recording
        trainer.train()
        norm = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
        return seen, norm, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    def whole(batches):
        return all(all(mb.count(p) == 2 for p in mb) for mb in batches)

    grouped, grouped_norm, grouped_weights = micro_batches(True, 0)
    rows, rows_norm, rows_weights = micro_batches(False, 0)
    assert whole(grouped) and not whole(rows)  # TRL's row shuffle splits a group here
    assert micro_batches(None, 0)[0] == grouped  # the default, under global normalisation
    assert micro_batches(None, 0, "micro_batch")[0] == rows  # the default keeps TRL's shuffle there
    # the same rows in another split: sums of the same per-token terms in another order (tolerance of
    # packing_helpers.GRAD_TERMS: a gradient sums at most 16 x 128 tokens' chains of the tiny model)
    assert_close(torch.tensor(grouped_norm), torch.tensor(rows_norm), terms=GRAD_TERMS)
    for name, weight in rows_weights.items():
        assert_close(grouped_weights[name], weight, terms=GRAD_TERMS, msg=name)
    # a batch that is not whole groups: TRL's shuffle, one log line
    from trinity_trl.packing.groups import whole_groups

    class Stub:
        args = type("A", (), {"prefix_packing_whole_groups": True, "steps_per_generation": 2})()
        algorithm = type("Algorithm", (), {"loss_agg_mode": "token-mean"})()
        args.gradient_accumulation_steps, args.per_device_train_batch_size = 2, 3
        num_generations = 3

    import trl.trainer.grpo_trainer as grpo

    batch = {"prompt_ids": torch.zeros(4, 2, dtype=torch.long), "prompt_mask": torch.ones(4, 2), "i": [0, 1, 2, 3]}
    with caplog.at_level(logging.WARNING, logger="trinity_trl"), whole_groups(Stub()):
        assert sorted(grpo.shuffle_sequence_dict(batch)["i"]) == [0, 1, 2, 3]
        grpo.shuffle_sequence_dict(batch)
    assert len([r for r in caplog.records if "row shuffle" in r.getMessage()]) == 1
    assert grpo.shuffle_sequence_dict.__module__ == "trl.trainer.utils"  # restored
