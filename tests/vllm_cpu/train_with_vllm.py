"""One trainer through vLLM colocated on a CPU for 2 steps (run by test_vllm_cpu.py in its own process, because vLLM
starts worker processes): `python train_with_vllm.py chord|cispo|step|agent MODEL_DIR OUTPUT_DIR`.

After every weight sync it checks that vLLM really holds the trainer's weights: vLLM's log-probs of a probe text equal
the trainer model's to bf16 rounding (vLLM runs the float32 checkpoint in bf16), while they differed before the sync.
Prints one JSON line: {"syncs": [[step, gap_before, gap_after], ...], "loss": float}; with `agent`
(`StepGRPOTrainer(agent=...)`) also "steps": per optimizer step, what vLLM sampled (`sampled`: each output's
`[prompt_ids, token_ids, sampled-token log-probs]`, read from vLLM's own `RequestOutput`s), what the endpoint recorded
(`recorded`: every step of `trainer.agent_runs`, `[prompt_ids, completion_ids, logprobs]`), the rows the loss trained
(`rows`: `[prompt + completion ids, trained flag per token]`) and the agents' `infos`; and "logs" (the last value of
each logged metric).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (helpers)

PROBE = "what is 3 plus 4 and the answer is seven"
#: the vLLM engine's context in these runs (the model's own is 512)
VLLM_CONTEXT = 256


async def two_call_agent(client, row):
    """Two calls, the second continuing the first with a user turn, then one call whose prompt fits the model's
    context but not vLLM's (it must be refused, not reach vLLM); a reward that varies with the answer. Returns what it
    saw as its info: the log-probs the endpoint returned for the first call and the refusal's error code."""
    import openai

    messages = list(row["prompt"])
    first = await client.chat.completions.create(model="policy", messages=messages, logprobs=True)
    returned = [token.logprob for token in first.choices[0].logprobs.content]
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    try:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["long"]}])
        refused = None
    except openai.BadRequestError as err:
        refused = err.code
    return float(len(second.choices[0].message.content or "") % 3), {"returned": returned, "refused": refused}


def long_text(tokenizer, low: int, high: int) -> str:
    """A user message whose chat-template prompt has between ``low`` and ``high`` tokens."""
    words = 1
    while True:
        text = " ".join(["seven"] * words)
        message = [{"role": "user", "content": text}]
        size = len(tokenizer.apply_chat_template(message, add_generation_prompt=True, return_dict=False))
        if size >= low:
            assert size <= high, (size, low, high)
            return text
        words += 1


def record_agent_steps(trainer) -> list[dict]:
    """Per optimizer step: vLLM's samples (at ``LLM.generate``, the engine's own outputs), the endpoint's recorded
    calls (``trainer.agent_runs``) and the trained rows (at ``compute_loss``); filled as the trainer trains."""
    from transformers import TrainerCallback

    llm, steps = trainer.vllm_generation.llm, []
    sampled, rows = [], []
    engine_generate, compute_loss = llm.generate, trainer.compute_loss

    def generate(prompts, *args, **kwargs):
        outputs = engine_generate(prompts, *args, **kwargs)
        for output in outputs:
            for sample in output.outputs:
                if sample.logprobs is None:  # the weight-sync probe (prompt log-probs only)
                    continue
                logps = [position[token].logprob for token, position in zip(sample.token_ids, sample.logprobs)]
                sampled.append([list(output.prompt_token_ids), list(sample.token_ids), logps])
        return outputs

    def loss(model, inputs, *args, **kwargs):
        for ids, mask, completion, completion_mask, trained in zip(
            inputs["prompt_ids"],
            inputs["prompt_mask"],
            inputs["completion_ids"],
            inputs["completion_mask"],
            inputs["tool_mask"],
        ):
            kept = completion_mask.bool()
            rows.append(
                [ids[mask.bool()].tolist() + completion[kept].tolist(), [0] * int(mask.sum()) + trained[kept].tolist()]
            )
        return compute_loss(model, inputs, *args, **kwargs)

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            runs = trainer.agent_runs
            recorded = [[list(p), list(c), list(lp)] for run in runs for p, c, lp in run.steps]
            steps.append(
                {"sampled": list(sampled), "recorded": recorded, "rows": list(rows), "infos": [r.info for r in runs]}
            )
            sampled.clear()
            rows.clear()

    llm.generate = generate
    trainer.compute_loss = loss
    trainer.add_callback(Steps())
    return steps


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
        vllm_max_model_length=VLLM_CONTEXT,
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
    elif which == "agent":  # an agent over the policy endpoint, answered by vLLM
        from transformers import AutoTokenizer

        text = long_text(AutoTokenizer.from_pretrained(model_dir), VLLM_CONTEXT + 16, 512 - 64)
        trainer = StepGRPOTrainer(
            model=model_dir,
            train_dataset=tiny_conversational_dataset(8).add_column("long", [text] * 8),
            agent=two_call_agent,
            args=StepGRPOConfig(
                **kwargs,
                max_env_steps=3,  # the third call is refused for its length, before it counts
                temperature=1.0,
                mask_truncated_completions=False,
                vllm_importance_sampling_correction=False,
            ),
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
    steps = record_agent_steps(trainer) if which == "agent" else None
    result = trainer.train()
    report = {"syncs": syncs, "loss": result.training_loss}
    if steps is not None:
        report["steps"] = steps
        report["logs"] = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
