"""``TrinityTrainer``: TRL's ``GRPOTrainer`` with Trinity-RFT's losses, KL terms and advantages.

It owns the seams of ``GRPOTrainer`` (see the TRL notes) and little else; the work is done by objects it composes
(docs/contributing.md#trainer-seams):

* ``_generate_and_score_completions``: after TRL has generated and scored a batch, replace its
  advantages (``advantage_estimator``, `trinity_trl.training.advantages`) and let a subclass add or expand
  rows (`_training_batch`);
* ``_compute_loss``: policy loss − entropy term + KL loss from one forward pass through TRL's own log-prob helper,
  read from a `trinity_trl.training.loss.LossBatch` and normalised by ``loss_normalizer``
  (`trinity_trl.training.loss.LossNormalizer`);
* the log-prob and baseline passes a component asks for (``scoring``, `trinity_trl.training.scoring.Scoring`),
  checkpoint extras (``state_files``, `trinity_trl.checkpointing.checkpoints.TrainerStateFiles`) and metric
  pooling (`trinity_trl.training.metrics`).

What a component needs (reference, behaviour or teacher log-probs, expert rows, linearity in the
advantage, ...) is asked from the component itself, so a loss registered outside the package works
here unchanged. Everything else (generation, vLLM, reward functions, PEFT, logging) is TRL's.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer

from ..checkpointing.checkpoints import CompleteCheckpoints, TrainerStateFiles
from ..data.model import resolve_model
from ..packing import PrefixPacking
from ..packing.compiled import compile_backend
from ..packing.selection import CompileBudget, gather_objects
from ..training import checks
from ..training.advantages import AdvantageEstimator, Advantages, AdvantageSources, refill_rows, weighted_rewards
from ..training.decoding import GroupedDecoding, choose_decoding, compile_refusal, model_facts, plan_decoding
from ..training.engines import engine_of, zero_stage
from ..training.grpo_seams import (
    bind_trl_arguments,
    captured_return,
    input_hooks_kept,
    reopen_trackio_run,
    temporarily,
    trained_mask,
    use_cpu_colocate_weight_sync,
    whole_groups,
)
from ..training.loss import LossBatch, LossNormalizer
from ..training.metrics import append_metrics, pool_metrics, replace_logged_advantages, use_concise_progress
from ..training.scoring import Scoring
from ..training.step_mask import STEP_MASK_KEY, STEP_MASK_STEP_KEY, StepTokens, process_gather, step_masks, step_members
from ..training.token_budget import MicroStep, TokenBudget, resolve_token_budget
from ..training.trl_generation import FORWARD_KEYS, TRLGeneration
from .card import AlgorithmCardMixin
from .common import default_output_dir, load_processor, prepare_teacher
from .components import TrainerCapabilities
from .config import TrinityConfig, from_trl_config
from .machine import check_run, start_run
from .trinity_loss import TrinityLossMixin


class TrinityTrainer(AlgorithmCardMixin, CompleteCheckpoints, TrinityLossMixin, TrainerCapabilities, GRPOTrainer):
    """A ``GRPOTrainer`` that runs any Trinity-RFT algorithm preset (see [`TrinityConfig`][]).

    Arguments are those of [`GRPOTrainer`](https://huggingface.co/docs/trl/grpo_trainer#trl.GRPOTrainer), plus
    ``teacher_model`` (a model or path) for on-policy distillation. ``args`` must be a
    [`TrinityConfig`][] (or a subclass).
    """

    _tag_names = ["trl", "trinity_trl"]
    _name = "Trinity"
    config_class: ClassVar[type[TrinityConfig]] = TrinityConfig
    # --- what a subclass adds (checked against what the components need; and `TrainerCapabilities`) ---
    #: every dataset row needs a non-empty ``prompt`` (StepGRPOTrainer: environments may supply it)
    requires_prompt: ClassVar[bool] = True
    #: the rollouts add inputs of the reward functions beyond the dataset's columns (StepGRPOTrainer: env_reward)
    rollouts_add_reward_inputs: ClassVar[bool] = False

    def __init__(self, model, reward_funcs=None, args: TrinityConfig | None = None, *pos, teacher_model=None, **kwargs):
        model, teacher_model = resolve_model(model), resolve_model(teacher_model)  # "bundled" works everywhere
        args = (
            self.config_class(output_dir=default_output_dir(model, self.config_class.__name__))
            if args is None
            else args
        )
        args = from_trl_config(args, self.config_class, type(self).__name__)  # a plain GRPOConfig is converted
        checks.check_owned_arguments(type(self).__name__, kwargs)  # expert_dataset: ChordTrainer's, ...
        given = bind_trl_arguments(GRPOTrainer, model, reward_funcs, args, *pos, **kwargs)
        self.components = args.take_components()  # built once, when the config was checked
        self.algorithm = self.components.algorithm
        checks.check_components(
            type(self), self.algorithm, self.components, args, teacher_model, given.get("rollout_func")
        )
        # reward functions against the columns (unless rollouts add inputs: an environment, a rollout_func's fields)
        if not (self.rollouts_add_reward_inputs or given.get("environment_factory") or given.get("rollout_func")):
            checks.check_reward_columns(given.get("reward_funcs"), given.get("train_dataset"), "train_dataset")
            checks.check_reward_columns(given.get("reward_funcs"), given.get("eval_dataset"), "eval_dataset")
        if isinstance(model, str) and given.get("processing_class") is None:
            given["processing_class"] = load_processor(model, args)
        if self.requires_prompt and given.get("environment_factory") is None:
            checks.check_prompt_dataset(given.get("train_dataset"), "train_dataset")
            checks.check_prompt_dataset(given.get("eval_dataset"), "eval_dataset")
        # TRL loads a reference model (or disables the adapter for it) iff beta != 0 (see grpo_seams)
        start_run(args)
        with temporarily(args, beta=1.0 if self.algorithm.needs_reference else 0.0):
            super().__init__(**given)
        check_run(self.accelerator, self.args)
        self.reward_funcs = [
            f if isinstance(f, torch.nn.Module) else checks.checked_reward_func(f, name)
            for f, name in zip(self.reward_funcs, self.reward_func_names)
        ]
        if self.rollout_func is not None:
            self.rollout_func = checks.checked_rollout_func(self.rollout_func)
        self.teacher_model = (
            None
            if teacher_model is None
            else prepare_teacher(teacher_model, self.accelerator, self.model.dtype, self.temperature)
        )
        self.generation = TRLGeneration(self)
        # one compile budget per run: compiled generation, compiled layers (prefix_packing_compile), a forced flex
        self.compile_budget = CompileBudget()
        self.decoding = self._decoding(args)  # compile_generation, one_prefill_per_group (training/decoding.py)
        # the forward and reward passes are looked up at call time: TRL's seams (grpo_seams.captured_return) and
        # subclasses wrap them on the instance
        self.scoring = Scoring(
            forward=lambda *a, **k: self._get_per_token_logps_and_entropies(*a, **k),
            batch_size=args.per_device_train_batch_size,
            policy=lambda: self.model,
            reference=self.ref_model,
            unwrap=self.accelerator.unwrap_model,
            teacher=self.teacher_model,
            generation=self.generation,
            score=lambda *a: self._calculate_rewards(*a),
            reward_weights=self.reward_weights,
        )
        self.prefix_packing = PrefixPacking(
            args.prefix_packing,
            args.prefix_packing_max_token_ratio,
            self.accelerator.unwrap_model,
            self.accelerator.autocast,
            args.prefix_packing_kernel,
            self.accelerator.device,
            gather=gather_objects if self.accelerator.num_processes > 1 else None,
            compile=compile_backend(args.prefix_packing_compile, engine_of(self.accelerator)),
            compile_budget=self.compile_budget,
        )
        self.add_callback(_PackingVerdicts(self.prefix_packing))
        self.token_budget = TokenBudget(  # prefix_packing_token_budget (training/token_budget.py)
            resolve_token_budget(
                args.prefix_packing_token_budget,
                type(self).__name__,
                engine_of(self.accelerator),
                self.supports_expert_rows,
                args.prefix_packing,
            ),
            self.prefix_packing,
            forward=lambda model, ids, mask, keep, batch_size: self._get_per_token_logps_and_entropies(
                model, ids, mask, keep, batch_size, self.components.entropy_loss.enabled, packed_only=True
            ),
            backward=lambda loss: self.accelerator.backward(loss),  # looked up at call time (benchmarks wrap it)
            no_sync=lambda model: self.accelerator.no_sync(model),
            metrics=lambda metrics: append_metrics(self._metrics["train"], metrics),
            aux_loss=self.aux_loss_enabled,
        )
        self.loss_normalizer = LossNormalizer(
            args.loss_normalization, self.accelerator.num_processes, args.steps_per_generation
        )
        self._gather_step_tokens = process_gather(  # a step mask's tokens of every process (training/step_mask.py)
            self.accelerator.gather,
            self.accelerator.pad_across_processes,
            self.accelerator.process_index,
            self.accelerator.num_processes,
        )
        self.advantage_estimator = AdvantageEstimator(
            self.components.advantage_fn,
            self.components.policy_loss,
            self.components.kl_penalty,
            self.accelerator.gather,
            self.accelerator.pad_across_processes,
            args.seed,
        )
        self.state_files = TrainerStateFiles(self.accelerator.process_index, self.accelerator.device)
        self._generation_count = 0
        self._max_positions = checks.model_max_positions(self.accelerator.unwrap_model(self.model))
        checks.check_completion_room(self.max_completion_length, self._max_positions)
        self._set_card_identity()
        use_cpu_colocate_weight_sync(self)  # vLLM colocated on a CPU (grpo_seams)
        use_concise_progress(self)  # one line per logging step, not transformers' metric dict (training/metrics)

    # ----------------------------------------------------------------------------- subclass hooks
    def _training_batch(self, output: dict, inputs: list[dict], rewards: torch.Tensor, mode: str) -> dict:
        """Turn TRL's scored batch into the training batch: our advantages replace TRL's. Subclasses add
        rows (ChordTrainer: demonstrations) or expand runs into steps (StepGRPOTrainer).

        ``inputs``: the rows (with the extra fields a ``rollout_func`` returned); ``rewards``: ``(N,)``
        every process's weighted rewards, NaN where no reward function scored.
        """
        loss_mask = trained_mask(output)
        result = self.advantage_estimator(
            rewards,
            loss_mask,
            self._local_rows(len(inputs)),
            self._group_size(mode),
            self._generation_count,
            mode == "train",
            self._advantage_sources(output, inputs),
        )
        if result.source_rows is not None:  # filtered groups refilled with copies of kept ones (duplicate_experiences)
            pad = {"prompt_ids": self._tokenizer.pad_token_id, "completion_ids": self._tokenizer.pad_token_id}
            output = refill_rows(
                output,
                result.source_rows,
                self._local_rows(len(inputs)),
                self.accelerator.gather,
                self.accelerator.pad_across_processes,
                pad,
            )
        output["advantages"] = result.advantages
        output["completion_mask"] = output["completion_mask"] * result.loss_rows.unsqueeze(1).to(
            output["completion_mask"].dtype
        )
        self._use_advantage_extras(output, result)
        append_metrics(self._metrics[mode], result.metrics)
        self._show_advantages_in_completions_table(output["advantages"], output["completion_mask"])
        return output

    def _advantage_sources(self, output: dict, inputs: list[dict]) -> AdvantageSources:
        """Lazily computed per-token inputs of the advantage functions (PPOTrainer adds critic values).
        Teacher log-probs: those a ``rollout_func`` returned with the rollout (``teacher_logprobs``, as
        Trinity's workflows store them), else a forward of ``teacher_model``."""
        mode = "train" if self.model.training else "eval"
        return AdvantageSources(
            behaviour_logps=lambda: self.scoring.behaviour_logps(output),
            reference_logps=lambda: output.get("ref_per_token_logps"),
            teacher_logps=lambda: self.scoring.teacher_logps(output, inputs),
            reward_baselines=lambda: self.scoring.greedy_reward_baselines(
                inputs, self._group_size(mode), self._metrics[mode]
            ),
        )

    def _use_advantage_extras(self, output: dict, result: Advantages) -> None:
        """Hook for more outputs of a batch advantage function (PPOTrainer: ``returns``)."""

    def _trainer_state(self) -> dict[str, Any]:
        """State a checkpoint carries beyond TRL's (``trinity_trainer_state.json``); subclasses add theirs
        (``micro_step``: TRL's counter, which decides when the next generation happens)."""
        return {
            "kl_penalty": self.components.kl_penalty.state_dict(),
            "kl_loss": self.components.kl_loss.state_dict(),
            "generation_count": self._generation_count,
            "micro_step": self._step,
        }

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        self.components.kl_penalty.load_state_dict(state["kl_penalty"])
        self.components.kl_loss.load_state_dict(state["kl_loss"])
        self._generation_count = state["generation_count"]
        self._step = state.get("micro_step", self._step)

    # ------------------------------------------------------------------------------ checkpoints
    def _save_checkpoint_extras(self, folder: str) -> None:
        """Our files in a checkpoint (`checkpoints.TrainerStateFiles`), before it is marked complete."""
        super()._save_checkpoint_extras(folder)
        # TRL's micro-step counter inside a generation batch: the rest of the batch is still to be trained on
        inside_batch = self._buffered_inputs is not None and self._step % (
            self.args.steps_per_generation * self.num_iterations
        )
        self.state_files.save(
            folder,
            self._trainer_state() if self.args.should_save else None,
            self._buffered_inputs if inside_batch else None,
        )

    def _load_optimizer_and_scheduler(self, checkpoint):
        """transformers calls this when resuming from ``checkpoint``: our state and unfinished batch come back too."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if not checkpoint:
            return
        state, unfinished_batch = self.state_files.load(checkpoint)
        if state is not None:
            self._load_trainer_state(state)
        if unfinished_batch is not None:
            self._buffered_inputs = unfinished_batch

    # ------------------------------------------------------------------------------- generation
    def _decoding(self, args: TrinityConfig) -> GroupedDecoding:
        """How this run decodes with transformers' ``generate`` (docs/generation.md). With compiled decoding, TRL's
        generation config (built with ``disable_compile=True``) is the seam: compilation on, transformers' static
        cache, its length fixed once from the longest prompt of the datasets."""
        if self.use_vllm or self.use_transformers_continuous_batching:  # no generation config of TRL's to set
            backend = "vLLM" if self.use_vllm else "continuous batching"
            choice = choose_decoding(
                args.compile_generation, args.one_prefill_per_group, device="cpu", backend=backend, refusal=None
            )
            return GroupedDecoding(choice)
        refusal = compile_refusal(
            engine=engine_of(self.accelerator),
            zero3=zero_stage(self.accelerator) == 3,
            cache=self.generation_config.cache_implementation,
            **model_facts(self.accelerator.unwrap_model(self.model)),
        )
        return plan_decoding(
            args.compile_generation,
            args.one_prefill_per_group,
            config=self.generation_config,
            device=self.accelerator.device,
            refusal=refusal,
            longest_prompt=self._longest_prompt,
            owner=type(self).__name__,
            compile_budget=self.compile_budget,
        )

    def _longest_prompt(self) -> int:
        """The longest prompt of the training and evaluation datasets, in tokens as TRL tokenizes them (0 where they
        cannot be read ahead: an iterable dataset, prompts an environment writes)."""
        datasets = [self.train_dataset]
        eval_datasets = self.eval_dataset
        datasets += list(eval_datasets.values()) if isinstance(eval_datasets, dict) else [eval_datasets]
        longest = 0
        for dataset in datasets:
            if self.environment_factories is not None or not hasattr(dataset, "column_names"):
                continue
            if "prompt" not in dataset.column_names or not hasattr(dataset, "__len__"):
                continue
            prompts = dataset["prompt"]
            for start in range(0, len(prompts), 256):
                ids = self.generation.tokenize_conversations(list(prompts[start : start + 256]))
                longest = max([longest, *map(len, ids)])
        return longest

    def _generate_single_turn(self, *args, **kwargs):
        """TRL's generation of one turn (every generation of our trainers passes here), through this run's decoding
        (`trinity_trl.training.decoding.GroupedDecoding.around`); with vLLM, TRL's alone."""
        if self.use_vllm:
            return super()._generate_single_turn(*args, **kwargs)
        with self.decoding.around(self.accelerator.unwrap_model(self.model_wrapped)):
            return super()._generate_single_turn(*args, **kwargs)

    def _generate_and_score_completions(self, inputs):
        if self.requires_prompt and self.environment_factories is None:
            checks.check_batch_prompts(inputs)
        with (
            captured_return(self, "_calculate_rewards") as rewards_per_func,  # gathered rewards (grpo_seams)
            input_hooks_kept(self.accelerator.unwrap_model(self.model_wrapped)),  # TRL's checkpointing toggles
        ):
            output = super()._generate_and_score_completions(inputs)
        checks.check_context(
            output["prompt_mask"].sum(1).tolist(),
            self.max_completion_length,
            self._max_positions,
            lambda i: f"row {i} of this process's generation batch ({checks.short(inputs[i])})",
        )
        mode = "train" if self.model.training else "eval"
        self._generation_count += 1
        rewards = weighted_rewards(rewards_per_func.value, self.reward_weights)
        output = self._training_batch(output, inputs, rewards, mode)
        if self.args.loss_normalization == "global":
            counts = LossNormalizer.global_counts(LossBatch.from_trl(output))
            # one unconditional collective per generation batch: every rank reaches it
            output["global_loss_tokens"], output["global_loss_rows"] = self.accelerator.gather(counts.unsqueeze(0)).sum(
                0
            )
        return output

    def _group_size(self, mode: str) -> int:
        return self.num_generations if mode == "train" else self.num_generations_eval

    def _local_rows(self, num_local: int) -> slice:
        """This process's rows in the gathered (process-major) order."""
        return slice(self.accelerator.process_index * num_local, (self.accelerator.process_index + 1) * num_local)

    def _show_advantages_in_completions_table(self, advantages: torch.Tensor, mask: torch.Tensor) -> None:
        """TRL's completions table (``log_completions``) recorded TRL's advantages; show ours instead."""
        if self.log_completions:  # a config value: every rank takes part in the gather alike
            replace_logged_advantages(self._logs["advantages"], self.accelerator.gather, advantages, mask)

    def _prepare_inputs(self, generation_batch):
        with whole_groups(self):  # prefix_packing_whole_groups: TRL's shuffle by groups, not rows
            return super()._prepare_inputs(generation_batch)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        *,
        packed_only=False,
        **multimodal,
    ):
        """Every log-prob forward passes here: ours (training, behaviour, reference, teacher) and TRL's own
        old/reference passes. It runs the prefix-shared packed layout (`trinity_trl.packing`) where that applies,
        else TRL's padded forward (``packed_only``: returns ``None`` instead, for a merged forward of several
        micro-batches, `trinity_trl.training.token_budget`); both return TRL's ``(logps, entropies, aux_loss)``."""
        packed = self.prefix_packing.logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, multimodal
        )
        mode = "train" if self.model.training else "eval"
        if packed is None and packed_only:
            return None
        # a training forward (with a backward): the tokens it forwards (token budget, docs/prefix-packing.md)
        tokens = {"packing/tokens_per_forward": input_ids.numel() if packed is None else packed.forwarded}
        training = {} if mode != "train" or not torch.is_grad_enabled() else tokens
        if packed is None:
            append_metrics(self._metrics[mode], {"packing/forwarded_token_ratio": 1.0, **training})
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **multimodal,
            )
        append_metrics(
            self._metrics[mode], {"packing/forwarded_token_ratio": packed.forwarded / packed.padded, **training}
        )
        return packed.logps, packed.entropies, None

    # ------------------------------------------------------------------------------------- loss
    def _compute_loss(self, model, inputs):
        if self.model.training and self.components.policy_loss.needs_step_mask:
            self._choose_step_mask(model, inputs)
        if self.model.training and self.token_budget.enabled:  # micro-batches merged into packed forwards
            return self.token_budget.loss(model, inputs, self._micro_step(), self._forward_and_loss)
        return self._forward_and_loss(model, inputs)

    def _choose_step_mask(self, model, inputs) -> None:
        """At the first micro-batch of an optimizer step, the mask a policy loss chooses over the whole step
        (``needs_step_mask``, M2PO; `trinity_trl.training.step_mask`): a pass without gradient over the step's
        micro-batches in TRL's buffer under the current weights, every process's log-ratios gathered; each micro-batch
        carries its part to the loss. A batch without behaviour log-probs (TRL computes none when every micro-batch
        is trained by the weights that generated it) has log-ratios 0: nothing to mask, no pass."""
        if inputs.get("old_per_token_logps") is None or inputs.get(STEP_MASK_STEP_KEY) == self.state.global_step:
            return
        spg = self.args.steps_per_generation
        members = step_members(
            self._buffered_inputs,
            self._step,
            spg,
            spg * self.num_iterations,
            self.current_gradient_accumulation_steps,
            inputs,
        )
        parts = []
        for member in members:
            batch = LossBatch.from_trl(member)
            logps = self.scoring.logps(model, member)
            parts.append(StepTokens.of(self._loss_inputs(batch, logps, batch.mask), batch.mask))
        for member, mask in zip(members, step_masks(self.components.policy_loss, parts, self._gather_step_tokens)):
            member[STEP_MASK_KEY], member[STEP_MASK_STEP_KEY] = mask, self.state.global_step

    def _micro_step(self) -> MicroStep:
        """Where this ``training_step`` stands in transformers' and TRL's loops (the token budget's window)."""
        buffered = self._buffered_inputs
        return MicroStep(
            self.state.global_step,
            getattr(self, "current_gradient_accumulation_steps", 1),
            self.accelerator.sync_gradients,
            buffered,
            self._step % len(buffered) if buffered else 0,
        )

    def _forward_and_loss(self, model, inputs, forward=None):
        """The loss of one micro-batch, normalised as the micro-batch alone. ``forward``: its rows' ``(logps,
        entropies, aux_loss)`` from a forward of several micro-batches (token budget); ``None``: its own forward."""
        mode = "train" if self.model.training else "eval"
        components = self.components
        batch = LossBatch.from_trl(inputs)  # TRL's dict stops here: the loss reads typed fields
        logps, entropies, aux_loss = forward or self._get_per_token_logps_and_entropies(
            model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            inputs["completion_ids"].size(1),
            compute_entropy=components.entropy_loss.enabled,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in FORWARD_KEYS},
        )
        return self._micro_batch_loss(model, batch, logps, entropies, aux_loss, mode)

    # ------------------------------------------------------------------------------ state, logs
    def evaluate(self, *args, **kwargs):
        reopen_trackio_run(self)  # evaluate() after train() with report_to="trackio" (grpo_seams)
        return super().evaluate(*args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        from accelerate.utils import gather_object

        pool_metrics(self._metrics[mode], gather_object if self.accelerator.num_processes > 1 else None)
        super().log(logs, start_time)


class _PackingVerdicts(TrainerCallback):
    """``prefix_packing_kernel='auto'`` with several processes: the verdicts of the shape classes measured so far,
    from every rank's timings, at the end of each optimizer step (every process reaches it)."""

    def __init__(self, packing: PrefixPacking):
        self.packing = packing

    def on_step_end(self, args, state, control, **kwargs):
        self.packing.synchronize()
