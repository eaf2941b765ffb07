"""bf16 (and fp16) on CPU: every trainer trains, the loss maths stays float32, and one step's loss is the float32 one.

`bf16=True` with `use_cpu=True` makes Accelerate run the forward passes under `torch.autocast("cpu", bfloat16)`
(matrix products in bf16, the weights and optimizer in float32). TRL's fused LM head computes the per-token
log-probabilities and entropies in float32 (`trl/trainer/grpo_trainer.py`: `lm_head.float()`), so the policy, KL,
entropy and value losses see float32 log-probs, ratios and advantages, as TRL's own loss does; SFT and DPO get their
log-probs from the same head. Each test trains the same first batch twice, in float32 and in bf16 (generation
replaced by fixed completions, so both runs train on the same rows), and checks:

* the forward ran in bf16 (a decoder projection's output is bfloat16) and the loss inputs were float32;
* step 1's logged loss is within 1e-2 relative + 1e-3 absolute of the float32 loss (bf16 keeps 8 bits of mantissa:
  relative errors of 4e-3 per product; observed differences: below 1e-3 relative);
* training goes on: step 2 is finite.

`fp16=True` on a CPU is rejected by every config: Accelerate 1.15 enables fp16 autocast and its gradient scaler only
on GPU-like devices, so the run would silently stay float32. PPOConfig rejects fp16 on any device: one loss scaler
cannot serve the policy's and the critic's optimizers (on GPUs Accelerate's scaler would unscale only the policy's).
"""

from __future__ import annotations

import re

import pytest
import torch
from datasets import Dataset
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs

import trinity_trl.trainers.trinity_loss as trinity_module
from trinity_trl.trainers import (
    ChordConfig,
    ChordTrainer,
    CISPOConfig,
    CISPOTrainer,
    PPOConfig,
    PPOTrainer,
    SAPOConfig,
    SAPOTrainer,
    StepGRPOConfig,
    StepGRPOTrainer,
    TrinityConfig,
    TrinityDPOConfig,
    TrinityDPOTrainer,
    TrinitySFTConfig,
    TrinitySFTTrainer,
    TrinityTrainer,
)

LOSS_RTOL, LOSS_ATOL = 1e-2, 1e-3
PROMPT_RE = re.compile(r"What is (\d+)\+(\d+)\?")


def fixed_rollouts(prompts, trainer):
    """Generation k of "What is a+b?" is a fixed text of k-dependent length: the same rows in every run."""
    tokenizer = trainer.processing_class
    seen: dict[str, int] = {}
    prompt_ids, completion_ids = [], []
    for messages in prompts:
        content = messages[-1]["content"]
        k = seen[content] = seen.get(content, -1) + 1
        a, b = map(int, PROMPT_RE.fullmatch(content).groups())
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        answer = f"The answer is {a + b + k}." + " so" * k
        completion_ids.append(tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "logprobs": [[0.0] * len(ids) for ids in completion_ids],
    }


def rl_kwargs(tmp_path, precision: str, **extra):
    kwargs = tiny_grpo_kwargs(
        output_dir=str(tmp_path / precision),
        max_completion_length=16,
        disable_tqdm=True,
        entropy_loss={"entropy_coef": 0.01},
        **extra,
    )
    kwargs["bf16"], kwargs["fp16"] = precision == "bf16", precision == "fp16"
    return kwargs


def expert_rows():
    return Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": f"What is {a}+{b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
                ]
            }
            for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]
        ]
    )


class CountingEnv:
    """Run k of task t lasts 1 + (t + k) % 2 turns and ends with reward k / 4."""

    counter: dict[int, int] = {}

    def reset(self, task_id, **row):
        self.k = CountingEnv.counter.get(task_id, 0)
        CountingEnv.counter[task_id] = self.k + 1
        self.length, self.turn = 1 + (task_id + self.k) % 2, 0
        return f"Task {task_id}: play."

    def step(self, action):
        from trinity_trl.rollouts import StepResult

        self.turn += 1
        if self.turn >= self.length:
            return StepResult("Over.", reward=self.k / 4, done=True)
        return StepResult(f"Turn {self.turn}.", reward=0.0)


def build(name: str, tmp_path, model_dir: str, precision: str):
    data = {
        "reward_funcs": length_reward,
        "train_dataset": tiny_conversational_dataset(4),
        "rollout_func": fixed_rollouts,
    }
    if name == "trinity":
        args = TrinityConfig(algorithm="grpo", kl_loss={"name": "k2", "kl_coef": 0.1}, **rl_kwargs(tmp_path, precision))
        return TrinityTrainer(model=model_dir, args=args, **data)
    if name == "chord":
        args = ChordConfig(expert_batch_size=2, **rl_kwargs(tmp_path, precision))
        return ChordTrainer(model=model_dir, args=args, expert_dataset=expert_rows(), **data)
    if name == "cispo":
        return CISPOTrainer(model=model_dir, args=CISPOConfig(**rl_kwargs(tmp_path, precision)), **data)
    if name == "sapo":
        return SAPOTrainer(model=model_dir, args=SAPOConfig(**rl_kwargs(tmp_path, precision)), **data)
    if name == "ppo":
        return PPOTrainer(model=model_dir, args=PPOConfig(**rl_kwargs(tmp_path, precision)), **data)
    if name == "step_grpo":
        CountingEnv.counter.clear()
        args = StepGRPOConfig(max_env_steps=2, **rl_kwargs(tmp_path, precision))
        trainer = StepGRPOTrainer(
            model=model_dir,
            args=args,
            train_dataset=Dataset.from_dict({"task_id": [0, 1]}),
            environment_factory=CountingEnv,
        )
        tokenizer = trainer.processing_class

        def generate(prompt_ids, images, multimodal_fields, num_generations, **kwargs):
            texts = [f"Guess {len(p) % 10} now" for p in prompt_ids]
            return [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts], None

        trainer._generate_single_turn = generate
        return trainer
    common = {
        "output_dir": str(tmp_path / precision),
        "use_cpu": True,
        "bf16": precision == "bf16",
        "activation_checkpointing": False,
        "per_device_train_batch_size": 4,
        "max_steps": 2,
        "max_length": 64,
        "learning_rate": 1e-3,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "seed": 0,
        "disable_tqdm": True,
    }
    rows = [(a, b) for a in range(1, 5) for b in range(1, 3)]
    if name == "sft":
        dataset = Dataset.from_dict(
            {
                "prompt": [[{"role": "user", "content": f"What is {a}+{b}?"}] for a, b in rows],
                "completion": [
                    [{"role": "assistant", "content": "The answer is" + " so" * (a % 3) + f" {a + b}."}]
                    for a, b in rows
                ],
            }
        )
        return TrinitySFTTrainer(model=model_dir, args=TrinitySFTConfig(**common), train_dataset=dataset)
    if name == "dpo":
        dataset = Dataset.from_dict(
            {
                "prompt": [f"What is {a}+{b}?" for a, b in rows],
                "chosen": [f" The answer is {a + b}." for a, b in rows],
                "rejected": [" I think it is" + " more" * (b % 3) + f" {a * b + 1}" for a, b in rows],
            }
        )
        return TrinityDPOTrainer(model=model_dir, args=TrinityDPOConfig(**common), train_dataset=dataset)
    raise ValueError(name)


def train_recording_dtypes(trainer, monkeypatch) -> tuple[list[float], dict[str, torch.dtype], torch.dtype]:
    """Train; return the logged losses, the dtypes of the loss inputs and the dtype of a decoder projection's
    output (what the forward computed in)."""
    seen: dict[str, torch.dtype] = {}
    if getattr(trainer, "components", None) is not None:  # TrinityTrainer and subclasses: a micro-batch's loss inputs
        original = trinity_module.micro_batch_loss

        def recording(policy_loss, components, normalizer, agg, inputs, loss_inputs, entropies, mask):
            seen.update({k: v.dtype for k, v in loss_inputs.items() if torch.is_tensor(v) and v.is_floating_point()})
            if entropies is not None:
                seen["entropy"] = entropies.dtype
            return original(policy_loss, components, normalizer, agg, inputs, loss_inputs, entropies, mask)

        monkeypatch.setattr(trinity_module, "micro_batch_loss", recording)
        if hasattr(trainer, "critic"):
            import trinity_trl.trainers.ppo_trainer as ppo_module

            value_loss = ppo_module.clipped_value_loss

            def recording_values(values, old_values, returns, *args, **kwargs):
                seen.update(values=values.dtype, old_values=old_values.dtype, returns=returns.dtype)
                return value_loss(values, old_values, returns, *args, **kwargs)

            monkeypatch.setattr(ppo_module, "clipped_value_loss", recording_values)
    else:  # SFT / DPO: the library loss's inputs
        evaluate = trainer.policy_loss.evaluate

        def recording_evaluate(**kwargs):
            seen.update({k: v.dtype for k, v in kwargs.items() if torch.is_tensor(v) and v.is_floating_point()})
            return evaluate(**kwargs)

        trainer.policy_loss.evaluate = recording_evaluate
    forward_dtype = []
    projection = trainer.accelerator.unwrap_model(trainer.model).get_decoder().layers[0].self_attn.q_proj
    handle = projection.register_forward_hook(lambda module, args, output: forward_dtype.append(output.dtype))
    try:
        trainer.train()
    finally:
        handle.remove()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, seen, forward_dtype[-1]


TRAINERS = ("trinity", "chord", "cispo", "sapo", "step_grpo", "ppo", "sft", "dpo")


@pytest.mark.parametrize("name", TRAINERS)
def test_bf16_trains_with_float32_loss_maths_and_the_float32_loss(name, tmp_path, tiny_model_dir, monkeypatch):
    fp32_losses, fp32_dtypes, fp32_forward = train_recording_dtypes(
        build(name, tmp_path, tiny_model_dir, "fp32"), monkeypatch
    )
    trainer = build(name, tmp_path, tiny_model_dir, "bf16")
    assert trainer.accelerator.mixed_precision == "bf16"
    bf16_losses, bf16_dtypes, bf16_forward = train_recording_dtypes(trainer, monkeypatch)
    assert fp32_forward == torch.float32 and bf16_forward == torch.bfloat16
    assert bf16_dtypes and set(bf16_dtypes.values()) == {torch.float32}, bf16_dtypes
    assert bf16_dtypes.keys() == fp32_dtypes.keys()
    assert len(bf16_losses) == len(fp32_losses) == 2 and all(map(torch.isfinite, torch.tensor(bf16_losses)))
    assert abs(fp32_losses[0]) > 1e-3  # a loss worth comparing
    assert bf16_losses[0] == pytest.approx(fp32_losses[0], rel=LOSS_RTOL, abs=LOSS_ATOL)


@pytest.mark.parametrize(
    "config_class",
    (
        TrinityConfig,
        ChordConfig,
        CISPOConfig,
        SAPOConfig,
        StepGRPOConfig,
        PPOConfig,
        TrinitySFTConfig,
        TrinityDPOConfig,
    ),
)
def test_fp16_on_a_cpu_is_rejected_with_the_reason(tmp_path, config_class):
    with pytest.raises(ValueError, match=r"fp16=True does nothing on a CPU \(Accelerate runs fp16 only on GPUs"):
        config_class(output_dir=str(tmp_path), use_cpu=True, fp16=True, report_to="none")


def test_ppo_rejects_fp16_on_any_device(tmp_path, monkeypatch):
    import trinity_trl.trainers.machine as machine

    monkeypatch.setattr(machine, "accelerator_available", lambda: True)  # as on a GPU machine, where fp16 runs
    with pytest.raises(ValueError, match="fp16 is not supported.*loss scaler serves one optimizer.*critic"):
        PPOConfig(output_dir=str(tmp_path), fp16=True, report_to="none")
