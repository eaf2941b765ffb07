"""The mask a policy loss chooses over a whole optimizer step (`trinity_trl.training.step_mask`, M2PO): where a
synchronous trainer can choose it before the step's first backward (else a one-line refusal), which micro-batches make
a step, the mask of several micro-batches (and processes) as one, and TrinityTrainer with gradient accumulation
choosing it over both micro-batches of each step under the current weights."""

from __future__ import annotations

import pytest
import torch
from async_helpers import packed_batch, recomputed_logps, rollout_sample, tiny_async_kwargs
from helpers import TINY_MODEL_TERMS, length_reward, tiny_grpo_kwargs
from tolerance import assert_close

from trinity_trl.algorithms import POLICY_LOSS_FN
from trinity_trl.trainers import AsyncTrinityConfig, AsyncTrinityTrainer, TrinityConfig, TrinityTrainer
from trinity_trl.training.step_mask import StepTokens, process_gather, step_masks, step_members, window_refusal


# ------------------------------------------------------------------------------------------------ the window
@pytest.mark.parametrize(
    "spg, iterations, accumulation, always, refused",
    [
        (4, 1, 4, False, None),  # TRL's defaults: on-policy, every log-ratio 0, nothing to choose
        (8, 1, 4, False, None),  # no behaviour log-probs at all: a step inside half a generation batch
        (2, 2, 2, False, None),  # num_iterations 2: each step inside one generation batch
        (4, 1, 8, False, None),  # on-policy again (a step holds two generation batches of the same weights)
        (4, 1, 8, True, "spans two generation batches"),  # ... unless behaviour log-probs come with vLLM
        (6, 1, 4, False, "spans two generation batches"),
        (2, 3, 4, False, "spans two generation batches"),
        (2, 4, 4, False, "trains some of the steps_per_generation=2 micro-batches twice"),
    ],
)
def test_where_the_pass_can_run(spg, iterations, accumulation, always, refused):
    reason = window_refusal(spg, iterations, accumulation, always)
    assert reason is None if refused is None else refused in reason


def test_a_synchronous_trainer_refuses_it_in_one_line(tmp_path, tiny_model_dir, tiny_dataset):
    args = TrinityConfig(
        **tiny_grpo_kwargs(output_dir=str(tmp_path)),
        algorithm="m2po",
        gradient_accumulation_steps=4,
        steps_per_generation=2,
        num_iterations=3,
    )
    with pytest.raises(ValueError) as info:
        TrinityTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_dataset)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("policy loss 'm2po' chooses its mask over each optimizer step's tokens before")
    assert "make 6 a multiple of 4" in message


def test_the_members_of_a_step():
    buffered = [{"i": i} for i in range(4)]
    assert [m["i"] for m in step_members(buffered, 4, 4, 8, 2, buffered[0])] == [0, 1]  # num_iterations 2
    assert [m["i"] for m in step_members(buffered, 6, 4, 8, 2, buffered[2])] == [2, 3]
    with pytest.raises(RuntimeError, match="not the one TRL's buffer holds"):
        step_members(buffered, 5, 4, 8, 2, buffered[0])
    with pytest.raises(RuntimeError, match="spans two generation batches"):
        step_members(buffered, 3, 4, 4, 2, buffered[3])


# ------------------------------------------------------------------------------------------------ the mask
def _parts(seed: int, rows: int = 3, width: int = 5, scale: float = 0.3) -> StepTokens:
    generator = torch.Generator().manual_seed(seed)
    log_ratio = scale * torch.randn(rows, width, generator=generator, dtype=torch.float64)
    advantages = torch.randn(rows, generator=generator, dtype=torch.float64)
    valid = torch.rand(rows, width, generator=generator) > 0.2
    return StepTokens(log_ratio, advantages.unsqueeze(1).expand(rows, width), valid)


def test_the_mask_of_several_micro_batches_is_chosen_as_one():
    """Each micro-batch's mask is its part of the mask of all their trained tokens in order, not its own mask."""
    loss = POLICY_LOSS_FN.get("m2po")(m2_threshold=0.04)
    parts = [_parts(0, scale=0.05), _parts(1, scale=0.5)]  # small log-ratios, then large ones
    masks = step_masks(loss, parts)
    tokens = torch.cat([p.log_ratio[p.valid] for p in parts])
    advantages = torch.cat([p.advantages[p.valid] for p in parts])
    expected = loss.step_mask(tokens, advantages)
    assert torch.equal(torch.cat([m[p.valid] for m, p in zip(masks, parts)]).bool(), expected)
    assert all(bool((m[~p.valid] == 1).all()) for m, p in zip(masks, parts))
    own = loss.step_mask(parts[1].log_ratio[parts[1].valid], parts[1].advantages[parts[1].valid])
    assert not torch.equal(masks[1][parts[1].valid].bool(), own)  # the mask of one micro-batch alone differs


def test_the_mask_over_processes_is_each_process_part_of_one_mask():
    """Two processes simulated: each gets its own tokens' part of the mask of both processes' tokens (process 0's
    first), through `process_gather` with accelerate's gather and padding semantics."""
    loss = POLICY_LOSS_FN.get("m2po")(m2_threshold=0.04)
    ranks = [[_parts(0, rows=2, scale=0.05)], [_parts(1, rows=4, scale=0.5), _parts(2, rows=1, scale=0.5)]]
    rows = []
    for parts in ranks:
        rows.append(torch.cat([torch.stack([p.log_ratio[p.valid], p.advantages[p.valid]], 1) for p in parts]))
    width = max(r.shape[0] for r in rows)

    def gather(tensor):  # accelerate's: every process's tensor, concatenated on dimension 0
        if tensor.dim() == 1:
            return torch.tensor([r.shape[0] for r in rows])
        return torch.cat([torch.nn.functional.pad(r, (0, 0, 0, width - r.shape[0])) for r in rows])

    def pad_across_processes(tensor, dim=0):
        return torch.nn.functional.pad(tensor, (0, 0, 0, width - tensor.shape[0]))

    every = loss.step_mask(torch.cat(rows)[:, 0], torch.cat(rows)[:, 1])
    for rank, parts in enumerate(ranks):
        masks = step_masks(loss, parts, process_gather(gather, pad_across_processes, rank, 2))
        start = sum(r.shape[0] for r in rows[:rank])
        got = torch.cat([m[p.valid] for m, p in zip(masks, parts)]).bool()
        assert torch.equal(got, every[start : start + rows[rank].shape[0]])
    alone = loss.step_mask(rows[1][:, 0], rows[1][:, 1])
    assert not torch.equal(alone, every[rows[0].shape[0] :])  # process 1's own mask would be another


# ------------------------------------------------------------------------------------------------ in a trainer
class _Recording(TrinityTrainer):
    """Records the policy-loss inputs of the step-mask pass (no gradient) and of the loss (with gradient)."""

    def _loss_inputs(self, batch, logps, mask):
        inputs = super()._loss_inputs(batch, logps, mask)
        kind = "loss" if logps.requires_grad else "pass"
        self.seen.append(
            (
                kind,
                self.state.global_step,
                {k: v.detach().clone() for k, v in inputs.items() if v is not None},
                mask.clone(),
            )
        )
        return inputs


def test_trinity_trainer_chooses_the_mask_over_both_micro_batches_of_each_step(tmp_path, tiny_model_dir, tiny_dataset):
    """Gradient accumulation 2, num_iterations 2: TRL computes behaviour log-probs, the first step trains the batch on
    the weights that generated it, the second trains it again after one update. Before the second step's first
    backward one pass without gradient over its two micro-batches gives the mask both losses receive: M2PO's mask of
    the two micro-batches' tokens together, from log-ratios under the weights the losses train (the losses' own),
    which is not the mask each micro-batch would choose alone."""
    args = TrinityConfig(
        **tiny_grpo_kwargs(output_dir=str(tmp_path), learning_rate=3e-2),
        algorithm="m2po",
        policy_loss={"m2_threshold": 0.3},  # where the step's two micro-batches' masks differ from each one's own
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        num_iterations=2,
    )
    trainer = _Recording(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_dataset)
    trainer.seen = []
    trainer.train()
    assert trainer.state.global_step == 2
    loss_fn = trainer.components.policy_loss
    for step in (0, 1):
        order = [(i, s) for i, s in enumerate(trainer.seen) if s[1] == step]
        passes = [s for _, s in order if s[0] == "pass"]
        losses = [s for _, s in order if s[0] == "loss"]
        assert [s[0] for _, s in order] == ["pass", "pass", "loss", "loss"]  # both before the step's first backward
        parts = [StepTokens.of(inputs, mask) for _, _, inputs, mask in passes]
        tokens = torch.cat([p.log_ratio[p.valid] for p in parts])
        advantages = torch.cat([p.advantages[p.valid] for p in parts])
        expected = loss_fn.step_mask(tokens, advantages)
        given = torch.cat([inputs["step_mask"][p.valid] for (_, _, inputs, _), p in zip(losses, parts)]).bool()
        assert torch.equal(given, expected)
        for (_, _, seen, _), part in zip(losses, parts):  # the pass ran under the weights the loss trains
            delta = (seen["logprob"] - seen["old_logprob"])[part.valid]
            assert_close(delta, part.log_ratio[part.valid], terms=TINY_MODEL_TERMS, scale=1.0)
        if step == 0:
            assert tokens.abs().max() < 1e-4 and bool(expected.all())  # generated by these weights: nothing masked
        else:
            assert not expected.all() and expected.any()
            alone = torch.cat([loss_fn.step_mask(p.log_ratio[p.valid], p.advantages[p.valid]) for p in parts])
            assert not torch.equal(alone, expected)
    logged = [e for e in trainer.state.log_history if "actor/m2po/masked_fraction" in e]
    assert logged[0]["actor/m2po/masked_fraction"] == 0.0 and logged[1]["actor/m2po/masked_fraction"] > 0.0


class _RecordingAsync(AsyncTrinityTrainer):
    """Records the policy-loss inputs of the step-mask pass (no gradient) and of the loss (with gradient)."""

    def _loss_inputs(self, batch, logps, mask):
        inputs = super()._loss_inputs(batch, logps, mask)
        kind = "loss" if logps.requires_grad else "pass"
        self.seen.append((kind, {k: v.detach().clone() for k, v in inputs.items() if v is not None}, mask.clone()))
        return inputs


def _stale_micro_batch(trainer, first: int, noise: float, seed: int) -> dict:
    """Four samples of two prompts generated by other weights: their behaviour log-probs are the trainer's log-probs
    plus ``noise`` times standard normal noise."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(4):
        completion = [first + 3 * i + j for j in range(3 + i % 2)]
        sample = rollout_sample([5, 6, 7 + i // 2], completion, [0.0] * len(completion), 1.0 - 2 * (i % 2), i // 2)
        current = recomputed_logps(trainer.model, sample, temperature=trainer.args.temperature)
        logps = (current + noise * torch.randn(len(completion), generator=generator)).tolist()
        samples.append(rollout_sample([5, 6, 7 + i // 2], completion, logps, 1.0 - 2 * (i % 2), i // 2))
    return packed_batch(samples, trainer.processing_class.pad_token_id, step_totals=False)


def test_async_trainer_chooses_the_mask_over_both_micro_batches_of_each_step(tmp_path, tiny_model_dir, tiny_dataset):
    """AsyncTrinityTrainer with gradient accumulation 2: transformers hands ``get_batch_samples`` the step's two
    micro-batches before the first forward; one pass without gradient over both gives the mask each loss receives,
    M2PO's mask of their tokens together (not each micro-batch's own), under the weights the losses train."""
    args = AsyncTrinityConfig(
        **tiny_async_kwargs(output_dir=str(tmp_path)), algorithm="m2po", gradient_accumulation_steps=2
    )
    trainer = _RecordingAsync(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_dataset)
    trainer.seen = []
    step = [_stale_micro_batch(trainer, 20, 0.05, 0), _stale_micro_batch(trainer, 40, 0.5, 1)]
    batches, _ = trainer.get_batch_samples(iter(step), 2, trainer.args.device)
    assert [kind for kind, _, _ in trainer.seen] == ["pass", "pass"]
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    for batch in batches:
        trainer.compute_loss(trainer.model, batch).backward()
    assert [kind for kind, _, _ in trainer.seen] == ["pass", "pass", "loss", "loss"]
    loss_fn = trainer.components.policy_loss
    parts = [StepTokens.of(inputs, mask) for _, inputs, mask in trainer.seen[:2]]
    expected = loss_fn.step_mask(
        torch.cat([p.log_ratio[p.valid] for p in parts]), torch.cat([p.advantages[p.valid] for p in parts])
    )
    given = torch.cat([inputs["step_mask"][p.valid] for (_, inputs, _), p in zip(trainer.seen[2:], parts)]).bool()
    assert torch.equal(given, expected) and expected.any() and not expected.all()
    alone = torch.cat([loss_fn.step_mask(p.log_ratio[p.valid], p.advantages[p.valid]) for p in parts])
    assert not torch.equal(alone, expected)
    for (_, seen, _), part in zip(trainer.seen[2:], parts):  # the pass ran under the weights the loss trains
        delta = (seen["logprob"] - seen["old_logprob"])[part.valid]
        assert_close(delta, part.log_ratio[part.valid], terms=TINY_MODEL_TERMS, scale=1.0)
