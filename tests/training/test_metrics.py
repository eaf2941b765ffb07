"""`trinity_trl/training/metrics.py`: appending metrics to TRL's per-mode lists, pooling our keys across processes
(guard counts summed), and our advantages in TRL's completions table. The same on a real trainer:
test_trinity.py (completions table) and tests/trainers/test_distributed.py (two processes)."""

from __future__ import annotations

from collections import defaultdict, deque

import pytest
import torch

from trinity_trl.training.metrics import (
    append_metrics,
    append_process_means,
    no_learning_signal,
    pool_metrics,
    replace_logged_advantages,
)


def test_append_metrics_turns_tensors_into_floats_and_appends():
    store = defaultdict(list)
    append_metrics(store, {"actor/pg_loss": torch.tensor(0.25), "actor/clipfrac": 0.5, "count": 3})
    append_metrics(store, {"actor/pg_loss": torch.tensor([1.5])})  # one-element tensors too
    assert dict(store) == {"actor/pg_loss": [0.25, 1.5], "actor/clipfrac": [0.5], "count": [3.0]}
    assert all(type(v) is float for values in store.values() for v in values)


def test_append_metrics_detaches():
    store = defaultdict(list)
    x = torch.tensor(2.0, requires_grad=True)
    append_metrics(store, {"actor/loss": x * 3})
    assert store["actor/loss"] == [6.0]


def test_append_process_means_appends_each_metrics_mean_over_processes():
    """The SFT/DPO trainers' logging: one gather of every key (sorted), each key's mean over processes appended."""
    other_rank = torch.tensor([[10.0, 20.0, 30.0]], dtype=torch.float64)  # another process's actor/a, actor/b, c
    gathered = []

    def gather(values):  # accelerate's gather for 2 processes, seen from rank 0
        gathered.append(values)
        return torch.cat([values, other_rank])

    store = defaultdict(list, {"actor/b": [7.0]})
    append_process_means(store, {"c": 4, "actor/b": torch.tensor(2.0), "actor/a": 1.0}, gather, "cpu")
    assert len(gathered) == 1 and gathered[0].dtype == torch.float64 and gathered[0].shape == (1, 3)
    assert dict(store) == {"actor/a": [5.5], "actor/b": [7.0, 11.0], "c": [17.0]}
    append_process_means(store, {}, gather, "cpu")  # nothing to log: no collective either
    assert len(gathered) == 1


def fake_gather_object(per_rank: list[dict]):
    """accelerate's `gather_object` for `len(per_rank)` processes, seen from the process holding `per_rank[0]`:
    each process contributes a one-element list, the result concatenates them in rank order."""
    calls = []

    def gather(obj):
        assert isinstance(obj, list) and len(obj) == 1
        calls.append(obj[0])
        return [obj[0], *per_rank[1:]]

    gather.calls = calls
    return gather


def test_pool_metrics_pools_our_keys_across_processes():
    store = defaultdict(
        list,
        {
            "actor/pg_loss": [1.0, 2.0],  # ours: pooled
            "chord/expert_tokens": [5.0],  # ours, this rank only
            "kl/mean": [0.1],
            "num_tokens": [40.0],  # TRL's: TRL gathers it, left alone
            "reward": [0.5],
        },
    )
    other_rank = {"actor/pg_loss": [3.0], "chord/on_policy_tokens": [7.0]}
    gather = fake_gather_object([None, other_rank])
    pool_metrics(store, gather)
    assert len(gather.calls) == 1  # one collective
    assert gather.calls[0] == {"actor/pg_loss": [1.0, 2.0], "chord/expert_tokens": [5.0], "kl/mean": [0.1]}
    assert store["actor/pg_loss"] == [1.0, 2.0, 3.0]  # rank 0's values, then rank 1's
    assert store["chord/expert_tokens"] == [5.0]
    assert store["chord/on_policy_tokens"] == [7.0]  # a key only another rank logged arrives too
    assert store["num_tokens"] == [40.0] and store["reward"] == [0.5]


def test_pool_metrics_sums_guard_counts():
    store = defaultdict(
        list, {"guards/empty_mask": [1.0, 0.0, 1.0], "guards/nonfinite_logps": [2.0], "actor/pg_loss": [0.5, 1.5]}
    )
    pool_metrics(store, None)  # one process: no collective
    assert store["guards/empty_mask"] == [2.0]
    assert store["guards/nonfinite_logps"] == [2.0]
    assert store["actor/pg_loss"] == [0.5, 1.5]  # averaged later by TRL, not summed


def test_pool_metrics_sums_guard_counts_over_processes():
    store = defaultdict(list, {"guards/nonfinite_advantages": [8.0, 0.0]})
    pool_metrics(store, fake_gather_object([None, {"guards/nonfinite_advantages": [3.0]}]))
    assert store["guards/nonfinite_advantages"] == [11.0]  # TRL's mean of one value is the sum of every event


def test_replace_logged_advantages_with_one_value_per_row():
    logged = deque([9.0, 9.5, 0.1, 0.2, 0.3], maxlen=100)  # an earlier batch's values, then TRL's for this one
    replace_logged_advantages(logged, lambda t: t, torch.tensor([1.0, -1.0, 0.5]), torch.ones(3, 2))
    assert list(logged) == [9.0, 9.5, 1.0, -1.0, 0.5]


def test_replace_logged_advantages_with_token_advantages_logs_each_rows_masked_mean():
    advantages = torch.tensor([[1.0, 3.0, 100.0], [2.0, 100.0, 100.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    logged = deque([0.0, 0.0, 0.0])
    replace_logged_advantages(logged, lambda t: t, advantages, mask)
    assert list(logged) == pytest.approx([2.0, 2.0, 0.0])  # an empty row logs 0, not NaN


def test_replace_logged_advantages_uses_every_processs_rows():
    # this process holds 2 rows; TRL's table lists the 4 rows of both processes
    logged = deque([0.0, 0.0, 0.0, 0.0])

    def gather(local):
        assert local.dtype == torch.float32
        return torch.cat([local, torch.tensor([7.0, 8.0])])

    replace_logged_advantages(logged, gather, torch.tensor([1, 2], dtype=torch.float64), torch.ones(2, 1))
    assert list(logged) == [1.0, 2.0, 7.0, 8.0]


def test_replace_logged_advantages_when_the_table_holds_fewer_values():
    logged = deque([0.3], maxlen=2)  # TRL keeps at most maxlen values
    replace_logged_advantages(logged, lambda t: t, torch.tensor([1.0, 2.0, 3.0]), torch.ones(3, 1))
    assert list(logged) == [2.0, 3.0]


def test_no_learning_signal_only_when_no_group_ever_varied():
    flat = [
        {"step": 1, "reward": 0.0, "frac_reward_zero_std": 1.0},
        {"step": 2, "reward": 0.0, "frac_reward_zero_std": 1.0},
        {"step": 2, "train_runtime": 3.0},
    ]
    remark = no_learning_signal(flat)
    assert remark.startswith("no learning signal: the reward never varied within a group of rollouts")
    assert "every rollout got reward 0 at every logged step" in remark
    # constant within each group but different between groups: still no signal, said without a single value
    mixed = [{"reward": 0.25, "frac_reward_zero_std": 1.0}, {"reward": 1.0, "frac_reward_zero_std": 1.0}]
    assert "no group's rewards differed" in no_learning_signal(mixed)
    # one step where some group varied: that step had a signal
    assert no_learning_signal([*flat, {"reward": 0.5, "frac_reward_zero_std": 0.75}]) is None
    assert no_learning_signal([{"loss": 1.0}]) is None  # SFT / DPO: no rewards, nothing to say


def test_a_chord_run_without_reward_signal_says_its_sft_term_trained():
    """CHORD's rollouts all scored 0: the RL term learned nothing, but the SFT term on the demonstrations trained
    (the held-out accuracy may rise): the remark says where what was learned came from, not that nothing was."""
    log = [
        {"reward": 0.0, "frac_reward_zero_std": 1.0, "actor/mu": 0.9},
        {"reward": 0.0, "frac_reward_zero_std": 1.0, "actor/mu": 0.05},
    ]
    remark = no_learning_signal(log)
    assert remark.startswith("no learning signal from the rewards:") and "the policy learned nothing" not in remark
    assert "what the model learned came from the SFT term on the demonstrations (its weight mu 0.9 -> 0.05)" in remark


@pytest.mark.parametrize("spelling", ["", "_total"], ids=["synchronous", "asynchronous"])
def test_a_run_in_which_every_agent_run_failed_says_so(spelling):
    """Every agent run raised or timed out at every logged step: the run trained on nothing its agents did, and the
    closing remark says so (it ended like a good run); one step with a run that worked says nothing."""
    failed = {f"agent/runs{spelling}": 4.0, f"agent/errors{spelling}": 3.0, f"agent/timeouts{spelling}": 1.0}
    remark = no_learning_signal([failed, {**failed, f"agent/errors_after_cut_answer{spelling}": 2.0}])
    assert remark.startswith("every agent run failed at every logged step (6 raised, 2 of them right after an answer")
    assert "2 timed out" in remark
    assert no_learning_signal([failed, {**failed, f"agent/errors{spelling}": 2.0}]) is None


@pytest.mark.parametrize("disable_tqdm", [False, True], ids=["progress-bar", "printer"])
def test_the_python_api_prints_one_line_per_logging_step(disable_tqdm, tmp_path, tiny_model_dir, capsys):
    """Issue 35: a trainer built in Python printed transformers' metric dict (dozens of keys) on every logging step;
    now one summary line, as the recipes print, under the progress bar or without it; the log keeps every metric."""
    from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs

    from trinity_trl import TrinityConfig, TrinityTrainer

    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), disable_tqdm=disable_tqdm)),
        train_dataset=tiny_conversational_dataset(),
    )
    trainer.train()
    printed = capsys.readouterr()
    text = printed.out + printed.err
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 1/2", "step 2/2"] and "| reward " in lines[0]
    assert "'guards/nonfinite_logps'" not in text and "{'loss'" not in text
    assert any("guards/nonfinite_logps" in entry for entry in trainer.state.log_history)


def test_the_summary_line_shows_a_missing_or_strange_value_instead_of_stopping_the_run():
    """A log step whose loss is NaN (logged as None by the Trainer) or a string must not raise: the console line
    is printed by a callback inside ``trainer.train()`` (the guards test's NaN run stopped there)."""
    from trinity_trl.training.metrics import summary_line

    metrics = (("reward", ("reward",)), ("loss", ("loss",)), ("rl", ("actor/pg_loss",)))
    line = summary_line(
        1, 2, {"reward": None, "loss": float("nan"), "actor/pg_loss": "n/a", "step_time": 1.25}, metrics
    )
    assert line == "step 1/2 | reward None | loss nan | rl n/a | 1.2 s"
    assert summary_line(3, 0, {"loss": 0.123456}, metrics) == "step 3 | loss 0.1235"


def test_the_asynchronous_summary_line_shows_staleness_and_seconds():
    """The asynchronous trainers log no ``step_time``: their line shows the step's wall time (``perf/step_s``; the
    first step has none, so its forward and backward, ``perf/fwd_bwd_s``) and the mean staleness of its samples."""
    from trinity_trl.algorithms import POLICY_LOSS_FN
    from trinity_trl.training.metrics import summary_line, summary_metrics

    metrics = summary_metrics(POLICY_LOSS_FN.get("cispo"))
    first = {"reward": 0.25, "loss": 0.1, "async/staleness": 0.0, "perf/fwd_bwd_s": 1.5}
    later = {**first, "async/staleness": 1.5, "perf/step_s": 7.25}
    assert summary_line(1, 3, first, metrics).endswith("| staleness 0 | 1.5 s")
    assert summary_line(2, 3, later, metrics).endswith("| staleness 1.5 | 7.2 s")
    assert "staleness" not in summary_line(2, 3, {"loss": 0.1, "step_time": 2.0}, metrics)
