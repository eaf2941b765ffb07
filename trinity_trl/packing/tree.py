"""The prefix tree of a micro-batch and its packed layout (one row of distinct tokens).

The rows of a batch (left-padded prompt + right-padded completion, TRL's layout) are folded into a
radix tree over their token ids: a node is a run of tokens that the same set of rows shares. The
tree is laid out depth first as ONE packed row: each node's tokens are contiguous, a node's whole
subtree follows it, and each token keeps the position it has in its own unpadded sequence. A token
attends to every token of its ancestor nodes and causally to the earlier tokens of its own node.

Because the layout is depth first, "key ``k`` is visible from query ``q``" is simply
``k <= q < subtree_end[k]``, where ``subtree_end[k]`` is the packed index just past the subtree of
``k``'s node: the one integer per token the FlexAttention kernel needs (`kernels`).

Host work per packed row: ONE device-to-host read (the token ids, with -1 where the mask is 0) and ONE
host-to-device copy (`upload`: every integer array of the packed row and of the kernel's plan in one
buffer, pinned on CUDA, the tensors views of it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

#: ``arrays(segments, num_tokens)``: a kernel's plan arrays (int64, built on the host), uploaded with the packed row
HostArrays = Callable[[list["Segment"], int], dict[str, np.ndarray]]


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
    subtree_end: int = -1  # packed index just past this node's subtree (-1: ``end``, a leaf)

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
    padding: int = 0  # trailing padding tokens (a root segment of their own; see ``pack_rows``)
    #: ``scored_rows * logits_to_keep + scored_cols``: where each result goes in the flattened output
    scored_flat: torch.Tensor | None = None
    #: a kernel's plan arrays (``pack_rows``'s ``arrays``): on the host, and on the device (uploaded with the rest)
    kernel_arrays: dict[str, np.ndarray] = field(default_factory=dict)
    kernel_tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Tokens of the packed row, padding included."""
        return int(self.input_ids.numel())

    def subtree_ends(self) -> np.ndarray:
        """``(N,)``: for each packed token, the packed index just past its node's subtree."""
        ends = np.zeros(self.num_tokens, dtype=np.int64)
        for seg in self.segments:
            ends[seg.start : seg.end] = seg.subtree_end if seg.subtree_end >= 0 else seg.end
        return ends


def row_spans(attention_mask: torch.Tensor, logits_to_keep: int) -> tuple[np.ndarray, np.ndarray]:
    """``(first, count)`` of each row's attended columns; raises `NotPackable` unless each row
    is one contiguous run (left padding, tokens, right padding) whose scored columns all follow a
    token of the same row (TRL's padded forward predicts a column from the column before it)."""
    return _spans(attention_mask.detach().to("cpu", torch.bool).numpy(), logits_to_keep)


def _spans(mask: np.ndarray, logits_to_keep: int) -> tuple[np.ndarray, np.ndarray]:
    """`row_spans` of a boolean mask on the host."""
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


def host_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> np.ndarray:
    """The batch's token ids on the host, -1 where the mask is 0: ONE device-to-host read (a host synchronisation on
    a GPU) for both."""
    marked = torch.where(attention_mask.detach() != 0, input_ids.detach(), -1)
    return marked.cpu().numpy()


def upload(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """``arrays`` (integers) as int64 tensors on ``device`` in ONE host-to-device copy: concatenated into one host
    buffer (pinned on CUDA, so the copy is asynchronous and the host does not wait for the GPU), copied, and split
    into views of their shapes. On CPU the tensors share the arrays' buffer (no copy)."""
    flat = [np.ascontiguousarray(a, dtype=np.int64).reshape(-1) for a in arrays.values()]
    host = torch.from_numpy(np.concatenate(flat) if flat else np.zeros(0, dtype=np.int64))
    device = torch.device(device)
    if device.type == "cpu":
        buffer = host
    else:
        buffer = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
    parts = buffer.split([a.size for a in flat]) if flat else ()
    return {name: part.view(np.shape(a)) for (name, a), part in zip(arrays.items(), parts)}


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    max_tokens: int | None = None,
    pad_multiple: int = 1,
    min_tokens: int = 0,
    arrays: HostArrays | None = None,
) -> list[PackedRows]:
    """Fold the rows of ``input_ids`` (``(B, L)``, attended where ``attention_mask`` is 1; the last
    ``logits_to_keep`` columns are scored) into packed rows of at most ``max_tokens`` distinct tokens
    each (``None``: one packed row). Rows are taken in order, so a group's consecutive rows (and the
    next groups of the micro-batch) share a packed row; a row longer than ``max_tokens`` gets a packed
    row of its own. ``pad_multiple``: the packed row is padded up to a multiple of it (FlexAttention's
    block size, so that its kernels see few distinct lengths) with tokens that form a root segment of
    their own, attend only among themselves and are never scored; and to at least ``min_tokens``.
    ``arrays``: a kernel's plan arrays (`HostArrays`), uploaded in the same copy as the packed row's
    (``kernel_arrays`` on the host, ``kernel_tensors`` on the device).

    Host work: one read of the rows (`host_rows`) and one copy per packed row (`upload`)."""
    ids = host_rows(input_ids, attention_mask)
    first, count = _spans(ids >= 0, logits_to_keep)
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
    return [
        _layout(tree, ends, rows, first, offset, logits_to_keep, input_ids.device, pad_multiple, min_tokens, arrays)
        for tree, ends in chunks
    ]


def _layout(
    tree: _PrefixTree,
    ends: list[tuple[int, _Node]],
    rows: list[np.ndarray],
    first: np.ndarray,
    offset: int,
    logits_to_keep: int,
    device: torch.device,
    pad_multiple: int = 1,
    min_tokens: int = 0,
    arrays: HostArrays | None = None,
) -> PackedRows:
    nodes = tree.nodes()
    tokens = np.concatenate([n.tokens for n in nodes]) if nodes else np.zeros(0, dtype=np.int64)
    positions = np.concatenate([np.arange(n.depth, n.depth + len(n.tokens)) for n in nodes]) if nodes else tokens
    subtree_end = {id(n): n.start + len(n.tokens) for n in nodes}
    for n in reversed(nodes):  # children come after their parent in depth-first order
        if n.parent is not tree.root:
            subtree_end[id(n.parent)] = max(subtree_end[id(n.parent)], subtree_end[id(n)])
    segments = []
    for n in nodes:
        path, up = [], n.parent
        while up is not tree.root:
            path.append((up.start, up.start + len(up.tokens)))
            up = up.parent
        segments.append(Segment(n.start, n.start + len(n.tokens), tuple(reversed(path)), subtree_end[id(n)]))
    padding = -len(tokens) % pad_multiple if len(tokens) else 0
    if len(tokens) and len(tokens) + padding < min_tokens:
        padding = min_tokens - len(tokens)
    if padding:
        n = len(tokens)
        segments.append(Segment(n, n + padding, (), n + padding))
        tokens = np.concatenate([tokens, np.zeros(padding, dtype=tokens.dtype)])
        positions = np.concatenate([positions, np.zeros(padding, dtype=positions.dtype)])
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

    def joined(parts):
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    out_rows, out_cols = joined(out_rows), joined(out_cols)
    host = {
        "input_ids": tokens,
        "position_ids": positions,
        "scored_index": joined(index),
        "scored_labels": joined(labels),
        "scored_rows": out_rows,
        "scored_cols": out_cols,
        "scored_flat": out_rows * logits_to_keep + out_cols,
    }
    kernel_arrays = arrays(segments, len(tokens)) if arrays is not None else {}
    tensors = upload({**host, **{f"kernel/{k}": v for k, v in kernel_arrays.items()}}, device)
    return PackedRows(
        **{name: tensors[name] for name in host},
        segments=segments,
        rows=[r for r, _ in ends],
        padding=padding,
        kernel_arrays=kernel_arrays,
        kernel_tensors={k: tensors[f"kernel/{k}"] for k in kernel_arrays},
    )
