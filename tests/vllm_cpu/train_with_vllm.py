"""One trainer through vLLM colocated on a CPU for 2 steps (run by test_vllm_cpu.py in its own process, because vLLM
starts worker processes): `python train_with_vllm.py chord|cispo|step MODEL_DIR OUTPUT_DIR`.

After every weight sync it checks that vLLM really holds the trainer's weights: vLLM's log-probs of a probe text equal
the trainer model's to bf16 rounding (vLLM runs the float32 checkpoint in bf16), while they differed before the sync.
Prints one JSON line: {"syncs": [[step, gap_before, gap_after], ...], "loss": float}.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (helpers)

PROBE = "what is 3 plus 4 and the answer is seven"


def prompt_logprob_gap(trainer) -> float:
    """max |log p| difference on the probe's tokens between vLLM and the trainer's (adapter-merged) model."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = trainer.processing_class(PROBE)["input_ids"]
    out = trainer.vllm_generation.llm.generate(
        [TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    served = [next(iter(d.values())).logprob for d in out[0].prompt_logprobs[1:]]
    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        logps = torch.log_softmax(model(torch.tensor([ids])).logits.float(), -1)[0]
    own = [logps[i - 1, ids[i]].item() for i in range(1, len(ids))]
    return max(abs(a - b) for a, b in zip(served, own))


def main(which: str, model_dir: str, output_dir: str) -> None:
    from datasets import Dataset
    from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs

    from trinity_trl.rollouts import NumberGuessEnv, number_guess_dataset
    from trinity_trl.trainers import (
        ChordConfig,
        ChordTrainer,
        CISPOConfig,
        CISPOTrainer,
        StepGRPOConfig,
        StepGRPOTrainer,
    )

    kwargs = tiny_grpo_kwargs(
        output_dir=output_dir,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=256,
        vllm_gpu_memory_utilization=0.3,
        learning_rate=5e-2,
    )
    if which == "chord":
        expert = Dataset.from_list(
            [
                {
                    "messages": [
                        {"role": "user", "content": f"What is {a}+{b}?"},
                        {"role": "assistant", "content": f"The answer is {a + b}."},
                    ]
                }
                for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]
            ]
        )
        trainer = ChordTrainer(
            model=model_dir,
            reward_funcs=length_reward,
            expert_dataset=expert,
            args=ChordConfig(**kwargs),
            train_dataset=tiny_conversational_dataset(),
        )
    elif which == "cispo":  # with vLLM's importance-sampling correction
        trainer = CISPOTrainer(
            model=model_dir,
            reward_funcs=length_reward,
            train_dataset=tiny_conversational_dataset(),
            args=CISPOConfig(**kwargs, vllm_importance_sampling_correction=True),
        )
    else:
        trainer = StepGRPOTrainer(
            model=model_dir,
            reward_funcs=length_reward,
            train_dataset=number_guess_dataset(16),
            environment_factory=lambda: NumberGuessEnv(partial_credit=True),
            args=StepGRPOConfig(**kwargs, max_env_steps=3, vllm_importance_sampling_correction=False),
        )
    sync, syncs = trainer.vllm_generation.sync_weights, []

    def checked_sync():
        before = prompt_logprob_gap(trainer)
        sync()
        syncs.append([trainer.state.global_step, before, prompt_logprob_gap(trainer)])

    trainer.vllm_generation.sync_weights = checked_sync
    result = trainer.train()
    print(json.dumps({"syncs": syncs, "loss": result.training_loss}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
