"""Input-name mapping shared by every component (docs/algorithms/index.md#notation,
docs/algorithms/index.md#call-convention).

Components use Trinity's internal names. Callers may use the internal names, verl's names or
TRL's names; `resolve_inputs` maps them. Unknown keys are ignored so a trainer can pass its
whole batch dict. One input under several names is fine when the values are equal (the same tensor,
or equal tensors); different values are an error.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

# internal name -> accepted aliases (internal first, then verl, then TRL)
INPUT_ALIASES: dict[str, tuple[str, ...]] = {
    "logprob": ("logprob", "log_prob", "log_probs", "per_token_logps"),
    "old_logprob": ("old_logprob", "old_log_probs", "old_log_prob", "old_per_token_logps"),
    "ref_logprob": ("ref_logprob", "ref_log_prob", "ref_log_probs", "ref_per_token_logps"),
    "action_mask": ("action_mask", "response_mask", "completion_mask"),
    "advantages": ("advantages",),
    "expert_mask": ("expert_mask",),
    "step": ("step",),
    "teacher_logprobs": ("teacher_logprobs", "teacher_log_prob", "teacher_per_token_logps"),
    "entropy": ("entropy", "entropies"),
    "step_mask": ("step_mask", "m2po_mask"),
}

# backend -> internal name -> the name that backend uses (for ``select_keys``)
BACKEND_NAMES: dict[str, dict[str, str]] = {
    "trl": {
        "logprob": "per_token_logps",
        "old_logprob": "old_per_token_logps",
        "ref_logprob": "ref_per_token_logps",
        "action_mask": "completion_mask",
        "teacher_logprobs": "teacher_per_token_logps",
    },
    "verl": {
        "logprob": "log_prob",
        "old_logprob": "old_log_probs",
        "ref_logprob": "ref_log_prob",
        "action_mask": "response_mask",
    },
}
BACKENDS = tuple(BACKEND_NAMES)

# per-token inputs whose masked-out positions are zeroed before any maths
PER_TOKEN_INPUTS = ("logprob", "old_logprob", "ref_logprob", "advantages", "teacher_logprobs", "entropy")


def check_backend(backend: str) -> str:
    if backend not in BACKEND_NAMES:
        raise ValueError(f"Unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    return backend


def backend_name(internal: str, backend: str) -> str:
    return BACKEND_NAMES[backend].get(internal, internal)


def same_value(a: Any, b: Any) -> bool:
    """Whether two values given for one input are equal: the same object, tensors of one shape with
    equal entries (NaN equals NaN; a bool and a float mask with the same 0/1 entries are equal), or
    equal plain values."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        try:
            a, b = torch.as_tensor(a), torch.as_tensor(b)
        except (TypeError, ValueError, RuntimeError):
            return False
        if a.shape != b.shape:
            return False
        b = b.to(a.device)
        equal = a == b
        if a.is_floating_point() and b.is_floating_point():
            equal |= torch.isnan(a) & torch.isnan(b)
        return bool(equal.all())
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # e.g. an array, whose == is elementwise
        return False


def pick_input(kwargs: Mapping[str, Any], internal: str, aliases: Iterable[str]) -> tuple[str, Any] | None:
    """``(alias, value)`` of ``internal`` in ``kwargs`` (the first of ``aliases`` present and not
    ``None``), or ``None`` if absent. ``ValueError`` when two aliases carry different values."""
    found = [(alias, kwargs[alias]) for alias in aliases if kwargs.get(alias) is not None]
    for alias, value in found[1:]:
        if not same_value(found[0][1], value):
            raise ValueError(
                f"Ambiguous input {internal!r}: {found[0][0]} and {alias} carry different values; pass one"
            )
    return found[0] if found else None


def resolve_inputs(kwargs: Mapping[str, Any], required: Iterable[str], optional: Iterable[str] = ()) -> dict[str, Any]:
    """Pick the inputs a component needs out of ``kwargs``, whatever naming convention it uses.

    Returns ``{internal_name: value}`` for every required and every present optional input.
    Raises ``ValueError`` when a required input is missing (or ``None``) or when two aliases of
    the same input carry different values (equal values, see `same_value`, are fine: the
    first alias in `INPUT_ALIASES` order is used).
    """
    resolved: dict[str, Any] = {}
    for internal in (*required, *optional):
        found = pick_input(kwargs, internal, INPUT_ALIASES.get(internal, (internal,)))
        if found:
            resolved[internal] = found[1]
        elif internal in required:
            aliases = ", ".join(INPUT_ALIASES.get(internal, (internal,)))
            raise ValueError(f"Missing required input {internal!r} (accepted names: {aliases})")
    return resolved


def metrics_to_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Detach tensor metrics and turn them into Python floats with a single device sync."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if keys:
        values = torch.stack([metrics[k].detach().reshape(()).to(torch.float64) for k in keys]).tolist()
        out.update(zip(keys, values))
    return {k: out[k] for k in metrics}
