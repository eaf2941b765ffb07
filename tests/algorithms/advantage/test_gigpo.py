"""GiGPO (docs/algorithms/advantages.md#gigpo): episode advantage plus omega times the anchor-state step advantage."""

from __future__ import annotations

import pytest
import torch
from tolerance import approx

from trinity_trl.algorithms.advantage import ADVANTAGE_FN
from trinity_trl.algorithms.experience import EID, Experience

GIGPO = ADVANTAGE_FN.get("gigpo")
TERMS = 3 * 3  # a statistic of at most 3 runs x 3 steps in float32


def runs_to_experiences(runs, task=0, batch=0, rewards=None):
    """``runs``: per run ``(state keys, run reward)``; the reward on the last step only (the others carry a decoy that
    must not be read). ``rewards``: per run, declared step rewards (``info["step_reward"]``) instead."""
    exps = []
    for r, (keys, reward) in enumerate(runs):
        for t, key in enumerate(keys):
            info = {"state_key": key}
            if rewards is not None:
                info["step_reward"] = rewards[r][t]
            exps.append(
                Experience(
                    eid=EID(batch=batch, task=task, run=r, step=t),
                    tokens=torch.arange(5),
                    prompt_length=2,
                    reward=reward if t == len(keys) - 1 else 9.0,
                    action_mask=torch.tensor([1, 1, 0], dtype=torch.bool),
                    info=info,
                )
            )
    return exps


def advantages(out):
    """``{(task, run): [A per step]}``, every step's masked tokens 0 and returns equal to advantages."""
    table: dict[tuple, list[float]] = {}
    for exp in out:
        assert exp.advantages.dtype == torch.float32 and torch.equal(exp.returns, exp.advantages)
        assert exp.advantages[2] == 0.0 and exp.advantages[0] == exp.advantages[1]
        table.setdefault((exp.eid.task, exp.eid.run), []).append(float(exp.advantages[0]))
    return table


def assert_table(out, expected):
    got = advantages(out)
    assert sorted(got) == sorted(expected)
    for key, values in expected.items():
        assert got[key] == [approx(v, terms=TERMS, scale=2.0) for v in values], key


# docs/algorithms/advantages.md#gigpo-reference: A visits s0 then s1 (R 1), B s0 then s2 (R 0), C s0, s1, s3 (R 0.5)
REFERENCE = [(["s0", "s1"], 1.0), (["s0", "s2"], 0.0), (["s0", "s1", "s3"], 0.5)]
REFERENCE_RESULT = {(0, 0): [1.0, 0.75], (0, 1): [-1.0, -0.5], (0, 2): [0.0, -0.25, 0.0]}


def test_reference_case():
    out, metrics = GIGPO(omega=1.0, gamma=1.0, fnorm="none", epsilon=0.0)(runs_to_experiences(REFERENCE))
    assert_table(out, REFERENCE_RESULT)
    # steps beyond the first: A1 (s1), B1 (s2), C1 (s1), C2 (s3); s1 recurs
    assert metrics["gigpo/anchor_hit_ratio"] == 0.5 and metrics["gigpo/later_steps"] == 4.0
    assert metrics["experience_count"] == 7.0
    assert metrics["group_advantages/reward_mean/mean"] == approx(0.5, terms=TERMS)
    assert metrics["group_advantages/reward_std/mean"] == approx(0.5, terms=TERMS)


def test_reference_case_at_the_defaults_is_within_epsilon():
    out, _ = GIGPO(**GIGPO.default_args())(runs_to_experiences(REFERENCE))
    expected = {key: [v / (1 + 1e-6) for v in values] for key, values in REFERENCE_RESULT.items()}
    assert_table(out, expected)


def test_omega_zero_is_the_episode_advantage_alone():
    out, _ = GIGPO(omega=0.0, epsilon=0.0)(runs_to_experiences(REFERENCE))
    assert_table(out, {(0, 0): [0.5, 0.5], (0, 1): [-0.5, -0.5], (0, 2): [0.0, 0.0, 0.0]})


@pytest.mark.parametrize("fnorm", ["none", "std"])
def test_a_single_run_gets_its_return_and_no_step_advantage(fnorm):
    out, metrics = GIGPO(fnorm=fnorm)(runs_to_experiences([(["s0", "s1", "s2"], 0.7)]))
    assert_table(out, {(0, 0): [0.7 / (1 + 1e-6)] * 3})
    assert metrics["group_advantages/reward_mean/mean"] == 0.0 and metrics["gigpo/anchor_hit_ratio"] == 0.0


@pytest.mark.parametrize("fnorm", ["none", "std"])
def test_all_equal_returns_give_zero(fnorm):
    runs = [(["s0", "s1"], 0.5), (["s0", "s1", "s2"], 0.5), (["s0", "s2"], 0.5)]
    out, metrics = GIGPO(fnorm=fnorm)(runs_to_experiences(runs))
    assert all(v == 0.0 for values in advantages(out).values() for v in values)
    assert metrics["gigpo/anchor_hit_ratio"] == 1.0


def test_no_shared_state_leaves_the_episode_advantage():
    runs = [(["a0", "a1"], 1.0), (["b0", "b1"], 0.0), (["c0", "c1", "c2"], 0.5)]
    out, metrics = GIGPO(epsilon=0.0)(runs_to_experiences(runs))
    assert_table(out, {(0, 0): [0.5, 0.5], (0, 1): [-0.5, -0.5], (0, 2): [0.0, 0.0, 0.0]})
    assert metrics["gigpo/anchor_hit_ratio"] == 0.0


def test_a_step_without_a_key_is_an_anchor_group_of_its_own():
    runs = [([None, "s1"], 1.0), ([None, "s1"], 0.0)]
    out, metrics = GIGPO(epsilon=0.0)(runs_to_experiences(runs))
    assert_table(out, {(0, 0): [0.5, 1.0], (0, 1): [-0.5, -1.0]})
    assert metrics["gigpo/anchor_hit_ratio"] == 1.0


def test_anchor_groups_never_span_two_tasks():
    """Two tasks whose states bear the same names (every game starts in "s0"): each task is scored alone."""
    first = [(["s0", "s1"], 1.0), (["s0", "s2"], 0.0)]
    second = [(["s0", "s1"], 0.0), (["s0", "s1"], 0.4)]
    together, _ = GIGPO(epsilon=0.0)(runs_to_experiences(first) + runs_to_experiences(second, task=1))
    alone = {}
    for task, runs in enumerate((first, second)):
        out, _ = GIGPO(epsilon=0.0)(runs_to_experiences(runs, task=task))
        alone.update(advantages(out))
    assert_table(together, alone)
    assert_table(together, {(0, 0): [1.0, 0.5], (0, 1): [-1.0, -0.5], (1, 0): [-0.4, -0.4], (1, 1): [0.4, 0.4]})


def test_a_state_repeated_within_a_run_is_an_anchor_group():
    runs = [(["s0", "s1", "s1"], 1.0), (["s0", "s2"], 0.0)]
    out, metrics = GIGPO(epsilon=0.0)(runs_to_experiences(runs))
    # s1's two steps have the same return (1): step advantage 0
    assert_table(out, {(0, 0): [1.0, 0.5, 0.5], (0, 1): [-1.0, -0.5]})
    assert metrics["gigpo/anchor_hit_ratio"] == approx(2 / 3)


def test_declared_step_rewards_are_summed_and_discounted():
    runs = [(["s0", "s1"], 5.0), (["s0", "s1"], 5.0)]  # the run rewards are not read when steps declare theirs
    declared = [[1.0, 1.0], [0.0, 0.0]]
    out, _ = GIGPO(gamma=0.5, epsilon=0.0)(runs_to_experiences(runs, rewards=declared))
    # R = [2, 0] -> A^E = +-1; G_A = [1.5, 1.0], G_B = [0, 0] -> s0 +-0.75, s1 +-0.5
    assert_table(out, {(0, 0): [1.75, 1.5], (0, 1): [-1.75, -1.5]})
    out, _ = GIGPO(gamma=1.0, epsilon=0.0)(runs_to_experiences(runs, rewards=declared))
    assert_table(out, {(0, 0): [2.0, 1.5], (0, 1): [-2.0, -1.5]})


def test_std_normalisation_divides_both_levels_by_their_unbiased_std():
    out, _ = GIGPO(fnorm="std", epsilon=1e-6)(runs_to_experiences(REFERENCE))
    episode = torch.tensor([1.0, 0.0, 0.5])
    e = ((episode - episode.mean()) / (episode.std() + 1e-6)).tolist()
    s1 = torch.tensor([1.0, 0.5])
    s = ((s1 - s1.mean()) / (s1.std() + 1e-6)).tolist()
    assert_table(out, {(0, 0): [2 * e[0], e[0] + s[0]], (0, 1): [2 * e[1], e[1]], (0, 2): [0.0, s[1], 0.0]})


def test_output_order_is_tasks_then_runs_then_steps():
    exps = runs_to_experiences(REFERENCE) + runs_to_experiences([(["s0"], 1.0)], task=1)
    shuffled = [exps[i] for i in (7, 4, 0, 5, 2, 1, 6, 3)]
    out, _ = GIGPO()(shuffled)
    assert [(e.eid.task, e.eid.run, e.eid.step) for e in out] == [
        (1, 0, 0),
        (0, 2, 0),
        (0, 2, 1),
        (0, 2, 2),
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
    ]


def test_experiences_known_by_their_reward_alone_get_a_scalar():
    exps = [Experience(eid=EID(task=0, run=r, step=0), reward=float(r), info={"state_key": "start"}) for r in range(2)]
    out, _ = GIGPO(epsilon=0.0)(exps)
    assert [e.advantages.dim() for e in out] == [0, 0]
    assert [float(e.advantages) for e in out] == [-1.0, 1.0]


def test_empty_input():
    assert GIGPO()([]) == ([], {})


def test_what_gigpo_refuses():
    with pytest.raises(ValueError, match=r"has no info\['state_key'\].*StepGRPOTrainer"):
        GIGPO()([Experience(eid=EID(), reward=1.0)])
    mixed = runs_to_experiences([(["s0", "s1"], 1.0)], rewards=[[0.0, 1.0]])
    del mixed[0].info["step_reward"]
    with pytest.raises(ValueError, match=r"declares info\['step_reward'\] on 1 of its 2 steps"):
        GIGPO()(mixed)
    with pytest.raises(ValueError, match="step_reward'] of 0/0/0/1/.* must be a finite number, got nan"):
        GIGPO()(runs_to_experiences([(["s0", "s1"], 1.0)], rewards=[[0.0, float("nan")]]))
    with pytest.raises(ValueError, match="without a reward"):
        GIGPO()(runs_to_experiences([(["s0"], None)]))
    for bad, match in [
        ({"gamma": 1.5}, "gamma must be in"),
        ({"omega": float("inf")}, "omega must be a finite number"),
        ({"fnorm": "batch"}, "Unknown fnorm 'batch'; allowed: 'std', 'none'"),
        ({"epsilon": -1e-6}, "epsilon must be >= 0"),
        ({"fnorm": "std", "epsilon": 0.0}, r"> 0 with fnorm='std'"),
    ]:
        with pytest.raises(ValueError, match=match):
            GIGPO(**bad)
