"""A rollout worker for TRL's ``AsyncGRPOTrainer`` that generates with transformers, and its weight transfer.

`TransformersRolloutWorker` implements TRL's ``RolloutWorkerProtocol``: a thread of the training process generates
completions with ``model.generate`` from **its own copy** of the policy, the groups of ``num_generations`` completions
of ``groups_per_generate`` prompts (an optimizer step's worth) in one call, scores each group with the reward
functions, computes its advantages with the trainer's advantage component (`GroupScorer`, the same
`trinity_trl.training.advantages.AdvantageEstimator` the synchronous trainers run) and pushes one ``RolloutSample``
per completion onto a ``queue.Queue`` the trainer drains. No vLLM server: it runs on a CPU and on any GPU. It decodes
as the synchronous trainers do (`trinity_trl.training.decoding`): one prefill per group, compiled decoding where
``compile_generation`` turns it on.

Weights reach the copy through `LocalWeightTransfer` (TRL's ``WeightTransferProtocol``): at each of TRL's weight syncs
``send_weights`` copies the trainer's weights into a staging dict, ``update_model_version`` commits them under TRL's
new model version, and the worker loads them (in place) **between two generate calls**, so a group is never sampled
from weights being changed and every sample carries the version of the weights that generated it. Since a call holds
a step's groups, a sample can be up to one call staler than with one group per call (TRL's ``max_staleness`` and the
logged ``async/staleness`` count it).

A sample's recorded tokens are the ones ``generate`` sampled (cut after the first end-of-sequence token), and its
recorded log-probs are those tokens' log-probabilities under the sampling temperature, ``log_softmax(logits / T)``,
taken step by step as ``generate`` draws them (`_SampledLogps`): what the trainer's forward computes for the same
weights (so the importance ratio of a sample trained at once is 1). ``top_p`` / ``top_k`` / ``min_p`` /
``repetition_penalty`` change which tokens are drawn, not the recorded log-probs (as with TRL's vLLM worker without
``processed_logprobs``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ..data.loading import SeededPasses, is_conversation, prompt_token_ids
from ..training.advantages import AdvantageEstimator, Advantages, AdvantageSources, weighted_rewards
from ..training.decoding import GroupedDecoding, compile_refusal, model_facts, plan_decoding
from .async_grpo_seams import completion_sample

logger = logging.getLogger("trinity_trl")


class GroupScorer:
    """Rewards and advantages of one group of completions: the reward functions (called as TRL calls them: the
    prompts, completions, completion ids and every other dataset column), their weighted sum (NaN where no function
    scored; a NaN or infinite sum makes the completion unscorable, docs/guarantees.md) and the trainer's advantage
    component over the group (`AdvantageEstimator`, given the whole group as its "generation batch").

    Args:
        reward_funcs: the reward functions (sync or async callables, each returning one value or ``None`` per
            completion).
        reward_func_names: their names (the ``rewards/<name>`` metrics).
        reward_weights: ``(F,)`` weights of the functions.
        estimator: the trainer's advantage estimator (group-level components only; the trainer refuses others);
            ``None`` where only `rewards` is used (`trinity_trl.asynchronous.multi_step_worker.MultiStepWorker` scores
            runs with its step-wise component).
    """

    def __init__(
        self,
        reward_funcs: list[Callable],
        reward_func_names: list[str],
        reward_weights: torch.Tensor,
        estimator: AdvantageEstimator | None,
    ):
        self.reward_funcs = reward_funcs
        self.reward_func_names = reward_func_names
        self.reward_weights = reward_weights
        self.estimator = estimator

    def rewards(
        self,
        prompts: list,
        completions: list,
        completion_ids: list[list[int]],
        columns: dict,
        inside: Callable[[str], contextlib.AbstractContextManager] | None = None,
    ) -> torch.Tensor:
        """``(G, F)`` every function's reward per completion, NaN for ``None``. ``inside(what)``: entered around each
        call (the worker's record of the user code it is in, for its stall message)."""
        values = []
        for func, name in zip(self.reward_funcs, self.reward_func_names):
            with (inside or _nowhere)(f"the reward function {name!r}"):
                result = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
                if inspect.isawaitable(result):
                    result = asyncio.run(_awaited(result))
            values.append([float("nan") if r is None else float(r) for r in result])
        return torch.tensor(values, dtype=torch.float32).T.reshape(len(completions), len(self.reward_funcs))

    def __call__(
        self,
        prompts: list,
        completions: list,
        completion_ids: list[list[int]],
        columns: dict,
        logps: torch.Tensor,
        mask: torch.Tensor,
        group_index: int,
        inside: Callable[[str], contextlib.AbstractContextManager] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Advantages]:
        """``(rewards per function (G, F), weighted rewards (G,), advantages)`` of a group; ``logps`` / ``mask``
        ``(G, T)``: the completions' sampled log-probs and tokens (for components that read them); ``inside``: as
        `rewards`."""
        per_func = self.rewards(prompts, completions, completion_ids, columns, inside)
        rewards = weighted_rewards(per_func, self.reward_weights)
        size = len(completions)
        sources = AdvantageSources(behaviour_logps=lambda: logps, reference_logps=lambda: None)
        result = self.estimator(rewards, mask, slice(0, size), size, group_index, True, sources)
        return per_func, rewards, result


async def _awaited(awaitable):
    return await awaitable


def _nowhere(what: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class _StopWhen:
    """A ``generate`` stopping criterion, called once per generated token: it reports the progress (``on_token``) and
    ends every sequence once ``event`` is set (the worker is stopping)."""

    def __init__(self, event: threading.Event, on_token: Callable[[], None]):
        self.event, self.on_token = event, on_token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.on_token()
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _SampledLogps:
    """The log-probability of each token ``generate`` samples, at the sampling temperature, kept one step at a time
    (transformers' ``output_logits`` would keep every step's full-vocabulary logits: ``rows x tokens x vocabulary``).

    As a logits processor (`processor`) it sees a step's logits before the sampling warpers (temperature, top-k,
    top-p, min-p: transformers applies a caller's processors first) and keeps ``log_softmax(logits / T)``; as a
    stopping criterion (`criterion`), called once the step's token is drawn, it keeps that token's entry. A repetition
    penalty goes after it in the processor list, so it does not change what is recorded."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.current: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def processor(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.current = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def criterion(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.steps.append(self.current.gather(-1, input_ids[:, -1:]).squeeze(-1))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def logps(self) -> torch.Tensor:
        """``(rows, steps)``: the recorded log-probs."""
        return torch.stack(self.steps, dim=1)


class TransformersRolloutWorker:
    """TRL's ``RolloutWorkerProtocol`` with transformers' ``generate`` (see the module docs).

    Args:
        model: the worker's copy of the policy (a plain causal LM, no adapter, on the device it generates on); its
            weights are replaced at each weight sync.
        tokenizer: the trainer's tokenizer.
        dataset: the prompts (a ``prompt`` column, text or conversations; every other column goes to the reward
            functions), drawn one group at a time, reshuffled every pass with ``seed``.
        scorer: the group's rewards and advantages.
        num_generations: completions per prompt (a group).
        max_completion_length: new tokens per completion at most.
        temperature, top_p, top_k, min_p, repetition_penalty: sampling (TRL's meanings; ``top_k=0``: off).
        eos_token_ids: the ids that end a completion.
        chat_template_kwargs: keyword arguments of the chat template.
        max_queued_samples: generate no further group while this many samples wait in the queue (TRL's
            ``max_inflight_tasks``: more would only go stale).
        queue_maxsize: the queue's capacity (TRL's ``queue_maxsize``; 0: unbounded).
        seed: the prompt order's seed.
        start_position: the position in the prompt stream to start at (a resumed run: the first untrained group).
        weight_lag: generate with the weights of this many syncs before the newest (0: the newest): a controlled
            staleness for benchmarks and studies (``benchmarks/m2po_study.py``); the worker then holds
            ``weight_lag + 1`` copies of the weights. Until that many syncs have come, the oldest received.
        groups_per_generate: groups generated by one ``generate`` call (the trainer: an optimizer step's samples).
        compile_generation, one_prefill_per_group: how it decodes (the trainer config's fields,
            `trinity_trl.training.decoding`); ``compile_config``: the ``CompileConfig`` of compiled decoding (``None``:
            transformers' default).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        dataset: Any,
        scorer: GroupScorer,
        *,
        num_generations: int,
        max_completion_length: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        eos_token_ids: list[int] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_queued_samples: int = 0,
        queue_maxsize: int = 0,
        seed: int = 0,
        start_position: int = 0,
        weight_lag: int = 0,
        groups_per_generate: int = 1,
        compile_generation: str = "auto",
        one_prefill_per_group: bool = True,
        compile_config: Any = None,
    ):
        from transformers import GenerationConfig, RepetitionPenaltyLogitsProcessor

        self.model = model.eval().requires_grad_(False)
        self.device = next(model.parameters()).device
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.scorer = scorer
        self.num_generations = num_generations
        self.temperature = temperature
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.eos_token_ids = list(eos_token_ids or [tokenizer.eos_token_id])
        self.generation_config = GenerationConfig(
            do_sample=True,
            max_new_tokens=max_completion_length,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k or None,
            min_p=min_p,
            eos_token_id=self.eos_token_ids,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
            return_dict_in_generate=True,
        )
        # after the log-prob recorder (`_SampledLogps`), which records the logits before the penalty
        self.penalty = [] if repetition_penalty == 1.0 else [RepetitionPenaltyLogitsProcessor(repetition_penalty)]
        if groups_per_generate < 1:
            raise ValueError(f"groups_per_generate must be >= 1, got {groups_per_generate}")
        self.groups_per_generate = groups_per_generate
        self.decoding = self._decoding(compile_generation, one_prefill_per_group, compile_config)
        self.max_queued_samples = max_queued_samples
        self.order = SeededPasses(len(dataset), seed)
        self.position = start_position  # the next group's position in the prompt stream (its group id)
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue = queue.Queue(maxsize=4096)
        # weights: staged by send_weights, committed by update_model_version, loaded between two groups
        self._lock = threading.Lock()
        self._staged: dict[str, torch.Tensor] | None = None
        self._committed: tuple[dict[str, torch.Tensor], int] | None = None
        if weight_lag < 0:
            raise ValueError(f"weight_lag must be >= 0, got {weight_lag}")
        self.weight_lag = weight_lag
        self._received: collections.deque = collections.deque()  # the last weight_lag + 1 commits (weight_lag > 0)
        self._lagged_version: int | None = None  # the version committed from them last
        self.model_version = -1  # TRL's version of the weights the copy holds (-1: none received yet)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._heartbeat = time.monotonic()
        self._in_user_code: str | None = None  # the user code the thread is in now ("the reward function 'x'")
        self._stalled = False  # check_health found the thread stuck: stop() does not wait for it
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _decoding(self, compile_generation: str, one_prefill_per_group: bool, compile_config: Any) -> GroupedDecoding:
        """How the worker decodes (`trinity_trl.training.decoding`): its copy is a plain model on one device, so
        compiled decoding is refused only for a quantized or offloaded copy; the static cache holds the dataset's
        longest prompt."""

        def longest_prompt() -> int:
            prompts = self.dataset["prompt"] if "prompt" in getattr(self.dataset, "column_names", ()) else []
            return max(map(len, prompt_token_ids(self.tokenizer, prompts, self.chat_template_kwargs)), default=0)

        return plan_decoding(
            compile_generation,
            one_prefill_per_group,
            config=self.generation_config,
            device=self.device,
            refusal=compile_refusal(engine="single", **model_facts(self.model)),
            longest_prompt=longest_prompt,
            owner="the rollout worker",
            compile_config=compile_config,
            on_prefill=self._beat,
        )

    # ------------------------------------------------------------------------------------- weights
    def stage_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(name, tensor)`` pairs (the trainer's weights, under the plain model's names) into the staging
        dict; they are used once `update_model_version` commits them."""
        staged = {name: tensor.detach().to(self.device, copy=True) for name, tensor in named_tensors}
        if self._stream is not None:
            torch.cuda.current_stream(self.device).synchronize()  # the copies are done before the worker's stream reads
        with self._lock:
            self._staged = staged

    def update_model_version(self, model_version: int) -> None:
        """TRL's seam: the weights staged since the last call are the policy of ``model_version``. With ``weight_lag``,
        the weights committed for the next group are those received ``weight_lag`` syncs before these."""
        with self._lock:
            if self._staged is None:
                return
            if not self.weight_lag:
                self._committed, self._staged = (self._staged, model_version), None
                return
            self._received.append((self._staged, model_version))
            self._staged = None
            while len(self._received) > self.weight_lag + 1:
                self._received.popleft()
            if self._received[0][1] != self._lagged_version:
                self._committed = self._received[0]
                self._lagged_version = self._received[0][1]

    def _load_committed(self) -> None:
        with self._lock:
            committed, self._committed = self._committed, None
        if committed is None:
            return
        state, version = committed
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected:
            raise RuntimeError(f"the trainer sent weights the worker's model does not have: {unexpected[:5]}")
        self.model_version = version

    # ------------------------------------------------------------------------------------- protocol
    def start(self) -> None:
        if self._thread is not None:
            return
        if self.groups_per_generate > 1:
            logger.info(
                "the rollout worker generates %d groups per generate call (an optimizer step's) and loads new weights "
                "between calls: a sample can be up to one call staler than with one group per call",
                self.groups_per_generate,
            )
        self._heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="trinity-rollout-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread and wait up to ``timeout`` seconds for it; not at all when `check_health` found it stuck
        in user code (a reward function that hangs never sees the stop: the daemon thread is left to the process)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(0 if self._stalled else timeout)
            if self._thread.is_alive() and not self._stalled:
                logger.warning("the rollout worker did not stop within %.0f s; leaving its (daemon) thread", timeout)
        self._thread = None

    @contextlib.contextmanager
    def _inside(self, what: str) -> Iterator[None]:
        """While the block runs, the worker thread is in user code ``what`` (named by a stall)."""
        previous, self._in_user_code = self._in_user_code, what
        try:
            yield
        finally:
            self._in_user_code = previous

    def check_health(self, stale_after_s: float) -> None:
        """Raise (one line) if the worker failed, ended, or made no progress for ``stale_after_s`` seconds: no token
        generated, no group scored and queued, and not waiting for the trainer (a slow generation is progress; a
        reward function that hangs is not, and is named)."""
        if self._failure is not None:
            error = self._failure
            raise RuntimeError(f"the rollout worker failed: {type(error).__name__}: {error}") from error
        if self._thread is not None and not self._thread.is_alive():
            raise RuntimeError("the rollout worker stopped")
        idle = time.monotonic() - self._heartbeat
        if idle > stale_after_s:
            where = self._in_user_code
            self._stalled = where is not None
            inside = f" inside {where}, which has not returned" if where is not None else ""
            raise RuntimeError(
                f"the rollout worker stalled: no progress for {idle:.0f} s{inside} "
                f"(heartbeat_stale_after_s={stale_after_s:g})"
            )

    # ------------------------------------------------------------------------------------- the loop
    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.model_version < 0:  # TRL syncs once before start()
                with self._on_own_stream():
                    self._load_committed()
                self._stop.wait(0.01)
            while not self._stop.is_set():
                if self.max_queued_samples and self.rollout_buffer.qsize() >= self.max_queued_samples:
                    self._heartbeat = time.monotonic()  # waiting for the trainer is not a stall
                    self._stop.wait(0.01)
                    continue
                # on a GPU the worker's own stream: loading the weights and generating are ordered on it, and overlap
                # the trainer's kernels (the staged copies are complete: stage_weights synchronised its stream)
                positions = list(range(self.position, self.position + self.groups_per_generate))
                with self._on_own_stream():
                    self._load_committed()
                    groups = self.rollout_groups(positions)
                for samples, metrics in groups:
                    for sample in samples:
                        self._put(sample)
                    try:  # the groups of a call: the staleness it adds (docs/generation.md#asynchronous)
                        self.metrics_queue.put_nowait({**metrics, "rollout/groups_per_call": float(len(positions))})
                    except queue.Full:
                        pass  # the trainer stopped reading metrics; generation must not wait for it
                self.position += len(positions)
                self._heartbeat = time.monotonic()
        except BaseException as error:  # noqa: BLE001 (reported by check_health, in one line)
            self._failure = error
            logger.error("the rollout worker failed: %s: %s", type(error).__name__, error)

    def _beat(self) -> None:
        self._heartbeat = time.monotonic()

    def _on_own_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _put(self, sample: Any) -> None:
        sample.enqueued_at = time.time()
        while not self._stop.is_set():
            try:
                self.rollout_buffer.put(sample, timeout=0.1)
                return
            except queue.Full:
                self._heartbeat = time.monotonic()  # the trainer is behind: not a stall

    def generate(self, prompt_ids: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """``num_generations`` completions of ``prompt_ids``: the sampled ids (through the first end-of-sequence
        token) and their log-probs under the sampling temperature."""
        return self.generate_many([prompt_ids] * self.num_generations)

    @torch.no_grad()
    def generate_many(self, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        """One completion of each prompt (prompts of different lengths are left-padded into one ``generate`` call,
        consecutive copies of a prompt prefilled once): the sampled ids (through the first end-of-sequence token) and
        their log-probs under the sampling temperature."""
        from transformers import LogitsProcessorList, StoppingCriteriaList

        width = max(len(p) for p in prompts)
        pad_id = self.generation_config.pad_token_id
        pad_id = self.eos_token_ids[0] if pad_id is None else pad_id
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        recorder = _SampledLogps(self.temperature)
        out = self.decoding.generate(
            self.model,
            self.model.generate,
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=self.generation_config,
            logits_processor=LogitsProcessorList([recorder.processor, *self.penalty]),
            stopping_criteria=StoppingCriteriaList([recorder.criterion, _StopWhen(self._stop, self._beat)]),
        )
        new = out.sequences[:, width:]
        logps = recorder.logps()[: new.shape[0], : new.shape[1]]
        eos = torch.isin(new, torch.tensor(self.eos_token_ids, device=new.device))
        ids, lps = [], []
        for row in range(new.shape[0]):
            ends = torch.nonzero(eos[row]).flatten()
            length = int(ends[0]) + 1 if len(ends) else new.shape[1]
            ids.append(new[row, :length].tolist())
            lps.append(logps[row, :length].tolist())
        return ids, lps

    def rollout_group(self, position: int) -> tuple[list[Any], dict[str, float]]:
        """The group at ``position`` of the prompt stream: its ``RolloutSample``s and the worker's metrics."""
        ((samples, metrics),) = self.rollout_groups([position])
        return samples, metrics

    def rollout_groups(self, positions: list[int]) -> list[tuple[list[Any], dict[str, float]]]:
        """The groups at ``positions`` of the prompt stream, generated by one ``generate`` call: for each, its
        ``RolloutSample``s and the worker's metrics (``rollout/generate_s``: the seconds of the whole call)."""
        started = time.monotonic()
        rows = [dict(self.dataset[self.order.row(position)]) for position in positions]
        prompt_ids = prompt_token_ids(self.tokenizer, [row["prompt"] for row in rows], self.chat_template_kwargs)
        version = self.model_version
        completion_ids, completion_logps = self.generate_many(
            [ids for ids in prompt_ids for _ in range(self.num_generations)]
        )
        size = self.num_generations
        return [
            self._group_samples(
                position,
                row,
                ids,
                completion_ids[k * size : (k + 1) * size],
                completion_logps[k * size : (k + 1) * size],
                version,
                started,
            )
            for k, (position, row, ids) in enumerate(zip(positions, rows, prompt_ids))
        ]

    def _group_samples(
        self,
        position: int,
        row: dict,
        prompt_ids: list[int],
        completion_ids: list[list[int]],
        completion_logps: list[list[float]],
        version: int,
        started: float,
    ) -> tuple[list[Any], dict[str, float]]:
        """A group's ``RolloutSample``s and metrics from its completions (scored here)."""

        prompt = row["prompt"]
        columns = {k: [v] * self.num_generations for k, v in row.items() if k not in ("prompt", "completion")}
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
        conversational = is_conversation(prompt)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        width = max(1, max(len(ids) for ids in completion_ids))
        mask = torch.zeros(self.num_generations, width)
        logps = torch.zeros(self.num_generations, width)
        for i, lp in enumerate(completion_logps):
            mask[i, : len(lp)] = 1.0
            logps[i, : len(lp)] = torch.tensor(lp)
        per_func, rewards, result = self.scorer(
            [prompt] * self.num_generations, completions, completion_ids, columns, logps, mask, position, self._inside
        )
        advantages = result.advantages
        finite = rewards[torch.isfinite(rewards)]
        group_std = float(finite.std(unbiased=False)) if len(finite) else float("nan")
        messages = prompt if conversational else [{"role": "user", "content": prompt}]
        samples = []
        for i, ids in enumerate(completion_ids):
            trained = bool(result.loss_rows[i])
            adv = advantages[i]
            metrics = {
                "reward": float(rewards[i]),
                "reward_std": group_std,
                **{f"rewards/{name}": float(per_func[i, f]) for f, name in enumerate(self.scorer.reward_func_names)},
            }
            samples.append(
                completion_sample(
                    prompt_ids,
                    ids,
                    completion_logps[i],
                    trained=trained,
                    advantage=float(adv) if adv.dim() == 0 else float(adv[: len(ids)].mean()),
                    version=version,
                    group_id=position,
                    prompt=messages,
                    completion=completions[i] if conversational else [{"role": "assistant", "content": texts[i]}],
                    metrics=metrics,
                )
            )
        metrics = {
            "rollout/generate_s": time.monotonic() - started,
            "rollout/completion_length": float(np.mean([len(ids) for ids in completion_ids])),
            "frac_reward_zero_std": float(len(finite) > 1 and bool((finite == finite[0]).all())),
            **{k: float(v) for k, v in result.metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)},
        }
        return samples, metrics


class LocalWeightTransfer:
    """TRL's ``WeightTransferProtocol`` for `TransformersRolloutWorker`: ``send_weights`` stages the trainer's weights
    in the worker, whose ``update_model_version`` (called by TRL right after) commits them; nothing to pause, set up
    or release."""

    def __init__(self, worker: TransformersRolloutWorker):
        self.worker = worker

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass  # the worker loads new weights between groups only: generation need not stop

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.worker.stage_weights(iterator)

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass
