"""Entropy loss terms (spec §11.1)."""

from __future__ import annotations

from .registry import Registry

ENTROPY_LOSS_FN: Registry = Registry("entropy loss function")
