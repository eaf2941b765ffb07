"""`trinity_trl/training/token_budget.py`: the micro-batches of an optimizer step in as few packed forwards as a token
budget allows, with the gradient of the unmerged micro-batches, each normalised as alone.

* The plan (`plan_bins`, `micro_batch_tokens`) against its definition and against the packed rows it bounds.
* The scheduling (`TokenBudget.loss`) on plain tensors: which ``training_step`` forwards, what it returns, where the
  fallback runs each member alone under ``no_sync``.
* The trainer: one optimizer step's gradient (every ``loss_agg_mode`` x ``loss_normalization``, KL and entropy terms,
  ``num_iterations=2``, ragged completions) with the budget equals the gradient without it, and the same comparison
  FAILS for deliberately broken bins (a bin normalised as one micro-batch, a member dropped, rows shifted).
* Two processes (DDP, gloo): the same gradients, all-reduced only in the optimizer step's last ``training_step``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from helpers import TINY_MODEL_TERMS, length_reward, tiny_grpo_kwargs
from tolerance import assert_close

from trinity_trl.packing import pack_rows
from trinity_trl.trainers import ChordConfig, ChordTrainer, TrinityConfig, TrinityTrainer
from trinity_trl.training import token_budget
from trinity_trl.training.token_budget import MicroStep, TokenBudget, WindowTokens, plan_bins, resolve_token_budget

AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
DIST_SCRIPT = Path(__file__).resolve().parent / "dist_scripts" / "token_budget_ddp.py"
MEMBER_ROWS, RUN = token_budget.member_rows, TokenBudget._run  # unbroken (the broken variants below replace them)
SYSTEM = "You are a careful assistant. Answer with the number only."


# --------------------------------------------------------------------------------------------------------- the plan
def window(rows, lengths, padded=None) -> WindowTokens:
    """A window whose distinct rows (in lexicographic order) have ``lengths`` and share nothing with each other."""
    return WindowTokens(rows, lengths, [0] * len(lengths), padded or [1000] * len(rows))


def test_packed_tokens_count_each_distinct_prefix_once():
    # distinct rows in lexicographic order: a prompt-only row, two completions of it, another prompt's row
    w = WindowTokens(rows=[[0, 1], [1, 2], [3]], lengths=[10, 17, 13, 8], shared=[0, 10, 12, 0], padded=[100] * 3)
    assert w.packed_tokens([0]) == 10 + 17 - 10
    assert w.packed_tokens([0, 1]) == 10 + 7 + 1  # rows 1 and 2 share 12 tokens
    assert w.packed_tokens([1]) == 17 + 13 - 12
    assert w.packed_tokens([0, 2]) == 17 + 8
    assert w.packed_tokens([2]) == 8
    # rows 0 and 2 alone: their common prefix is the smallest between them (10, through row 1)
    assert WindowTokens([[0], [2]], [10, 17, 13], [0, 10, 12], [100, 100]).packed_tokens([0, 1]) == 10 + 13 - 10


def test_plan_bins_is_greedy_over_consecutive_micro_batches():
    w = window([[i] for i in range(5)], [30] * 5)  # 30 tokens each, nothing shared
    assert plan_bins(w, budget=60) == [2, 2, 1]
    assert plan_bins(w, budget=59) == [1, 1, 1, 1, 1]
    assert plan_bins(w, budget=150) == [5]
    assert plan_bins(w, budget=90) == [3, 2]
    assert plan_bins(w, budget=60, pad=lambda n: -(-n // 16) * 16) == [1, 1, 1, 1, 1]  # the kernel's block: 64
    # a micro-batch over the budget on its own is a bin of its own (never dropped, never split)
    big = window([[0], [1], [2], [3]], [30, 200, 30, 30])
    assert plan_bins(big, budget=60) == [1, 1, 2]
    # packing's own condition: a bin holds at most max_token_ratio of its padded tokens
    dense = window([[i] for i in range(4)], [30] * 4, padded=[40] * 4)
    assert plan_bins(dense, budget=1000, max_token_ratio=0.7) == [1, 1, 1, 1]  # 60 > 0.7 * 80
    assert plan_bins(dense, budget=1000, max_token_ratio=0.75) == [4]
    # a group's rows spread over micro-batches share their prompt in one forward, so more fits
    split = WindowTokens([[0], [1], [2]], [50, 50, 50], [0, 40, 40], [1000] * 3)
    assert plan_bins(split, budget=70) == [3]  # 50 + 10 + 10
    assert plan_bins(window([], []), budget=10) == [] and plan_bins(window([[0]], [30]), budget=1) == [1]


def _micro_batch(rows: list[tuple[list[int], list[int]]], width_p: int, width_c: int) -> dict:
    ids_p = torch.zeros(len(rows), width_p, dtype=torch.long)
    mask_p = torch.zeros_like(ids_p)
    ids_c = torch.zeros(len(rows), width_c, dtype=torch.long)
    mask_c = torch.zeros_like(ids_c)
    for i, (p, c) in enumerate(rows):
        ids_p[i, width_p - len(p) :], mask_p[i, width_p - len(p) :] = torch.tensor(p), 1
        if c:
            ids_c[i, : len(c)], mask_c[i, : len(c)] = torch.tensor(c), 1
    return {"prompt_ids": ids_p, "prompt_mask": mask_p, "completion_ids": ids_c, "completion_mask": mask_c}


def _random_micro_batches(generator: torch.Generator, shared_system: bool) -> list[dict]:
    """Four micro-batches of three rows of one generation batch: three groups of four rows (so groups are split over
    micro-batches), ragged completions (one empty per group), a duplicate row, optionally a system prompt every prompt
    starts with."""

    def rand(n):
        return torch.randint(3, 400, (n,), generator=generator).tolist()

    system = rand(6) if shared_system else []
    prompts = [system + rand(3 + 2 * g) for g in range(3)]
    rows = [(p, rand(n)) for p in prompts for n in (7, 2, 0, 4)]
    rows[5] = rows[4]  # a duplicate row
    return [_micro_batch(rows[i : i + 3], 20, 8) for i in range(0, 12, 3)]


@pytest.mark.parametrize("shared_system", [False, True])
def test_window_tokens_are_the_packed_rows_tokens(shared_system):
    """For every run of consecutive micro-batches, the count is the tokens of the prefix tree packing builds for the
    same rows (groups split over micro-batches, a system prompt shared by every group or not, empty completions, a
    duplicate row)."""
    batches = _random_micro_batches(torch.Generator().manual_seed(0), shared_system)
    w = WindowTokens.of(batches)
    for start in range(len(batches)):
        for end in range(start + 1, len(batches) + 1):
            part = batches[start:end]
            ids = torch.cat([torch.cat([b["prompt_ids"], b["completion_ids"]], 1) for b in part])
            mask = torch.cat([torch.cat([b["prompt_mask"], b["completion_mask"]], 1) for b in part])
            assert w.packed_tokens(range(start, end)) == sum(c.num_tokens for c in pack_rows(ids, mask, 8))
    assert w.padded == [3 * 28] * 4


def test_resolve_token_budget_refuses_where_merged_forwards_are_not_shown_exact(caplog):
    assert resolve_token_budget(None, "TrinityTrainer", "ddp", False, True) is None
    assert resolve_token_budget(4096, "TrinityTrainer", "single", False, True) == 4096
    assert resolve_token_budget(0, "TrinityTrainer", "deepspeed", True, True) == 0
    assert resolve_token_budget(None, "TrinityTrainer", "single", False, False) == 0  # no packing: nothing to merge
    for engine, expert, said in (("deepspeed", False, "DeepSpeed"), ("fsdp", False, "FSDP"), ("ddp", True, "expert")):
        with caplog.at_level(logging.WARNING, logger="trinity_trl"):
            caplog.clear()
            assert resolve_token_budget(None, "ChordTrainer", engine, expert, True) == 0
        assert len(caplog.records) == 1 and said in caplog.text and "off" in caplog.text
        with pytest.raises(ValueError, match=f"prefix_packing_token_budget=512 is not supported here.*{said}"):
            resolve_token_budget(512, "ChordTrainer", engine, expert, True)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4096"])
def test_config_refuses_a_bad_budget(tmp_path, bad):
    with pytest.raises(ValueError, match="prefix_packing_token_budget must be None, 0"):
        TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), prefix_packing_token_budget=bad))


def test_config_refuses_a_budget_without_packing(tmp_path):
    with pytest.raises(ValueError, match="no effect with prefix_packing=False"):
        TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), prefix_packing=False, prefix_packing_token_budget=8))
    args = TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), prefix_packing=False))
    assert args.prefix_packing_token_budget is None  # the default stays valid: nothing is packed, nothing merged
    assert TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), prefix_packing_token_budget=0))


# --------------------------------------------------------------------------------------------- the scheduling
class _Loop:
    """`TokenBudget` on plain tensors: a 'model' with one weight ``w``, log-probs ``w * token id`` (so a member's
    gradient depends on its own rows), each member's loss its own token mean (normalised alone)."""

    def __init__(self, budget, merged_forward_runs=True, calibrate=False):
        self.w = torch.nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
        self.forwards, self.backwards, self.sync_depth, self.no_sync_backwards = [], 0, 0, 0
        self.metrics: list[dict] = []
        kernel = SimpleNamespace(pad_multiple=1, min_tokens=0)
        packing = SimpleNamespace(
            enabled=True,
            max_token_ratio=1.0,
            model_reason=lambda model: None,
            choice=lambda model, device: SimpleNamespace(kernel=kernel, calibrate=calibrate),
        )
        self.merged_forward_runs = merged_forward_runs
        self.budget = TokenBudget(budget, packing, self._forward, self._backward, self._no_sync, self.metrics.append)

    def logps(self, ids, keep):
        return self.w * ids[:, -keep:].to(torch.float64)

    def _forward(self, model, ids, mask, keep, batch_size):
        self.forwards.append((ids.shape[0], batch_size))
        return (self.logps(ids, keep), None, None) if self.merged_forward_runs else None

    def _backward(self, loss):
        self.backwards += 1
        self.no_sync_backwards += self.sync_depth > 0
        loss.backward()

    @contextlib.contextmanager
    def _no_sync(self, model):
        self.sync_depth += 1
        try:
            yield
        finally:
            self.sync_depth -= 1

    def member_loss(self, model, m, forward):
        keep = m["completion_ids"].shape[1]
        if forward is None:
            self.forwards.append((m["prompt_ids"].shape[0], "alone"))
            logps = self.logps(torch.cat([m["prompt_ids"], m["completion_ids"]], 1), keep)
        else:
            logps = forward[0]
        mask = m["completion_mask"].to(torch.float64)
        return (logps * mask).sum() / mask.sum()

    def optimizer_step(self, batches, accumulation, start=0, step=0, spg=None):
        """One optimizer step as transformers runs it: ``accumulation`` calls, the last one synchronising; the
        returned losses (each backpropagated here, as ``training_step`` does) and ``w``'s gradient."""
        self.w.grad = None
        returned = []
        for i in range(accumulation):
            index = (start + i) % (spg or len(batches))
            micro = MicroStep(step, accumulation, i == accumulation - 1, batches, index)
            loss = self.budget.loss(None, batches[index], micro, self.member_loss)
            loss.backward()
            returned.append(float(loss.detach()))
        return returned, self.w.grad.clone()

    def unmerged_gradient(self, batches):
        self.w.grad = None
        for m in batches:
            self.member_loss(None, m, None).backward()
        return self.w.grad.clone()


def _scheduling_batches(count=4, rows=3, seed=0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(count):
        prompt = torch.randint(3, 50, (6,), generator=g).tolist()
        lengths = [(k + r) % 5 + 1 for r in range(rows)]  # ragged: each micro-batch its own token count
        out.append(_micro_batch([(prompt, torch.randint(3, 50, (n,), generator=g).tolist()) for n in lengths], 6, 5))
    return out


def test_bins_run_at_their_last_members_step_and_sum_the_members_losses():
    batches = _scheduling_batches()
    per_member = [6 + int(b["completion_mask"].sum()) for b in batches]  # one prompt per micro-batch
    assert per_member == [12, 15, 18, 16]
    loop = _Loop(budget=27)  # the first two fit together; the third and fourth only alone
    returned, grad = loop.optimizer_step(batches, 4)
    assert loop.forwards == [(6, None), (3, "alone"), (3, "alone")]
    assert returned[0] == 0.0 and all(r != 0.0 for r in returned[1:])  # the first member waits for its bin
    expected_losses = [float(loop.member_loss(None, b, None).detach()) for b in batches]
    assert_close(sum(returned), sum(expected_losses))  # what transformers logs is unchanged
    assert_close(grad, loop.unmerged_gradient(batches))
    assert loop.metrics == [{"packing/forwards_per_step": 3.0}]
    loop = _Loop(budget=34)  # now the last two fit together too
    returned, grad = loop.optimizer_step(batches, 4)
    assert [r == 0.0 for r in returned] == [True, False, True, False]
    assert loop.forwards == [(6, None), (6, None)] and loop.metrics == [{"packing/forwards_per_step": 2.0}]
    assert_close(grad, loop.unmerged_gradient(batches))


def test_a_window_ends_with_the_generation_batch_and_with_the_optimizer_step():
    batches = _scheduling_batches()
    # steps_per_generation 2, accumulation 4: two windows of two (a bin never spans two generation batches)
    loop = _Loop(budget=10_000)
    returned, grad = loop.optimizer_step(batches[:2], 4, spg=2)
    assert [r == 0.0 for r in returned] == [True, False, True, False]
    assert_close(grad, 2 * loop.unmerged_gradient(batches[:2]))
    # steps_per_generation 4, accumulation 2: each optimizer step is a window of two
    loop = _Loop(budget=10_000)
    first, grad_a = loop.optimizer_step(batches, 2, start=0, step=0, spg=4)
    second, grad_b = loop.optimizer_step(batches, 2, start=2, step=1, spg=4)
    assert [r == 0.0 for r in first + second] == [True, False, True, False]
    assert_close(grad_a, loop.unmerged_gradient(batches[:2]))
    assert_close(grad_b, loop.unmerged_gradient(batches[2:]))
    assert [m["packing/forwards_per_step"] for m in loop.metrics] == [1.0, 1.0]


def test_without_a_merged_forward_each_member_runs_alone_and_only_the_last_synchronises():
    batches = _scheduling_batches()
    loop = _Loop(budget=10_000, merged_forward_runs=False)
    returned, grad = loop.optimizer_step(batches, 4)
    assert returned[:3] == [0.0, 0.0, 0.0]
    assert [f for f in loop.forwards if f[1] == "alone"] == [(3, "alone")] * 4
    assert loop.backwards == 3 and loop.no_sync_backwards == 3  # the 4th: transformers' backward, synchronising
    assert_close(sum(returned), sum(float(loop.member_loss(None, b, None).detach()) for b in batches))
    assert_close(grad, loop.unmerged_gradient(batches))
    assert loop.metrics[-1] == {"packing/forwards_per_step": 4.0}


def test_under_autos_measurement_bins_follow_one_micro_batchs_shape(caplog):
    """``auto`` on CUDA: a merged forward is chunked by one micro-batch's rows (packing then applies the verdict
    measured on that shape), and a budget above one padded micro-batch (3 rows x 11) is capped there, with one log
    line."""
    batches = _scheduling_batches()
    loop = _Loop(budget=10_000, calibrate=True)
    with caplog.at_level(logging.WARNING, logger="trinity_trl"):
        returned, grad = loop.optimizer_step(batches, 4)
    assert loop.forwards == [(6, 3), (3, "alone"), (3, "alone")]  # 12 + 15 <= 33 < 12 + 15 + 18; 18 + 16 > 33
    assert "capped at 33 tokens" in caplog.text
    assert_close(grad, loop.unmerged_gradient(batches))


def test_a_micro_batch_the_plan_did_not_expect_runs_what_waits_alone():
    batches = _scheduling_batches()
    loop = _Loop(budget=10_000)
    loop.w.grad = None
    losses = []
    for i, m in enumerate([batches[0], batches[1], {**batches[2]}]):  # the third is a copy: not TRL's buffered one
        micro = MicroStep(0, 4, False, batches, i)
        loss = loop.budget.loss(None, m, micro, loop.member_loss)
        loss.backward()
        losses.append(float(loss.detach()))
    assert losses[:2] == [0.0, 0.0] and losses[2] != 0.0
    assert_close(loop.w.grad, loop.unmerged_gradient(batches[:3]))


def test_outside_trls_loop_each_call_is_its_own_forward():
    batches = _scheduling_batches()
    loop = _Loop(budget=10_000)
    for m in batches:
        assert float(loop.budget.loss(None, m, MicroStep(0, 1, True, None, 0), loop.member_loss).detach()) != 0.0


# ------------------------------------------------------------------------------------------------- the trainer
def conversational_dataset(n: int = 16) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a}+{a + 1}?"}]
                for a in range(n)
            ]
        }
    )


class RaggedTrainer(TrinityTrainer):
    """Completions cut to different lengths (one emptied per generation batch), as EOS leaves them: the random tiny
    model never emits EOS, and micro-batches with equal token counts would hide a wrong normalisation."""

    def _training_batch(self, output, inputs, rewards, mode):
        output = super()._training_batch(output, inputs, rewards, mode)
        mask = output["completion_mask"]
        rows, width = mask.shape
        lengths = torch.tensor([0 if r % 7 == 3 else width - (r * 5) % width for r in range(rows)])
        output["completion_mask"] = mask * (torch.arange(width)[None] < lengths[:, None]).to(mask.dtype)
        self.padded_widths.append(output["prompt_ids"].shape[1] + width)
        return output

    def log(self, logs, start_time=None):
        for key in ("packing/tokens_per_forward", "packing/forwards_per_step"):
            self.packing_metrics.setdefault(key, []).extend(self._metrics["train"].get(key, []))
        super().log(logs, start_time)

    @property
    def padded_widths(self):
        return self.__dict__.setdefault("_padded_widths", [])

    @property
    def packing_metrics(self):
        return self.__dict__.setdefault("_packing_metrics", {})


class DecliningTrainer(RaggedTrainer):
    """Packing declines every forward of more than one micro-batch's rows (as ``auto`` does where it measured padded
    rows faster); records the rows of each training forward that ran."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        run, rows = self.prefix_packing.logps_and_entropies, self.args.per_device_train_batch_size
        self.forward_rows = []

        def declining(model, input_ids, *rest):
            return None if input_ids.shape[0] > rows else run(model, input_ids, *rest)

        self.prefix_packing.logps_and_entropies = declining

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)
        if result is not None and torch.is_grad_enabled():
            self.forward_rows.append(input_ids.shape[0])
        return result


class _Gradients:
    """A callback: every trainable parameter's gradient at each optimizer step (complete, all-reduced), of the policy
    and of any other trained ``modules`` (PPO's critic)."""

    def __init__(self, model, **modules):
        self.modules, self.steps = {"": model, **modules}, []

    def __getattr__(self, name):  # every other callback event: nothing
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.steps.append(
            {
                f"{prefix}{n}": p.grad.detach().clone()
                for prefix, module in self.modules.items()
                for n, p in module.named_parameters()
                if p.grad is not None
            }
        )


def train_gradients(
    model_dir, output_dir, budget, trainer_class=RaggedTrainer, setup=None, config_class=TrinityConfig, **overrides
):
    """``setup(trainer)``, then two optimizer steps of 4 micro-batches of 4 rows (one generation batch, each
    micro-batch used twice: ``num_iterations=2``, so the second step trains off-policy), a float64 model, KL and
    entropy terms. Returns the gradients of each step and the trainer."""
    kwargs = tiny_grpo_kwargs(
        output_dir=str(output_dir),
        gradient_accumulation_steps=4,
        num_iterations=2,
        max_completion_length=8,
        optim="sgd",
        learning_rate=0.5,
        kl_loss={"name": "k2", "kl_coef": 0.3},
        entropy_loss={"entropy_coef": 0.05},
        model_init_kwargs={"dtype": torch.float64},
        prefix_packing_token_budget=budget,
        max_steps=2,
    )
    trainer_kwargs = {"reward_funcs": length_reward, "train_dataset": conversational_dataset()}
    trainer_kwargs.update(overrides.pop("trainer_kwargs", {}))
    kwargs.update(overrides)
    trainer = trainer_class(model=model_dir, args=config_class(**kwargs), **trainer_kwargs)
    critic = getattr(trainer, "critic", None)
    recorder = _Gradients(trainer.model, **({} if critic is None else {"critic.": critic}))
    trainer.add_callback(recorder)
    if setup is not None:
        setup(trainer)
    torch.manual_seed(0)
    trainer.train()
    return recorder.steps, trainer


def assert_same_gradients(merged: list[dict], unmerged: list[dict]) -> None:
    """The model runs in float64, TRL's fused head takes its log-softmax in float32: float32 roundings, on a chain
    of TINY_MODEL_TERMS per log-prob summed over the tokens of an optimizer step (16 rows of at most 60 tokens)."""
    assert len(merged) == len(unmerged) == 2
    for got, want in zip(merged, unmerged, strict=True):
        assert got.keys() == want.keys() and want
        scale = max(float(g.abs().max()) for g in want.values())
        for name in want:
            assert_close(got[name], want[name], terms=TINY_MODEL_TERMS * 16 * 60, scale=scale, dtype=torch.float32)


def merged_forwards(trainer) -> list[float]:
    """``packing/forwards_per_step`` of each optimizer step."""
    return trainer.packing_metrics.get("packing/forwards_per_step", [])


@pytest.mark.parametrize("normalization", ["micro_batch", "global"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_an_optimizer_steps_gradient_equals_the_unmerged_micro_batches(tmp_path, tiny_model_dir, agg, normalization):
    extra = {"loss_agg_mode": agg, "loss_normalization": normalization}
    merged, trainer = train_gradients(tiny_model_dir, tmp_path / "merged", None, **extra)
    unmerged, trainer_off = train_gradients(tiny_model_dir, tmp_path / "unmerged", 0, **extra)
    assert merged_forwards(trainer) and max(merged_forwards(trainer)) < 4.0  # micro-batches really shared forwards
    assert merged_forwards(trainer_off) == []  # off: no budget metric
    assert all(e.get("packing/forwards_per_step", 4.0) < 4.0 for e in trainer.state.log_history if "loss" in e)
    assert_same_gradients(merged, unmerged)
    # every training forward within the default budget: one padded micro-batch (4 rows x the padded width)
    budget = 4 * trainer.padded_widths[0]
    forwarded = trainer.packing_metrics["packing/tokens_per_forward"]
    assert len(forwarded) == sum(merged_forwards(trainer)) and max(forwarded) <= budget
    assert max(forwarded) > max(trainer_off.packing_metrics["packing/tokens_per_forward"])  # merged: fuller forwards


def _normalised_as_one_micro_batch(self, model, members, member_loss):
    """BROKEN: a bin's loss as ONE micro-batch of all its rows (its own token count, times its members to keep the
    scale), instead of each member normalised as alone."""
    if len(members) == 1:
        return member_loss(model, members[0], None)
    merged = {}
    for key, value in members[0].items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            merged[key] = torch.cat([m[key] for m in members])
        else:
            merged[key] = value
    return len(members) * member_loss(model, merged, None)


def _member_dropped(self, model, members, member_loss):
    """BROKEN: the bin's first member is left out of its loss."""
    return RUN(self, model, members[1:] if len(members) > 1 else members, member_loss)


def _rows_shifted(members):
    """BROKEN: each member reads the rows after its own from the merged forward (an off-by-one slice)."""
    total = sum(m["completion_ids"].shape[0] for m in members)
    return [torch.arange(s.start + 1, s.stop + 1) % total for s in MEMBER_ROWS(members)]


@pytest.mark.parametrize(
    "broken, agg, normalization",
    [
        (_normalised_as_one_micro_batch, "token-mean", "micro_batch"),
        (_member_dropped, "token-mean", "micro_batch"),
        (_member_dropped, "seq-mean-token-mean", "global"),
        (_rows_shifted, "seq-mean-token-sum", "micro_batch"),
    ],
)
def test_the_gradient_comparison_fails_for_broken_bins(
    tmp_path, tiny_model_dir, monkeypatch, broken, agg, normalization
):
    """The comparison above can fail: bins that are wrong in each way it must catch give other gradients. (A bin
    normalised as one micro-batch is only wrong where its members' counts differ: token-mean per micro-batch; with
    the same rows per micro-batch the seq-mean modes and the global counts are invariant to it.)"""
    extra = {"loss_agg_mode": agg, "loss_normalization": normalization}
    unmerged, _ = train_gradients(tiny_model_dir, tmp_path / "unmerged", 0, **extra)
    if broken is _rows_shifted:
        monkeypatch.setattr(token_budget, "member_rows", broken)
    else:
        monkeypatch.setattr(token_budget.TokenBudget, "_run", broken)
    merged, trainer = train_gradients(tiny_model_dir, tmp_path / "broken", None, **extra)
    assert max(merged_forwards(trainer)) < 4.0
    with pytest.raises(AssertionError):
        assert_same_gradients(merged, unmerged)


def test_a_budget_of_one_token_merges_nothing_and_a_large_one_merges_the_window(tmp_path, tiny_model_dir):
    _, trainer = train_gradients(tiny_model_dir, tmp_path / "one", 1, max_steps=1)
    assert merged_forwards(trainer) == [4.0]
    merged, trainer = train_gradients(tiny_model_dir, tmp_path / "all", 100_000, max_steps=1)
    assert merged_forwards(trainer) == [1.0]
    unmerged, _ = train_gradients(tiny_model_dir, tmp_path / "off", 0, max_steps=1)
    assert_same_gradients(merged * 2, unmerged * 2)


def test_when_packing_declines_the_merged_forward_each_micro_batch_runs_alone(tmp_path, tiny_model_dir):
    """A merged forward packing declines (here: every forward of more than one micro-batch's rows) runs each member's
    own forward and backward: the same gradients, one forward per micro-batch, never a padded forward of a bin."""

    merged, trainer = train_gradients(tiny_model_dir, tmp_path / "declined", None, trainer_class=DecliningTrainer)
    unmerged, _ = train_gradients(tiny_model_dir, tmp_path / "off", 0)
    assert merged_forwards(trainer) == [4.0, 4.0]
    assert trainer.forward_rows == [4] * 8  # each micro-batch its own forward, none of a whole bin
    assert_same_gradients(merged, unmerged)


def _ppo_and_step_grpo():
    from trinity_trl.rollouts import CalculatorEnv, calculator_dataset
    from trinity_trl.trainers import PPOConfig, PPOTrainer, StepGRPOConfig, StepGRPOTrainer

    return {
        "ppo": {"trainer_class": PPOTrainer, "config_class": PPOConfig},
        "step_grpo": {
            "trainer_class": StepGRPOTrainer,
            "config_class": StepGRPOConfig,
            "max_env_steps": 3,
            "trainer_kwargs": {
                "reward_funcs": None,
                "train_dataset": calculator_dataset(16),
                "environment_factory": CalculatorEnv,
            },
        },
    }


@pytest.mark.parametrize("name", ["ppo", "step_grpo"])
def test_ppo_and_step_grpo_gradients_equal_the_unmerged_micro_batches(tmp_path, tiny_model_dir, name):
    """PPOTrainer (the policy's forwards shared, the critic's value loss per micro-batch: policy and critic gradients)
    and StepGRPOTrainer (rows of several turns, samples per step; the random model's turns share little within a
    micro-batch, so a budget of one micro-batch's padded tokens merges nothing: a larger one)."""
    setup = _ppo_and_step_grpo()[name]
    budget = None if name == "ppo" else 100_000
    merged, trainer = train_gradients(tiny_model_dir, tmp_path / "merged", budget, **dict(setup))
    unmerged, _ = train_gradients(tiny_model_dir, tmp_path / "unmerged", 0, **dict(setup))
    forwards = [e["packing/forwards_per_step"] for e in trainer.state.log_history if "packing/forwards_per_step" in e]
    assert forwards and max(forwards) < 4.0
    if name == "ppo":
        assert any(k.startswith("critic.") for k in merged[0])
    assert_same_gradients(merged, unmerged)


def test_chord_keeps_one_forward_per_micro_batch(tmp_path, tiny_model_dir, caplog):
    expert = Dataset.from_dict(
        {
            "messages": [
                [{"role": "user", "content": f"What is {a}+1?"}, {"role": "assistant", "content": f"It is {a + 1}."}]
                for a in range(8)
            ]
        }
    )

    def chord(budget):
        return ChordTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=conversational_dataset(),
            expert_dataset=expert,
            args=ChordConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), prefix_packing_token_budget=budget)),
        )

    with caplog.at_level(logging.WARNING, logger="trinity_trl"):
        assert not chord(None).token_budget.enabled
    assert "ChordTrainer appends expert rows" in caplog.text
    with pytest.raises(ValueError, match="prefix_packing_token_budget=4096 is not supported here"):
        chord(4096)


# ------------------------------------------------------------------------------------------------ two processes
def test_two_processes_all_reduce_once_per_step_with_the_unmerged_gradients(tmp_path, tiny_model_dir):
    """DDP (2 CPU processes, gloo), 4 micro-batches per optimizer step: with the budget (merged forwards, the ranks
    running different numbers of them; and merged forwards declined so each member runs alone) the all-reduced
    gradients equal those without it, with as many all-reduces, all in the step's last ``training_step``."""
    from launching import run_launch

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    }
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(DIST_SCRIPT)]
    run_launch(
        [*cmd, tiny_model_dir, str(tmp_path)],
        "token budget under DDP",
        timeout_s=300,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    for rank in (0, 1):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        off = results["off"]
        for case in ("merged", "declined"):
            got = results[case]
            # as many bucket all-reduces as without the budget (one backward per step synchronises), all in the last
            assert len(got["all_reduce_steps"]) == len(off["all_reduce_steps"]) > 0, (case, got["all_reduce_steps"])
            assert set(got["all_reduce_steps"]) == set(off["all_reduce_steps"]) == {3}, case
            assert_same_gradients(got["gradients"], off["gradients"])
        assert results["declined"]["forwards"] == [4.0, 4.0]
    # rank 0 (the default budget) forwards each step's 4 micro-batches in fewer forwards, rank 1 (one token) in 4
    forwards = [torch.load(tmp_path / f"rank{r}.pt")["merged"]["forwards"] for r in (0, 1)]
    assert max(forwards[0]) < 4.0 and forwards[1] == [4.0, 4.0], forwards
    a, b = (torch.load(tmp_path / f"rank{r}.pt")["merged"]["gradients"] for r in (0, 1))
    for step_a, step_b in zip(a, b, strict=True):
        for name in step_a:
            assert_close(step_a[name], step_b[name])  # DDP averaged: both ranks hold the same gradients
