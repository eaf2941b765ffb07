"""TRL's chat-template helpers that its package does not export, used by the rollouts and the tokenizer helper: the
one place the package imports them from (`trinity_trl.training.grpo_seams` and
`trinity_trl.asynchronous.async_grpo_seams` are the trainers' two; ``tests/test_trl_surface.py`` lists everything).

* ``parse_response``: how TRL reads a sampled turn (its text, its tool calls) with the response template it knows
  for a chat template; the policy endpoint and the tool-run summaries read turns exactly as TRL's tool loop does.
* the tool-calling chat templates TRL stores (``trl.chat_template_utils.<name>_chat_template``), which
  `trinity_trl.tokenizer.with_tool_chat_template` puts on a tokenizer.

Importing this module imports TRL; its users import it when they need it, so ``import trinity_trl`` stays light.
"""

from __future__ import annotations

import trl.chat_template_utils
from trl.chat_template_utils import parse_response  # noqa: F401 (the rollouts import it from here)


def stored_chat_template(name: str) -> str:
    """The tool-calling chat template TRL stores as ``<name>_chat_template`` (``name``: e.g. ``"qwen3"``)."""
    return getattr(trl.chat_template_utils, f"{name}_chat_template")
