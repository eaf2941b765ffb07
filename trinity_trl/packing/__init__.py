"""Prefix-shared, padding-free forward passes: each distinct token of a micro-batch is encoded once.

TRL's ``GRPOTrainer`` forwards a micro-batch as rows of left-padded prompt + right-padded completion,
so the G completions of a prompt encode that prompt G times and every row is padded to the widest.
Here the rows are folded into a prefix tree laid out as ONE packed row (`tree`: shared prompts,
earlier turns and common system prompts once, several groups per row, no padding), whose attention
(ancestors, then causal within a node) runs through one of the kernels of `kernels`
(``sdpa_segments`` on CPU; ``varlen``, ``flash_attn`` or ``flex`` on CUDA), reached through a named
attention implementation in transformers' public attention registry, the plan passed as a forward keyword
argument (`attention`). `selection` is the one place that decides, per
forward, between a packed kernel and TRL's padded forward (``prefix_packing_kernel``; on CUDA ``auto``
keeps packing only where it timed faster than the padded forward on the run itself), and
`forward` runs the packed log-prob and critic forwards for the trainers
(`forward.PrefixPacking`). User guide: ``docs/prefix-packing.md``.
"""

from .attention import TREE_ATTENTION, TreePlan, tree_attention
from .forward import (
    VERIFIED_MODEL_TYPES,
    PackedOutput,
    PrefixPacking,
    causal_lm,
    packed_critic_values,
    packed_logps,
    unsupported_reason,
)
from .kernels import KERNELS, GatheredKeys, TreeKernel, gathered_keys, tree_block_mask, tree_mask_mod
from .selection import KERNEL_CHOICES, Calibration, Choice, check_kernel_request, choose
from .tree import NotPackable, PackedRows, Segment, pack_rows, row_spans

__all__ = [
    "KERNELS",
    "KERNEL_CHOICES",
    "TREE_ATTENTION",
    "VERIFIED_MODEL_TYPES",
    "Calibration",
    "Choice",
    "GatheredKeys",
    "NotPackable",
    "PackedOutput",
    "PackedRows",
    "PrefixPacking",
    "Segment",
    "TreePlan",
    "TreeKernel",
    "causal_lm",
    "check_kernel_request",
    "choose",
    "gathered_keys",
    "pack_rows",
    "packed_critic_values",
    "packed_logps",
    "row_spans",
    "tree_attention",
    "tree_block_mask",
    "tree_mask_mod",
    "unsupported_reason",
]
