"""``StepGRPOTrainer``: multi-step agents, every turn its own sample, step-wise GRPO advantages.

For each task the trainer plays ``num_generations`` runs against an environment (see
:mod:`trinity_trl.rollouts`), batching the next turn of every active run into one generation
call. TRL scores the runs (the environment's last-step reward, plus any reward functions on the
final turn), the rewards of every process are gathered, and ``step_wise_grpo`` normalises each
run's reward within its task group and gives the score to every step of the run (spec §12.4).
Each step then becomes a row of the training batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from trl.trainer.utils import pad

from ..algorithms import EID, Experience
from ..rollouts import MultiStepRollout
from ..rollouts.multi_step import HISTORY_MODES, Run
from .config import TrinityConfig
from .trinity import TrinityTrainer

STD_CAL_LEVELS = ("group", "batch", "none")


@dataclass
class StepGRPOConfig(TrinityConfig):
    r"""
    Configuration of [`StepGRPOTrainer`] (preset `multi_step_grpo`: PPO-clip loss, `step_wise_grpo`
    advantages, k2 KL loss; any policy loss of the library can replace PPO).

    Parameters:
        max_env_steps (`int`, *optional*, defaults to `5`): Turns per run at most.
        history (`str`, *optional*, defaults to `"tokens"`):
            `"tokens"`: each turn's prompt is the previous prompt + the generated tokens + the
            observation's chat-template tokens (never re-tokenized). `"messages"`: the conversation is
            re-rendered by the chat template every turn.
        enable_step_norm (`bool`, *optional*, defaults to `False`):
            Divide a run's advantage by its number of steps, so long runs do not weigh more.
        std_cal_level (`str`, *optional*, defaults to `"group"`):
            Standard deviation used to normalise run rewards: the task group's (`"group"`), the whole
            batch's (`"batch"`), or none (`"none"`: reward minus group mean).
        std_threshold (`float` or `None`, *optional*):
            Skip task groups whose reward std is at most this (and single-run groups); their steps get
            no gradient and are counted in `filtered_count`.
        advantage_epsilon (`float`, *optional*, defaults to `1e-6`): Added to the std.
    """

    algorithm: str = field(default="multi_step_grpo", metadata={"help": "Algorithm preset."})
    max_env_steps: int = field(default=5, metadata={"help": "Turns per run at most."})
    history: str = field(default="tokens", metadata={"help": "'tokens' or 'messages' (see docs)."})
    enable_step_norm: bool = field(default=False, metadata={"help": "Divide a run's advantage by its step count."})
    std_cal_level: str = field(default="group", metadata={"help": "'group', 'batch' or 'none'."})
    std_threshold: float | None = field(default=None, metadata={"help": "Skip groups with std <= threshold."})
    advantage_epsilon: float = field(default=1e-6, metadata={"help": "Added to the std."})

    def __post_init__(self):
        if self.max_env_steps < 1:
            raise ValueError(f"max_env_steps must be >= 1, got {self.max_env_steps}")
        if self.history not in HISTORY_MODES:
            raise ValueError(f"history must be one of {HISTORY_MODES}, got {self.history!r}")
        if self.std_cal_level not in STD_CAL_LEVELS:
            raise ValueError(f"std_cal_level must be one of {STD_CAL_LEVELS}, got {self.std_cal_level!r}")
        super().__post_init__()

    def _user_overrides(self) -> dict[str, Any]:
        advantage = self.advantage_fn or "step_wise_grpo"
        if advantage != "step_wise_grpo":
            raise ValueError(f"StepGRPOConfig needs advantage_fn='step_wise_grpo', got {advantage!r}")
        return {"advantage_fn": "step_wise_grpo", "advantage_fn_args": {
            "enable_step_norm": self.enable_step_norm,
            "std_cal_level": self.std_cal_level,
            "std_threshold": self.std_threshold,
            "epsilon": self.advantage_epsilon,
        }}


def environment_reward(completions, env_reward, **kwargs) -> list[float]:
    """The reward the environment returned with each run's last step."""
    return list(env_reward)


class StepGRPOTrainer(TrinityTrainer):
    """Multi-step agent training with step-wise GRPO (see [`StepGRPOConfig`]).

    Args:
        environment_factory (`Callable[[], Environment]`): builds one environment per run (see
            :class:`trinity_trl.rollouts.Environment`). Each dataset row is a task: its columns are
            passed to `reset`, and its optional `prompt` starts the conversation.
        reward_funcs: optional extra reward functions scoring each run's final turn; the
            environment's reward is always the first reward (`environment_reward`).
        Other arguments: as [`TrinityTrainer`] (no `rollout_func`: the environment loop is the rollout).
    """

    _name = "Step-wise GRPO"
    config_class = StepGRPOConfig

    def __init__(self, model, reward_funcs=None, args: StepGRPOConfig | None = None, *pos, environment_factory=None, **kwargs):
        if args is not None and not isinstance(args, StepGRPOConfig):
            raise TypeError(f"StepGRPOTrainer needs a StepGRPOConfig, got {type(args).__name__}")
        if environment_factory is None or not callable(environment_factory):
            raise ValueError("StepGRPOTrainer needs environment_factory: a callable returning a fresh environment")
        if kwargs.get("rollout_func") is not None:
            raise ValueError("StepGRPOTrainer plays the environment itself; rollout_func cannot be combined with it")
        extra = [] if reward_funcs is None else (list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])
        kwargs["rollout_func"] = self._play
        super().__init__(model, [environment_reward, *extra], args, *pos, **kwargs)
        if self.use_vllm and self.vllm_importance_sampling_correction:
            raise ValueError(
                "StepGRPOTrainer does not support vllm_importance_sampling_correction yet (TRL computes the ratio for "
                "the final turn only); set vllm_importance_sampling_correction=False"
            )
        self.rollout = MultiStepRollout(self, environment_factory, self.args.max_env_steps, self.args.history)
        self._runs: list[Run] = []
        self._rows: list[dict[str, Any]] = []

    # ------------------------------------------------------------------------------ rollout
    def _generate_and_score_completions(self, inputs):
        # TRL reads x["prompt"] before calling the rollout; tasks may get their whole prompt from reset()
        self._rows = [dict(row) for row in inputs]
        for row in inputs:
            row.setdefault("prompt", [{"role": "user", "content": ""}])
        return super()._generate_and_score_completions(inputs)

    def _play(self, prompts, trainer) -> dict[str, list]:
        """TRL's ``rollout_func``: play every run, report each run's final turn (scored by TRL)."""
        self._runs = self.rollout(self._rows)
        last = [run.steps[-1] for run in self._runs]
        logprobs = [s.logprobs for s in last]
        return {
            "prompt_ids": [s.prompt_ids for s in last],
            "completion_ids": [s.completion_ids for s in last],
            "logprobs": None if any(lp is None for lp in logprobs) else logprobs,
            "env_reward": [run.reward for run in self._runs],
        }

    # --------------------------------------------------------------------------- advantages
    def _apply_algorithm(self, output: dict, num_local: int, mode: str) -> dict:
        group_size = self._group_size(mode)
        rewards = self._global_rewards()
        device = output["prompt_ids"].device
        steps_local = torch.tensor([len(run.steps) for run in self._runs], device=device)
        steps = self.accelerator.gather(steps_local).cpu().tolist()  # every process's runs, process-major
        first = self._local_rows(num_local).start
        experiences = [
            Experience(eid=EID(batch=self._generation_count, task=i // group_size, run=i % group_size, step=s),
                       tokens=torch.zeros(1, dtype=torch.long), prompt_length=0, reward=value)
            for i, (value, count) in enumerate(zip(rewards.tolist(), steps))
            if math.isfinite(value)
            for s in range(count)
        ]
        scored, metrics = self.advantage_fn(experiences)
        score = {(e.eid.task, e.eid.run, e.eid.step): float(e.advantages[0]) for e in scored}
        rows = []
        for j, run in enumerate(self._runs):
            i = first + j
            for s, step in enumerate(run.steps):
                key = (i // group_size, i % group_size, s)
                rows.append((j, s, step, score.get(key, 0.0), key in score))
        metrics.update({
            "multi_step/steps_per_run": sum(steps) / max(1, len(steps)),
            "multi_step/run_reward": float(torch.nan_to_num(rewards).mean()),
            "multi_step/prefix_preserving": sum(r.prefix_preserving for r in self._runs) / max(1, len(self._runs)),
            "unscorable_count": float((~torch.isfinite(rewards)).sum()),
        })
        self._log_metrics(mode, metrics)
        return self._step_batch(output, rows)

    def _step_batch(self, output: dict, rows: list[tuple[int, int, Any, float, bool]]) -> dict:
        """One row per step (and padding rows so the count splits evenly into micro-batches).

        ``rows``: ``(run index, step index, Step, advantage, trained)``. A run's last step is the row
        TRL already scored, so its old/reference log-probs are reused; other steps get one no-grad
        forward each for what the loss needs.
        """
        device = output["prompt_ids"].device
        spg = self.args.steps_per_generation
        padding = -len(rows) % spg
        pad_id = self._tokenizer.pad_token_id
        prompts = [torch.tensor(step.prompt_ids) for _, _, step, _, _ in rows] + [torch.tensor([pad_id])] * padding
        completions = [torch.tensor(step.completion_ids) for _, _, step, _, _ in rows] + [torch.tensor([pad_id])] * padding
        eos = set(self.eos_token_ids)
        finished = [not self.args.mask_truncated_completions or (bool(step.completion_ids) and step.completion_ids[-1] in eos)
                    for _, _, step, _, _ in rows]
        trained = [keep and done for (*_, keep), done in zip(rows, finished)] + [False] * padding
        batch: dict[str, Any] = {
            "prompt_ids": pad(prompts, padding_value=pad_id, padding_side="left").to(device),
            "prompt_mask": pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left").to(device),
            "completion_ids": pad(completions, padding_value=pad_id, padding_side="right").to(device),
            "advantages": torch.tensor([a for _, _, _, a, _ in rows] + [0.0] * padding, device=device),
            "sample_count": torch.tensor([1] * len(rows) + [0] * padding, device=device),
            "num_items_in_batch": output["num_items_in_batch"],
        }
        completion_mask = pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right").to(device)
        batch["completion_mask"] = completion_mask * torch.tensor(trained, device=device).unsqueeze(1).to(completion_mask.dtype)
        width = batch["completion_ids"].shape[1]
        is_last = [s == len(self._runs[j].steps) - 1 for j, s, *_ in rows] + [False] * padding
        if "sampling_per_token_logps" in output:  # the generation backend's log-probs, recorded per step
            sampling = torch.full((len(prompts), width), float("nan"), device=device)
            for r, (_, _, step, _, _) in enumerate(rows):
                if step.logprobs:
                    sampling[r, : len(step.logprobs)] = torch.tensor(step.logprobs, device=device)
            batch["sampling_per_token_logps"] = sampling
        for key in ("old_per_token_logps", "ref_per_token_logps"):
            if key not in output:
                continue
            values = torch.zeros((len(prompts), width), dtype=output[key].dtype, device=device)
            last_rows = [r for r, last in enumerate(is_last) if last]
            run_of = [rows[r][0] for r in last_rows]
            take = min(width, output[key].shape[1])
            values[last_rows, :take] = output[key][run_of, :take]
            others = [r for r, last in enumerate(is_last) if not last and r < len(rows)]
            if others:
                values[others] = self._step_logps(key, batch, others, width)
            batch[key] = values
        unknown = set(output) - set(batch) - {"tool_mask", "importance_sampling_ratio"}
        if unknown:
            raise ValueError(f"StepGRPOTrainer cannot expand batches with {sorted(unknown)}")
        return batch

    def _step_logps(self, key: str, batch: dict, rows: list[int], width: int) -> torch.Tensor:
        """Behaviour (``old``) or reference log-probs of the non-final step rows ``rows``."""
        subset = {k: batch[k][rows] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        if key == "old_per_token_logps":
            return self._forward_logps(self.model, subset)[:, :width]
        return self._reference_logps(subset)[:, :width]
