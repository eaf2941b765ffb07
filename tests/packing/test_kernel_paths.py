"""The CUDA kernels' code paths, run on CPU (`trinity_trl/packing/kernels.py`).

* Hardware and version checks: ``varlen`` and ``flash_attn`` need compute capability >= 8.0 (FlashAttention 2
  kernels), ``flash_attn`` version >= 2.1 (bottom-right causal masks); the capability and version are monkeypatched.
* The call sites of ``varlen_attn`` and ``flash_attn_varlen_func`` (what the model forward passes them, layer after
  layer, forward and backward) through strict references with the exact signatures of torch 2.11's and 2.13's
  ``varlen_attn`` and of FlashAttention 2's ``flash_attn_varlen_func``: they assert the argument types, devices and
  dtypes, then compute per-sequence bottom-right causal attention in plain torch. In float64 the packed model forward
  and its gradients equal the padded forward (tiny Qwen2, 4 query heads over 2 key/value heads).
* FlexAttention's forward compiled (``backend="aot_eager"``, dynamic shapes as on CUDA) over a packed row of 7 blocks
  of 128 tokens: full blocks, partial off-diagonal blocks and the padding block all run.
* The bf16 assertions of the CUDA tests (:func:`assert_bf16_attention_close`, :func:`assert_bf16_logps_close`) pass
  for a correct kernel in bf16 on CPU and FAIL for a deliberately wrong one (wrong mask, dropped token, off-by-one
  causal edge): the GPU run can catch a wrong kernel.
"""

from __future__ import annotations

import contextlib
import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from helpers import build_tiny_model, build_tiny_tokenizer
from packing_helpers import (
    assert_bf16_attention_close,
    assert_bf16_logps_close,
    dense_tree_mask_from_rows,
    logp_terms,
    long_grouped_rows,
    padded_batch,
    reference_flash_attn_varlen_func,
    reference_varlen_attn_2_11,
    reference_varlen_attn_2_13,
)
from tolerance import assert_close

from trinity_trl.packing import KERNELS, check_kernel_request, pack_rows, packed_logps
from trinity_trl.packing import kernels as kernels_module

CUDA_DEVICE = torch.device("cuda")


# ------------------------------------------------------------------------------ hardware and versions
def _fake_gpu(monkeypatch, capability: tuple[int, int], name: str = "a test GPU") -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


@pytest.mark.parametrize("kernel", ["varlen", "flash_attn"])
@pytest.mark.parametrize("capability", [(7, 5), (7, 0), (8, 0), (9, 0)])
def test_flash_kernels_need_compute_capability_8(monkeypatch, kernel, capability):
    """Pre-Ampere GPUs (a T4 is 7.5, a V100 7.0) have no FlashAttention 2 kernels: the kernel is unavailable there,
    with the reason, and a forced ``prefix_packing_kernel`` is rejected when the trainer is built."""
    _fake_gpu(monkeypatch, capability, "Tesla T4")
    monkeypatch.setattr(kernels_module, "_varlen_api", lambda: (None, {"window_size": (-1, 0)}, True))
    monkeypatch.setattr(kernels_module, "_flash_attn_varlen", lambda: reference_flash_attn_varlen_func)
    monkeypatch.setattr(kernels_module.importlib.metadata, "version", lambda name: "2.7.4.post1")
    reason = KERNELS[kernel].unavailable(CUDA_DEVICE)
    if capability >= (8, 0):
        assert reason is None
        check_kernel_request(kernel, CUDA_DEVICE)
    else:
        assert reason and "compute capability 8.0" in reason and f"{capability[0]}.{capability[1]}" in reason, reason
        with pytest.raises(ValueError, match="compute capability"):
            check_kernel_request(kernel, CUDA_DEVICE)


@pytest.mark.parametrize(
    ("version", "ok"), [("2.0.9", False), ("1.0.9", False), ("2.1.0", True), ("2.8.3", True), ("2.7.4.post1", True)]
)
def test_flash_attn_needs_version_2_1(monkeypatch, version, ok):
    """Before 2.1, FlashAttention's causal mask is top-left aligned: a node's queries would miss its ancestors' keys."""
    _fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(kernels_module, "_flash_attn_varlen", lambda: reference_flash_attn_varlen_func)
    monkeypatch.setattr(kernels_module.importlib.metadata, "version", lambda name: version)
    reason = KERNELS["flash_attn"].unavailable(CUDA_DEVICE)
    if ok:
        assert reason is None
    else:
        assert reason and "flash_attn >= 2.1" in reason and version[:3] in reason, reason


def test_references_match_the_installed_varlen_attn_signature():
    """The 2.13 reference has the signature of the installed torch's ``varlen_attn`` (the 2.11 one is written from
    torch 2.11's source: ``window_size``, ``return_aux``, no ``enable_gqa``)."""
    from torch.nn.attention.varlen import varlen_attn

    if "enable_gqa" not in inspect.signature(varlen_attn).parameters:
        pytest.skip(f"torch {torch.__version__}'s varlen_attn has no enable_gqa")
    assert list(inspect.signature(reference_varlen_attn_2_13).parameters) == list(
        inspect.signature(varlen_attn).parameters
    )


VARLEN_PATHS = {
    "varlen-torch2.11": ("varlen", reference_varlen_attn_2_11),
    "varlen-torch2.13": ("varlen", reference_varlen_attn_2_13),
    "flash_attn": ("flash_attn", None),
}


@pytest.fixture
def varlen_path(monkeypatch, request):
    """Install the reference as ``torch.nn.attention.varlen.varlen_attn`` (so the kernel's own signature detection
    runs) or as FlashAttention's function; returns the kernel."""
    import torch.nn.attention.varlen as varlen_module

    name, reference = VARLEN_PATHS[request.param]
    calls = []
    if reference is not None:

        def recorded(*args, **kwargs):
            calls.append(kwargs)
            return reference(*args, **kwargs)

        recorded.__signature__ = inspect.signature(reference)
        monkeypatch.setattr(varlen_module, "varlen_attn", recorded)
        kernels_module._varlen_api.cache_clear()
        request.addfinalizer(kernels_module._varlen_api.cache_clear)
    else:

        def recorded(*args, **kwargs):
            calls.append(kwargs)
            return reference_flash_attn_varlen_func(*args, **kwargs)

        monkeypatch.setattr(kernels_module, "_flash_attn_varlen", lambda: recorded)
    return KERNELS[name], calls, request.param


# --------------------------------------------------------------------------- model-level comparisons
@pytest.fixture(scope="module")
def tiny_setup():
    from trl.trainer.utils import add_fused_lm_head

    from trinity_trl.packing import attention

    attention.register()  # packed_logps registers it too: the layers hand GQA heads over unexpanded
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    rows = long_grouped_rows(torch.Generator().manual_seed(1), vocab=len(tokenizer))
    return model, rows


def padded_logps(model, ids, mask, keep):
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    scored = mask[:, -keep:].bool()
    return out.log_probs[:, -keep:][scored], out.entropy[:, -keep:][scored]


def kernel_logps(model, kernel, ids, mask, keep):
    """The packed forward's call site (forward.packed_logps) with ``kernel``; log-probs in the padded order."""
    (packed,) = pack_rows(ids, mask, keep, pad_multiple=kernel.pad_multiple, min_tokens=kernel.min_tokens)
    logps, entropy = packed_logps(model, model.model, packed, kernel, True, contextlib.nullcontext)
    order = torch.zeros(ids.shape[0], keep, dtype=torch.long)
    order[packed.scored_rows, packed.scored_cols] = torch.arange(packed.scored_rows.numel())
    picked = order[mask[:, -keep:].bool()]
    return logps[picked], entropy[picked], packed


@pytest.mark.parametrize("varlen_path", sorted(VARLEN_PATHS), indirect=True)
def test_varlen_call_sites_through_the_model_equal_the_padded_forward_in_float64(tiny_setup, varlen_path):
    """Log-probs, entropies and every gradient of the tiny Qwen2 (GQA) in float64: the packed forward whose attention
    runs through the CUDA kernel's call site (gathered keys, int32 offsets on the device, Python-int maxima, GQA
    expanded or enable_gqa, bottom-right causal) equals the padded forward."""
    kernel, calls, path = varlen_path
    model = copy.deepcopy(tiny_setup[0]).double()
    rows = tiny_setup[1]
    ids, mask, keep = padded_batch(rows)

    def run(packed: bool):
        model.zero_grad()
        if packed:
            logps, entropy = kernel_logps(model, kernel, ids, mask, keep)[:2]
        else:
            logps, entropy = padded_logps(model, ids, mask, keep)
        (logps.sum() + 0.1 * entropy.sum()).backward()
        return logps.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    packed, padded = run(True), run(False)
    assert len(calls) == model.config.num_hidden_layers  # one call per layer; autograd runs the backward
    # GQA: enable_gqa where torch 2.13 has it; heads expanded for torch 2.11; FlashAttention takes them as they are
    assert [call.get("enable_gqa", False) for call in calls] == [path == "varlen-torch2.13"] * len(calls)
    # the model and the attention run in float64, but TRL's fused head takes its log-softmax in float32: float32
    # tolerances (a wrong mask or a dropped key moves log-probs by ~0.2, see the bf16 tests below)
    terms, f32 = logp_terms(max(len(p) + len(c) for p, c in rows)), torch.float32
    assert_close(packed[0], padded[0], terms=terms, dtype=f32)
    assert_close(packed[1], padded[1], terms=terms, dtype=f32)
    for name, grad in padded[2].items():
        assert_close(packed[2][name], grad, terms=terms * ids.numel(), dtype=f32, msg=name)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_compiled_forward_over_seven_blocks_equals_the_padded_forward(tiny_setup, monkeypatch):
    """FlexAttention's kernel as the CUDA path runs it (torch.compile, dynamic shapes) with the ``aot_eager`` backend
    on CPU, forward only (CPU FlexAttention has no backward), over a packed row of 7 blocks: its BlockMask has full
    blocks and partial off-diagonal blocks, and the last block is partly padding."""
    from torch.nn.attention.flex_attention import flex_attention

    kernel = KERNELS["flex"]
    compiled = torch.compile(flex_attention, dynamic=True, backend="aot_eager")
    monkeypatch.setattr(kernels_module, "_compiled_flex", lambda: compiled)
    model = copy.deepcopy(tiny_setup[0]).float()
    rows = tiny_setup[1]
    ids, mask, keep = padded_batch(rows)
    with torch.no_grad():
        logps, entropy, packed = kernel_logps(model, kernel, ids, mask, keep)
        want_logps, want_entropy = padded_logps(model, ids, mask, keep)
    block_mask = kernel.plan(packed, torch.device("cpu")).block_mask
    blocks = packed.num_tokens // kernels_module.FLEX_BLOCK
    assert blocks >= 3 and packed.padding > 0
    assert int(block_mask.full_kv_num_blocks.sum()) > 0  # whole key blocks visible to a later query block
    partial_off_diagonal = int(block_mask.kv_num_blocks.sum()) - blocks
    assert partial_off_diagonal > 0
    terms = logp_terms(max(len(p) + len(c) for p, c in rows))
    assert_close(logps, want_logps, terms=terms)
    assert_close(entropy, want_entropy, terms=terms)


# ------------------------------------------------------------------------------ the bf16 arm can fail
def _attention_case():
    rows = long_grouped_rows(torch.Generator().manual_seed(0))
    (packed,) = pack_rows(*padded_batch(rows))
    truth = dense_tree_mask_from_rows(packed, rows)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, packed.num_tokens, 64, generator=g).bfloat16() for h in (8, 2, 2))
    return packed, truth, q, k, v


def _sdpa(q, k, v, mask, dtype=torch.bfloat16):
    return F.scaled_dot_product_attention(
        q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask, scale=64**-0.5, enable_gqa=True
    )


def _layout_bug(packed, truth, bug: str) -> torch.Tensor:
    """The dense mask of a deliberately wrong kernel."""
    from trinity_trl.packing import gathered_keys

    if bug == "wrong mask":  # plain causal over the packed row: sees other branches
        return torch.ones_like(truth).tril()
    layout = gathered_keys(packed.segments)
    mask = torch.zeros_like(truth)
    shift = 1 if bug == "off-by-one" else 0
    for i in range(len(layout.cu_q) - 1):
        keys = list(layout.key_index[layout.cu_k[i] : layout.cu_k[i + 1]])
        length = int(layout.cu_q[i + 1] - layout.cu_q[i])
        if bug == "dropped token" and len(keys) > length:
            keys = keys[1:]  # every non-root node loses its path's first key
            length = min(length, len(keys))
        for j in range(length):
            mask[layout.cu_q[i] + j, keys[: len(keys) - length + j + 1 + shift]] = True
    return mask | (truth if bug == "off-by-one" else torch.zeros_like(truth))


def test_bf16_kernel_assertion_passes_a_correct_bf16_kernel():
    """The reference kernel in bf16 on CPU (fp32 accumulation, as FlashAttention) passes the CUDA test's assertion."""
    packed, truth, q, k, v = _attention_case()
    kernel = KERNELS["sdpa_segments"]
    out = kernel(kernel.plan(packed, q.device), q, k, v, 64**-0.5)
    assert out.dtype == torch.bfloat16
    assert_bf16_attention_close(out, _sdpa(q, k, v, truth, torch.float64), v)


@pytest.mark.parametrize("bug", ["wrong mask", "dropped token", "off-by-one"])
def test_bf16_kernel_assertion_fails_a_wrong_bf16_kernel(bug):
    packed, truth, q, k, v = _attention_case()
    wrong = _sdpa(q, k, v, _layout_bug(packed, truth, bug))
    assert not torch.equal(_layout_bug(packed, truth, bug), truth)
    with pytest.raises(AssertionError):
        assert_bf16_attention_close(wrong, _sdpa(q, k, v, truth, torch.float64), v)


class _PlainCausal(kernels_module.SdpaSegments):
    """A deliberately wrong kernel: causal over the whole packed row (every earlier branch visible)."""

    def __call__(self, plan, query, key, value, scale):
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=True)


@pytest.mark.parametrize("wrong", [False, True], ids=["correct", "wrong kernel"])
def test_bf16_model_assertion_catches_a_wrong_kernel(tiny_setup, wrong):
    """The model-level bf16 assertion of the CUDA test (bf16 packed log-probs against the float32 padded forward of the
    same weights): a correct kernel in bf16 on CPU passes, a wrong one fails."""
    model = copy.deepcopy(tiny_setup[0])
    rows = tiny_setup[1]
    ids, mask, keep = padded_batch(rows)
    with torch.no_grad():
        reference = padded_logps(model.float(), ids, mask, keep)[0]
        kernel = _PlainCausal() if wrong else KERNELS["sdpa_segments"]
        logps = kernel_logps(model.bfloat16(), kernel, ids, mask, keep)[0]
    if wrong:
        with pytest.raises(AssertionError):
            assert_bf16_logps_close(logps, reference)
    else:
        assert_bf16_logps_close(logps, reference)
