"""The passes a component may need beyond TRL's scoring of a batch (`Scoring`, composed by the trainer).

* log-probs of any rows under the policy (behaviour log-probs when TRL computed none), the reference model (or the
  policy with its adapter disabled under PEFT, as TRL does) and the teacher (on-policy distillation);
* ReMax's baselines: the reward of one greedy completion per prompt.

Every forward goes through the trainer's ``_get_per_token_logps_and_entropies`` (given as ``forward``), so prefix
packing, multimodal inputs and TRL's fused head apply to these passes too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from trl import is_conversational

from . import checks
from .advantages import weighted_rewards
from .metrics import append_metrics
from .trl_generation import FORWARD_KEYS


@dataclass(eq=False)
class Scoring:
    """Extra no-grad passes over a batch's rows, for the inputs a component asks for.

    Args:
        forward: the trainer's log-prob forward, with the signature of TRL's
            ``GRPOTrainer._get_per_token_logps_and_entropies`` (returns ``(logps, entropies, aux_loss)``).
        batch_size: rows per forward (``per_device_train_batch_size``).
        policy: returns the policy model (a getter: the engine may replace the trainer's model after this is built).
        reference: the reference model TRL loaded, or ``None`` (then the policy with its adapter disabled, PEFT).
        unwrap: ``accelerator.unwrap_model``.
        teacher: the teacher model (on-policy distillation), or ``None``.
        generation: the trainer's `generation.TRLGeneration` (ReMax's greedy completions).
        score: the trainer's reward pass, with the signature of TRL's ``GRPOTrainer._calculate_rewards``
            (returns every process's ``(N, reward functions)`` rewards).
        reward_weights: ``(reward functions,)`` TRL's ``reward_weights``.
    """

    forward: Callable[..., tuple[torch.Tensor, Any, Any]]
    batch_size: int
    policy: Callable[[], torch.nn.Module]
    reference: torch.nn.Module | None
    unwrap: Callable[[torch.nn.Module], torch.nn.Module]
    teacher: torch.nn.Module | None
    generation: Any
    score: Callable[..., torch.Tensor]
    reward_weights: torch.Tensor

    @torch.no_grad()
    def logps(self, model: torch.nn.Module, rows: dict) -> torch.Tensor:
        """No-grad per-token log-probs ``(N, T)`` of ``rows``' completions under ``model``."""
        logps, _, _ = self.forward(
            model,
            torch.cat([rows["prompt_ids"], rows["completion_ids"]], dim=1),
            torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1),
            rows["completion_ids"].size(1),
            batch_size=self.batch_size,
            **{k: rows[k] for k in FORWARD_KEYS if k in rows},
        )
        return logps

    def policy_logps(self, rows: dict) -> torch.Tensor:
        """No-grad log-probs of ``rows`` under the current policy."""
        return self.logps(self.policy(), rows)

    def behaviour_logps(self, output: dict) -> torch.Tensor:
        """TRL's ``old_per_token_logps`` when it computed them, else one forward of the current policy (kept in
        ``output``, so it runs once per batch)."""
        if output.get("old_per_token_logps") is None:
            output["old_per_token_logps"] = self.policy_logps(output)
        return output["old_per_token_logps"]

    @torch.no_grad()
    def reference_logps(self, rows: dict) -> torch.Tensor:
        """Reference log-probs of rows TRL did not score (expert or step rows), as TRL obtains them:
        the reference model, or the policy with its adapter disabled under PEFT."""
        from .grpo_seams import use_adapter

        if self.reference is not None:
            return self.logps(self.reference, rows)
        policy = self.policy()
        model = self.unwrap(policy)
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            return self.logps(policy, rows)

    def teacher_logps(self, output: dict, inputs: list[dict]) -> torch.Tensor:
        """Teacher log-probs: those a ``rollout_func`` returned with the rollout (``teacher_logprobs``, as
        Trinity's workflows store them), else a forward of the teacher model."""
        if all(row.get("teacher_logprobs") is not None for row in inputs):
            return checks.rollout_teacher_logps([row["teacher_logprobs"] for row in inputs], output["completion_mask"])
        if self.teacher is None:
            raise ValueError(
                "the advantage function needs teacher log-probs: pass teacher_model=, or return "
                "'teacher_logprobs' (one list per completion) from rollout_func"
            )
        return self.logps(self.teacher, output)

    def greedy_reward_baselines(self, inputs: list[dict], group: int, metrics: dict[str, list]) -> torch.Tensor:
        """ReMax's baselines ``(N,)``: one greedy completion of each group's prompt (groups of ``group`` rows),
        generated through TRL's generation path and scored by the reward functions like the rollouts (not trained
        on). ``metrics``: the trainer's metric lists of the current mode (``remax/*`` are appended)."""
        leaders = inputs[::group]  # each process holds whole groups (checks.check_components)
        prompts = [row["prompt"] for row in leaders]
        completion_ids = self.generation.generate_greedy(self.generation.tokenize_conversations(prompts))
        texts = [self.generation.decode(ids) for ids in completion_ids]
        completions = [[{"role": "assistant", "content": t}] for t in texts] if is_conversational(leaders[0]) else texts
        rewards = weighted_rewards(self.score(leaders, prompts, completions, completion_ids), self.reward_weights)
        append_metrics(
            metrics, {"remax/greedy_completions": float(len(rewards)), "remax/greedy_reward": float(rewards.nanmean())}
        )
        return torch.nan_to_num(rewards).repeat_interleave(group)
