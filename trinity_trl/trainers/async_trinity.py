"""``AsyncTrinityTrainer``: Trinity-RFT's algorithms on TRL's asynchronous trainer (``AsyncGRPOTrainer``).

Generation and training overlap: a rollout worker fills a queue with scored samples while the trainer trains on what
is there, dropping samples more than ``max_staleness`` weight syncs old (docs/asynchronous.md). TRL's trainer brings
the queue, the token budget, tree packing (a micro-batch's samples packed into one row, shared prompts forwarded once)
and LoRA adapter sync to vLLM; its loss is one fixed PPO clip. Here the loss is the configured algorithm's, computed by
the same code the synchronous trainers run (`trinity_trl.trainers.trinity_loss.TrinityLossMixin`): any policy loss,
entropy and KL terms, aggregation mode and normalisation, configured as in [`TrinityConfig`][] (the same fields,
presets, YAML and command line; the config and its checks are in `trinity_trl.trainers.async_config`). The seams it
needs beyond TRL's public ones are in `trinity_trl.asynchronous.async_grpo_seams`, each with its reason.

Where samples come from (``generation_backend``):

* ``"transformers"`` (default): `trinity_trl.asynchronous.worker.TransformersRolloutWorker`, a thread that generates
  with transformers from its own copy of the policy (updated between two groups), scores each group with the reward
  functions and computes its advantages with the configured advantage component. Runs on a CPU and on any GPU.
* ``"vllm"``: TRL's own worker against ``vllm_server_base_url`` (``vllm serve``); it computes the group z-score of
  the rewards itself, so the advantage must be the ``grpo`` estimator at its defaults (TRL's z-score then replaces
  it: docs/asynchronous.md#with-vllm).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, ClassVar

import torch

from ..asynchronous.async_grpo_seams import quiet_experimental_import

with quiet_experimental_import():  # TRL's warning that its experimental API may change
    from trl.experimental.async_grpo import AsyncGRPOTrainer

from ..asynchronous.async_grpo_seams import (
    TRL_TREE_ATTENTION,
    PolicyVersions,
    SampleStream,
    StreamLoader,
    account_step,
    cpu_safe_peak_flops,
    kernel_for,
    register_tree_attention,
    release_rollout_dataset,
    tree_attention_refusal,
    tree_plan,
    trl_collator,
)
from ..asynchronous.batch import unpack
from ..asynchronous.progress import GroupLedger
from ..asynchronous.vllm_rewards import RewardSum
from ..asynchronous.worker import GroupScorer, LocalWeightTransfer, TransformersRolloutWorker
from ..checkpointing.checkpoints import CompleteCheckpoints, TrainerStateFiles
from ..data.model import resolve_model
from ..packing.selection import compute_dtype
from ..training import checks
from ..training.advantages import AdvantageEstimator
from ..training.decoding import choose_decoding
from ..training.loss import LossBatch, LossNormalizer
from ..training.metrics import append_metrics, pool_metrics, use_concise_progress
from ..training.step_mask import STEP_MASK_KEY, StepTokens, step_masks
from .async_config import AsyncTrinityConfig, check_async_components, groups_per_step
from .card import AlgorithmCardMixin
from .common import default_output_dir, load_processor
from .components import TrainerCapabilities
from .config import from_trl_config
from .machine import check_run, start_run
from .trinity_loss import TrinityLossMixin

logger = logging.getLogger("trinity_trl")


def check_model_config(model: str, args: AsyncTrinityConfig) -> None:
    """Refuse, in one line and before any weight loads, a model whose attention our tree kernels cannot run
    (`trinity_trl.asynchronous.async_grpo_seams.tree_attention_refusal`), read from its config."""
    from transformers import AutoConfig

    kwargs = _init_kwargs(args)
    config = AutoConfig.from_pretrained(
        model, trust_remote_code=kwargs["trust_remote_code"], revision=kwargs.get("revision")
    )
    reason = tree_attention_refusal(config)
    if reason is not None:
        raise ValueError(f"{model}: {reason}")


def _init_kwargs(args: AsyncTrinityConfig) -> dict[str, Any]:
    """How TRL's AsyncGRPOTrainer loads the policy (``model_init_kwargs``, with ``trust_remote_code`` and ``dtype``),
    for the other copies of the checkpoint: the worker's and the KL terms' reference."""
    kwargs = dict(args.model_init_kwargs or {})
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    kwargs.setdefault("dtype", args.dtype)
    return kwargs


class AsyncTrinityTrainer(
    AlgorithmCardMixin, CompleteCheckpoints, TrinityLossMixin, TrainerCapabilities, AsyncGRPOTrainer
):
    """TRL's ``AsyncGRPOTrainer`` running any Trinity-RFT algorithm (see the module docs and [`AsyncTrinityConfig`][]).

    Arguments are those of TRL's ``AsyncGRPOTrainer``: ``model`` (an id or a path; ``"bundled"`` for the bundled
    model), ``reward_funcs``, ``args``, ``train_dataset``, ``processing_class``, ``callbacks``, ``optimizers``,
    ``peft_config``, ``tools`` and ``environment_factory`` (with ``generation_backend="vllm"`` only), ``rollout_worker``
    and ``weight_transfer`` (a worker and transfer of your own, TRL's protocols).

    Logged beyond TRL's metrics: ``actor/*`` (the loss terms, as the synchronous trainers), ``async/staleness`` and
    ``async/staleness_max`` (optimizer steps between the weights that generated a trained sample and those it trains),
    ``guards/*`` and the worker's ``rollout/*`` and advantage metrics.
    """

    _tag_names = ["trl", "trinity_trl", "async-grpo"]
    _name = "Trinity"
    config_class: ClassVar[type[AsyncTrinityConfig]] = AsyncTrinityConfig
    #: the training dataset must be prompts (a ``prompt`` column); a trainer whose tasks may come from an
    #: environment's ``reset()`` checks its dataset itself
    requires_prompt_dataset: ClassVar[bool] = True

    def __init__(
        self,
        model: str,
        reward_funcs=None,
        args: AsyncTrinityConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools=None,
        environment_factory=None,
        rollout_worker=None,
        weight_transfer=None,
    ):
        model = resolve_model(model)
        if not isinstance(model, str):
            raise TypeError(
                f"{type(self).__name__} takes a model id or path (TRL's AsyncGRPOTrainer loads the model itself), got "
                f"{type(model).__name__}; save_pretrained() it and pass the folder"
            )
        if args is None:
            args = self.config_class(output_dir=default_output_dir(model, self.config_class.__name__))
        args = from_trl_config(args, self.config_class, type(self).__name__)  # a plain AsyncGRPOConfig is converted
        check_model_config(model, args)  # before any weight loads
        self.components = args.take_components()
        self.algorithm = self.components.algorithm
        check_async_components(type(self), self.components, args)
        reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        reward_funcs = [f for f in reward_funcs if f is not None]
        if any(isinstance(f, (str, torch.nn.Module)) for f in reward_funcs):
            raise TypeError(f"{type(self).__name__} takes reward functions (callables), not reward models")
        weights = args.reward_weights if args.reward_weights is not None else [1.0] * len(reward_funcs)
        if len(weights) != len(reward_funcs):
            raise ValueError(f"reward_weights has {len(weights)} values for {len(reward_funcs)} reward functions")
        if processing_class is None:
            processing_class = load_processor(model, args)
        if environment_factory is None and self.requires_prompt_dataset:
            checks.check_prompt_dataset(train_dataset, "train_dataset")
        start_run(args)
        own_worker = args.generation_backend == "transformers" and rollout_worker is None
        if args.generation_backend == "transformers":
            if tools or environment_factory is not None:
                raise ValueError(
                    "tools and environment_factory need TRL's multi-turn worker: set generation_backend='vllm'"
                )
            if own_worker and not reward_funcs:
                raise ValueError(f"{type(self).__name__} needs reward_funcs: its worker scores each group with them")
            if own_worker:
                rollout_worker = self._transformers_worker(model, args, processing_class, train_dataset, reward_funcs)
                weight_transfer = weight_transfer or LocalWeightTransfer(rollout_worker)
        if not own_worker:  # TRL's vLLM worker or the user's: our decoding options do not reach it (one line if set)
            choose_decoding(
                args.compile_generation,
                args.one_prefill_per_group,
                device="cpu",
                backend="TRL's vLLM worker" if rollout_worker is None else "the rollout_worker passed in",
                refusal=None,
            )
            trl_rewards = reward_funcs
        else:
            trl_rewards = [RewardSum(reward_funcs, list(weights))] if reward_funcs else []
        with cpu_safe_peak_flops():  # async_grpo_seams 1
            super().__init__(
                model=model,
                reward_funcs=trl_rewards,
                args=args,
                train_dataset=train_dataset,
                processing_class=processing_class,
                callbacks=callbacks,
                optimizers=optimizers,
                peft_config=peft_config,
                tools=tools,
                environment_factory=environment_factory,
                rollout_worker=rollout_worker,
                weight_transfer=weight_transfer,
            )
        register_tree_attention()  # async_grpo_seams 2: after TRL's __init__ registered its own
        check_run(self.accelerator, self.args)
        if self.accelerator.num_processes > 1:
            raise ValueError(
                f"{type(self).__name__} runs in one process for now (several processes are not tested yet); "
                "launch it without torchrun / accelerate launch"
            )
        self._tree_kernel = functools.partial(kernel_for, self.args.tree_attention_kernel, self.accelerator.device)
        if own_worker:
            rollout_worker.max_queued_samples = self.args.max_inflight_tasks  # TRL's default is set in its __init__
        if self.args.generation_backend == "transformers" and self.args.token_budget is None:
            # TRL's default asks the vLLM server for its max_model_len; without a server, micro-batches of
            # per_device_train_batch_size samples, as the synchronous trainers' (set token_budget for TRL's budget)
            self.args.token_budget = 0
        self.ref_model = self._reference_model(model) if self.algorithm.needs_reference else None
        self.loss_normalizer = LossNormalizer(
            self.args.loss_normalization, self.accelerator.num_processes, self.args.gradient_accumulation_steps
        )
        self.state_files = TrainerStateFiles(self.accelerator.process_index, self.accelerator.device)
        self.policy_versions = PolicyVersions()
        self.group_ledger = GroupLedger()  # the groups trained and dropped, for the checkpoint's resume position
        self._dropped_before = 0  # groups dropped whole before the checkpoint this run resumed from
        self.skipped_steps = 0  # optimizer steps of this run that had no sample to train (none taken)
        if self.accelerator.is_main_process:
            self.rollout_queue = self._sample_stream(self.rollout_queue)  # async_grpo_seams 3
        self._set_card_identity()
        use_concise_progress(self)

    # ------------------------------------------------------------------------------------ construction
    def _transformers_worker(self, model: str, args, tokenizer, dataset, reward_funcs) -> TransformersRolloutWorker:
        """Our worker, with its own copy of the policy loaded as TRL loads the trainer's (on the trainer's device)."""
        from ..training.grpo_seams import create_model_from_path, get_callable_name

        copy = create_model_from_path(model, device_map=None, attn_implementation="sdpa", **_init_kwargs(args))
        copy.to(args.device)
        eos = copy.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if tokenizer.eos_token_id not in eos:
            eos = [tokenizer.eos_token_id, *eos]
        weights = args.reward_weights if args.reward_weights is not None else [1.0] * len(reward_funcs)
        names = [get_callable_name(f) for f in reward_funcs]
        estimator = AdvantageEstimator(
            self.components.advantage_fn,
            self.components.policy_loss,
            self.components.kl_penalty,
            gather=lambda x: x,  # one group is the whole "generation batch"
            pad_across_processes=lambda x, **kwargs: x,
            seed=args.seed,
        )
        scorer = GroupScorer(
            [checks.checked_reward_func(f, n) for f, n in zip(reward_funcs, names)],
            names,
            torch.tensor(weights, dtype=torch.float32),
            estimator,
        )
        return self._make_worker(
            copy,
            tokenizer,
            dataset,
            scorer,
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            eos_token_ids=eos,
            chat_template_kwargs=args.chat_template_kwargs,
            queue_maxsize=args.queue_maxsize,
            seed=args.seed,
            groups_per_generate=groups_per_step(args),
            compile_generation=args.compile_generation,
            one_prefill_per_group=args.one_prefill_per_group,
        )

    def _make_worker(self, *args: Any, **kwargs: Any) -> TransformersRolloutWorker:
        """The worker of `_transformers_worker`'s arguments (a subclass may build its own kind of worker:
        `AsyncStepGRPOTrainer`)."""
        return TransformersRolloutWorker(*args, **kwargs)

    def _reference_model(self, model: str):
        """The frozen reference of the KL terms: ``None`` under PEFT (the policy with its adapter disabled, as TRL
        does), else a second copy of the checkpoint with TRL's packed attention and fused head."""
        from accelerate.utils import is_peft_model

        from ..training.engines import prepare_frozen_model
        from ..training.grpo_seams import add_fused_lm_head, create_model_from_path

        if is_peft_model(self.accelerator.unwrap_model(self.model)):
            return None
        reference = create_model_from_path(
            model, device_map=None, attn_implementation=TRL_TREE_ATTENTION, **_init_kwargs(self.args)
        )
        reference.eval().requires_grad_(False)
        add_fused_lm_head(reference, temperature=self.temperature, outputs=("log_probs", "entropy"))
        return prepare_frozen_model(reference, self.accelerator)

    def _sample_stream(self, source) -> SampleStream:
        """The stream TRL's queue dataset reads: the worker's samples, stamped with their policy versions; a sample
        TRL's staleness filter will drop is recorded in the group ledger."""
        return SampleStream(source, self.policy_versions, kept=self._kept_by_trl, ledger=self.group_ledger)

    def _kept_by_trl(self, model_version: int) -> bool:
        """TRL's staleness filter: whether its queue dataset keeps a sample of ``model_version`` now."""
        return self.model_version - model_version <= self.args.max_staleness

    def _too_stale(self, model_versions: torch.Tensor) -> torch.Tensor:
        """``(S,)`` bool: the samples more than ``max_staleness`` weight syncs behind the weights trained now (a
        demonstration, NaN, never)."""
        return (self.model_version - model_versions) > self.args.max_staleness  # NaN compares False

    # ------------------------------------------------------------------------------------ TRL's seams
    def get_train_dataloader(self):
        with trl_collator():  # async_grpo_seams 3: TRL's collator plus each sample's fields
            prepared = super().get_train_dataloader()
        return StreamLoader(prepared)  # async_grpo_seams 4: no micro-batch is taken before the loop asks for it

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """transformers fetches an optimizer step's micro-batches before the first forward (after the last weight
        sync: `StreamLoader` reads nothing ahead): their totals (trained tokens, samples, demonstrations of every
        process) go into each, for the step-level normalisations. A step whose micro-batches hold no token to train
        (every sample unscorable, filtered or too stale) takes no optimizer step: no batch is handed to the loop, so
        neither ``global_step`` nor the learning-rate schedule advances and the weights are not synced; it is counted
        (``async/skipped_steps_total``, `skipped_steps`) and its groups are used up."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if batches and not any(self._trainable_tokens(b) for b in batches):
            for batch in batches:
                samples = int(batch["sample_count"][0])
                own = batch["sample_expert"][0, :samples] == 0
                stale = self._too_stale(batch["sample_model_version"][0, :samples])
                self.group_ledger.record(batch["sample_group"][0, :samples][own].tolist(), stale[own].tolist())
            self.skipped_steps += 1
            self._metrics["train"]["async/skipped_steps_total"].append(1.0)
            return [], num_items
        totals = {
            "step_trained_tokens": sum(float(b["global_n_tokens"][0]) for b in batches),
            "step_samples": sum(float(b["global_n_samples"][0]) for b in batches),
            "step_expert_samples": sum(float(b["global_n_expert"][0]) for b in batches),
        }
        for batch in batches:
            batch.update({key: torch.tensor([value]) for key, value in totals.items()})
        if batches and self.components.policy_loss.needs_step_mask:
            self._choose_step_mask(batches)
        return batches, num_items

    def _trainable_tokens(self, batch: dict[str, Any]) -> float:
        """The tokens of one micro-batch (this process's row) the loss would train: those of its samples within
        ``max_staleness``."""
        samples = int(batch["sample_count"][0])
        keep = ~self._too_stale(batch["sample_model_version"][0, :samples])
        return float((batch["sample_trained_tokens"][0, :samples] * keep).sum())

    def _choose_step_mask(self, batches: list[dict[str, Any]]) -> None:
        """The mask a policy loss chooses over the whole optimizer step (``needs_step_mask``, M2PO;
        `trinity_trl.training.step_mask`): before the step's first forward, a pass without gradient over its
        micro-batches under the current weights (one process: nothing to gather); each micro-batch carries its part,
        one value per loss term as TRL lists them, to the loss."""
        model, parts, layouts = self.model_wrapped, [], []
        with torch.no_grad(), self.compute_loss_context_manager():
            for batch in batches:
                inputs = {k: v.to(self.args.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                packed = unpack(inputs)
                outputs, _ = self._forward_packed(model, packed)
                logps, mask, _ = self._sample_rows(packed, outputs)
                loss_batch = LossBatch(
                    mask=mask, advantages=packed.pad(packed.advantages), old_logps=packed.pad(packed.old_logps)
                )
                parts.append(StepTokens.of(self._loss_inputs(loss_batch, logps, mask), mask))
                layouts.append(packed.layout)
        for batch, layout, mask in zip(batches, layouts, step_masks(self.components.policy_loss, parts)):
            index = batch["token_index"]  # the row's loss terms (-1: none), as `unpack` selects them
            terms = torch.ones(index.shape, dtype=torch.float32, device=index.device)
            terms[index >= 0] = mask.flatten()[layout.flat].to(index.device, torch.float32)
            batch[STEP_MASK_KEY] = terms

    def _forward_packed(self, model, packed) -> tuple[Any, Any]:
        """The policy's outputs on one packed row (TRL's fused head: per-token log-probs and entropies) and the row's
        tree plan (built once per forward: every layer and the backward use it)."""
        device = packed.token_index.device
        kernel = self._tree_kernel(compute_dtype(model, device, self.accelerator.autocast))
        plan = tree_plan(packed.forward, kernel, device)
        router = {"output_router_logits": True} if self.aux_loss_enabled else {}
        return model(**packed.forward, fused_lm_head=True, trinity_tree_plan=plan, **router), plan

    def _sample_rows(self, packed, outputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One packed row in the per-sample layout the loss reads: the trained tokens' log-probs ``(S, L)``, their
        mask, and the samples ``(S,)`` more than ``max_staleness`` weight syncs behind the weights trained now, which
        leave the mask. (TRL's queue dataset drops a sample that is too old when it takes it from the queue; one that a
        token-budget batcher held over from the last step may be older now.)"""
        logps = packed.pad(outputs.log_probs.flatten()[packed.token_index])
        too_stale = self._too_stale(packed.model_version)
        mask = packed.layout.mask.to(logps.device) * (~too_stale).to(logps.device).unsqueeze(1)
        return logps, mask, too_stale

    def _sync_weight(self):
        super()._sync_weight()
        if self.accelerator.is_main_process:  # TRL counts syncs; our staleness counts optimizer steps (seams 3)
            self.policy_versions.record(self.model_version, self.state.global_step)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError(f"{type(self).__name__} does not return model outputs from compute_loss")
        mode = "train" if self.model.training else "eval"
        packed = unpack(inputs)
        started = time.time()
        outputs, plan = self._forward_packed(model, packed)
        forward_s = time.time() - started
        logps, mask, too_stale = self._sample_rows(packed, outputs)
        entropies = None
        if self.components.entropy_loss.enabled:
            entropies = packed.pad(outputs.entropy.flatten()[packed.token_index])
        staleness = self.state.global_step - packed.policy_version.to(torch.float32)  # NaN: demonstrations
        own = ~packed.expert
        self.group_ledger.record(packed.group[own].tolist(), too_stale[own].tolist())  # where the loss runs
        batch = LossBatch(
            mask=mask,
            advantages=packed.pad(packed.advantages),
            old_logps=packed.pad(packed.old_logps),
            ref_logps=self._reference_logps(model, packed, plan) if self.algorithm.needs_reference else None,
            expert_rows=packed.expert if self.supports_expert_rows else None,
            global_tokens=inputs["step_trained_tokens"][0],
            global_samples=inputs["step_samples"][0],
            staleness=staleness,
            class_weights=self._class_weights(inputs),
            step_mask=None if packed.step_mask is None else packed.pad(packed.step_mask, fill=1.0),
        )
        loss = self._micro_batch_loss(model, batch, logps, entropies, getattr(outputs, "aux_loss", None), mode)
        trained = staleness[~torch.isnan(staleness) & ~too_stale]
        metrics = {"async/dropped_stale_total": float(too_stale.sum())}
        if trained.numel():
            metrics.update({"async/staleness": trained.mean(), "async/staleness_max": trained.max()})
        append_metrics(self._metrics[mode], metrics)
        account_step(self, packed.micro_batch, forward_s)
        return loss

    def _loss_inputs(self, batch: LossBatch, logps: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
        # each sample's staleness, for a policy loss that reads it (components may declare a ``staleness`` input)
        return {**super()._loss_inputs(batch, logps, mask), "staleness": batch.staleness}

    def _class_weights(self, inputs: dict[str, Any]) -> dict[str, float] | None:
        """The per-sample weights of the policy loss's row classes in this micro-batch's optimizer step (``None``: the
        loss's own; AsyncChordTrainer weighs its samples with the step's counts)."""
        return None

    @torch.no_grad()
    def _reference_logps(self, model, packed, plan) -> torch.Tensor:
        """The trained tokens' log-probs under the reference: our own forward of the packed row (the reference model,
        or under PEFT the policy with its adapter disabled)."""
        from ..training.grpo_seams import use_adapter

        if self.ref_model is not None:
            outputs = self.ref_model(**packed.forward, fused_lm_head=True, trinity_tree_plan=plan)
        else:
            unwrapped = self.accelerator.unwrap_model(model)
            with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                outputs = model(**packed.forward, fused_lm_head=True, trinity_tree_plan=plan)
        return packed.pad(outputs.log_probs.flatten()[packed.token_index].detach())

    # ------------------------------------------------------------------------------------ checkpoints
    def _trainer_state(self) -> dict[str, Any]:
        """What a checkpoint carries beyond TRL's (``trinity_trainer_state.json``): the KL state and, with our worker,
        the first prompt group neither trained nor dropped (`GroupLedger.resume`; TRL's own checkpoint counts a
        group trained when its collator batched it) and how many groups were dropped whole so far."""
        state: dict[str, Any] = {"kl_loss": self.components.kl_loss.state_dict()}
        if isinstance(self.rollout_worker, TransformersRolloutWorker):
            state["prompt_position"] = self.group_ledger.resume()
            state["dropped_groups"] = self._dropped_before + len(self.group_ledger.dropped_only)
        return state

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        self.components.kl_loss.load_state_dict(state["kl_loss"])
        if "prompt_position" in state and isinstance(self.rollout_worker, TransformersRolloutWorker):
            # the worker restarts at the first group neither trained nor dropped; TRL counts epochs from there
            self.rollout_worker.position = state["prompt_position"]
            self._groups_before_resume = state["prompt_position"]
            self.group_ledger = GroupLedger(start=state["prompt_position"])
            self._dropped_before = state.get("dropped_groups", 0)

    def _save_checkpoint_extras(self, folder: str) -> None:
        super()._save_checkpoint_extras(folder)
        self.state_files.save(folder, self._trainer_state() if self.args.should_save else None, None)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """transformers calls this when resuming from ``checkpoint``, before the worker starts."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint:
            state, _ = self.state_files.load(checkpoint)
            if state is not None:
                self._load_trainer_state(state)

    # ------------------------------------------------------------------------------------ logs
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        pool_metrics(self._metrics[mode], None)  # one process (checked above): count metrics summed
        if mode == "train" and "loss" in logs:
            dropped = self._dropped_before + len(self.group_ledger.dropped_only)
            self._metrics[mode]["async/dropped_groups"].append(float(dropped))  # so far in the run
        super().log(logs, start_time)

    def train(self, *args: Any, **kwargs: Any):
        """TRL's ``train``; then, when optimizer steps had no sample to train (`get_batch_samples`), one line
        saying how many and, when no step trained at all, that the run trained nothing."""
        skipped_before, steps_before = self.skipped_steps, self.state.global_step
        try:
            output = super().train(*args, **kwargs)
        finally:
            release_rollout_dataset(self)  # async_grpo_seams 5: else TRL's thread keeps this trainer alive
        skipped = self.skipped_steps - skipped_before
        if skipped and self.is_world_process_zero():
            trained = self.state.global_step - steps_before
            why = (
                f"every sample was unscorable (no reward), filtered by the advantage, or more than "
                f"max_staleness={self.args.max_staleness} weight syncs old"
            )
            if trained == 0:
                logger.warning(
                    "%s trained nothing: none of its %d steps had a sample to train (%s), so it took no optimizer "
                    "step and the model is unchanged",
                    type(self).__name__,
                    skipped,
                    why,
                )
            else:
                logger.warning(
                    "%s: %d step(s) had no sample to train (%s) and took no optimizer step (global_step and the "
                    "learning-rate schedule did not advance for them; async/skipped_steps_total)",
                    type(self).__name__,
                    skipped,
                    why,
                )
        return output
