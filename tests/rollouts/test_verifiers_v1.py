"""``VerifiersAgent`` with verifiers 0.4's v1 stack (trinity_trl/rollouts/verifiers.py): a ``vf.SingleAgentEnv`` over a
taskset built locally (tests/rollouts/verifiers_v1_calc.py), played by verifiers' own ``null`` harness on the
``subprocess`` runtime, trained by ``StepGRPOTrainer`` offline.

verifiers 0.4 is not in the project's environment: ``make test-verifiers-04`` builds ``.venv-vf04`` (verifiers 0.4,
``uv``, and a local folder of the wheels the harness program needs) and runs this file there; with another verifiers
it is skipped.
During training every connection beyond loopback goes to a dead proxy, so nothing reaches the network.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import tiny_grpo_kwargs
from trainers import test_step_grpo_tools as tool_tests
from trainers.test_step_grpo_tools import Recording, force_turns, logs_of, task_of

from trinity_trl.trainers import StepGRPOConfig

vf = pytest.importorskip("verifiers.v1", reason="verifiers 0.4 is not installed (make test-verifiers-04)")
pytest.importorskip("verifiers.v1.configs.agent", reason="verifiers 0.4 is not installed (make test-verifiers-04)")
if not hasattr(sys.modules["verifiers.v1.configs.agent"], "agent_config_fields"):
    pytest.skip("verifiers 0.3.1's v1 API, not 0.4's (make test-verifiers-04)", allow_module_level=True)

from trinity_trl.rollouts.verifiers import VerifiersAgent  # noqa: E402

tool_model_dir = tool_tests.tool_model_dir  # the tiny Qwen2 with TRL's Qwen2.5 chat template
HERE = Path(__file__).resolve().parent
#: the local package sources of the harness program (made by `make test-verifiers-04`)
WHEELS = Path(os.environ.get("TRINITY_VF04_WHEELS", Path(sys.prefix) / "wheels"))


@pytest.fixture
def offline(monkeypatch):
    """Loopback only: every other HTTP(S) connection (pip, uv, httpx, openai) goes to a dead proxy."""
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(key, "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.syspath_prepend(str(HERE))  # the taskset module, loaded by verifiers by name


def local_harness(tmp_path) -> dict:
    """The null harness, its uv program prepared from local sources only."""
    assert any(WHEELS.glob("openai-*.whl")), f"no local wheels of the harness program at {WHEELS} (see the Makefile)"
    index = tmp_path / "index"
    index.mkdir(parents=True)
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    assert shutil.which("uv", path=path), "uv is part of the verifiers 0.4 test environment"
    return {
        "id": "null",
        "env": {
            "PATH": path,
            "UV_DEFAULT_INDEX": index.as_uri(),
            "UV_FIND_LINKS": str(WHEELS),
            "UV_PYTHON_DOWNLOADS": "never",
            "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
        },
    }


def calc_env(harness: dict, runtime: str = "subprocess"):
    config = vf.SingleAgentEnvConfig(
        taskset={"id": "verifiers_v1_calc"}, agent={"runtime": {"type": runtime}, "harness": harness}
    )
    return vf.SingleAgentEnv(config)


def recording_trainer(agent: VerifiersAgent, tmp_path, tool_model_dir, max_steps: int) -> Recording:
    """A `Recording` StepGRPOTrainer over ``agent``'s tasks: 2 runs of each of 2 tasks a step, turns of 64 tokens."""
    kwargs = tiny_grpo_kwargs(
        output_dir=str(tmp_path / "out"),
        max_steps=max_steps,
        shuffle_dataset=False,
        max_completion_length=64,
        temperature=1.0,
        num_generations=2,
        per_device_train_batch_size=4,
    )
    return Recording(model=tool_model_dir, args=StepGRPOConfig(**kwargs), train_dataset=agent.dataset(), agent=agent)


def test_a_verifiers_0_4_env_trains_two_steps_with_its_task_rewards(tmp_path, tool_model_dir, offline, monkeypatch):
    from trinity_trl.rollouts.endpoint import PolicyEndpoint

    served = []  # (path, streamed) of every request the endpoint parsed
    parse = PolicyEndpoint._parse

    def spy(self, record, raw, wire):
        pending = parse(self, record, raw, wire)
        served.append((record.key, pending.request.stream))
        return pending

    monkeypatch.setattr(PolicyEndpoint, "_parse", spy)
    paths = []
    authorize = PolicyEndpoint._authorize

    def spy_authorize(self, request):
        paths.append(request.url.path)
        return authorize(self, request)

    monkeypatch.setattr(PolicyEndpoint, "_authorize", spy_authorize)
    agent = VerifiersAgent(calc_env(local_harness(tmp_path)))
    data = agent.dataset()
    assert data["task_index"] == [0, 1]
    trainer = recording_trainer(agent, tmp_path, tool_model_dir, max_steps=2)
    seen = []

    class ReadRuns(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            seen.append(list(trainer.agent_runs))

    trainer.add_callback(ReadRuns())
    record, answered = [], Counter()

    def script(text: str) -> str:
        """Each task's first answer of a step is right (reward 1), its second wrong (reward 0)."""
        task = task_of(text)
        answered[task] += 1
        return f"It is {task * 3 - 1}." if answered[task] % 2 else "It is 99."

    force_turns(trainer, script, record)
    trainer.train()
    assert trainer.state.global_step == 2 and len(seen) == 2
    for step, runs in enumerate(seen):
        # verifiers' trace reward (the task's @vf.reward) is each run's reward, and it reaches the loss: the
        # group-normalised advantages of task 0's runs are above those of task 1's
        assert [run.row["task_index"] for run in runs] == [0, 0, 1, 1] and {run.outcome for run in runs} == {"ok"}
        assert sorted(run.reward for run in runs[:2]) == sorted(run.reward for run in runs[2:]) == [0.0, 1.0]
        assert all(run.info["rewards"] == {"correct": run.reward} for run in runs)
        advantages = trainer.batches[step]["advantages"]
        advantages = (advantages[:, 0] if advantages.dim() == 2 else advantages).tolist()
        assert [a > 0 for a in advantages] == [run.reward == 1.0 for run in runs] and 0.0 not in advantages
        # one model call per run (the null harness's chat loop), recorded exactly as the generator sampled it
        assert all(len(run.calls) == 1 for run in runs)
    steps = [s for runs in seen for run in runs for s in run.steps]
    assert sorted(steps) == sorted((p, c, lp) for p, c, lp in record) and len(steps) == 8
    # issue 46 item 5: no relay: verifiers' interception server sends the harness's request as it was written
    # (streamed) straight to the endpoint, at each run's own base URL (its key in the path)
    assert len(served) == 8 and all(streamed for _, streamed in served)
    assert sorted(paths) == sorted(f"/runs/{key}/v1/chat/completions" for key, _ in served)
    logs = logs_of(trainer)
    assert logs["agent/errors"] == 0.0 and logs["rewards/environment_reward/mean"] == pytest.approx(0.5)


def test_what_cannot_run_offline_is_refused_in_one_line(tmp_path, offline, monkeypatch):
    with pytest.raises(ValueError, match=r"'prime' runtime \(Prime's remote sandboxes\)"):
        VerifiersAgent(calc_env({"id": "null"}, runtime="prime"))
    with pytest.raises(ValueError, match=r"harness 'claude_code' offline: it installs a third-party program"):
        VerifiersAgent(calc_env({"id": "claude_code"}))
    # the null harness with PyPI as its index: verifiers would fetch uv's packages from the network
    harness = local_harness(tmp_path)
    del harness["env"]["UV_DEFAULT_INDEX"]
    monkeypatch.delenv("UV_DEFAULT_INDEX", raising=False)
    monkeypatch.delenv("UV_INDEX_URL", raising=False)
    with pytest.raises(ValueError, match=r"harness 'null'.s program offline: its package index is PyPI"):
        VerifiersAgent(calc_env(harness))
    with pytest.raises(ValueError, match="n=1"):
        VerifiersAgent(calc_env(local_harness(tmp_path / "n")), sampling_args={"n": 2})


def test_a_call_the_door_refuses_ends_only_its_rollout(tmp_path, tool_model_dir, offline):
    # every call asks for max_tokens=0, which the endpoint refuses (400): verifiers' harness sees the refusal, its
    # rollout ends with the error, and training goes on with each run failed and counted
    agent = VerifiersAgent(calc_env(local_harness(tmp_path)), sampling_args={"max_tokens": 0})
    trainer = recording_trainer(agent, tmp_path, tool_model_dir, max_steps=1)
    force_turns(trainer, lambda text: "It is -1.")
    trainer.train()
    assert trainer.state.global_step == 1
    runs = trainer.agent_runs
    assert [run.outcome for run in runs] == ["error"] * 4 and all(run.reward == 0.0 for run in runs)
    # the run's fault is verifiers' own record of the endpoint's answer, naming the refused field
    assert all("ended before it was scored" in run.info and "max_tokens" in run.info for run in runs)
    logs = logs_of(trainer)
    assert logs["agent/errors"] == 4.0 and logs["agent/rejected_requests"] == 4.0 and logs["agent/requests"] == 0.0


def test_an_episode_of_several_runs_fails_its_rollout_in_one_line(tmp_path, tool_model_dir, offline):
    # verifiers' best-of-n env plays its one seat n times per episode, each run with its own reward: one rollout of
    # the door is one run, so such an episode is a failed run naming why, and training goes on
    from verifiers.v1.envs.best_of_n.env import BestOfNEnv, BestOfNEnvConfig

    config = BestOfNEnvConfig(
        taskset={"id": "verifiers_v1_calc"},
        agent={"runtime": {"type": "subprocess"}, "harness": local_harness(tmp_path)},
        n=2,
    )
    agent = VerifiersAgent(BestOfNEnv(config))
    trainer = recording_trainer(agent, tmp_path, tool_model_dir, max_steps=1)
    force_turns(trainer, lambda text: "It is -1.")
    trainer.train()
    runs = trainer.agent_runs
    assert [run.outcome for run in runs] == ["error"] * 4
    assert all("played its seat 2 times (BestOfNEnv)" in run.info for run in runs)
    assert logs_of(trainer)["agent/errors"] == 4.0
