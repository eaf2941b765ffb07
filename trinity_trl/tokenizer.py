"""Tokenizer loading with the two corrections verl applies (`verl.utils.tokenizer.hf_tokenizer`)."""

from __future__ import annotations

import os
import warnings
from typing import Any

GEMMA2_END_OF_TURN = "<end_of_turn>"


def hf_tokenizer(
    name_or_path: str | os.PathLike,
    correct_pad_token: bool = True,
    correct_gemma2: bool = True,
    **kwargs: Any,
):
    """Load a tokenizer with `AutoTokenizer.from_pretrained` and fix the eos and pad tokens for RL training.

    Args:
        name_or_path: Hub id or local directory, passed to `AutoTokenizer.from_pretrained`.
        correct_pad_token: If the tokenizer has no pad token (`pad_token_id is None`), use its eos token as the pad
            token and emit a `UserWarning` saying so. Batched generation and TRL's padding need a pad token.
        correct_gemma2: If `name_or_path` contains `"gemma-2"` (case-insensitive), make `<end_of_turn>` the eos token,
            with a `UserWarning`. Gemma-2 chat checkpoints declare `<eos>` as eos, but chat turns end with
            `<end_of_turn>`, so generation would not stop at the end of a turn and masks after "eos" would be wrong.
            verl hard-codes its id (107); here it is looked up in the loaded vocabulary.
        **kwargs: Forwarded to `AutoTokenizer.from_pretrained` (e.g. `padding_side="left"`, `revision=...`).

    Returns:
        The loaded tokenizer (a `PreTrainedTokenizerBase`), corrected in place.

    Raises:
        ValueError: `correct_gemma2` applies but the tokenizer has no `<end_of_turn>` token; or `correct_pad_token`
            is set, the tokenizer has no pad token and no eos token to use instead.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    return correct_tokenizer(
        tokenizer, name_or_path, correct_pad_token=correct_pad_token, correct_gemma2=correct_gemma2
    )


def correct_tokenizer(tokenizer, name_or_path, correct_pad_token: bool = True, correct_gemma2: bool = True):
    """The corrections of `hf_tokenizer`, applied in place to an already loaded tokenizer
    (the trainers apply them to the tokenizer inside the processor TRL loads)."""
    if correct_gemma2 and "gemma-2" in str(name_or_path).lower():
        end_of_turn_id = tokenizer.convert_tokens_to_ids(GEMMA2_END_OF_TURN)
        # Unknown tokens map to None, or to the unk id when the tokenizer has an unk token.
        unknown = end_of_turn_id is None or (
            tokenizer.unk_token_id is not None
            and end_of_turn_id == tokenizer.unk_token_id
            and tokenizer.unk_token != GEMMA2_END_OF_TURN
        )
        if unknown:
            raise ValueError(
                f"{str(name_or_path)!r} looks like a Gemma-2 tokenizer (its name contains 'gemma-2'), "
                f"but its vocabulary "
                f"has no {GEMMA2_END_OF_TURN!r} token to use as eos. Pass correct_gemma2=False to load it unchanged."
            )
        if tokenizer.eos_token != GEMMA2_END_OF_TURN:
            warnings.warn(
                f"Found a Gemma-2 tokenizer ({str(name_or_path)!r}): setting eos_token to {GEMMA2_END_OF_TURN!r} "
                f"(id {end_of_turn_id}) instead of {tokenizer.eos_token!r}, because chat turns end with it. "
                "Pass correct_gemma2=False to keep the original eos token.",
                UserWarning,
                stacklevel=2,
            )
            tokenizer.eos_token = GEMMA2_END_OF_TURN

    if correct_pad_token and tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"The tokenizer {str(name_or_path)!r} has neither a pad token nor an eos token to pad with. Set "
                "tokenizer.pad_token yourself, or pass correct_pad_token=False."
            )
        warnings.warn(
            f"The tokenizer {str(name_or_path)!r} has no pad token: using its eos token {tokenizer.eos_token!r} "
            f"(id {tokenizer.eos_token_id}) as the pad token. Pass correct_pad_token=False to leave it unset.",
            UserWarning,
            stacklevel=2,
        )
        tokenizer.pad_token = tokenizer.eos_token

    return tokenizer


# tool-calling chat templates TRL stores (trl.chat_template_utils) -> the special tokens they write
TOOL_CHAT_TEMPLATES: dict[str, tuple[str, ...]] = {
    "qwen2_5": ("<|im_start|>", "<|im_end|>"),  # ChatML with tool schemas and <tool_call> JSON (SmolLM2's tokens too)
}


def tool_chat_template(tokenizer: Any = "bundled", template: str = "qwen2_5", **kwargs: Any):
    """A tokenizer whose chat template renders tool schemas and tool calls, for models whose own template cannot
    (SmolLM2, the bundled model, among them): pass it as ``processing_class=`` to a trainer with tools or a TRL tool
    environment.

        trainer = StepGRPOTrainer(model="bundled", processing_class=tool_chat_template("bundled"), ...)

    Args:
        tokenizer: a loaded tokenizer (changed in place), or a model id or path (``"bundled"``: the bundled
            SmolLM2-135M-Instruct) whose tokenizer is loaded as the RL trainers load it (left padding and truncation,
            [`hf_tokenizer`][]'s corrections).
        template: the chat template TRL stores under that name: ``"qwen2_5"`` (Qwen2.5's ChatML, which writes tool
            schemas in the system turn and calls as ``<tool_call>`` JSON; TRL parses the calls with its Qwen parser).
        **kwargs: passed to [`hf_tokenizer`][] when ``tokenizer`` is a name or path.

    Returns:
        The tokenizer with ``chat_template`` replaced.

    Raises:
        ValueError: an unknown ``template``, or a tokenizer without the special tokens the template writes (the model
            would see them as plain text and never learn where turns end).
    """
    from .chat_template_seams import stored_chat_template

    if template not in TOOL_CHAT_TEMPLATES:
        raise ValueError(f"template must be one of {sorted(TOOL_CHAT_TEMPLATES)}, got {template!r}")
    if isinstance(tokenizer, (str, os.PathLike)):
        from .data.model import resolve_model

        name = resolve_model(os.fspath(tokenizer))
        tokenizer = hf_tokenizer(name, **{"padding_side": "left", "truncation_side": "left", **kwargs})
    inner = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
    vocabulary = inner.get_vocab()
    missing = [token for token in TOOL_CHAT_TEMPLATES[template] if token not in vocabulary]
    if missing:
        raise ValueError(
            f"the {template!r} chat template writes {', '.join(TOOL_CHAT_TEMPLATES[template])} as special tokens; "
            f"this tokenizer has no {', '.join(missing)}"
        )
    tokenizer.chat_template = stored_chat_template(template)
    return tokenizer
