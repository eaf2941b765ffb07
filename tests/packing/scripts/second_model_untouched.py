"""Run by ``tests/packing/test_attention.py`` in a fresh process (nothing registered yet): a second, unrelated model
keeps its attention while a first model trains packed in the same process.

The second model (a tiny Llama, its own weights) is run before anything of trinity_trl's packing is imported; then
the first (the tiny Qwen2, activation checkpointing on) runs a packed forward through `PrefixPacking`, and the second
runs again while that forward's plan is alive, after its backward, and after a second packed forward without
gradients. Each time the second model's attention outputs (every layer) and logits are bit-identical to the first run,
its ``config._attn_implementation`` is the same, and the functions registered under the names transformers ships
(``sdpa``, ``eager``, FlashAttention, flex; and their mask functions) are the same objects as before. Prints ``OK``.

Usage: ``python second_model_untouched.py`` (with ``tests/`` and the repository on ``PYTHONPATH``).
"""

from __future__ import annotations

import contextlib
import gc

import torch
from helpers import build_tiny_model, build_tiny_tokenizer
from packing_helpers import grouped_rows, padded_batch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

SHIPPED = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


def registered() -> dict:
    return {
        (kind, name): registry.get(name)
        for kind, registry in (("attention", AttentionInterface()), ("mask", AttentionMaskInterface()))
        for name in SHIPPED
    }


def observe(model, ids, mask) -> list[torch.Tensor]:
    """The attention modules' outputs of every layer and the logits of a padded forward."""
    outputs = []
    handles = [
        layer.self_attn.register_forward_hook(lambda m, a, out: outputs.append(out[0].detach().clone()))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            outputs.append(model(input_ids=ids, attention_mask=mask).logits)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def check(model, expected_outputs, expected_registry, implementation, ids, mask, when: str) -> None:
    outputs = observe(model, ids, mask)
    assert len(outputs) == len(expected_outputs), when
    for i, (got, want) in enumerate(zip(outputs, expected_outputs, strict=True)):
        assert torch.equal(got, want), f"{when}: output {i} of the second model changed"
    assert model.config._attn_implementation == implementation, f"{when}: {model.config._attn_implementation!r}"
    now = registered()
    for key, function in expected_registry.items():
        assert now[key] is function, f"{when}: the {key[0]} function registered as {key[1]!r} changed"


def main() -> None:
    tokenizer = build_tiny_tokenizer()
    rows = grouped_rows(torch.Generator().manual_seed(3), vocab=len(tokenizer))
    ids, mask, keep = padded_batch(rows)
    second = build_tiny_model(tokenizer, arch="llama", seed=5).eval()
    implementation = second.config._attn_implementation
    expected_registry = registered()
    expected = observe(second, ids, mask)  # before anything of trinity_trl.packing exists in this process

    from trl.trainer.utils import add_fused_lm_head

    from trinity_trl.packing import PrefixPacking

    first = build_tiny_model(tokenizer)
    add_fused_lm_head(first, temperature=1.0, outputs=("log_probs",))
    first.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    first.train()
    packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext, kernel="sdpa_segments")
    check(second, expected, expected_registry, implementation, ids, mask, "with packing built")

    out = packing.logps_and_entropies(first, ids, mask, keep, None, False, False, {})
    assert out is not None and out.forwarded < out.padded, "the first model's forward was not packed"
    check(second, expected, expected_registry, implementation, ids, mask, "while a packed forward's plan is alive")
    out.logps.sum().backward()  # recomputes the first model's layers (activation checkpointing)
    assert all(p.grad is not None for p in first.parameters() if p.requires_grad)
    del out
    gc.collect()
    check(second, expected, expected_registry, implementation, ids, mask, "after the packed backward")

    with torch.no_grad():
        assert packing.logps_and_entropies(first, ids, mask, keep, None, False, False, {}) is not None
    check(second, expected, expected_registry, implementation, ids, mask, "after a packed forward without gradients")
    assert first.config._attn_implementation == implementation, first.config._attn_implementation
    print("OK")


if __name__ == "__main__":
    main()
