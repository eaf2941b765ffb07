"""Raw-reward REINFORCE — key ``reinforce`` (docs/algorithms/advantages.md#reinforce; the TOPR preset's advantage).

``score = reward``: no baseline, so TOPR can tell positive from negative samples by sign.
"""

from __future__ import annotations

from ..experience import Experience, gather_metrics, group_by
from .advantage_fn import ADVANTAGE_FN, GroupAdvantageFn
from .grpo import experience_rewards


@ADVANTAGE_FN.register("reinforce")
class REINFORCEGroupAdvantage(GroupAdvantageFn):
    """No arguments. Writes ``advantages = returns = reward·action_mask``; metric ``reward_mean`` per group."""

    def process(self, experiences: list[Experience]) -> tuple[list[Experience], dict[str, float]]:
        output: list[Experience] = []
        metric_list: list[dict[str, float]] = []
        for group in group_by(experiences, "task").values():
            rewards = experience_rewards(group)
            for exp, score in zip(group, rewards.tolist()):
                exp.set_advantage(score)
            metric_list.append({"reward_mean": rewards.mean().item()})
            output.extend(group)
        return output, gather_metrics(metric_list, "group_advantages")
