"""The places where TRL 1.16's ``AsyncGRPOTrainer`` leaves no public seam for what our asynchronous trainers need,
each done once here with its reason (the asynchronous twin of `trinity_trl.training.grpo_seams`). The contract tests
(``tests/asynchronous/test_async_grpo_seams.py``) fail loudly if TRL changes what they rely on.

1. **Peak FLOPs off a GPU** (`cpu_safe_peak_flops`). ``AsyncGRPOTrainer.__init__`` asks TRL's
   ``get_peak_flops_per_device`` for the device's peak FLOPs (for its MFU metrics), which calls
   ``torch.cuda.get_device_name``: a CPU build of torch raises there, so TRL's trainer cannot even be built without a
   GPU. While TRL's ``__init__`` runs, the name its module calls is bound to a stand-in that answers ``None`` off CUDA
   (TRL's own answer for a device it does not know: no MFU metric, every other metric kept) and calls TRL's function
   on CUDA.
2. **The tree attention** (`register_tree_attention`, `tree_plan`). TRL loads the policy with
   ``attn_implementation="tree_fa3"`` and registers under that name a function that downloads FlashAttention-3 from
   the Hub (the ``kernels`` package) at the first forward: impossible offline, on a CPU, and on GPUs other than
   Hopper. We register the same name through transformers' public ``AttentionInterface`` and
   ``AttentionMaskInterface`` with our own tree kernels (`trinity_trl.packing.kernels`: ``sdpa_segments`` on a CPU,
   ``varlen`` / ``flash_attn`` on a GPU; nothing is downloaded), after TRL's ``__init__`` has registered its own.
   TRL's packed layout (``tree_kv_index``, ``tree_cu_seqlens_q`` / ``_k``: each segment's queries against the keys of
   its root-to-segment path, bottom-right causal) is the gathered-key layout our kernels run; `tree_plan` turns it
   into a kernel plan once per forward, passed to every layer as the forward's ``trinity_tree_plan`` keyword.
3. **Per-sample fields to the loss** (`SampleStream`, `SampleFieldsCollator`, `trl_collator`). TRL's queue dataset
   passes only ``input_ids``, ``completion_mask``, ``old_log_probs``, ``advantage``, ``group_id`` and ``metrics`` of a
   ``RolloutSample`` on, and its collator packs them into per-token loss terms: a sample's ``model_version`` never
   reaches the loss. Our loss needs each sample's policy version (the logged ``staleness``, also given to the policy
   loss as an input) and, for CHORD, whether the sample is a demonstration. `SampleStream` (the trainer's
   ``rollout_queue``, wrapping the worker's queue) writes both into the sample's ``metrics`` dict, which TRL hands
   through untouched (and logs as per-micro-batch means), and mixes CHORD's demonstrations into the stream;
   `SampleFieldsCollator` (TRL's collator, subclassed; `trl_collator` puts it in place of TRL's for the one call of
   ``get_train_dataloader`` that builds the collator) reads them back into per-sample tensors of each packed row;
   `PolicyVersions` turns TRL's model version (a count of weight syncs) into the policy version (optimizer steps).

4. **A loader that does not read ahead** (`StreamLoader`). TRL's ``get_train_dataloader`` returns accelerate's prepared
   loader, which takes the next micro-batch from TRL's queue dataset before it hands over the current one (to learn
   whether the stream ended). The queue dataset drops a sample that is too stale when it takes it: one micro-batch
   ahead, against the weights of the step before, so with ``max_staleness=0`` every micro-batch after the first was
   taken before the weight sync that made it stale. The asynchronous trainers run on one process and their stream
   never ends, so they iterate TRL's batcher and collator through a plain loader instead: a micro-batch is taken
   from the queue when the training loop asks for it, after the last weight sync (waiting inside the dataset would
   not help: accelerate's read-ahead would wait there for the next step's samples before this step trains).

5. **A trainer that can be freed** (`release_rollout_dataset`). TRL's queue dataset starts a daemon thread (its
   rollout-trace logger) that never ends and holds the dataset, whose ``model_version_fn`` closes over the trainer:
   every trainer that trained stayed alive for the rest of the process, with its model, optimizer state, worker (and
   the worker's copy of the model) and queued samples (seen in the test suite: a process running the trainers'
   tests grew past 8 GB and was killed). After ``train()`` the dataset's references are dropped.

Replacing TRL's ``compute_loss`` also means keeping its per-step throughput accounting (`account_step`), which TRL's
``_log_step_metrics`` reads.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ..overrides import temporarily
from ..packing.attention import TreePlan, tree_attention
from ..packing.kernels import KERNELS
from ..packing.selection import choose
from ..packing.tree import PackedRows, Segment
from .progress import GroupLedger

logger = logging.getLogger("trinity_trl")

#: the attention implementation TRL's AsyncGRPOTrainer loads its model with
TRL_TREE_ATTENTION = "tree_fa3"
#: the forward keyword that carries our plan of a packed row to every attention layer
PLAN_KWARG = "trinity_tree_plan"
#: ``tree_attention_kernel`` choices: ``auto`` (see `kernel_for`) or one of our kernels TRL's layout can run
TREE_KERNEL_CHOICES = ("auto", "sdpa_segments", "varlen", "flash_attn")

#: the keys of ``RolloutSample.metrics`` that carry a sample's fields to the loss (seam 3); all are logged as means:
#: its policy version (optimizer steps), its ``model_version`` (TRL's count of weight syncs), and whether it is a
#: demonstration
POLICY_VERSION_KEY = "sample/policy_version"
MODEL_VERSION_KEY = "sample/model_version"
EXPERT_KEY = "chord/expert_share"


# ==================================================================================== TRL's non-public names
@contextlib.contextmanager
def quiet_experimental_import() -> Iterator[None]:
    """While the block runs, TRL's warning on the first import of ``trl.experimental`` (that its API may change) is
    silenced: trinity_trl pins TRL 1.16.*, and ``tests/test_trl_surface.py`` and the contract tests
    (``tests/asynchronous/test_async_grpo_seams.py``) fail when what we use changes."""
    from trl.import_utils import TRLExperimentalWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TRLExperimentalWarning)
        yield


def rollout_sample(**fields: Any) -> Any:
    """TRL's ``RolloutSample`` of ``fields`` (one scored completion on the queue: ``prompt``, ``completion``,
    ``input_ids``, ``completion_mask``, ``old_log_probs``, ``advantage``, ``model_version``, ``group_id``,
    ``metrics``), which TRL's asynchronous package does not export; imported when the first sample is made."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    return RolloutSample(**fields)


def completion_sample(
    prompt_ids: list[int],
    completion_ids: list[int],
    logprobs: list[float] | None,
    *,
    trained: bool,
    advantage: float,
    version: int,
    group_id: int,
    prompt: list[dict[str, Any]],
    completion: list[dict[str, Any]],
    metrics: dict[str, Any],
) -> Any:
    """The one way a scored completion becomes TRL's ``RolloutSample``: ``input_ids`` the prompt's ids then the
    completion's, ``completion_mask`` 0 over the prompt and ``trained`` over the completion, ``old_log_probs`` 0 over
    the prompt then the completion's sampling log-probs (0 each where ``logprobs`` is ``None``: a demonstration),
    ``advantage`` one number, ``model_version`` the policy version that sampled it, ``group_id`` its group's stream
    position; ``prompt``, ``completion`` (messages) and ``metrics`` as TRL logs them."""
    sampled = [0.0] * len(completion_ids) if logprobs is None else list(logprobs)
    return rollout_sample(
        prompt=prompt,
        completion=completion,
        input_ids=np.asarray(list(prompt_ids) + list(completion_ids), dtype=np.int64),
        completion_mask=np.asarray([0] * len(prompt_ids) + [int(trained)] * len(completion_ids), dtype=np.int64),
        old_log_probs=np.asarray([0.0] * len(prompt_ids) + sampled, dtype=np.float32),
        advantage=float(advantage),
        model_version=version,
        group_id=group_id,
        metrics=metrics,
    )


# ==================================================================================== 1. peak FLOPs
@contextlib.contextmanager
def cpu_safe_peak_flops() -> Iterator[None]:
    """While the block runs, TRL's async trainer module calls a peak-FLOPs probe that answers ``None`` off CUDA."""
    from trl.experimental.async_grpo import async_grpo_trainer as trl_async

    probe = trl_async.get_peak_flops_per_device

    def peak_flops(accelerator: Any, dtype: str) -> float | None:
        if accelerator.device.type != "cuda":
            return None  # TRL's answer for a device it does not know: no MFU metric
        return probe(accelerator, dtype)

    with temporarily(trl_async, get_peak_flops_per_device=peak_flops):
        yield


# ==================================================================================== 2. tree attention
def packed_rows_of(kv_index: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> PackedRows:
    """TRL's tree layout of a packed row as our `PackedRows` (its segments; no scored tokens): segment ``i`` holds the
    packed tokens ``[cu_q[i], cu_q[i+1])`` and attends to ``kv_index[cu_k[i]:cu_k[i+1]]``, its ancestors' tokens
    first and its own last."""
    kv = kv_index.detach().cpu().numpy().astype(np.int64)
    cu_q = cu_seqlens_q.detach().cpu().tolist()
    cu_k = cu_seqlens_k.detach().cpu().tolist()
    segments = []
    for i in range(len(cu_q) - 1):
        start, end = cu_q[i], cu_q[i + 1]
        path = kv[cu_k[i] : cu_k[i + 1]]
        own = end - start
        if own < 1 or len(path) < own or not np.array_equal(path[len(path) - own :], np.arange(start, end)):
            raise ValueError(f"tree layout: segment {i} [{start}, {end}) is not the end of its key path")
        context = path[: len(path) - own]
        breaks = np.flatnonzero(np.diff(context) != 1) + 1 if len(context) else np.zeros(0, dtype=np.int64)
        ancestors = tuple(
            (int(run[0]), int(run[-1]) + 1) for run in np.split(context, breaks) if len(run)
        )  # contiguous runs of the ancestors' tokens, root first
        segments.append(Segment(start, end, ancestors))
    n = cu_q[-1] if cu_q else 0
    empty = torch.zeros(0, dtype=torch.long)
    return PackedRows(
        input_ids=torch.zeros(n, dtype=torch.long),
        position_ids=torch.zeros(n, dtype=torch.long),
        segments=segments,
        scored_index=empty,
        scored_labels=empty,
        scored_rows=empty,
        scored_cols=empty,
    )


_fallback_noted: set[str] = set()


def kernel_for(requested: str, device: torch.device, dtype: torch.dtype):
    """Our tree kernel for ``requested`` (`TREE_KERNEL_CHOICES`) on ``device`` computing in ``dtype``. ``auto`` takes
    the packing's choice (`trinity_trl.packing.selection.choose`: ``sdpa_segments`` on a CPU; ``flash_attn``, else
    ``varlen`` for fp16/bf16 on CUDA); where it offers none (float32 on a GPU), ``sdpa_segments``, with one log line:
    TRL's packed rows have no padded layout to fall back to. A forced kernel that cannot run is an error."""
    if requested not in TREE_KERNEL_CHOICES:
        raise ValueError(f"tree_attention_kernel must be one of {TREE_KERNEL_CHOICES}, got {requested!r}")
    if requested != "auto":
        kernel = KERNELS[requested]
        reason = kernel.unavailable(device) or kernel.unsupported_dtype(dtype)
        if reason is not None:
            raise ValueError(f"tree_attention_kernel={requested!r} cannot run here: {reason}")
        return kernel
    choice = choose("auto", device, dtype)
    if choice.kernel is not None:
        return choice.kernel
    note = f"{device.type}/{dtype}"
    if note not in _fallback_noted:
        _fallback_noted.add(note)
        logger.info("tree attention: sdpa_segments (one SDPA per tree node) on %s: %s", note, choice.reason)
    return KERNELS["sdpa_segments"]


def tree_plan(tree_kwargs: dict[str, Any], kernel: Any, device: torch.device) -> TreePlan:
    """The kernel plan of one packed row, from TRL's tree keyword arguments (``tree_kv_index``,
    ``tree_cu_seqlens_q``, ``tree_cu_seqlens_k``): built once per forward, used by every layer and the backward."""
    packed = packed_rows_of(
        tree_kwargs["tree_kv_index"], tree_kwargs["tree_cu_seqlens_q"], tree_kwargs["tree_cu_seqlens_k"]
    )
    return TreePlan(kernel, kernel.plan(packed, device))


def tree_fa3_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    tree_kv_index: torch.Tensor | None = None,
    tree_cu_seqlens_q: torch.Tensor | None = None,
    tree_cu_seqlens_k: torch.Tensor | None = None,
    tree_max_seqlen_q: int | None = None,
    tree_max_seqlen_k: int | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    trinity_tree_plan: TreePlan | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``"tree_fa3"``: TRL's signature, our kernels. ``query`` ``(1, H, N, D)``,
    ``key`` / ``value`` ``(1, H_kv, N, D)``; returns ``(1, N, H, D)``. The plan comes with the forward
    (``trinity_tree_plan``, our trainers); a packed row without one (TRL's own trainer) gets one built per call. A
    forward that is no packed row (generation, evaluation) runs transformers' SDPA."""
    plan = trinity_tree_plan
    if plan is None and tree_kv_index is None:
        # not one of TRL's packed rows (the trained model generating or evaluated, e.g. a recipe's held-out
        # accuracy): the model's attention as transformers' SDPA computes it, with the mask `_mask` made
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if sliding_window or softcap:
        raise ValueError(
            "our tree kernels run full causal attention: a model with sliding-window attention or attention "
            "logit soft-capping cannot be trained by the asynchronous trainers"
        )
    if dropout:
        raise ValueError("tree attention runs without attention dropout (set the model's attention_dropout to 0)")
    if plan is None:
        device = query.device
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else query.dtype
        plan = tree_plan(
            {
                "tree_kv_index": tree_kv_index,
                "tree_cu_seqlens_q": tree_cu_seqlens_q,
                "tree_cu_seqlens_k": tree_cu_seqlens_k,
            },
            kernel_for("auto", device, dtype),
            device,
        )
    out = tree_attention(query, key, value, plan, scaling)
    return out.transpose(1, 2).contiguous(), None


def _mask(**kwargs: Any) -> torch.Tensor | None:
    """SDPA's mask (``None`` where causal attention needs none): used by forwards that are not packed rows; a packed
    row's pattern is its tree keywords (TRL passes it no ``attention_mask``, so no mask is materialised)."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(**kwargs)


def tree_attention_refusal(config: Any) -> str | None:
    """Why our tree kernels cannot run the model of ``config`` (a transformers config; a multimodal one's text config
    is read), else ``None``: they run full causal attention, so a model whose layers attend within a sliding window
    (``layer_types`` naming ``sliding_attention`` with a window set, or a ``sliding_window`` applied to every layer by
    a config without layer types, as Mistral's) or soft-cap their attention logits cannot train. A config whose
    window is off (Qwen2's ``use_sliding_window=False``) can. Read when the trainer is built, before any weight loads;
    the kernel refuses the same at its first forward."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    windowed = window is not None and ("sliding_attention" in layer_types if layer_types else True)
    softcap = getattr(text, "attn_logit_softcapping", None)
    if windowed:
        where = (
            f"{sum(t == 'sliding_attention' for t in layer_types)} of its {len(layer_types)} layers"
            if layer_types
            else "every layer"
        )
        return (
            f"the model attends within a sliding window of {window} tokens in {where}; the asynchronous trainers' "
            "tree kernels run full causal attention (train it with a synchronous trainer, or with the window off)"
        )
    if softcap:
        return (
            f"the model soft-caps its attention logits (attn_logit_softcapping={softcap}); the asynchronous "
            "trainers' tree kernels do not (train it with a synchronous trainer)"
        )
    return None


def register_tree_attention() -> None:
    """Register ``"tree_fa3"`` with our kernels (replacing TRL's Hub-downloading function under that name)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TRL_TREE_ATTENTION, tree_fa3_attention)
    AttentionMaskInterface.register(TRL_TREE_ATTENTION, _mask)


# ==================================================================================== 3. per-sample fields
class SampleStream:
    """The trainer's ``rollout_queue``: the worker's queue, with each sample's policy version written into its
    ``metrics`` and, for CHORD, demonstrations mixed in (seam 3 of the module docs).

    TRL's queue dataset calls ``get(timeout=...)`` and ``qsize()``; the stream answers from the worker's queue.

    Args:
        source: the worker's ``rollout_buffer`` (``queue.Queue`` or ``multiprocessing`` queue).
        policy_version: maps a sample's ``model_version`` (TRL's count of weight syncs) to its policy version: the
            number of optimizer steps whose weights generated it.
        demonstrations: ``None``, or a callable returning the next demonstration as a ``RolloutSample`` for the
            current model version and the group id of the last rollout (CHORD).
        expert_ratio: target share of demonstrations among the samples TRL keeps (CHORD's ``expert_data_ratio``).
        kept: whether TRL's staleness filter will keep a rollout sample (``model_version`` -> bool); the share is
            counted over kept samples only.
        model_version: the trainer's current model version (TRL's count), for demonstrations.
        ledger: where a rollout sample that TRL's staleness filter will drop (``kept`` false) is recorded as dropped.
    """

    def __init__(
        self,
        source: Any,
        policy_version: Callable[[int], int],
        demonstrations: Callable[[int, int], Any] | None = None,
        expert_ratio: float = 0.0,
        kept: Callable[[int], bool] | None = None,
        model_version: Callable[[], int] | None = None,
        ledger: GroupLedger | None = None,
    ):
        if demonstrations is not None and not 0.0 < expert_ratio < 1.0:
            raise ValueError(f"expert_ratio must be in (0, 1), got {expert_ratio}")
        self.source = source
        self.policy_version = policy_version
        self.demonstrations = demonstrations
        self.expert_ratio = expert_ratio
        self.kept = kept or (lambda version: True)
        self.model_version = model_version or (lambda: 0)
        self.ledger = ledger
        self.rollouts = 0  # rollout samples handed on that TRL keeps
        self.experts = 0  # demonstrations handed on
        self._last_group = -1

    def _expert_due(self) -> bool:
        """Whether the next sample is a demonstration: demonstrations / all samples stays at ``expert_ratio`` (the
        deficit rule: one is due while ``experts < ratio / (1 - ratio) * rollouts``)."""
        if self.demonstrations is None or self._last_group < 0:
            return False
        return self.experts + 1 <= self.expert_ratio / (1.0 - self.expert_ratio) * self.rollouts + 1e-9

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self._expert_due():
            self.experts += 1
            sample = self.demonstrations(self.model_version(), self._last_group)
            sample.metrics[EXPERT_KEY] = 1.0
            return sample
        sample = self.source.get(block, timeout)
        sample.metrics[POLICY_VERSION_KEY] = float(self.policy_version(sample.model_version))
        sample.metrics[MODEL_VERSION_KEY] = float(sample.model_version)
        kept = self.kept(sample.model_version)
        if not kept and self.ledger is not None:
            self.ledger.record([sample.group_id], [True])
        if self.demonstrations is not None:
            sample.metrics[EXPERT_KEY] = 0.0
            if kept:
                self.rollouts += 1
                self._last_group = sample.group_id
        return sample

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def put_nowait(self, item: Any) -> None:
        self.source.put_nowait(item)

    def qsize(self) -> int:
        return self.source.qsize()


def _trl_collator_class() -> type:
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout

    return DataCollatorForRollout


#: the per-sample tensors `SampleFieldsCollator` adds to a packed micro-batch (dimension 0: one row per process, as
#: TRL's keys): ``sample_policy_version`` and ``sample_model_version`` ``(P, S)`` (NaN past a row's samples and for
#: demonstrations), ``sample_expert`` ``(P, S)`` (1 for a demonstration), ``sample_group`` ``(P, S)`` int64 (the
#: sample's prompt group, TRL's ``group_id``; -1 past a row's samples), ``sample_trained_tokens`` ``(P, S)`` (its
#: tokens the loss takes), ``sample_count`` ``(P,)``, and per micro-batch, repeated on each row, ``global_n_samples``
#: and ``global_n_expert``
SAMPLE_FIELD_KEYS = (
    "sample_policy_version",
    "sample_model_version",
    "sample_expert",
    "sample_group",
    "sample_trained_tokens",
    "sample_count",
    "global_n_samples",
    "global_n_expert",
)


@functools.cache
def _collator_class() -> type:
    trl_collator = _trl_collator_class()

    class SampleFieldsCollator(trl_collator):
        """TRL's ``DataCollatorForRollout``, plus each packed row's per-sample fields (`SAMPLE_FIELD_KEYS`)."""

        def torch_call(self, examples: list[Any]) -> dict[str, Any]:
            batch = super().torch_call(examples)
            (rows,) = examples
            width = max(1, max(len(row.samples) for row in rows))
            versions = torch.full((len(rows), width), float("nan"))
            model_versions = torch.full((len(rows), width), float("nan"))
            expert = torch.zeros((len(rows), width))
            groups = torch.full((len(rows), width), -1, dtype=torch.long)
            trained = torch.zeros((len(rows), width))
            for r, row in enumerate(rows):
                for s, sample in enumerate(row.samples):
                    metrics = sample["metrics"]
                    groups[r, s] = int(sample["group_id"])
                    trained[r, s] = float(sample["completion_mask"].sum())
                    expert[r, s] = float(metrics.get(EXPERT_KEY, 0.0))
                    if not expert[r, s]:
                        versions[r, s] = float(metrics.get(POLICY_VERSION_KEY, float("nan")))
                        model_versions[r, s] = float(metrics.get(MODEL_VERSION_KEY, float("nan")))
            counts = torch.tensor([float(len(row.samples)) for row in rows])
            batch["sample_policy_version"] = versions
            batch["sample_model_version"] = model_versions
            batch["sample_expert"] = expert
            batch["sample_group"] = groups
            batch["sample_trained_tokens"] = trained
            batch["sample_count"] = counts
            batch["global_n_samples"] = torch.full((len(rows),), float(counts.sum()))
            batch["global_n_expert"] = torch.full((len(rows),), float(expert.sum()))
            return batch

    return SampleFieldsCollator


@contextlib.contextmanager
def trl_collator() -> Iterator[None]:
    """While the block runs (the trainer's ``get_train_dataloader``), TRL's async module builds its collator from
    `SampleFieldsCollator` (its subclass)."""
    from trl.experimental.async_grpo import async_grpo_trainer as trl_async

    with temporarily(trl_async, DataCollatorForRollout=_collator_class()):
        yield


class StreamLoader(torch.utils.data.DataLoader):
    """The training loader of the asynchronous trainers (seam 4): TRL's batcher and collator, as accelerate's
    ``prepared`` loader holds them, iterated by a plain loader that takes a micro-batch from the queue only when the
    training loop asks for one. One stream for the whole run (its samples never end): every ``iter()`` continues it,
    so a new epoch of transformers' loop loses no sample a batcher holds. One process only (accelerate's loader is
    what splits a micro-batch across processes)."""

    def __init__(self, prepared: torch.utils.data.DataLoader):
        super().__init__(prepared.dataset, batch_size=1, collate_fn=prepared.collate_fn, num_workers=0)
        self._stream: Iterator[Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        if self._stream is None:
            self._stream = super().__iter__()
        return self._stream


def release_rollout_dataset(trainer: Any) -> None:
    """Drop what TRL's queue dataset of ``trainer`` (the last ``get_train_dataloader``'s) holds (seam 5): the trainer
    (through ``model_version_fn``), the worker (``check_health_fn``), the queue and the metric lists. The dataset is
    not iterated again: the next ``train()`` builds a new one."""
    dataset = getattr(trainer, "_rollout_dataset", None)
    if dataset is None:
        return
    dataset.model_version_fn = dataset.check_health_fn = dataset.queue = None
    dataset.metrics = {}
    trainer._rollout_dataset = None


class PolicyVersions:
    """TRL's model versions (one per weight sync) mapped to policy versions (the optimizer steps whose weights were
    synced), recorded by the trainer after each of TRL's syncs: TRL numbers syncs, our ``staleness`` counts optimizer
    steps (they differ when ``weight_sync_steps > 1``)."""

    def __init__(self):
        self._steps: dict[int, int] = {}

    def record(self, model_version: int, optimizer_steps: int) -> None:
        self._steps[model_version] = optimizer_steps

    def __call__(self, model_version: int) -> float:
        """The policy version of ``model_version`` (NaN for a version no sync of this run recorded)."""
        return float(self._steps.get(model_version, float("nan")))


def account_step(trainer: Any, micro_batch: dict[str, float], forward_s: float) -> None:
    """What TRL's ``compute_loss`` adds, per micro-batch, to the trainer's per-step throughput accounting (read and
    reset by TRL's ``_log_step_metrics``: ``perf/*`` and ``batch/*_per_step``), done by ours in its place:
    ``micro_batch`` is `trinity_trl.asynchronous.batch.PackedMicroBatch.micro_batch`."""
    forward_tokens, mean_seq_len = micro_batch["forward_tokens"], micro_batch["mean_seq_len"]
    trainer._step_forward_tokens += forward_tokens
    trainer._step_trained_tokens += micro_batch["trained_tokens"]
    trainer._step_seq_len_weighted += mean_seq_len * forward_tokens
    trainer._step_samples += forward_tokens / mean_seq_len if mean_seq_len else 0.0
    trainer._step_forward_s += forward_s
