"""``TrinityTrainer``: TRL's ``GRPOTrainer`` with Trinity-RFT's losses, KL terms and advantages.

It owns three seams of ``GRPOTrainer`` (see the TRL notes):

* ``_calculate_rewards``: keeps the rewards TRL gathers from every process;
* ``_generate_and_score_completions``: replaces TRL's advantages with the configured advantage
  function, computed on the global batch and sliced back to this process (optionally after a KL
  reward penalty);
* ``_compute_loss``: policy loss − entropy term + KL loss, from one forward pass through TRL's
  own log-prob helper.

Everything else (generation, vLLM, reward functions and models, ``rollout_func``, PEFT, the
reference model, logging, checkpoints) is TRL's.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from trl import GRPOTrainer

from ..algorithms import EID, Experience
from ..algorithms.advantage import scalar_rewards_to_token_level
from ..algorithms.inputs import metrics_to_floats
from . import checks
from .config import TrinityConfig
from .common import AlgorithmCardMixin
from .model_card import paper_for

# multimodal keys TRL's forward pass accepts; passed through unchanged
_FORWARD_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)
# group-advantage options that need data a TRL batch does not carry, or that add rows
_UNSUPPORTED_GROUP_ARGS = {
    "rank_penalty": "it needs every sample's behaviour log-probs at advantage time",
    "duplicate_experiences": "TRL's batch geometry is fixed, so filtered groups cannot be refilled by copies",
}
# batch advantage functions that whiten over every response token (need at least two)
_WHITENED_ADVANTAGES = ("reinforceplusplus", "ppo")


class TrinityTrainer(AlgorithmCardMixin, GRPOTrainer):
    """A ``GRPOTrainer`` that runs any Trinity-RFT algorithm preset (see [`TrinityConfig`]).

    Arguments are those of [`~trl.GRPOTrainer`], plus ``teacher_model`` (a model or path) for
    on-policy distillation. ``args`` must be a [`TrinityConfig`] (or a subclass).
    """

    _tag_names = ["trl", "trinity_trl"]
    _name = "Trinity"
    config_class = TrinityConfig
    _has_critic = False  # PPOTrainer: a value model for the 'ppo' preset and GAE
    _prompt_optional = False  # StepGRPOTrainer: a task's prompt may come from its environment's reset()

    def __init__(self, model, reward_funcs=None, args: TrinityConfig | None = None, *pos, teacher_model=None, **kwargs):
        if args is None:
            args = self._default_args(model)
        if not isinstance(args, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(args).__name__}")
        self.algorithm = args.resolved_algorithm()
        self._check_algorithm(args, teacher_model)
        if isinstance(model, str) and kwargs.get("processing_class") is None and len(pos) < 3:
            kwargs["processing_class"] = self._load_processor(model, args)
        if not self._prompt_optional and kwargs.get("environment_factory") is None:
            checks.check_prompt_dataset(kwargs.get("train_dataset", pos[0] if pos else None), "train_dataset")
            checks.check_prompt_dataset(kwargs.get("eval_dataset", pos[1] if len(pos) > 1 else None), "eval_dataset")

        # TRL loads the reference model and computes its log-probs iff beta != 0; beta itself is
        # never used by our loss (TrinityConfig rejects a user beta), so set it only for __init__.
        user_beta = args.beta
        args.beta = 1.0 if self.algorithm.needs_reference else 0.0
        try:
            super().__init__(model, reward_funcs, args, *pos, **kwargs)
        finally:
            args.beta = user_beta

        self.policy_loss = self.algorithm.build_policy_loss(**self._policy_loss_runtime_args())
        self.kl_loss = self.algorithm.build_kl_loss()
        self.kl_penalty = self.algorithm.build_kl_penalty()
        self.entropy_loss = self.algorithm.build_entropy_loss()
        self.advantage_fn = self.algorithm.build_advantage_fn() if self.algorithm.uses_advantage else None
        self.teacher_model = self._prepare_teacher(teacher_model) if teacher_model is not None else None
        self._generation_count = 0
        self._stashed_rewards: torch.Tensor | None = None
        if self.rollout_func is not None:
            self.rollout_func = checks.checked_rollout_func(self.rollout_func)
        self._max_positions = checks.model_max_positions(self.accelerator.unwrap_model(self.model))
        if self._max_positions is not None and self.max_completion_length >= self._max_positions:
            raise ValueError(f"max_completion_length ({self.max_completion_length}) leaves no room for a prompt in the "
                             f"model's {self._max_positions} positions (max_position_embeddings)")
        preset_name, paper = paper_for(self.algorithm.algorithm)
        self._name = self._name if type(self)._name != "Trinity" else preset_name
        self._paper = paper

    # ----------------------------------------------------------------------------------- set-up
    @classmethod
    def _default_args(cls, model) -> TrinityConfig:
        """The config used when ``args`` is None: defaults, output dir named after the model."""
        model_name = model if isinstance(model, str) else (getattr(model.config, "_name_or_path", "") or "model")
        return cls.config_class(output_dir=f"{str(model_name).split('/')[-1]}-{cls.config_class.__name__}")

    def _check_algorithm(self, args: TrinityConfig, teacher_model: Any) -> None:
        algo = self.algorithm
        if algo.use_critic and not self._has_critic:
            raise ValueError(
                f"algorithm {algo.algorithm!r} needs a value model (critic) and GAE: use PPOTrainer with a PPOConfig, "
                "or a critic-free preset such as 'grpo' or 'reinforceplusplus'"
            )
        if algo.schema != "experience":
            raise ValueError(
                f"algorithm {algo.algorithm!r} trains on {algo.schema!r} data, not on rollouts; use "
                f"{'TrinitySFTTrainer' if algo.schema == 'sft' else 'TrinityDPOTrainer'} instead"
            )
        if algo.policy_loss_fn in ("mix", "mix_chord") and not getattr(self, "_supports_expert_rows", False):
            raise ValueError(f"policy loss {algo.policy_loss_fn!r} needs expert rows; use ChordTrainer (MIX/CHORD)")
        if algo.kl_penalty_fn != "none" and not algo.compute_advantage_in_trainer:
            raise ValueError(
                f"kl_penalty_fn={algo.kl_penalty_fn!r} subtracts a KL from token rewards before trainer-side "
                f"advantages, but algorithm {algo.algorithm!r} computes advantages on experience groups "
                "(use kl_loss_fn, or a preset such as 'reinforceplusplus' or 'rloo')"
            )
        if algo.entropy_loss_fn == "mix" and not getattr(self, "_supports_expert_rows", False):
            raise ValueError("entropy_loss_fn 'mix' needs expert rows; use ChordTrainer, or entropy_loss_fn='default'")
        if args.use_vllm and args.vllm_importance_sampling_correction and not self._is_advantage_linear():
            raise ValueError(
                f"policy loss {algo.policy_loss_fn!r} with these arguments is not linear in the advantage, so TRL's "
                "vLLM importance-sampling weight cannot be applied through the advantages; set "
                "vllm_importance_sampling_correction=False"
            )
        if args.sync_ref_model and not algo.needs_reference:
            raise ValueError(
                "sync_ref_model=True updates the reference model, but this algorithm uses none (no KL loss or "
                "penalty): set kl_loss_fn or kl_penalty_fn, or sync_ref_model=False"
            )
        if not algo.uses_advantage:
            return
        if algo.advantage_fn == "on_policy_distill" and teacher_model is None:
            raise ValueError("advantage_fn 'on_policy_distill' needs a teacher_model (a model or a path)")
        if algo.advantage_fn == "remax":
            raise ValueError("advantage_fn 'remax' needs greedy-rollout reward baselines, which this trainer does not produce")
        if algo.advantage_fn == "ppo" and not self._has_critic:
            raise ValueError("advantage_fn 'ppo' (GAE) needs critic values; it is only available with a value model (PPOTrainer)")
        if not algo.compute_advantage_in_trainer:
            for key, why in _UNSUPPORTED_GROUP_ARGS.items():
                if algo.advantage_fn_args.get(key):
                    raise ValueError(f"advantage_fn_args[{key!r}] is not supported in TRL trainers: {why}")

    @staticmethod
    def _load_processor(model: str, args: TrinityConfig):
        """TRL's processor (tokenizer or VLM processor, same loading options as GRPOTrainer), with
        :func:`trinity_trl.hf_tokenizer`'s pad/eos corrections applied to its tokenizer."""
        from transformers import AutoProcessor

        from ..tokenizer import correct_tokenizer

        processor = AutoProcessor.from_pretrained(
            model, revision=(args.model_init_kwargs or {}).get("revision"), truncation_side="left",
            padding_side="left", trust_remote_code=args.trust_remote_code,
        )
        correct_tokenizer(getattr(processor, "tokenizer", processor), model)
        return processor

    def _policy_loss_runtime_args(self) -> dict[str, Any]:
        """Policy-loss arguments that depend on the trainer's batch geometry (MIX/CHORD override)."""
        return {}

    def _is_advantage_linear(self) -> bool:
        """Whether scaling the advantages by a positive per-token weight scales the loss terms by it
        (how TRL's vLLM importance-sampling weight is applied, see :meth:`_loss_inputs`)."""
        name, args = self.algorithm.policy_loss_fn, self.algorithm.policy_loss_fn_args
        if name in ("sft", "sft_is", "sft_phi"):
            return False
        if name == "rec":
            return args.get("weight", "none") != "advantage" and args.get("regularizer", "none") == "none" \
                and not args.get("fix_opd_advantage", False)
        if name == "topr":
            return args.get("advantage_threshold", 0.0) == 0.0
        return True

    def _prepare_teacher(self, teacher_model: Any):
        from transformers import AutoModelForCausalLM
        from trl.trainer.utils import add_fused_lm_head

        if isinstance(teacher_model, str):
            teacher_model = AutoModelForCausalLM.from_pretrained(teacher_model, dtype=self.model.dtype)
        teacher_model.eval()
        teacher_model.requires_grad_(False)
        add_fused_lm_head(teacher_model, temperature=self.temperature, outputs=("log_probs", "entropy"))
        return self.accelerator.prepare_model(teacher_model, evaluation_mode=True)

    # ------------------------------------------------------------------------------- advantages
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # reward functions that raise or return malformed values are reported by name and row (checks.py)
        funcs = self.reward_funcs
        self.reward_funcs = [f if isinstance(f, torch.nn.Module) else checks.checked_reward_func(f, name)
                             for f, name in zip(funcs, self.reward_func_names)]
        try:
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs = funcs
        self._stashed_rewards = rewards_per_func  # (world·B, n_funcs), process-major, gathered
        return rewards_per_func

    def _global_rewards(self) -> torch.Tensor:
        """The weighted reward sum of every completion of every process; NaN where no function scored."""
        per_func = self._stashed_rewards
        rewards = (per_func * self.reward_weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
        return rewards

    def _generate_and_score_completions(self, inputs):
        if not self._prompt_optional and self.environment_factories is None:
            checks.check_batch_prompts(inputs)
        output = super()._generate_and_score_completions(inputs)
        checks.check_context(output["prompt_mask"].sum(1).tolist(), self.max_completion_length, self._max_positions,
                             lambda i: f"row {i} of this process's generation batch ({checks.short(inputs[i])})")
        mode = "train" if self.model.training else "eval"
        self._generation_count += 1
        output = self._apply_algorithm(output, len(inputs), mode)
        if self.args.loss_normalization == "global":
            loss_mask = output["completion_mask"] * output["tool_mask"] if "tool_mask" in output else output["completion_mask"]
            rows = output["sample_count"].sum() if "sample_count" in output else torch.tensor(loss_mask.shape[0])
            counts = torch.stack([loss_mask.sum().float(), rows.float().to(loss_mask.device)])
            # one unconditional collective per generation batch: every rank reaches it
            output["global_loss_tokens"], output["global_loss_rows"] = self.accelerator.gather(counts.unsqueeze(0)).sum(0)
        return output

    def _group_size(self, mode: str) -> int:
        return self.num_generations if mode == "train" else self.num_generations_eval

    def _local_rows(self, num_local: int) -> slice:
        """This process's rows in the gathered (process-major) order."""
        start = self.accelerator.process_index * num_local
        return slice(start, start + num_local)

    def _apply_algorithm(self, output: dict, num_local: int, mode: str) -> dict:
        """Replace TRL's advantages with the configured advantage function's (and filter rows)."""
        group_size = self._group_size(mode)
        rewards = self._global_rewards()
        local = self._local_rows(num_local)
        unscorable = ~torch.isfinite(rewards)
        metrics: dict[str, Any] = {"unscorable_count": float(unscorable.sum())}
        if self.algorithm.policy_loss_fn == "sft":  # RAFT: SFT on the best completion(s) of each group
            keep = self._best_of_group(rewards, group_size)
            output["completion_mask"] = output["completion_mask"] * keep[local].unsqueeze(1).to(output["completion_mask"].dtype)
            output["advantages"] = torch.zeros_like(output["advantages"])
            metrics["raft/kept_fraction"] = float(keep.float().mean())
        elif self.algorithm.compute_advantage_in_trainer:
            output["advantages"], batch_metrics = self._batch_advantages(output, rewards, group_size, local)
            metrics.update(batch_metrics)
        else:
            advantages, kept, group_metrics = self._group_advantages(rewards, group_size)
            output["advantages"] = advantages[local].to(output["advantages"].device)
            output["completion_mask"] = output["completion_mask"] * kept[local].unsqueeze(1).to(output["completion_mask"].dtype)
            metrics.update(group_metrics)
        self._log_metrics(mode, metrics)
        self._replace_logged_advantages(output["advantages"], output["completion_mask"])
        return output

    def _replace_logged_advantages(self, advantages: torch.Tensor, mask: torch.Tensor) -> None:
        """TRL's completions table (``log_completions``) recorded its own GRPO advantages for this batch;
        put ours there instead (per row; the masked mean for token-level advantages)."""
        # the table is only shown with log_completions (a config value, so every rank skips the gather alike)
        logged = self._logs.get("advantages") if self.log_completions else None
        if logged is None:
            return
        per_row = advantages if advantages.dim() == 1 else (advantages * mask).sum(1) / mask.sum(1).clamp(min=1)
        values = self.accelerator.gather(per_row.float()).tolist()
        for _ in range(min(len(values), len(logged))):
            logged.pop()
        logged.extend(values)

    def _best_of_group(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        grouped = torch.nan_to_num(rewards, nan=-torch.inf).view(-1, group_size)
        best = grouped.max(dim=1, keepdim=True).values
        spread = best > grouped.min(dim=1, keepdim=True).values
        return ((grouped == best) & spread & torch.isfinite(grouped)).view(-1)

    def _group_advantages(self, rewards: torch.Tensor, group_size: int):
        """Run a group operator over every process's completions. Returns ``(advantages (N,),
        kept (N,) bool, metrics)``; rows it filters out (std threshold) or that no reward function
        scored get advantage 0 and are excluded from the loss."""
        values = rewards.tolist()
        experiences = [
            Experience(
                eid=EID(batch=self._generation_count, task=row // group_size, run=row % group_size),
                tokens=torch.zeros(1, dtype=torch.long),
                prompt_length=0,
                reward=value,
            )
            for row, value in enumerate(values)
            if math.isfinite(value)
        ]
        out, metrics = self.advantage_fn(experiences)
        advantages = torch.zeros(len(values), dtype=torch.float32)
        kept = torch.zeros(len(values), dtype=torch.bool)
        for exp in out:
            row = exp.eid.task * group_size + exp.eid.run
            advantages[row] = exp.advantages[0]
            kept[row] = True
        return advantages, kept, metrics

    def _batch_advantages(self, output: dict, rewards: torch.Tensor, group_size: int, local: slice):
        """Run a batch (trainer-side) advantage function on the padded batch of every process, after
        the optional KL reward penalty, and return this process's ``(B, T)`` advantages."""
        completion_mask = output["completion_mask"]
        response_mask = completion_mask * output["tool_mask"] if "tool_mask" in output else completion_mask
        local_rewards = rewards[local].to(completion_mask.device)
        scorable = torch.isfinite(local_rewards)
        response_mask = response_mask * scorable.unsqueeze(1).to(response_mask.dtype)
        output["completion_mask"] = completion_mask * scorable.unsqueeze(1).to(completion_mask.dtype)
        # rows whose mask is empty (mask_truncated_completions) keep their reward, on the last column, as
        # TRL keeps them in the group baseline; the mask still excludes them from the loss
        placement = torch.where(completion_mask.sum(1, keepdim=True) > 0, completion_mask, torch.ones_like(completion_mask))
        batch: dict[str, Any] = {
            "token_level_scores": scalar_rewards_to_token_level(torch.nan_to_num(local_rewards), placement),
            "response_mask": response_mask,
            **self._advantage_inputs(output),
        }
        metrics: dict[str, Any] = {}
        needs_old = self.kl_penalty.name != "none" or self.algorithm.advantage_fn == "on_policy_distill"
        if needs_old:
            batch["old_log_probs"] = self._behaviour_logps(output)
        if self.algorithm.advantage_fn == "on_policy_distill":
            batch["teacher_logprobs"] = self._teacher_logps(output)
        if self.kl_penalty.name != "none":
            batch["ref_log_prob"] = output["ref_per_token_logps"]
        global_batch = self._gather_padded(batch)
        if self.kl_penalty.name != "none":
            controller_state = self.kl_penalty.state_dict()
            global_batch, penalty_metrics = self.kl_penalty.apply_kl_penalty_to_reward(global_batch)
            if not self.model.training:  # evaluation measures; only training moves the adaptive coefficient
                self.kl_penalty.load_state_dict(controller_state)
            metrics.update({f"critic/{k}": v for k, v in penalty_metrics.items()})
        else:
            global_batch["token_level_rewards"] = global_batch["token_level_scores"]
        rows = global_batch["response_mask"].shape[0]
        uid = torch.arange(rows) // group_size
        # unscorable rows form their own groups so they cannot bias a group baseline
        unscored = ~torch.isfinite(rewards.cpu())
        uid[unscored] = -1 - torch.arange(int(unscored.sum()))
        global_batch["uid"] = uid
        if self.algorithm.advantage_fn in _WHITENED_ADVANTAGES and int((global_batch["response_mask"] != 0).sum()) < 2:
            # whitening needs two tokens; with fewer (e.g. every completion truncated and masked) nothing
            # is trained, so every advantage is 0 instead of an error deep inside the whitening
            zeros = torch.zeros_like(global_batch["token_level_rewards"], dtype=torch.float32)
            global_batch.update(advantages=zeros, returns=zeros.clone())
            adv_metrics = {}
        else:
            global_batch, adv_metrics = self.advantage_fn(global_batch)
        metrics.update(adv_metrics)
        width = completion_mask.shape[1]
        metrics.update(self._advantage_outputs(output, global_batch, local, width))
        return global_batch["advantages"][local, :width].to(completion_mask.device), metrics

    def _advantage_inputs(self, output: dict) -> dict[str, torch.Tensor]:
        """Extra ``(B, T)`` inputs of the batch advantage function (PPO: the critic's values),
        gathered from every process like the rewards."""
        return {}

    def _advantage_outputs(self, output: dict, global_batch: dict, local: slice, width: int) -> dict[str, Any]:
        """Hook after the batch advantage function: copy more of its outputs (PPO: ``returns``) into
        this process's ``output``; returns metrics."""
        return {}

    def _gather_padded(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every process's ``(B, T)`` tensors, right-padded to a common width and concatenated in
        process order (the order TRL gathers rewards in)."""
        out = {}
        for key, value in batch.items():
            padded = self.accelerator.pad_across_processes(value, dim=1, pad_index=0)
            out[key] = self.accelerator.gather(padded)
        return out

    @torch.no_grad()
    def _forward_logps(self, model, output: dict) -> torch.Tensor:
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, output["completion_ids"].size(1),
            batch_size=self.args.per_device_train_batch_size,
            **{key: output[key] for key in _FORWARD_KEYS if key in output},
        )
        return logps

    def _behaviour_logps(self, output: dict) -> torch.Tensor:
        """Log-probs of the policy that generated the batch: TRL's ``old_per_token_logps`` when it
        computed them, else one no-grad forward of the current (= behaviour) policy."""
        if output.get("old_per_token_logps") is None:
            output["old_per_token_logps"] = self._forward_logps(self.model, output)
        return output["old_per_token_logps"]

    @torch.no_grad()
    def _reference_logps(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """Reference log-probs of extra rows (expert rows, step rows), obtained as TRL obtains them
        for rollouts: the reference model, or the policy with its adapter disabled under PEFT."""
        from trl.trainer.utils import use_adapter

        if self.ref_model is not None:
            return self._forward_logps(self.ref_model, rows)
        model = self.accelerator.unwrap_model(self.model)
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            return self._forward_logps(self.model, rows)

    def _teacher_logps(self, output: dict) -> torch.Tensor:
        return self._forward_logps(self.teacher_model, output)

    # ------------------------------------------------------------------------------------- loss
    def _loss_inputs(self, inputs: dict, logps: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
        """Keyword inputs of the policy loss (subclasses add theirs)."""
        advantages = inputs["advantages"]
        if "importance_sampling_ratio" in inputs:
            # TRL weights each token's loss by the vLLM IS ratio; every advantage-linear loss gets the
            # same weighting from scaled advantages (ratio >= 0 keeps signs and clip branches)
            if advantages.dim() == 1:
                advantages = advantages.unsqueeze(1)
            advantages = advantages * inputs["importance_sampling_ratio"]
        old = inputs.get("old_per_token_logps")
        return {
            "logprob": logps,
            "old_logprob": logps.detach() if old is None else old,
            "action_mask": mask,
            "advantages": advantages,
            "ref_logprob": inputs.get("ref_per_token_logps"),
        }

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = completion_mask * inputs["tool_mask"] if "tool_mask" in inputs else completion_mask
        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=self.entropy_loss.name != "none",
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _FORWARD_KEYS},
        )
        # numerical guards (checks.py): trained tokens with non-finite inputs leave the mask, and every
        # untrained position is zeroed, so no NaN/inf reaches the loss or its gradient
        mask, guard_metrics = checks.guard_loss_mask(mask, logps, inputs, entropies)
        loss_mask, agg, divisors = self._aggregation(inputs, mask)
        loss_inputs = {k: checks.masked_finite(v, loss_mask) for k, v in self._loss_inputs(inputs, logps, loss_mask).items()}
        logps, entropies = loss_inputs["logprob"], checks.masked_finite(entropies, loss_mask)
        loss, metrics = self._policy_loss_for(mode).evaluate(**loss_inputs)
        metrics = {f"actor/{k}": v for k, v in metrics.items()}
        if self.entropy_loss.name != "none":
            if self.entropy_loss.entropy_coef == 0.0:
                entropies = entropies.detach()  # logged only: no backward through the entropy
            entropy_term, entropy_metrics = self.entropy_loss(
                entropy=entropies, action_mask=loss_mask, expert_mask=loss_inputs.get("expert_mask"), loss_agg_mode=agg
            )
            loss = loss - entropy_term
            metrics.update({f"actor/{k}": v for k, v in entropy_metrics.items()})
        if self.kl_loss.name != "none":
            kl_term, kl_metrics = self.kl_loss.calculate_kl_loss(
                logps, loss_inputs["ref_logprob"], loss_mask, agg, old_logprob=loss_inputs["old_logprob"]
            )
            loss = loss + kl_term
            metrics.update({f"actor/{k}": v for k, v in kl_metrics.items()})
        if mode == "train":
            loss = loss * self._loss_scale(inputs, *divisors)
        if self.aux_loss_enabled:
            normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / normalizer
            metrics["aux_loss"] = aux_loss.detach()
        guard_metrics["guards/nonfinite_loss"] = float(not checks.is_finite(loss))
        if guard_metrics["guards/nonfinite_loss"]:  # e.g. an unclamped ratio overflowed: skip this micro-batch
            loss = checks.zero_loss(model)
        metrics["actor/loss"] = loss.detach()
        self._log_metrics(mode, {**metrics, **guard_metrics})
        return loss

    def _policy_loss_for(self, mode: str):
        return self.policy_loss

    def _aggregation(self, inputs: dict, mask: torch.Tensor) -> tuple[torch.Tensor, str, tuple]:
        """``(loss mask, aggregation mode, (divisor used, divisor wanted))`` of a micro-batch.

        The loss terms aggregate with ``loss_agg_mode`` over the micro-batch, i.e. divide by a count:
        tokens (``token-mean``), rows (``seq-mean-*``, padding rows included) or the padded width
        (``seq-mean-token-sum-norm``). The wanted divisor counts samples, not padding rows
        (``sample_count``, one per real row); :meth:`_loss_scale` corrects for the difference.
        """
        agg = self.algorithm.loss_agg_mode
        samples = inputs["sample_count"].sum() if "sample_count" in inputs else mask.shape[0]
        if agg == "token-mean":
            return mask, agg, (mask.sum(), mask.sum())
        if agg == "seq-mean-token-sum-norm":
            return mask, agg, (mask.shape[1], mask.shape[1])
        return mask, agg, (mask.shape[0], samples)

    def _loss_scale(self, inputs: dict, used, wanted) -> torch.Tensor | float:
        """Factor applied to a training micro-batch loss: ``used / wanted`` turns the aggregation's
        divisor into the wanted one, and gradient accumulation is accounted for here because
        GRPOTrainer sets ``loss_is_scaled_for_ga`` (transformers does not divide).

        ``loss_normalization="global"``: the wanted divisor is the optimizer step's global count of
        tokens (``token-mean``) or samples (``seq-mean-*``) per process, so after DDP's average every
        token (sample) of the step weighs the same on any number of processes.
        """
        accumulation = self.current_gradient_accumulation_steps
        agg = self.algorithm.loss_agg_mode
        if self.args.loss_normalization == "micro_batch" or agg == "seq-mean-token-sum-norm":
            return used / (torch.as_tensor(wanted).clamp(min=1) * accumulation)
        total = inputs["global_loss_tokens"] if agg == "token-mean" else inputs["global_loss_rows"]
        per_step = total / self.accelerator.num_processes * accumulation / self.args.steps_per_generation
        return used / per_step.clamp(min=1.0)

    # ------------------------------------------------------------------------------ state, logs
    TRAINER_STATE_FILE = "trinity_trainer_state.json"

    def _trainer_state(self) -> dict[str, Any]:
        """State that a checkpoint must carry beyond TRL's (restored on resume)."""
        # micro_step: TRL's micro-step counter, which decides when the next generation happens
        return {"kl_penalty": self.kl_penalty.state_dict(), "kl_loss": self.kl_loss.state_dict(),
                "generation_count": self._generation_count, "micro_step": self._step}

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        self.kl_penalty.load_state_dict(state["kl_penalty"])
        self.kl_loss.load_state_dict(state["kl_loss"])
        self._generation_count = state["generation_count"]
        self._step = state.get("micro_step", self._step)

    # a checkpoint taken while a generation batch is still being trained on (num_iterations > 1, or
    # steps_per_generation > gradient_accumulation_steps) keeps each process's remaining batch, so a
    # resumed run trains on the same rows instead of generating a new batch early
    BUFFER_FILE = "trinity_generation_buffer_rank{rank}.pt"

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            with open(os.path.join(folder, self.TRAINER_STATE_FILE), "w", encoding="utf-8") as f:
                json.dump(self._trainer_state(), f)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._buffered_inputs is not None and self._step % generate_every != 0:
            os.makedirs(folder, exist_ok=True)
            torch.save(self._buffered_inputs, os.path.join(folder, self.BUFFER_FILE.format(rank=self.accelerator.process_index)))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, self.TRAINER_STATE_FILE) if checkpoint else None
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                self._load_trainer_state(json.load(f))
        buffer = os.path.join(checkpoint, self.BUFFER_FILE.format(rank=self.accelerator.process_index)) if checkpoint else None
        if buffer and os.path.isfile(buffer):
            self._buffered_inputs = torch.load(buffer, map_location=self.accelerator.device, weights_only=False)

    _OWN_METRIC_PREFIXES = ("actor/", "critic/", "chord/", "group_advantages/", "multi_step/", "raft/", "kl/",
                            "advantages/", "filtered_count", "unscorable_count", "experience_count",
                            "skipped_group_ratio", "guards/")

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # our metrics are appended per process (key sets may differ across ranks, e.g. usual/* needs
        # usual rows): pool every rank's values before TRL averages them, as TRL does for its own
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            mode = "train" if self.model.training else "eval"
            own = {k: list(v) for k, v in self._metrics[mode].items() if k.startswith(self._OWN_METRIC_PREFIXES)}
            pooled: dict[str, list[float]] = {}
            for rank_metrics in gather_object([own]):
                for key, values in rank_metrics.items():
                    pooled.setdefault(key, []).extend(values)
            for key, values in pooled.items():
                self._metrics[mode][key] = values
        # guard metrics are counts: the number of events since the last log line, over every process
        metrics = self._metrics["train" if self.model.training else "eval"]
        for key in [k for k in metrics if k.startswith("guards/")]:
            metrics[key] = [sum(metrics[key])]
        super().log(logs, start_time)

    def _log_metrics(self, mode: str, metrics: dict[str, Any]) -> None:
        """Append metrics to TRL's per-mode lists (averaged at logging time). Values are this
        process's; no collective is issued, so ranks may log different key sets."""
        for key, value in metrics_to_floats(metrics).items():
            self._metrics[mode][key].append(value)
