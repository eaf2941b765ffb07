"""trinity_trl/algorithms/demo.py (`make demo-algorithms`): every printed fraction is in [0, 1]."""

from __future__ import annotations

import re

import pytest
from tolerance import approx

from trinity_trl.algorithms import POLICY_LOSS_FN
from trinity_trl.algorithms.demo import _one_step_weights, main, sample_batch


def test_printed_fractions_are_in_unit_interval(capsys):
    main()
    out = capsys.readouterr().out
    fractions = re.findall(r"(\S*frac\S*)=([-+0-9.e]+)", out)
    assert {name for name, _ in fractions} >= {"usual/pg_clipfrac", "pg_clipfrac", "unmasked_frac"}
    assert all(0.0 <= float(value) <= 1.0 for _, value in fractions), fractions


@pytest.mark.parametrize("name", ["mix", "mix_chord"])
def test_mix_metrics_are_means_over_their_rows(name):
    """With the demo's one-step weights, MIX's usual/pg_clipfrac is PPO's clip fraction on the usual rows alone."""
    batch = sample_batch()
    cls = POLICY_LOSS_FN.get(name)
    _, metrics = cls(**cls.default_args(), **_one_step_weights(cls, batch))(**batch)
    usual = ~batch["expert_mask"]
    ppo = POLICY_LOSS_FN.get("ppo")(clip_range=cls.default_args().get("clip_range", 0.2))
    _, expected = ppo.evaluate(
        logprob=batch["logprob"][usual],
        old_logprob=batch["old_logprob"][usual],
        action_mask=batch["action_mask"][usual],
        advantages=batch["advantages"][usual],
    )
    assert float(metrics["usual/pg_clipfrac"]) == approx(
        float(expected["pg_clipfrac"]), terms=int(batch["action_mask"].sum())
    )
