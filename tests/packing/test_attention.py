"""How the tree attention reaches the layers (`trinity_trl/packing/attention.py`): the mask marker, and the wrapper
registered in transformers' AttentionInterface for `sdpa` and FlashAttention-loaded models."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import build_tiny_model, build_tiny_tokenizer
from packing_helpers import grouped_rows, padded_batch
from tolerance import assert_close

from trinity_trl.packing import KERNELS, PrefixPacking, TreeAttentionMask, unsupported_reason
from trinity_trl.packing import attention as attention_module


def test_the_mask_is_only_an_attention_marker():
    mask = TreeAttentionMask(KERNELS["sdpa_segments"], [], "cpu")
    assert mask.shape == (1, 1, 0, 0) and mask.device.type == "cpu"  # transformers takes it as a prepared 4D mask
    assert mask.to("cpu") is mask
    with pytest.raises(TypeError, match="attention function"):
        torch.add(torch.zeros(1, 1, 2, 2), mask)  # eager attention adds masks: refused, never silently wrong


def test_the_registered_wrapper_leaves_other_masks_to_the_original_function():
    from transformers import AttentionInterface

    attention_module.install()
    attention_module.install()  # idempotent: one wrapper, not a wrapper of a wrapper
    wrapped = AttentionInterface._global_mapping["sdpa"]
    original = wrapped.trinity_tree_original
    assert not hasattr(original, "trinity_tree_original")
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out, _ = wrapped(module, q, k, v, None, dropout=0.0, scaling=0.3)
    expected, _ = original(module, q, k, v, None, dropout=0.0, scaling=0.3)
    assert torch.equal(out, expected)  # the same function on the same inputs


def test_a_flash_attention_loaded_model_is_packed_through_the_wrapper():
    """A model whose attention is `flash_attention_2` is accepted, and its layers reach the tree kernel through the
    wrapper without calling FlashAttention (not installed here): its packed log-probs equal those of its `sdpa` twin's
    padded forward."""
    from trl.trainer.utils import add_fused_lm_head

    tokenizer = build_tiny_tokenizer()
    flash, twin = build_tiny_model(tokenizer), build_tiny_model(tokenizer)
    flash.config._attn_implementation = "flash_attention_2"
    assert unsupported_reason(flash) is None
    for model in (flash, twin):
        add_fused_lm_head(model, temperature=1.0, outputs=("log_probs",))
    ids, mask, keep = padded_batch(grouped_rows(torch.Generator().manual_seed(0), vocab=len(tokenizer)))
    labels = ids.masked_fill(mask == 0, -100)
    packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext)
    with torch.no_grad():
        packed = packing.logps_and_entropies(flash, ids, mask, keep, None, False, False, {})
        padded = twin(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -keep:]
    scored = mask[:, -keep:].bool()
    # 2 layers x (MLP 128 + hidden 64 + an attention row of <= 32 keys x head dim 16) + the vocabulary's logsumexp
    assert_close(packed.logps[scored], padded[scored], terms=2 * (128 + 64 + 32 * 16) + len(tokenizer))
