"""Tree-attention kernels behind one small interface.

A kernel computes ``scaled_dot_product_attention`` over a packed row (`tree`): query
``(1, H, N, D)``, key/value ``(1, H_kv, N, D)``; every token attends to its ancestor nodes and
causally to its own node. Each kernel has two parts:

* ``plan(packed, device)``: everything the kernel needs, built ONCE per packed forward on the device
  (offsets, index of gathered keys, BlockMask) and reused by every layer and by the backward. Its integer
  arrays are built on the host by ``arrays(segments, num_tokens)`` and travel in the packed row's one
  host-to-device copy (`tree.upload`); the Python integers a kernel takes (``max_q``, ``max_k``) come
  from the host arrays, so building the plan reads nothing back from the device;
* ``__call__(plan, query, key, value, scale)``: one layer; on CUDA a fixed number of kernel launches
  whatever the tree, no Python loop over nodes and no host synchronisation. ``attend`` is the same in
  transformers' output layout ``(1, N, H, D)`` (what the attention function returns), without the
  transposes ``__call__``'s layout costs.

The kernels:

* ``sdpa_segments`` (everywhere; the CPU kernel and the reference): one SDPA per tree node, the
  node's queries against the gathered keys of its root-to-node path with a bottom-right causal mask.
  Launch-bound on a GPU (a Python loop over nodes), so ``auto`` never picks it there.
* ``varlen`` (CUDA compute capability >= 8.0, fp16/bf16, torch >= 2.10):
  ``torch.nn.attention.varlen.varlen_attn`` (torch's FlashAttention kernels); queries
  are the packed row as it is, each node's keys its gathered path (``cu_seq_q`` / ``cu_seq_k`` per
  node), ``window_size=(-1, 0)`` (bottom-right causal, FlashAttention's convention). Key/value heads
  are expanded for GQA where the installed torch has no ``enable_gqa`` (before 2.12).
* ``flash_attn`` (CUDA compute capability >= 8.0, fp16/bf16, FlashAttention >= 2.1 installed: bottom-right
  causal masks came with 2.1): the same layout through ``flash_attn_varlen_func(causal=True)``, GQA native.
* ``flex`` (CUDA, fp32/fp16/bf16): FlexAttention with a tree BlockMask built directly from the layout
  (no ``create_block_mask``): ``mask_mod(q, k) = k <= q < subtree_end[k]``. Compiled with dynamic
  shapes: torch compiles the first length it sees, then one dynamic graph at the second, and no more
  (checked with torch 2.13's recompile log; a new ``subtree_end`` per forward does not recompile). The
  packed row is padded to a multiple of the block size (128), and to 2 blocks at least.

The gathered-key layout of ``varlen``/``flash_attn`` is also what ``sdpa_segments`` runs on, so the CPU
tests of the reference kernel test that layout too.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from packaging.version import InvalidVersion, Version

from .tree import PackedRows, Segment, upload

#: FlexAttention's sparse block size; the flex kernel pads the packed row to a multiple of it
FLEX_BLOCK = 128
HALF = (torch.float16, torch.bfloat16)
#: the compute capability FlashAttention 2 kernels need (Ampere), torch's own (``varlen``) and the package's
FLASH_MIN_CAPABILITY = (8, 0)
#: FlashAttention's causal mask is bottom-right aligned (what a node's gathered keys need) from this version on
FLASH_ATTN_MIN_VERSION = (2, 1)


def _capability_reason(name: str, device: torch.device) -> str | None:
    """Why the FlashAttention kernels of ``name`` cannot run on the CUDA ``device`` (``None``: they can)."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FLASH_MIN_CAPABILITY:
        need = ".".join(map(str, FLASH_MIN_CAPABILITY))
        return (
            f"the {name} kernel runs FlashAttention 2 kernels, which need a GPU of compute capability {need} or "
            f"newer (Ampere); {torch.cuda.get_device_name(device)} has {major}.{minor}"
        )
    return None


# ============================================================================ the gathered-key layout
@dataclass
class GatheredKeys:
    """Per tree node (segment ``i``): queries ``[cu_q[i], cu_q[i+1])`` of the packed row attend to the
    keys ``key_index[cu_k[i]:cu_k[i+1]]`` (the node's root-to-node path, its own tokens last),
    bottom-right causal: query ``j`` of the node sees the first ``k_len - q_len + j + 1`` keys."""

    key_index: np.ndarray  # (sum of path lengths,)
    cu_q: np.ndarray  # (segments + 1,)
    cu_k: np.ndarray  # (segments + 1,)

    @property
    def max_q(self) -> int:
        return int(np.diff(self.cu_q).max(initial=0))

    @property
    def max_k(self) -> int:
        return int(np.diff(self.cu_k).max(initial=0))


def gathered_keys(segments: list[Segment]) -> GatheredKeys:
    """The gathered-key layout of ``segments`` (depth-first order: queries are the packed row as is)."""
    index, q_lens, k_lens = [], [], []
    for seg in segments:
        ranges = [*seg.ancestors, (seg.start, seg.end)]
        index.append(np.concatenate([np.arange(s, e) for s, e in ranges]))
        q_lens.append(seg.end - seg.start)
        k_lens.append(sum(e - s for s, e in ranges))
    return GatheredKeys(
        key_index=np.concatenate(index) if index else np.zeros(0, dtype=np.int64),
        cu_q=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64),
        cu_k=np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int64),
    )


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype SDPA would run in here: the autocast dtype inside an autocast region (custom kernels are
    not cast by autocast; under it the rotary embedding can leave queries/keys in float32)."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return query.dtype


def _cast(dtype: torch.dtype, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.dtype == dtype else t.to(dtype) for t in tensors]


def _plan_arrays(
    kernel: TreeKernel, packed: PackedRows, device: torch.device
) -> tuple[dict[str, np.ndarray], dict[str, torch.Tensor]]:
    """``kernel``'s plan arrays, on the host and on ``device``: those uploaded with ``packed`` (`tree.pack_rows`'s
    ``arrays``), else built and uploaded now (a packed row built without them)."""
    names = kernel.array_names
    tensors = packed.kernel_tensors
    if all(n in tensors and n in packed.kernel_arrays for n in names) and all(
        tensors[n].device == torch.device(device) for n in names
    ):
        return {n: packed.kernel_arrays[n] for n in names}, {n: tensors[n] for n in names}
    arrays = kernel.arrays(packed.segments, packed.num_tokens)
    return arrays, upload(arrays, device)


# ============================================================================ the interface
class TreeKernel:
    """One tree-attention kernel (see the module docs)."""

    name: ClassVar[str]
    #: the packed row's length must be a multiple of this (padding tokens form a root segment of their own)
    pad_multiple: ClassVar[int] = 1
    #: and at least this long
    min_tokens: ClassVar[int] = 0
    #: dtypes the kernel runs in (None: any floating dtype)
    dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    #: the names of the plan arrays `arrays` returns
    array_names: ClassVar[tuple[str, ...]] = ()

    def unavailable(self, device: torch.device) -> str | None:
        """Why the kernel cannot run on ``device`` with the installed software (``None``: it can)."""
        raise NotImplementedError

    def unsupported_dtype(self, dtype: torch.dtype) -> str | None:
        if self.dtypes is not None and dtype not in self.dtypes:
            names = "/".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"the {self.name} kernel runs in {names}, not {str(dtype).removeprefix('torch.')}"
        return None

    def arrays(self, segments: list[Segment], num_tokens: int) -> dict[str, np.ndarray]:
        """The plan's integer arrays, built on the host (uploaded with the packed row: `tree.pack_rows`)."""
        return {}

    def plan(self, packed: PackedRows, device: torch.device) -> Any:
        raise NotImplementedError

    def __call__(
        self, plan: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        raise NotImplementedError

    def attend(
        self, plan: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        """`__call__` in transformers' attention output layout: ``(1, N, H, D)``, contiguous."""
        return self(plan, query, key, value, scale).transpose(1, 2).contiguous()


class SdpaSegments(TreeKernel):
    """One ``scaled_dot_product_attention`` per tree node (the reference; the CPU kernel)."""

    name = "sdpa_segments"

    def unavailable(self, device: torch.device) -> str | None:
        return None

    def plan(self, packed: PackedRows, device: torch.device) -> list:
        layout = gathered_keys(packed.segments)
        items, masks = [], {}
        for i in range(len(layout.cu_q) - 1):
            q0, q1 = int(layout.cu_q[i]), int(layout.cu_q[i + 1])
            keys_np = layout.key_index[layout.cu_k[i] : layout.cu_k[i + 1]]
            length, total = q1 - q0, len(keys_np)
            contiguous = bool(np.all(np.diff(keys_np) == 1))
            keys: slice | torch.Tensor = (
                slice(int(keys_np[0]), int(keys_np[-1]) + 1)
                if contiguous
                else torch.as_tensor(keys_np, dtype=torch.long, device=device)
            )
            mask = None  # a root node: plain causal
            if total > length:
                if (length, total) not in masks:  # bottom-right causal: query j sees keys [0, total - length + j]
                    masks[(length, total)] = torch.ones(length, total, dtype=torch.bool, device=device).tril(
                        total - length
                    )
                mask = masks[(length, total)]
            items.append((slice(q0, q1), keys, mask))
        return items

    def __call__(self, plan, query, key, value, scale):
        dtype = _compute_dtype(query)
        query, key, value = _cast(dtype, query, key, value)
        gqa = key.shape[1] != query.shape[1]
        outputs = []
        for queries, keys, mask in plan:
            k = key[:, :, keys] if isinstance(keys, slice) else key.index_select(2, keys)
            v = value[:, :, keys] if isinstance(keys, slice) else value.index_select(2, keys)
            outputs.append(
                F.scaled_dot_product_attention(
                    query[:, :, queries], k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
                )
            )
        return torch.cat(outputs, dim=2) if outputs else query.new_zeros(query.shape)


@dataclass(eq=False)
class _VarlenPlan:
    """The gathered-key layout on the device, and what the layers share: the compute dtype (read at the first layer,
    under the forward's autocast state)."""

    key_index: torch.Tensor  # (K,) long
    cu_q: torch.Tensor  # int32
    cu_k: torch.Tensor  # int32
    max_q: int
    max_k: int
    dtype: torch.dtype | None = None

    def cast(self, query, key, value):
        if self.dtype is None:
            self.dtype = _compute_dtype(query)
        dtype = self.dtype
        if query.dtype is dtype and key.dtype is dtype and value.dtype is dtype:
            return query, key, value
        return _cast(dtype, query, key, value)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``(K, H_kv, D)``: the key/value heads ``x`` (``(1, H_kv, N, D)``) at the gathered keys: one
        ``index_select`` over a view of ``x`` (whatever its memory layout: no copy first)."""
        return x[0].transpose(0, 1).index_select(0, self.key_index)


def _varlen_arrays(segments: list[Segment]) -> dict[str, np.ndarray]:
    layout = gathered_keys(segments)
    return {"key_index": layout.key_index, "cu": np.concatenate([layout.cu_q, layout.cu_k])}


def _varlen_plan(kernel: TreeKernel, packed: PackedRows, device: torch.device) -> _VarlenPlan:
    host, tensors = _plan_arrays(kernel, packed, device)
    cu = tensors["cu"].to(torch.int32)  # one cast for both offsets; views of it
    cu_q, cu_k = cu.split(cu.numel() // 2)
    half = len(host["cu"]) // 2
    return _VarlenPlan(
        key_index=tensors["key_index"],
        cu_q=cu_q,
        cu_k=cu_k,
        max_q=int(np.diff(host["cu"][:half]).max(initial=0)),
        max_k=int(np.diff(host["cu"][half:]).max(initial=0)),
    )


def _queries(plan: _VarlenPlan, query: torch.Tensor) -> torch.Tensor:
    """``(N, H, D)``: the packed row's queries as they are (a view where the projection left them token-major)."""
    return query[0].transpose(0, 1).contiguous()


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``(K, heads, D)`` from ``(K, H_kv, D)``: each key/value head repeated for its query heads (torch < 2.12's
    ``varlen_attn`` has no ``enable_gqa``): one copy."""
    k, kv, dim = x.shape
    return x[:, :, None].expand(k, kv, heads // kv, dim).reshape(k, heads, dim)


@cache
def _varlen_api() -> tuple[Any, dict[str, Any], bool] | None:
    """``(varlen_attn, causal keyword arguments, has enable_gqa)`` or ``None`` where torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}  # bottom-right causal; (-1, -1) would be full attention
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


class _GatheredKeysKernel(TreeKernel):
    """A CUDA kernel over the gathered keys with cumulative query/key offsets (`Varlen`, `FlashAttn`): the same plan,
    the same host arrays, the same layouts; each says what software it misses and how it attends."""

    dtypes = HALF
    array_names = ("key_index", "cu")
    #: the start of the reason given on a device without CUDA
    cuda_only: ClassVar[str]

    def missing_software(self) -> str | None:
        """Why the installed software cannot run the kernel (``None``: it can)."""
        raise NotImplementedError

    def unavailable(self, device: torch.device) -> str | None:
        missing = self.missing_software()
        if missing is not None:
            return missing
        if device.type != "cuda":
            return f"{self.cuda_only} (device {device.type})"
        return _capability_reason(self.name, device)

    def arrays(self, segments, num_tokens):
        return _varlen_arrays(segments)

    def plan(self, packed, device):
        return _varlen_plan(self, packed, device)

    def __call__(self, plan, query, key, value, scale):
        return self.attend(plan, query, key, value, scale).transpose(1, 2)


class Varlen(_GatheredKeysKernel):
    """``torch.nn.attention.varlen.varlen_attn`` over the gathered keys (torch >= 2.10, CUDA)."""

    name = "varlen"
    cuda_only = "varlen_attn has CUDA kernels only"

    def missing_software(self) -> str | None:
        if _varlen_api() is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (torch >= 2.10)"
        return None

    def attend(self, plan, query, key, value, scale):
        varlen_attn, causal, has_gqa = _varlen_api()
        query, key, value = plan.cast(query, key, value)
        q, k, v = _queries(plan, query), plan.gather(key), plan.gather(value)
        if k.shape[1] == q.shape[1]:
            extra = causal
        elif has_gqa:
            extra = {**causal, "enable_gqa": True}
        else:  # torch < 2.12: one key/value head per query head
            extra = causal
            k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
        out = varlen_attn(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale=scale, **extra)
        return out.unsqueeze(0)


@cache
def _flash_attn_varlen():
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:  # installed but built for another torch/CUDA
        return None
    return flash_attn_varlen_func


def _flash_attn_version() -> tuple[int, ...] | None:
    """The installed FlashAttention's ``(major, minor)`` (``None``: no version could be read)."""
    try:
        text = importlib.metadata.version("flash_attn")
    except importlib.metadata.PackageNotFoundError:
        text = getattr(importlib.import_module("flash_attn"), "__version__", None)
    try:
        return Version(text).release[:2] if text else None
    except InvalidVersion:
        return None


class FlashAttn(_GatheredKeysKernel):
    """FlashAttention 2's ``flash_attn_varlen_func`` over the gathered keys (CUDA, installed separately)."""

    name = "flash_attn"
    cuda_only = "FlashAttention runs on CUDA only"

    def missing_software(self) -> str | None:
        if _flash_attn_varlen() is None:
            return "the flash_attn package is not installed (pip install flash-attn)"
        version = _flash_attn_version()
        if version is None or version < FLASH_ATTN_MIN_VERSION:
            need = ".".join(map(str, FLASH_ATTN_MIN_VERSION))
            found = ".".join(map(str, version)) if version else "of unknown version"
            return (
                f"flash_attn {found} is installed; the tree needs its bottom-right causal mask, flash_attn >= {need} "
                "(pip install -U flash-attn)"
            )
        return None

    def attend(self, plan, query, key, value, scale):
        query, key, value = plan.cast(query, key, value)
        q, k, v = _queries(plan, query), plan.gather(key), plan.gather(value)
        out = _flash_attn_varlen()(
            q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, dropout_p=0.0, softmax_scale=scale, causal=True
        )
        return out.unsqueeze(0)


# ---------------------------------------------------------------------------- FlexAttention
def tree_mask_mod(subtree_end: torch.Tensor):
    """FlexAttention ``mask_mod`` of a packed row: key ``k`` is visible from query ``q`` iff
    ``k <= q < subtree_end[k]`` (``k`` in ``q``'s own node at or before it, or in an ancestor node)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])

    return mask_mod


def tree_block_mask(subtree_end: torch.Tensor, block: int = FLEX_BLOCK):
    """The tree's ``BlockMask`` built directly from ``subtree_end`` (length a multiple of ``block``) with a
    few tensor operations on its device: no ``create_block_mask`` (vmap over every block), no host sync.

    For query block ``Q`` and key block ``K``: the diagonal is partial; ``K`` after ``Q`` is empty; ``K``
    before ``Q`` is full if every key's subtree reaches past ``Q``'s end (``min subtree_end >= Q end``),
    empty if none reaches into ``Q`` (``max subtree_end <= Q start``), partial otherwise."""
    from torch.nn.attention.flex_attention import BlockMask

    n = subtree_end.numel()
    if n % block:
        raise ValueError(f"the packed row ({n} tokens) must be padded to a multiple of {block}")
    blocks = n // block
    device = subtree_end.device
    ends = subtree_end.view(blocks, block)
    start = torch.arange(blocks, device=device) * block
    q_start, q_end = start[:, None], start[:, None] + block
    before = torch.arange(blocks, device=device)[None, :] < torch.arange(blocks, device=device)[:, None]
    diagonal = torch.eye(blocks, dtype=torch.bool, device=device)
    reaches = ends.amax(1)[None, :] > q_start
    full = before & (ends.amin(1)[None, :] >= q_end)
    partial = (diagonal | (before & reaches)) & ~full

    def indices(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = chosen.sum(-1, dtype=torch.int32)
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return count[None, None], order[None, None]

    kv_num, kv_index = indices(partial)
    full_num, full_index = indices(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_index,
        full_num,
        full_index,
        BLOCK_SIZE=block,
        mask_mod=tree_mask_mod(subtree_end),
        seq_lengths=(n, n),
    )


@cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic shapes: one compilation serves every packed length (a multiple of the block size)
    return torch.compile(flex_attention, dynamic=True)


@dataclass
class _FlexPlan:
    block_mask: Any
    subtree_end: torch.Tensor


class Flex(TreeKernel):
    """FlexAttention with the tree BlockMask (CUDA; CPU FlexAttention has no backward)."""

    name = "flex"
    pad_multiple = FLEX_BLOCK
    # at least 2 blocks: torch.compile specialises sizes 0 and 1, so a 1-block row would compile a graph of its own
    min_tokens = 2 * FLEX_BLOCK
    array_names = ("subtree_end",)

    def unavailable(self, device: torch.device) -> str | None:
        if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
            return f"torch {torch.__version__} has no FlexAttention (torch >= 2.5)"
        if device.type != "cuda":
            return f"FlexAttention has no backward on {device.type} (CUDA only here)"
        return None

    def arrays(self, segments, num_tokens):
        ends = np.zeros(num_tokens, dtype=np.int64)
        for seg in segments:
            ends[seg.start : seg.end] = seg.subtree_end if seg.subtree_end >= 0 else seg.end
        return {"subtree_end": ends}

    def plan(self, packed, device):
        subtree_end = _plan_arrays(self, packed, device)[1]["subtree_end"].to(torch.int32)
        return _FlexPlan(tree_block_mask(subtree_end, FLEX_BLOCK), subtree_end)

    def __call__(self, plan, query, key, value, scale, compiled: bool = True):
        query, key, value = _cast(_compute_dtype(query), query, key, value)
        if compiled:
            flex = _compiled_flex()
        else:
            from torch.nn.attention.flex_attention import flex_attention as flex
        return flex(
            query, key, value, block_mask=plan.block_mask, scale=scale, enable_gqa=key.shape[1] != query.shape[1]
        )


KERNELS: dict[str, TreeKernel] = {k.name: k for k in (SdpaSegments(), Varlen(), FlashAttn(), Flex())}
