"""Tree-attention kernels (`trinity_trl/packing/kernels.py`): each kernel's layout against the dense tree mask built
from the rows, the reference kernel against SDPA with that dense mask, and (marked `gpu`) every kernel on CUDA.

Tolerances (tests/tolerance.py): an attention output or its gradient sums ``keys x head_dim`` products (``terms``).
The fused CUDA kernels in bf16 accumulate in float32 but round the probabilities and the output to bf16 once each:
``tolerance(dtype=bf16, terms=keys, ulps=1)`` (one bf16 rounding per summed key, independent, so sqrt(keys)).
The deliberate bugs below (a wrong mask, a dropped key, an off-by-one causal edge) must FAIL the same comparison.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from packing_helpers import (
    assert_bf16_attention_close,
    assert_bf16_grad_close,
    dense_tree_mask_from_rows,
    grouped_rows,
    long_grouped_rows,
    padded_batch,
)
from tolerance import assert_close

from trinity_trl.packing import KERNELS, gathered_keys, pack_rows, tree_block_mask, tree_mask_mod
from trinity_trl.packing import kernels as kernels_module

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA (run by `make test-gpu` on a GPU machine)")


def packed_case(seed: int, groups: int = 2, pad_multiple: int = 1):
    rows = grouped_rows(torch.Generator().manual_seed(seed), groups=groups)
    ids, mask, keep = padded_batch(rows)
    (packed,) = pack_rows(ids, mask, keep, pad_multiple=pad_multiple)
    return packed, dense_tree_mask_from_rows(packed, rows)


def qkv(n: int, heads: int, kv_heads: int, dim: int, seed: int, device="cpu", dtype=torch.float32, grad=True):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(1, h, n, dim, generator=g).to(device, dtype).requires_grad_(grad)
        for h in (heads, kv_heads, kv_heads)
    ]


def dense_attention(q, k, v, mask, scale):
    """The reference: SDPA with the dense mask, float32."""
    return F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask.to(q.device), scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


def gathered_mask(packed, index, cu_q, cu_k, shift: int = 0) -> torch.Tensor:
    """The dense mask a gathered-key layout means (bottom-right causal per node)."""
    n = packed.num_tokens
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(len(cu_q) - 1):
        keys = index[cu_k[i] : cu_k[i + 1]]
        length, total = cu_q[i + 1] - cu_q[i], len(keys)
        for j in range(length):
            mask[cu_q[i] + j, keys[: total - length + j + 1 + shift]] = True
    return mask


# ------------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_gathered_key_layout_equals_the_dense_tree_mask(groups):
    """varlen / flash_attn / sdpa_segments: offsets and gathered-key index."""
    packed, truth = packed_case(groups, groups)
    layout = gathered_keys(packed.segments)
    assert layout.cu_q[-1] == packed.num_tokens and layout.cu_k[-1] == len(layout.key_index)
    assert torch.equal(gathered_mask(packed, layout.key_index, layout.cu_q, layout.cu_k), truth)


@pytest.mark.parametrize("groups", [1, 4])
def test_flex_block_mask_equals_the_dense_tree_mask(groups):
    """flex: the mask_mod as a dense boolean matrix, and the BlockMask built from the layout against the blocks of the
    dense mask and against torch's own create_block_mask (block size 16 so that a small tree spans many blocks)."""
    from torch.nn.attention.flex_attention import create_block_mask

    block = 16
    packed, truth = packed_case(10 + groups, groups, pad_multiple=block)
    n = packed.num_tokens
    ends = torch.as_tensor(packed.subtree_ends(), dtype=torch.int32)
    mask_mod = tree_mask_mod(ends)
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    assert torch.equal(mask_mod(0, 0, q, k), truth)
    ours = tree_block_mask(ends, block)
    blocks = truth.view(n // block, block, n // block, block).permute(0, 2, 1, 3).flatten(2)
    assert torch.equal(ours.to_dense()[0, 0].bool(), blocks.any(-1))
    full = torch.zeros_like(blocks.any(-1))
    for qb in range(n // block):
        full[qb, ours.full_kv_indices[0, 0, qb, : ours.full_kv_num_blocks[0, 0, qb]].long()] = True
    assert torch.equal(full, blocks.all(-1))
    theirs = create_block_mask(mask_mod, 1, 1, n, n, device="cpu", BLOCK_SIZE=block)
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)


# ------------------------------------------------------------------------------------ the reference kernel
def run_kernel(name, packed, q, k, v, scale, **call):
    kernel = KERNELS[name]
    return kernel(kernel.plan(packed, q.device), q, k, v, scale, **call)


@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa_segments_equals_sdpa_with_the_dense_tree_mask(gqa):
    packed, truth = packed_case(0)
    keys, dim = int(truth.sum(1).max()), 8
    q, k, v = qkv(packed.num_tokens, 4, 2 if gqa else 4, dim, seed=1)
    out = run_kernel("sdpa_segments", packed, q, k, v, 0.3)
    expected = dense_attention(q, k, v, truth, 0.3)
    assert_close(out, expected, terms=keys * dim)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        assert_close(got, want, terms=keys * dim * packed.num_tokens)  # a key's gradient sums over its queries too


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_kernel_forward_on_cpu_equals_the_dense_tree_mask():
    """FlexAttention runs forward (only) on CPU, uncompiled: the kernel with its BlockMask and padding."""
    packed, truth = packed_case(4, groups=3, pad_multiple=kernels_module.FLEX_BLOCK)
    keys, dim = int(truth.sum(1).max()), 16
    q, k, v = qkv(packed.num_tokens, 4, 2, dim, seed=2, grad=False)
    out = run_kernel("flex", packed, q, k, v, 0.25, compiled=False)
    assert_close(out, dense_attention(q, k, v, truth, 0.25), terms=keys * dim)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=None, enable_gqa=False, **kw):
    """What varlen_attn / flash_attn_varlen_func compute (bottom-right causal per sequence), in plain torch."""
    assert window_size in ((-1, 0), None) and q.shape[0] == cu_q[-1] and k.shape[0] == cu_k[-1]
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
    scale = kw.get("softmax_scale", scale)
    outs = []
    for i in range(len(cu_q) - 1):
        qi, ki, vi = (
            t[a:b].transpose(0, 1)
            for t, a, b in ((q, cu_q[i], cu_q[i + 1]), (k, cu_k[i], cu_k[i + 1]), (v, cu_k[i], cu_k[i + 1]))
        )
        mask = torch.ones(qi.shape[1], ki.shape[1], dtype=torch.bool).tril(ki.shape[1] - qi.shape[1])
        outs.append(
            F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
        )
    return torch.cat(outs)


@pytest.mark.parametrize("gqa_in_torch", [False, True])
def test_varlen_and_flash_attn_kernels_call_their_kernel_with_the_layout(monkeypatch, gqa_in_torch):
    """The CUDA kernels' arguments (queries as packed, gathered keys, offsets, bottom-right causal, GQA heads
    expanded where torch's varlen_attn has no enable_gqa) checked on CPU with a reference standing in for the kernel."""
    calls = []

    def fake_varlen(q, k, v, *args, **kwargs):
        calls.append((k.shape[1], kwargs))
        return reference_varlen(q, k, v, *args, **kwargs)

    monkeypatch.setattr(kernels_module, "_varlen_api", lambda: (fake_varlen, {"window_size": (-1, 0)}, gqa_in_torch))
    monkeypatch.setattr(kernels_module, "_flash_attn_varlen", lambda: reference_varlen)
    packed, truth = packed_case(5, groups=2)
    keys, dim = int(truth.sum(1).max()), 8
    q, k, v = qkv(packed.num_tokens, 4, 2, dim, seed=3, grad=False)
    expected = dense_attention(q, k, v, truth, 0.3)
    for name in ("varlen", "flash_attn"):
        assert_close(run_kernel(name, packed, q, k, v, 0.3), expected, terms=keys * dim, msg=name)
    assert calls[0][0] == (2 if gqa_in_torch else 4) and calls[0][1].get("enable_gqa", False) == gqa_in_torch


# ------------------------------------------------------------------------------ the comparison can fail
def _buggy_outputs():
    packed, truth = packed_case(6)
    keys, dim = int(truth.sum(1).max()), 8
    q, k, v = qkv(packed.num_tokens, 4, 4, dim, seed=4, grad=False)
    expected = dense_attention(q, k, v, truth, 0.3)
    layout = gathered_keys(packed.segments)
    wrong = torch.ones_like(truth).tril()  # plain causal over the packed row: sees other branches
    dropped = layout.key_index.copy()
    second = next(i for i in range(len(layout.cu_q) - 1) if layout.cu_k[i + 1] - layout.cu_k[i] > 2)
    dropped[layout.cu_k[second]] = dropped[layout.cu_k[second] + 1]  # a node loses its first key (duplicated)
    return {
        "wrong mask": (dense_attention(q, k, v, wrong, 0.3), expected, keys * dim),
        "dropped token": (
            dense_attention(q, k, v, gathered_mask(packed, dropped, layout.cu_q, layout.cu_k), 0.3),
            expected,
            keys * dim,
        ),
        "off-by-one": (
            dense_attention(
                q, k, v, gathered_mask(packed, layout.key_index, layout.cu_q, layout.cu_k, shift=1) | truth, 0.3
            ),
            expected,
            keys * dim,
        ),
    }


@pytest.mark.parametrize("bug", ["wrong mask", "dropped token", "off-by-one"])
def test_a_deliberate_layout_bug_fails_the_same_comparison(bug):
    actual, expected, terms = _buggy_outputs()[bug]
    with pytest.raises(AssertionError):
        assert_close(actual, expected, terms=terms)


# ------------------------------------------------------------------------------------------------ CUDA
def long_case(pad_multiple: int = 1, min_tokens: int = 0):
    """A packed row of 851 tokens (7 blocks of 128: full and partial off-diagonal FlexAttention blocks)."""
    rows = long_grouped_rows(torch.Generator().manual_seed(0))
    ids, mask, keep = padded_batch(rows)
    (packed,) = pack_rows(ids, mask, keep, pad_multiple=pad_multiple, min_tokens=min_tokens)
    return packed, dense_tree_mask_from_rows(packed, rows)


def check_kernel_on(device, name: str, dtype: torch.dtype, kernel=None) -> None:
    """``kernel`` (default ``KERNELS[name]``) on ``device`` in ``dtype``, output and gradients, against SDPA with the
    dense tree mask in float32 (float64 on CPU) from the same inputs; 8 query heads over 2 key/value heads, head
    dimension 64. float32: float32 tolerances over ``keys x head_dim`` terms. bf16: :func:`assert_bf16_attention_close`
    and :func:`assert_bf16_grad_close` (bounds independent of the row's length, which a wrong kernel exceeds: shown on
    CPU by ``test_the_kernel_check_fails_a_wrong_kernel``)."""
    kernel = kernel or KERNELS[name]
    packed, truth = long_case(kernel.pad_multiple, kernel.min_tokens)
    packed.input_ids = packed.input_ids.to(device)
    keys, dim = int(truth.sum(1).max()), 64
    q, k, v = qkv(packed.num_tokens, 8, 2, dim, seed=5, device=device, dtype=dtype)
    out = kernel(kernel.plan(packed, q.device), q, k, v, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    reference = torch.float64 if torch.device(device).type == "cpu" else torch.float32
    qr, kr, vr = (t.detach().to(reference).requires_grad_(True) for t in (q, k, v))
    expected = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=truth.to(device), scale=dim**-0.5, enable_gqa=True)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (qr, kr, vr))
    if dtype == torch.float32:
        assert_close(out.double(), expected.double(), terms=keys * dim, dtype=dtype)
        for got, want in zip(grads, expected_grads):
            assert_close(got.double(), want.double(), terms=keys * dim * packed.num_tokens, dtype=dtype)
    else:
        assert_bf16_attention_close(out, expected, v)
        for got, want, what in zip(grads, expected_grads, "qkv"):
            assert_bf16_grad_close(got, want, msg=f"d{what}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_kernel_check_passes_the_cpu_kernel(dtype):
    check_kernel_on("cpu", "sdpa_segments", dtype)


class _OffByOne(kernels_module.SdpaSegments):
    """A deliberately wrong kernel: each node's queries see one key too many (the causal edge off by one)."""

    def plan(self, packed, device):
        return [
            (queries, keys, None if mask is None else torch.ones_like(mask).tril(mask.shape[1] - mask.shape[0] + 1))
            for queries, keys, mask in super().plan(packed, device)
        ]


class _PlainCausal(kernels_module.SdpaSegments):
    def __call__(self, plan, query, key, value, scale):
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("wrong", [_OffByOne, _PlainCausal], ids=["off-by-one", "plain causal"])
def test_the_kernel_check_fails_a_wrong_kernel(wrong, dtype):
    with pytest.raises(AssertionError, match="not close|d[qkv]"):  # the values, not a setup
        check_kernel_on("cpu", "sdpa_segments", dtype, kernel=wrong())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["sdpa_segments", "varlen", "flash_attn", "flex"])
def test_kernel_on_cuda_equals_sdpa_with_the_dense_tree_mask(name, dtype):
    kernel = KERNELS[name]
    reason = kernel.unavailable(torch.device("cuda")) or kernel.unsupported_dtype(dtype)
    if reason:
        pytest.skip(reason)
    check_kernel_on("cuda", name, dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("enable_gqa", [True, False], ids=["enable_gqa", "expanded"])
def test_varlen_on_cuda_with_and_without_enable_gqa(monkeypatch, enable_gqa):
    """varlen_attn's two GQA paths on CUDA in bf16: ``enable_gqa`` (torch >= 2.12) and key/value heads expanded (the
    torch 2.11 path, forced here on any torch)."""
    kernel = KERNELS["varlen"]
    reason = kernel.unavailable(torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    attn, causal, has_gqa = kernels_module._varlen_api()
    if enable_gqa and not has_gqa:
        pytest.skip(f"torch {torch.__version__}'s varlen_attn has no enable_gqa")
    calls = []

    def recorded(*args, **kwargs):
        calls.append(args[1].shape[1])
        return attn(*args, **kwargs)

    monkeypatch.setattr(kernels_module, "_varlen_api", lambda: (recorded, causal, enable_gqa))
    check_kernel_on("cuda", "varlen", torch.bfloat16)
    assert calls == [2 if enable_gqa else 8]  # key/value heads passed to varlen_attn


def test_gathered_keys_of_an_empty_layout():
    layout = gathered_keys([])
    assert layout.key_index.size == 0 and np.array_equal(layout.cu_q, [0]) and layout.max_k == 0
