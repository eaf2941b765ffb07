"""Input checks and numerical guards shared by the trainers.

Bad input fails at the earliest point with a message that names the row, column or value, or is
handled in a documented way that drops nothing silently (docs/guarantees.md#bad-input):

* datasets: a missing ``prompt`` column or empty prompts (``""``, ``[]``, ``None``) are rejected at
  construction (map-style datasets, by row index) or at the first batch (iterable datasets);
* reward functions: an exception is re-raised as `RewardFunctionError` naming the function
  and the row that raises; a result that is not a list of numbers/None is a ``TypeError`` naming
  the value (TRL checks the length);
* ``rollout_func``: rows with an empty completion are rejected (TRL would fail on ``ids[-1]``);
* context: a prompt that cannot fit ``max_completion_length`` more tokens in the model's
  positions is rejected, naming the row and the lengths;
* loss inputs: `guard_loss_mask` drops trained tokens whose log-probs or advantages are not
  finite, and `trinity_trl.training.loss.masked_finite` zeroes every untrained position, so NaN/inf cannot reach
  the loss or its gradient; each event is counted in a ``guards/*`` metric.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .step_mask import window_refusal

if TYPE_CHECKING:
    from .loss import LossBatch

GUARD_METRICS = ("guards/nonfinite_logps", "guards/nonfinite_advantages", "guards/empty_mask", "guards/nonfinite_loss")


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names the function and, when one row alone
    reproduces it, that row (the original exception is the ``__cause__``)."""


# ------------------------------------------------------------------------------------- datasets
def _is_empty_prompt(prompt: Any) -> bool:
    return prompt is None or (isinstance(prompt, (str, list, tuple)) and len(prompt) == 0)


def check_prompt_dataset(dataset: Any, name: str) -> None:
    """Reject a dataset without a ``prompt`` column, or (map-style datasets) with empty prompts.

    The scan reads the column's lengths from Arrow, so it costs milliseconds even on large datasets.
    Iterable datasets are checked batch by batch (`check_batch_prompts`).
    """
    if dataset is None:
        return
    if isinstance(dataset, dict):
        for key, value in dataset.items():
            check_prompt_dataset(value, f"{name}[{key!r}]")
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        return
    if "prompt" not in columns:
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {sorted(columns)}); every row needs the prompt to generate "
            "completions for (a string, or a list of chat messages)"
        )
    from datasets import Dataset

    if not isinstance(dataset, Dataset):
        return
    import pyarrow as pa
    import pyarrow.compute as pc

    column = dataset.with_format("arrow")["prompt"]
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        lengths = pc.utf8_length(column)
    elif pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        lengths = pc.list_value_length(column)
    else:
        return
    empty = [i for i, n in enumerate(lengths.to_pylist()) if not n]
    if empty:
        raise ValueError(
            f"{name} has {len(empty)} row(s) with an empty prompt "
            f"(rows {empty[:10]}{' ...' if len(empty) > 10 else ''}); "
            "remove them, e.g. dataset.filter(lambda row: len(row['prompt']) > 0)"
        )


def check_batch_prompts(inputs: list[dict[str, Any]]) -> None:
    """Reject a generation batch holding an empty prompt (iterable datasets are not scanned upfront)."""
    for position, row in enumerate(inputs):
        if "prompt" not in row:
            raise ValueError(f"a batch row has no 'prompt' (columns: {sorted(row)})")
        if _is_empty_prompt(row["prompt"]):
            raise ValueError(f"row {position} of this process's batch has an empty prompt: {short(row)}")


def check_context(prompt_lengths: list[int], extra: int | list[int], limit: int | None, describe) -> None:
    """Reject the first row whose prompt plus ``extra`` completion tokens exceed ``limit`` positions;
    ``describe(i)`` names row ``i`` in the message."""
    if limit is None:
        return
    extras = extra if isinstance(extra, list) else [extra] * len(prompt_lengths)
    for i, (length, more) in enumerate(zip(prompt_lengths, extras)):
        if length + more > limit:
            raise ValueError(
                f"{describe(i)}: its prompt has {length} tokens, and {length} + {more} completion tokens exceed the "
                f"model's {limit} positions (max_position_embeddings). Filter or shorten long prompts, or lower "
                "max_completion_length"
            )


def model_max_positions(model: Any) -> int | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text_config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ------------------------------------------------------------------------------ reward functions
def _row_kwargs(kwargs: dict[str, Any], row: int, n: int) -> dict[str, Any]:
    return {k: [v[row]] if isinstance(v, list) and len(v) == n else v for k, v in kwargs.items()}


def _raise_context(name: str, err: Exception, row: int | None, kwargs: dict[str, Any]) -> RewardFunctionError:
    n = len(kwargs.get("completions") or [])
    if row is None:
        where = f"on this process's batch of {n} completions (no single row raises alone)"
    else:
        where = (
            f"on row {row} of this process's batch of {n} completions (prompt: "
            f"{short(kwargs['prompts'][row])}, completion: {short(kwargs['completions'][row])})"
        )
    return RewardFunctionError(f"reward function {name!r} raised {type(err).__name__}: {err} {where}")


def _validated(name: str, output: Any, expected: int) -> list[Any]:
    """``output`` as a list of ``expected`` rewards, each a number or ``None``: a NaN or +-inf is a ``None`` (the
    function did not score that completion), the one rule for bad rewards of every source
    (docs/guarantees.md#bad-rewards)."""
    if output is None or isinstance(output, (str, bytes, dict)) or not hasattr(output, "__len__"):
        raise TypeError(
            f"reward function {name!r} returned {short(output)} ({type(output).__name__}); it must return a list "
            "with one reward per completion: a number, or None where it does not score the completion"
        )
    values = list(output)
    if len(values) != expected:
        raise ValueError(
            f"reward function {name!r} returned {len(values)} rewards for {expected} completions; it must return "
            "one per completion (None where it does not score one)"
        )
    for row, value in enumerate(values):
        if value is None:
            continue
        ok = not isinstance(value, (str, bytes))
        if ok:
            try:
                float(value)
            except (TypeError, ValueError):
                ok = False
        if not ok:
            raise TypeError(
                f"reward function {name!r} returned {short(value)} ({type(value).__name__}) for row {row}; "
                "a reward must be a number, or None where the function does not score the completion"
            )
        if not math.isfinite(float(value)):
            values[row] = None
    return values


#: the keyword arguments TRL's GRPOTrainer passes every reward function besides the dataset's columns (all but
#: ``prompt``, ``completion`` and ``completion_ids``, which it passes as the first three)
TRL_REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def check_reward_columns(reward_funcs: Any, dataset: Any, name: str) -> None:
    """Each reward function's parameters without a default are arguments TRL will pass it: `TRL_REWARD_ARGUMENTS`
    or a column of ``dataset``. One that is neither (an ``answer`` parameter on data without an ``answer`` column)
    is a one-line ``ValueError`` now, not a ``TypeError`` at the first step after the model has loaded and generated.
    Reward models (``nn.Module``, model ids) and datasets without known columns pass."""
    import inspect

    columns = getattr(dataset, "column_names", None)
    if dataset is None or columns is None:
        return
    passed = (set(columns) - {"prompt", "completion", "completion_ids"}) | set(TRL_REWARD_ARGUMENTS)
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    for func in funcs:
        if isinstance(func, (str, os.PathLike, torch.nn.Module)) or not callable(func):
            continue
        try:
            parameters = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature: nothing to check
            continue
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        missing = [p.name for p in parameters if p.kind in keyword and p.default is p.empty and p.name not in passed]
        if missing:
            listed = ", ".join(repr(m) for m in missing)
            raise ValueError(
                f"reward function {getattr(func, '__name__', type(func).__name__)!r} takes {listed}, but {name} has "
                f"no such column (its columns: {', '.join(columns)}); TRL passes a reward function the dataset's "
                f"columns and {', '.join(TRL_REWARD_ARGUMENTS)}: add the column, or give the parameter a default"
            )


def checked_reward_func(func: Any, name: str) -> Any:
    """``func`` (sync or async) with its failures and malformed results reported by name and row."""
    from .grpo_seams import is_async_callable

    if is_async_callable(func):

        @functools.wraps(func)
        async def checked_async(**kwargs):
            return await _checked_call(func, name, kwargs, awaits=True)

        return checked_async

    @functools.wraps(func)
    def checked(**kwargs):
        return _run_unsuspended(_checked_call(func, name, kwargs, awaits=False))

    return checked


async def _checked_call(func: Any, name: str, kwargs: dict[str, Any], awaits: bool) -> Any:
    """The checks of `checked_reward_func`, written once for both kinds of function: what ``func`` returns is awaited
    when ``awaits`` (an async function); a sync one runs in a coroutine that never suspends (`_run_unsuspended`)."""
    try:
        output = func(**kwargs)
        if awaits:
            output = await output
    except Exception as err:
        n, row = len(kwargs["completions"]), None
        for i in range(n):  # only on failure: find the row that raises alone
            try:
                alone = func(**_row_kwargs(kwargs, i, n))
                if awaits:
                    await alone
            except Exception:  # noqa: BLE001 (locating the row only)
                row = i
                break
        raise _raise_context(name, err, row, kwargs) from err
    return _validated(name, output, len(kwargs["completions"]))


def _run_unsuspended(coroutine: Any) -> Any:
    """The result of a coroutine that awaits nothing asynchronous, run to its end in this thread without an event
    loop (so a sync reward function stays sync; its exceptions propagate as they are)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("a sync reward function's check suspended; it cannot run without an event loop")


# --------------------------------------------------------------------------------- rollout_func
def checked_rollout_func(func: Any) -> Any:
    """``rollout_func`` whose rows must each hold a non-empty completion (TRL reads ``ids[-1]``)."""

    @functools.wraps(func)
    def checked(prompts, trainer):
        output = func(prompts, trainer)
        completions = output.get("completion_ids") if isinstance(output, dict) else None
        if completions is not None:
            if len(completions) != len(prompts):
                raise ValueError(f"rollout_func returned {len(completions)} completions for {len(prompts)} prompts")
            empty = [i for i, ids in enumerate(completions) if len(ids) == 0]
            if empty:
                raise ValueError(
                    f"rollout_func returned an empty completion for row(s) {empty[:10]} (first prompt: "
                    f"{short(prompts[empty[0]])}); every completion needs at least one token (end it with EOS)"
                )
        return output

    return checked


# ------------------------------------------------------------------------------------ loss guards
def guard_loss_mask(
    mask: torch.Tensor, logps: torch.Tensor, batch: LossBatch, entropies: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Drop trained tokens whose inputs are not finite; return ``(mask, guard metrics)``.

    A token is dropped (its mask set to 0) when its current, behaviour or reference log-prob or
    entropy (``guards/nonfinite_logps``), or its advantage or vLLM importance weight
    (``guards/nonfinite_advantages``), is NaN or ±inf. ``guards/empty_mask`` is 1 when the
    micro-batch then has no trained token (its loss is exactly 0). The metrics are 0-dim tensors and nothing here
    reads the device (no host synchronisation inside the loss).
    """
    valid = mask != 0
    bad_logps = ~torch.isfinite(logps.detach())
    for value in (batch.old_logps, batch.ref_logps):
        if value is not None:
            bad_logps |= ~torch.isfinite(value)
    if entropies is not None:
        bad_logps |= ~torch.isfinite(entropies.detach())
    bad_adv = torch.zeros_like(valid)
    for value in (batch.advantages, batch.importance_sampling_ratio):
        if value is not None:
            value = value.unsqueeze(1) if value.dim() == 1 else value
            bad_adv |= ~torch.isfinite(value).expand_as(valid)
    bad_logps &= valid
    bad_adv &= valid & ~bad_logps
    dropped = bad_logps | bad_adv
    mask = mask * (~dropped).to(mask.dtype)  # unchanged where nothing is dropped; no host read to find out
    # 0-dim tensors: read with the micro-batch's other metrics in one device synchronisation (`append_metrics`)
    metrics = {
        "guards/nonfinite_logps": bad_logps.sum().float(),
        "guards/nonfinite_advantages": bad_adv.sum().float(),
        "guards/empty_mask": (mask == 0).all().float(),
    }
    return mask, metrics


def zero_loss(model: torch.nn.Module) -> torch.Tensor:
    """A loss of exactly 0 whose backward gives every trainable parameter a zero gradient (so DDP's
    all-reduce still sees every parameter), used in place of a non-finite loss."""
    terms = [p.reshape(-1)[:1].sum() * 0.0 for p in model.parameters() if p.requires_grad]
    return torch.stack(terms).sum() if terms else torch.zeros(())


def is_finite(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(x).all()) if torch.is_tensor(x) else math.isfinite(x)


# ------------------------------------------------------------------------------- components
#: keyword arguments that one trainer takes and the others do not: the trainer that takes each, and what it is
OWNED_ARGUMENTS = {
    "expert_dataset": ("ChordTrainer", "ChordConfig", "demonstrations for CHORD/MIX"),
    "value_model": ("PPOTrainer", "PPOConfig", "a critic"),
    "value_peft_config": ("PPOTrainer", "PPOConfig", "the critic's LoRA"),
    "agent": ("StepGRPOTrainer", "StepGRPOConfig", "a multi-step agent"),
}


def check_owned_arguments(trainer_name: str, kwargs: dict[str, Any]) -> None:
    """A keyword argument that another trainer takes (``expert_dataset`` given to ``TrinityTrainer``) is one line
    naming that trainer, as an algorithm that needs it is (`check_components`), instead of TRL's bare
    ``unexpected keyword argument``. ``kwargs``: what the trainer passes on to TRL (its own are taken out)."""
    for name, (owner, config, what) in OWNED_ARGUMENTS.items():
        if name in kwargs:
            raise TypeError(
                f"{trainer_name} does not take {name} ({what}); use {owner} with a {config}: "
                f"{owner}(model, reward_funcs, args={config}(...), {name}=...)"
            )


def check_components(
    trainer_cls: type, algorithm: Any, components: Any, args: Any, teacher_model: Any, rollout_func: Any = None
) -> None:
    """Reject, at construction, an algorithm whose components need something ``trainer_cls`` does not
    provide, asking the components' declared properties (never their registry names)."""
    policy, advantage = components.policy_loss, components.advantage_fn
    if algorithm.use_critic and not trainer_cls.has_critic:
        raise ValueError(
            f"algorithm {algorithm.algorithm!r} needs a value model (critic) and GAE: use PPOTrainer with a PPOConfig, "
            "or a critic-free preset such as 'grpo' or 'reinforceplusplus'"
        )
    if algorithm.schema != "experience":
        raise ValueError(
            f"algorithm {algorithm.algorithm!r} trains on {algorithm.schema!r} data, not on rollouts; use "
            f"{'TrinitySFTTrainer' if algorithm.schema == 'sft' else 'TrinityDPOTrainer'} instead"
        )
    if policy.pairwise:
        raise ValueError(
            f"policy loss {algorithm.policy_loss.name!r} compares chosen/rejected pairs, not rollouts; use "
            "TrinityDPOTrainer (algorithm='dpo')"
        )
    if policy.needs_expert_rows and not trainer_cls.supports_expert_rows:
        raise ValueError(f"policy loss {algorithm.policy_loss.name!r} needs expert rows; use ChordTrainer (MIX/CHORD)")
    if components.kl_penalty.enabled and not algorithm.compute_advantage_in_trainer:
        raise ValueError(
            f"kl_penalty={algorithm.kl_penalty.name!r} subtracts a KL from token rewards before trainer-side "
            f"advantages, but algorithm {algorithm.algorithm!r} computes advantages on experience groups "
            "(use kl_loss, or a preset such as 'reinforceplusplus' or 'rloo')"
        )
    if components.entropy_loss.needs_expert_mask and not trainer_cls.supports_expert_rows:
        raise ValueError(
            f"entropy_loss {algorithm.entropy_loss.name!r} needs expert rows; use ChordTrainer, or "
            "entropy_loss='default'"
        )
    # (the asynchronous trainers' configs have no use_vllm, sync_ref_model or steps_per_generation: TRL's
    # AsyncGRPOConfig generates with a vLLM server or our worker, keeps no reference model and has no generation batch)
    if getattr(args, "use_vllm", False) and args.vllm_importance_sampling_correction and not policy.linear_in_advantage:
        raise ValueError(
            f"policy loss {algorithm.policy_loss.name!r} with these arguments is not linear in the advantage, so TRL's "
            "vLLM importance-sampling weight cannot be applied through the advantages; set "
            "vllm_importance_sampling_correction=False"
        )
    if policy.needs_step_mask and getattr(args, "steps_per_generation", None) is not None:
        # the synchronous trainers (the asynchronous ones hold each step's micro-batches before its first forward)
        behaviour_logps = (getattr(args, "use_vllm", False) and args.vllm_importance_sampling_correction) or (
            advantage is not None and (advantage.needs_old_logprobs or components.kl_penalty.enabled)
        )
        reason = window_refusal(
            args.steps_per_generation, args.num_iterations, args.gradient_accumulation_steps, bool(behaviour_logps)
        )
        if reason is not None:
            raise ValueError(
                f"policy loss {algorithm.policy_loss.name!r} chooses its mask over each optimizer step's tokens before "
                f"the step's first backward: {reason}"
            )
    if getattr(args, "sync_ref_model", False) and not algorithm.needs_reference:
        raise ValueError(
            "sync_ref_model=True updates the reference model, but this algorithm uses none (no KL loss or "
            "penalty): set kl_loss or kl_penalty, or sync_ref_model=False"
        )
    if advantage is None or not policy.reads_advantages:
        return
    name = algorithm.advantage.name
    if advantage.needs_teacher_logprobs and teacher_model is None and rollout_func is None:
        raise ValueError(
            f"advantage {name!r} needs a teacher_model (a model or a path), or a rollout_func that "
            "returns 'teacher_logprobs'"
        )
    if advantage.needs_reward_baselines and (
        args.per_device_train_batch_size * getattr(args, "steps_per_generation", 1) % args.num_generations
    ):
        raise ValueError(
            f"advantage {name!r} scores one greedy completion per prompt group, so each process's "
            f"generation batch (per_device_train_batch_size * steps_per_generation = "
            f"{args.per_device_train_batch_size * args.steps_per_generation}) must hold whole groups of "
            f"num_generations={args.num_generations}"
        )
    if advantage.needs_step_states and not getattr(trainer_cls, "plays_runs", False):
        raise ValueError(
            f"advantage {name!r} compares the steps of multi-step runs by the state each acted from; "
            f"{trainer_cls.__name__} generates one turn per prompt and records no states: use StepGRPOTrainer (or "
            "AsyncStepGRPOTrainer) with an environment or agent="
        )
    if advantage.needs_values and not trainer_cls.has_critic:
        raise ValueError(
            f"advantage {name!r} (GAE) needs critic values; it is only available with a value model (PPOTrainer)"
        )


def check_completion_room(max_completion_length: int, max_positions: int | None) -> None:
    if max_positions is not None and max_completion_length >= max_positions:
        raise ValueError(
            f"max_completion_length ({max_completion_length}) leaves no room for a prompt in the "
            f"model's {max_positions} positions (max_position_embeddings)"
        )


def check_model_source(model: Any, option: str = "model") -> None:
    """A model named by a string that cannot be loaded now is a one-line error before anything loads: a path that
    does not exist (or a folder without ``config.json``), or a Hub id that is neither in the cache nor on a Hub that
    answers within `trinity_trl.data.loading.HUB_PROBE_SECONDS` (`trinity_trl.data.loading.hub_repo_problem`).
    ``"bundled"``, ``None`` and model objects pass; ``option`` names the argument in the message."""
    from ..data.loading import close_local_name, hub_repo_problem, looks_like_path, missing_path_message
    from ..data.model import BUNDLED, BUNDLED_MODEL_HUB_ID

    if not isinstance(model, (str, os.PathLike)) or model == BUNDLED:
        return
    text = os.fspath(model)
    path = os.path.expanduser(text)
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, name)) for name in ("config.json", "adapter_config.json")):
            raise FileNotFoundError(f"{option} {text!r} is a folder without config.json: not a saved model")
        return
    if looks_like_path(text):
        raise FileNotFoundError(f"{option} {missing_path_message(text, 'model folder')}")
    problem = hub_repo_problem(text, "model")
    if problem is None:
        return
    hint = ""
    if difflib.get_close_matches(text, [BUNDLED_MODEL_HUB_ID], n=1, cutoff=0.8):
        hint = f"; did you mean {BUNDLED_MODEL_HUB_ID}? ('{BUNDLED}' is that model, from an installed package, offline)"
    elif close := close_local_name(text):
        hint = f"; did you mean {close}?"
    raise FileNotFoundError(f"{option} {text!r} {problem}{hint}")


def check_hub_reachable(args: Any) -> None:
    """With ``push_to_hub=True`` transformers creates the repository while the trainer is built; without a
    reachable Hub that fails deep inside with a raw connection error. Say what is wrong instead."""
    if getattr(args, "push_to_hub", False):
        require_hub("push_to_hub=True", "set push_to_hub=False")


def require_hub(what: str, instead: str) -> None:
    """A one-line ``ValueError`` (``<what>, but the Hub is ...: <instead>``) when the Hugging Face Hub is switched
    off (``HF_HUB_OFFLINE``) or does not answer; ``what``: the call that needs it, ``instead``: what to do."""
    message = hub_unavailable(what, instead)
    if message:
        raise ValueError(message)


@contextlib.contextmanager
def hub_errors_in_one_line(what: str, instead: str) -> Iterator[None]:
    """Run a Hub call; if it fails because the Hub is switched off or unreachable, raise `require_hub`'s one-line
    ``ValueError`` instead of the HTTP client's traceback (any other error is raised as it is)."""
    try:
        yield
    except Exception as err:  # a raw connection error from inside huggingface_hub: one line instead
        message = hub_unavailable(what, instead, err)
        if message is None:
            raise
        raise ValueError(message) from None


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What a Hub call raises when the Hub does not answer: Python's, and the HTTP clients' transport errors
    (huggingface_hub's client is ``httpx2`` in this release, ``httpx`` or ``requests`` in others)."""
    import importlib

    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def hub_unavailable(what: str, instead: str, error: BaseException | None = None) -> str | None:
    """The one-line message of `require_hub` when the Hub is switched off or unreachable, else ``None``. Without
    ``error`` the Hub is asked (any HTTP answer, even 401, means it is there); with ``error`` (what a Hub call raised)
    only a connection error, or offline mode, means it is unavailable."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return (
            f"{what}, but the Hugging Face Hub is switched off (HF_HUB_OFFLINE=1): {instead}, or unset HF_HUB_OFFLINE"
        )
    if error is None:
        try:
            get_session().get(f"{constants.ENDPOINT}/api/whoami-v2", timeout=10)
            return None
        except Exception as err:  # noqa: BLE001 (connection refused, DNS, timeout, proxy: all mean unreachable)
            error = err
    elif not isinstance(error, _connection_errors()):
        return None
    return (
        f"{what}, but the Hugging Face Hub at {constants.ENDPOINT} is unreachable ({type(error).__name__}): "
        f"{instead}, or check the network / HF_ENDPOINT"
    )


def rollout_teacher_logps(per_row: list[Any], completion_mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` teacher log-probs from a ``rollout_func``'s ``teacher_logprobs`` (one list per completion,
    one value per completion token), checked against the completion lengths; 0 after each completion."""
    lengths = completion_mask.shape[1]
    out = torch.zeros(completion_mask.shape, dtype=torch.float32, device=completion_mask.device)
    for i, values in enumerate(per_row):
        values = torch.as_tensor(values, dtype=torch.float32)
        n = int((completion_mask[i] != 0).nonzero().max()) + 1 if (completion_mask[i] != 0).any() else 0
        if values.dim() != 1 or values.numel() < n or values.numel() > lengths:
            raise ValueError(
                f"rollout_func returned {values.numel()} teacher_logprobs for row {i}, whose completion "
                f"has {n} tokens; give one value per completion token"
            )
        out[i, : values.numel()] = values.to(out.device)
    return out
