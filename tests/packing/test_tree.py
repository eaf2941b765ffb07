"""The prefix tree and its packed layout (`trinity_trl/packing/tree.py`)."""

from __future__ import annotations

import pytest
import torch
from packing_helpers import dense_tree_mask_from_rows, grouped_rows, padded_batch

from trinity_trl.packing import NotPackable, pack_rows


def segments_mask(packed) -> torch.Tensor:
    """The ``(N, N)`` mask the segments describe (ancestors, then causal within the node)."""
    n = packed.num_tokens
    mask = torch.zeros(n, n, dtype=torch.bool)
    for seg in packed.segments:
        for s, e in seg.ancestors:
            mask[seg.start : seg.end, s:e] = True
        length = seg.end - seg.start
        mask[seg.start : seg.end, seg.start : seg.end] = torch.ones(length, length, dtype=torch.bool).tril()
    return mask


def test_prefix_tree_forwards_each_distinct_token_once():
    rows = grouped_rows(torch.Generator().manual_seed(0))
    ids, mask, keep = padded_batch(rows)
    (packed,) = pack_rows(ids, mask, keep)
    distinct = {tuple(p + c[:i]) for p, c in rows for i in range(len(c) + 1)} | {
        tuple(p[:i]) for p, _ in rows for i in range(1, len(p) + 1)
    }
    assert packed.num_tokens == len(distinct)  # every distinct (prefix, token) once: shared system prompt too
    assert packed.segments[0].ancestors == () and packed.segments[0].end - packed.segments[0].start == 5
    # each row reads its tokens back at the positions of its unpadded sequence
    for r, (p, c) in enumerate(rows):
        chosen = packed.scored_rows == r
        assert packed.scored_labels[chosen].tolist() == c
        assert packed.scored_cols[chosen].tolist() == list(range(len(c)))
        predictors = packed.scored_index[chosen]
        assert (packed.position_ids[predictors] == torch.arange(len(p) - 1, len(p) + len(c) - 1)).all()
        seq = p + c
        assert packed.input_ids[predictors].tolist() == seq[len(p) - 1 : len(seq) - 1]
    # token budget: rows are packed in order, a new packed row starts when the next would exceed it
    chunks = pack_rows(ids, mask, keep, max_tokens=20)
    assert [r for c in chunks for r in c.rows] == list(range(len(rows)))
    assert all(c.num_tokens <= 20 or len(c.rows) == 1 for c in chunks) and len(chunks) > 1


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_segments_and_subtree_ends_describe_the_rows_tree(groups):
    """K groups in one packed row: the segments' mask and ``k <= q < subtree_end[k]`` (the flex kernel's rule) both
    equal the mask built from the rows themselves."""
    rows = grouped_rows(torch.Generator().manual_seed(groups), groups=groups)
    ids, mask, keep = padded_batch(rows)
    (packed,) = pack_rows(ids, mask, keep)
    truth = dense_tree_mask_from_rows(packed, rows)
    assert torch.equal(segments_mask(packed), truth)
    ends = torch.as_tensor(packed.subtree_ends())
    q, k = torch.arange(packed.num_tokens)[:, None], torch.arange(packed.num_tokens)[None, :]
    assert torch.equal((k <= q) & (q < ends[k]), truth)


def test_padding_to_a_block_multiple_adds_a_root_segment_never_scored():
    rows = grouped_rows(torch.Generator().manual_seed(3))
    ids, mask, keep = padded_batch(rows)
    (plain,) = pack_rows(ids, mask, keep)
    (padded,) = pack_rows(ids, mask, keep, pad_multiple=16)
    assert padded.num_tokens % 16 == 0 and padded.padding == padded.num_tokens - plain.num_tokens > 0
    assert torch.equal(padded.input_ids[: plain.num_tokens], plain.input_ids)
    assert torch.equal(padded.scored_index, plain.scored_index)  # no scored token reads a padding position
    last = padded.segments[-1]
    assert (last.start, last.end, last.ancestors) == (plain.num_tokens, padded.num_tokens, ())
    assert torch.equal(segments_mask(padded), dense_tree_mask_from_rows(padded, rows))
    (long,) = pack_rows(ids, mask, keep, pad_multiple=16, min_tokens=96)
    assert long.num_tokens == 96 and long.segments[-1].start == plain.num_tokens


def test_rows_that_the_padded_forward_reads_differently_are_not_packed():
    ids, mask, keep = padded_batch([([5, 6, 7], [8, 9]), ([5, 6], [8, 9, 10])])
    holed = mask.clone()
    holed[0, 1] = 0  # a hole inside the row
    with pytest.raises(NotPackable, match="row 0"):
        pack_rows(ids, holed, keep)
    no_prompt = mask.clone()
    no_prompt[1, :3] = 0  # row 1 has no token before its first completion token
    with pytest.raises(NotPackable, match="row 1"):
        pack_rows(ids, no_prompt, keep)
