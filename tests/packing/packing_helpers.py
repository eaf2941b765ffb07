"""Shared by the tests of `trinity_trl/packing/`: TRL-style padded batches, grouped rows, and the dense tree mask
built from the rows alone (the ground truth every kernel's layout is checked against)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Tolerances (tests/tolerance.py), derived for the tiny models of tests/helpers.py (2 layers, hidden 64,
# intermediate 128, head dim 16, vocabulary 512) on rows of at most 128 tokens: a log-prob, entropy or critic value
# chains, per layer, the MLP's and projection's sums and an attention row (keys x head dim), then the vocabulary's
# logsumexp; a gradient, loss or trained weight also sums over the tokens of the micro-batch (at most 16 x 128).
LOGP_TERMS = 2 * (128 + 64 + 128 * 16) + 512
GRAD_TERMS = LOGP_TERMS * 16 * 128


def padded_batch(rows: list[tuple[list[int], list[int]]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(input_ids, attention_mask, logits_to_keep)`` as TRL builds them: left-padded prompts, right-padded
    completions."""
    width_p = max(len(p) for p, _ in rows)
    width_c = max(len(c) for _, c in rows)
    ids = torch.full((len(rows), width_p + width_c), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        ids[i, width_p - len(p) : width_p] = torch.tensor(p, dtype=torch.long)
        mask[i, width_p - len(p) : width_p] = 1
        ids[i, width_p : width_p + len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, width_p : width_p + len(c)] = 1
    return ids, mask, width_c


def grouped_rows(generator: torch.Generator, vocab: int = 400, groups: int = 2) -> list[tuple[list[int], list[int]]]:
    """``groups`` groups of three rows (K prompts in one micro-batch); every prompt starts with the same 5-token
    'system prompt'; ragged completions, one completion empty, and a duplicate of the first row."""

    def rand(n):
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    system = rand(5)
    prompts = [system + rand(4 + 3 * g) for g in range(groups)]
    rows = []
    for prompt in prompts:
        for length in (6, 3, 0):
            rows.append((prompt, rand(length)))
    rows.append(rows[0])  # an identical row: same tokens, its own outputs
    return rows


def dense_tree_mask_from_rows(packed, rows: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """``(N, N)`` boolean: query ``i`` sees key ``j`` iff some row holds packed token ``j`` before (or at) packed
    token ``i`` in its own sequence. Built from each row's tokens found in the packed row, not from the layout's
    segments, so it checks them: a row's next token is the nearest later packed token with its id and position (in a
    depth-first radix-tree layout a sibling subtree in between starts with another token). Padding tokens (after the
    real ones) see themselves causally."""
    n = packed.num_tokens
    real = n - packed.padding
    mask = torch.zeros(n, n, dtype=torch.bool)
    ids, pos = packed.input_ids.tolist(), packed.position_ids.tolist()
    for p, c in rows:
        seq, path, start = p + c, [], 0
        for t, token in enumerate(seq):  # walk the packed row: the next token of this row at position t
            found = next(i for i in range(start, real) if ids[i] == token and pos[i] == t)
            path.append(found)
            start = found + 1
            mask[found, path] = True
    mask[real:, real:] = torch.ones(n - real, n - real, dtype=torch.bool).tril()
    return mask


def long_grouped_rows(
    generator: torch.Generator, vocab: int = 400, prompts: tuple[int, ...] = (120, 40, 60)
) -> list[tuple[list[int], list[int]]]:
    """Rows whose packed tree spans several 128-token blocks (FlexAttention's block size): a 16-token 'system prompt'
    shared by every row, then one group of four completions (70, 45, 0 and 90 tokens) per prompt length in
    ``prompts``, and a duplicate of the first row. With the default prompts the packed row holds 608 tokens (5 blocks);
    the first group's long prompt makes whole key blocks visible to later query blocks (full blocks) and the node
    boundaries cut blocks (partial off-diagonal blocks). The longest row has 226 tokens."""

    def rand(n):
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    system = rand(16)
    rows = []
    for length in prompts:
        prompt = system + rand(length)
        rows.extend((prompt, rand(c)) for c in (70, 45, 0, 90))
    rows.append(rows[0])
    return rows


def logp_terms(max_keys: int) -> int:
    """:data:`LOGP_TERMS` for rows of up to ``max_keys`` tokens (the attention row is ``max_keys x head dim``)."""
    return 2 * (128 + 64 + max_keys * 16) + 512


def assert_bf16_attention_close(actual: torch.Tensor, expected: torch.Tensor, value: torch.Tensor) -> None:
    """A fused attention kernel's bf16 output against attention computed in float32/float64 from the same bf16 inputs.

    FlashAttention-style kernels (torch's varlen_attn, flash_attn, FlexAttention, SDPA's flash and CPU kernels) take
    the scores and softmax in float32, round the probabilities to bf16 before multiplying them with the values, then
    round the output once: two roundings of at most one unit roundoff ``eps/2`` of the values' magnitude
    (``sum_j p_j |v_j| <= max |v|`` since the probabilities sum to one), independent of the number of keys. Hence
    ``terms=1``, ``ulps=2`` (one ulp each, twice the unit roundoff), ``scale = max |v|``. A wrong mask, a dropped key or
    an off-by-one causal edge moves some outputs by a sizeable fraction of ``|v|`` (tests/packing/test_kernel_paths.py
    shows each fails)."""
    from tolerance import assert_close

    assert_close(
        actual.double(), expected.double(), terms=1, ulps=2, dtype=torch.bfloat16, scale=float(value.abs().max())
    )


def assert_bf16_logps_close(actual: torch.Tensor, expected: torch.Tensor, msg: str | None = None) -> None:
    """bf16 log-probs of the packed forward against the float32 padded forward of the same weights.

    TRL's fused head computes the log-softmax in float32 from the bf16 model's hidden states; each log-prob then
    carries the bf16 roundings of the layers before it, which (fp32 accumulation in every matmul) stay within one bf16
    ulp of the log-prob's magnitude: ``terms=1``, ``ulps=1``, ``dtype=bf16`` (measured on CPU: 0.006 against a bound of
    0.055 at ``|log p| ~ 7``). A kernel that attends to a wrong branch moves the tiny model's log-probs by about 0.19
    (tests/packing/test_kernel_paths.py shows it fails)."""
    from tolerance import assert_close

    assert_close(actual.double(), expected.double(), terms=1, ulps=1, dtype=torch.bfloat16, msg=msg)


def assert_bf16_grad_close(actual: torch.Tensor, expected: torch.Tensor, msg: str | None = None) -> None:
    """A gradient of the packed bf16 forward (or of a bf16 attention kernel) against float32/float64 from the same
    bf16 weights or inputs.

    Each gradient entry sums terms each rounded a few times to bf16 (probabilities, their gradients, the incoming
    gradient, the output): independent roundings of at most one unit roundoff of their term. Their sum then errs by
    about ``eps/2 * sqrt(sum of squared terms)``, which is the size of the gradient entry itself when the terms have
    random signs, and at most the largest entry of the tensor: ``terms=1`` against ``scale = max |expected|``, with
    ``ulps=8`` (the module default) for the several roundings per term. Measured on CPU in bf16: about one ulp for the
    attention kernel, against 30-120 for a wrong mask, a dropped key or an off-by-one edge
    (tests/packing/test_kernel_paths.py)."""
    from tolerance import DEFAULT_ULPS, assert_close

    assert_close(actual.double(), expected.double(), terms=1, ulps=DEFAULT_ULPS, dtype=torch.bfloat16, msg=msg)


# ---------------------------------------------------------------------------- strict kernel references
# The CUDA kernels' entry points as exact CPU references with their signatures (tests/packing/test_kernel_paths.py,
# tests/packing/test_host_work.py): they assert what the CUDA kernels require, then compute per-node bottom-right
# causal attention in plain torch.
def _check_varlen_arguments(q, k, v, cu_q, cu_k, max_q, max_k, scale) -> None:
    """The contract of FlashAttention's variable-length kernels, as the CUDA kernels enforce it (or misbehave)."""
    assert q.dim() == k.dim() == v.dim() == 3, "(tokens, heads, head_dim) tensors"
    assert q.dtype == k.dtype == v.dtype and q.device == k.device == v.device
    assert q.shape[2] == k.shape[2] == v.shape[2] and k.shape[:2] == v.shape[:2]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "the last dimension must be contiguous"
    for cu, tensor in ((cu_q, q), (cu_k, k)):
        assert cu.dtype == torch.int32 and cu.device == q.device and cu.dim() == 1, (cu.dtype, cu.device)
        assert int(cu[0]) == 0 and bool((cu[1:] >= cu[:-1]).all()) and int(cu[-1]) == tensor.shape[0]
    assert cu_q.shape == cu_k.shape
    for m, cu in ((max_q, cu_q), (max_k, cu_k)):
        assert type(m) is int and m == int((cu[1:] - cu[:-1]).max()), (type(m), m)  # a Python int, the true maximum
    assert scale is None or type(scale) is float


def _bottom_right_causal(q, k, v, cu_q, cu_k, scale):
    outs = []
    for i in range(len(cu_q) - 1):
        qi, ki, vi = (
            t[int(a) : int(b)].transpose(0, 1)
            for t, a, b in ((q, cu_q[i], cu_q[i + 1]), (k, cu_k[i], cu_k[i + 1]), (v, cu_k[i], cu_k[i + 1]))
        )
        mask = torch.ones(qi.shape[1], ki.shape[1], dtype=torch.bool).tril(ki.shape[1] - qi.shape[1])
        outs.append(
            F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
        )
    return torch.cat(outs)


def reference_varlen_attn_2_11(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    k_cache=None,
    v_cache=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    page_table=None,
    seqused_k=None,
):
    """torch 2.11's ``varlen_attn``: causal only for ``window_size == (-1, 0)`` compared as a tuple, no GQA."""
    _check_varlen_arguments(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale)
    assert window_size == (-1, 0) and isinstance(window_size, tuple), window_size  # (-1, -1) is NOT causal
    assert key.shape[1] == query.shape[1], "torch 2.11's varlen_attn has no enable_gqa: heads must be expanded"
    assert return_aux is None
    return _bottom_right_causal(query, key, value, cu_seq_q, cu_seq_k, scale)


def reference_varlen_attn_2_13(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    """torch 2.13's ``varlen_attn``: ``enable_gqa`` for fewer key/value heads."""
    _check_varlen_arguments(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale)
    assert window_size == (-1, 0) and isinstance(window_size, tuple), window_size
    if key.shape[1] != query.shape[1]:
        assert enable_gqa and query.shape[1] % key.shape[1] == 0
    return _bottom_right_causal(query, key, value, cu_seq_q, cu_seq_k, scale)


def reference_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """FlashAttention 2's ``flash_attn_varlen_func`` (>= 2.1: ``causal`` is bottom-right aligned; GQA native)."""
    _check_varlen_arguments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)
    assert causal is True and dropout_p == 0.0 and window_size == (-1, -1) and not return_attn_probs
    assert q.shape[1] % k.shape[1] == 0
    return _bottom_right_causal(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale)
