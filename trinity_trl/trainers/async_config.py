"""``AsyncTrinityConfig``: TRL's ``AsyncGRPOConfig`` whose algorithm is chosen as in ``TrinityConfig``, and the checks
that refuse, in one line, what the asynchronous trainers cannot run (evaluation during training, an algorithm that
needs a whole generation batch, an advantage TRL's vLLM worker does not compute). The trainer is in `async_trinity`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from trl import GRPOConfig

from ..asynchronous.async_grpo_seams import TREE_KERNEL_CHOICES, quiet_experimental_import

with quiet_experimental_import():  # TRL's warning that its experimental API may change
    from trl.experimental.async_grpo import AsyncGRPOConfig

from ..training import checks
from .config import REPLACED_GRPO_FIELDS, AlgorithmFields, GenerationFields
from .machine import MachineFields

GENERATION_BACKENDS = ("transformers", "vllm")
# AsyncGRPOConfig fields that only TRL's vLLM worker reads: with generation_backend="transformers" a value other than
# the default is refused (it would do nothing), with what to do instead
VLLM_WORKER_FIELDS: dict[str, str] = {
    "vllm_server_base_url": "the vLLM server's address",
    "vllm_server_timeout": "how long to wait for the vLLM server",
    "request_timeout": "the timeout of a request to the vLLM server",
    "weight_sync_timeout": "the timeout of a weight transfer to the vLLM server",
    "max_tool_calling_iterations": "multi-turn tool calling (TRL's worker)",
    "fork_threshold_tokens": "multi-turn re-tokenization (TRL's worker)",
    "log_completions": "TRL's worker's completion printout",
    "num_completions_to_print": "TRL's worker's completion printout",
}
# AsyncGRPOConfig fields (and the GRPOConfig fields added below) whose job a component does; as in TrinityConfig
ASYNC_REPLACED_FIELDS = {
    name: REPLACED_GRPO_FIELDS[name]
    for name in ("epsilon", "epsilon_high", "sapo_temperature_pos", "sapo_temperature_neg")
}


def _default(config_class: type, name: str) -> Any:
    return next(f.default for f in fields(config_class) if f.name == name)


def _grpo_field(name: str) -> Any:
    """A field as ``GRPOConfig`` declares it (its default and help), for an option our asynchronous configs share
    with the synchronous ones."""
    declared = next(f for f in fields(GRPOConfig) if f.name == name)
    return field(default=declared.default, metadata=dict(declared.metadata))


@dataclass
class AsyncTrinityConfig(MachineFields, AlgorithmFields, GenerationFields, AsyncGRPOConfig):
    r"""
    Configuration of [`AsyncTrinityTrainer`][trinity_trl.trainers.async_trinity.AsyncTrinityTrainer]: every option
    of TRL's [`AsyncGRPOConfig`](https://huggingface.co/docs/trl/main/en/async_grpo_trainer) (the queue,
    `max_staleness`, `token_budget`, the vLLM server, ...) plus the algorithm, with exactly the fields of
    [`TrinityConfig`][]:
    `algorithm`, `policy_loss`, `advantage`, `kl_loss`, `kl_penalty`, `entropy_loss`, `loss_agg_mode`,
    `loss_normalization`, `component_args_mode`, and TRL's names of loss arguments (`epsilon`, `epsilon_high`,
    `sapo_temperature_pos` / `_neg`).

    Parameters:
        generation_backend (`str`, *optional*, defaults to `"transformers"`):
            Where samples come from: `"transformers"` (a worker thread generating with transformers from its own copy
            of the policy, any device, our advantage components) or `"vllm"` (TRL's worker and a `vllm serve`
            server at `vllm_server_base_url`; TRL's group z-score is the advantage, so `advantage` must be `grpo` at
            its defaults).
        token_budget (`int` or `None`, *optional*): TRL's: the most tokens one micro-batch row forwards (micro-batches
            then hold as many samples as fit). Left `None` with `generation_backend="transformers"`, micro-batches hold
            `per_device_train_batch_size` samples, as the synchronous trainers' (TRL's `token_budget <= 0`); with
            `"vllm"`, TRL's default (the server's `max_model_len`).
        tree_attention_kernel (`str`, *optional*, defaults to `"auto"`):
            The kernel of the packed rows' tree attention: `"auto"` (`sdpa_segments` on a CPU; on CUDA `flash_attn`,
            else `varlen`, for fp16/bf16, else `sdpa_segments`), or one of them forced. Never downloaded.
        reward_weights (`list[float]` or `None`, *optional*): Weights of the reward functions (default 1 each).
        sapo_temperature_pos, sapo_temperature_neg (`float`, *optional*): TRL's SAPO gate temperatures, passed to
            the `sapo` loss as `tau_pos` / `tau_neg` (as in [`TrinityConfig`][]).
        loss_normalization (`str`, *optional*, defaults to `"micro_batch"`):
            `"micro_batch"`: each micro-batch's token (sample) mean, divided by `gradient_accumulation_steps`, as TRL's
            asynchronous trainer does. `"global"`: every trained token (sample) of the optimizer step weighs the
            same, whatever the size of its micro-batch (micro-batches vary in size under `token_budget`).
        compile_generation (`str`, *optional*, defaults to `"auto"`): How the `"transformers"` worker decodes, as in
            [`TrinityConfig`][] (compiled decoding on CUDA; docs/generation.md). The worker generates an optimizer
            step's groups in one `generate` call. With `"vllm"` (or a `rollout_worker` of your own) it does nothing
            (one log line when set to `"on"`).
        one_prefill_per_group (`bool`, *optional*, defaults to `True`): The worker's prompts encoded once per group,
            as in [`TrinityConfig`][] (one log line when set to `False` with `"vllm"` or your own worker).

    `max_staleness` counts TRL's weight syncs (one per optimizer step unless `weight_sync_steps > 1`); the logged
    `async/staleness` counts optimizer steps: the policy version a sample was generated with (the number of
    optimizer steps whose weights served it) behind the weights it is trained on.
    """

    replaced_fields = ASYNC_REPLACED_FIELDS

    generation_backend: str = field(
        default="transformers",
        metadata={
            "help": "'transformers' (a worker thread generating with transformers from its own copy of the policy) "
            "or 'vllm' (TRL's worker and a vllm serve server; TRL's group z-score is the advantage).",
            "choices": list(GENERATION_BACKENDS),
        },
    )
    tree_attention_kernel: str = field(
        default="auto",
        metadata={
            "help": "Kernel of the packed rows' tree attention: auto (sdpa_segments on CPU; flash_attn or varlen for "
            "fp16/bf16 on CUDA), sdpa_segments, varlen or flash_attn.",
            "choices": list(TREE_KERNEL_CHOICES),
        },
    )
    reward_weights: list[float] | None = _grpo_field("reward_weights")
    sapo_temperature_pos: float = _grpo_field("sapo_temperature_pos")
    sapo_temperature_neg: float = _grpo_field("sapo_temperature_neg")

    def check_before_trl(self) -> None:
        check_no_evaluation(self)  # before transformers' own check, which asks for an eval_dataset

    def __post_init__(self):
        super().__post_init__()
        if self.generation_backend not in GENERATION_BACKENDS:
            raise ValueError(
                f"generation_backend must be one of {GENERATION_BACKENDS}, got {self.generation_backend!r}"
            )
        if self.tree_attention_kernel not in TREE_KERNEL_CHOICES:
            raise ValueError(
                f"tree_attention_kernel must be one of {TREE_KERNEL_CHOICES}, got {self.tree_attention_kernel!r}"
            )
        if self.generation_backend == "transformers":
            for name, what in VLLM_WORKER_FIELDS.items():
                value, default = getattr(self, name), _default(type(self), name)
                if value != default:
                    raise ValueError(
                        f"{type(self).__name__}: {name}={value!r} sets {what}, which generation_backend='transformers' "
                        f"does not use; leave it at {default!r} or set generation_backend='vllm'"
                    )
        self.check_generation_fields()
        self.check_algorithm_fields()  # builds the components now (bad names and arguments fail here), once


def groups_per_step(args: Any) -> int:
    """The groups an optimizer step trains, at least one: its samples (``per_device_train_batch_size`` per
    micro-batch, ``gradient_accumulation_steps`` micro-batches) over ``num_generations``; the worker generates them in
    one ``generate`` call."""
    return max(1, math.ceil(args.per_device_train_batch_size * args.gradient_accumulation_steps / args.num_generations))


#: TrainingArguments fields that ask for evaluation during training, and their off values
EVALUATION_FIELDS = {"eval_strategy": "no", "eval_on_start": False, "load_best_model_at_end": False}


def check_no_evaluation(args: Any) -> None:
    """Refuse, in one line, evaluation during training: TRL's asynchronous trainer has no evaluation loop and the
    asynchronous trainers take no ``eval_dataset`` (docs/asynchronous.md#what-it-does-not-run)."""
    for name, off in EVALUATION_FIELDS.items():
        value = getattr(args, name)
        if getattr(value, "value", value) != off:
            raise ValueError(
                f"{type(args).__name__}: {name}={getattr(value, 'value', value)!r} asks for evaluation during "
                f"training, which the asynchronous trainers do not run (TRL's asynchronous trainer has none); leave "
                f"{name} at {off!r} and evaluate the saved model after training (a recipe's eval_accuracy does)"
            )


def check_async_components(trainer_cls: type, components: Any, args: AsyncTrinityConfig) -> None:
    """Refuse, at construction and in one line, an algorithm the asynchronous trainers cannot run, asking the
    components' declared properties: what the synchronous trainers refuse, plus what needs a whole generation batch
    (each group is scored alone, as it is generated) or a reference the worker has not."""
    algorithm = components.algorithm
    checks.check_components(trainer_cls, algorithm, components, args, teacher_model=None)
    advantage, policy = components.advantage_fn, components.policy_loss
    name = algorithm.advantage.name
    if components.kl_penalty.enabled:
        raise ValueError(
            f"kl_penalty={algorithm.kl_penalty.name!r} subtracts a KL from token rewards before batch-level "
            "advantages; the asynchronous trainers score each group alone as it is generated (use kl_loss)"
        )
    if advantage is not None and policy.reads_advantages:
        if advantage.compute_in_trainer():
            raise ValueError(
                f"advantage {name!r} is computed over a whole generation batch; the asynchronous trainers score each "
                "group alone as it is generated: use a group estimator (grpo, opmd, asymre, rec, ...)"
            )
        if advantage.refills_filtered_groups:
            raise ValueError(
                f"advantage {name!r} refills filtered groups with copies of other groups of the batch; the "
                "asynchronous trainers score each group alone: set duplicate_experiences=False"
            )
        if advantage.uses_batch_statistics:
            raise ValueError(
                f"advantage {name!r} with these arguments normalises by statistics of the whole batch; the "
                "asynchronous trainers score each group alone (e.g. std_cal_level='group')"
            )
        if advantage.step_wise and not trainer_cls.plays_runs:
            raise ValueError(
                f"advantage {name!r} scores multi-step runs; {trainer_cls.__name__} generates one turn "
                "(AsyncStepGRPOTrainer plays multi-step runs)"
            )
    if args.generation_backend == "vllm":
        if not policy.reads_advantages or advantage is None or not advantage.equals_trl_group_zscore:
            raise ValueError(
                "generation_backend='vllm' uses TRL's worker, whose advantage is its group z-score of the rewards: "
                f"the algorithm's advantage must be 'grpo' at its defaults (got {name!r} with "
                f"{dict(algorithm.advantage.args)}); use generation_backend='transformers' for other advantages"
            )
