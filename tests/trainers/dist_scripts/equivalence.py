"""One optimizer step of a trinity_trl trainer on a fixed global batch; records what each rank saw.

Run by `tests/trainers/test_distributed.py`, either as `python equivalence.py ...` (1 process) or as
`python -m torch.distributed.run --standalone --nproc_per_node 2 equivalence.py ...` (2 processes), with the same
arguments. The global batch is the same in both runs:

* 2 prompts x `num_generations=4` = 8 rollouts per step. World 1 uses `per_device_train_batch_size=8`, world 2 uses
  4, so `generation_batch_size=8` in both; `RepeatSampler` yields the same 8 rows and accelerate hands rank 0 the
  first contiguous half (prompt 0's group) and rank 1 the second (prompt 1's group).
* Generation is replaced by a deterministic `rollout_func`: the completion of generation `k` of a prompt
  "What is a+b?" is a fixed text built from `(a, b, k)`, so rewards differ within a group.
* CHORD: `expert_batch_size = 4 // world`, so both runs draw the same 4 rows of the one global expert stream.

For each case it writes `<out>/<case>_world<W>_rank<R>.pt` holding, per rank:
`rollouts`/`experts` (lists of `{"prompt_ids", "completion_ids", "advantages"}`, unpadded, in this rank's order),
`losses` (the value `_compute_loss` returned, one per micro-batch), `grad` (every parameter's gradient after the
backward of the step, flattened and concatenated in `named_parameters()` order: after DDP's all-reduce, before the
optimizer step; clipping is disabled) and `grad_norm`.

Usage: equivalence.py MODEL_DIR OUT_DIR CASE [CASE ...]
(CASE in grpo, grpo_refill, reinforceplusplus, cispo_global, cispo_micro, sapo, chord, step_grpo)
"""

from __future__ import annotations

import os
import re
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# tests/ on sys.path for `helpers` (this file is tests/trainers/dist_scripts/equivalence.py)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore", category=FutureWarning)

import torch
from helpers import completion_text, recording, tiny_conversational_dataset, tiny_grpo_kwargs
from transformers import TrainerCallback

from trinity_trl.trainers import (
    ChordConfig,
    ChordTrainer,
    SAPOConfig,
    SAPOTrainer,
    TrinityConfig,
    TrinityTrainer,
)

GLOBAL_ROLLOUTS = 8  # 2 prompts x 4 generations
NUM_GENERATIONS = 4
GLOBAL_EXPERT_ROWS = 4
PROMPT_RE = re.compile(r"What is (\d+)\+(\d+)\?")


def completion_for(a: int, b: int, k: int, ragged: bool) -> str:
    """Completion text of generation `k` of the prompt "What is a+b?".

    The number `a·k² + k + b` makes the rewards of the two groups follow different patterns (1, 3, 7, 13 for
    prompt 1+1 and 1, 4, 11, 22 for 2+1), so advantages sliced from the wrong group would not match.
    `ragged=False`: every completion has the same number of tokens (only its last digit is kept; the tokenizer
    splits digits). `ragged=True`: generation k of prompt a gets `k + 3(a-1)` extra words, so rank 1 (prompt a=2)
    has longer completions than rank 0 (a=1) and the per-process padded widths differ.
    """
    number = a * k * k + k + b
    if not ragged:
        return f"The answer is {number % 10}."
    return f"The answer is {number}." + " yes" * (k + 3 * (a - 1))


def make_rollout_func(ragged: bool):
    def rollout_func(prompts, trainer):
        tokenizer = trainer.processing_class
        seen: dict[str, int] = {}
        prompt_ids, completion_ids, logprobs = [], [], []
        for messages in prompts:
            content = messages[-1]["content"]
            k = seen.get(content, 0)  # generation index within this prompt's group
            seen[content] = k + 1
            a, b = map(int, PROMPT_RE.fullmatch(content).groups())
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt_ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            ids = tokenizer(completion_for(a, b, k, ragged), add_special_tokens=False)["input_ids"]
            ids = ids + [tokenizer.eos_token_id]
            completion_ids.append(ids)
            logprobs.append([0.0] * len(ids))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    return rollout_func


def digit_reward(completions, **kwargs):
    """Sum of the digits in the completion / 10, plus its length / 100: differs within every group here."""
    out = []
    for c in completions:
        text = completion_text(c)
        out.append(sum(int(d) for d in re.findall(r"\d", text)) / 10.0 + len(text) / 100.0)
    return out


def flat_first_group_reward(prompts, completions, **kwargs):
    """0.5 for every completion of the prompt "What is 1+1?" (a group with zero spread), digit_reward elsewhere."""
    digits = digit_reward(completions)
    return [0.5 if "1+1" in prompt[-1]["content"] else d for prompt, d in zip(prompts, digits)]


def _unpad(ids: torch.Tensor, mask: torch.Tensor) -> list[int]:
    return ids[mask.bool()].tolist()


def recorded_rows(trainer) -> dict[str, list]:
    """What this rank saw, from `trainer.recorded` (tests/helpers.py `recording`): every generation batch's rows
    (`rollouts`, or `experts` for CHORD's expert rows), unpadded, in this rank's order, and each micro-batch's loss."""
    record = {"rollouts": [], "experts": [], "losses": [float(call.loss) for call in trainer.recorded.loss_calls]}
    for output in trainer.recorded.batches:
        expert = output.get("expert_mask")
        for i in range(output["prompt_ids"].shape[0]):
            cmask = output["completion_mask"][i]
            adv = output["advantages"][i]
            # (B,) scalar advantages, or (B, T) token advantages restricted to the completion's tokens
            adv = [float(adv)] if adv.dim() == 0 else adv[: int(cmask.sum())].tolist()
            row = {
                "prompt_ids": _unpad(output["prompt_ids"][i], output["prompt_mask"][i]),
                "completion_ids": _unpad(output["completion_ids"][i], cmask),
                "advantages": adv,
            }
            is_expert = expert is not None and bool(expert[i])
            record["experts" if is_expert else "rollouts"].append(row)
    return record


class GradRecorder(TrainerCallback):
    """Flattened gradients just before the optimizer step (DDP has already averaged them)."""

    def __init__(self):
        self.grad = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).clone()
            for _, p in model.named_parameters()
            if p.requires_grad
        ]
        self.grad = torch.cat(grads)


def run_case(case: str, model_dir: str, out_dir: str, world: int, rank: int) -> None:
    common = tiny_grpo_kwargs(
        output_dir=os.path.join(out_dir, f"run_{case}_world{world}"),
        per_device_train_batch_size=GLOBAL_ROLLOUTS // world,
        num_generations=NUM_GENERATIONS,
        gradient_accumulation_steps=1,
        max_completion_length=32,
        max_steps=1,
        logging_steps=1,
        learning_rate=1e-3,
        max_grad_norm=0.0,  # no clipping: compare the raw (DDP-averaged) gradients
        shuffle_dataset=False,
        # the default KL (k2) is 0 with zero gradient at the first step; a small entropy bonus adds a second
        # gradient term that also goes through the loss aggregation
        entropy_loss={"entropy_coef": 0.01},
    )
    dataset = tiny_conversational_dataset(4)
    extra = {}
    if case == "grpo":
        # token-mean (the default): the loss of each process is the mean over ITS micro-batch's tokens, and DDP
        # averages the two processes' gradients. That average equals the 1-process global token-mean only if both
        # halves hold the same number of loss tokens, hence equal-length completions here (ragged=False).
        args = TrinityConfig(algorithm="grpo", **common)
        cls, ragged = TrinityTrainer, False
    elif case == "grpo_refill":
        # DAPO-style dynamic sampling: prompt 1+1's group has equal rewards (flat_first_group_reward) and is filtered
        # (std_threshold 0); duplicate_experiences refills its rows with copies of prompt 2+1's group. On 2
        # processes the filtered group is rank 0's and the kept one rank 1's, so the copies cross processes.
        args = TrinityConfig(
            algorithm="grpo", advantage={"std_threshold": 0.0, "duplicate_experiences": True}, **common
        )
        cls, ragged = TrinityTrainer, False
    elif case == "reinforceplusplus":
        # ragged completions, so the batch advantage function sees padded (B, T) tensors gathered from processes of
        # different widths. seq-mean-token-mean: the mean over rows of per-row token means; each process has the same
        # number of rows (4), so the DDP average of the two local means is the global mean over the 8 rows.
        args = TrinityConfig(algorithm="reinforceplusplus", loss_agg_mode="seq-mean-token-mean", **common)
        cls, ragged = TrinityTrainer, True
    elif case in ("cispo_global", "cispo_micro"):
        # token-mean with ragged completions: the two processes hold different token counts. With
        # loss_normalization="global" every token of the step weighs the same, so 2 processes equal 1 exactly;
        # with Trinity's per-micro-batch token mean they do not (the test asserts both)
        normalization = "global" if case == "cispo_global" else "micro_batch"
        args = TrinityConfig(algorithm="cispo", loss_normalization=normalization, **common)
        cls, ragged = TrinityTrainer, True
    elif case == "sapo":
        # SAPOTrainer's defaults (paper form, seq-mean-token-mean) with ragged completions: each process holds 4 rows,
        # so the DDP average of the two per-process row means is the global mean over the 8 rows
        args = SAPOConfig(**common)
        cls, ragged = SAPOTrainer, True
    elif case == "chord":
        # as above; every process also has the same number of expert rows (4 // world), so both the RL part (mean
        # over rollout rows) and the SFT part (mean over expert rows) average to their global means.
        args = ChordConfig(
            algorithm="mix_chord",
            loss_agg_mode="seq-mean-token-mean",
            expert_batch_size=GLOBAL_EXPERT_ROWS // world,
            **common,
        )
        cls, ragged = ChordTrainer, True
        from datasets import Dataset

        extra["expert_dataset"] = Dataset.from_dict(
            {
                "messages": [
                    [
                        {"role": "user", "content": f"What is {a}+{b}?"},
                        {"role": "assistant", "content": f"{a} plus {b} equals {a + b}" + " so" * a},
                    ]
                    for a, b in [(5, 1), (6, 2), (7, 3), (8, 4), (9, 5), (3, 3)]
                ]
            }
        )
    else:
        raise ValueError(f"unknown case {case!r}")

    grads = GradRecorder()
    trainer = recording(cls)(
        model=model_dir,
        reward_funcs=[flat_first_group_reward if case == "grpo_refill" else digit_reward],
        args=args,
        train_dataset=dataset,
        rollout_func=make_rollout_func(ragged),
        callbacks=[grads],
        **extra,
    )
    result = trainer.train()
    assert trainer.state.global_step == 1, trainer.state.global_step
    torch.save(
        {
            **recorded_rows(trainer),
            "grad": grads.grad,
            "world": trainer.accelerator.num_processes,
            "rank": trainer.accelerator.process_index,
            "train_loss": result.training_loss,
        },
        os.path.join(out_dir, f"{case}_world{world}_rank{rank}.pt"),
    )


STEP_COUNTER: dict[int, int] = {}


class CountingEnv:
    """Run k of task t lasts 1 + (t + k) % 3 turns and ends with reward ((7t + 3k) % 5) / 4. Groups never
    straddle processes, so the per-task counter numbers the runs 0..G-1 on 1 or 2 processes alike."""

    def reset(self, task_id, **row):
        self.k = STEP_COUNTER.get(task_id, 0)
        STEP_COUNTER[task_id] = self.k + 1
        self.length, self.turn = 1 + (task_id + self.k) % 3, 0
        self.reward = ((7 * task_id + 3 * self.k) % 5) / 4
        return f"Task {task_id}: play."

    def step(self, action):
        from trinity_trl.rollouts import StepResult

        self.turn += 1
        if self.turn >= self.length:
            return StepResult("Over.", reward=self.reward, done=True)
        return StepResult(f"Turn {self.turn} of run {self.k}.", reward=0.0)


def run_step_case(model_dir: str, out_dir: str, world: int, rank: int) -> None:
    """StepGRPOTrainer with a deterministic generation (each turn's text depends only on its prompt), so
    1 and 2 processes play the same runs; global token normalisation makes the gradients comparable."""
    from datasets import Dataset

    from trinity_trl.trainers import StepGRPOConfig, StepGRPOTrainer

    args = StepGRPOConfig(
        **tiny_grpo_kwargs(
            output_dir=os.path.join(out_dir, f"run_step_grpo_world{world}"),
            per_device_train_batch_size=GLOBAL_ROLLOUTS // world,
            num_generations=NUM_GENERATIONS,
            max_steps=1,
            max_grad_norm=0.0,
            shuffle_dataset=False,
            max_env_steps=3,
            loss_normalization="global",
            entropy_loss={"entropy_coef": 0.01},
        )
    )
    grads = GradRecorder()
    trainer = recording(StepGRPOTrainer)(
        model=model_dir,
        args=args,
        train_dataset=Dataset.from_dict({"task_id": [0, 1]}),
        environment_factory=CountingEnv,
        callbacks=[grads],
    )
    tokenizer = trainer.processing_class

    def generate(prompt_ids, images, multimodal_fields, num_generations, **kwargs):
        texts = [f"Guess {len(p) % 10} now" for p in prompt_ids]
        return [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts], None

    trainer._generate_single_turn = generate
    trainer.train()
    runs = [row["run"] for row in trainer.recorded.rows[-1]]  # the rollout's runs, one per row
    torch.save(
        {
            **recorded_rows(trainer),
            "grad": grads.grad,
            "world": trainer.accelerator.num_processes,
            "rank": trainer.accelerator.process_index,
            "steps": [len(r.steps) for r in runs],
        },
        os.path.join(out_dir, f"step_grpo_world{world}_rank{rank}.pt"),
    )


def main() -> None:
    model_dir, out_dir, *cases = sys.argv[1:]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    for case in cases:
        if case == "step_grpo":
            run_step_case(model_dir, out_dir, world, rank)
        else:
            run_case(case, model_dir, out_dir, world, rank)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # without this, rank 0 aborts at exit with SIGABRT (notes/TRL_1_16.md §7)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
