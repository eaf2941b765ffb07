"""Train trinity_trl trainers for a few steps under whatever engine the launcher set up; record what each rank saw.

Launched by `tests/engines/test_engines.py` with `accelerate launch --config_file recipes/accelerate/<engine>.yaml
--num_processes 2 --mixed_precision no engine_run.py ...` (the shipped configs, on CPU: every config sets
`use_cpu=True`, which gives gloo). One launch plays every case named on the command line in turn, so the two Python
start-ups (about 10 s on this machine) are paid once per engine.

Each RL case trains `--steps` optimizer steps with TRL's real sampling generation. `num_iterations=2`, so a
generation batch is trained on for two steps: step 1's rows come from the weights read from disk (the same for every
engine) and step 2 trains on the same rows after one update, so both steps' losses are comparable across engines.
SFT and DPO train on fixed rows. With
`--save_steps` a checkpoint is written; `--resume` picks the last complete one (`resume_from_checkpoint=True`).

Cases (see `build`):
  trinity_full  TrinityTrainer, full fine-tuning, k2 KL loss against TRL's reference model
  chord_lora    ChordTrainer (mix_chord) with LoRA, expert rows, k2 KL loss (reference = adapter disabled)
  distill       TrinityTrainer(algorithm="on_policy_distill") with a teacher model
  cispo         CISPOTrainer, full fine-tuning
  sapo          SAPOTrainer with LoRA
  step_grpo     StepGRPOTrainer on the number-guessing environment (2 turns at most: generation per turn)
  ppo           PPOTrainer, full fine-tuning, value model from the policy's checkpoint
  ppo_lora      PPOTrainer with LoRA on the policy and the critic
  ppo_warmup    ppo_lora with one critic warm-up step (refused under DeepSpeed: the case records the refusal)
  sft           TrinitySFTTrainer (sft_phi), full fine-tuning, fixed data
  dpo           TrinityDPOTrainer (dpo + k2 KL against TRL's reference model), full fine-tuning, fixed data

For each case it writes `<out>/<case>_rank<R>.pt` (plain tensors, lists, numbers and strings): `engine`
(distributed type, ZeRO stage, FSDP version, world size), `logs` (the per-step log dicts), `completions` (the
completion ids of every generation batch of this rank), `accuracy` and `eval_completions` (the recipes'
`held_out_accuracy` before and after training, and the greedy completions it scored), and on rank 0 `weights`
and `weights_step_2` (the full trained parameters at the end and after step 2, gathered from every rank: LoRA
adapter, or the whole model), `critic` and `critic_step_2` (PPO's value model) and `checkpoints` (what the output
folder holds). A case the trainer refuses under this engine writes `{"refused": message}` instead.

Usage: engine_run.py MODEL_DIR OUT_DIR CASE [CASE ...] [--steps N] [--save_steps K] [--resume] [--teacher DIR]
       [--no_cpu_fsdp] [--bf16]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# tests/ on sys.path for `helpers` (this file is tests/engines/scripts/engine_run.py)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

import torch  # noqa: E402
from cpu_fsdp import enable_fsdp_on_cpu  # noqa: E402
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

CASES = (
    "trinity_full",
    "chord_lora",
    "distill",
    "cispo",
    "sapo",
    "step_grpo",
    "ppo",
    "ppo_lora",
    "ppo_warmup",
    "sft",
    "dpo",
)


def lora():
    from peft import LoraConfig

    return LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"
    )


def expert_dataset():
    from datasets import Dataset

    return Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": f"What is {a}+{b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
                ]
            }
            for a, b in [(5, 1), (6, 2), (7, 3), (8, 4), (9, 5), (3, 3), (2, 7), (4, 4)]
        ]
    )


def build(
    case: str,
    model_dir: str,
    out: str,
    steps: int,
    save_steps: int | None,
    teacher_dir: str | None = None,
    bf16: bool = False,
):
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
        TrinityTrainer,
    )

    if case in ("sft", "dpo"):
        return build_sft_dpo(case, model_dir, out, steps, save_steps, bf16)

    common = tiny_grpo_kwargs(
        output_dir=out,
        max_steps=steps,
        num_iterations=2,
        max_completion_length=8,
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        num_generations=4,
        shuffle_dataset=False,
        save_strategy="steps" if save_steps else "no",
        **({"save_steps": save_steps} if save_steps else {}),
    )
    common["bf16"] = bf16
    data = {"reward_funcs": length_reward, "train_dataset": tiny_conversational_dataset(16)}
    kl = {"kl_loss": {"name": "k2", "kl_coef": 0.1}}
    if case == "trinity_full":
        return TrinityTrainer(model=model_dir, args=TrinityConfig(algorithm="grpo", **kl, **common), **data)
    if case == "chord_lora":
        args = ChordConfig(algorithm="mix_chord", expert_batch_size=2, **kl, **common)
        return ChordTrainer(model=model_dir, args=args, expert_dataset=expert_dataset(), peft_config=lora(), **data)
    if case == "distill":
        args = TrinityConfig(algorithm="on_policy_distill", **common)
        if teacher_dir is None:
            raise ValueError(
                "the distill case needs --teacher (a model other than the student: the same weights give "
                "zero advantages)"
            )
        return TrinityTrainer(model=model_dir, args=args, teacher_model=teacher_dir, **data)
    if case == "cispo":
        return CISPOTrainer(model=model_dir, args=CISPOConfig(**common), **data)
    if case == "sapo":
        return SAPOTrainer(model=model_dir, args=SAPOConfig(**common), peft_config=lora(), **data)
    if case == "step_grpo":
        from trinity_trl.rollouts import NumberGuessEnv, number_guess_dataset

        args = StepGRPOConfig(max_env_steps=2, **common)
        return StepGRPOTrainer(
            model=model_dir,
            args=args,
            train_dataset=number_guess_dataset(16),
            environment_factory=lambda: NumberGuessEnv(partial_credit=True),
        )
    if case in ("ppo", "ppo_lora", "ppo_warmup"):
        warmup = {"critic_warmup_steps": 1} if case == "ppo_warmup" else {}
        args = PPOConfig(value_learning_rate=1e-2, **warmup, **common)
        return PPOTrainer(model=model_dir, args=args, peft_config=lora() if case != "ppo" else None, **data)
    raise ValueError(f"unknown case {case!r}; choose from {CASES}")


def build_sft_dpo(case: str, model_dir: str, out: str, steps: int, save_steps: int | None, bf16: bool):
    """TrinitySFTTrainer (sft_phi loss) or TrinityDPOTrainer (dpo + k2 KL, TRL's reference model), full
    fine-tuning, on fixed data: every step is comparable across engines."""
    from datasets import Dataset

    from trinity_trl.trainers import TrinityDPOConfig, TrinityDPOTrainer, TrinitySFTConfig, TrinitySFTTrainer

    common = {
        "output_dir": out,
        "use_cpu": True,
        "bf16": bf16,
        "activation_checkpointing": False,
        "max_steps": steps,
        "max_length": 64,
        "learning_rate": 1e-3,
        "report_to": "none",
        "logging_steps": 1,
        "seed": 0,
        "disable_tqdm": True,
        "ddp_find_unused_parameters": False,
        "save_strategy": "steps" if save_steps else "no",
        **({"save_steps": save_steps} if save_steps else {}),
    }
    rows = [(a, b) for a in range(1, 9) for b in range(1, 5)]
    if case == "sft":
        dataset = Dataset.from_dict(
            {
                "prompt": [[{"role": "user", "content": f"What is {a}+{b}?"}] for a, b in rows],
                "completion": [
                    [{"role": "assistant", "content": "The answer is" + " so" * (a % 3) + f" {a + b}."}]
                    for a, b in rows
                ],
            }
        )
        args = TrinitySFTConfig(policy_loss="sft_phi", per_device_train_batch_size=4, **common)
        return TrinitySFTTrainer(model=model_dir, args=args, train_dataset=dataset)
    dataset = Dataset.from_dict(
        {
            "prompt": [f"What is {a}+{b}?" for a, b in rows],
            "chosen": [f" The answer is {a + b}." for a, b in rows],
            "rejected": [" I think it is" + " more" * (b % 3) + f" {a * b + 1}" for a, b in rows],
        }
    )
    args = TrinityDPOConfig(per_device_train_batch_size=2, kl_loss={"kl_coef": 0.1}, **common)
    return TrinityDPOTrainer(model=model_dir, args=args, train_dataset=dataset)


def recording(trainer):
    """Record the completion ids of every generation batch (this rank's rows, unpadded) without changing them
    (trainers without generation: nothing)."""
    completions: list[list[list[int]]] = []
    if not hasattr(trainer, "_generate_and_score_completions"):
        return completions
    generate = trainer._generate_and_score_completions

    def wrapped(inputs):
        output = generate(inputs)
        ids, mask = output["completion_ids"], output["completion_mask"]
        completions.append([row[m.bool()].tolist() for row, m in zip(ids, mask)])
        return output

    trainer._generate_and_score_completions = wrapped
    return completions


def held_out(trainer, label: str) -> tuple[float, list[str]]:
    """The recipes' `held_out_accuracy` (TRL's `unwrap_model_for_generation`: ZeRO-3 parameters gathered), with
    the greedy completions it scored on this rank."""
    import trinity_trl.recipes.common as recipe_common
    from trinity_trl.recipes.common import RecipeArguments, held_out_accuracy

    seen: list[str] = []
    evaluate = recipe_common.evaluate_accuracy

    def capturing(*args, **kwargs):
        accuracy, completions = evaluate(*args, **kwargs, return_completions=True)
        seen.extend(completions)
        return accuracy

    recipe_common.evaluate_accuracy = capturing
    try:
        args = RecipeArguments(eval_batch_size=4, eval_max_new_tokens=6, plot=False)
        accuracy = held_out_accuracy(trainer, tiny_conversational_dataset(8), args, label)
    finally:
        recipe_common.evaluate_accuracy = evaluate
    return accuracy, seen


def full_trained_weights(trainer) -> dict[str, torch.Tensor]:
    """Every trainable parameter of the policy, full (gathered from every rank), keyed by its name in the unwrapped
    model; collective: every rank must call it."""
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    trainable = {name for name, p in unwrapped.named_parameters() if p.requires_grad}
    if not trainer.accelerator.is_main_process:
        return {}
    return {k: v.detach().float().cpu().clone() for k, v in state.items() if k in trainable}


class WeightsAt(TrainerCallback):
    """Gather the trained weights (and PPO's critic) at the end of optimizer step ``step`` (every rank takes part)."""

    def __init__(self, trainer, step: int):
        self.trainer, self.step, self.weights, self.critic = trainer, step, None, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.weights = full_trained_weights(self.trainer)
            if hasattr(self.trainer, "critic_state_dict"):
                self.critic = _cpu(self.trainer.critic_state_dict())


def _cpu(state: dict) -> dict:
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def sharded(model) -> bool | None:
    """Whether every parameter of ``model`` is a shard: a ZeRO-3 partitioned parameter or an FSDP2 DTensor
    (``None`` without a model)."""
    if model is None:
        return None
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    return bool(params) and all(hasattr(p, "ds_id") or isinstance(p, DTensor) for p in params)


def engine_of(trainer) -> dict:
    state = trainer.accelerator.state
    plugin = getattr(state, "deepspeed_plugin", None)
    fsdp = getattr(state, "fsdp_plugin", None)
    return {
        "distributed_type": str(state.distributed_type.value),
        "world": state.num_processes,
        "mixed_precision": trainer.accelerator.mixed_precision,
        "bf16": bool(plugin.deepspeed_config.get("bf16", {}).get("enabled")) if plugin is not None else None,
        "zero_stage": plugin.zero_stage if plugin is not None else None,
        "fsdp_version": fsdp.fsdp_version if fsdp is not None else None,
        "model_class": type(trainer.model_wrapped).__name__,
        "sharded": {
            "policy": sharded(trainer.model_wrapped),
            "reference": sharded(getattr(trainer, "ref_model", None)),
            "teacher": sharded(getattr(trainer, "teacher_model", None)),
            "critic": sharded(getattr(trainer, "critic", None)),
        },
    }


def run(case: str, options: argparse.Namespace) -> None:
    out_dir, resume = options.out_dir, options.resume
    torch.manual_seed(0)
    try:
        trainer = build(
            case,
            options.model_dir,
            os.path.join(out_dir, case),
            options.steps,
            options.save_steps,
            options.teacher,
            options.bf16,
        )
    except ValueError as err:  # a refused combination: every rank refuses alike
        if "not supported under DeepSpeed" not in str(err):
            raise
        rank = int(os.environ.get("RANK", "0"))
        torch.save({"refused": str(err)}, os.path.join(out_dir, f"{case}_rank{rank}.pt"))
        return
    completions = recording(trainer)
    at_step_2 = WeightsAt(trainer, 2)
    trainer.add_callback(at_step_2)
    record: dict = {"engine": engine_of(trainer), "accuracy": {}, "eval_completions": {}}
    if not resume:
        record["accuracy"]["before"], record["eval_completions"]["before"] = held_out(trainer, "before")
    trainer.train(resume_from_checkpoint=True if resume else None)
    record["engine"] = engine_of(trainer)  # DeepSpeed wraps the model when training starts
    record["accuracy"]["after"], record["eval_completions"]["after"] = held_out(trainer, "after")
    record["logs"] = [h for h in trainer.state.log_history if "loss" in h]
    record["completions"] = completions
    record["weights"] = full_trained_weights(trainer)
    record["weights_step_2"] = at_step_2.weights
    if hasattr(trainer, "critic_state_dict"):
        record["critic"] = _cpu(trainer.critic_state_dict())
        record["critic_step_2"] = at_step_2.critic
    main = trainer.accelerator.is_main_process
    record["checkpoints"] = sorted(os.listdir(os.path.join(out_dir, case))) if main else []
    rank = trainer.accelerator.process_index
    torch.save(record, os.path.join(out_dir, f"{case}_rank{rank}.pt"))
    del trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("cases", nargs="+", choices=CASES)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--save_steps", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--teacher", default=None, help="teacher model of the distill case")
    parser.add_argument("--bf16", action="store_true", help="bf16=True (launch with --mixed_precision bf16)")
    parser.add_argument(
        "--no_cpu_fsdp",
        action="store_true",
        help="leave Accelerate's choice for FSDP on CPU processes (MULTI_CPU), which trainers refuse",
    )
    options = parser.parse_args()
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not options.no_cpu_fsdp:
        enable_fsdp_on_cpu()
    torch.set_num_threads(1)
    for case in options.cases:
        run(case, options)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # without this, rank 0 aborts at exit with SIGABRT (notes/TRL_1_16.md §7)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
