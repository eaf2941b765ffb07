"""PPO with a value model: the critic path that TRL 1.16 no longer has (Trinity-RFT's ``ppo`` preset).

Each generation batch, the critic scores every response token once (no gradient): these old
values and the token-level rewards (the scalar reward on the last valid token, minus an optional
KL penalty, docs/algorithms/kl.md#kl-penalty) give GAE advantages and returns
(docs/algorithms/advantages.md#batch-functions), computed on the batch gathered from every process. Each micro-batch
then trains both models from the same rows: the policy with the PPO-clip loss (plus KL and entropy terms, as every
``TrinityTrainer``) and the critic with the clipped value loss (docs/algorithms/entropy.md#critic-loss). The critic has
its own optimizer, stepped right after the policy's, and its own wrapping in the run's engine (DDP, FSDP, or a DeepSpeed
engine of its own: `critic_engine`). Without DeepSpeed the two losses are summed into one backward pass (their
parameters are disjoint, so each optimizer sees only its own model's gradient); under DeepSpeed the
critic's engine runs its own backward.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer

from ..algorithms import ADVANTAGE_FN, ALGORITHM_TYPE
from ..algorithms.component import Component
from ..algorithms.masked import masked_fill_invalid, masked_mean
from ..algorithms.value_loss import check_cliprange_value, clipped_value_loss
from ..data.model import resolve_model
from ..training import checks
from ..training.advantages import Advantages, AdvantageSources
from ..training.critic_engine import CRITIC_OPTIMIZER_FILE, build_critic
from ..training.grpo_seams import bind_trl_arguments, trained_mask
from ..training.loss import LossBatch, masked_finite
from ..training.metrics import append_metrics
from .common import default_output_dir
from .config import TrinityConfig, from_trl_config
from .trinity import TrinityTrainer

CRITIC_DIR = "critic"
__all__ = ["CRITIC_DIR", "CRITIC_OPTIMIZER_FILE", "PPOConfig", "PPOTrainer"]
# value heads of transformers' token-classification models (PEFT trains them in full for TOKEN_CLS)
_VALUE_HEADS = ("score", "classifier")


@dataclass
class PPOConfig(TrinityConfig):
    r"""
    Configuration of [`PPOTrainer`][]: Trinity-RFT's `ppo` preset (PPO-clip policy loss, GAE
    advantages, entropy term; its k2 KL loss when `kl_loss` names it) with a value model.

    Parameters:
        value_model_name_or_path (`str` or `None`, *optional*):
            Model id or path of the critic, loaded with `AutoModelForTokenClassification(num_labels=1)`
            and `model_init_kwargs` (a reward model's `score` head is reused). `None`: the critic is
            the policy's base model plus a new scalar head. It must use the policy's tokenizer. The
            trainer's `value_model` argument (a path or a module) is the alternative; give one.
        value_learning_rate (`float`, *optional*, defaults to `1e-5`):
            Peak learning rate of the critic's optimizer (same `optim`, betas, epsilon and
            `weight_decay` as the policy's). It follows the policy's schedule
            (`lr_scheduler_type`, warm-up), scaled to this peak.
        cliprange_value (`float`, *optional*, defaults to `0.5`):
            `c` of the clipped value loss: one update moves a value at most `c` away from its
            generation-time estimate (before the loss takes the larger error). `inf` disables it.
        critic_warmup_steps (`int`, *optional*, defaults to `0`):
            Optimizer steps at the start during which only the critic trains: the policy loss is not
            computed and the policy weights do not change.
        gamma (`float`, *optional*, defaults to `1.0`): GAE discount γ (becomes the advantage's `gamma`).
        lam (`float`, *optional*, defaults to `1.0`): GAE λ (becomes the advantage's `lam`).
        save_value_model (`bool`, *optional*, defaults to `False`):
            `save_model` and `push_to_hub` also write the critic to `<output_dir>/critic/` (the full
            model, or its LoRA adapter with the value head). Checkpoints always hold the critic and
            its optimizer state, for resuming.

    The value loss aggregates with `loss_agg_mode` and is normalised like the policy loss
    (`loss_normalization`, gradient accumulation). The critic clips its gradient norm at
    `max_grad_norm`, separately from the policy, and has no dropout. Under DeepSpeed and FSDP the
    critic is wrapped like the policy (its own DeepSpeed engine with the policy's ZeRO config, or
    FSDP). Not supported (rejected): `fp16` (one loss scaler cannot serve two optimizers; use
    `bf16`), `critic_warmup_steps > 0` under DeepSpeed (its engine steps the policy's optimizer at
    every boundary, gradient or not) and an `advantage` other than `ppo` (GAE). `kl_penalty` (KL in the
    reward, before GAE) is honoured; unset, it is `none`, as is `kl_loss` (TRL's `beta=0.0`: no KL term).
    """

    algorithm: str = field(default="ppo", metadata={"help": "Algorithm preset (PPOConfig trains 'ppo' only)."})
    value_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Critic model id or path (token classification, 1 label); None: the policy's base."},
    )
    value_learning_rate: float = field(default=1e-5, metadata={"help": "Peak learning rate of the critic."})
    cliprange_value: float = field(default=0.5, metadata={"help": "Clip range c of the clipped value loss."})
    critic_warmup_steps: int = field(default=0, metadata={"help": "First optimizer steps that train only the critic."})
    gamma: float = field(default=1.0, metadata={"help": "GAE discount gamma."})
    lam: float = field(default=1.0, metadata={"help": "GAE lambda."})
    save_value_model: bool = field(
        default=False, metadata={"help": "save_model/push_to_hub also write the critic to <output_dir>/critic/."}
    )

    def __post_init__(self):
        if not ALGORITHM_TYPE.get(self.algorithm).use_critic:
            raise ValueError(
                f"PPOConfig trains the 'ppo' preset (a value model and GAE) or another preset with a "
                f"critic, got algorithm={self.algorithm!r}"
            )
        super().__post_init__()
        try:
            check_cliprange_value(self.cliprange_value)
        except ValueError as err:
            raise ValueError(f"PPOConfig: {err}") from None
        if not (isinstance(self.critic_warmup_steps, int) and self.critic_warmup_steps >= 0):
            raise ValueError(f"PPOConfig: critic_warmup_steps must be an int >= 0, got {self.critic_warmup_steps!r}")
        if 0 < self.max_steps <= self.critic_warmup_steps:
            raise ValueError(
                f"PPOConfig: critic_warmup_steps={self.critic_warmup_steps} covers all max_steps="
                f"{self.max_steps}, so the policy would never train; lower critic_warmup_steps"
            )
        if not self.value_learning_rate >= 0:
            raise ValueError(f"PPOConfig: value_learning_rate must be >= 0, got {self.value_learning_rate!r}")
        if self.fp16:
            raise ValueError(
                "PPOConfig: fp16 is not supported (its loss scaler serves one optimizer, and the critic has "
                "its own); use bf16=True or fp32"
            )

    def _implied_components(self) -> dict[str, Component]:
        advantage = self.component_name("advantage") or "ppo"
        if not ADVANTAGE_FN.get(advantage).needs_values:
            raise ValueError(
                f"PPOConfig trains a critic for GAE, so advantage must be 'ppo' (or another function "
                f"of critic values), got {advantage!r}"
            )
        return {"advantage": Component(gamma=self.gamma, lam=self.lam)}


class _CriticOptimizerStep(TrainerCallback):
    """Steps the critic's optimizer right after the policy's (once per optimizer step, after the
    gradients of every accumulated micro-batch are in)."""

    def __init__(self, trainer: PPOTrainer):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._critic_optimizer_step()


class PPOTrainer(TrinityTrainer):
    """[`TrinityTrainer`][] for PPO with a value model (see [`PPOConfig`][]).

    Args:
        value_model (`str`, `torch.nn.Module` or `None`): the critic. A model id or path is loaded as
            `AutoModelForTokenClassification(num_labels=1)`; a module must take `input_ids` and
            `attention_mask` and return `.logits` of shape `(B, L, 1)` (one value per position).
            `None`: `args.value_model_name_or_path`, else the policy's base model with a new scalar
            head (an in-memory policy is copied, so it must not be a `PeftModel` then).
        value_peft_config (`peft.PeftConfig`, `False` or `None`): LoRA (or another PEFT method) for the
            critic, applied as a token-classification task so the value head is trained in full.
            `None`: the policy's `peft_config`, if any; `False`: train the whole critic.
        Other arguments: as [`TrinityTrainer`][].

    Logged: `critic/vf_loss`, `critic/vf_clipfrac`, `critic/vpred_mean` (per micro-batch),
    `critic/values/mean`, `critic/returns/mean`, `critic/vf_explained_var` (per generation batch,
    over every process), `critic/grad_norm` and `critic/lr` (per optimizer step). TRL's `loss` is the
    sum of the policy loss (`actor/loss`) and the critic's.
    """

    _name = "PPO"
    config_class = PPOConfig
    has_critic = True

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: PPOConfig | None = None,
        *pos,
        value_model=None,
        value_peft_config=None,
        **kwargs,
    ):
        model, value_model = resolve_model(model), resolve_model(value_model)
        if args is None:
            args = PPOConfig(output_dir=default_output_dir(model, "PPOConfig"))
        args = from_trl_config(args, PPOConfig, "PPOTrainer")  # a plain GRPOConfig is converted
        teacher_model = kwargs.pop("teacher_model", None)
        given = bind_trl_arguments(GRPOTrainer, model, reward_funcs, args, *pos, **kwargs)
        critic = self._build_critic(
            model, args, value_model, value_peft_config, given.get("peft_config"), given.get("quantization_config")
        )
        super().__init__(**given, teacher_model=teacher_model)
        if self._is_vlm:
            raise ValueError("PPOTrainer supports text models only: the critic reads token ids, not images")
        if self.is_deepspeed_enabled and args.critic_warmup_steps > 0:
            raise ValueError(
                "PPOTrainer: critic_warmup_steps > 0 is not supported under DeepSpeed: the policy's DeepSpeed engine "
                "steps its optimizer at every accumulation boundary (Accelerate's DeepSpeedEngineWrapper.backward "
                "calls engine.step()), so a warm-up step would still advance the policy's Adam state and apply weight "
                "decay; set critic_warmup_steps=0, or warm the critic up with DDP or FSDP (whose optimizer skips "
                "parameters without gradients)"
            )
        # the critic in the run's engine, with its own optimizer (critic_engine.py)
        self._critic = build_critic(critic, self.accelerator, self._build_critic_optimizer)
        self.critic = self._critic.module  # what a training forward calls (DDP, FSDP or DeepSpeed engine)
        self.critic_optimizer = self._critic.optimizer
        self._saving_checkpoint = False
        self.add_callback(_CriticOptimizerStep(self))

    # ----------------------------------------------------------------------------------- critic
    @staticmethod
    def _build_critic(
        model, args: PPOConfig, value_model, value_peft_config, peft_config, quantization_config=None
    ) -> torch.nn.Module:
        """The critic before accelerate prepares it: loaded like TRL loads the policy (``model_init_kwargs``,
        ``quantization_config``), with a scalar head, optional PEFT adapter, no dropout."""
        from accelerate.utils import is_peft_model
        from transformers import AutoConfig, AutoModelForTokenClassification, set_seed

        from ..training.grpo_seams import create_model_from_path, disable_dropout_in_model

        if value_model is not None and args.value_model_name_or_path is not None:
            raise ValueError("give the critic once: either the value_model argument or value_model_name_or_path")
        source = value_model if value_model is not None else resolve_model(args.value_model_name_or_path)
        set_seed(args.seed)  # the new value head (and critic adapter) is initialised reproducibly
        if source is None and not isinstance(model, str):
            if is_peft_model(model):
                raise ValueError("the policy is a PeftModel: pass the critic as value_model (a path or a module)")
            config = copy.deepcopy(model.config)
            config.num_labels = 1
            critic = AutoModelForTokenClassification.from_config(config, dtype=model.dtype)
            critic.base_model.load_state_dict(model.base_model.state_dict())
            critic.to(model.device)
        elif source is None or isinstance(source, str):
            path = source if source is not None else model
            init_kwargs = dict(args.model_init_kwargs or {})
            if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
                init_kwargs["device_map"] = None  # as TRL loads the policy
            init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
            if quantization_config is not None:
                init_kwargs["quantization_config"] = quantization_config
            config = AutoConfig.from_pretrained(
                path,
                num_labels=1,
                revision=init_kwargs.get("revision"),
                trust_remote_code=init_kwargs["trust_remote_code"],
            )
            critic = create_model_from_path(
                path, architecture=AutoModelForTokenClassification, config=config, **init_kwargs
            )
        elif isinstance(source, torch.nn.Module):
            critic = source
        else:
            raise TypeError(f"value_model must be a model id/path or a torch.nn.Module, got {type(source).__name__}")

        if value_peft_config is None and not is_peft_model(critic):
            value_peft_config = peft_config
        if value_peft_config:
            from peft import PeftConfig, TaskType, get_peft_model

            if not isinstance(value_peft_config, PeftConfig):
                raise TypeError(
                    f"value_peft_config must be a peft.PeftConfig, False or None, "
                    f"got {type(value_peft_config).__name__}"
                )
            if is_peft_model(critic):
                raise ValueError(
                    "value_model is already a PeftModel; pass value_peft_config=False or an unwrapped model"
                )
            value_peft_config = copy.deepcopy(value_peft_config)
            value_peft_config.task_type = TaskType.TOKEN_CLS  # the scalar head is trained in full (modules_to_save)
            # keep the head out of adapter targets such as "all-linear": PEFT cannot both adapt and fully train it
            targets, excluded = (
                getattr(value_peft_config, "target_modules", None),
                getattr(value_peft_config, "exclude_modules", ""),
            )
            heads = [
                name
                for name in _VALUE_HEADS
                if isinstance(getattr(critic, name, None), torch.nn.Module)
                and (
                    targets == "all-linear"
                    or (isinstance(targets, str) and re.fullmatch(targets, name))
                    or (isinstance(targets, (list, set, tuple)) and name in targets)
                )
            ]
            if heads and not isinstance(excluded, str):
                value_peft_config.exclude_modules = sorted(set(excluded or ()) | set(heads))
            critic = get_peft_model(critic, value_peft_config)
        disable_dropout_in_model(critic)  # a regression target: dropout only adds noise to the values
        if getattr(critic, "config", None) is not None:
            critic.config.use_cache = False
        if args.activation_checkpointing:
            options = dict(args.activation_checkpointing_kwargs or {})
            every_n_layers, offload = options.pop("every_n_layers", 1), options.pop("offload", False)
            if hasattr(critic, "activation_checkpointing_enable"):
                critic.activation_checkpointing_enable(
                    activation_checkpointing_kwargs=options or None, every_n_layers=every_n_layers, offload=offload
                )
                if is_peft_model(critic):
                    critic.enable_input_require_grads()
        return critic

    def _build_critic_optimizer(self, critic: torch.nn.Module) -> torch.optim.Optimizer:
        """The critic's optimizer, built like the Trainer builds the policy's (``optim``, weight decay
        groups), with ``value_learning_rate``."""
        from transformers.trainer_optimizer import is_optimizer_factory

        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, critic)
        if is_optimizer_factory(optimizer_cls) or {"params", "model", "optimizer_dict"} & set(optimizer_kwargs):
            raise ValueError(
                f"optim={self.args.optim!r} builds its own parameter groups; the critic needs a plain "
                "optimizer such as 'adamw_torch'"
            )
        decay = set(self.get_decay_parameter_names(critic))
        named = [(n, p) for n, p in critic.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        optimizer_kwargs["lr"] = self.args.value_learning_rate
        return optimizer_cls(groups, **optimizer_kwargs)

    def _critic_values(self, critic: torch.nn.Module, batch: dict, batch_size: int | None = None) -> torch.Tensor:
        """``(B, T)`` values of the response tokens: ``V[b, t]`` is the critic's output at the position
        just before completion token ``t`` (the state the token was chosen in), float32, and 0 where
        ``completion_mask`` is 0. Prompt and padding positions are never scored."""
        completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
        input_ids = torch.cat([batch["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], completion_mask], dim=1)
        width = completion_ids.size(1)
        packed = self.prefix_packing.critic_values(critic, input_ids, attention_mask, width, batch_size)
        if packed is not None:  # the prefix-shared packed row (trinity_trl.packing), as the policy's forwards
            return masked_fill_invalid(packed.float(), completion_mask)
        batch_size = batch_size or input_ids.size(0)
        chunks = []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            with self.accelerator.autocast():
                logits = critic(input_ids=input_ids[rows], attention_mask=attention_mask[rows]).logits
            if logits.dim() != 3 or logits.shape[-1] != 1:
                raise ValueError(f"the critic must return logits of shape (B, L, 1), got {tuple(logits.shape)}")
            chunks.append(logits[:, -width - 1 : -1, 0].float())
        return masked_fill_invalid(torch.cat(chunks), completion_mask)

    # ------------------------------------------------------------------------------ advantages
    def _advantage_sources(self, output: dict, inputs: list[dict]) -> AdvantageSources:
        sources = super()._advantage_sources(output, inputs)

        def old_values() -> torch.Tensor:
            # once per generation batch, no gradient (outside DDP: no collective per chunk; FSDP and DeepSpeed
            # gather their shards, every process alike)
            with torch.no_grad():
                output["old_values"] = self._critic_values(
                    self._critic.scoring_module(), output, batch_size=self.args.per_device_train_batch_size
                )
            return output["old_values"]

        sources.values = old_values
        return sources

    def _use_advantage_extras(self, output: dict, result: Advantages) -> None:
        output["returns"] = result.returns
        mask, returns = result.batch["response_mask"], result.batch["returns"]
        values = result.batch["values"].to(returns.dtype)

        def variance(x):
            return masked_mean((x - masked_mean(x, mask)) ** 2, mask)

        append_metrics(
            self._metrics["train" if self.model.training else "eval"],
            {
                "critic/values/mean": masked_mean(values, mask),
                "critic/returns/mean": masked_mean(returns, mask),
                "critic/vf_explained_var": 1.0 - variance(returns - values) / (variance(returns) + 1e-8),
            },
        )

    # ------------------------------------------------------------------------------------ loss
    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        value_loss = self._value_loss(inputs, mode)
        if mode == "train" and self.state.global_step < self.args.critic_warmup_steps:
            return value_loss  # critic warm-up: no policy forward, so the policy gets no gradient at all
        return super()._compute_loss(model, inputs) + value_loss

    def _value_loss(self, inputs: dict, mode: str) -> torch.Tensor:
        """The clipped value loss of a micro-batch, scaled like the policy loss (aggregation mode,
        loss normalisation, gradient accumulation)."""
        loss_mask = trained_mask(inputs)
        self.critic.train(mode == "train")
        values = self._critic_values(self.critic, inputs)
        # numerical guards, as for the policy loss (checks.py): tokens whose value, old value or return is
        # not finite leave the mask; a loss that is still not finite becomes an exact 0 for this micro-batch
        finite = torch.isfinite(values) & torch.isfinite(inputs["old_values"]) & torch.isfinite(inputs["returns"])
        dropped = float(((loss_mask != 0) & ~finite).sum())
        loss_mask = loss_mask * finite
        aggregation = self.loss_normalizer.plan(LossBatch.from_trl(inputs), loss_mask, self.algorithm.loss_agg_mode)
        loss, metrics = clipped_value_loss(
            *(masked_finite(t, loss_mask) for t in (values, inputs["old_values"], inputs["returns"])),
            loss_mask,
            self.args.cliprange_value,
            aggregation,
        )
        if mode == "train":
            loss = loss / self.current_gradient_accumulation_steps
        guards = {"guards/nonfinite_values": dropped, "guards/nonfinite_value_loss": float(not checks.is_finite(loss))}
        if guards["guards/nonfinite_value_loss"]:
            loss = checks.zero_loss(self.critic)
        append_metrics(self._metrics[mode], {**{f"critic/{k}": v for k, v in metrics.items()}, **guards})
        if mode == "train" and self._critic.separate_backward:
            self._critic.backward(loss)  # the critic's own engine (DeepSpeed); the policy's backward skips it
            loss = loss.detach()
        return loss

    def _critic_optimizer_step(self) -> None:
        """Clip the critic's gradient, set its learning rate from the policy's schedule, step, zero."""
        scale = 1.0
        if self.lr_scheduler is not None and self.args.learning_rate > 0:
            scale = self._get_learning_rate() / self.args.learning_rate  # the policy's rate for this step
        lr = self.args.value_learning_rate * scale
        metrics = self._critic.step(lr, self.args.max_grad_norm)
        metrics["critic/lr"] = lr
        append_metrics(self._metrics["train"], metrics)

    # --------------------------------------------------------------------------- save, resume
    def critic_state_dict(self) -> dict[str, torch.Tensor]:
        """The critic's full weights (gathered under ZeRO-3 and FSDP) on the main process, ``{}`` on the others;
        every process must call it."""
        return self._critic.full_state_dict()

    def _save_critic(self, directory: str) -> None:
        """The critic in ``save_pretrained`` form (the full model, or its adapter with the value head) in
        ``directory``, written whole or not at all; every process must call it (the weights are gathered)."""
        from safetensors.torch import save_file
        from transformers.utils import SAFE_WEIGHTS_NAME

        state = self._critic.full_state_dict()
        if not self.args.should_save:
            return
        critic = self._critic.model
        temporary = f"{directory.rstrip(os.sep)}.tmp-{os.getpid()}"
        shutil.rmtree(temporary, ignore_errors=True)
        if hasattr(critic, "save_pretrained"):
            critic.save_pretrained(temporary, state_dict=state)
        else:
            os.makedirs(temporary, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(temporary, SAFE_WEIGHTS_NAME))
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(temporary, directory)

    def _save_checkpoint(self, model, trial):
        self._saving_checkpoint = True  # save_model inside: the critic is written once, below
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving_checkpoint = False

    def _save_checkpoint_extras(self, folder: str) -> None:
        super()._save_checkpoint_extras(folder)
        # the critic goes in before the checkpoint is marked complete (and before a Hub push of it)
        self._save_critic(os.path.join(folder, CRITIC_DIR))
        if not self.args.save_only_model:
            self._critic.save(folder)  # weights and optimizer state, for resuming

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        super().save_model(output_dir, _internal_call)
        if self.args.save_value_model and not self._saving_checkpoint:
            self._save_critic(os.path.join(output_dir or self.args.output_dir, CRITIC_DIR))

    def _load_best_model(self):
        super()._load_best_model()
        self._critic.load(self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self._critic.load(checkpoint)  # weights and optimizer state, in every engine
