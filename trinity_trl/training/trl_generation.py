"""The generation interface a trainer offers to rollouts (`trinity_trl.rollouts.Generator`).

It wraps TRL's own prompt tokenization and single-turn generation (transformers ``generate``,
continuous batching or vLLM, whichever the trainer is configured for), so multi-step rollouts use
exactly the sampling settings, chat template and weight syncing of TRL's generation path.
"""

from __future__ import annotations

import copy
from typing import Any

from ..overrides import temporarily

# generation settings that only apply to sampling (unset for greedy decoding)
SAMPLING_ONLY = ("temperature", "top_p", "top_k", "min_p")

# multimodal keys TRL's forward pass accepts; passed through unchanged
FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


class TRLGeneration:
    """`trinity_trl.rollouts.Generator` backed by a TRL ``GRPOTrainer``."""

    def __init__(self, trainer):
        self._trainer = trainer
        self.eos_token_id = trainer._tokenizer.eos_token_id
        self.eos_token_ids = set(trainer.eos_token_ids)

    def tokenize_conversations(self, conversations: list[list[dict[str, Any]]]) -> list[list[int]]:
        return [list(ids) for ids in self._trainer._tokenize_prompts(conversations)[0]]

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        trainer = self._trainer
        return list(
            trainer.processing_class.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                chat_template=trainer.chat_template,
                **trainer.chat_template_kwargs,
            )
        )

    def generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]] | None]:
        completions, logprobs = self._trainer._generate_single_turn(prompt_ids, None, {}, 1)
        return [list(c) for c in completions], logprobs

    def generate_greedy(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """One greedy completion per prompt through the same generation path (ReMax's baselines)."""
        trainer = self._trainer
        if trainer.use_vllm:  # vLLM reads its sampling settings from the generation helper's attributes
            settings = temporarily(trainer.vllm_generation, temperature=0.0)
        else:  # transformers generate reads both the config and TRL's override kwargs
            kwargs = {k: v for k, v in trainer.generation_kwargs.items() if k not in SAMPLING_ONLY}
            config = copy.deepcopy(trainer.generation_config)
            config.do_sample = False
            for name in SAMPLING_ONLY:
                setattr(config, name, None)
            settings = temporarily(trainer, generation_kwargs={**kwargs, "do_sample": False}, generation_config=config)
        with settings:
            completions, _ = trainer._generate_single_turn(prompt_ids, None, {}, 1)
        return [list(c) for c in completions]

    def decode(self, ids: list[int]) -> str:
        return self._trainer.processing_class.decode(ids, skip_special_tokens=True)
