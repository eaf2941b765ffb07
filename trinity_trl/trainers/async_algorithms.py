"""The algorithm trainers on TRL's asynchronous trainer: `AsyncCISPOTrainer`, `AsyncSAPOTrainer`, `AsyncChordTrainer`,
`AsyncStepGRPOTrainer`.

Each is its synchronous twin's config fields and defaults (`CISPOFields`, `SAPOFields`, `ChordFields`,
`StepWiseFields`: the same classes [`CISPOConfig`][], [`SAPOConfig`][], [`ChordConfig`][] and [`StepGRPOConfig`][] are
made of) on [`AsyncTrinityConfig`][], and a small subclass of [`AsyncTrinityTrainer`][] (docs/asynchronous.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..algorithms.policy_loss import step_sample_weights
from ..asynchronous.async_grpo_seams import SampleStream, completion_sample
from ..data.loading import SeededPasses, check_demonstrations, prompt_token_ids
from ..overrides import temporarily
from .async_config import AsyncTrinityConfig
from .async_trinity import AsyncTrinityTrainer
from .chord_trainer import ChordFields, ExpertRowsLoss, _expert_columns, expert_completion_ids, expert_example
from .cispo_trainer import CISPOFields
from .config import from_trl_config
from .sapo_trainer import SAPOFields
from .step_grpo import StepWiseFields, agent_rollout, check_agent_options


@dataclass
class AsyncCISPOConfig(CISPOFields, AsyncTrinityConfig):
    r"""Configuration of [`AsyncCISPOTrainer`][]: the fields and defaults of [`CISPOConfig`][] (the `cispo` preset; the
    loss's arguments in `policy_loss`, e.g. `{"clip_range_high": 5.0}`) on [`AsyncTrinityConfig`][]."""


class AsyncCISPOTrainer(AsyncTrinityTrainer):
    """[`AsyncTrinityTrainer`][] with Trinity-RFT's CISPO loss (see [`AsyncCISPOConfig`][]): [`CISPOTrainer`][]
    with generation overlapping training."""

    _name = "CISPO"
    config_class = AsyncCISPOConfig


@dataclass
class AsyncSAPOConfig(SAPOFields, AsyncTrinityConfig):
    r"""Configuration of [`AsyncSAPOTrainer`][]: the fields and defaults of [`SAPOConfig`][] (the SAPO paper's loss,
    `seq-mean-token-mean`, no KL) on [`AsyncTrinityConfig`][]."""


class AsyncSAPOTrainer(AsyncTrinityTrainer):
    """[`AsyncTrinityTrainer`][] with the SAPO soft gate (see [`AsyncSAPOConfig`][]): [`SAPOTrainer`][] with
    generation overlapping training."""

    _name = "SAPO"
    config_class = AsyncSAPOConfig


@dataclass
class AsyncChordConfig(ChordFields, AsyncTrinityConfig):
    r"""
    Configuration of [`AsyncChordTrainer`][]: CHORD (`algorithm="mix_chord"`, default) or MIX (`"mix"`), with the
    fields of [`ChordConfig`][] (μ's schedule, `enable_phi_function`, `sft_loss_agg_mode`) on
    [`AsyncTrinityConfig`][].

    Parameters:
        expert_batch_size (`int` or `None`, *optional*):
            Demonstrations per micro-batch beside its `per_device_train_batch_size` rollouts (as [`ChordConfig`][]'s
            per generation batch): a micro-batch then holds `per_device_train_batch_size + expert_batch_size`
            samples, and demonstrations are that share of the sample stream. `None`: from `expert_data_ratio`.
        expert_data_ratio (`float`, *optional*, defaults to `0.25`, `0.2` with `paper_config`):
            The share of demonstrations among the samples trained on, when `expert_batch_size` is `None`
            (`round(ratio / (1 - ratio) * per_device_train_batch_size)` demonstrations per micro-batch, at least 1).
        paper_config (`str` or `None`, *optional*):
            `"chord_mu"` or `"chord_phi"`: the paper's variant with its released values, as in [`ChordConfig`][]
            (a micro-batch then holds one demonstration per four rollouts: `per_device_train_batch_size` a multiple
            of 4).

    A demonstration is mixed into the sample stream whenever demonstrations fall below their share of the samples
    (rollouts dropped as stale not counted), so a micro-batch holds its demonstrations to within one; under
    `token_budget` micro-batches vary in size and hold the share on average. The loss weighs every usual sample of
    an optimizer step `1 / (usual samples of the step)` and every demonstration `1 / (demonstrations of the step)`,
    as [`ChordTrainer`][] does (docs/asynchronous.md#chord). μ is scheduled in optimizer steps, as in
    [`ChordConfig`][].
    """

    expert_batch_size: int | None = field(
        default=None,
        metadata={"help": "Demonstrations per micro-batch beside its per_device_train_batch_size rollouts."},
    )

    def _check_own_fields(self) -> None:
        super()._check_own_fields()
        if self.expert_batch_size is not None and self.expert_batch_size < 1:
            raise ValueError(f"expert_batch_size must be >= 1, got {self.expert_batch_size}")
        self._check_paper_share(self.demonstrations_per_micro_batch(), self.per_device_train_batch_size, "micro-batch")

    def demonstrations_per_micro_batch(self) -> int:
        """Demonstrations each micro-batch holds beside its ``per_device_train_batch_size`` rollouts."""
        if self.expert_batch_size is not None:
            return self.expert_batch_size
        ratio = self.expert_data_ratio
        return max(1, round(ratio / (1.0 - ratio) * self.per_device_train_batch_size))

    def expert_share(self) -> float:
        """The share of demonstrations in the sample stream."""
        experts = self.demonstrations_per_micro_batch()
        return experts / (experts + self.per_device_train_batch_size)

    def derived_policy_loss_arguments(self) -> dict[str, Any]:
        """The loss's per-sample weights are the trainer's (from each optimizer step's counts): placeholders here,
        so that the user cannot set them too."""
        return {"usual_sample_weight": 1.0, "expert_sample_weight": 1.0}


class AsyncChordTrainer(ExpertRowsLoss, AsyncTrinityTrainer):
    """[`AsyncTrinityTrainer`][] that mixes expert demonstrations into the sample stream (CHORD / MIX):
    [`ChordTrainer`][] with generation overlapping training.

    Args:
        expert_dataset (`datasets.Dataset`): demonstrations, in [`ChordTrainer`][]'s formats (`messages`, or
            `prompt` + `completion`), drawn in a seeded order reshuffled every pass.
        Other arguments: as [`AsyncTrinityTrainer`][].

    Logged beyond [`AsyncTrinityTrainer`][]'s: `actor/mu`, the SFT and RL parts as [`ChordTrainer`][] logs them, and
    `chord/expert_share` (the share of demonstrations per micro-batch).
    """

    _name = "CHORD"
    config_class = AsyncChordConfig
    supports_expert_rows = True

    def __init__(self, model, reward_funcs=None, args: AsyncChordConfig | None = None, *pos, expert_dataset=None, **kw):
        args = from_trl_config(args, AsyncChordConfig, "AsyncChordTrainer") if args is not None else None
        if expert_dataset is None:
            raise ValueError("AsyncChordTrainer needs an expert_dataset (demonstrations for the SFT part)")
        check_demonstrations(expert_dataset, "expert_dataset")
        self._expert_format = _expert_columns(expert_dataset)
        self.expert_dataset = expert_dataset
        self._expert_cache: dict[int, tuple[list[int], list[int]]] = {}
        self._expert_cursor = 0  # demonstrations drawn so far
        self._expert_order: SeededPasses | None = None
        super().__init__(model, reward_funcs, args, *pos, **kw)

    def _sample_stream(self, source) -> SampleStream:
        return SampleStream(
            source,
            self.policy_versions,
            demonstrations=self._demonstration,
            expert_ratio=self.args.expert_share(),
            kept=self._kept_by_trl,
            model_version=lambda: self.model_version,
            ledger=self.group_ledger,
        )

    def get_train_dataloader(self):
        """TRL's fixed-count batcher reads its micro-batch size from ``per_device_train_batch_size`` when the loader
        is built; a micro-batch holds the rollouts and the demonstrations (`AsyncChordConfig`), so for that one call
        the size it reads counts both (`trinity_trl.overrides.temporarily`)."""
        if self.args.token_budget is not None and self.args.token_budget > 0:
            return super().get_train_dataloader()
        samples = self.args.per_device_train_batch_size + self.args.demonstrations_per_micro_batch()
        with temporarily(self.args, per_device_train_batch_size=samples):
            return super().get_train_dataloader()

    def _demonstration(self, model_version: int, group_id: int):
        """The next demonstration as a ``RolloutSample``: its prompt as the worker tokenizes prompts, its answer and
        the end-of-sequence token trained, behaviour log-probs and advantage 0 (docs/algorithms/chord.md#expert-rows),
        in the stream next to the group it follows."""

        if self._expert_order is None:
            self._expert_order = SeededPasses(len(self.expert_dataset), self.args.seed)
        index = self._expert_order.row(self._expert_cursor)
        self._expert_cursor += 1
        if index not in self._expert_cache:
            prompt, answer = expert_example(self.expert_dataset, index, self._expert_format)
            (prompt_ids,) = prompt_token_ids(self.processing_class, [prompt], self.args.chat_template_kwargs)
            completion = expert_completion_ids(self.processing_class, answer, self.args.max_completion_length)
            self._expert_cache[index] = (prompt_ids, completion)
        prompt_ids, completion = self._expert_cache[index]
        return completion_sample(
            prompt_ids,
            completion,
            None,
            trained=True,
            advantage=0.0,
            version=model_version,
            group_id=group_id,
            prompt=[],
            completion=[],
            metrics={},
        )

    def _class_weights(self, inputs: dict[str, Any]) -> dict[str, float]:
        """This optimizer step's per-sample weights: every usual sample of the step (every process) weighs ``1 / usual
        samples`` and every demonstration ``1 / demonstrations``, after the trainer's division by gradient
        accumulation and DDP's mean over processes (docs/algorithms/chord.md#normalisation)."""
        samples, experts = float(inputs["step_samples"][0]), float(inputs["step_expert_samples"][0])
        micro_steps = self.current_gradient_accumulation_steps * self.accelerator.num_processes
        usual, expert = step_sample_weights(samples - experts, experts, micro_steps)
        return {"usual": usual, "expert": expert}

    def _trainer_state(self) -> dict[str, Any]:
        return {**super()._trainer_state(), "expert_cursor": self._expert_cursor}

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        super()._load_trainer_state(state)
        self._expert_cursor = state["expert_cursor"]


@dataclass
class AsyncStepGRPOConfig(StepWiseFields, AsyncTrinityConfig):
    r"""
    Configuration of [`AsyncStepGRPOTrainer`][]: the fields and defaults of [`StepGRPOConfig`][] (preset
    `multi_step_grpo`, `step_wise_grpo` advantages; `algorithm="gigpo"` for GiGPO's) on [`AsyncTrinityConfig`][],
    with the transformers worker.

    Parameters:
        max_env_steps (`int`, *optional*, defaults to `5`):
            Turns per run at most (a run still going then ends, counted in `multi_step/cut_runs_total`).
        history (`str`, *optional*, defaults to `"tokens"`):
            `"tokens"`: each turn's prompt is the previous prompt + the generated tokens + the observation's
            chat-template tokens (never re-tokenized). `"messages"`: the conversation is re-rendered by the chat
            template every turn.
        enable_step_norm (`bool`, *optional*, defaults to `False`):
            Divide a run's advantage by its number of steps, so long runs do not weigh more (step-wise GRPO only, as
            the next two: refused with `gigpo`).
        std_cal_level (`str`, *optional*, defaults to `"group"`):
            Standard deviation the run rewards are normalised by: the task group's (`"group"`) or none (`"none"`:
            reward minus group mean). `"batch"` is refused: each group is scored alone, as it is played.
        std_threshold (`float` or `None`, *optional*):
            Skip task groups whose reward std is at most this (and single-run groups); their steps get no gradient.
        agent_timeout (`float`, *optional*, defaults to `300.0`):
            With `agent=` only (the three `agent_*` options are refused without it): seconds of its own time one agent
            run may take; it is then cancelled and scored as `agent_on_failure` says.
        agent_on_failure (`str`, *optional*, defaults to `"zero"`):
            With `agent=`: a run whose agent raised, timed out or returned no number scores 0 (`"zero"`) or is left
            unscored, its steps without gradient (`"drop"`).
        agent_batch_window (`float`, *optional*, defaults to `0.05`):
            With `agent=`: seconds the endpoint waits after a request for the group's other running agents' requests
            before it generates them in one batch.
    """

    def __post_init__(self):
        self.check_step_fields()
        super().__post_init__()
        if self.generation_backend != "transformers":
            raise ValueError(
                "AsyncStepGRPOConfig plays runs with its own transformers worker: generation_backend must be "
                f"'transformers', got {self.generation_backend!r} (TRL's vLLM worker plays TRL tool environments: "
                "AsyncTrinityTrainer with generation_backend='vllm' and environment_factory)"
            )


class AsyncStepGRPOTrainer(AsyncTrinityTrainer):
    """[`AsyncTrinityTrainer`][] playing multi-step runs of reset/step environments with step-wise GRPO (see
    [`AsyncStepGRPOConfig`][]): [`StepGRPOTrainer`][] with generation overlapping training.

    Its worker (`trinity_trl.asynchronous.multi_step_worker.MultiStepWorker`) plays `num_generations` runs of a task
    with the code `StepGRPOTrainer` plays them with, scores the runs (the environment's last-step reward or the agent's
    return value first, then `reward_funcs` on the final turn), and queues every step as its own sample with its run's
    step-wise advantage.

    Args:
        environment_factory: builds one environment per run: a reset/step `trinity_trl.rollouts.Environment` (or a
            class whose public methods are exactly `reset` and `step`); or a dict of them, each dataset row choosing
            one by its `environment` column. TRL tool environments and `rollout=` run synchronously
            ([`StepGRPOTrainer`][]).
        agent: instead of an environment, `async def agent(client, row) -> reward`, as [`StepGRPOTrainer`][] takes
            it: every model call it makes through the policy endpoint is a step (`agent_timeout`, `agent_on_failure`,
            `agent_batch_window` as there). Needs `train_dataset`.
        train_dataset: the tasks (every column but `prompt` goes to `reset`); `None` when the environment owns the
            data (`reset()` returns the first observation): `max_steps` then sets the length.
        reward_funcs: reward functions scoring each run's final turn, after the environment's reward.
        Other arguments: as [`AsyncTrinityTrainer`][].

    Logged beyond [`AsyncTrinityTrainer`][]'s: `multi_step/steps_per_run`, `multi_step/prefix_preserving`,
    `multi_step/cut_runs_total` and `unscorable_count` (runs); with `agent=`, the agent's fault counters as
    `agent/<name>_total` (summed over the logging window) and `agent/calls_per_run`, `agent/segments_per_run`.
    """

    _name = "Step-wise GRPO"
    config_class = AsyncStepGRPOConfig
    plays_runs = True
    requires_prompt_dataset = False

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: AsyncStepGRPOConfig | None = None,
        train_dataset=None,
        *pos,
        environment_factory=None,
        agent=None,
        rollout_worker=None,
        **kw,
    ):
        from ..rollouts.multi_step import MultiStepRollout
        from ..rollouts.protocols import STEP_PROTOCOL, environment_reward, resolve_protocol

        args = from_trl_config(args, AsyncStepGRPOConfig, "AsyncStepGRPOTrainer") if args is not None else None
        config = args if args is not None else AsyncStepGRPOConfig  # its defaults when args=None
        if rollout_worker is not None:
            raise ValueError("AsyncStepGRPOTrainer plays the runs with its own worker; rollout_worker= cannot be given")
        check_agent_options(config, agent)
        if agent is not None:  # an agent over the policy endpoint (trinity_trl.rollouts.agent)
            self.environment_rollout = agent_rollout(agent, config, train_dataset, environment_factory is not None)
        else:
            if environment_factory is None:
                raise ValueError(
                    "AsyncStepGRPOTrainer needs environment_factory (a callable returning a fresh reset/step "
                    "environment, or a dict of them routed by the dataset's 'environment' column) or agent= (an "
                    "`async def agent(client, row)` calling the policy through an OpenAI or Anthropic client)"
                )
            columns = None if train_dataset is None else getattr(train_dataset, "column_names", None)
            protocol, classes = resolve_protocol(environment_factory, None, columns)
            if protocol != STEP_PROTOCOL:
                raise ValueError(
                    f"{next(iter(classes.values())).__qualname__} is a TRL tool environment: AsyncStepGRPOTrainer "
                    "plays reset/step environments and agents; train tool environments with StepGRPOTrainer, or "
                    "asynchronously with AsyncTrinityTrainer(generation_backend='vllm', environment_factory=...) "
                    "(TRL's worker)"
                )
            if train_dataset is None:
                train_dataset = self._placeholder_tasks(environment_factory, args)
            self.environment_rollout = MultiStepRollout(
                None,
                environment_factory,
                config.max_env_steps,
                config.history,
                [cls.__qualname__ for cls in classes.values()],
            )
        if len(train_dataset) == 0:
            raise ValueError("train_dataset has no rows: each row is one task")
        user_rewards = (
            []
            if reward_funcs is None
            else (list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])
        )
        super().__init__(model, [environment_reward, *user_rewards], args, train_dataset, *pos, **kw)

    @staticmethod
    def _placeholder_tasks(environment_factory, args):
        """``train_dataset=None`` (the environment owns the data): one row of an empty prompt, drawn for every group
        (``reset()`` supplies each task); the length comes from ``max_steps``."""
        from datasets import Dataset

        if isinstance(environment_factory, dict):
            raise ValueError(
                "a dict environment_factory routes rows by their 'environment' column: it needs a train_dataset "
                "with that column"
            )
        if args is None or args.max_steps <= 0:
            raise ValueError(
                "train_dataset=None (the environment owns the data) needs max_steps > 0 to set the training length"
            )
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]]})

    def _make_worker(self, *args: Any, **kwargs: Any):
        from ..asynchronous.multi_step_worker import MultiStepWorker

        return MultiStepWorker(
            *args, rollout=self.environment_rollout, advantage_fn=self.components.advantage_fn, **kwargs
        )


__all__ = [
    "AsyncStepGRPOConfig",
    "AsyncStepGRPOTrainer",
    "AsyncCISPOConfig",
    "AsyncCISPOTrainer",
    "AsyncChordConfig",
    "AsyncChordTrainer",
    "AsyncSAPOConfig",
    "AsyncSAPOTrainer",
]
