"""How the tree attention reaches the model's attention layers.

A packed forward passes a `TreeAttentionMask` where the model takes a prepared 4D mask:
an empty ``(1, 1, 0, 0)`` tensor on the packed row's device (so transformers' mask preparation
returns it unchanged, DDP's input placement leaves it alone, and activation checkpointing keeps it
with the layer's saved inputs) that carries the kernel and its plan, built once per forward.

The layers' attention functions are looked up in transformers' ``AttentionInterface``: for the
implementations a packed forward accepts (``sdpa``, ``flash_attention_2``, ``flash_attention_3``)
`install` registers a wrapper that runs `tree_attention` when the mask is a
`TreeAttentionMask` and the original function otherwise, so a model loaded with
FlashAttention 2 is packed as well, and GQA key/value heads arrive unexpanded. (Registering
through the interface rather than only intercepting ``scaled_dot_product_attention`` is what makes
the FlashAttention-loaded models work; the mask still intercepts SDPA, for code that calls it
directly.) Any other use of the mask as a tensor is an error: it holds no mask values.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .kernels import TreeKernel

#: ``config._attn_implementation`` values whose attention function `install` wraps
DISPATCHED_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3")


class TreeAttentionMask(torch.Tensor):
    """The attention pattern of a packed row: ``kernel`` and its ``plan`` (see the module docs)."""

    kernel: TreeKernel
    plan: Any

    @staticmethod
    def __new__(cls, kernel: TreeKernel, plan: Any, device: torch.device | str):
        mask = torch.Tensor._make_subclass(cls, torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device))
        mask.kernel = kernel
        mask.plan = plan
        return mask

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _sdpa(*args, **kwargs)
        if func is torch.Tensor.to:  # device placement of inputs (DDP, accelerate): already where it belongs
            return args[0]
        name = getattr(func, "__name__", "")
        if name in _METADATA:  # shape, device, dtype, ndim (property getters), repr: those of the empty tensor
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise TypeError(
            f"a packed prefix-tree attention mask only goes to the attention function, not {name or func}; the "
            f"model's attention must be one of {', '.join(DISPATCHED_IMPLEMENTATIONS)} "
            "(set prefix_packing=False to forward padded rows)"
        )


_METADATA = ("__get__", "__repr__", "dim", "size", "__len__")


def tree_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: TreeAttentionMask, scale: float | None = None
) -> torch.Tensor:
    """Attention of a packed row: ``query`` ``(1, H, N, D)``, ``key``/``value`` ``(1, H_kv, N, D)``
    (``H_kv`` dividing ``H``) through ``mask``'s kernel; returns ``(1, H, N, D)``."""
    if query.shape[0] != 1:
        raise ValueError(f"a packed row has batch size 1, got query of shape {tuple(query.shape)}")
    return mask.kernel(mask.plan, query, key, value, scale)


def _sdpa(query, key, value, attn_mask, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if dropout_p:
        raise ValueError("prefix packing does not support attention dropout (set prefix_packing=False)")
    return tree_attention(query, key, value, attn_mask, scale)


def _wrap(original):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if not isinstance(attention_mask, TreeAttentionMask):
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        if kwargs.get("dropout") or (args and args[0]):
            raise ValueError("prefix packing does not support attention dropout (set prefix_packing=False)")
        out = tree_attention(query, key, value, attention_mask, kwargs.get("scaling"))
        return out.transpose(1, 2).contiguous(), None

    attention.trinity_tree_original = original
    return attention


def install() -> None:
    """Wrap the attention functions of `DISPATCHED_IMPLEMENTATIONS` (once; idempotent)."""
    from transformers import AttentionInterface

    mapping = AttentionInterface._global_mapping
    for name in DISPATCHED_IMPLEMENTATIONS:
        original = mapping.get(name)
        if original is not None and not hasattr(original, "trinity_tree_original"):
            AttentionInterface.register(name, _wrap(original))
