"""Entropy loss terms (docs/algorithms/entropy.md#entropy).

The trainer subtracts the returned term from the policy loss, so a positive ``entropy_coef``
rewards exploration. ``H`` is the entropy (nats) of the full next-token distribution at each
response position.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from .args import ComponentArgs
from .inputs import resolve_inputs
from .masked import agg_loss, check_loss_agg_mode, masked_fill_invalid
from .registry import Registry


class EntropyLossFn(ComponentArgs):
    """``loss, metrics = fn(entropy, action_mask, expert_mask=None, loss_agg_mode="token-mean")``.

    ``entropy``, ``action_mask``: ``(B, T)``; ``expert_mask``: ``(B,)`` bool. Alias names
    (``entropies``, ``response_mask``, ``completion_mask``) are accepted and unknown keyword
    arguments ignored, so a trainer can pass its whole batch dict.
    """

    name: ClassVar[str]
    # whether the term reads ``expert_mask`` (so the trainer must provide expert rows)
    needs_expert_mask: ClassVar[bool] = False
    # False for the no-op ``none``: a trainer then does not compute entropies for it
    enabled: ClassVar[bool] = True
    # required in the constructor, 0.0 (no entropy term) in a preset (docs/algorithms/entropy.md#entropy)
    preset_defaults = {"entropy_coef": 0.0}

    def __init__(self, entropy_coef: float):
        self.entropy_coef = float(entropy_coef)

    def __call__(
        self,
        entropy: torch.Tensor | None = None,
        action_mask: torch.Tensor | None = None,
        expert_mask: Any = None,
        loss_agg_mode: str = "token-mean",
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        named = {"entropy": entropy, "action_mask": action_mask, "expert_mask": expert_mask}
        kwargs.update({k: v for k, v in named.items() if v is not None})
        required = ("entropy", "action_mask", "expert_mask") if self.needs_expert_mask else ("entropy", "action_mask")
        inputs = resolve_inputs(kwargs, required, ("expert_mask",))
        entropy, mask = inputs["entropy"], inputs["action_mask"]
        if mask.shape != entropy.shape:
            raise ValueError(f"action_mask shape {tuple(mask.shape)} != entropy shape {tuple(entropy.shape)}")
        entropy = masked_fill_invalid(entropy, mask)
        h = self.aggregate(entropy, mask, inputs.get("expert_mask"), loss_agg_mode)
        return self.entropy_coef * h, {"entropy_loss": float(h.detach())}

    def aggregate(
        self, entropy: torch.Tensor, mask: torch.Tensor, expert_mask: Any, loss_agg_mode: str
    ) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


ENTROPY_LOSS_FN: Registry[type[EntropyLossFn]] = Registry("entropy loss function")


@ENTROPY_LOSS_FN.register("default")
class DefaultEntropyLossFn(EntropyLossFn):
    """``entropy_coef · AGG(H, m, mode)`` over every row."""

    def aggregate(self, entropy, mask, expert_mask, loss_agg_mode):
        return agg_loss(entropy, mask, loss_agg_mode)


@ENTROPY_LOSS_FN.register("mix")
class MixEntropyLossFn(EntropyLossFn):
    """``entropy_coef · AGG(H[¬e], m[¬e], mode)``: on-policy rows only, since the entropy of the
    policy on expert demonstrations says nothing about its exploration. A batch with no usual row
    gives 0 (not the NaN of an empty seq-mean)."""

    needs_expert_mask = True

    def aggregate(self, entropy, mask, expert_mask, loss_agg_mode):
        expert = torch.as_tensor(expert_mask, device=entropy.device).to(torch.bool)
        if expert.shape != entropy.shape[:1]:
            raise ValueError(
                f"entropy mix: expert_mask must have shape ({entropy.shape[0]},), got {tuple(expert.shape)}"
            )
        usual = ~expert
        if not bool(usual.any()):
            check_loss_agg_mode(loss_agg_mode)
            return entropy.sum() * 0.0  # stays in the graph: a caller may backprop this term alone
        return agg_loss(entropy[usual], mask[usual], loss_agg_mode)


@ENTROPY_LOSS_FN.register("none")
class DummyEntropyLossFn(EntropyLossFn):
    """No entropy term: ``(0, {})`` whatever the inputs."""

    enabled = False

    def __call__(self, entropy=None, action_mask=None, expert_mask=None, loss_agg_mode="token-mean", **kwargs):
        device = entropy.device if isinstance(entropy, torch.Tensor) else None
        return torch.zeros((), device=device), {}
