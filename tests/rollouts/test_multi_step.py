"""`trinity_trl/rollouts/multi_step.py`: `MultiStepRollout` against a scripted `Generator`, no model.

The fake generator's chat template is ChatML-like over character ids (`<user>`, `<assistant>`, `<eos>`, a newline
token after each turn), so expected prompts can be rendered independently of the rollout's own bookkeeping. With the
real tokenizer and TRL's generation: tests/trainers/test_step_grpo.py.
"""

from __future__ import annotations

import hashlib

import pytest

from trinity_trl.rollouts import Environment, MultiStepRollout, PolicyEndpoint, StepResult
from trinity_trl.rollouts.environment import EnvironmentFailure

USER, ASSISTANT, EOS, NEWLINE = 1000, 1001, 1002, 1003


def text_ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def chat_template(messages, add_generation_prompt: bool) -> list[int]:
    """`<role>content<eos>\\n` per message, then `<assistant>` for the generation prompt."""
    ids = []
    for message in messages:
        ids += [USER if message["role"] == "user" else ASSISTANT, *text_ids(message["content"]), EOS, NEWLINE]
    return ids + ([ASSISTANT] if add_generation_prompt else [])


class ScriptedGenerator:
    """A `Generator` whose turns are scripted: `replies(call, prompt_ids) -> text`; a reply ending in `"…"` is cut
    off (no EOS), as a turn that hit max_completion_length."""

    eos_token_id = EOS
    eos_token_ids = {EOS}

    def __init__(self, replies, template=chat_template, logprobs=True):
        self.replies = replies
        self.template = template
        self.logprobs = logprobs
        self.calls: list[list[list[int]]] = []

    def tokenize_conversations(self, conversations):
        return [self.template(messages, True) for messages in conversations]

    def render(self, messages, add_generation_prompt):
        return self.template(messages, add_generation_prompt)

    def generate(self, prompt_ids):
        self.calls.append([list(p) for p in prompt_ids])
        completions = []
        for prompt in prompt_ids:
            text = self.replies(len(self.calls) - 1, prompt)
            completions.append(text_ids(text.removesuffix("…")) + ([] if text.endswith("…") else [EOS]))
        logprobs = [[-0.5] * len(c) for c in completions] if self.logprobs else None
        return completions, logprobs

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i < USER)


class CountdownEnv(Environment):
    """Done after `turns` turns (from the row); step k is rewarded k / 10, the last one `final`."""

    def reset(self, turns, final=1.0, **row):
        self.turns, self.final, self.turn, self.row = int(turns), float(final), 0, row
        return f"Play {turns} turns."

    def step(self, action):
        self.turn += 1
        if self.turn >= self.turns:
            return StepResult("Done.", reward=self.final, done=True)
        return StepResult(f"Turn {self.turn}: you said {action}.", reward=self.turn / 10)


def echo(call, prompt):
    return f"t{call}"


def test_one_run_per_row_and_one_step_per_turn():
    generator = ScriptedGenerator(echo)
    runs = MultiStepRollout(generator, CountdownEnv, max_env_steps=5)(
        [{"prompt": "Hi", "turns": 3, "final": 0.7}, {"prompt": "Hi", "turns": 1, "final": 0.2}]
    )
    assert [len(run.steps) for run in runs] == [3, 1]
    assert [run.reward for run in runs] == [0.7, 0.2]  # the last step's reward
    assert [step.reward for step in runs[0].steps] == [0.1, 0.2, 0.7]
    assert [step.text for step in runs[0].steps] == ["t0", "t1", "t2"]
    assert all(run.done and run.prefix_preserving for run in runs)
    # every active run's next turn is generated in one batched call; finished runs are not generated for
    assert [len(call) for call in generator.calls] == [2, 1, 1]


def test_token_history_extends_the_previous_prompt_and_equals_the_rendered_conversation():
    generator = ScriptedGenerator(echo)
    (run,) = MultiStepRollout(generator, CountdownEnv, max_env_steps=5)([{"prompt": "Hi", "turns": 3}])
    for previous, step in zip(run.steps, run.steps[1:]):
        assert step.prompt_ids[: len(previous.prompt_ids) + len(previous.completion_ids)] == (
            previous.prompt_ids + previous.completion_ids
        )
    # the history is never re-tokenized, and (turns end with EOS, decoding is lossless) equals the rendering
    messages = [{"role": "user", "content": "Hi\n\nPlay 3 turns."}]
    for step in run.steps:
        assert step.prompt_ids == chat_template(messages, True)
        messages += [{"role": "assistant", "content": step.text}]
        if step is not run.steps[-1]:
            messages += [{"role": "user", "content": f"Turn {len(messages) // 2}: you said {step.text}."}]
    assert run.messages == messages[:-1]  # the conversation up to the last observation


def test_a_turn_cut_off_before_eos_gets_one_in_the_history():
    generator = ScriptedGenerator(lambda call, prompt: "cut…" if call == 0 else "ok")
    (run,) = MultiStepRollout(generator, CountdownEnv, max_env_steps=5)([{"prompt": "Hi", "turns": 2}])
    first, second = run.steps
    assert first.completion_ids == text_ids("cut")  # as generated: no EOS
    observation = [NEWLINE, USER, *text_ids("Turn 1: you said cut."), EOS, NEWLINE, ASSISTANT]
    assert second.prompt_ids == first.prompt_ids + first.completion_ids + [EOS] + observation


def test_observation_ids_follow_the_eos_of_the_turn():
    rollout = MultiStepRollout(ScriptedGenerator(echo), CountdownEnv, max_env_steps=2)
    # the template renders "<eos>\n" after a turn: the generated turn ends at <eos>, the "\n" belongs to what follows
    assert rollout._observation_ids("obs") == [NEWLINE, USER, *text_ids("obs"), EOS, NEWLINE, ASSISTANT]


def test_a_template_that_does_not_append_is_refused_in_token_mode():
    def numbered(messages, add_generation_prompt):  # starts with the message count: earlier tokens change
        return [len(messages), *chat_template(messages, add_generation_prompt)]

    rollout = MultiStepRollout(ScriptedGenerator(echo, template=numbered), CountdownEnv, max_env_steps=3)
    with pytest.raises(ValueError, match="does not extend a conversation by appending tokens; use history='messages'"):
        rollout([{"prompt": "Hi", "turns": 2}])


def test_messages_mode_re_renders_and_flags_rewritten_history():
    def strip_thoughts(messages, add_generation_prompt):
        """A template that drops `think:` turns of the assistant except the last message (reasoning stripping)."""
        kept = [
            m
            for i, m in enumerate(messages)
            if not (m["role"] == "assistant" and m["content"].startswith("think:") and i < len(messages) - 1)
        ]
        return chat_template(kept, add_generation_prompt)

    replies = {0: "think:a", 1: "plain"}
    generator = ScriptedGenerator(lambda call, prompt: replies.get(call, "x"), template=strip_thoughts)
    rollout = MultiStepRollout(generator, CountdownEnv, max_env_steps=3, history="messages")
    (run,) = rollout([{"prompt": "Hi", "turns": 3}])
    assert not run.prefix_preserving  # the second prompt no longer contains the first turn
    messages = run.messages
    assert [step.prompt_ids for step in run.steps] == [strip_thoughts(messages[:k], True) for k in (1, 3, 5)]

    (kept,) = MultiStepRollout(
        ScriptedGenerator(echo, template=strip_thoughts), CountdownEnv, max_env_steps=3, history="messages"
    )([{"prompt": "Hi", "turns": 3}])
    assert kept.prefix_preserving  # nothing rewritten


def test_max_env_steps_ends_every_run():
    class Endless(Environment):
        def reset(self, **row):
            return "Go."

        def step(self, action):
            return StepResult("Again.", reward=0.25)

    generator = ScriptedGenerator(echo)
    runs = MultiStepRollout(generator, Endless, max_env_steps=2)([{"prompt": "a"}, {"prompt": "b"}])
    assert [len(run.steps) for run in runs] == [2, 2]
    assert all(run.done and run.reward == 0.25 for run in runs)  # cut off: the last step's reward counts
    assert len(generator.calls) == 2


def test_logprobs_are_kept_per_step_when_the_generator_reports_them():
    (run,) = MultiStepRollout(ScriptedGenerator(echo), CountdownEnv, max_env_steps=2)([{"prompt": "Hi", "turns": 2}])
    assert [step.logprobs for step in run.steps] == [[-0.5] * 3, [-0.5] * 3]  # "t0" + EOS
    (run,) = MultiStepRollout(ScriptedGenerator(echo, logprobs=False), CountdownEnv, max_env_steps=2)(
        [{"prompt": "Hi", "turns": 2}]
    )
    assert [step.logprobs for step in run.steps] == [None, None]


def test_reset_gets_the_row_without_its_prompt():
    envs = []

    def factory():
        envs.append(CountdownEnv())
        return envs[-1]

    MultiStepRollout(ScriptedGenerator(echo), factory, max_env_steps=1)([{"prompt": "Hi", "turns": 1, "level": 3}])
    assert envs[0].row == {"level": 3}


@pytest.mark.parametrize(
    ("prompt", "observation", "expected"),
    [
        ("Hi", "Obs.", [{"role": "user", "content": "Hi\n\nObs."}]),
        ("Hi", None, [{"role": "user", "content": "Hi"}]),
        ("", "Obs.", [{"role": "user", "content": "Obs."}]),
        ([{"role": "user", "content": ""}], "Obs.", [{"role": "user", "content": "Obs."}]),  # StepGRPO's placeholder
        (
            [{"role": "system", "content": "Be brief."}],
            "Obs.",
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Obs."}],
        ),
    ],
)
def test_the_first_prompt_is_the_rows_prompt_and_the_first_observation(prompt, observation, expected):
    class Start(Environment):
        def reset(self, **row):
            return observation

        def step(self, action):
            return StepResult(None, done=True)

    generator = ScriptedGenerator(echo)
    (run,) = MultiStepRollout(generator, Start, max_env_steps=1)([{"prompt": prompt}])
    assert run.messages == expected
    assert generator.calls[0] == [chat_template(expected, True)]


def test_each_step_records_the_state_it_acted_from_and_its_declared_reward():
    """GiGPO's inputs (docs/trainers/step-grpo.md#gigpo): the reset observation (or the row's prompt), then the previous
    step's ``info["env_state_hash"]`` or its observation; ``info["step_reward"]`` where declared."""

    class Walk(Environment):
        def reset(self, start=None, **row):
            self.turn = 0
            return start

        def step(self, action):
            self.turn += 1
            if self.turn == 1:
                return StepResult("Left.", reward=0.3, info={"env_state_hash": (2, "x"), "step_reward": 0.5})
            if self.turn == 2:
                return StepResult("Right.", reward=0.6)
            return StepResult("End.", reward=1.0, done=True, info={"step_reward": 1})

    rollout = MultiStepRollout(ScriptedGenerator(echo), Walk, max_env_steps=5)
    with_observation, without = rollout(
        [{"prompt": "Hi", "start": "Room 1."}, {"prompt": [{"role": "user", "content": "Hi"}]}]
    )
    assert [s.state_key for s in with_observation.steps] == [
        "observation:Room 1.",
        "env_state_hash:(2, 'x')",  # the environment's own name of its state, not the observation
        "observation:Right.",
    ]
    assert without.steps[0].state_key == 'prompt:[{"content": "Hi", "role": "user"}]'
    assert [s.step_reward for s in with_observation.steps] == [0.5, None, 1.0]
    assert [s.reward for s in with_observation.steps] == [0.3, 0.6, 1.0]  # the reward as returned, unchanged
    assert with_observation.step_states()[1] == (
        hashlib.blake2b(b"env_state_hash:(2, 'x')", digest_size=16).hexdigest(),
        None,
    )


@pytest.mark.parametrize("declared", [float("nan"), "0.5", True])
def test_a_declared_step_reward_must_be_a_finite_number(declared):
    class Bad(Environment):
        def reset(self, **row):
            return "Go."

        def step(self, action):
            return StepResult(None, done=True, info={"step_reward": declared})

    with pytest.raises(
        EnvironmentFailure, match=r"run 0 \(\), turn 0: Bad.step\(\): info\['step_reward'\]=.* a finite"
    ):
        MultiStepRollout(ScriptedGenerator(echo), Bad, max_env_steps=1)([{"prompt": "a"}])


# ---------------------------------------------------------------------------------------------------- errors
def test_bad_arguments():
    with pytest.raises(ValueError, match="max_env_steps must be >= 1, got 0"):
        MultiStepRollout(ScriptedGenerator(echo), CountdownEnv, max_env_steps=0)
    with pytest.raises(ValueError, match=r"history must be one of \('tokens', 'messages'\), got 'text'"):
        MultiStepRollout(ScriptedGenerator(echo), CountdownEnv, max_env_steps=1, history="text")
    # the name it had until issue 37 (it clashed with the training length), and the endpoint's
    with pytest.raises(TypeError, match="MultiStepRollout's max_steps is now max_env_steps"):
        MultiStepRollout(ScriptedGenerator(echo), CountdownEnv, max_steps=3)
    with pytest.raises(TypeError, match="PolicyEndpoint's max_calls is now max_env_steps"):
        PolicyEndpoint(ScriptedGenerator(echo), None, max_calls=3)
    with pytest.raises(RuntimeError, match="MultiStepRollout has no generator"):
        MultiStepRollout(None, CountdownEnv, max_env_steps=1)([{"prompt": "Hi", "turns": 1}])


def test_a_run_needs_a_prompt():
    class Silent(Environment):
        def reset(self, **row):
            return None

    with pytest.raises(ValueError, match="a run needs a prompt"):
        MultiStepRollout(ScriptedGenerator(echo), Silent, max_env_steps=1)([{"task": 1}])


def test_step_must_return_a_step_result():
    class Sloppy(Environment):
        def reset(self, **row):
            return "Go."

        def step(self, action):
            return ("obs", 1.0, True)

    with pytest.raises(
        EnvironmentFailure, match=r"run 0 \(\), turn 0: Sloppy.step\(\) must return a StepResult, got tuple"
    ):
        MultiStepRollout(ScriptedGenerator(echo), Sloppy, max_env_steps=2)([{"prompt": "a"}])


def test_an_unfinished_episode_needs_an_observation():
    class Mute(Environment):
        def reset(self, **row):
            return "Go."

        def step(self, action):
            return StepResult(None, done=False)

    with pytest.raises(
        EnvironmentFailure, match=r"turn 0: Mute.step\(\) returned no observation for an episode that is not done"
    ):
        MultiStepRollout(ScriptedGenerator(echo), Mute, max_env_steps=2)([{"prompt": "a"}])
    # on the last allowed turn no observation is needed: the run ends anyway
    (run,) = MultiStepRollout(ScriptedGenerator(echo), Mute, max_env_steps=1)([{"prompt": "a"}])
    assert run.done and len(run.steps) == 1
