"""KL estimators as loss and as reward penalty, with the adaptive coefficient (spec §10)."""

from __future__ import annotations

from .registry import Registry

KL_FN: Registry = Registry("KL function")
