"""AsyncTrinityTrainer with TRL's vLLM worker against a running `vllm serve` on a CPU, LoRA adapter sync, 2 steps (run
by test_async_vllm.py in its own process: TRL's worker spawns a child): `python async_with_vllm.py MODEL_DIR URL OUT`.

Prints one JSON line: the steps trained, the adapters the server lists, and how far vLLM's log-probs of a probe text
under the last published adapter are from the trained policy's (``gap``) and from the base model's (``gap_base``).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (helpers)

PROBE = "what is 3 plus 4 and the answer is seven"


def varied_reward(completions, **kwargs):
    """Module-level (TRL's worker pickles its reward functions into a spawned process); varies with the text."""
    return [float(len(c[0]["content"]) % 5) for c in completions]


def vllm_logprobs(url: str, model: str, ids: list[int]) -> list[float]:
    import requests

    response = requests.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0},
        timeout=600,
    )
    response.raise_for_status()
    entries = response.json()["choices"][0]["prompt_logprobs"][1:]
    return [next(iter(entry.values()))["logprob"] for entry in entries]


def main(model_dir: str, url: str, out: str) -> None:
    import requests
    import torch
    from helpers import tiny_conversational_dataset
    from peft import LoraConfig

    from trinity_trl import AsyncTrinityConfig, AsyncTrinityTrainer

    args = AsyncTrinityConfig(
        output_dir=out,
        use_cpu=True,
        generation_backend="vllm",
        vllm_server_base_url=url,
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        token_budget=0,
        learning_rate=5e-2,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        max_staleness=1,
    )
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    # TRL's worker parses each answer with the tokenizer's response template, which it sets only for chat templates it
    # knows; the tiny tokenizer's ChatML template is not one, so it gets the template of TRL's own ChatML family
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.response_template = qwen3_template
    trainer = AsyncTrinityTrainer(
        model_dir, varied_reward, args, tiny_conversational_dataset(16), processing_class=tokenizer, peft_config=lora
    )
    trainer.train()
    models = [m["id"] for m in requests.get(f"{url}/v1/models", timeout=60).json()["data"]]
    ids = trainer.processing_class(PROBE)["input_ids"]
    policy = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        logits = policy(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    latest = f"trl-policy-v{trainer.model_version}"
    served = torch.tensor(vllm_logprobs(url, latest, ids))
    base = torch.tensor(vllm_logprobs(url, model_dir, ids))
    report = {
        "steps": trainer.state.global_step,
        "models": models,
        "latest": latest,
        "gap": float((served - ours).abs().max()),
        "gap_base": float((base - ours).abs().max()),
        "rewards": [e.get("reward") for e in trainer.state.log_history if "loss" in e],
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
