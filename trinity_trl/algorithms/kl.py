"""KL estimators as loss and as reward penalty, with the adaptive coefficient (docs/algorithms/kl.md).

Every estimator is per token, on ``(B, T)`` log-probs of the sampled tokens, in nats. One
registry serves both uses: ``kl_loss`` (a term added to the actor loss) and ``kl_penalty``
(subtracted from the token-level reward before the advantage function).
"""

from __future__ import annotations

import abc
from collections.abc import MutableMapping
from typing import Any, ClassVar

import torch

from .args import ComponentArgs
from .inputs import resolve_inputs
from .masked import agg_loss, masked_fill_invalid, masked_mean
from .registry import Registry


class KLFn(ComponentArgs, abc.ABC):
    """Base of the KL estimators: ``calculate_kl`` per token (abstract: every estimator defines it),
    plus the loss and penalty wrappers.

    ``kl_coef`` (β) scales both uses. With ``adaptive=True`` the penalty updates β after every
    batch to steer the observed KL towards ``target_kl`` over ``horizon`` samples
    (Ziegler et al. 2019); ``state_dict`` / ``load_state_dict`` checkpoint it.
    """

    name: ClassVar[str]
    # False for the no-op ``none``: a trainer then skips the term and needs no reference model for it
    enabled: ClassVar[bool] = True

    def __init__(
        self,
        adaptive: bool = False,
        kl_coef: float = 0.001,
        target_kl: float | None = None,
        horizon: float | None = None,
    ):
        if not kl_coef >= 0:
            raise ValueError(f"{self._owner}: kl_coef must be >= 0, got {kl_coef}")
        if adaptive:
            if target_kl is None or horizon is None:
                raise ValueError(f"{self._owner}: adaptive=True needs both target_kl and horizon")
            if not (target_kl > 0 and horizon > 0):
                raise ValueError(f"{self._owner}: target_kl and horizon must be > 0, got {target_kl}, {horizon}")
        self.adaptive = bool(adaptive)
        self.kl_coef = float(kl_coef)
        self.target_kl = target_kl
        self.horizon = horizon

    @property
    def _owner(self) -> str:
        return f"KL function {getattr(self, 'name', type(self).__name__)!r}"

    @abc.abstractmethod
    def calculate_kl(
        self, logprob: torch.Tensor, ref_logprob: torch.Tensor, old_logprob: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-token KL estimate ``(B, T)``; gradient flows through ``logprob``."""

    def calculate_kl_loss(
        self,
        logprob: torch.Tensor,
        ref_logprob: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str,
        old_logprob: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """``(kl_coef · AGG(kl, m, loss_agg_mode), {"kl_loss": AGG(...), "kl_coef": kl_coef})``.

        All tensors ``(B, T)``. Inputs are zeroed at masked positions first, so NaN/inf there
        reaches neither the value nor the gradient.
        """
        if response_mask.shape != logprob.shape:
            raise ValueError(
                f"response_mask shape {tuple(response_mask.shape)} != logprob shape {tuple(logprob.shape)}"
            )
        logprob, ref_logprob = (
            masked_fill_invalid(logprob, response_mask),
            masked_fill_invalid(ref_logprob, response_mask),
        )
        if old_logprob is not None:
            old_logprob = masked_fill_invalid(old_logprob, response_mask)
        kl_agg = agg_loss(self.calculate_kl(logprob, ref_logprob, old_logprob), response_mask, loss_agg_mode)
        return self.kl_coef * kl_agg, {"kl_loss": float(kl_agg.detach()), "kl_coef": self.kl_coef}

    def apply_kl_penalty_to_reward(
        self, batch: MutableMapping[str, Any]
    ) -> tuple[MutableMapping[str, Any], dict[str, float]]:
        """Write ``token_level_rewards = token_level_scores − β·kl(ℓo, ℓr)·m`` into ``batch``.

        Reads ``token_level_scores``, ``response_mask`` (or an alias), ``old_log_probs`` and
        ``ref_log_prob`` (or aliases), all ``(B, T)``. Without reference log-probs the rewards are
        the scores. Returns ``(batch, {"kl": mean per-row KL, "kl_coef": β used})`` and then
        updates β if adaptive.
        """
        inputs = resolve_inputs(batch, ("token_level_scores", "action_mask"), ("old_logprob", "ref_logprob"))
        scores, mask = inputs["token_level_scores"], inputs["action_mask"]
        if "ref_logprob" in inputs:
            if "old_logprob" not in inputs:
                raise ValueError(
                    "apply_kl_penalty_to_reward: ref log-probs given without old log-probs (old_log_probs)"
                )
            old, ref = (
                masked_fill_invalid(inputs["old_logprob"], mask),
                masked_fill_invalid(inputs["ref_logprob"], mask),
            )
            # the sampled (behaviour) log-probs stand in for the policy: no gradient is wanted here
            kl = self.calculate_kl(old, ref) * mask.to(old.dtype)
            beta = self.kl_coef
            batch["token_level_rewards"] = scores - beta * kl
            current_kl = float(masked_mean(kl, mask, dim=-1).mean())
        else:
            beta, current_kl = 0.0, 0.0
            batch["token_level_rewards"] = scores.clone()
        self.update_kl_coef(current_kl, batch_size=scores.shape[0])
        return batch, {"kl": current_kl, "kl_coef": beta}

    def update_kl_coef(self, current_kl: float | torch.Tensor, batch_size: int) -> None:
        """Adaptive controller: ``β ← β·(1 + clip(kl/target − 1, ±0.2)·n/horizon)``; no-op if not adaptive."""
        if not self.adaptive:
            return
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.kl_coef = self.kl_coef * (1.0 + error * batch_size / self.horizon)

    def state_dict(self) -> dict[str, float]:
        return {"kl_coef": self.kl_coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "kl_coef" not in state:
            raise ValueError(f"{self._owner}: state dict has no 'kl_coef' (keys: {sorted(state)})")
        self.kl_coef = float(state["kl_coef"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


KL_FN: Registry[type[KLFn]] = Registry("KL function")


@KL_FN.register("none")
class DummyKLFn(KLFn):
    """No KL: zero estimate, zero loss with no metrics, rewards equal to scores."""

    enabled = False

    def calculate_kl(self, logprob, ref_logprob, old_logprob=None):
        return torch.zeros_like(logprob)

    def calculate_kl_loss(self, logprob, ref_logprob, response_mask, loss_agg_mode, old_logprob=None):
        return torch.zeros((), dtype=logprob.dtype, device=logprob.device), {}

    def apply_kl_penalty_to_reward(self, batch):
        batch["token_level_rewards"] = resolve_inputs(batch, ("token_level_scores",))["token_level_scores"].clone()
        return batch, {}


@KL_FN.register("k1")
class K1Fn(KLFn):
    """``ℓ − ℓr``: unbiased, high variance, can be negative."""

    def calculate_kl(self, logprob, ref_logprob, old_logprob=None):
        return logprob - ref_logprob


@KL_FN.register("k2")
class K2Fn(KLFn):
    """``½(ℓ − ℓr)²``: biased, low variance, non-negative."""

    def calculate_kl(self, logprob, ref_logprob, old_logprob=None):
        return 0.5 * (logprob - ref_logprob) ** 2


def _k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    log_ratio = ref_logprob - logprob
    return torch.exp(log_ratio) - 1 - log_ratio


@KL_FN.register("k3")
class K3Fn(KLFn):
    """``exp(d) − 1 − d`` with ``d = ℓr − ℓ``: unbiased, non-negative, unclamped."""

    def calculate_kl(self, logprob, ref_logprob, old_logprob=None):
        return _k3(logprob, ref_logprob)


@KL_FN.register("low_var_kl")
class LowVarKLFn(KLFn):
    """verl's ``low_var_kl``: k3 with ``d`` clamped to ±20 and the result clamped to ±10."""

    def calculate_kl(self, logprob, ref_logprob, old_logprob=None):
        log_ratio = torch.clamp(ref_logprob - logprob, -20.0, 20.0)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -10.0, 10.0)


@KL_FN.register("abs")
class AbsFn(KLFn):
    """``|ℓ − ℓr|``."""

    def calculate_kl(self, logprob, ref_logprob, old_logprob=None):
        return torch.abs(logprob - ref_logprob)


@KL_FN.register("corrected_k3")
class CorrectedK3Fn(KLFn):
    """k3 re-weighted by the (non-detached) ratio ``clamp(exp(ℓ − ℓo), 0, 2)`` when ``ℓo`` is given
    (DeepSeek-V3.2's unbiased KL for off-policy samples); plain k3 otherwise."""

    def calculate_kl(self, logprob, ref_logprob, old_logprob=None):
        kl = _k3(logprob, ref_logprob)
        if old_logprob is None:
            return kl
        return kl * torch.clamp(torch.exp(logprob - old_logprob), 0.0, 2.0)


_VERL_NAMES = {"kl": "k1", "mse": "k2"}


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate ``(B, T)`` by name, with verl's function name and signature.

    Accepts the ``KL_FN`` keys plus verl's ``"kl"`` (= ``k1``) and ``"mse"`` (= ``k2``).
    Unlike verl, where ``"k3"`` means the clamped ``low_var_kl``, ``"k3"`` here is the unclamped
    k3 of docs/algorithms/kl.md#estimators; pass ``"low_var_kl"`` for verl's behaviour. ``"full"`` (a KL over the whole
    vocabulary) needs logits, not sampled-token log-probs, and is rejected.
    """
    name = _VERL_NAMES.get(kl_penalty, kl_penalty)
    if name not in KL_FN:
        allowed = ", ".join([*KL_FN.names(), *_VERL_NAMES])
        raise ValueError(f"Unknown kl_penalty {kl_penalty!r}; allowed: {allowed}")
    return KL_FN.get(name)().calculate_kl(logprob, ref_logprob)
