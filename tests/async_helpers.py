"""Helpers of the asynchronous trainers' tests (tests/asynchronous/, tests/trainers/test_async_*.py): rollout samples
built by hand, TRL's packing and our collator on them, scripted rollout workers, and tiny CPU configs."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch


def tiny_async_kwargs(**overrides: Any) -> dict[str, Any]:
    """CPU-friendly `AsyncTrinityConfig` keyword arguments for the tiny model (set `output_dir`): groups of 4
    completions of at most 8 tokens, micro-batches of 4 samples, 2 optimizer steps, no checkpoints, one log line per
    step."""
    kwargs: dict[str, Any] = {
        "use_cpu": True,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 2,
        "learning_rate": 1e-3,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "seed": 0,
        "disable_tqdm": True,
    }
    kwargs.update(overrides)
    return kwargs


def save_float64_model(path, tokenizer) -> str:
    """The tiny Qwen2 (tests/helpers.py) saved in float64 with its tokenizer; both trainers load it as it is."""
    from helpers import build_tiny_model

    model = build_tiny_model(tokenizer).to(torch.float64)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def rollout_sample(
    prompt_ids: list[int],
    completion_ids: list[int],
    logps: list[float],
    advantage: float,
    group_id: int,
    model_version: int = 1,
    trained: bool = True,
    metrics: dict[str, float] | None = None,
):
    """A TRL ``RolloutSample`` of one completion (``logps``: its behaviour log-probs, one per completion token), by
    the package's one builder."""
    from trinity_trl.asynchronous.async_grpo_seams import completion_sample

    return completion_sample(
        prompt_ids,
        completion_ids,
        logps,
        trained=trained,
        advantage=advantage,
        version=model_version,
        group_id=group_id,
        prompt=[],
        completion=[],
        metrics=dict(metrics or {}),
    )


def queue_item(sample) -> dict[str, Any]:
    """``sample`` as TRL's queue dataset hands it to the batcher."""
    return {
        "input_ids": sample.input_ids,
        "completion_mask": sample.completion_mask,
        "old_log_probs": sample.old_log_probs,
        "advantage": sample.advantage,
        "group_id": sample.group_id,
        "metrics": sample.metrics,
    }


def packed_batch(samples: list, pad_token_id: int, step_totals: bool = True) -> dict[str, Any]:
    """One micro-batch of ``samples`` in one packed row (one process), through TRL's ``TreeRow`` and our collator
    (`trinity_trl.asynchronous.async_grpo_seams`), with the optimizer step's totals of a one-micro-batch step."""
    from trl.experimental.async_grpo.packing import TreeRow

    from trinity_trl.asynchronous.async_grpo_seams import _collator_class

    row = TreeRow()
    for sample in samples:
        row.add(queue_item(sample))
    batch = _collator_class()(pad_token_id, 1)([[row]])
    if step_totals:
        batch["step_trained_tokens"] = batch["global_n_tokens"][:1].clone()
        batch["step_samples"] = batch["global_n_samples"][:1].clone()
        batch["step_expert_samples"] = batch["global_n_expert"][:1].clone()
    return batch


class ScriptedWorker:
    """A ``RolloutWorkerProtocol`` that serves ``make_sample(n, model_version)`` as fast as the queue takes them (its
    own thread), or fails / stalls on request: ``fail_after`` samples, then raise; ``stall_after`` samples, then
    hang (heartbeat stops)."""

    def __init__(self, make_sample, fail_after: int | None = None, stall_after: int | None = None, maxsize: int = 64):
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=maxsize)
        self.metrics_queue: queue.Queue = queue.Queue()
        self.make_sample = make_sample
        self.fail_after, self.stall_after = fail_after, stall_after
        self.model_version = 0
        self.versions_seen: list[int] = []
        self.failure: BaseException | None = None
        self.heartbeat = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        try:
            while not self._stop.is_set():
                if self.fail_after is not None and n >= self.fail_after:
                    raise RuntimeError("scripted worker failure")
                if self.stall_after is not None and n >= self.stall_after:
                    self._stop.wait()  # hangs: no heartbeat, no sample
                    return
                sample = self.make_sample(n, self.model_version)
                while not self._stop.is_set():
                    try:
                        self.rollout_buffer.put(sample, timeout=0.05)
                        break
                    except queue.Full:
                        self.heartbeat = time.monotonic()
                n += 1
                self.heartbeat = time.monotonic()
        except BaseException as error:  # noqa: BLE001
            self.failure = error

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version
        self.versions_seen.append(model_version)

    def check_health(self, stale_after_s: float) -> None:
        if self.failure is not None:
            raise RuntimeError(f"the rollout worker failed: {self.failure}")
        if time.monotonic() - self.heartbeat > stale_after_s:
            raise RuntimeError("the rollout worker stalled")


class NoTransfer:
    """A ``WeightTransferProtocol`` that moves nothing (the scripted worker has no model)."""

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator) -> None:
        for _ in iterator:
            pass

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def send(worker, model, version: int) -> None:
    """A weight sync as TRL runs it: send_weights, then update_model_version."""
    from trinity_trl.asynchronous.worker import LocalWeightTransfer

    transfer = LocalWeightTransfer(worker)
    transfer.pause()
    transfer.send_weights(iter(model.named_parameters()))
    transfer.resume()
    worker.update_model_version(version)


def recomputed_logps(model, sample, temperature: float = 0.7) -> torch.Tensor:
    """A sample's completion log-probs recomputed by a plain forward of ``model`` (no cache, no generate)."""
    start = int((sample.completion_mask == 0).sum())
    ids = torch.tensor(sample.input_ids).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, start - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, start:].unsqueeze(-1)).squeeze(-1)


# ------------------------------------------------------------------------------------------- reward functions
# module-level (picklable, importable in a spawned process): the asynchronous trainers hand TRL's vLLM worker their
# reward functions as one `RewardSum`, which TRL pickles into a spawned process


def reward_a(completions, **kwargs):
    """A finite value, None, +inf, a finite value."""
    return [1.0, None, float("inf"), 2.0]


def reward_b(completions, **kwargs):
    """A finite value, NaN, a finite value, None."""
    return [0.5, float("nan"), 1.0, None]


def one_score(completions, **kwargs):
    """One reward whatever the number of completions (a malformed result)."""
    return [1.0]


def score_in_spawned_child(rewards: list, kwargs: dict, results) -> None:
    """What TRL's vLLM worker does with a reward function, in a process started as TRL starts its (``spawn``, the
    environment scrubbed by TRL's own function): call each of ``rewards`` with ``kwargs`` and put each result (or
    the error's one line) on ``results``."""
    from trl.experimental.async_grpo.async_rollout_worker import _scrub_child_env

    _scrub_child_env()
    for reward in rewards:
        try:
            results.put(("ok", reward(**kwargs)))
        except Exception as error:  # noqa: BLE001 (reported to the parent)
            results.put(("error", f"{type(error).__name__}: {error}"))
