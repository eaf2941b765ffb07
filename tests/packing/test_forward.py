"""Prefix-shared packed forward (`trinity_trl/packing/forward.py`): packed log-probs, loss, gradients equal padded.

Exactness means: the packed layout gives the padded layout's per-token log-probs, entropies, loss and every
parameter gradient, up to float32 rounding (different reduction orders; tolerances derived below with
tests/tolerance.py). Every trainer test computes the same batch twice on the same trainer, `prefix_packing` on and
off. The tests marked `gpu` (`make test-gpu`) do the same on CUDA for every kernel, LoRA and full, Qwen2 and Llama,
and train every trainer 2 steps with packing there.
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
from packing_helpers import (
    GRAD_TERMS,
    LOGP_TERMS,
    assert_bf16_grad_close,
    assert_bf16_logps_close,
    grouped_rows,
    logp_terms,
    long_grouped_rows,
    padded_batch,
)
from peft import LoraConfig
from tolerance import assert_close

from trinity_trl.packing import KERNELS, PackedOutput, PrefixPacking, causal_lm, unsupported_reason
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

LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
SYSTEM = "You are a careful assistant. Answer with the number only."
DIST_SCRIPT = Path(__file__).resolve().parent / "dist_scripts" / "packing_equivalence.py"


# ------------------------------------------------------------------------------------------------ helpers
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
    # the loss and gradients sum terms of order one (ratios times normalised advantages, KL and entropy terms of
    # log-probs); a loss or gradient that cancels to ~0 (equal rewards) is compared at the scale of its terms
    assert_close(loss_packed, loss_padded, terms=GRAD_TERMS, scale=1.0)
    assert grads_packed.keys() == grads_padded.keys() and grads_packed
    scale = max(float(g.abs().max()) for g in grads_padded.values())
    for name in grads_padded:
        assert_close(grads_packed[name], grads_padded[name], terms=GRAD_TERMS, scale=scale, msg=name)


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
    assert_close(packed[0], padded[0], terms=LOGP_TERMS)
    assert_close(packed[1], padded[1], terms=LOGP_TERMS)
    for name, grad in padded[2].items():
        assert_close(packed[2][name], grad, terms=GRAD_TERMS, msg=name)


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
            kl_loss={"name": "k2", "kl_coef": 0.5},
            entropy_loss={"entropy_coef": 0.05},
            temperature=0.8,
        )
    )
    trainer = TrinityTrainer(
        model=model_dir, reward_funcs=length_reward, args=args, train_dataset=conversational_dataset()
    )
    batch = ragged(generation_batch(trainer), trainer._tokenizer.pad_token_id)
    rows = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    trainer.prefix_packing.enabled = False
    behaviour, reference = trainer.scoring.logps(trainer.model, rows), trainer.scoring.reference_logps(rows)
    trainer.prefix_packing.enabled = True
    assert_close(trainer.scoring.logps(trainer.model, rows), behaviour, terms=LOGP_TERMS)
    assert_close(trainer.scoring.reference_logps(rows), reference, terms=LOGP_TERMS)
    batch["old_per_token_logps"] = behaviour + 0.2 * torch.randn(
        behaviour.shape, generator=torch.Generator().manual_seed(0)
    )
    batch["ref_per_token_logps"] = reference
    assert_same_loss_and_grads(trainer, batch)


def test_lora_adapter_and_disabled_adapter_reference_equal_padded(tmp_path, model_dir):
    args = TrinityConfig(
        **tiny_grpo_kwargs(output_dir=str(tmp_path), kl_loss={"name": "low_var_kl", "kl_coef": 0.5}, learning_rate=0.05)
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
    packed_ref = trainer.scoring.reference_logps(rows)
    trainer.prefix_packing.enabled = False
    padded_ref = trainer.scoring.reference_logps(rows)
    trainer.prefix_packing.enabled = True
    assert_close(packed_ref, padded_ref, terms=LOGP_TERMS)
    assert (packed_ref - trainer.scoring.logps(trainer.model, rows)).abs().max() > 1e-3  # adapter really disabled
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
                kl_loss={"name": "k3", "kl_coef": 0.1},
                optim="sgd",
                learning_rate=0.1,
                entropy_loss={"entropy_coef": 0.01},
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
    assert_close(torch.tensor(loss_a), torch.tensor(loss_b), terms=GRAD_TERMS)
    assert_close(torch.tensor(norm_a), torch.tensor(norm_b), terms=GRAD_TERMS)
    for name, w in weights_b.items():
        assert_close(weights_a[name], w, terms=GRAD_TERMS, msg=name)
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
        assert_close(packed, padded, terms=LOGP_TERMS)
    assert_same_loss_and_grads(trainer, batch)


def test_step_grpo_runs_equal_padded(tmp_path, tiny_model_dir):
    """StepGRPO's rows (one per prefix-preserving run, or per step): earlier turns are shared prefixes."""
    from trinity_trl.rollouts import CalculatorEnv, calculator_dataset
    from trinity_trl.trainers import StepGRPOConfig, StepGRPOTrainer

    for shared in (True, False):
        args = StepGRPOConfig(
            **tiny_grpo_kwargs(
                output_dir=str(tmp_path / str(shared)), max_env_steps=3, shared_prefix=shared, kl_loss="k2"
            )
        )
        trainer = StepGRPOTrainer(
            model=tiny_model_dir, args=args, train_dataset=calculator_dataset(8), environment_factory=CalculatorEnv
        )
        trainer.model.train()
        rows = [dict(trainer.train_dataset[0]) for _ in range(trainer.num_generations)]
        torch.manual_seed(0)
        batch = trainer._generate_and_score_completions(rows)
        # the random model earns equal rewards, so its advantages cancel to rounding noise (a loss of ~1e-17): random
        # advantages give gradients of the size real training sees, so the comparison can fail
        batch["advantages"] = torch.randn(batch["advantages"].shape, generator=torch.Generator().manual_seed(0))
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
            assert_close(result["packed"]["loss"], result["padded"]["loss"], terms=GRAD_TERMS)
            assert result["packed"]["grads"].keys() == result["padded"]["grads"].keys()
            for name, grad in result["padded"]["grads"].items():
                assert_close(result["packed"]["grads"][name], grad, terms=GRAD_TERMS, msg=name)
            assert result["forwarded_token_ratio"] < 0.9
    # DDP averaged the gradients: both ranks hold the same ones
    a, b = (torch.load(tmp_path / f"trinity_rank{r}.pt")["packed"]["grads"] for r in (0, 1))
    for name in a:
        assert_close(a[name], b[name])  # the same all-reduced values on both ranks


# ------------------------------------------------------------------------------------------------ CUDA
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA (run by `make test-gpu` on a GPU machine)")
FUSED = ["sdpa_segments", "varlen", "flash_attn", "flex"]


def _cuda_kernel(name: str, dtype: torch.dtype) -> None:
    from trinity_trl.packing import KERNELS

    kernel = KERNELS[name]
    reason = kernel.unavailable(torch.device("cuda")) or kernel.unsupported_dtype(dtype)
    if reason:
        pytest.skip(reason)


def compare_with_padded(
    kernel: str,
    dtype: torch.dtype,
    device: str,
    arch: str = "qwen2",
    peft: bool = False,
    checkpointing: bool = False,
    batch_size: int | None = None,
    monkeypatch=None,
) -> PackedOutput:
    """Log-probs, entropies, the loss and every gradient of TRL's fused-head forward, packed through ``kernel`` (forced,
    or ``"auto"``) on ``device`` vs the padded forward, on rows whose packed tree spans 7 blocks of 128 tokens
    (:func:`long_grouped_rows`: full and partial off-diagonal FlexAttention blocks).

    float32: both sides float32, float32 tolerances. bf16: the packed side in bf16 against the padded forward in
    float32 of the same (bf16-rounded) weights, with the bf16 bounds of :func:`assert_bf16_logps_close` (log-probs and
    entropies) and :func:`assert_bf16_grad_close` (gradients): a wrong kernel fails them (shown on CPU by
    ``test_the_model_comparison_fails_a_wrong_kernel``). ``checkpointing``: activation checkpointing on (TRL's
    default; each layer recomputes its forward, tree mask included, in the backward). ``batch_size``: TRL's forward
    chunk size, so the micro-batch is packed into several rows (asserted)."""
    from peft import get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from trinity_trl.packing import forward as forward_module

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, arch=arch)
    if peft:
        model = get_peft_model(model, copy.deepcopy(LORA))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    model = model.to(device, dtype)
    reference = copy.deepcopy(model).float()  # the same weights (bf16-rounded where dtype is bf16), in float32
    for m in (model, reference):
        add_fused_lm_head(causal_lm(m, lambda x: x), temperature=0.7, outputs=("log_probs", "entropy"))
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    rows = long_grouped_rows(torch.Generator().manual_seed(1), vocab=len(tokenizer))
    ids, mask, keep = padded_batch(rows)
    ids, mask = ids.to(device), mask.to(device)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100
    scored = mask[:, -keep:].bool()
    packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext, kernel, device)
    forwards = []
    if monkeypatch is not None:  # count the packed rows
        original = forward_module.packed_logps
        monkeypatch.setattr(
            forward_module, "packed_logps", lambda *a, **k: forwards.append(a[2].num_tokens) or original(*a, **k)
        )

    def run(m, packed: bool):
        m.zero_grad(set_to_none=True)
        if packed:
            out = packing.logps_and_entropies(m, ids, mask, keep, batch_size, True, False, {})
            assert out is not None, "the packed forward fell back to padded rows"
            logps, entropy = out.logps, out.entropies
        else:
            out = m(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            logps, entropy = out.log_probs[:, -keep:], out.entropy[:, -keep:]
        logps, entropy = logps.float()[scored], entropy.float()[scored]
        (logps.sum() + 0.1 * entropy.sum()).backward()
        grads = {n: p.grad.float().clone() for n, p in m.named_parameters() if p.grad is not None}
        return out, logps.detach(), entropy.detach(), grads

    out, logps, entropy, grads = run(model, True)
    _, want_logps, want_entropy, want_grads = run(reference, False)
    # forwarded tokens: the distinct tokens of the rows, padded to the kernel's block where it pads (flex), and never
    # more than the padded layout (the ratio threshold above is 1.0)
    from trinity_trl.packing import KERNELS, pack_rows

    kernel_used = KERNELS[out.kernel]
    chunks = pack_rows(ids, mask, keep, batch_size * ids.shape[1] if batch_size else None)
    block = kernel_used.pad_multiple
    expected = sum(max(-(-c.num_tokens // block) * block, kernel_used.min_tokens) for c in chunks)
    assert out.forwarded == expected <= out.padded == ids.numel(), (out.forwarded, expected, out.padded)
    if batch_size is not None:
        assert len(chunks) > 1 and len(forwards) == len(chunks), (len(chunks), forwards)
    assert grads.keys() == want_grads.keys() and grads
    terms = logp_terms(max(len(p) + len(c) for p, c in rows))
    if dtype == torch.float32:
        assert_close(logps, want_logps, terms=terms)
        assert_close(entropy, want_entropy, terms=terms)
        for name, grad in want_grads.items():
            assert_close(grads[name], grad, terms=terms * ids.numel(), msg=name)
    else:
        assert_bf16_logps_close(logps, want_logps, msg="log-probs")
        assert_bf16_logps_close(entropy, want_entropy, msg="entropies")
        for name, grad in want_grads.items():
            assert_bf16_grad_close(grads[name], grad, msg=name)
    return out


def test_the_model_comparison_passes_sdpa_segments_on_cpu():
    """The CUDA tests' comparison, run on CPU with the CPU kernel: float32, bf16 with LoRA and activation
    checkpointing, and chunked packing."""
    assert compare_with_padded("sdpa_segments", torch.float32, "cpu").kernel == "sdpa_segments"
    compare_with_padded("sdpa_segments", torch.bfloat16, "cpu", arch="llama", peft=True, checkpointing=True)


def test_the_model_comparison_checks_chunked_packing_on_cpu(monkeypatch):
    compare_with_padded("sdpa_segments", torch.bfloat16, "cpu", batch_size=2, monkeypatch=monkeypatch)


class _PlainCausal(KERNELS["sdpa_segments"].__class__):
    """A deliberately wrong kernel: causal over the whole packed row (earlier branches visible)."""

    def __call__(self, plan, query, key, value, scale):
        query, key, value = (t.to(query.dtype) for t in (query, key, value))
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=True
        )


class _DroppedAncestor(KERNELS["sdpa_segments"].__class__):
    """A deliberately wrong kernel: every non-root node misses the first token of its path (the system prompt's)."""

    def plan(self, packed, device):
        import dataclasses

        segments = [dataclasses.replace(s, ancestors=s.ancestors[1:]) if s.ancestors else s for s in packed.segments]
        return super().plan(dataclasses.replace(packed, segments=segments), device)


@pytest.mark.parametrize("wrong", ["plain causal", "dropped ancestor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_model_comparison_fails_a_wrong_kernel(monkeypatch, dtype, wrong):
    """The same comparison with a deliberately wrong kernel standing in for the CPU kernel: it fails, in bf16 too."""
    monkeypatch.setitem(KERNELS, "sdpa_segments", _PlainCausal() if wrong == "plain causal" else _DroppedAncestor())
    with pytest.raises(AssertionError, match="not close|log-probs|entropies|weight|bias"):  # the values, not a setup
        compare_with_padded("sdpa_segments", dtype, "cpu")


def test_flex_block_padding_counts_against_the_token_ratio(monkeypatch):
    """flex pads the packed row to whole 128-token blocks (2 at least), and the ratio check counts that padding: a
    micro-batch whose 53 distinct tokens pad to 256 (more than its 210 padded tokens) runs padded, by design; one whose
    851 distinct tokens pad to 896 (of 2938) is packed. (The CUDA test used to expect the first one packed.)"""
    from trl.trainer.utils import add_fused_lm_head

    monkeypatch.setattr(KERNELS["flex"], "unavailable", lambda device: None)  # its forward runs on CPU, compiled
    from torch.nn.attention.flex_attention import flex_attention

    from trinity_trl.packing import kernels as kernels_module

    compiled = torch.compile(flex_attention, dynamic=True, backend="aot_eager")
    monkeypatch.setattr(kernels_module, "_compiled_flex", lambda: compiled)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext, "flex", "cpu")
    short = padded_batch(grouped_rows(torch.Generator().manual_seed(1), vocab=len(tokenizer), groups=3))
    long = padded_batch(long_grouped_rows(torch.Generator().manual_seed(1), vocab=len(tokenizer)))
    with torch.no_grad():
        assert short[0].numel() == 210
        assert packing.logps_and_entropies(model, *short, None, False, False, {}) is None
        out = packing.logps_and_entropies(model, *long, None, False, False, {})
    assert out is not None and out.kernel == "flex" and (out.forwarded, out.padded) == (896, 2938)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("kernel", "dtype", "arch", "peft"),
    [(k, d, "qwen2", False) for k in FUSED for d in (torch.float32, torch.bfloat16)]
    + [(k, torch.bfloat16, "llama", True) for k in FUSED],
    ids=lambda v: str(v).removeprefix("torch."),
)
def test_every_kernel_on_cuda_equals_the_padded_forward(kernel, dtype, arch, peft):
    """Every kernel on CUDA, float32 where it runs in float32 and bf16, Qwen2 full and Llama LoRA (see
    :func:`compare_with_padded`)."""
    _cuda_kernel(kernel, dtype)
    assert compare_with_padded(kernel, dtype, "cuda", arch=arch, peft=peft).kernel == kernel


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", ["varlen", "flash_attn", "flex"])
def test_kernels_on_cuda_with_activation_checkpointing_and_chunked_packing(kernel, monkeypatch):
    """TRL's default activation checkpointing (the layers recompute their forward in the backward, the plan in their
    keyword arguments) and chunked packing (TRL's forward batch size below the micro-batch: several packed rows),
    bf16."""
    _cuda_kernel(kernel, torch.bfloat16)
    compare_with_padded(kernel, torch.bfloat16, "cuda", checkpointing=True)
    compare_with_padded(kernel, torch.bfloat16, "cuda", batch_size=2, monkeypatch=monkeypatch)


@pytest.mark.gpu
@needs_cuda
def test_auto_on_cuda_picks_a_fused_kernel_and_equals_the_padded_forward():
    """``prefix_packing_kernel="auto"`` on CUDA in bf16: a fused kernel (never the per-node one); the forced kernel
    equals the padded forward; and 4 training forwards under ``auto`` (its measurement running) each run packed through
    that kernel and equal the padded forward, or run padded. (Its timing decisions are tested on CPU with an injected
    timer.)"""
    from trl.trainer.utils import add_fused_lm_head

    from trinity_trl.packing import choose

    choice = choose("auto", torch.device("cuda"), torch.bfloat16)
    if choice.kernel is None:
        pytest.skip(choice.reason)
    assert choice.kernel.name in ("varlen", "flash_attn", "flex")
    assert compare_with_padded(choice.kernel.name, torch.bfloat16, "cuda").kernel == choice.kernel.name

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer).to("cuda", torch.bfloat16)
    reference = copy.deepcopy(model).float()
    for m in (model, reference):
        add_fused_lm_head(m, temperature=0.7, outputs=("log_probs", "entropy"))
    ids, mask, keep = padded_batch(long_grouped_rows(torch.Generator().manual_seed(1), vocab=len(tokenizer)))
    ids, mask = ids.to("cuda"), mask.to("cuda")
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100
    scored = mask[:, -keep:].bool()
    want = reference(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -keep:]
    packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext, "auto", "cuda")
    kernels = []
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        out = packing.logps_and_entropies(model, ids, mask, keep, None, True, False, {})
        if out is None:  # padded this time (a measurement, or the verdict): TRL's forward runs
            logps = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -keep:]
        else:
            kernels.append(out.kernel)
            logps = out.logps
        assert_bf16_logps_close(logps.float()[scored], want.float()[scored].detach(), msg="log-probs")
        logps.float()[scored].sum().backward()
    assert set(kernels) <= {choice.kernel.name}, kernels


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["chord", "cispo", "sapo", "ppo", "step_grpo"])
def test_every_trainer_trains_two_steps_with_packing_on_cuda(tmp_path, tiny_model_dir, name):
    """CHORD, CISPO, SAPO, PPO (policy and critic) and StepGRPO, bf16 on CUDA, packing forced onto the first fused
    kernel available: 2 optimizer steps, finite losses, and the forwards were packed."""
    from trinity_trl.packing import KERNELS

    kernel = next(
        (k for k in ("varlen", "flash_attn", "flex") if KERNELS[k].unavailable(torch.device("cuda")) is None), None
    )
    if kernel is None:
        pytest.skip("no fused tree-attention kernel on this machine")
    # bf16, with TRL's default activation checkpointing
    cuda = {"use_cpu": False, "bf16": True, "prefix_packing_kernel": kernel, "activation_checkpointing": True}
    if name == "step_grpo":
        from trinity_trl.rollouts import CalculatorEnv, calculator_dataset
        from trinity_trl.trainers import StepGRPOConfig, StepGRPOTrainer

        trainer = StepGRPOTrainer(
            model=tiny_model_dir,
            args=StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), max_env_steps=2, **cuda)),
            train_dataset=calculator_dataset(8),
            environment_factory=CalculatorEnv,
        )
    else:
        trainer = CUDA_TRAINERS[name](tiny_model_dir, str(tmp_path), cuda)
    trainer.train()
    logs = trainer.state.log_history
    losses = [e["loss"] for e in logs if "loss" in e]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    ratios = [e["packing/forwarded_token_ratio"] for e in logs if "packing/forwarded_token_ratio" in e]
    assert ratios and min(ratios) < 1.0, ratios  # packed forwards ran


CUDA_TRAINERS = {
    "chord": lambda d, o, c: ChordTrainer(
        model=d,
        reward_funcs=length_reward,
        train_dataset=conversational_dataset(),
        expert_dataset=_expert_dataset(),
        args=ChordConfig(**tiny_grpo_kwargs(output_dir=o, expert_batch_size=2, mu_peak=0.5, mu_valley=0.5, **c)),
    ),
    "cispo": lambda d, o, c: CISPOTrainer(
        model=d,
        reward_funcs=length_reward,
        train_dataset=conversational_dataset(),
        args=CISPOConfig(**tiny_grpo_kwargs(output_dir=o, **c)),
    ),
    "sapo": lambda d, o, c: SAPOTrainer(
        model=d,
        reward_funcs=length_reward,
        train_dataset=conversational_dataset(),
        args=SAPOConfig(**tiny_grpo_kwargs(output_dir=o, **c)),
    ),
    "ppo": lambda d, o, c: PPOTrainer(
        model=d,
        reward_funcs=length_reward,
        train_dataset=conversational_dataset(),
        args=PPOConfig(**tiny_grpo_kwargs(output_dir=o, **c)),
    ),
}
