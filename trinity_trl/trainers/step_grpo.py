"""``StepGRPOTrainer``: multi-step agents, every turn its own sample, step-wise GRPO advantages.

For each task the trainer plays ``num_generations`` runs against an environment, then TRL scores the
runs, the rewards of every process are gathered, and ``step_wise_grpo`` normalises each run's reward
within its task group and gives the score to every step of the run (docs/algorithms/advantages.md#step-wise-grpo). Each
step then becomes a sample of the training batch (a whole prefix-preserving run in one row, see ``shared_prefix``).

The runs come from one `trinity_trl.rollouts.Rollout` (docs/environments.md#rollouts), which returns them whole;
the trainer lays them out as `trinity_trl.rollouts.TrainingRow`s and never asks which kind of environment it plays:

* **TRL's tool environments** (``environment_factory`` and ``tools`` exactly as ``GRPOTrainer`` takes
  them): TRL plays the runs itself (its environment pool, ``reset``, chat template with the tool
  schemas, tool-call parsing, tool execution and errors, ``get_reward``), and `trinity_trl.rollouts.ToolRollout`
  splits every trajectory back into one step per assistant turn (`trinity_trl.rollouts.trajectories`).
* **reset/step environments** (`trinity_trl.rollouts.Environment`): the turns are text;
  `trinity_trl.rollouts.MultiStepRollout` plays them over the trainer's generation backend,
  batching the next turn of every active run into one generation call.
* **agents** (``agent=``): `trinity_trl.rollouts.AgentRollout` serves the policy on loopback to the agent's client
  (OpenAI chat completions or Responses, Anthropic Messages); each model call is a step.
* **a rollout of one's own** (``rollout=``): any object following `trinity_trl.rollouts.Rollout`.

Which of the first two an ``environment_factory`` follows is read from its class (`trinity_trl.rollouts.protocols`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from trl import GRPOTrainer
from trl.trainer.utils import pad

from ..algorithms import ADVANTAGE_FN, EID, Experience
from ..algorithms.component import Component, argument_types
from ..rollouts.agent import FAILURE_MODES, AgentRollout, check_agent, check_agent_generation
from ..rollouts.choice import environment_rollout
from ..rollouts.multi_step import HISTORY_MODES
from ..rollouts.protocols import (
    Rollout,
    RolloutContext,
    check_rollout,
    environment_reward,  # noqa: F401 (its home until issue 37; imported from here)
)
from ..rollouts.runs import Run, StepState, TrainingRow, experience_info
from ..training import checks
from ..training.advantages import check_declared_step_rewards
from ..training.engines import engine_of, zero_stage
from ..training.metrics import append_metrics
from ..training.trl_seams import bind_trl_arguments, skip_trl_reference_pass, temporarily
from .config import TrinityConfig, from_trl_config, preset_component
from .spellings import component_argument_spelling
from .trinity import TrinityTrainer

STD_CAL_LEVELS = ("group", "batch", "none")
#: the fields of `StepWiseFields` that are arguments of step-wise GRPO's advantage
STEP_WISE_GRPO_OPTIONS = ("enable_step_norm", "std_cal_level", "std_threshold")


@dataclass
class StepWiseFields:
    """Step-wise GRPO's own fields and checks, shared by [`StepGRPOConfig`][] and the asynchronous
    [`AsyncStepGRPOConfig`][trinity_trl.trainers.async_algorithms.AsyncStepGRPOConfig]: the preset, the turn limit,
    how the history grows, the step-wise advantage's arguments (passed to it under the same names) and the options of
    ``agent=`` runs."""

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
    agent_timeout: float = field(default=300.0, metadata={"help": "Seconds one agent run may take (agent=)."})
    agent_on_failure: str = field(default="zero", metadata={"help": "'zero' or 'drop': a failed agent run's score."})
    agent_batch_window: float = field(
        default=0.05, metadata={"help": "Seconds the endpoint collects agents' requests into one batch (agent=)."}
    )

    def check_step_fields(self) -> None:
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

    def _implied_components(self) -> dict[str, Component]:
        preset = preset_component(self.algorithm, "advantage").name  # gigpo's; step_wise_grpo for other presets
        advantage = self.component_name("advantage") or (
            preset if ADVANTAGE_FN.get(preset).step_wise else "step_wise_grpo"
        )
        cls = ADVANTAGE_FN.get(advantage)
        if not cls.step_wise:
            raise ValueError(
                f"{type(self).__name__} needs a step-wise advantage function such as 'step_wise_grpo' or 'gigpo' (it "
                f"scores runs and the steps in them), got advantage={advantage!r}"
            )
        # the step-wise GRPO options: passed to an advantage that takes them, refused when set for one that does not
        defaults = {f.name: f.default for f in fields(StepWiseFields)}
        takes = argument_types(cls)
        implied = {}
        for name in STEP_WISE_GRPO_OPTIONS:
            value = getattr(self, name)
            if name in takes:
                implied[name] = value
            elif value != defaults[name]:
                raise ValueError(
                    f"{name}={value!r} is an option of the step_wise_grpo advantage; {advantage!r} does not take it "
                    f"(leave it at {defaults[name]!r}; its own arguments: {', '.join(takes)})"
                )
        return {"advantage": Component(advantage, **implied)}


@dataclass
class StepGRPOConfig(StepWiseFields, TrinityConfig):
    r"""
    Configuration of [`StepGRPOTrainer`][] (preset `multi_step_grpo`: PPO-clip loss, `step_wise_grpo`
    advantages; no KL term unless `kl_loss` names one, e.g. the preset's `k2`; any policy loss of the library can
    replace PPO). `algorithm="gigpo"` trains with GiGPO's advantage instead (docs/trainers/step-grpo.md#gigpo; its
    arguments in `advantage`, e.g. `{"omega": 0.5}`).

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
            Divide a run's advantage by its number of steps, so long runs do not weigh more (step-wise GRPO only, as
            the next two: refused with `gigpo`).
        std_cal_level (`str`, *optional*, defaults to `"group"`):
            Standard deviation used to normalise run rewards: the task group's (`"group"`), the whole
            batch's (`"batch"`), or none (`"none"`: reward minus group mean).
        std_threshold (`float` or `None`, *optional*):
            Skip task groups whose reward std is at most this (and single-run groups); their steps get
            no gradient and are counted in `filtered_count`.
        advantage (`dict`, *optional*): the step-wise advantage and its arguments, e.g.
            `{"name": "step_wise_grpo", "epsilon": 1e-6}` (`epsilon`: added to the std) or
            `{"name": "gigpo", "omega": 1.0, "gamma": 1.0, "fnorm": "none"}`.
        shared_prefix (`bool`, *optional*, defaults to `True`):
            When each turn's prompt is exactly the previous prompt + completion + observation (always with
            `history="tokens"`), train the whole run as ONE row: one forward pass over the run, each
            turn's tokens carrying that turn's advantage, behaviour and reference log-probs, and the
            loss aggregated per turn, so loss and gradients equal one-row-per-turn training while the
            cost grows linearly, not quadratically, with the number of turns. Runs whose history was
            rewritten, and sequence-level losses (`gspo`, `rec` with GSPO clipping, `ppo` with sequence
            masking), fall back to one row per turn.
        agent_timeout (`float`, *optional*, defaults to `300.0`):
            With `agent=` only (this and the other two `agent_*` options, set without `agent=`, are refused when
            the trainer is built): seconds of its own time one agent run may take (time waiting for the policy's answers
            does not count); it is then cancelled, its later calls refused, and it is scored as `agent_on_failure`
            says.
        agent_on_failure (`str`, *optional*, defaults to `"zero"`):
            With `agent=`: a run whose agent raised, timed out or returned no number scores 0 (`"zero"`) or is left
            unscored, its steps without gradient (`"drop"`).
        agent_batch_window (`float`, *optional*, defaults to `0.05`):
            With `agent=`: seconds the endpoint waits after a request for the other running agents' requests before
            it generates them in one batch (it generates at once when every running agent waits).
    """

    shared_prefix: bool = field(
        default=True,
        metadata={
            "help": "Train a run whose every prompt extends the previous turn in ONE row (one forward over the "
            "whole run) instead of one row per step; same loss and gradients."
        },
    )

    def __post_init__(self):
        self.check_step_fields()
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


#: the options of `StepWiseFields` that only ``agent=`` reads
AGENT_OPTIONS = ("agent_timeout", "agent_on_failure", "agent_batch_window")


def agent_options_set(config: StepWiseFields | type[StepWiseFields]) -> list[str]:
    """The `AGENT_OPTIONS` that ``config`` (a config or a config class: its defaults) sets to something other than
    their defaults."""
    defaults = {f.name: f.default for f in fields(StepWiseFields)}
    return [name for name in AGENT_OPTIONS if getattr(config, name) != defaults[name]]


def check_agent_options(config: StepWiseFields | type[StepWiseFields], agent: Any) -> None:
    """One line when ``agent_*`` options are set without ``agent=``."""
    if agent is None and (unused := agent_options_set(config)):
        raise ValueError(
            f"{', '.join(unused)} set, but there is no agent=: the agent_* options apply to agent= runs only "
            "(leave them at their defaults)"
        )


def agent_rollout(agent: Any, config: Any, train_dataset: Any, with_environment: bool) -> AgentRollout:
    """The rollout of ``agent=`` with ``config``'s ``agent_*`` options, ``max_env_steps`` and ``history`` (a config or
    a config class: its defaults); one line when an environment is given too (``with_environment``), there is no
    dataset, or the agent is not an ``async def agent(client, row)``."""
    if with_environment:
        raise ValueError("agent= plays its own environment: pass agent= alone, without environment_factory/tools")
    if train_dataset is None:
        raise ValueError("agent= needs a train_dataset: each row is one task, passed to the agent as `row`")
    check_agent(agent)
    return AgentRollout(
        None,
        agent,
        timeout=config.agent_timeout,
        on_failure=config.agent_on_failure,
        batch_window=config.agent_batch_window,
        max_env_steps=config.max_env_steps,
        history=config.history,
    )


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
            that calls the policy through `client`, pointed at an endpoint the trainer serves on loopback: an
            `openai.AsyncOpenAI` (chat completions, Responses), or what the parameter's annotation asks for
            (`anthropic.AsyncAnthropic`, `trinity_trl.rollouts.agent.PolicyAccess`); every model call is a step,
            trained on the token ids it sampled (`trinity_trl.rollouts.agent`, the `agents` extra). Options:
            `agent_timeout`, `agent_on_failure`, `agent_batch_window`; `max_env_steps` bounds the calls of a run.
        rollout: instead of the above, a `trinity_trl.rollouts.Rollout` of one's own (a kind of environment the
            library does not know; docs/environments.md#rollouts). Its `max_env_steps` and `history` must equal the
            config's.
        reward_funcs: reward functions scoring each run (TRL passes them the whole conversation of a tool run,
            or the final turn of a reset/step run). A reset/step environment's last-step reward (an agent's return
            value) is always the first reward (`environment_reward`); a tool environment's `get_reward()` is added by
            TRL.
        Other arguments: as [`TrinityTrainer`][] (no `rollout_func`: the environment loop is the rollout).
    """

    _name = "Step-wise GRPO"
    config_class = StepGRPOConfig
    requires_prompt = False  # a task's prompt may come from reset()
    plays_runs = True  # each step's state recorded (GiGPO)
    rollouts_add_reward_inputs = True  # env_reward, from the runs

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
        rollout=None,
        **kwargs,
    ):
        args = from_trl_config(args, StepGRPOConfig, "StepGRPOTrainer")  # a plain GRPOConfig is converted
        given = bind_trl_arguments(GRPOTrainer, model, reward_funcs, args, *pos, **kwargs)
        if given.get("rollout_func") is not None:
            raise ValueError("StepGRPOTrainer plays the environment itself; rollout_func cannot be combined with it")
        given["teacher_model"] = teacher_model
        train_dataset = given.get("train_dataset")
        columns = ["prompt"] if train_dataset is None else getattr(train_dataset, "column_names", None)
        config = args if args is not None else StepGRPOConfig  # its defaults when args=None (TRL builds the config)
        check_agent_options(config, agent)
        if rollout is not None:  # a Rollout of the user's (trinity_trl.rollouts.protocols.Rollout)
            if environment_factory is not None or tools or agent is not None:
                raise ValueError(
                    "rollout= plays its own runs: pass rollout= alone, without environment_factory/tools/agent"
                )
            check_rollout(rollout, config.max_env_steps, config.history)
        elif agent is not None:  # an agent over the policy endpoint (trinity_trl.rollouts.agent)
            rollout = agent_rollout(agent, config, train_dataset, environment_factory is not None or bool(tools))
            if args is not None:
                check_agent_generation(args.use_vllm, args.vllm_mode, args.vllm_tensor_parallel_size)
        else:
            rollout = environment_rollout(environment_factory, tools, columns, config.max_env_steps, config.history)
        self.rollout: Rollout = rollout
        extra = (
            []
            if reward_funcs is None
            else (list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])
        )
        super().__init__(**rollout.trl_arguments(given, extra))
        rollout.start(self._rollout_context())
        self.model_card.environment = ", ".join(rollout.environment_names) or None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            raise ValueError(
                "StepGRPOTrainer does not support vllm_importance_sampling_correction yet (TRL computes the ratio for "
                "whole completions, not turns); set vllm_importance_sampling_correction=False"
            )
        # reference log-probs are computed here for every row (step or run); TRL's pass over the final
        # turns would be redone (the reference model itself stays loaded)
        skip_trl_reference_pass(self)

    def _rollout_context(self) -> RolloutContext:
        """What the rollout may use of this trainer (`trinity_trl.rollouts.protocols.RolloutContext`)."""
        args = self.args
        engine = engine_of(self.accelerator)
        lockstep = (
            "FSDP"
            if engine == "fsdp"
            else "DeepSpeed ZeRO-3"
            if engine == "deepspeed" and zero_stage(self.accelerator) == 3
            else None
        )
        context = getattr(self.model.config, "max_position_embeddings", None)
        if self.use_vllm and args.vllm_max_model_length is not None:  # vLLM fails on a longer prompt + completion
            context = args.vllm_max_model_length if context is None else min(context, args.vllm_max_model_length)
        return RolloutContext(
            generation=self.generation,
            processing_class=self.processing_class,
            tokenizer=self._tokenizer,
            chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs,
            tools=self.tools,
            max_context=None if context is None else context - args.max_completion_length,
            sampling={"temperature": args.temperature, "top_p": args.top_p},
            lockstep_engine=lockstep,
            max_completion_length=args.max_completion_length,
            policy_version=lambda: self.state.global_step,
        )

    @property
    def environment_protocol(self) -> str:
        """The name of the rollout's protocol (``"reset/step"``, ``"tools"``, ``"agent"`` or a user rollout's), for
        people: the trainer itself never reads it."""
        return self.rollout.protocol

    @property
    def agent_runs(self):
        """With ``agent=``: the runs of the last generation, as played and trained
        (`trinity_trl.rollouts.agent.RecordedRun`: the row, the reward, and each model call's prompt ids,
        completion ids and sampling log-probs); read it from a callback's ``on_step_end``."""
        if not hasattr(self.rollout, "recorded"):
            raise AttributeError("agent_runs exists only for StepGRPOTrainer(agent=...)")
        return self.rollout.recorded

    # ------------------------------------------------------------------------------ rollout
    def _generate_and_score_completions(self, inputs):
        output = self.rollout.generate(inputs, self._trl_generate)
        if self.rollout.metrics:  # e.g. the agent rollout's fault counters (agent/...)
            append_metrics(
                self._metrics["train" if self.model.training else "eval"], self._all_processes(self.rollout.metrics)
            )
        return output

    def _trl_generate(self, inputs: list[dict[str, Any]], **attributes) -> dict[str, Any]:
        """TRL's generation and scoring of ``inputs`` (through `TrinityTrainer`), with ``attributes`` of this trainer
        set for the call (trl_seams.temporarily): how a `Rollout` plays through TRL. A ``rollout_func`` is checked as
        a user's would be."""
        if attributes.get("rollout_func") is not None:
            attributes["rollout_func"] = checks.checked_rollout_func(attributes["rollout_func"])
        with temporarily(self, **attributes):
            return super()._generate_and_score_completions(inputs)

    def _all_processes(self, metrics: dict[str, float]) -> dict[str, float]:
        """The rollout's metrics over every process: counts summed, per-run means averaged (every process plays
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
    def _training_batch(self, output: dict, inputs: list[dict], rewards: torch.Tensor, mode: str) -> dict:
        local = rewards[self._local_rows(output["prompt_ids"].size(0))].tolist()
        runs = self.rollout.runs(output, inputs, local)  # this process's runs, whole
        group_size = self._group_size(mode)
        device = output["prompt_ids"].device
        steps = self.accelerator.gather(torch.tensor([len(run.steps) for run in runs], device=device)).cpu().tolist()
        first = self._local_rows(len(runs)).start
        # GiGPO: each step's state key and declared reward, of every process's runs
        states = self._gathered_step_states(runs) if self.components.advantage_fn.needs_step_states else None
        experiences = [
            Experience(
                eid=EID(batch=self._generation_count, task=i // group_size, run=i % group_size, step=s),
                reward=value,
                info={} if states is None else experience_info(states[i][s]),
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
                    self.accelerator.gather(torch.tensor(sum(r.malformed for r in runs), device=device)).sum()
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

    def _gathered_step_states(self, runs: list[Run]) -> list[list[StepState]]:
        """`Run.step_states` of every process's runs, in the order of the gathered rewards (one line when steps declare
        rewards that would make reward functions ignored: `check_declared_step_rewards`)."""
        states = [run.step_states() for run in runs]
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            states = gather_object(states)
        check_declared_step_rewards(states, self.reward_func_names, self.reward_weights)
        return states

    def _step_batch(self, output: dict, runs: list[Run], advantages: list[list[float | None]]) -> dict:
        """The training batch of this process's runs: each run's `TrainingRow`s (a whole run per row when it is
        prefix-preserving and ``shared_prefix`` is on, else one row per step; `trinity_trl.rollouts.runs`), then
        padding rows so the count splits evenly into micro-batches, stacked into TRL's padded tensors. Per token:
        ``segment_ids`` (the step a trained token belongs to, -1 elsewhere), ``advantages``; per row:
        ``sample_count`` (steps trained in it).
        """
        device = output["prompt_ids"].device
        eos = set(self.eos_token_ids) if self.args.mask_truncated_completions else None
        shared = self.args.shared_prefix and not self.components.policy_loss.sequence_level
        rows: list[TrainingRow] = [
            row for run, scores in zip(runs, advantages) for row in run.training_rows(scores, shared, eos)
        ]
        padding = -len(rows) % self.args.steps_per_generation or (0 if rows else self.args.steps_per_generation)
        pad_id = self._tokenizer.pad_token_id
        rows += [TrainingRow.padding(pad_id)] * padding

        def padded(rows, value, side, dtype=torch.long):
            return pad([torch.tensor(r, dtype=dtype) for r in rows], padding_value=value, padding_side=side).to(device)

        segment_ids = padded([r.segment_ids for r in rows], -1, "right")
        batch: dict[str, Any] = {
            "prompt_ids": padded([r.prompt_ids for r in rows], pad_id, "left"),
            "prompt_mask": padded([[1] * len(r.prompt_ids) for r in rows], 0, "left"),
            "completion_ids": padded([r.completion_ids for r in rows], pad_id, "right"),
            "completion_mask": padded([[1] * len(r.completion_ids) for r in rows], 0, "right"),
            "tool_mask": (segment_ids >= 0).long(),
            "segment_ids": segment_ids,
            "advantages": padded([r.advantages for r in rows], 0.0, "right", torch.float32),
            "sample_count": torch.tensor([r.sample_count for r in rows], device=device),
            "step_width": torch.tensor([r.step_width for r in rows], device=device),
            "num_items_in_batch": output["num_items_in_batch"],
        }
        if "sampling_per_token_logps" in output:
            batch["sampling_per_token_logps"] = padded(
                [r.sampling_logps for r in rows], float("nan"), "right", torch.float32
            )
        tensors = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        if "old_per_token_logps" in output:  # TRL needs behaviour log-probs (off-policy steps): all rows
            batch["old_per_token_logps"] = self.scoring.policy_logps(tensors)
        if self.algorithm.needs_reference:
            batch["ref_per_token_logps"] = self.scoring.reference_logps(tensors)
        unknown = set(output) - set(batch) - {"ref_per_token_logps", "importance_sampling_ratio"}
        if unknown:
            raise ValueError(f"StepGRPOTrainer cannot expand batches with {sorted(unknown)}")
        return batch
