"""The rollout worker of `AsyncStepGRPOTrainer`: multi-step runs of reset/step environments or agents, each step a
sample.

`MultiStepWorker` is the transformers worker (`trinity_trl.asynchronous.worker`) whose group is ``num_generations``
runs of one task. It plays them with the rollout `StepGRPOTrainer` plays them with
(`trinity_trl.rollouts.MultiStepRollout` for reset/step environments, `trinity_trl.rollouts.AgentRollout` for agents
over the policy endpoint), over `WorkerGeneration` (the worker's own copy of the policy behind the rollouts'
generation interface); scores each run as `StepGRPOTrainer` does (the environment's or agent's reward first, then the
reward functions on the run's final turn; an unscorable run trains nothing); gives every step its run's score with
the trainer's step-wise advantage component; and queues one TRL ``RolloutSample`` per step: the step's prompt (the
conversation so far) and its completion, only the completion trained, with the log-probs it was sampled with.

A group is played between two weight loads, so all its steps carry one policy version. TRL's tree packing forwards the
prefix the steps of a run share once, so a run costs about one forward of its longest step, not the sum of its
steps' prompts.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Any

import numpy as np
import torch

from ..algorithms import EID, Experience
from ..data.loading import is_conversation, prompt_token_ids
from ..rollouts.agent import AgentRollout
from ..rollouts.multi_step import MultiStepRollout
from ..rollouts.protocols import RolloutContext
from ..rollouts.runs import Run, experience_info
from ..training.advantages import check_declared_step_rewards, weighted_rewards
from .async_grpo_seams import completion_sample
from .worker import TransformersRolloutWorker


class WorkerGeneration:
    """The rollouts' generation interface (`trinity_trl.rollouts.generation.Generator`) over a worker's copy of the
    policy: its chat template, its tokenizer and `TransformersRolloutWorker.generate_many`."""

    def __init__(self, worker: TransformersRolloutWorker):
        self.worker = worker
        self.tokenizer = worker.tokenizer
        self.eos_token_id = worker.tokenizer.eos_token_id  # what the chat template ends a turn with
        self.eos_token_ids = set(worker.eos_token_ids)

    def tokenize_conversations(self, conversations: list[list[dict[str, Any]]]) -> list[list[int]]:
        return prompt_token_ids(self.tokenizer, conversations, self.worker.chat_template_kwargs)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                **self.worker.chat_template_kwargs,
            )
        )

    def generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        return self.worker.generate_many(prompt_ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class MultiStepWorker(TransformersRolloutWorker):
    """`TransformersRolloutWorker` playing multi-step runs (see the module docs).

    Args:
        rollout: plays a group's runs (its generator is set to this worker's `WorkerGeneration`).
        advantage_fn: the trainer's step-wise advantage component (``step_wise_grpo``): experiences in, scored
            experiences and metrics out.
        Other arguments: as `TransformersRolloutWorker`; ``scorer`` supplies the reward functions and their weights
        (the environment's reward, `trinity_trl.rollouts.protocols.environment_reward`, first).
    """

    def __init__(self, *args: Any, rollout: MultiStepRollout | AgentRollout, advantage_fn: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.rollout = rollout
        self.advantage_fn = advantage_fn
        context = getattr(self.model.config, "max_position_embeddings", None)
        max_completion = self.generation_config.max_new_tokens
        rollout.start(
            RolloutContext(
                generation=WorkerGeneration(self),
                processing_class=self.tokenizer,
                tokenizer=self.tokenizer,
                chat_template_kwargs=self.chat_template_kwargs,
                max_context=None if context is None else context - max_completion,
                sampling={"temperature": self.temperature, "top_p": self.generation_config.top_p},
                max_completion_length=max_completion,
                # a recorded call's policy version counts optimizer steps, which the worker does not know (TRL's
                # model version counts weight syncs); the samples carry TRL's, which the trainer turns into steps
                policy_version=None,
            )
        )

    @contextlib.contextmanager
    def _agents_at_work(self):
        """While agents play, the worker is at work even when no token is generated: an agent's own time is bounded
        by ``agent_timeout`` (the rollout cancels it then), which may exceed TRL's ``heartbeat_stale_after_s``; so the
        heartbeat goes on, once a second, until the rollout returns. An environment's ``step`` has no such bound: a
        hanging one still stops the heartbeat and the run ends with one line."""
        if not isinstance(self.rollout, AgentRollout):
            yield
            return
        done = threading.Event()

        def beat() -> None:
            while not done.wait(1.0):
                self._beat()

        thread = threading.Thread(target=beat, name="trinity-agents-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    @property
    def _playing(self) -> str:
        """What the thread is in while a group plays (for a stall: an environment's ``reset`` / ``step`` has no time
        bound of its own; an agent's is ``agent_timeout``)."""
        if isinstance(self.rollout, AgentRollout):
            return "the group's agent runs"
        return "the group's environment runs (an environment's reset or step)"

    def step_advantages(self, runs: list[Run], rewards: torch.Tensor) -> tuple[list[list[float | None]], dict]:
        """Per run and step, its advantage (``None``: not trained, its run unscorable or its group filtered), and
        the component's metrics; as `StepGRPOTrainer` computes them for one task's group."""
        states = None
        if self.advantage_fn.needs_step_states:  # GiGPO: each step's state key and declared reward
            states = [run.step_states() for run in runs]
            check_declared_step_rewards(states, self.scorer.reward_func_names, self.scorer.reward_weights)
        experiences = [
            Experience(
                eid=EID(batch=0, task=0, run=i, step=s),
                reward=float(rewards[i]),
                info={} if states is None else experience_info(states[i][s]),
            )
            for i, run in enumerate(runs)
            if math.isfinite(float(rewards[i]))
            for s in range(len(run.steps))
        ]
        scored, metrics = self.advantage_fn(experiences)
        score = {(e.eid.run, e.eid.step): float(e.advantages) for e in scored}
        return [[score.get((i, s)) for s in range(len(run.steps))] for i, run in enumerate(runs)], metrics

    def rollout_groups(self, positions: list[int]) -> list[tuple[list[Any], dict[str, float]]]:
        """The ``num_generations`` runs of each task at ``positions``, played together (the rollout batches every
        run's next turn into one ``generate`` call): for each task, one ``RolloutSample`` per step, and metrics."""
        started = time.monotonic()
        rows = [dict(self.dataset[self.order.row(position)]) for position in positions]
        size = self.num_generations
        version = self.model_version
        with self._agents_at_work(), self._inside(self._playing):
            runs = self.rollout([dict(row) for row in rows for _ in range(size)])
        return [
            self._task_samples(
                position,
                row,
                runs[k * size : (k + 1) * size],
                version,
                started,
                rollout_metrics=None if k else self.rollout.metrics,
                played=len(runs),
            )
            for k, (position, row) in enumerate(zip(positions, rows))
        ]

    def _task_samples(
        self,
        position: int,
        row: dict,
        runs: list[Run],
        version: int,
        started: float,
        rollout_metrics: dict[str, float] | None,
        played: int,
    ) -> tuple[list[Any], dict[str, float]]:
        """One task's samples and metrics from its ``runs`` (scored here); ``rollout_metrics``: the rollout's own
        metrics of the call, over ``played`` runs."""
        size = self.num_generations
        prompt = row.get("prompt") or [{"role": "user", "content": ""}]
        conversational = is_conversation(prompt)
        last = [run.steps[-1] for run in runs]
        completions = [[{"role": "assistant", "content": s.text}] if conversational else s.text for s in last]
        columns = {k: [v] * size for k, v in row.items() if k not in ("prompt", "completion")}
        columns["env_reward"] = [run.reward for run in runs]
        per_func = self.scorer.rewards(
            [prompt] * size, completions, [s.completion_ids for s in last], columns, self._inside
        )
        rewards = weighted_rewards(per_func, self.scorer.reward_weights)
        advantages, advantage_metrics = self.step_advantages(runs, rewards)
        finite = rewards[torch.isfinite(rewards)]
        group_std = float(finite.std(unbiased=False)) if len(finite) else float("nan")
        samples = []
        for i, run in enumerate(runs):
            first_messages = max(0, len(run.messages) - 2 * (len(run.steps) - 1))  # each turn but the last added 2
            # an agent run's steps outside every segment (the stand-in step of a run that made no call) never train
            segments = None if run.segments is None else {s for segment in run.segments for s in segment}
            for s, step in enumerate(run.steps):
                advantage = advantages[i][s]
                trained = advantage is not None and (segments is None or s in segments)
                metrics = {}
                if s == len(run.steps) - 1:  # a run's reward once (TRL averages a metric over the samples carrying it)
                    metrics = {
                        "reward": float(rewards[i]),
                        "reward_std": group_std,
                        **{f"rewards/{n}": float(per_func[i, f]) for f, n in enumerate(self.scorer.reward_func_names)},
                    }
                samples.append(
                    completion_sample(
                        step.prompt_ids,
                        step.completion_ids,
                        step.logprobs or None,
                        trained=trained,
                        advantage=0.0 if advantage is None else advantage,
                        version=version,
                        group_id=position,
                        prompt=run.messages[: first_messages + 2 * s],
                        completion=[{"role": "assistant", "content": step.text}],
                        metrics=metrics,
                    )
                )
        # TRL reduces a (numerator, denominator) pair as a rate over its logging window and sums a "total" word
        metrics = {
            "rollout/generate_s": time.monotonic() - started,
            "rollout/completion_length": float(np.mean([len(s.completion_ids) for run in runs for s in run.steps])),
            "multi_step/steps_per_run": (float(sum(len(run.steps) for run in runs)), float(len(runs))),
            "multi_step/prefix_preserving": (float(sum(run.prefix_preserving for run in runs)), float(len(runs))),
            "multi_step/cut_runs_total": float(sum(run.cut for run in runs)),
            "unscorable_count": float(len(runs) - len(finite)),
            "frac_reward_zero_std": float(len(finite) > 1 and bool((finite == finite[0]).all())),
            **{k: float(v) for k, v in advantage_metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)},
        }
        # the rollout's own (an agent's faults) over the whole call, with its first task only: a mean over runs as a
        # rate, a count summed over the logging window
        for name, value in (rollout_metrics or {}).items():
            if name.endswith("_per_run"):
                metrics[name] = (float(value) * played, float(played))
            else:
                metrics[f"{name}_total"] = float(value)
        return samples, metrics
