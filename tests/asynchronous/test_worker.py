"""TransformersRolloutWorker and LocalWeightTransfer: what a sample records, when weights change, the reward rule,
and how a failing or stalled worker is reported."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from async_helpers import recomputed_logps, send
from helpers import TINY_MODEL_TERMS, build_tiny_model, build_tiny_tokenizer, tiny_conversational_dataset
from tolerance import assert_close

from trinity_trl.algorithms import ADVANTAGE_FN, KL_FN, POLICY_LOSS_FN
from trinity_trl.asynchronous.worker import GroupScorer, TransformersRolloutWorker
from trinity_trl.training.advantages import AdvantageEstimator, group_advantages

G = 4


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def scorer(reward_funcs, advantage: str = "grpo") -> GroupScorer:
    estimator = AdvantageEstimator(
        ADVANTAGE_FN.get(advantage)(),
        POLICY_LOSS_FN.get("ppo")(clip_range=0.2),
        KL_FN.get("none")(),
        gather=lambda x: x,
        pad_across_processes=lambda x, **k: x,
    )
    names = [f.__name__ for f in reward_funcs]
    return GroupScorer(reward_funcs, names, torch.ones(len(reward_funcs)), estimator)


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def make_worker(tokenizer, reward_funcs=(length_reward,), temperature=0.7, max_completion_length=6, **kwargs):
    model = build_tiny_model(tokenizer, seed=0)
    return TransformersRolloutWorker(
        model,
        tokenizer,
        tiny_conversational_dataset(8),
        scorer(list(reward_funcs)),
        num_generations=G,
        max_completion_length=max_completion_length,
        temperature=temperature,
        eos_token_ids=[tokenizer.eos_token_id],
        **kwargs,
    )


def assert_logps_of(model, samples) -> None:
    """Each sample's recorded log-probs are those of a plain forward of ``model`` (the weights that sampled it)."""
    for sample in samples:
        assert_close(
            torch.tensor(sample.old_log_probs[sample.completion_mask == 1]),
            recomputed_logps(model, sample),
            terms=TINY_MODEL_TERMS,
        )


def test_recorded_tokens_and_logprobs_are_what_was_sampled(tokenizer):
    """The ids of a sample are the ids ``generate`` drew (through the first end-of-sequence token), and its log-probs
    are those ids' log-probabilities at the sampling temperature under the weights the worker holds (the trainer's
    weights of the sync), recomputed here by a plain forward of the trainer's model."""
    worker = make_worker(tokenizer)
    trainer_model = build_tiny_model(tokenizer, seed=7)  # other weights than the worker's initial copy
    send(worker, trainer_model, version=3)
    worker._load_committed()
    drawn = []
    generate = worker.model.generate

    def recording(**kwargs):
        out = generate(**kwargs)
        drawn.append(out.sequences.clone())
        return out

    worker.model.generate = recording
    torch.manual_seed(0)
    samples, _ = worker.rollout_group(position=0)
    assert len(samples) == G and {s.model_version for s in samples} == {3}
    (sequences,) = drawn
    for sample, sequence in zip(samples, sequences):
        prompt_length = int((sample.completion_mask == 0).sum())
        completion = sample.input_ids[prompt_length:].tolist()
        new = sequence[prompt_length:].tolist()
        assert completion == new[: len(completion)]  # what was drawn ...
        if tokenizer.eos_token_id in new:  # ... through the first end-of-sequence token, nothing after
            assert completion == new[: new.index(tokenizer.eos_token_id) + 1]
        else:
            assert len(completion) == len(new)
        ids = torch.tensor(sample.input_ids).unsqueeze(0)
        with torch.no_grad():
            logits = trainer_model(input_ids=ids).logits[0, prompt_length - 1 : -1].float() / 0.7
        expected = torch.log_softmax(logits, -1).gather(-1, ids[0, prompt_length:].unsqueeze(-1)).squeeze(-1)
        recorded = torch.tensor(sample.old_log_probs[prompt_length:])
        assert_close(recorded, expected, terms=TINY_MODEL_TERMS)


def test_new_weights_are_taken_between_groups_only(tokenizer):
    """A weight sync that arrives while a group is being generated (here: at its third forward) is not used for that
    group: every token of it comes from the weights it started with, whose version it carries; the next group is
    generated with the new weights and carries their version. Sent but never committed weights are not used."""
    old_model, new_model = build_tiny_model(tokenizer, seed=5), build_tiny_model(tokenizer, seed=11)
    worker = make_worker(tokenizer)
    send(worker, old_model, version=1)
    worker._load_committed()
    forward, calls = worker.model.forward, []

    def syncing_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            send(worker, new_model, version=2)  # the trainer's sync, from inside the group's generation
        return forward(*args, **kwargs)

    worker.model.forward = syncing_forward
    torch.manual_seed(0)
    first, _ = worker.rollout_group(0)
    assert len(calls) > 3 and {s.model_version for s in first} == {1}
    assert_logps_of(old_model, first)
    worker._load_committed()  # what the worker's loop does before each group
    second, _ = worker.rollout_group(1)
    assert {s.model_version for s in second} == {2}
    assert_logps_of(new_model, second)
    staged_only = make_worker(tokenizer)
    staged_only.stage_weights(iter(new_model.named_parameters()))  # sent, never committed by TRL
    staged_only._load_committed()
    assert staged_only.model_version == -1


def test_a_weight_lag_generates_with_the_weights_of_that_many_syncs_before(tokenizer):
    """``weight_lag=2``: after each of five syncs the worker holds the weights received two syncs before the newest
    (the oldest received until three have come), and a group's samples carry that version and its log-probs; a lag
    of 0 holds the newest."""
    models = {version: build_tiny_model(tokenizer, seed=20 + version) for version in range(1, 6)}
    lagged, fresh = make_worker(tokenizer, weight_lag=2), make_worker(tokenizer)
    held = []
    for version, model in models.items():
        for worker in (lagged, fresh):
            send(worker, model, version=version)
            worker._load_committed()  # what the worker's loop does before each group
        held.append((lagged.model_version, fresh.model_version))
    assert held == [(1, 1), (1, 2), (1, 3), (2, 4), (3, 5)]
    torch.manual_seed(0)
    samples, _ = lagged.rollout_group(0)
    assert {s.model_version for s in samples} == {3}
    for sample in samples:
        assert_close(
            torch.tensor(sample.old_log_probs[sample.completion_mask == 1]),
            recomputed_logps(models[3], sample),
            terms=TINY_MODEL_TERMS,
        )
    with pytest.raises(ValueError, match="weight_lag must be >= 0, got -1"):
        make_worker(tokenizer, weight_lag=-1)


def test_unscorable_rewards_follow_the_synchronous_rule(tokenizer):
    """A None, NaN or infinite reward makes the completion unscorable: no trained token, advantage 0, left out of the
    group's statistics (the others' advantages are the synchronous trainers' `group_advantages` of the scored ones),
    counted in ``unscorable_count`` (docs/guarantees.md). TRL's worker would let the inf poison the whole group."""
    values = [1.0, float("inf"), None, 3.0]

    def reward(completions, **kwargs):
        return values

    worker = make_worker(tokenizer, reward_funcs=[reward])
    send(worker, build_tiny_model(tokenizer), version=1)
    worker._load_committed()
    samples, metrics = worker.rollout_group(0)
    trained = [bool(s.completion_mask.sum()) for s in samples]
    assert trained == [True, False, False, True]
    assert [s.advantage for s in samples][1:3] == [0.0, 0.0]
    expected, kept, _, _ = group_advantages(
        ADVANTAGE_FN.get("grpo")(), torch.tensor([1.0, float("nan"), float("nan"), 3.0]), G, 0
    )
    assert kept.tolist() == trained
    assert_close(torch.tensor([s.advantage for s in samples]), expected)
    assert all(torch.isfinite(torch.tensor([s.advantage for s in samples])))
    assert metrics["unscorable_count"] == 2.0


def _wait(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_a_failing_worker_is_reported_in_one_line(tokenizer):
    def broken(completions, **kwargs):
        raise ValueError("reward server unreachable")

    worker = make_worker(tokenizer, reward_funcs=[broken])
    send(worker, build_tiny_model(tokenizer), version=1)
    worker.start()
    _wait(lambda: worker._failure is not None)
    with pytest.raises(RuntimeError) as info:
        worker.check_health(stale_after_s=300)
    message = str(info.value)
    assert "\n" not in message and "reward server unreachable" in message and "ValueError" in message
    worker.stop()


def test_a_stalled_worker_is_reported_and_stops_without_hanging(tokenizer):
    """A reward function that hangs stops the worker's progress (a slow generation would not: each token is progress),
    and ``check_health`` reports it; stop() returns although the thread is stuck."""
    entered, release = threading.Event(), threading.Event()

    def hangs(completions, **kwargs):
        entered.set()
        release.wait(60)
        return [0.0] * len(completions)

    worker = make_worker(tokenizer, reward_funcs=[hangs])
    send(worker, build_tiny_model(tokenizer), version=1)
    worker.start()
    assert entered.wait(60)
    worker.check_health(stale_after_s=300)  # alive and not yet stale
    time.sleep(0.6)
    with pytest.raises(RuntimeError, match="stalled: no progress for") as info:
        worker.check_health(stale_after_s=0.5)
    assert "\n" not in str(info.value)
    worker.stop(timeout=0.5)  # the thread is stuck in the reward function: stop() returns, leaving a daemon thread
    release.set()


def test_the_worker_waits_for_the_trainer(tokenizer):
    """Generation pauses while ``max_queued_samples`` samples wait (more would only go stale), and a stopped worker
    ends its thread."""
    worker = make_worker(tokenizer, max_queued_samples=G)
    send(worker, build_tiny_model(tokenizer), version=1)
    worker.start()
    _wait(lambda: worker.rollout_buffer.qsize() >= G)
    time.sleep(0.5)
    assert worker.rollout_buffer.qsize() == G  # one group, then it waits
    worker.check_health(stale_after_s=0.4)  # waiting for the trainer is not a stall
    thread = worker._thread
    worker.stop()
    assert not thread.is_alive()


def test_a_slow_generation_is_progress_not_a_stall(tokenizer):
    """Each generated token counts as progress: a group whose generation takes longer than heartbeat_stale_after_s
    (here: every token slowed) is not reported as a stall while it generates."""
    worker = make_worker(tokenizer, max_completion_length=8)
    send(worker, build_tiny_model(tokenizer), version=1)
    forward = worker.model.forward
    checks = []

    def slow_forward(*args, **kwargs):
        time.sleep(0.3)
        if worker._thread is not None:
            worker.check_health(stale_after_s=0.5)  # no RuntimeError: the last token was 0.3 s ago
            checks.append(1)
        return forward(*args, **kwargs)

    worker.model.forward = slow_forward
    worker.start()
    _wait(lambda: worker.rollout_buffer.qsize() >= G or worker._failure is not None, timeout=120)
    worker.stop()
    assert worker._failure is None and len(checks) >= 4  # the group took > 0.5 s x 4 and was never stale


def test_a_steps_groups_come_from_one_generate_call_each_group_prefilled_once(tokenizer):
    """``groups_per_generate`` groups (an optimizer step's) are sampled by one ``generate`` call whose grouped prefill
    encodes each group's prompt once; each group is scored on its own and its log-probs are those of the weights."""
    worker = make_worker(tokenizer, groups_per_generate=3)
    trainer_model = build_tiny_model(tokenizer, seed=7)
    send(worker, trainer_model, version=2)
    worker._load_committed()
    generate, calls = worker.model.generate, []
    forwards = []
    handle = worker.model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )

    def counting(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return generate(*args, **kwargs)

    worker.model.generate = counting
    try:
        groups = worker.rollout_groups([0, 1, 2])
    finally:
        handle.remove()
    assert calls == [3 * G] and forwards[0] == 3  # one call; its prefill: the 3 distinct prompts
    assert [len(samples) for samples, _ in groups] == [G, G, G]
    assert [{s.group_id for s in samples} for samples, _ in groups] == [{0}, {1}, {2}]
    prompts = [worker.dataset[worker.order.row(p)]["prompt"] for p in range(3)]
    for (samples, metrics), prompt in zip(groups, prompts):
        assert all(s.prompt == prompt and s.model_version == 2 for s in samples)
        assert metrics["rollout/generate_s"] > 0
        assert_logps_of(trainer_model, samples)


def test_a_repetition_penalty_changes_the_draws_not_the_recorded_logprobs(tokenizer):
    """The recorded log-probs are ``log_softmax(logits / T)`` of the model's own logits, before the repetition penalty
    (as before top-k/top-p): what the trainer's forward computes."""
    worker = make_worker(tokenizer, repetition_penalty=3.0)
    trainer_model = build_tiny_model(tokenizer, seed=7)
    send(worker, trainer_model, version=1)
    worker._load_committed()
    torch.manual_seed(0)
    samples, _ = worker.rollout_group(0)
    assert_logps_of(trainer_model, samples)


def test_compiled_decoding_in_the_worker_decodes_with_the_weights_it_loaded(tokenizer):
    """compile_generation='on' (torch's eager backend, on this CPU): the worker's static cache holds the dataset's
    longest prompt, and weights loaded in place between two calls are the ones the next compiled call samples with
    (recorded log-probs are those of a plain forward of the new weights), without compiling again."""
    from transformers import CompileConfig

    worker = make_worker(
        tokenizer, compile_generation="on", compile_config=CompileConfig(backend="eager", mode="default")
    )
    assert worker.decoding.choice.compiled and worker.decoding.cache_length.tokens == 64
    for version, seed in ((1, 5), (2, 11)):
        trainer_model = build_tiny_model(tokenizer, seed=seed)
        send(worker, trainer_model, version=version)
        worker._load_committed()
        samples, _ = worker.rollout_group(version)
        assert_logps_of(trainer_model, samples)
        if version == 1:
            compiled = worker.decoding.compilations
    assert compiled >= 1 and worker.decoding.compilations == compiled
