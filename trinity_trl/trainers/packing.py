"""Prefix-shared, padding-free forward passes: each distinct token of a batch is encoded once.

TRL's ``GRPOTrainer`` forwards a batch as ``B`` rows of left-padded prompt + right-padded completion,
so the ``G`` completions of a prompt encode that prompt ``G`` times, and every row is padded to the
widest of the batch. Here the rows are folded into a **prefix tree** over their token ids (a radix
tree: a node is a run of tokens that the same set of rows shares) and the tree is laid out depth
first as ONE packed row of ``N`` distinct tokens:

* a group's prompt (and, in a multi-turn run, its earlier turns; across groups, a common system
  prompt) is a node that every row below it shares, forwarded once;
* each token keeps the position it has in its own unpadded sequence (``position_ids`` = depth);
* each token attends to its ancestors' tokens and causally to the earlier tokens of its own node:
  exactly the tokens its row had before it at sampling time. No padding token is forwarded.

The attention pattern travels as a :class:`TreeAttentionMask`, a ``torch.Tensor`` subclass passed
where a model takes a prepared 4D mask (transformers returns such a mask as-is). Like torch's own
``CausalBias``, it intercepts ``scaled_dot_product_attention``: the model's ``sdpa`` attention runs
unchanged up to the kernel call, which then runs segment by segment (:func:`tree_attention`):

* ``flash_attn_varlen`` (CUDA, fp16/bf16, FlashAttention installed): one varlen call per layer; each
  node's queries attend to the gathered keys of its root-to-node path (causal, bottom-right aligned);
* ``sdpa_segments`` (everywhere else, CPU included): one ``scaled_dot_product_attention`` per node,
  the node's queries against the gathered keys of its path, with a bottom-right causal mask of
  ``node length x path length`` (a root node uses ``is_causal`` and no mask at all).

Neither materialises an ``N x N`` mask or score matrix: memory grows with the sum over nodes of
``node length x path length``, plus one copy of each node's ancestor keys/values per node.

Log-probs keep TRL's fused LM head (``add_fused_lm_head``): the model is called with
``fused_lm_head=True`` and pre-shifted labels, and while it runs a forward hook on the backbone keeps
only the hidden states of the tokens that predict a completion token (a shared prompt's last token
once per row below it), so the chunked head scores only those and full-vocabulary logits are never
materialised. The critic (PPO) is called on the same packed row and read at the same positions.

Only verified causal decoders are packed (:data:`VERIFIED_MODEL_TYPES`, full attention, SDPA);
anything else (other architectures, sliding-window layers, eager or flash-loaded attention,
multimodal inputs, MoE auxiliary losses, masks that are not one contiguous run per row) falls back to
TRL's padded forward with one log line naming the reason (:class:`PrefixPacking`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

logger = logging.getLogger("trinity_trl")

#: ``config.model_type`` of the causal decoders whose packed forward is tested equal to the padded one
VERIFIED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")


class NotPackable(ValueError):
    """The rows cannot be laid out as a prefix tree that reproduces the padded forward exactly."""


# ============================================================================ the prefix tree
class _Node:
    """A run of tokens shared by every row whose path passes through it."""

    __slots__ = ("tokens", "children", "parent", "start", "depth")

    def __init__(self, tokens: np.ndarray, parent: _Node | None):
        self.tokens = tokens
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.start = 0  # first packed index (set by the layout)
        self.depth = 0  # position of the first token in its sequence (set by the layout)


class _PrefixTree:
    """A radix tree over token sequences; ``size`` is its number of distinct (token, position) pairs."""

    def __init__(self):
        self.root = _Node(np.zeros(0, dtype=np.int64), None)
        self.size = 0

    def matched(self, row: np.ndarray) -> int:
        """How many leading tokens of ``row`` the tree already holds."""
        node, i = self.root, 0
        while i < len(row):
            child = node.children.get(int(row[i]))
            if child is None:
                return i
            m = _common_prefix(child.tokens, row[i:])
            i += m
            if m < len(child.tokens):
                return i
            node = child
        return i

    def insert(self, row: np.ndarray) -> _Node:
        """Add ``row``; return the node its last token ends (the root for an empty row)."""
        node, i = self.root, 0
        while i < len(row):
            child = node.children.get(int(row[i]))
            if child is None:
                leaf = _Node(row[i:], node)
                node.children[int(row[i])] = leaf
                self.size += len(leaf.tokens)
                return leaf
            m = _common_prefix(child.tokens, row[i:])
            if m < len(child.tokens):
                child = self._split(child, m)
            node, i = child, i + m
        return node

    @staticmethod
    def _split(node: _Node, m: int) -> _Node:
        """Cut ``node`` after ``m`` tokens; the new upper part is returned and ``node`` keeps the tail
        (so rows that already end at ``node`` still do)."""
        upper = _Node(node.tokens[:m], node.parent)
        node.parent.children[int(node.tokens[0])] = upper
        node.tokens = node.tokens[m:]
        node.parent = upper
        upper.children[int(node.tokens[0])] = node
        return upper

    def nodes(self) -> list[_Node]:
        """Every node but the root, depth first (children in insertion order), with ``start`` and
        ``depth`` assigned: the packed layout."""
        order, stack, offset = [], list(reversed(self.root.children.values())), 0
        while stack:
            node = stack.pop()
            node.start = offset
            node.depth = 0 if node.parent is self.root else node.parent.depth + len(node.parent.tokens)
            offset += len(node.tokens)
            order.append(node)
            stack.extend(reversed(node.children.values()))
        return order


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


# ============================================================================ the packed layout
@dataclass
class Segment:
    """One tree node in the packed row: tokens ``[start, end)``, which attend to the tokens of
    ``ancestors`` (packed ``(start, end)`` ranges, root first) and causally to their own."""

    start: int
    end: int
    ancestors: tuple[tuple[int, int], ...]

    @property
    def context(self) -> int:
        """Tokens of the ancestors."""
        return sum(e - s for s, e in self.ancestors)


@dataclass
class PackedRows:
    """Rows of a batch folded into one packed row (see the module docs).

    ``scored_*`` (``(K,)`` each) say, for every completion token the padded forward scores, which
    packed token's hidden state predicts it (``scored_index``), the token itself (``scored_labels``)
    and where its result goes in the ``(B, logits_to_keep)`` output (``scored_rows``, ``scored_cols``).
    """

    input_ids: torch.Tensor  # (N,)
    position_ids: torch.Tensor  # (N,)
    segments: list[Segment]
    scored_index: torch.Tensor
    scored_labels: torch.Tensor
    scored_rows: torch.Tensor
    scored_cols: torch.Tensor
    rows: list[int] = field(default_factory=list)  # the batch rows packed here

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def attention_mask(self) -> TreeAttentionMask:
        return TreeAttentionMask(self.segments, self.input_ids.device)


def row_spans(attention_mask: torch.Tensor, logits_to_keep: int) -> tuple[np.ndarray, np.ndarray]:
    """``(first, count)`` of each row's attended columns; raises :class:`NotPackable` unless each row
    is one contiguous run (left padding, tokens, right padding) whose scored columns all follow a
    token of the same row (TRL's padded forward predicts a column from the column before it)."""
    mask = attention_mask.detach().to("cpu", torch.bool).numpy()
    width = mask.shape[1]
    count = mask.sum(1)
    first = mask.argmax(1)
    last = width - 1 - mask[:, ::-1].argmax(1)
    holes = (count > 0) & (last - first + 1 != count)
    if holes.any():
        raise NotPackable(f"row {int(np.flatnonzero(holes)[0])}'s attention mask is not one contiguous run")
    scored = (count > 0) & (last >= width - logits_to_keep)
    unpredicted = scored & (first >= width - logits_to_keep)
    if unpredicted.any():
        raise NotPackable(f"row {int(np.flatnonzero(unpredicted)[0])} has no prompt token before its completion")
    return first, count


def pack_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, max_tokens: int | None = None
) -> list[PackedRows]:
    """Fold the rows of ``input_ids`` (``(B, L)``, attended where ``attention_mask`` is 1; the last
    ``logits_to_keep`` columns are scored) into packed rows of at most ``max_tokens`` distinct tokens
    each (``None``: one packed row). Rows are taken in order, so a group's consecutive rows share a
    packed row; a row longer than ``max_tokens`` gets a packed row of its own."""
    first, count = row_spans(attention_mask, logits_to_keep)
    ids = input_ids.detach().cpu().numpy()
    rows = [ids[r, first[r] : first[r] + count[r]] for r in range(ids.shape[0])]
    chunks, current, tree = [], [], _PrefixTree()
    for r, row in enumerate(rows):
        if current and max_tokens is not None and tree.size + len(row) - tree.matched(row) > max_tokens:
            chunks.append((tree, current))
            current, tree = [], _PrefixTree()
        current.append((r, tree.insert(row)))
    if current:
        chunks.append((tree, current))
    offset = ids.shape[1] - logits_to_keep  # first scored column
    return [_layout(tree, ends, rows, first, offset, input_ids.device) for tree, ends in chunks]


def _layout(
    tree: _PrefixTree,
    ends: list[tuple[int, _Node]],
    rows: list[np.ndarray],
    first: np.ndarray,
    offset: int,
    device: torch.device,
) -> PackedRows:
    nodes = tree.nodes()
    tokens = np.concatenate([n.tokens for n in nodes]) if nodes else np.zeros(0, dtype=np.int64)
    positions = np.concatenate([np.arange(n.depth, n.depth + len(n.tokens)) for n in nodes]) if nodes else tokens
    segments = []
    for n in nodes:
        path, up = [], n.parent
        while up is not tree.root:
            path.append((up.start, up.start + len(up.tokens)))
            up = up.parent
        segments.append(Segment(n.start, n.start + len(n.tokens), tuple(reversed(path))))
    index, labels, out_rows, out_cols = [], [], [], []
    for r, end in ends:
        path, node = [], end
        while node is not tree.root:
            path.append(np.arange(node.start, node.start + len(node.tokens)))
            node = node.parent
        packed = np.concatenate(path[::-1]) if path else np.zeros(0, dtype=np.int64)  # row position -> packed index
        columns = first[r] + np.arange(len(packed))
        scored = np.flatnonzero(columns >= offset)  # row positions of scored tokens (never 0: see row_spans)
        index.append(packed[scored - 1])
        labels.append(rows[r][scored])
        out_rows.append(np.full(len(scored), r))
        out_cols.append(columns[scored] - offset)

    def tensor(parts):
        return torch.as_tensor(np.concatenate(parts) if parts else np.zeros(0), dtype=torch.long, device=device)

    return PackedRows(
        input_ids=torch.as_tensor(tokens, dtype=torch.long, device=device),
        position_ids=torch.as_tensor(positions, dtype=torch.long, device=device),
        segments=segments,
        scored_index=tensor(index),
        scored_labels=tensor(labels),
        scored_rows=tensor(out_rows),
        scored_cols=tensor(out_cols),
        rows=[r for r, _ in ends],
    )


# ============================================================================ attention
class TreeAttentionMask(torch.Tensor):
    """The attention pattern of a packed row, where a model takes a prepared 4D mask.

    An empty ``(1, 1, 0, 0)`` tensor on the packed row's device (so transformers' mask preparation
    returns it unchanged and DDP's input placement leaves it alone) that carries the segments.
    ``scaled_dot_product_attention`` called with it as ``attn_mask`` runs :func:`tree_attention`;
    any other use of it as a tensor is an error (it holds no mask values).
    """

    segments: list[Segment]

    @staticmethod
    def __new__(cls, segments: list[Segment], device: torch.device | str):
        mask = torch.Tensor._make_subclass(cls, torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device))
        mask.segments = segments
        mask._plans = {}
        return mask

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return tree_attention(*args, **kwargs)
        if func is torch.Tensor.to:  # device placement of inputs (DDP, accelerate): already where it belongs
            return args[0]
        name = getattr(func, "__name__", "")
        if name in _METADATA:  # shape, device, dtype, ndim (property getters), repr: those of the empty tensor
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise TypeError(
            f"a packed prefix-tree attention mask only supports scaled_dot_product_attention, not {name or func}; "
            "the model's attention must be 'sdpa' (set prefix_packing=False to forward padded rows)"
        )

    def _plan(self, device: torch.device) -> _SegmentPlan:
        if device not in self._plans:
            self._plans[device] = _SegmentPlan(self.segments, device)
        return self._plans[device]


_METADATA = ("__get__", "__repr__", "dim", "size", "__len__")


class _SegmentPlan:
    """Per segment, the key positions (a slice when the path is contiguous, else an index) and the
    bottom-right causal mask; built once per packed forward and reused by every layer."""

    def __init__(self, segments: list[Segment], device: torch.device):
        self.items = []
        masks: dict[tuple[int, int], torch.Tensor] = {}
        gather = []
        for seg in segments:
            length, context = seg.end - seg.start, seg.context
            ranges = [*seg.ancestors, (seg.start, seg.end)]
            contiguous = all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            keys: slice | torch.Tensor = (
                slice(ranges[0][0], seg.end)
                if contiguous
                else torch.cat([torch.arange(s, e) for s, e in ranges]).to(device)
            )
            mask = None
            if context:
                if (length, context) not in masks:
                    masks[(length, context)] = torch.ones(
                        length, context + length, dtype=torch.bool, device=device
                    ).tril(context)
                mask = masks[(length, context)]
            self.items.append((slice(seg.start, seg.end), keys, mask))
            gather.append(torch.cat([torch.arange(s, e) for s, e in ranges]))
        # FlashAttention varlen: queries are the packed row as is, keys each segment's gathered path
        self.flash_keys = torch.cat(gather).to(device) if gather else torch.zeros(0, dtype=torch.long, device=device)
        q_lens = [s.end - s.start for s in segments]
        k_lens = [s.end - s.start + s.context for s in segments]
        self.cu_q = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device=device)
        self.cu_k = torch.tensor([0, *np.cumsum(k_lens)], dtype=torch.int32, device=device)
        self.max_q, self.max_k = max(q_lens, default=0), max(k_lens, default=0)


def _flash_varlen() -> Callable | None:
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        return None
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def attention_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel :func:`tree_attention` uses for queries on ``device`` in ``dtype``."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _flash_varlen() is not None:
        return "flash_attn_varlen"
    return "sdpa_segments"


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: TreeAttentionMask,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` over a packed row: ``query`` ``(1, H, N, D)``, ``key``/``value``
    ``(1, H_kv, N, D)``; each segment attends to its ancestors and causally to itself. Returns
    ``(1, H, N, D)``."""
    if query.shape[0] != 1:
        raise ValueError(f"a packed row has batch size 1, got query of shape {tuple(query.shape)}")
    plan = attn_mask._plan(query.device)
    if attention_backend(query.device, query.dtype) == "flash_attn_varlen" and query.shape[-1] <= 256:
        flash = _flash_varlen()
        q = query[0].transpose(0, 1)
        k = key[0].transpose(0, 1).index_select(0, plan.flash_keys)
        v = value[0].transpose(0, 1).index_select(0, plan.flash_keys)
        out = flash(
            q.contiguous(),
            k,
            v,
            plan.cu_q,
            plan.cu_k,
            plan.max_q,
            plan.max_k,
            dropout_p=dropout_p,
            softmax_scale=scale,
            causal=True,
        )
        return out.transpose(0, 1).unsqueeze(0)
    outputs = []
    for queries, keys, mask in plan.items:
        k = key[:, :, keys] if isinstance(keys, slice) else key.index_select(2, keys)
        v = value[:, :, keys] if isinstance(keys, slice) else value.index_select(2, keys)
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, :, queries],
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        )
    return torch.cat(outputs, dim=2)


# ============================================================================ forwards
def causal_lm(model: torch.nn.Module, unwrap: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.nn.Module:
    """The transformers model inside ``model`` (DDP, PEFT), the one TRL patched with its fused head."""
    inner = unwrap(model)
    get_base = getattr(inner, "get_base_model", None)  # PEFT
    return get_base() if callable(get_base) else inner


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` (a transformers model, unwrapped) cannot run the packed forward, or ``None``."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in VERIFIED_MODEL_TYPES:
        return (
            f"model type {model_type!r} is not verified for prefix packing (verified: "
            f"{', '.join(VERIFIED_MODEL_TYPES)})"
        )
    implementation = config._attn_implementation
    if implementation != "sdpa":
        return (
            f"the model's attention is {implementation!r}; the packed forward runs through 'sdpa' (load the model "
            "with attn_implementation='sdpa')"
        )
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or getattr(config, "sliding_window", None) is not None:
        return "the model has sliding-window attention layers"
    if getattr(config, "output_router_logits", False):
        return "the model returns router logits (MoE auxiliary loss)"
    return None


def packed_logps(
    model: torch.nn.Module,
    backbone: torch.nn.Module,
    packed: PackedRows,
    compute_entropy: bool,
    autocast: Callable[[], Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(K,)`` log-probs (and entropies) of ``packed``'s scored tokens through TRL's fused LM head.

    ``model`` is called as TRL's helper calls it (``fused_lm_head=True``), with the packed row, its
    positions and its :class:`TreeAttentionMask`; the hook on ``backbone`` (the module whose
    ``last_hidden_state`` the fused head reads) keeps the hidden states at ``scored_index`` only, and
    the pre-shifted ``shift_labels`` name each one's next token.
    """
    index, labels = packed.scored_index, packed.scored_labels
    if index.numel() == 0:  # nothing scored: one ignored position keeps the output connected to the graph
        index, labels = index.new_zeros(1), labels.new_full((1,), -100)

    def keep_scored(module, args, output):
        output["last_hidden_state"] = output["last_hidden_state"][:, index]
        return output

    handle = backbone.register_forward_hook(keep_scored)
    try:
        with autocast():
            out = model(
                input_ids=packed.input_ids[None],
                position_ids=packed.position_ids[None],
                attention_mask=packed.attention_mask(),
                shift_labels=labels[None],
                fused_lm_head=True,
            )
    finally:
        handle.remove()
    count = packed.scored_index.numel()
    entropy = out.entropy[0, :count] if compute_entropy else None
    return out.log_probs[0, :count], entropy


def packed_critic_values(critic: torch.nn.Module, packed: PackedRows, autocast: Callable[[], Any]) -> torch.Tensor:
    """``(K,)`` values of a token-classification critic at ``packed``'s scored positions (the state
    each completion token was chosen in)."""
    with autocast():
        logits = critic(
            input_ids=packed.input_ids[None],
            position_ids=packed.position_ids[None],
            attention_mask=packed.attention_mask(),
        ).logits
    if logits.dim() != 3 or logits.shape[-1] != 1:
        raise ValueError(f"the critic must return logits of shape (B, L, 1), got {tuple(logits.shape)}")
    return logits[0, packed.scored_index, 0]


@dataclass
class PackedOutput:
    """``(B, logits_to_keep)`` results of a packed forward (0 where not scored, as TRL's helper) and
    its token counts: ``forwarded`` distinct tokens against the padded layout's ``padded``."""

    logps: torch.Tensor
    entropies: torch.Tensor | None
    forwarded: int
    padded: int


class PrefixPacking:
    """Decides, per forward, between the packed layout and TRL's padded one, and runs the packed one.

    Args:
        enabled: ``prefix_packing`` of the config.
        max_token_ratio: pack only when the packed rows hold at most this fraction of the padded
            layout's tokens (``prefix_packing_max_token_ratio``).
        unwrap: the accelerator's ``unwrap_model``.
        autocast: the accelerator's ``autocast`` (what TRL's helper runs the model under).
    """

    def __init__(self, enabled: bool, max_token_ratio: float, unwrap: Callable, autocast: Callable):
        self.enabled = enabled
        self.max_token_ratio = max_token_ratio
        self._unwrap = unwrap
        self._autocast = autocast
        # per model as passed (DDP / PEFT wrapper): (the transformers model inside, why it runs padded);
        # unwrapping costs milliseconds per call in accelerate
        self._models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._logged: set[str] = set()

    def _inspect(self, model: torch.nn.Module) -> tuple[torch.nn.Module, str | None]:
        if model not in self._models:
            inner = causal_lm(model, self._unwrap)
            self._models[model] = (inner, unsupported_reason(inner))
        return self._models[model]

    def model_reason(self, model: torch.nn.Module) -> str | None:
        """Why ``model`` runs padded (``None``: it can be packed); checked once per model."""
        return self._inspect(model)[1]

    def _fall_back(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning("prefix packing off for this forward, padded rows instead: %s", reason)

    def _pack(self, model, input_ids, attention_mask, logits_to_keep, batch_size, extra_reason=None):
        if not self.enabled:
            return None
        reason = extra_reason or self.model_reason(model)
        if reason is None:
            try:
                width = input_ids.shape[1]
                budget = None if batch_size is None or batch_size >= input_ids.shape[0] else batch_size * width
                chunks = pack_rows(input_ids, attention_mask, logits_to_keep, budget)
            except NotPackable as err:
                reason = str(err)
        if reason is not None:
            self._fall_back(reason)
            return None
        chunks = [c for c in chunks if c.num_tokens]  # rows without any token have nothing to score
        forwarded = sum(c.num_tokens for c in chunks)
        if not chunks or forwarded > self.max_token_ratio * input_ids.numel():
            return None  # too little shared or padded to be worth it: the padded forward is as fast
        return chunks

    def logps_and_entropies(
        self,
        model,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None,
        compute_entropy: bool,
        compute_aux_loss: bool,
        multimodal: dict[str, Any],
    ) -> PackedOutput | None:
        """The arguments of TRL's ``_get_per_token_logps_and_entropies``; ``None`` where the padded
        forward must run instead (the reason logged once)."""
        extra = None
        present = sorted(k for k, v in multimodal.items() if v is not None)
        if present:
            extra = f"multimodal inputs ({', '.join(present)})"
        elif compute_aux_loss:
            extra = "the MoE auxiliary loss counts every padded row's tokens"
        chunks = self._pack(model, input_ids, attention_mask, logits_to_keep, batch_size, extra)
        if chunks is None:
            return None
        backbone = self._inspect(model)[0].base_model
        shape = (input_ids.shape[0], logits_to_keep)
        index, logps, entropies = [], [], []
        for packed in chunks:
            lp, ent = packed_logps(model, backbone, packed, compute_entropy, self._autocast)
            index.append((packed.scored_rows, packed.scored_cols))
            logps.append(lp)
            entropies.append(ent)
        rows, cols = torch.cat([r for r, _ in index]), torch.cat([c for _, c in index])

        def scatter(values):
            values = torch.cat(values)
            return values.new_zeros(shape).index_put((rows, cols), values)

        return PackedOutput(
            scatter(logps),
            scatter(entropies) if compute_entropy else None,
            sum(c.num_tokens for c in chunks),
            input_ids.numel(),
        )

    def critic_values(
        self, critic, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, batch_size: int | None
    ) -> torch.Tensor | None:
        """``(B, logits_to_keep)`` critic values of the completion tokens (0 elsewhere), or ``None``
        where the padded forward must run instead."""
        chunks = self._pack(critic, input_ids, attention_mask, logits_to_keep, batch_size)
        if chunks is None:
            return None
        values = torch.cat([packed_critic_values(critic, packed, self._autocast) for packed in chunks])
        rows = torch.cat([c.scored_rows for c in chunks])
        cols = torch.cat([c.scored_cols for c in chunks])
        return values.new_zeros((input_ids.shape[0], logits_to_keep)).index_put((rows, cols), values)
