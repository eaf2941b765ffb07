"""StepGRPOTrainer with TRL's environment contract: tool environments (public methods as tools, optional
``get_reward``), dicts of them routed by an ``environment`` column, standalone ``tools``, ``train_dataset=None``;
every assistant turn of TRL's tool loop trained as a step, with the sampled token ids and no drift.

The tiny model cannot write tool calls by itself, so its turns are *forced*: ``transformers``' ``generate``
samples at temperature 1 with ``prefix_allowed_tokens_fn`` allowing only the scripted next token, and returns
the raw logits, from which the sampling log-probs of the forced tokens are read (what vLLM returns). The
generation is the model's, incremental and KV-cached, exactly as TRL's transformers path runs it; only the
choice of token is scripted. It replaces ``GRPOTrainer._generate_single_turn``, the one call TRL's tool loop
makes to generate.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from datasets import Dataset
from helpers import build_tiny_model, build_tiny_tokenizer, tiny_grpo_kwargs

from trinity_trl.rollouts import CalculatorToolEnv, Environment, StepResult, calculator_tool_dataset
from trinity_trl.trainers import StepGRPOConfig, StepGRPOTrainer


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """The tiny Qwen2 with TRL's stored Qwen2.5 chat template: it renders tool schemas, ``<tool_call>`` JSON
    and ``<tool_response>`` turns, and TRL knows its response parser (``add_response_schema``)."""
    from trl.chat_template_utils import qwen2_5_chat_template

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = qwen2_5_chat_template
    model = build_tiny_model(tokenizer)
    model.config.max_position_embeddings = 4096  # the tool schemas in the system prompt take ~500 tiny-BPE tokens
    path = tmp_path_factory.mktemp("tiny_tool_qwen2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def tool_call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def force_turns(trainer, script, record=None):
    """Replace the trainer's single-turn generation with forced sampling (see the module docstring).
    ``script(conversation_text) -> next turn text``; ``record`` collects ``(prompt_ids, ids, logprobs)``."""
    model, tokenizer = trainer.model, trainer.processing_class
    eos = tokenizer.eos_token_id

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        completions, logprobs = [], []
        for ids in prompt_ids:
            ids = list(ids)
            target = tokenizer(script(tokenizer.decode(ids)), add_special_tokens=False)["input_ids"] + [eos]
            target = target[: trainer.max_completion_length]
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=True,
                    temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=len(target), eos_token_id=eos,
                    pad_token_id=tokenizer.pad_token_id, output_logits=True, return_dict_in_generate=True,
                    prefix_allowed_tokens_fn=lambda batch, sofar: [target[len(sofar) - len(ids)]])
            new = out.sequences[0, len(ids):].tolist()
            logps = [torch.log_softmax(logits[0].float(), -1)[token].item() for logits, token in zip(out.logits, new)]
            completions.append(new)
            logprobs.append(logps)
            if record is not None:
                record.append((ids, new, logps))
        return completions, logprobs

    trainer._generate_single_turn = generate
    return trainer


def task_of(text: str) -> int:
    return int(re.findall(r"task (\d+)", text)[-1])


def turn_of(text: str) -> int:
    return text.count("<tool_response>")


def calculator_script(text: str) -> str:
    """Three turns: calc(a*c), calc(result-b), then answer; each turn names its task (unique token ids)."""
    task, turn = task_of(text), turn_of(text)
    if turn == 0:
        return f"Task {task}. " + tool_call("calc", expression=f"{task}*3")
    if turn == 1:
        return f"Task {task} again. " + tool_call("calc", expression=f"{task}*3-1")
    if turn == 2:
        return tool_call("answer", number=task * 3 - 1)
    return f"Task {task} is done."


def calculator_tasks(n: int) -> Dataset:
    prompts = [[{"role": "user", "content": f"Solve task {i}: what is {i}*3-1?"}] for i in range(n)]
    return Dataset.from_dict({"prompt": prompts, "answer": [i * 3 - 1 for i in range(n)]})


class Recording(StepGRPOTrainer):
    """Keeps each training batch and, per loss micro-batch, the training forward's per-token log-probs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches, self.forwards = [], []

    def _training_batch(self, output, inputs, rewards, mode):
        out = super()._training_batch(output, inputs, rewards, mode)
        self.batches.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items()})
        return out

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)
        if torch.is_grad_enabled():  # the training forward of _compute_loss (not a no-grad reference pass)
            self.forwards.append((input_ids.detach().clone(), logps.detach().clone()))
        return logps, entropies, aux


def make(tmp_path, model_dir, tasks, env=CalculatorToolEnv, script=calculator_script, record=None, cls=Recording,
         reward_funcs=None, tools=None, **config):
    kwargs = tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), max_steps=1, shuffle_dataset=False,
                              max_completion_length=512, temperature=1.0)
    kwargs.update(config)
    trainer = cls(model=model_dir, reward_funcs=reward_funcs, args=StepGRPOConfig(**kwargs), train_dataset=tasks,
                  environment_factory=env, tools=tools)
    return force_turns(trainer, script, record)


def test_tool_environment_turns_are_steps_with_the_runs_advantage(tmp_path, tool_model_dir):
    trainer = make(tmp_path, tool_model_dir, calculator_tasks(4), num_generations=2, per_device_train_batch_size=4,
                   max_env_steps=5)
    assert trainer.environment_protocol == "tools"
    assert sorted(t.__name__ for t in trainer.tools) == ["answer", "calc"]
    trainer.train()
    batch = trainer.batches[0]
    # 4 runs (2 tasks x 2 generations), each 4 turns (calc, calc, answer, final text), one row per run
    assert batch["sample_count"].tolist() == [4, 4, 4, 4]
    assert [sorted(set(row.tolist()) - {-1}) for row in batch["segment_ids"]] == [[0, 1, 2, 3]] * 4
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert logs["multi_step/steps_per_run"] == 4.0
    assert logs["tools/call_frequency"] == 3.0  # TRL's own tool metrics: 3 calls per run, none failed
    assert logs["tools/failure_frequency"] == 0.0
    assert logs["multi_step/cut_runs"] == 0.0
    assert logs["rewards/CalculatorToolEnv/mean"] == 1.0  # get_reward, added by TRL under the class name
