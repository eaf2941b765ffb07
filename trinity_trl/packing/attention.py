"""How the tree attention reaches the model's attention layers: transformers' public attention registry.

`register` adds one named attention implementation, ``TREE_ATTENTION`` (``"trinity_tree"``), to
transformers' ``AttentionInterface`` (its function, `tree_attention_forward`, runs the kernel of the
plan it is given) and to ``AttentionMaskInterface`` (its mask function returns no mask: the plan is
the mask). It adds a name and changes no entry that exists: ``sdpa``, ``eager``, the FlashAttention
functions and every other model in the process stay as they are.

A packed forward passes its `TreePlan` (the kernel and its plan, built once per forward) as the
keyword argument ``tree_attention_plan`` of the model's forward; transformers hands a forward's
keyword arguments down to the decoder layers and to the attention function. The model runs under
``TREE_ATTENTION`` only for the calls that carry a plan: `route` places forward hooks on the
backbone (and, where the layers recompute under activation checkpointing, on each decoder layer's
attention module) that set ``config._attn_implementation`` to ``TREE_ATTENTION`` while a call with a
plan runs, and set it back to what it was when the call returns (or raises). So

* the mask is made (``None``) by the registered mask function, and the layers' attention function is
  `tree_attention_forward`, which gets the key/value heads unexpanded (GQA) whatever the model was
  loaded with (``sdpa``, FlashAttention 2/3);
* activation checkpointing recomputes a layer with the keyword arguments of its first run, plan
  included, and the attention module's hook routes the recomputation the same way (a forward without
  gradients, or a model without checkpointing, recomputes nothing: the backbone's hooks alone);
* every call without a plan (TRL's padded forward, ``auto``'s padded timing pass, generation, the
  user's own calls) runs the model's own implementation, untouched;
* the hooks live as long as a packed forward's plan: they are removed when the last plan of the
  model is freed (after the backward, or at once without gradients), so nothing stays on the model
  (hooks left on it would cost every later call, generation's included, a few microseconds per
  module: more than installing them per packed forward). The backbone's hook also keeps, where the
  plan says so (``TreePlan.keep``), only the hidden states that predict a scored token.

A model saved or pushed meanwhile says its own implementation (``_attn_implementation`` is not
saved in ``config.json`` by transformers anyway).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .kernels import TreeKernel

#: the name of the tree attention in transformers' ``AttentionInterface`` and ``AttentionMaskInterface``
TREE_ATTENTION = "trinity_tree"
#: the keyword argument of the model's forward that carries a packed row's `TreePlan`
PLAN_KWARG = "tree_attention_plan"
#: ``config._attn_implementation`` values of the models a packed forward accepts (the model's own attention
#: runs every forward that is not packed)
PACKABLE_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True, eq=False)
class TreePlan:
    """The attention pattern of a packed row: ``kernel`` and its ``plan``, built once per forward; ``keep``: the
    positions of the backbone's output to keep (the tokens whose hidden states predict a scored token), or
    ``None`` for all. (Not a tuple or a dict: DDP's input placement passes it through as it is.)"""

    kernel: TreeKernel
    plan: Any
    keep: torch.Tensor | None = None


def tree_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: TreePlan, scale: float | None = None
) -> torch.Tensor:
    """Attention of a packed row: ``query`` ``(1, H, N, D)``, ``key``/``value`` ``(1, H_kv, N, D)``
    (``H_kv`` dividing ``H``) through ``plan``'s kernel; returns ``(1, H, N, D)``."""
    if query.shape[0] != 1:
        raise ValueError(f"a packed row has batch size 1, got query of shape {tuple(query.shape)}")
    return plan.kernel(plan.plan, query, key, value, scale)


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    tree_attention_plan: TreePlan | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``TREE_ATTENTION``: the signature of transformers' attention functions, the
    output ``(1, N, H, D)`` as theirs."""
    if tree_attention_plan is None:
        raise RuntimeError(
            f"the attention implementation {TREE_ATTENTION!r} runs packed forwards only (the forward's "
            f"{PLAN_KWARG!r} keyword argument is missing); load the model with attn_implementation='sdpa'"
        )
    if dropout:
        raise ValueError("prefix packing does not support attention dropout (set prefix_packing=False)")
    if query.shape[0] != 1:
        raise ValueError(f"a packed row has batch size 1, got query of shape {tuple(query.shape)}")
    plan = tree_attention_plan
    return plan.kernel.attend(plan.plan, query, key, value, scaling), None


def keep_hidden_states(plan: TreePlan, output: Any) -> Any:
    """The backbone's ``output`` with only ``plan.keep``'s positions of its ``last_hidden_state`` (all where ``keep`` is
    ``None``)."""
    if plan.keep is not None and output is not None:
        output["last_hidden_state"] = output["last_hidden_state"][:, plan.keep]
    return output


def _no_mask(**kwargs) -> None:
    """The mask function of ``TREE_ATTENTION``: a packed row's attention pattern is its plan."""
    return None


def register() -> None:
    """Register ``TREE_ATTENTION`` in transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
    AttentionMaskInterface.register(TREE_ATTENTION, _no_mask)


def layers_of(backbone: torch.nn.Module) -> list[torch.nn.Module]:
    """``backbone``'s decoder layers (transformers' ``GradientCheckpointingLayer`` modules)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in backbone.modules() if isinstance(m, GradientCheckpointingLayer)]


def attention_modules(backbone: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules of ``backbone``'s decoder layers (``self_attn``), the modules that look up the attention
    function by the config's name."""
    layers = layers_of(backbone)
    return [layer.self_attn for layer in layers if isinstance(getattr(layer, "self_attn", None), torch.nn.Module)]


class _Route:
    """The hooks on one model while it has live plans (see the module docs)."""

    def __init__(self, backbone: torch.nn.Module):
        self.config = backbone.config
        self.depth = 0  # calls with a plan in progress (the backbone's and, inside it, its layers')
        self.previous: str | None = None
        self.live = 0  # plans not yet freed
        self.handles = [
            backbone.register_forward_pre_hook(self._enter, with_kwargs=True),
            backbone.register_forward_hook(self._leave_backbone, with_kwargs=True, always_call=True),
        ]
        self.layers_routed = False

    def route_layers(self, modules: list[torch.nn.Module]) -> None:
        """Hooks on the attention modules too: their recomputation in the backward runs outside the backbone's call."""
        if not self.layers_routed:
            self.layers_routed = True
            for module in modules:
                self.handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._leave, with_kwargs=True, always_call=True))

    def _enter(self, module, args, kwargs):
        if kwargs.get(PLAN_KWARG) is not None:
            if self.depth == 0:
                self.previous = self.config._attn_implementation
                self.config._attn_implementation = TREE_ATTENTION
            self.depth += 1

    def _leave(self, module, args, kwargs, output):
        if kwargs.get(PLAN_KWARG) is not None and self.depth:
            self.depth -= 1
            if self.depth == 0:
                self.config._attn_implementation = self.previous

    def _leave_backbone(self, module, args, kwargs, output):
        self._leave(module, args, kwargs, output)
        plan = kwargs.get(PLAN_KWARG)
        return keep_hidden_states(plan, output) if plan is not None else output

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


_routes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backbone -> its _Route while it has live plans
#: backbone -> (its decoder layers, their attention modules): found once per model
_modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_registered = False


def _recomputes(backbone: torch.nn.Module, layers: list[torch.nn.Module]) -> bool:
    """Whether a forward now would recompute ``backbone``'s layers in its backward (activation checkpointing, as
    transformers' ``GradientCheckpointingLayer`` decides it: checkpointing on, training mode, gradients on)."""
    return torch.is_grad_enabled() and any(layer.gradient_checkpointing and layer.training for layer in layers)


def route(backbone: torch.nn.Module, plan: TreePlan) -> TreePlan:
    """Make ``backbone``'s calls that carry ``plan`` (as ``PLAN_KWARG``) run under ``TREE_ATTENTION``, until ``plan``
    is freed; returns ``plan``."""
    global _registered
    if not _registered:
        register()
        _registered = True
    if backbone not in _modules:
        layers = layers_of(backbone)
        _modules[backbone] = (layers, attention_modules(backbone))
    layers, modules = _modules[backbone]
    while True:  # a finalizer run by the garbage collector in between may have just removed the route
        current = _routes.get(backbone)
        if current is None:
            current = _routes[backbone] = _Route(backbone)
        current.live += 1
        if current.handles:
            break
    if _recomputes(backbone, layers):
        current.route_layers(modules)
    weakref.finalize(plan, _release, weakref.ref(backbone))
    return plan


def _release(backbone_ref: weakref.ref) -> None:
    backbone = backbone_ref()
    current = _routes.get(backbone) if backbone is not None else None
    if current is not None:
        current.live -= 1
        if current.live == 0:
            current.remove()
            del _routes[backbone]
