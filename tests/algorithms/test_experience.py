"""Experiences, their grouping helpers and the experience-operator base (``experience.py``,
docs/algorithms/advantages.md#experiences)."""

from __future__ import annotations

import pytest
import torch

from trinity_trl.algorithms import ADVANTAGE_FN, EID, Experience, ExperienceOperator, gather_metrics, group_by
from trinity_trl.algorithms.advantage import BatchAdvantageFn, GroupAdvantageFn

from .support import BATCH_ADV_KEYS, GROUP_ADV_KEYS


def test_eid_ids():
    eid = EID(batch=3, task=1, run=2, step=4, suffix="abcdef")
    assert (eid.tid, eid.rid, eid.sid, eid.uid) == ("3/1", "3/1/2", "3/1/4", "3/1/2/4/abcdef")


def test_experience_defaults_and_reward_only_experiences():
    exp = Experience(eid=EID(), tokens=torch.arange(5), prompt_length=2, reward=1.0)
    assert exp.response_length == 3 and exp.action_mask.tolist() == [True, True, True]
    exp.set_advantage(0.5)
    assert exp.advantages.tolist() == [0.5, 0.5, 0.5] and exp.returns is not exp.advantages
    scalar = Experience(eid=EID(), reward=1.0)  # known by its reward alone
    scalar.set_advantage(torch.tensor(0.25))
    assert scalar.advantages.dim() == 0 and scalar.advantages.item() == 0.25
    with pytest.raises(ValueError, match="prompt_length"):
        Experience(eid=EID(), tokens=torch.arange(2), prompt_length=3)


def test_group_by_keeps_first_appearance_order():
    exps = [Experience(eid=EID(task=t, run=r)) for t, r in ((1, 0), (0, 0), (1, 1), (0, 1))]
    groups = group_by(exps, "task")
    assert list(groups) == ["0/1", "0/0"] and [e.eid.run for e in groups["0/1"]] == [0, 1]
    with pytest.raises(ValueError, match="task, run, step"):
        group_by(exps, "batch")


def test_gather_metrics():
    assert gather_metrics([], "p") == {}
    out = gather_metrics([{"a": 1.0}, {"a": 3.0, "b": float("nan")}], "p")
    assert out == {"p/a/mean": 2.0, "p/a/max": 3.0, "p/a/min": 1.0}


def test_experience_operator_is_abstract_and_callable():
    with pytest.raises(TypeError, match="abstract"):
        ExperienceOperator()

    class KeepRewarded(ExperienceOperator):
        def process(self, exps):
            kept = [e for e in exps if e.reward]
            return kept, {"dropped": float(len(exps) - len(kept))}

    exps = [Experience(eid=EID(run=i), reward=float(i % 2)) for i in range(4)]
    out, metrics = KeepRewarded()(exps)
    assert [e.eid.run for e in out] == [1, 3] and metrics == {"dropped": 2.0}


def test_group_advantage_functions_are_experience_operators():
    for key in GROUP_ADV_KEYS:
        cls = ADVANTAGE_FN.get(key)
        assert issubclass(cls, GroupAdvantageFn) and issubclass(cls, ExperienceOperator), key
        assert "process" not in getattr(cls, "__abstractmethods__", ()), key
    for key in BATCH_ADV_KEYS:
        assert not issubclass(ADVANTAGE_FN.get(key), ExperienceOperator), key  # they work on padded batches
        assert issubclass(ADVANTAGE_FN.get(key), BatchAdvantageFn)
    with pytest.raises(TypeError, match="abstract"):
        GroupAdvantageFn()
