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
import re

import pytest
import torch
from datasets import Dataset
from helpers import TINY_LOGP_SCALE, TINY_MODEL_TERMS, build_tiny_model, build_tiny_tokenizer, tiny_grpo_kwargs
from tolerance import approx, assert_close

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
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def force_turns(trainer, script, record=None, free=False):
    """Replace the trainer's single-turn generation with forced sampling (see the module docstring).
    ``script(conversation_text) -> next turn text``; ``record`` collects ``(prompt_ids, ids, logprobs)``. With
    ``free``, a call whose every turn the script answers ``None`` is TRL's own, unforced generation."""
    model, tokenizer = trainer.model, trainer.processing_class
    eos = tokenizer.eos_token_id
    own = trainer._generate_single_turn

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        texts = [script(tokenizer.decode(list(ids))) for ids in prompt_ids]
        if free and all(text is None for text in texts):
            return own(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        completions, logprobs = [], []
        for ids, text in zip(prompt_ids, texts):
            ids = list(ids)
            target = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            target = target[: trainer.max_completion_length]
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=len(target),
                    eos_token_id=eos,
                    pad_token_id=tokenizer.pad_token_id,
                    output_logits=True,
                    return_dict_in_generate=True,
                    prefix_allowed_tokens_fn=lambda batch, sofar, target=target, ids=ids: [
                        target[len(sofar) - len(ids)]
                    ],
                )
            new = out.sequences[0, len(ids) :].tolist()
            logps = [torch.log_softmax(logits[0].float(), -1)[token].item() for logits, token in zip(out.logits, new)]
            completions.append(new)
            logprobs.append(logps)
            if record is not None:
                record.append((ids, list(new), list(logps)))  # TRL extends its lists in place
        return completions, (None if free else logprobs)  # mixed with TRL's own path, which has none

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


def make(
    tmp_path,
    model_dir,
    tasks,
    env=CalculatorToolEnv,
    script=calculator_script,
    record=None,
    cls=Recording,
    reward_funcs=None,
    tools=None,
    **config,
):
    kwargs = tiny_grpo_kwargs(
        output_dir=str(tmp_path / "out"), max_steps=1, shuffle_dataset=False, max_completion_length=512, temperature=1.0
    )
    kwargs.update(config)
    trainer = cls(
        model=model_dir,
        reward_funcs=reward_funcs,
        args=StepGRPOConfig(**kwargs),
        train_dataset=tasks,
        environment_factory=env,
        tools=tools,
    )
    return force_turns(trainer, script, record)


def test_tool_environment_turns_are_steps_with_the_runs_advantage(tmp_path, tool_model_dir):
    trainer = make(
        tmp_path, tool_model_dir, calculator_tasks(4), num_generations=2, per_device_train_batch_size=4, max_env_steps=5
    )
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


def logs_of(trainer) -> dict:
    return {k: v for entry in trainer.state.log_history for k, v in entry.items()}


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_trained_log_probs_are_the_sampled_ones_turn_by_turn(tmp_path, tool_model_dir, shared_prefix):
    # item 2 (TRL 5224/5242: re-tokenised turns): temperature 1, one completion per generation call, three-turn runs;
    # every turn's tokens are found in a training row after exactly the context they were sampled in, and the
    # training forward's log-probs of them equal the ones the generation returned
    record = []

    def three_turns(text):
        task, turn = task_of(text), turn_of(text)
        return [
            tool_call("calc", expression=f"{task}*3"),
            tool_call("calc", expression=f"{task}*3-1"),
            f"Task {task}: {task * 3 - 1}.",
        ][turn]

    trainer = make(
        tmp_path,
        tool_model_dir,
        calculator_tasks(4),
        script=three_turns,
        record=record,
        num_generations=2,
        per_device_train_batch_size=4,
        shared_prefix=shared_prefix,
        learning_rate=0.0,
    )
    trainer.train()
    assert len(record) == 12  # 4 runs x 3 turns, each turn sampled once
    rows = []
    for input_ids, logps in trainer.forwards:
        prompt_width = input_ids.size(1) - logps.size(1)
        for ids, row_logps in zip(input_ids.tolist(), logps):
            left = next(i for i, t in enumerate(ids) if t != trainer.processing_class.pad_token_id)
            rows.append((ids[left:], row_logps, prompt_width - left))
    for context, sampled, sampled_logps in record:
        found = [
            (seq, lp, start)
            for seq, lp, start in rows
            if seq[: len(context) + len(sampled)] == context + sampled and len(context) >= start
        ]
        assert found, "a sampled turn is missing from the training rows (or its context changed)"
        for _seq, lp, start in found:
            trained = lp[len(context) - start : len(context) - start + len(sampled)]
            # sampling's forward (one token at a time, cached keys) and training's (whole rows): the tiny model's chain
            assert_close(trained, torch.tensor(sampled_logps), terms=TINY_MODEL_TERMS, scale=TINY_LOGP_SCALE)
    assert logs_of(trainer)["multi_step/steps_per_run"] == 3.0


class EchoToolEnv:
    """A second tool environment for routing: one tool, reward from the dataset's `target` column."""

    def reset(self, target: str, **row):
        self.target, self.said = target, None
        return f" Say {target} with the echo tool."

    def echo(self, text: str) -> str:
        """Repeat a text.

        Args:
            text: What to repeat.
        """
        self.said = text
        return text

    def get_reward(self) -> float:
        return float(self.said == self.target)


def test_a_dict_of_tool_environments_routed_by_the_environment_column(tmp_path, tool_model_dir):
    tasks = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Solve task {i}: what is {i}*3-1?"}] for i in range(4)],
            "environment": ["calculator", "echo", "calculator", "echo"],
            "answer": [i * 3 - 1 for i in range(4)],
            "target": ["a", "b", "c", "d"],
        }
    )
    seen = {}

    def script(text):
        task, turn = task_of(text), turn_of(text)
        header = text.split("<|im_start|>user")[0]  # the system turn, with the tool schemas
        seen[task] = ('"name": "echo"' in header, '"name": "calc"' in header)
        if task % 2:  # echo task: one call, then done
            return tool_call("echo", text="abcd"[task]) if turn == 0 else f"Task {task} echoed."
        return calculator_script(text)

    trainer = make(
        tmp_path,
        tool_model_dir,
        tasks,
        env={"calculator": CalculatorToolEnv, "echo": EchoToolEnv},
        script=script,
        num_generations=2,
        shuffle_dataset=False,
    )
    trainer.train()
    # each row saw only its own environment's tools in its prompt (TRL renders them per environment)
    assert seen == {0: (False, True), 1: (True, False)}
    logs = logs_of(trainer)
    assert logs["multi_step/steps_per_run"] == 3.0  # calculator runs: 4 turns, echo runs: 2 turns
    assert logs["rewards/CalculatorToolEnv/mean"] == 1.0 and logs["rewards/EchoToolEnv/mean"] == 1.0


class OwnsTheData:
    """Tool environment that owns its tasks: the dataset is TRL's placeholder; reset() returns the question."""

    count = 0

    def reset(self, **row):
        OwnsTheData.count += 1
        self.task, self.answer_given = 100 + OwnsTheData.count, None
        return f"Solve task {self.task}: what is {self.task}*3-1?"

    def answer(self, number: int) -> str:
        """Submit the answer.

        Args:
            number: The answer.
        """
        self.answer_given = number
        return "ok"

    def get_reward(self):
        return float(self.answer_given == self.task * 3 - 1)


def test_train_dataset_none_when_the_environment_owns_the_data(tmp_path, tool_model_dir):
    def script(text):
        task = task_of(text)
        return tool_call("answer", number=task * 3 - 1) if turn_of(text) == 0 else "Done."

    trainer = make(tmp_path, tool_model_dir, None, env=OwnsTheData, script=script, max_steps=2)
    trainer.train()
    assert trainer.state.global_step == 2
    assert logs_of(trainer)["rewards/OwnsTheData/mean"] == 1.0


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b


def test_standalone_tools_without_an_environment(tmp_path, tool_model_dir):
    def script(text):
        task = task_of(text)
        return tool_call("multiply", a=task, b=3) if turn_of(text) == 0 else f"Task {task}: {task * 3 - 1}"

    def answer_in_last_turn(completions, answer, **kwargs):
        return [float(str(a) in c[-1]["content"]) for c, a in zip(completions, answer)]

    trainer = make(
        tmp_path,
        tool_model_dir,
        calculator_tasks(2),
        env=None,
        tools=[multiply],
        script=script,
        reward_funcs=answer_in_last_turn,
    )
    trainer.train()
    logs = logs_of(trainer)
    assert trainer.environment_protocol == "tools" and logs["multi_step/steps_per_run"] == 2.0
    assert logs["rewards/answer_in_last_turn/mean"] == 1.0 and logs["tools/call_frequency"] == 1.0


# ------------------------------------------------------------------------------ item 5: errors, not hangs
class Flaky:
    """calc raises on task 1; get_reward is None (cannot score) on task 2; task 3 never stops calling."""

    def reset(self, answer, **row):
        self.task = (answer + 1) // 3
        return None

    def calc(self, expression: str) -> str:
        """Compute.

        Args:
            expression: The expression.
        """
        if self.task == 1:
            raise RuntimeError("calculator is broken")
        return "42"

    def get_reward(self):
        return None if self.task == 2 else 1.0


def test_tool_errors_malformed_calls_endless_runs_and_unscorable_rewards(tmp_path, tool_model_dir):
    def script(text):
        task, turn = task_of(text), turn_of(text)
        if task == 0:  # malformed tool call: TRL's parser falls back to text, the run ends there
            return f"Task {task} " + '<tool_call>\n{"name": "calc", "arguments": {oops}\n</tool_call>'
        if task == 3:  # never finishes: a tool call every turn
            return f"Task {task} turn {turn}. " + tool_call("calc", expression="1+1")
        return f"Task {task}. " + tool_call("calc", expression="1+1") if turn == 0 else f"Task {task} done."

    trainer = make(
        tmp_path,
        tool_model_dir,
        calculator_tasks(4),
        env=Flaky,
        script=script,
        num_generations=2,
        per_device_train_batch_size=8,
        max_env_steps=3,
    )
    trainer.train()  # nothing raises, nothing hangs
    logs, batch = logs_of(trainer), trainer.batches[0]
    assert logs["multi_step/malformed_tool_calls"] == 2.0  # task 0's two runs: one turn each, taken as the answer
    assert logs["multi_step/cut_runs"] == 2.0  # task 3's runs stopped at max_env_steps=3 turns
    # the tool that raised answered {"error": ...} to the model (TRL), counted as failures: task 1's 2 calls of 6
    assert logs["tools/failure_frequency"] == approx(2 / 8, terms=8)  # a mean over 8 calls
    assert logs["unscorable_count"] == 2.0  # task 2's runs: get_reward None -> NaN -> no gradient, counted
    # trained steps: task 0 one, task 1 two, task 2 none (unscorable), task 3 three (each turn ended with EOS)
    assert sum(batch["sample_count"].tolist()) == (1 + 2 + 0 + 3) * 2


# ---------------------------------------------------------------------------- construction (issue 14)
class NoStep(Environment):
    def reset(self, **row):
        return "hi"


@pytest.mark.parametrize(
    "env, match",
    [
        (NoStep, r"NoStep subclasses trinity_trl.rollouts.Environment but does not define step"),
        (object, r"object defines no reset"),
        (CalculatorToolEnv(), r"must be a callable returning a fresh environment"),
    ],
)
def test_a_wrong_environment_fails_at_construction(tmp_path, tiny_model_dir, env, match):
    with pytest.raises(TypeError, match=match):
        StepGRPOTrainer(
            model=tiny_model_dir,
            args=StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path))),
            train_dataset=calculator_tool_dataset(4),
            environment_factory=env,
        )


def test_tool_options_that_cannot_work_fail_at_construction(tmp_path, tiny_model_dir, tool_model_dir):
    config = tiny_grpo_kwargs(output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="history='messages' is for reset/step environments"):
        StepGRPOTrainer(
            model=tool_model_dir,
            args=StepGRPOConfig(**config, history="messages"),
            train_dataset=calculator_tool_dataset(4),
            environment_factory=CalculatorToolEnv,
        )
    with pytest.raises(ValueError, match="set max_env_steps=3 and leave max_tool_calling_iterations unset"):
        StepGRPOConfig(**config, max_tool_calling_iterations=2)
    assert StepGRPOConfig(**config, max_env_steps=4).max_tool_calling_iterations == 3
    # a chat template that cannot render tool calls (the tiny ChatML one, like SmolLM2's): TRL's own error
    with pytest.raises(ValueError, match="does not support tool calling"):
        StepGRPOTrainer(
            model=tiny_model_dir,
            args=StepGRPOConfig(**config),
            train_dataset=calculator_tool_dataset(4),
            environment_factory=CalculatorToolEnv,
        )


class Countdown(Environment):
    """reset/step environment owning its data: a fixed number of turns, then reward 1."""

    def reset(self, **row):
        assert row == {}  # the placeholder rows hold only `prompt`, which reset/step environments do not receive
        self.left = 2
        return "Count down."

    def step(self, action):
        self.left -= 1
        return StepResult("again", reward=1.0 if self.left == 0 else 0.0, done=self.left == 0)


def test_train_dataset_none_with_a_reset_step_environment(tmp_path, tiny_model_dir):
    trainer = StepGRPOTrainer(
        model=tiny_model_dir,
        args=StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), max_steps=1)),
        train_dataset=None,
        environment_factory=Countdown,
    )
    trainer.train()
    assert trainer.environment_protocol == "reset/step"
    assert logs_of(trainer)["multi_step/steps_per_run"] == 2.0
    with pytest.raises(ValueError, match="needs max_steps > 0"):
        StepGRPOTrainer(
            model=tiny_model_dir,
            args=StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), max_steps=-1)),
            environment_factory=Countdown,
        )


def test_the_tool_recipe_config_trains(tmp_path, tool_model_dir):
    from trinity_trl.cli import run as cli

    trainer = cli(
        [
            "step_grpo",
            "--config",
            "step_grpo_tools_cpu",
            "--model_name_or_path",
            tool_model_dir,
            "--output_dir",
            str(tmp_path / "run"),
            "--max_steps",
            "2",
            "--num_tasks",
            "8",
            "--max_completion_length",
            "16",
            "--max_env_steps",
            "2",
            "--lora_r",
            "4",
            "--lora_alpha",
            "8",
        ]
    )
    assert trainer.state.global_step == 2 and trainer.environment_protocol == "tools"
    assert sorted(t.__name__ for t in trainer.tools) == ["answer", "calc"]
    assert (tmp_path / "run" / "training_log.json").is_file()


# ------------------------------------------------------------------------ the bundled model (slow)
@pytest.mark.slow
def test_bundled_smollm2_calculator_tool_task(tmp_path):
    """SmolLM2-135M-Instruct with TRL's Qwen2.5 tool template on CalculatorToolEnv. The 135M model does not write
    tool calls by itself (no call in 12 samples with the tool schemas, a system-prompt example or a one-shot
    dialogue), so each run's FIRST turn is forced to a calc call (sampled by the real model, see force_turns);
    everything after is the model's own sampling through TRL's generation. Shows on the real model and template:
    TRL parses the call, CalculatorToolEnv executes it, the result is rendered as a tool turn, the model's own
    next turn follows, and both turns are trained as steps of an optimizer step (one: each of its 4 runs shows all
    of this, and it is the same first step as with max_steps=2, which took twice as long)."""
    import time

    from peft import LoraConfig
    from trl.chat_template_utils import qwen2_5_chat_template

    from trinity_trl.data import bundled_model_dir
    from trinity_trl.trainers.common import load_processor

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/test_bundled_model.py::one_torch_thread
    try:
        args = StepGRPOConfig(
            **tiny_grpo_kwargs(
                output_dir=str(tmp_path / "out"),
                max_steps=1,
                num_generations=2,
                per_device_train_batch_size=4,
                max_completion_length=96,
                max_env_steps=3,
                temperature=1.0,
                learning_rate=1e-4,
            )
        )
        tokenizer = load_processor(bundled_model_dir(), args)
        tokenizer.chat_template = qwen2_5_chat_template
        trainer = Recording(
            model=bundled_model_dir(),
            processing_class=tokenizer,
            args=args,
            train_dataset=calculator_tool_dataset(8, seed=1),
            environment_factory=CalculatorToolEnv,
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        )

        def first_turn_calls_calc(text):
            if turn_of(text) > 0:
                return None  # the model's own turn
            c, a, b = re.findall(r"has (\d+) boxes with (\d+) apples each and sells (\d+)", text)[-1]
            return tool_call("calc", expression=f"{c}*{a}-{b}")

        force_turns(trainer, first_turn_calls_calc, free=True)
        start = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    logs = [entry for entry in trainer.state.log_history if "multi_step/steps_per_run" in entry]
    assert len(logs) == args.max_steps and trainer.state.global_step == args.max_steps
    for entry in logs:
        assert entry["tools/call_frequency"] >= 1.0 and entry["tools/failure_frequency"] == 0.0  # parsed, executed
        assert entry["multi_step/steps_per_run"] >= 2.0  # the model's own turn after the tool result is a step
        assert entry["rewards/CalculatorToolEnv/mean"] >= 0.2  # get_reward saw the right value computed by calc
    rows = [trainer.processing_class.decode(ids) for batch in trainer.batches for ids in batch["completion_ids"]]
    assert all(re.search(r"<tool_response>\n-?\d+\n</tool_response>", row) for row in rows if row.strip())
    print(
        f"\n2 steps in {elapsed:.0f} s; per step: "
        + "; ".join(
            f"steps/run {e['multi_step/steps_per_run']}, tool calls/run {e['tools/call_frequency']}, reward "
            f"{e['rewards/CalculatorToolEnv/mean']:.2f}, cut {e['multi_step/cut_runs']}, malformed "
            f"{e['multi_step/malformed_tool_calls']}"
            for e in logs
        )
    )
    print("a run's second turn (the model's own):", repr(rows[0].split("</tool_response>")[-1][:200]))
