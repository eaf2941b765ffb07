"""``StepGRPOTrainer``: multi-step agents, every turn its own sample, step-wise GRPO advantages.

For each task the trainer plays ``num_generations`` runs against an environment, then TRL scores the
runs, the rewards of every process are gathered, and ``step_wise_grpo`` normalises each run's reward
within its task group and gives the score to every step of the run (docs/algorithms/advantages.md#step-wise-grpo). Each
step then becomes a sample of the training batch (a whole prefix-preserving run in one row, see ``shared_prefix``).

Two environment protocols, told apart by what the environment class defines
(`trinity_trl.rollouts.protocols`):

* **TRL's tool environments** (``environment_factory`` and ``tools`` exactly as ``GRPOTrainer`` takes
  them): TRL plays the runs itself (its environment pool, ``reset``, chat template with the tool
  schemas, tool-call parsing, tool execution and errors, ``get_reward``), and every assistant turn of
  the resulting trajectory becomes a step (`trinity_trl.rollouts.trajectories`).
* **reset/step environments** (`trinity_trl.rollouts.Environment`): the turns are text;
  `trinity_trl.rollouts.MultiStepRollout` plays them over the trainer's generation backend,
  batching the next turn of every active run into one generation call.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from trl import GRPOTrainer
from trl.trainer.utils import pad

from ..algorithms import ADVANTAGE_FN, EID, Experience
from ..rollouts import MultiStepRollout
from ..rollouts.agent import AGENT_PROTOCOL, FAILURE_MODES, check_agent, check_agent_generation
from ..rollouts.multi_step import HISTORY_MODES, Run
from ..rollouts.protocols import TOOL_PROTOCOL, resolve_protocol
from ..rollouts.trajectories import run_from_trajectory
from ..training import checks
from ..training.engines import engine_of, zero_stage
from ..training.metrics import append_metrics
from ..training.trl_seams import bind_trl_arguments, skip_trl_reference_pass, temporarily
from .config import TrinityConfig, from_trl_config
from .spellings import component_argument_spelling
from .trinity import TrinityTrainer

STD_CAL_LEVELS = ("group", "batch", "none")


@dataclass
class StepGRPOConfig(TrinityConfig):
    r"""
    Configuration of [`StepGRPOTrainer`][] (preset `multi_step_grpo`: PPO-clip loss, `step_wise_grpo`
    advantages, k2 KL loss; any policy loss of the library can replace PPO).

    Parameters:
        max_env_steps (`int`, *optional*, defaults to `5`):
            Turns per run at most. With a TRL tool environment a turn that calls a tool is a turn, so TRL's
            `max_tool_calling_iterations` is `max_env_steps - 1` (set it only to that value, or leave it unset).
        history (`str`, *optional*, defaults to `"tokens"`):
            `"tokens"`: each turn's prompt is the previous prompt + the generated tokens + the
            observation's chat-template tokens (never re-tokenized). `"messages"`: the conversation is
            re-rendered by the chat template every turn. Only for reset/step environments: TRL's tool loop always
            extends the token history.
        enable_step_norm (`bool`, *optional*, defaults to `False`):
            Divide a run's advantage by its number of steps, so long runs do not weigh more.
        std_cal_level (`str`, *optional*, defaults to `"group"`):
            Standard deviation used to normalise run rewards: the task group's (`"group"`), the whole
            batch's (`"batch"`), or none (`"none"`: reward minus group mean).
        std_threshold (`float` or `None`, *optional*):
            Skip task groups whose reward std is at most this (and single-run groups); their steps get
            no gradient and are counted in `filtered_count`.
        advantage (`dict`, *optional*): the step-wise advantage and its arguments, e.g.
            `{"name": "step_wise_grpo", "epsilon": 1e-6}` (`epsilon`: added to the std).
        shared_prefix (`bool`, *optional*, defaults to `True`):
            When each turn's prompt is exactly the previous prompt + completion + observation (always with
            `history="tokens"`), train the whole run as ONE row: one forward pass over the run, each
            turn's tokens carrying that turn's advantage, behaviour and reference log-probs, and the
            loss aggregated per turn, so loss and gradients equal one-row-per-turn training while the
            cost grows linearly, not quadratically, with the number of turns. Runs whose history was
            rewritten, and sequence-level losses (`gspo`, `rec` with GSPO clipping, `ppo` with sequence
            masking), fall back to one row per turn.
        agent_timeout (`float`, *optional*, defaults to `300.0`):
            With `agent=`: seconds of its own time one agent run may take (time waiting for the policy's answers
            does not count); it is then cancelled, its later calls refused, and it is scored as `agent_on_failure`
            says.
        agent_on_failure (`str`, *optional*, defaults to `"zero"`):
            With `agent=`: a run whose agent raised, timed out or returned no number scores 0 (`"zero"`) or is left
            unscored, its steps without gradient (`"drop"`).
        agent_batch_window (`float`, *optional*, defaults to `0.05`):
            With `agent=`: seconds the endpoint waits after a request for the other running agents' requests before
            it generates them in one batch (it generates at once when every running agent waits).
    """

    removed_spellings = {
        **TrinityConfig.removed_spellings,
        "advantage_epsilon": component_argument_spelling("advantage", "epsilon"),
    }

    algorithm: str = field(default="multi_step_grpo", metadata={"help": "Algorithm preset."})
    max_env_steps: int = field(default=5, metadata={"help": "Turns per run at most."})
    history: str = field(default="tokens", metadata={"help": "'tokens' or 'messages' (see docs)."})
    enable_step_norm: bool = field(default=False, metadata={"help": "Divide a run's advantage by its step count."})
    std_cal_level: str = field(default="group", metadata={"help": "'group', 'batch' or 'none'."})
    std_threshold: float | None = field(default=None, metadata={"help": "Skip groups with std <= threshold."})
    shared_prefix: bool = field(
        default=True,
        metadata={
            "help": "Train a run whose every prompt extends the previous turn in ONE row (one forward over the "
            "whole run) instead of one row per step; same loss and gradients."
        },
    )

    agent_timeout: float = field(default=300.0, metadata={"help": "Seconds one agent run may take (agent=)."})
    agent_on_failure: str = field(default="zero", metadata={"help": "'zero' or 'drop': a failed agent run's score."})
    agent_batch_window: float = field(
        default=0.05, metadata={"help": "Seconds the endpoint collects agents' requests into one batch (agent=)."}
    )

    def __post_init__(self):
        if not self.agent_timeout > 0:
            raise ValueError(f"agent_timeout must be > 0 seconds, got {self.agent_timeout}")
        if self.agent_on_failure not in FAILURE_MODES:
            raise ValueError(f"agent_on_failure must be one of {FAILURE_MODES}, got {self.agent_on_failure!r}")
        if self.agent_batch_window < 0:
            raise ValueError(f"agent_batch_window must be >= 0 seconds, got {self.agent_batch_window}")
        if self.max_env_steps < 1:
            raise ValueError(f"max_env_steps must be >= 1, got {self.max_env_steps}")
        if self.history not in HISTORY_MODES:
            raise ValueError(f"history must be one of {HISTORY_MODES}, got {self.history!r}")
        if self.std_cal_level not in STD_CAL_LEVELS:
            raise ValueError(f"std_cal_level must be one of {STD_CAL_LEVELS}, got {self.std_cal_level!r}")
        # one limit on turns for both protocols: TRL's tool loop counts tool-calling iterations (turns - 1)
        if self.max_tool_calling_iterations is None:
            self.max_tool_calling_iterations = self.max_env_steps - 1
        elif self.max_tool_calling_iterations != self.max_env_steps - 1:
            raise ValueError(
                f"StepGRPOConfig counts turns with max_env_steps (= max_tool_calling_iterations + 1); got "
                f"max_tool_calling_iterations={self.max_tool_calling_iterations} "
                f"with max_env_steps={self.max_env_steps}: "
                f"set max_env_steps={self.max_tool_calling_iterations + 1} and leave max_tool_calling_iterations unset"
            )
        super().__post_init__()

    def _user_overrides(self) -> dict[str, Any]:
        advantage = self.component_name("advantage") or "step_wise_grpo"
        if not ADVANTAGE_FN.get(advantage).step_wise:
            raise ValueError(
                f"StepGRPOConfig needs a step-wise advantage function such as 'step_wise_grpo' (it scores "
                f"runs and gives each step its run's score), got advantage={advantage!r}"
            )
        args = {
            "enable_step_norm": self.enable_step_norm,
            "std_cal_level": self.std_cal_level,
            "std_threshold": self.std_threshold,
        }
        return {"advantage_fn": advantage, "advantage_fn_args": args}


def environment_reward(completions, env_reward, **kwargs) -> list[float | None]:
    """The reward a reset/step environment returned with each run's last step (``None`` where it could not
    score the run, or returned a non-finite number: TRL's convention, so the run is unscorable rather than rewarded 0,
    and kept out of the logged means)."""
    return [None if reward is None or not math.isfinite(reward) else reward for reward in env_reward]


class StepGRPOTrainer(TrinityTrainer):
    """Multi-step agent training with step-wise GRPO (see [`StepGRPOConfig`][]).

    Args:
        environment_factory: builds one environment per run; or a dict of factories, each dataset row
            choosing one by its `environment` column (TRL's contract). The protocol is read from the class
            (`trinity_trl.rollouts.protocols`): a TRL tool environment (`reset(**row) -> str | None`,
            public methods as tools, optional `get_reward()`), or a reset/step
            `trinity_trl.rollouts.Environment`. A class that fits neither is rejected here, naming
            what it lacks. Each dataset row is a task (its columns are passed to `reset`); with
            `train_dataset=None` the environment owns the data and `max_steps` sets the length.
        tools: standalone tools (callables), as for TRL's `GRPOTrainer`; with a tool environment or alone.
        agent: instead of an environment, `async def agent(client, row) -> reward` (or `(reward, info)`): a program
            that calls the policy through `client`, an `openai.AsyncOpenAI` pointed at an OpenAI-compatible endpoint
            the trainer serves on loopback; every model call is a step, trained on the token ids it sampled
            (`trinity_trl.rollouts.agent`, the `agents` extra). Options: `agent_timeout`, `agent_on_failure`,
            `agent_batch_window`; `max_env_steps` bounds the calls of a run.
        reward_funcs: reward functions scoring each run (TRL passes them the whole conversation of a tool run,
            or the final turn of a reset/step run). A reset/step environment's last-step reward is always the
            first reward (`environment_reward`); a tool environment's `get_reward()` is added by TRL.
        Other arguments: as [`TrinityTrainer`][] (no `rollout_func`: the environment loop is the rollout).
    """

    _name = "Step-wise GRPO"
    config_class = StepGRPOConfig
    requires_prompt = False  # a task's prompt may come from reset()

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: StepGRPOConfig | None = None,
        *pos,
        environment_factory=None,
        tools=None,
        teacher_model=None,
        agent=None,
        **kwargs,
    ):
        args = from_trl_config(args, StepGRPOConfig, "StepGRPOTrainer")  # a plain GRPOConfig is converted
        given = bind_trl_arguments(GRPOTrainer, model, reward_funcs, args, *pos, **kwargs)
        if given.get("rollout_func") is not None:
            raise ValueError("StepGRPOTrainer plays the environment itself; rollout_func cannot be combined with it")
        given["teacher_model"] = teacher_model
        train_dataset = given.get("train_dataset")
        columns = ["prompt"] if train_dataset is None else getattr(train_dataset, "column_names", None)
        if agent is not None:  # an agent over the policy endpoint (trinity_trl.rollouts.agent)
            if environment_factory is not None or tools:
                raise ValueError(
                    "agent= plays its own environment: pass agent= alone, without environment_factory/tools"
                )
            if train_dataset is None:
                raise ValueError("agent= needs a train_dataset: each row is one task, passed to the agent as `row`")
            check_agent(agent)
            if args is not None:
                check_agent_generation(args.use_vllm, args.vllm_mode, args.vllm_tensor_parallel_size)
            protocol, classes = AGENT_PROTOCOL, {None: type(agent)}
        else:
            protocol, classes = resolve_protocol(environment_factory, tools, columns)
        self.environment_protocol = protocol
        environment_names = sorted(
            {
                getattr(agent, "__qualname__", cls.__qualname__) if agent else cls.__qualname__
                for cls in classes.values()
            }
        )
        extra = (
            []
            if reward_funcs is None
            else (list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])
        )
        if protocol == TOOL_PROTOCOL:
            if args is not None and args.history != "tokens":
                raise ValueError(
                    "history='messages' is for reset/step environments; TRL's tool loop always extends "
                    "the token history (set history='tokens')"
                )
            # TRL sets up the environments (pool, tools, get_reward, response parsing, chat template)
            super().__init__(
                **(given | {"reward_funcs": extra or None, "environment_factory": environment_factory, "tools": tools})
            )
            self.rollout = None
        else:
            if train_dataset is None:
                given["train_dataset"] = self._placeholder_tasks(args, environment_factory)
            super().__init__(**(given | {"reward_funcs": [environment_reward, *extra]}))
            self.rollout = (
                self._agent_rollout(agent)
                if agent is not None
                else MultiStepRollout(self.generation, environment_factory, self.args.max_env_steps, self.args.history)
            )
        self.model_card.environment = ", ".join(environment_names) or None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            raise ValueError(
                "StepGRPOTrainer does not support vllm_importance_sampling_correction yet (TRL computes the ratio for "
                "whole completions, not turns); set vllm_importance_sampling_correction=False"
            )
        # reference log-probs are computed here for every row (step or run); TRL's pass over the final
        # turns would be redone (the reference model itself stays loaded)
        skip_trl_reference_pass(self)

    def _agent_rollout(self, agent):
        """The policy endpoint and the rollout that plays ``agent`` over it (`trinity_trl.rollouts.agent`)."""
        from ..rollouts.agent import AgentRollout
        from ..rollouts.endpoint import ChatRenderer, PolicyEndpoint

        args = self.args
        engine = engine_of(self.accelerator)
        if engine == "fsdp" or (engine == "deepspeed" and zero_stage(self.accelerator) == 3):
            # each process serves its own runs and generates when its agents ask, a number of times that differs
            # between processes; ZeRO-3 and FSDP gather the sharded weights in every forward of generate, so all
            # processes must generate in lockstep (DDP and ZeRO-1/2 keep whole weights: each generates alone)
            raise NotImplementedError(
                f"agent= cannot run under {'FSDP' if engine == 'fsdp' else 'DeepSpeed ZeRO-3'}: its generation needs "
                "every process to generate in lockstep, while each process answers its own agents when they ask; use "
                "DDP or ZeRO-1/2 (docs/environments.md#agent-limits)"
            )
        context = getattr(self.model.config, "max_position_embeddings", None)
        if self.use_vllm and args.vllm_max_model_length is not None:  # vLLM fails on a longer prompt + completion
            context = args.vllm_max_model_length if context is None else min(context, args.vllm_max_model_length)
        endpoint = PolicyEndpoint(
            self.generation,
            ChatRenderer(self.processing_class, self.chat_template, self.chat_template_kwargs),
            max_context=None if context is None else context - args.max_completion_length,
            max_calls=args.max_env_steps,
            sampling={"temperature": args.temperature, "top_p": args.top_p},
            token_history=args.history == "tokens",
        )
        return AgentRollout(
            endpoint,
            agent,
            timeout=args.agent_timeout,
            on_failure=args.agent_on_failure,
            batch_window=args.agent_batch_window,
            empty_prompt=[self._tokenizer.pad_token_id],
        )

    @property
    def agent_runs(self):
        """With ``agent=``: the runs of the last generation, as played and trained
        (`trinity_trl.rollouts.agent.RecordedRun`: the row, the reward, and each model call's prompt ids,
        completion ids and sampling log-probs); read it from a callback's ``on_step_end``."""
        if self.environment_protocol != AGENT_PROTOCOL:
            raise AttributeError("agent_runs exists only for StepGRPOTrainer(agent=...)")
        return self.rollout.recorded

    @staticmethod
    def _placeholder_tasks(args, environment_factory):
        """``train_dataset=None`` with a reset/step environment: rows of empty prompts that drive the loop
        while ``reset`` supplies each task, the same placeholder TRL builds for its own environments."""
        from datasets import Dataset

        if isinstance(environment_factory, dict):
            raise ValueError(
                "a dict environment_factory routes rows by their 'environment' column: it needs a "
                "train_dataset with that column"
            )
        if args is None or args.max_steps <= 0:
            raise ValueError(
                "train_dataset=None (the environment owns the data) needs max_steps > 0 to set the training length"
            )
        return Dataset.from_dict(
            {"prompt": [[{"role": "user", "content": ""}]] * (args.generation_batch_size // args.num_generations)}
        )

    # ------------------------------------------------------------------------------ rollout
    def _generate_and_score_completions(self, inputs):
        if self.environment_protocol == TOOL_PROTOCOL:
            # TRL plays the tool loop. Its mask_truncated_completions would zero the whole trajectory (and the
            # turn boundaries in its tool_mask) when the last turn is cut off; here each step is masked on its
            # own in _step_batch, so TRL's whole-run masking is off during its call (trl_seams.temporarily)
            with temporarily(self, mask_truncated_completions=False):
                return super()._generate_and_score_completions(inputs)
        rows = [dict(row) for row in inputs]
        # TRL reads x["prompt"] before calling the rollout; tasks may get their whole prompt from reset()
        for row in inputs:
            row.setdefault("prompt", [{"role": "user", "content": ""}])
        # TRL's rollout_func receives only the prompts; the environments need the whole rows (trl_seams)
        with temporarily(self, rollout_func=checks.checked_rollout_func(functools.partial(self._play, rows))):
            return super()._generate_and_score_completions(inputs)

    def _play(self, rows: list[dict[str, Any]], prompts, trainer) -> dict[str, list]:
        """TRL's ``rollout_func`` for one batch: play every run and report each run's final turn (which
        TRL scores); the runs come back to `_training_batch` as the rows' ``run`` field."""
        runs = self.rollout(rows)
        if getattr(self.rollout, "metrics", None):  # the agent rollout's fault counters (agent/...)
            append_metrics(
                self._metrics["train" if self.model.training else "eval"], self._all_processes(self.rollout.metrics)
            )
        last = [run.steps[-1] for run in runs]
        logprobs = [s.logprobs for s in last]
        return {
            "prompt_ids": [s.prompt_ids for s in last],
            "completion_ids": [s.completion_ids for s in last],
            "logprobs": None if any(lp is None for lp in logprobs) else logprobs,
            "env_reward": [run.reward for run in runs],
            "run": runs,
        }

    def _all_processes(self, metrics: dict[str, float]) -> dict[str, float]:
        """The agent rollout's metrics over every process: counts summed, per-run means averaged (every process plays
        the same number of runs)."""
        if self.accelerator.num_processes == 1:
            return metrics
        names = sorted(metrics)
        values = self.accelerator.gather(
            torch.tensor([[metrics[n] for n in names]], dtype=torch.float64, device=self.accelerator.device)
        )
        return {
            n: float(values[:, i].mean() if n.endswith("_per_run") else values[:, i].sum()) for i, n in enumerate(names)
        }

    # --------------------------------------------------------------------------- advantages
    def _tool_runs(self, output: dict) -> list[Run]:
        """This process's runs of TRL's tool loop, one step per assistant turn
        (`trinity_trl.rollouts.trajectories`): the padded prompt / completion / tool-mask rows of TRL's output,
        back to the token lists it generated."""
        prompt_lengths = output["prompt_mask"].sum(1).tolist()
        completion_lengths = output["completion_mask"].sum(1).tolist()  # unmasked: see _generate_and_score_completions
        tool_mask = output.get("tool_mask")
        sampled = output.get("sampling_per_token_logps")
        runs = []
        for i, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
            prompt = output["prompt_ids"][i, output["prompt_ids"].size(1) - p :].tolist()
            completion = output["completion_ids"][i, :c].tolist()
            mask = [1] * c if tool_mask is None else tool_mask[i, :c].tolist()
            logps = None if sampled is None else sampled[i, :c].tolist()
            runs.append(run_from_trajectory(prompt, completion, mask, logps))
        return runs

    def _final_turns(self, runs: list[Run]) -> list[str]:
        """How each tool run ended, its last turn parsed as TRL parses turns (``parse_response``): ``"answer"`` (no
        tool call), ``"tool_call"`` (still calling a tool: stopped by ``max_env_steps`` or ``max_completion_length``)
        or ``"malformed"`` (the response template's tool-call opener is there but TRL's parser found no valid call,
        so TRL took the turn as the final answer: the run ends there, scored as it is)."""
        from trl.chat_template_utils import parse_response

        template = getattr(self._tokenizer, "response_template", None)
        if template is None and getattr(self._tokenizer, "response_schema", None) is None:
            return ["answer"] * len(runs)
        field = (template or {}).get("fields", {}).get("tool_calls", {})
        opener = field.get("open_pattern") or (re.escape(field["open"]) if field.get("open") else None)
        endings = []
        for run in runs:
            last = run.steps[-1]
            if parse_response(self._tokenizer, last.completion_ids, prefix=last.prompt_ids, tools=self.tools).get(
                "tool_calls"
            ):
                endings.append("tool_call")
            elif opener is not None and re.search(opener, self._tokenizer.decode(last.completion_ids)):
                endings.append("malformed")
            else:
                endings.append("answer")
        return endings

    def _training_batch(self, output: dict, inputs: list[dict], rewards: torch.Tensor, mode: str) -> dict:
        malformed = 0
        if self.environment_protocol == TOOL_PROTOCOL:
            runs = self._tool_runs(output)
            endings = self._final_turns(runs)
            for run, ending, reward in zip(runs, endings, rewards[self._local_rows(len(runs))].tolist()):
                run.cut, run.reward = ending == "tool_call", reward
            malformed = endings.count("malformed")
        else:
            runs = [row["run"] for row in inputs]
        group_size = self._group_size(mode)
        device = output["prompt_ids"].device
        steps = self.accelerator.gather(torch.tensor([len(run.steps) for run in runs], device=device)).cpu().tolist()
        first = self._local_rows(len(runs)).start
        experiences = [
            Experience(
                eid=EID(batch=self._generation_count, task=i // group_size, run=i % group_size, step=s), reward=value
            )
            for i, (value, count) in enumerate(zip(rewards.tolist(), steps))
            if math.isfinite(value)
            for s in range(count)
        ]
        scored, metrics = self.components.advantage_fn(experiences)
        score = {(e.eid.task, e.eid.run, e.eid.step): float(e.advantages) for e in scored}
        # per run and step: the step's advantage, or None if its group was filtered / unscored
        advantages = [
            [score.get(((first + j) // group_size, (first + j) % group_size, s)) for s in range(len(run.steps))]
            for j, run in enumerate(runs)
        ]
        metrics.update(
            {
                "multi_step/steps_per_run": sum(steps) / max(1, len(steps)),
                "multi_step/run_reward": float(rewards.nanmean()) if torch.isfinite(rewards).any() else 0.0,
                "multi_step/prefix_preserving": sum(r.prefix_preserving for r in runs) / max(1, len(runs)),
                # runs the turn limit stopped before the environment (or a final answer) ended them
                "multi_step/cut_runs": float(
                    self.accelerator.gather(torch.tensor(sum(r.cut for r in runs), device=device)).sum()
                ),
                # tool runs whose last turn was a tool call TRL could not parse (taken as the final answer)
                "multi_step/malformed_tool_calls": float(
                    self.accelerator.gather(torch.tensor(malformed, device=device)).sum()
                ),
                "unscorable_count": float((~torch.isfinite(rewards)).sum()),
            }
        )
        # TRL's completions table lists one row per run (its final turn): show that turn's advantage
        final = [scores[-1] if scores[-1] is not None else 0.0 for scores in advantages]
        self._show_advantages_in_completions_table(torch.tensor(final, device=device), output["completion_mask"])
        batch = self._step_batch(output, runs, advantages)
        metrics["multi_step/rows_per_run"] = batch["sample_count"].bool().sum().item() / max(1, len(runs))
        append_metrics(self._metrics[mode], metrics)
        return batch

    def _step_batch(self, output: dict, runs: list[Run], advantages: list[list[float | None]]) -> dict:
        """The training rows of this process's runs: a whole run per row when it is prefix-preserving
        and ``shared_prefix`` is on, else one row per step; then padding rows so the count splits
        evenly into micro-batches. Per token: ``segment_ids`` (the step a trained token belongs to,
        -1 elsewhere), ``advantages``; per row: ``sample_count`` (steps trained in it).
        """
        device = output["prompt_ids"].device
        eos = set(self.eos_token_ids)
        shared = self.args.shared_prefix and not self.components.policy_loss.sequence_level
        prompts, completions, segments, token_adv, samples, widths, sampling = [], [], [], [], [], [], []
        for run, scores in zip(runs, advantages):
            trained = [
                score is not None
                and (
                    not self.args.mask_truncated_completions
                    or (bool(step.completion_ids) and step.completion_ids[-1] in eos)
                )
                for step, score in zip(run.steps, scores)
            ]
            if run.segments is not None:  # an agent run: its segments (none when it made no call)
                groups = run.segments if shared else [[s] for segment in run.segments for s in segment]
            else:
                groups = (
                    [list(range(len(run.steps)))]
                    if shared and run.prefix_preserving
                    else [[s] for s in range(len(run.steps))]
                )
            for group in groups:
                first, last = run.steps[group[0]], run.steps[group[-1]]
                completion = last.prompt_ids[len(first.prompt_ids) :] + last.completion_ids
                segment, adv, logps = [-1] * len(completion), [0.0] * len(completion), [float("nan")] * len(completion)
                for s in group:
                    step = run.steps[s]
                    start = len(step.prompt_ids) - len(first.prompt_ids)
                    span = slice(start, start + len(step.completion_ids))
                    if step.logprobs:
                        logps[span] = step.logprobs
                    if trained[s]:
                        segment[span] = [s] * len(step.completion_ids)
                        adv[span] = [scores[s]] * len(step.completion_ids)
                prompts.append(first.prompt_ids)
                completions.append(completion)
                segments.append(segment)
                token_adv.append(adv)
                sampling.append(logps)
                samples.append(sum(trained[s] for s in group))
                widths.append(max(len(run.steps[s].completion_ids) for s in group))
        padding = -len(prompts) % self.args.steps_per_generation or (0 if prompts else self.args.steps_per_generation)
        pad_id = self._tokenizer.pad_token_id
        prompts += [[pad_id]] * padding
        completions += [[pad_id]] * padding
        segments += [[-1]] * padding
        token_adv += [[0.0]] * padding
        sampling += [[float("nan")]] * padding
        samples += [0] * padding
        widths += [1] * padding

        def padded(rows, value, side, dtype=torch.long):
            return pad([torch.tensor(r, dtype=dtype) for r in rows], padding_value=value, padding_side=side).to(device)

        segment_ids = padded(segments, -1, "right")
        batch: dict[str, Any] = {
            "prompt_ids": padded(prompts, pad_id, "left"),
            "prompt_mask": padded([[1] * len(p) for p in prompts], 0, "left"),
            "completion_ids": padded(completions, pad_id, "right"),
            "completion_mask": padded([[1] * len(c) for c in completions], 0, "right"),
            "tool_mask": (segment_ids >= 0).long(),
            "segment_ids": segment_ids,
            "advantages": padded(token_adv, 0.0, "right", torch.float32),
            "sample_count": torch.tensor(samples, device=device),
            "step_width": torch.tensor(widths, device=device),
            "num_items_in_batch": output["num_items_in_batch"],
        }
        if "sampling_per_token_logps" in output:
            batch["sampling_per_token_logps"] = padded(sampling, float("nan"), "right", torch.float32)
        rows = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        if "old_per_token_logps" in output:  # TRL needs behaviour log-probs (off-policy steps): all rows
            batch["old_per_token_logps"] = self.scoring.policy_logps(rows)
        if self.algorithm.needs_reference:
            batch["ref_per_token_logps"] = self.scoring.reference_logps(rows)
        unknown = set(output) - set(batch) - {"ref_per_token_logps", "importance_sampling_ratio"}
        if unknown:
            raise ValueError(f"StepGRPOTrainer cannot expand batches with {sorted(unknown)}")
        return batch
