"""Prefix-shared packed forward (`trainers/packing.py`): the layout, the tree attention, and exactness.

Exactness means: the packed layout gives the padded layout's per-token log-probs, entropies, loss and every
parameter gradient, up to float32 rounding (different reduction orders). Tolerances: log-probs and entropies
`atol=2e-5`; loss and gradients `rtol=1e-4, atol=1e-6` (what we see: about 1e-6 on log-probs and 5e-7 relative on
gradients). Every trainer test computes the same batch twice on the same trainer, `prefix_packing` on and off.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import build_tiny_model, build_tiny_tokenizer, length_reward, save_tiny_model, tiny_grpo_kwargs
from peft import LoraConfig

from trinity_trl.trainers import (
    ChordConfig,
    ChordTrainer,
    CISPOConfig,
    CISPOTrainer,
    PPOConfig,
    PPOTrainer,
    SAPOConfig,
    SAPOTrainer,
    TrinityConfig,
    TrinityTrainer,
)
from trinity_trl.trainers.packing import (
    NotPackable,
    PrefixPacking,
    TreeAttentionMask,
    pack_rows,
    tree_attention,
    unsupported_reason,
)

LOGP_ATOL = 2e-5
RTOL, ATOL = 1e-4, 1e-6
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
SYSTEM = "You are a careful assistant. Answer with the number only."
DIST_SCRIPT = Path(__file__).resolve().parent / "dist_scripts" / "packing_equivalence.py"


# ------------------------------------------------------------------------------------------------ helpers
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


def dense_tree_mask(packed) -> torch.Tensor:
    """The ``(N, N)`` boolean mask the segments describe, materialised (for reference only)."""
    n = packed.num_tokens
    mask = torch.zeros(n, n, dtype=torch.bool)
    for seg in packed.segments:
        for s, e in seg.ancestors:
            mask[seg.start : seg.end, s:e] = True
        mask[seg.start : seg.end, seg.start : seg.end] = (
            torch.ones(seg.end - seg.start, seg.end - seg.start).tril().bool()
        )
    return mask


def grouped_rows(generator: torch.Generator, vocab: int = 400) -> list[tuple[list[int], list[int]]]:
    """Two groups of three rows; both prompts start with the same 5-token 'system prompt'; ragged completions, one
    completion empty, two identical rows."""

    def rand(n):
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    system = rand(5)
    prompts = [system + rand(4), system + rand(7)]
    rows = []
    for prompt in prompts:
        for length in (6, 3, 0):
            rows.append((prompt, rand(length)))
    rows.append(rows[0])  # an identical row: same tokens, its own outputs
    return rows


def loss_and_grads(trainer, batch: dict, packing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``_compute_loss`` + backward of ``batch`` in one layout: the loss and every parameter's gradient (policy
    and, for PPO, critic)."""
    trainer.prefix_packing.enabled = packing
    trainer.current_gradient_accumulation_steps = 1
    modules = {"policy": trainer.model_wrapped}  # what the Trainer passes to the loss (DDP under torchrun)
    if getattr(trainer, "critic", None) is not None:
        modules["critic"] = trainer.critic
    for m in modules.values():
        m.train()
        m.zero_grad(set_to_none=True)
    logged = trainer._metrics["train"]["packing/forwarded_token_ratio"]
    calls = len(logged)
    loss = trainer._compute_loss(trainer.model_wrapped, dict(batch))
    loss.backward()
    if packing:  # the training forward was packed, not silently padded
        assert len(logged) > calls and max(logged[calls:]) < 0.9, logged[calls:]
    grads = {
        f"{k}.{n}": p.grad.detach().clone()
        for k, m in modules.items()
        for n, p in m.named_parameters()
        if p.requires_grad and p.grad is not None
    }
    for m in modules.values():
        m.zero_grad(set_to_none=True)
    trainer.prefix_packing.enabled = True
    return loss.detach(), grads


def assert_same_loss_and_grads(trainer, batch: dict) -> None:
    loss_packed, grads_packed = loss_and_grads(trainer, batch, packing=True)
    loss_padded, grads_padded = loss_and_grads(trainer, batch, packing=False)
    torch.testing.assert_close(loss_packed, loss_padded, rtol=RTOL, atol=ATOL)
    assert grads_packed.keys() == grads_padded.keys() and grads_packed
    for name in grads_padded:
        torch.testing.assert_close(grads_packed[name], grads_padded[name], rtol=RTOL, atol=ATOL, msg=name)


def ragged(batch: dict, pad_id: int) -> dict:
    """Completions of different lengths (one row empty), as EOS and truncation masking leave them."""
    batch = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    rows, width = batch["completion_mask"].shape
    lengths = torch.tensor([width - (i * 3) % width if i % 5 != 4 else 0 for i in range(rows)])
    keep = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(batch["completion_mask"].dtype)
    batch["completion_mask"] = batch["completion_mask"] * keep
    batch["completion_ids"] = batch["completion_ids"].masked_fill(keep == 0, pad_id)
    return batch


def conversational_dataset(n: int = 8) -> Dataset:
    """Prompts that share a system message (cross-group sharing) and differ in the question."""
    return Dataset.from_dict(
        {
            "prompt": [
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a}+{a + 1}?"}]
                for a in range(n)
            ],
            "answer": [str(2 * a + 1) for a in range(n)],
        }
    )


def generation_batch(trainer, prompts: int = 2) -> dict:
    """One scored generation batch of ``prompts`` x ``num_generations`` rows (TRL's old/reference forwards, where
    the config needs them, already ran through the packed layout)."""
    trainer.model.train()
    dataset = conversational_dataset()
    rows = [dict(dataset[i]) for i in range(prompts) for _ in range(trainer.num_generations)]
    torch.manual_seed(0)
    return trainer._generate_and_score_completions(rows)


@pytest.fixture(scope="module")
def llama_model_dir(tmp_path_factory, tiny_tokenizer_dir) -> str:
    from transformers import AutoTokenizer

    return save_tiny_model(
        tmp_path_factory.mktemp("tiny_llama"), AutoTokenizer.from_pretrained(tiny_tokenizer_dir), arch="llama"
    )


@pytest.fixture(params=["qwen2", "llama"])
def model_dir(request, tiny_model_dir, llama_model_dir) -> str:
    return tiny_model_dir if request.param == "qwen2" else llama_model_dir


# ----------------------------------------------------------------------------------------- the layout
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


@pytest.mark.parametrize("gqa", [False, True])
def test_tree_attention_equals_sdpa_with_the_dense_tree_mask(gqa):
    generator = torch.Generator().manual_seed(0)
    ids, mask, keep = padded_batch(grouped_rows(generator))
    (packed,) = pack_rows(ids, mask, keep)
    n, heads, kv_heads, dim = packed.num_tokens, 4, 2 if gqa else 4, 8
    q = torch.randn(1, heads, n, dim, generator=generator, requires_grad=True)
    k = torch.randn(1, kv_heads, n, dim, generator=generator, requires_grad=True)
    v = torch.randn(1, kv_heads, n, dim, generator=generator, requires_grad=True)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=packed.attention_mask(), scale=0.3, enable_gqa=gqa
    )
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_tree_mask(packed), scale=0.3, enable_gqa=gqa
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert tree_attention is not None  # the kernel SDPA dispatches to through the mask (no other use of it)


def test_flash_varlen_path_gathers_each_segments_path(monkeypatch):
    """The CUDA path's arguments (queries as packed, each segment's gathered path as its keys, cu_seqlens, causal
    bottom-right) checked on CPU with a reference varlen attention standing in for FlashAttention's kernel."""
    from trinity_trl.trainers import packing

    def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
        assert causal and q.shape[0] == cu_q[-1] and k.shape[0] == cu_k[-1]
        outs = []
        for i in range(len(cu_q) - 1):
            qi, ki, vi = (
                t[a:b].transpose(0, 1)
                for t, a, b in ((q, cu_q[i], cu_q[i + 1]), (k, cu_k[i], cu_k[i + 1]), (v, cu_k[i], cu_k[i + 1]))
            )
            mask = torch.ones(qi.shape[1], ki.shape[1], dtype=torch.bool).tril(ki.shape[1] - qi.shape[1])
            outs.append(
                torch.nn.functional.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, scale=softmax_scale
                ).transpose(0, 1)
            )
        return torch.cat(outs)

    monkeypatch.setattr(packing, "attention_backend", lambda device, dtype: "flash_attn_varlen")
    monkeypatch.setattr(packing, "_flash_varlen", lambda: reference_varlen)
    generator = torch.Generator().manual_seed(2)
    ids, mask, keep = padded_batch(grouped_rows(generator))
    (packed,) = pack_rows(ids, mask, keep)
    q, k, v = (torch.randn(1, 4, packed.num_tokens, 8, generator=generator) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=packed.attention_mask(), scale=0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_tree_mask(packed), scale=0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_tree_mask_is_only_an_sdpa_mask():
    mask = TreeAttentionMask([], "cpu")
    assert mask.shape == (1, 1, 0, 0) and mask.device.type == "cpu"  # transformers takes it as a prepared 4D mask
    assert mask.to("cpu") is mask
    with pytest.raises(TypeError, match="scaled_dot_product_attention"):
        torch.add(torch.zeros(1, 1, 2, 2), mask)  # eager attention adds masks: refused, never silently wrong


# --------------------------------------------------------------------------------- the model forward
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_forward_equals_padded_forward(arch):
    """Log-probs, entropies and gradients of TRL's fused-head forward, packed vs padded, at temperature 0.7."""
    from trl.trainer.utils import add_fused_lm_head

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, arch=arch)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    ids, mask, keep = padded_batch(grouped_rows(torch.Generator().manual_seed(1), vocab=len(tokenizer)))
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100

    def run(packed: bool):
        model.zero_grad()
        if packed:
            packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext)
            out = packing.logps_and_entropies(model, ids, mask, keep, None, True, False, {})
            logps, entropy = out.logps, out.entropies
        else:
            out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            logps, entropy = out.log_probs[:, -keep:], out.entropy[:, -keep:]
        (logps.sum() + 0.1 * entropy.sum()).backward()
        return logps.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    packed, padded = run(True), run(False)
    torch.testing.assert_close(packed[0], padded[0], rtol=0, atol=LOGP_ATOL)
    torch.testing.assert_close(packed[1], padded[1], rtol=0, atol=LOGP_ATOL)
    for name, grad in padded[2].items():
        torch.testing.assert_close(packed[2][name], grad, rtol=RTOL, atol=ATOL, msg=name)


# --------------------------------------------------------------------------------------- the trainers
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("normalization", ["micro_batch", "global"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_trinity_loss_and_gradients_equal_padded(tmp_path, model_dir, agg, normalization):
    """Every aggregation mode and normalisation, with the KL loss and the entropy bonus on, on a ragged batch with
    behaviour (old) log-probs: loss and every gradient equal; so are the no-grad behaviour and reference forwards."""
    args = TrinityConfig(
        **tiny_grpo_kwargs(
            output_dir=str(tmp_path),
            loss_agg_mode=agg,
            loss_normalization=normalization,
            kl_loss_fn="k2",
            kl_loss_fn_args={"kl_coef": 0.5},
            entropy_loss_fn_args={"entropy_coef": 0.05},
            temperature=0.8,
        )
    )
    trainer = TrinityTrainer(
        model=model_dir, reward_funcs=length_reward, args=args, train_dataset=conversational_dataset()
    )
    batch = ragged(generation_batch(trainer), trainer._tokenizer.pad_token_id)
    rows = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    trainer.prefix_packing.enabled = False
    behaviour, reference = trainer._forward_logps(trainer.model, rows), trainer._reference_logps(rows)
    trainer.prefix_packing.enabled = True
    torch.testing.assert_close(trainer._forward_logps(trainer.model, rows), behaviour, rtol=0, atol=LOGP_ATOL)
    torch.testing.assert_close(trainer._reference_logps(rows), reference, rtol=0, atol=LOGP_ATOL)
    batch["old_per_token_logps"] = behaviour + 0.2 * torch.randn(
        behaviour.shape, generator=torch.Generator().manual_seed(0)
    )
    batch["ref_per_token_logps"] = reference
    assert_same_loss_and_grads(trainer, batch)


def test_lora_adapter_and_disabled_adapter_reference_equal_padded(tmp_path, model_dir):
    args = TrinityConfig(
        **tiny_grpo_kwargs(
            output_dir=str(tmp_path), kl_loss_fn="low_var_kl", kl_loss_fn_args={"kl_coef": 0.5}, learning_rate=0.05
        )
    )
    trainer = TrinityTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=conversational_dataset(),
        peft_config=copy.deepcopy(LORA),
    )
    with torch.no_grad():  # a non-zero adapter, so the disabled-adapter reference differs from the policy
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    batch = ragged(generation_batch(trainer), trainer._tokenizer.pad_token_id)
    rows = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    packed_ref = trainer._reference_logps(rows)
    trainer.prefix_packing.enabled = False
    padded_ref = trainer._reference_logps(rows)
    trainer.prefix_packing.enabled = True
    torch.testing.assert_close(packed_ref, padded_ref, rtol=0, atol=LOGP_ATOL)
    assert (packed_ref - trainer._forward_logps(trainer.model, rows)).abs().max() > 1e-3  # adapter really disabled
    batch["ref_per_token_logps"] = padded_ref
    assert_same_loss_and_grads(trainer, batch)


@pytest.mark.parametrize("arch_peft", [("qwen2", False), ("llama", True)])
def test_training_with_accumulation_and_iterations_equals_padded(tmp_path, tiny_model_dir, llama_model_dir, arch_peft):
    """Two optimizer steps from one generation batch (GA 2, num_iterations 2: TRL itself computes behaviour
    log-probs, and reference ones for the KL), plain SGD: same logged losses, gradient norms and final weights.
    The LoRA case also checkpoints activations (the layers recompute their forward, mask included, in backward)."""
    arch, peft = arch_peft
    results = {}
    for packing in (True, False):
        args = TrinityConfig(
            **tiny_grpo_kwargs(
                output_dir=str(tmp_path / str(packing)),
                per_device_train_batch_size=4,
                gradient_accumulation_steps=2,
                num_iterations=2,
                kl_loss_fn="k3",
                kl_loss_fn_args={"kl_coef": 0.1},
                optim="sgd",
                learning_rate=0.1,
                entropy_loss_fn_args={"entropy_coef": 0.01},
                prefix_packing=packing,
                activation_checkpointing=peft,
            )
        )
        trainer = TrinityTrainer(
            model=tiny_model_dir if arch == "qwen2" else llama_model_dir,
            reward_funcs=length_reward,
            args=args,
            train_dataset=conversational_dataset(),
            peft_config=copy.deepcopy(LORA) if peft else None,
        )
        trainer.train()
        logs = trainer.state.log_history
        results[packing] = (
            [e["loss"] for e in logs if "loss" in e],
            [e["grad_norm"] for e in logs if "grad_norm" in e],
            {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad},
            [e["packing/forwarded_token_ratio"] for e in logs if "packing/forwarded_token_ratio" in e],
        )
    (loss_a, norm_a, weights_a, ratio_a), (loss_b, norm_b, weights_b, ratio_b) = results[True], results[False]
    assert len(loss_a) == 2
    torch.testing.assert_close(torch.tensor(loss_a), torch.tensor(loss_b), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.tensor(norm_a), torch.tensor(norm_b), rtol=RTOL, atol=ATOL)
    for name, w in weights_b.items():
        torch.testing.assert_close(weights_a[name], w, rtol=RTOL, atol=ATOL, msg=name)
    assert max(ratio_a) < 0.9 and min(ratio_b) == 1.0  # packed forwards happened (TRL's own ones included)


def _expert_dataset() -> Dataset:
    return Dataset.from_dict(
        {
            "messages": [
                [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"What is {a}+1?"},
                    {"role": "assistant", "content": f"It is {a + 1}."},
                ]
                for a in range(8)
            ]
        }
    )


TRAINERS = {
    "chord": lambda d, o: ChordTrainer(
        model=d,
        reward_funcs=length_reward,
        train_dataset=conversational_dataset(),
        expert_dataset=_expert_dataset(),
        args=ChordConfig(**tiny_grpo_kwargs(output_dir=o, expert_batch_size=2, mu_peak=0.5, mu_valley=0.5)),
    ),
    "cispo": lambda d, o: CISPOTrainer(
        model=d,
        reward_funcs=length_reward,
        train_dataset=conversational_dataset(),
        args=CISPOConfig(**tiny_grpo_kwargs(output_dir=o)),
    ),
    "sapo": lambda d, o: SAPOTrainer(
        model=d,
        reward_funcs=length_reward,
        train_dataset=conversational_dataset(),
        args=SAPOConfig(**tiny_grpo_kwargs(output_dir=o)),
    ),
    "ppo": lambda d, o: PPOTrainer(
        model=d,
        reward_funcs=length_reward,
        train_dataset=conversational_dataset(),
        args=PPOConfig(**tiny_grpo_kwargs(output_dir=o)),
    ),
}


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_every_rollout_trainer_equals_padded(tmp_path, tiny_model_dir, name):
    """CHORD (rollout and expert rows), CISPO, SAPO and PPO (the policy and the critic: its values and its loss)."""
    trainer = TRAINERS[name](tiny_model_dir, str(tmp_path))
    batch = generation_batch(trainer)
    if name == "ppo":
        rows = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        critic = trainer.accelerator.unwrap_model(trainer.critic)
        with torch.no_grad():
            packed = trainer._critic_values(critic, rows)
            trainer.prefix_packing.enabled = False
            padded = trainer._critic_values(critic, rows)
            trainer.prefix_packing.enabled = True
        torch.testing.assert_close(packed, padded, rtol=RTOL, atol=LOGP_ATOL)
    assert_same_loss_and_grads(trainer, batch)


def test_step_grpo_runs_equal_padded(tmp_path, tiny_model_dir):
    """StepGRPO's rows (one per prefix-preserving run, or per step): earlier turns are shared prefixes."""
    from trinity_trl.rollouts import CalculatorEnv, calculator_dataset
    from trinity_trl.trainers import StepGRPOConfig, StepGRPOTrainer

    for shared in (True, False):
        args = StepGRPOConfig(
            **tiny_grpo_kwargs(
                output_dir=str(tmp_path / str(shared)), max_env_steps=3, shared_prefix=shared, kl_loss_fn="k2"
            )
        )
        trainer = StepGRPOTrainer(
            model=tiny_model_dir, args=args, train_dataset=calculator_dataset(8), environment_factory=CalculatorEnv
        )
        trainer.model.train()
        rows = [dict(trainer.train_dataset[0]) for _ in range(trainer.num_generations)]
        torch.manual_seed(0)
        batch = trainer._generate_and_score_completions(rows)
        assert_same_loss_and_grads(trainer, batch)


# ------------------------------------------------------------------------------------------ fallbacks
def test_unsupported_models_and_inputs_fall_back_with_one_log_line(tmp_path, tiny_model_dir, caplog):
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    assert "attn_implementation='sdpa'" in unsupported_reason(eager)
    sliding = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, use_sliding_window=True, sliding_window=4, max_window_layers=0
    )
    assert "sliding-window" in unsupported_reason(sliding)
    from transformers import GPT2Config, GPT2LMHeadModel

    assert "not verified" in unsupported_reason(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2)))

    args = TrinityConfig(
        **tiny_grpo_kwargs(output_dir=str(tmp_path), model_init_kwargs={"attn_implementation": "eager"})
    )
    trainer = TrinityTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=conversational_dataset()
    )
    with caplog.at_level(logging.WARNING, logger="trinity_trl"):
        batch = generation_batch(trainer)
        trainer.current_gradient_accumulation_steps = 1
        trainer._compute_loss(trainer.model, batch)
        trainer._compute_loss(trainer.model, batch)
    lines = [r.getMessage() for r in caplog.records if "prefix packing off" in r.getMessage()]
    assert len(lines) == 1 and "'eager'" in lines[0], lines
    assert set(trainer._metrics["train"]["packing/forwarded_token_ratio"]) == {1.0}

    packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext)
    ids, mask, keep = padded_batch([([5, 6], [7])])
    with caplog.at_level(logging.WARNING, logger="trinity_trl"):
        assert (
            packing.logps_and_entropies(eager, ids, mask, keep, None, False, False, {"pixel_values": torch.ones(1)})
            is None
        )
        assert packing.logps_and_entropies(eager, ids, mask, keep, None, False, True, {}) is None
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "multimodal inputs (pixel_values)" in messages and "MoE auxiliary loss" in messages


def test_config_switches_packing_off_and_threshold(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="prefix_packing_max_token_ratio"):
        TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), prefix_packing_max_token_ratio=0.0))
    args = TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), prefix_packing=False))
    trainer = TrinityTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=conversational_dataset()
    )
    assert not trainer.prefix_packing.enabled
    # a batch with nothing to share (one row) packs only if the threshold allows its saving (the padding)
    ids, mask, keep = padded_batch([([5, 6, 7], [8, 9]), ([5, 6, 7, 10], [8])])
    packing = PrefixPacking(True, 0.5, trainer.accelerator.unwrap_model, trainer.accelerator.autocast)
    assert packing.logps_and_entropies(trainer.model, ids, mask, keep, None, False, False, {}) is None
    packing.max_token_ratio = 1.0
    assert packing.logps_and_entropies(trainer.model, ids, mask, keep, None, False, False, {}) is not None


# ------------------------------------------------------------------------------------- two processes
def test_two_processes_packed_equals_padded(tmp_path, tiny_model_dir):
    """Under DDP (2 CPU processes, gloo), each rank's loss and the all-reduced gradients of the packed layout equal
    the padded layout's, for the policy (full fine-tuning and LoRA) and PPO's critic."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    }
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(DIST_SCRIPT),
        tiny_model_dir,
        str(tmp_path),
    ]
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=300, check=False, cwd=Path(__file__).resolve().parents[2]
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    for rank in (0, 1):
        for case in ("trinity", "lora", "ppo"):
            result = torch.load(tmp_path / f"{case}_rank{rank}.pt")
            torch.testing.assert_close(result["packed"]["loss"], result["padded"]["loss"], rtol=RTOL, atol=ATOL)
            assert result["packed"]["grads"].keys() == result["padded"]["grads"].keys()
            for name, grad in result["padded"]["grads"].items():
                torch.testing.assert_close(result["packed"]["grads"][name], grad, rtol=RTOL, atol=ATOL, msg=name)
            assert result["forwarded_token_ratio"] < 0.9
    # DDP averaged the gradients: both ranks hold the same ones
    a, b = (torch.load(tmp_path / f"trinity_rank{r}.pt")["packed"]["grads"] for r in (0, 1))
    for name in a:
        torch.testing.assert_close(a[name], b[name])
