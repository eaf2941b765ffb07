"""A short, real demonstration of the algorithm library: ``python -m trinity_trl.algorithms.demo``.

Builds one sample micro-batch (the policy-loss data of docs/algorithms/reference-values.md), runs every registered
policy loss, KL estimator and entropy term on it, runs every advantage function on a small set of grouped
rollouts, and prints the losses, metrics and advantages.
"""

from __future__ import annotations

import torch

from . import ADVANTAGE_FN, ALGORITHM_TYPE, EID, ENTROPY_LOSS_FN, KL_FN, POLICY_LOSS_FN, Experience
from .advantage import scalar_rewards_to_token_level
from .policy_loss.mix import ExpertMixLossFn, step_sample_weights


def sample_batch(seed: int = 42, rows: int = 6, width: int = 20) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def uniform() -> torch.Tensor:
        return 2 * torch.rand(rows, width, generator=generator) - 1

    logprob, old_logprob, ref_logprob = -uniform().abs(), -uniform().abs(), -uniform().abs()
    mask = torch.rand(rows, width, generator=generator) > 0.3
    return {
        "logprob": logprob,
        "old_logprob": old_logprob,
        "ref_logprob": ref_logprob,
        "action_mask": mask,
        "advantages": uniform(),
        "expert_mask": torch.arange(rows) % 3 == 2,
        "step": torch.full((rows,), 10),
        "entropy": torch.rand(rows, width, generator=generator) * 2,
    }


def _one_step_weights(cls, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """For MIX and CHORD: the per-sample weights that make this one micro-batch a whole optimizer step (each usual
    sample weighs 1/usual rows, each expert sample 1/expert rows), so their ``usual/*`` and ``expert/*`` metrics are
    means over the rows (a clip fraction in [0, 1]). With the default weights (w = 1) each metric would be scaled by
    its row count: the scaling a trainer sums over the micro-batches of a step."""
    if not issubclass(cls, ExpertMixLossFn):
        return {}
    experts = int(batch["expert_mask"].sum())
    usual, expert = step_sample_weights(len(batch["expert_mask"]) - experts, experts, 1)
    return {"usual_sample_weight": usual, "expert_sample_weight": expert}


def _fmt(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def main() -> None:
    batch = sample_batch()
    print(
        f"Sample micro-batch: {batch['logprob'].shape[0]} rows x {batch['logprob'].shape[1]} tokens, "
        f"{int(batch['action_mask'].sum())} trained tokens\n"
    )

    print("Policy losses (default_args):")
    for name in POLICY_LOSS_FN.names():
        cls = POLICY_LOSS_FN.get(name)
        loss, metrics = cls(**cls.default_args(), **_one_step_weights(cls, batch))(**batch)
        print(f"  {name:20s} loss={loss.item():+.6f}  {_fmt(metrics)}")

    print("\nKL estimators (kl_coef=0.1, token-mean):")
    for name in KL_FN.names():
        fn = KL_FN.get(name)(kl_coef=0.1)
        loss, metrics = fn.calculate_kl_loss(
            batch["logprob"], batch["ref_logprob"], batch["action_mask"], "token-mean", old_logprob=batch["old_logprob"]
        )
        print(f"  {name:20s} loss={float(loss):+.6f}  {_fmt(metrics)}")

    print("\nEntropy terms (entropy_coef=0.01):")
    for name in ENTROPY_LOSS_FN.names():
        loss, metrics = ENTROPY_LOSS_FN.get(name)(entropy_coef=0.01)(**batch)
        print(f"  {name:20s} loss={float(loss):+.6f}  {_fmt(metrics)}")

    rewards = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.2, 0.9, 0.1], [0.3, 0.3, 0.3, 0.3]]
    print(f"\nGroup advantage functions on 3 tasks x 4 runs, rewards {rewards}:")
    for name in ADVANTAGE_FN.names():
        cls = ADVANTAGE_FN.get(name)
        if cls.compute_in_trainer():
            continue
        exps = [
            Experience(
                eid=EID(batch=0, task=t, run=r),
                tokens=torch.arange(6),
                prompt_length=2,
                reward=reward,
                logprobs=torch.full((4,), -0.1 * (r + 1)),
                # one-turn runs: every run of a task acted from its prompt (GiGPO's anchor state)
                info={"state_key": f"prompt {t}"} if cls.needs_step_states else {},
            )
            for t, row in enumerate(rewards)
            for r, reward in enumerate(row)
        ]
        out, metrics = cls(**cls.default_args())(exps)
        scores = [[round(float(e.advantages[0]), 3) for e in out if e.eid.task == t] for t in range(len(rewards))]
        print(f"  {name:20s} {scores}")

    mask = batch["action_mask"]
    token_rewards = scalar_rewards_to_token_level(torch.tensor([1.0, 0.0, 0.5, 1.0, 0.2, 0.7]), mask)
    trainer_batch = {
        "token_level_rewards": token_rewards,
        "response_mask": mask,
        "uid": ["a", "a", "a", "b", "b", "c"],
        "values": torch.linspace(-0.5, 0.5, mask.numel()).reshape(mask.shape),
        "reward_baselines": torch.tensor([0.5, 0.5, 0.5, 0.1, 0.1, 0.0]),
        "teacher_logprobs": batch["ref_logprob"],
        "old_logprob": batch["old_logprob"],
    }
    print("\nBatch (trainer-side) advantage functions, advantage at each row's first token:")
    for name in ADVANTAGE_FN.names():
        cls = ADVANTAGE_FN.get(name)
        if not cls.compute_in_trainer():
            continue
        out, _ = cls(**cls.default_args())(dict(trainer_batch))
        print(f"  {name:20s} {[round(v, 3) for v in out['advantages'][:, 0].tolist()]}")

    print(f"\n{len(ALGORITHM_TYPE)} algorithm presets:")
    for name in ALGORITHM_TYPE.names():
        cfg = ALGORITHM_TYPE.get(name).default_config()
        advantage = cfg["advantage"].name if "advantage" in cfg else "-"
        print(f"  {name:20s} policy_loss={cfg['policy_loss'].name:18s} advantage={advantage}")


if __name__ == "__main__":
    main()
