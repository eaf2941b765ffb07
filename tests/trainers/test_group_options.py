"""GRPO's `rank_penalty` and `duplicate_experiences` in the trainers (issue 13 item 9): the rank penalty ranks each
group's samples by the behaviour log-probs the trainer computes at advantage time; duplicate experiences refill the
rows of filtered groups with copies of kept rows, so the batch keeps its size (DAPO-style dynamic sampling)."""

from __future__ import annotations

import torch
from helpers import completion_text, tiny_conversational_dataset, tiny_grpo_kwargs
from tolerance import assert_close

from trinity_trl.algorithms import ADVANTAGE_FN, EID, Experience
from trinity_trl.trainers import TrinityConfig, TrinityTrainer

G = 4


def length_reward(completions, **kwargs):
    return [len(completion_text(c)) / 10 for c in completions]


def make(tmp_path, tiny_model_dir, reward, **config):
    return TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=reward,
        train_dataset=tiny_conversational_dataset(),
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), per_device_train_batch_size=8, **config)),
    )


def generate(trainer, rewards_out: list | None = None):
    trainer.model.train()
    torch.manual_seed(0)
    rows = [dict(tiny_conversational_dataset()[i]) for i in (0, 1) for _ in range(G)]
    return trainer._generate_and_score_completions(rows)


def test_rank_penalty_uses_the_behaviour_logprobs_of_every_sample(tmp_path, tiny_model_dir):
    args = {"rank_penalty": 0.5}
    trainer = make(tmp_path, tiny_model_dir, length_reward, advantage=args)
    batch = generate(trainer)
    mask = batch["completion_mask"].bool()
    logps = trainer.scoring.logps(trainer.model, batch)
    rewards = torch.tensor(
        [
            len(trainer.processing_class.decode(ids[m], skip_special_tokens=True)) / 10
            for ids, m in zip(batch["completion_ids"], mask)
        ]
    )
    fn = ADVANTAGE_FN.get("grpo")(**{**ADVANTAGE_FN.get("grpo").default_args(), **args})
    exps = [
        Experience(eid=EID(task=i // G, run=i % G), reward=float(r), logprobs=logps[i][mask[i]])
        for i, r in enumerate(rewards)
    ]
    expected = torch.zeros(2 * G)
    for exp in fn(exps)[0]:
        expected[exp.eid.task * G + exp.eid.run] = exp.advantages
    # z-scores over a group of G penalised rewards (each penalty a sum over a row's log-probs); |z| < 2
    assert_close(batch["advantages"], expected, terms=G * mask.shape[1], scale=2.0)
    # the penalty changes the result (the test could fail): without it the advantages differ
    plain = ADVANTAGE_FN.get("grpo")(**ADVANTAGE_FN.get("grpo").default_args())
    unpenalised = torch.zeros(2 * G)
    for exp in plain([Experience(eid=EID(task=i // G, run=i % G), reward=float(r)) for i, r in enumerate(rewards)])[0]:
        unpenalised[exp.eid.task * G + exp.eid.run] = exp.advantages
    assert not torch.allclose(unpenalised, expected)


def test_duplicate_experiences_refill_filtered_groups_with_copies_of_kept_rows(tmp_path, tiny_model_dir):
    def first_group_flat(completions, **kwargs):  # group 0: all equal (filtered by std_threshold 0); group 1 varies
        return [1.0] * G + [float(i) for i in range(G)]

    trainer = make(
        tmp_path,
        tiny_model_dir,
        first_group_flat,
        advantage={"std_threshold": 0.0, "duplicate_experiences": True},
    )
    batch = generate(trainer)
    assert batch["completion_ids"].shape[0] == 2 * G  # the batch keeps its size
    mask = batch["completion_mask"]
    assert bool((mask.sum(1) > 0).all())  # every row trains: the filtered group's rows were refilled
    # the refilled rows are copies of the kept group's rows (token ids, masks, advantages): exact
    assert torch.equal(batch["completion_ids"][:G], batch["completion_ids"][G:])
    assert torch.equal(batch["prompt_ids"][:G], batch["prompt_ids"][G:])
    assert torch.equal(batch["advantages"][:G], batch["advantages"][G:])
    scores = torch.arange(G, dtype=torch.float32)
    assert_close(batch["advantages"][G:], (scores - scores.mean()) / (scores.std() + 1e-6), terms=G)  # z-scores
    assert trainer._metrics["train"]["refill/rows"][-1] == float(G)
    assert trainer._metrics["train"]["filtered_count"][-1] == float(G)


def test_without_duplicate_experiences_the_filtered_rows_are_left_out(tmp_path, tiny_model_dir):
    def first_group_flat(completions, **kwargs):
        return [1.0] * G + [float(i) for i in range(G)]

    trainer = make(tmp_path, tiny_model_dir, first_group_flat, advantage={"std_threshold": 0.0})
    batch = generate(trainer)
    assert (batch["completion_mask"][:G].sum(1) == 0).all() and (batch["advantages"][:G] == 0).all()
