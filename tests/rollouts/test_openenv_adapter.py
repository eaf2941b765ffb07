"""OpenEnv (``openenv-core``, the ``openenv`` extra) environments trained step-wise through OpenEnvEnvironment.

The environment is defined with OpenEnv's own base classes (``Environment``, ``Action``, ``Observation``,
``State``), served by OpenEnv's own FastAPI app on a loopback port by uvicorn in a thread, and reached with
OpenEnv's ``GenericEnvClient`` (WebSocket, one session per run); the server is stopped after the module.
"""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest

openenv = pytest.importorskip("openenv.core", reason="needs the openenv extra: pip install 'trinity-trl[openenv]'")
uvicorn = pytest.importorskip("uvicorn")

from openenv.core import Action, GenericEnvClient, Observation, State, create_fastapi_app  # noqa: E402
from openenv.core import Environment as OpenEnvBase  # noqa: E402

from trinity_trl.rollouts import MultiStepRollout, resolve_protocol  # noqa: E402
from trinity_trl.rollouts.openenv import OpenEnvEnvironment, observation_text  # noqa: E402


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    hint: str


class GuessEnv(OpenEnvBase):
    """Guess ``target`` (a reset argument); reward 1 when found, None while playing (OpenEnv's 'no reward')."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State()

    def reset(self, seed=None, episode_id=None, target: int = 5, **kwargs) -> GuessObservation:
        self.target, self._state = int(target), State(episode_id=episode_id, step_count=0)
        return GuessObservation(hint="Guess a number from 1 to 9.", done=False, reward=None)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        if action.guess == self.target:
            return GuessObservation(hint="Correct!", done=True, reward=1.0)
        return GuessObservation(hint="higher" if action.guess < self.target else "lower", done=False, reward=None)

    @property
    def state(self) -> State:
        return self._state


@pytest.fixture(scope="module")
def server_url():
    app = create_fastapi_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=16)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # loopback only, a free port
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the OpenEnv server did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()
    assert not thread.is_alive()


def number_action(text: str) -> dict:
    found = re.findall(r"-?\d+", text)
    return {"guess": int(found[-1]) if found else 0}


def make_env(url):
    return lambda: OpenEnvEnvironment(
        GenericEnvClient(base_url=url).sync(), action=number_action, instructions="Answer with one number."
    )


def test_observation_text():
    assert observation_text(GuessObservation(hint="higher", done=False, reward=None)) == "higher"
    assert observation_text({"a": 1, "b": "x", "done": True}) == '{"a": 1, "b": "x"}'


def test_the_adapter_is_a_reset_step_environment_that_plays_the_server(server_url):
    assert resolve_protocol(make_env(server_url), None, ["prompt", "target"])[0] == "reset/step"
    env = make_env(server_url)()
    assert (
        env.reset(target=7, unrelated="dropped by the server")
        == "Answer with one number.\n\nGuess a number from 1 to 9."
    )
    first = env.step("I guess 3")
    assert (first.observation, first.reward, first.done) == ("higher", None, False)
    last = env.step("7")
    assert (last.observation, last.reward, last.done) == ("Correct!", 1.0, True)
    env.close()


def test_in_process_openenv_environment():
    env = OpenEnvEnvironment(GuessEnv(), action=lambda text: GuessAction(**number_action(text)))
    assert env.reset(target=2) == "Guess a number from 1 to 9."
    assert env.step("2").done
    with pytest.raises(TypeError, match="an async EnvClient: pass client.sync"):
        OpenEnvEnvironment(object(), action=number_action)


class ScriptedGuesser:
    """A Generator that guesses 1, 2, 3, ... (one token per character)."""

    eos_token_id = 0
    eos_token_ids = {0}

    def render(self, messages, add_generation_prompt):
        return [t for m in messages for t in [*map(ord, m["content"]), 0]]

    def tokenize_conversations(self, conversations):
        return [self.render(c, True) for c in conversations]

    def generate(self, prompt_ids):
        # each turn adds two messages (the guess, the hint): guess the turn number
        return [[ord(str((ids.count(0) + 1) // 2)), 0] for ids in prompt_ids], None

    def decode(self, ids):
        return "".join(chr(t) for t in ids if t)


def test_multi_step_runs_against_the_server(server_url):
    runs = MultiStepRollout(ScriptedGuesser(), make_env(server_url), max_env_steps=4)(
        [{"target": 1}, {"target": 3}, {"target": 9}]
    )
    assert [(len(r.steps), r.reward, r.cut) for r in runs[:2]] == [(1, 1.0, False), (3, 1.0, False)]
    assert runs[2].cut and runs[2].reward != runs[2].reward  # stopped at 4 turns; None reward -> NaN (unscorable)


def test_step_grpo_trains_on_an_openenv_server(tmp_path, tiny_model_dir, server_url):
    from datasets import Dataset
    from helpers import tiny_grpo_kwargs

    from trinity_trl.trainers import StepGRPOConfig, StepGRPOTrainer

    trainer = StepGRPOTrainer(
        model=tiny_model_dir,
        args=StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), max_steps=1, max_env_steps=2)),
        train_dataset=Dataset.from_dict({"target": [3, 6, 1, 8]}),
        environment_factory=make_env(server_url),
    )
    trainer.train()
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert trainer.environment_protocol == "reset/step" and 1.0 <= logs["multi_step/steps_per_run"] <= 2.0
