"""The passes a component may need beyond TRL's scoring of a batch (a trainer mixin).

* log-probs of any rows under the policy (behaviour log-probs when TRL computed none), the reference model (or the
  policy with its adapter disabled under PEFT, as TRL does) and the teacher (on-policy distillation);
* ReMax's baselines: the reward of one greedy completion per prompt.

Every forward goes through the trainer's ``_get_per_token_logps_and_entropies``, so prefix packing, multimodal
inputs and TRL's fused head apply to these passes too.
"""

from __future__ import annotations

import torch
from trl.data_utils import is_conversational

from . import checks
from .advantages import weighted_rewards
from .generation import FORWARD_KEYS
from .metrics import append_metrics


class ScoringPasses:
    """Extra no-grad passes over a batch's rows, for the inputs a component asks for."""

    @torch.no_grad()
    def _forward_logps(self, model, rows: dict) -> torch.Tensor:
        """No-grad per-token log-probs ``(N, T)`` of ``rows``' completions under ``model``."""
        logps, _, _ = self._get_per_token_logps_and_entropies(
            model,
            torch.cat([rows["prompt_ids"], rows["completion_ids"]], dim=1),
            torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1),
            rows["completion_ids"].size(1),
            batch_size=self.args.per_device_train_batch_size,
            **{k: rows[k] for k in FORWARD_KEYS if k in rows},
        )
        return logps

    def _behaviour_logps(self, output: dict) -> torch.Tensor:
        """TRL's ``old_per_token_logps`` when it computed them, else one forward of the current policy."""
        if output.get("old_per_token_logps") is None:
            output["old_per_token_logps"] = self._forward_logps(self.model, output)
        return output["old_per_token_logps"]

    @torch.no_grad()
    def _reference_logps(self, rows: dict) -> torch.Tensor:
        """Reference log-probs of rows TRL did not score (expert or step rows), as TRL obtains them:
        the reference model, or the policy with its adapter disabled under PEFT."""
        from trl.trainer.utils import use_adapter

        if self.ref_model is not None:
            return self._forward_logps(self.ref_model, rows)
        model = self.accelerator.unwrap_model(self.model)
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            return self._forward_logps(self.model, rows)

    def _teacher_logps(self, output: dict, inputs: list[dict]) -> torch.Tensor:
        """Teacher log-probs: those a ``rollout_func`` returned with the rollout (``teacher_logprobs``, as
        Trinity's workflows store them), else a forward of ``teacher_model``."""
        if all(row.get("teacher_logprobs") is not None for row in inputs):
            return checks.rollout_teacher_logps([row["teacher_logprobs"] for row in inputs], output["completion_mask"])
        if self.teacher_model is None:
            raise ValueError(
                "the advantage function needs teacher log-probs: pass teacher_model=, or return "
                "'teacher_logprobs' (one list per completion) from rollout_func"
            )
        return self._forward_logps(self.teacher_model, output)

    def _greedy_reward_baselines(self, inputs: list[dict]) -> torch.Tensor:
        """ReMax's baselines ``(N,)``: one greedy completion of each group's prompt, generated through TRL's
        generation path and scored by the reward functions like the rollouts (not trained on)."""
        mode = "train" if self.model.training else "eval"
        group = self._group_size(mode)
        leaders = inputs[::group]  # each process holds whole groups (checks.check_components)
        prompts = [row["prompt"] for row in leaders]
        completion_ids = self.generation.generate_greedy(self.generation.tokenize_conversations(prompts))
        texts = [self.generation.decode(ids) for ids in completion_ids]
        completions = [[{"role": "assistant", "content": t}] for t in texts] if is_conversational(leaders[0]) else texts
        rewards = weighted_rewards(
            self._calculate_rewards(leaders, prompts, completions, completion_ids), self.reward_weights
        )
        append_metrics(
            self._metrics[mode],
            {"remax/greedy_completions": float(len(rewards)), "remax/greedy_reward": float(rewards.nanmean())},
        )
        return torch.nan_to_num(rewards).repeat_interleave(group)
