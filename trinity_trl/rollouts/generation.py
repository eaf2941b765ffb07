"""What a rollout needs from the trainer's generation backend: the small interface it talks to.

A multi-step rollout tokenizes conversations with the model's chat template, generates the next
turn of many conversations in one batched call, and decodes the result. The trainer provides an
object with these methods (``trinity_trl.training.trl_generation.TRLGeneration`` wraps TRL's
transformers / vLLM generation); tests can provide a scripted one.
"""

from __future__ import annotations

from typing import Any, Protocol


class Generator(Protocol):
    """The generation backend of a rollout.

    Attributes:
        eos_token_id: the id appended to a turn that was cut off before its end.
        eos_token_ids: every id that ends a turn.
    """

    eos_token_id: int
    eos_token_ids: set[int]

    def tokenize_conversations(self, conversations: list[list[dict[str, Any]]]) -> list[list[int]]:
        """Chat-template token ids of each conversation, ending with the generation prompt."""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """Chat-template token ids of ``messages``."""

    def generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]] | None]:
        """One completion per prompt (``completion ids``, and their sampling log-probs when known)."""

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` without special tokens."""
