"""AsyncTrinityTrainer: the asynchronous trainers' loss is the synchronous trainers' loss.

On a fixed batch, TRL's packed micro-batch through `AsyncTrinityTrainer.compute_loss` (tree attention on our kernel,
the per-sample layout, the shared `TrinityLossMixin`) gives the same loss and the same gradient of every parameter as
`TrinityTrainer._compute_loss` on TRL's padded rows, in float64 on a CPU, for each component and normalisation below.
Also here: the config (fields honoured or refused in one line) and what the trainer refuses.
"""

from __future__ import annotations

import threading
from dataclasses import fields

import pytest
import torch
from async_helpers import packed_batch, rollout_sample, save_float64_model, tiny_async_kwargs
from datasets import Dataset
from helpers import TINY_MODEL_TERMS, length_reward, tiny_conversational_dataset, tiny_grpo_kwargs
from tolerance import assert_close
from trl import GRPOTrainer
from trl.trainer.utils import pad

from trinity_trl.asynchronous.async_grpo_seams import POLICY_VERSION_KEY
from trinity_trl.trainers import (
    AsyncChordConfig,
    AsyncChordTrainer,
    AsyncSAPOConfig,
    AsyncSAPOTrainer,
    AsyncTrinityConfig,
    AsyncTrinityTrainer,
    ChordConfig,
    ChordTrainer,
    SAPOConfig,
    SAPOTrainer,
    TrinityConfig,
    TrinityTrainer,
)

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")

F64 = {"model_init_kwargs": {"dtype": "auto"}}  # the synchronous trainers load the float64 checkpoint as it is


@pytest.fixture(scope="module")
def float64_model_dir(tmp_path_factory):
    from helpers import build_tiny_tokenizer

    return save_float64_model(tmp_path_factory.mktemp("tiny_qwen2_f64"), build_tiny_tokenizer())


def expert_dataset(n: int = 8) -> Dataset:
    rows = tiny_conversational_dataset(n)
    return Dataset.from_dict(
        {"prompt": rows["prompt"], "completion": [[{"role": "assistant", "content": a}] for a in rows["answer"]]}
    )


# ------------------------------------------------------------------------------------------- the fixed batch
# four completions of two prompts; the first two share their first two tokens (the tree forks inside a completion);
# every completion is trained from its first token and the widest one is whole, so the padded rows' width is the
# widest sample (the one layout difference: docs/asynchronous.md#what-it-does-not-run)
COMPLETIONS = [[17, 23, 40, 41, 42, 43], [17, 23, 50, 51], [60, 61, 62, 63, 64, 65], [70, 71, 72]]
PROMPTS = [0, 0, 1, 1]
ADVANTAGES = [1.0, -0.5, 0.3, -0.8]


def _prompt_ids(tokenizer) -> list[list[int]]:
    rows = tiny_conversational_dataset(2)
    return [
        tokenizer(tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True))["input_ids"]
        for p in rows["prompt"]
    ]


def _perturb(model, seed: int = 3) -> None:
    """Move the policy off the checkpoint (the reference), the same way in both trainers."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(0.02 * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def _padded_inputs(tokenizer, old_logps: list[list[float]], expert: list[bool] | None = None) -> dict:
    prompts = _prompt_ids(tokenizer)
    prompt_rows = [torch.tensor(prompts[p]) for p in PROMPTS]
    completion_rows = [torch.tensor(c) for c in COMPLETIONS]
    inputs = {
        "prompt_ids": pad(prompt_rows, padding_value=tokenizer.pad_token_id, padding_side="left"),
        "prompt_mask": pad([torch.ones_like(r) for r in prompt_rows], padding_value=0, padding_side="left"),
        "completion_ids": pad(completion_rows, padding_value=tokenizer.pad_token_id, padding_side="right"),
        "completion_mask": pad([torch.ones_like(r) for r in completion_rows], padding_value=0, padding_side="right"),
        "old_per_token_logps": pad(
            [torch.tensor(lp, dtype=torch.float64) for lp in old_logps], padding_value=0.0, padding_side="right"
        ),
        "advantages": torch.tensor(ADVANTAGES, dtype=torch.float32),
    }
    if expert is not None:
        inputs["expert_mask"] = torch.tensor(expert)
        inputs["advantages"] = inputs["advantages"].masked_fill(inputs["expert_mask"], 0.0)
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    inputs["global_loss_tokens"] = inputs["completion_mask"].sum().float()
    inputs["global_loss_rows"] = torch.tensor(4.0)
    return inputs


def _packed_inputs(tokenizer, old_logps, expert: list[bool] | None = None) -> dict:
    prompts = _prompt_ids(tokenizer)
    samples = []
    for i, completion in enumerate(COMPLETIONS):
        is_expert = expert is not None and expert[i]
        metrics = {"chord/expert_share": 1.0} if is_expert else {POLICY_VERSION_KEY: 0.0}
        samples.append(
            rollout_sample(
                prompts[PROMPTS[i]],
                completion,
                [0.0] * len(completion) if is_expert else old_logps[i],
                0.0 if is_expert else ADVANTAGES[i],
                group_id=PROMPTS[i],
                metrics=metrics,
            )
        )
    return packed_batch(samples, tokenizer.pad_token_id)


def _noisy_logps(trainer, inputs: dict, lengths: list[int]) -> list[list[float]]:
    """Behaviour log-probs of the padded ``inputs``' completions (``lengths`` tokens each) off the current policy,
    with noise (ratios far from 1), rounded to float32 as TRL's queue carries them."""
    with torch.no_grad():
        logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer,
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
            inputs["completion_ids"].shape[1],
        )
    generator = torch.Generator().manual_seed(1)
    noisy = logps + 0.3 * torch.randn(logps.shape, generator=generator, dtype=logps.dtype)
    return [noisy[i, :n].float().tolist() for i, n in enumerate(lengths)]


def _old_logps(trainer, tokenizer) -> list[list[float]]:
    """`_noisy_logps` of the fixed batch."""
    inputs = _padded_inputs(tokenizer, [[0.0] * len(c) for c in COMPLETIONS])
    return _noisy_logps(trainer, inputs, [len(c) for c in COMPLETIONS])


def _twins(tmp_path, model_dir, dataset, options: dict) -> tuple[TrinityTrainer, AsyncTrinityTrainer]:
    """`TrinityTrainer` and `AsyncTrinityTrainer` of ``options`` on the float64 checkpoint, both moved off it alike."""
    sync = TrinityTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "s"), prefix_packing=False, **F64, **options)),
        train_dataset=dataset,
    )
    asynchronous = AsyncTrinityTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=AsyncTrinityConfig(**tiny_async_kwargs(output_dir=str(tmp_path / "a"), dtype="auto", **options)),
        train_dataset=dataset,
    )
    assert sync.model.dtype == asynchronous.model.dtype == torch.float64
    _perturb(sync.model), _perturb(asynchronous.model)
    return sync, asynchronous


def _grads(model) -> dict:
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _sync_loss(trainer, inputs):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad(set_to_none=True)
    if "ref_per_token_logps" not in inputs and trainer.algorithm.needs_reference:
        # as TRL computes them: the reference model, or the policy with its adapter disabled under LoRA
        inputs["ref_per_token_logps"] = trainer.scoring.reference_logps(inputs)
    loss = trainer._compute_loss(trainer.model, dict(inputs))
    loss.backward()
    return loss.detach(), _grads(trainer.model)


def _async_loss(trainer, batch):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    return loss.detach(), _grads(trainer.model)


def _assert_same(sync, asynchronous):
    """The model computes in float64, but TRL's fused LM head (both trainers') accumulates log-probs in float32 and
    TRL's queue carries behaviour log-probs and advantages in float32: float32's tolerance for the tiny model's sums."""
    (loss_s, grads_s), (loss_a, grads_a) = sync, asynchronous
    assert_close(loss_a.double(), loss_s.double(), terms=TINY_MODEL_TERMS, dtype=torch.float32)
    assert grads_s.keys() == grads_a.keys() and grads_s
    for name in grads_s:
        assert_close(grads_a[name], grads_s[name], terms=TINY_MODEL_TERMS, dtype=torch.float32, msg=name)
    assert any(g.abs().max() > 1e-6 for g in grads_s.values()), "all-zero gradients prove nothing"


CASES = {
    # CISPO preset: GRPO advantages, k2 KL loss against our reference forward, token-mean
    "cispo": {"algorithm": "cispo"},
    # sequence-level ratios (a sample's tokens must stay one row)
    "gspo": {"algorithm": "gspo"},
    "grpo-k3-entropy-seq-mean-token-mean": {
        "algorithm": "grpo",
        "kl_loss": {"name": "k3", "kl_coef": 0.05},
        "entropy_loss": {"entropy_coef": 0.01},
        "loss_agg_mode": "seq-mean-token-mean",
    },
    "grpo-seq-mean-token-sum-norm": {"algorithm": "grpo", "loss_agg_mode": "seq-mean-token-sum-norm"},
    "ppo-global-normalization": {"algorithm": "ppo", "loss_normalization": "global", "advantage": "grpo"},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_async_loss_and_gradient_equal_the_synchronous_trainers(case, tmp_path, float64_model_dir, tiny_dataset):
    options = CASES[case]
    if options["algorithm"] == "ppo":  # the critic-free part of PPO's loss: its clip, a group advantage
        options = {**options, "algorithm": "grpo", "policy_loss": "ppo"}
    sync, asynchronous = _twins(tmp_path, float64_model_dir, tiny_dataset, options)
    tokenizer = sync.processing_class
    old = _old_logps(sync, tokenizer)
    _assert_same(
        _sync_loss(sync, _padded_inputs(tokenizer, old)), _async_loss(asynchronous, _packed_inputs(tokenizer, old))
    )


def test_async_sapo_equals_sapo_trainer(tmp_path, float64_model_dir, tiny_dataset):
    sync = SAPOTrainer(
        model=float64_model_dir,
        reward_funcs=length_reward,
        args=SAPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "s"), prefix_packing=False, **F64)),
        train_dataset=tiny_dataset,
    )
    asynchronous = AsyncSAPOTrainer(
        model=float64_model_dir,
        reward_funcs=length_reward,
        args=AsyncSAPOConfig(**tiny_async_kwargs(output_dir=str(tmp_path / "a"), dtype="auto")),
        train_dataset=tiny_dataset,
    )
    _perturb(sync.model), _perturb(asynchronous.model)
    tokenizer = sync.processing_class
    old = _old_logps(sync, tokenizer)
    _assert_same(
        _sync_loss(sync, _padded_inputs(tokenizer, old)), _async_loss(asynchronous, _packed_inputs(tokenizer, old))
    )


@pytest.mark.parametrize("phi", [True, False], ids=["chord-phi", "chord-mu"])
def test_async_chord_equals_chord_trainer_on_a_mixed_batch(phi, tmp_path, float64_model_dir, tiny_dataset):
    """Three rollouts and one demonstration in one micro-batch: ChordTrainer weighs each of its 3 rollouts 1/3 and its
    demonstration 1/1 (per_device_train_batch_size 3, expert_batch_size 1); AsyncChordTrainer the same from the
    optimizer step's counts."""
    schedule = {
        "mu_warmup_steps": 0,
        "mu_decay_steps": 4,
        "mu_peak": 0.9,
        "mu_valley": 0.05,
        "enable_phi_function": phi,
    }
    sync = ChordTrainer(
        model=float64_model_dir,
        reward_funcs=length_reward,
        args=ChordConfig(
            **tiny_grpo_kwargs(
                output_dir=str(tmp_path / "s"),
                prefix_packing=False,
                **F64,
                per_device_train_batch_size=3,
                num_generations=3,
                expert_batch_size=1,
                **schedule,
            )
        ),
        train_dataset=tiny_dataset,
        expert_dataset=expert_dataset(),
    )
    asynchronous = AsyncChordTrainer(
        model=float64_model_dir,
        reward_funcs=length_reward,
        args=AsyncChordConfig(**tiny_async_kwargs(output_dir=str(tmp_path / "a"), dtype="auto", **schedule)),
        train_dataset=tiny_dataset,
        expert_dataset=expert_dataset(),
    )
    _perturb(sync.model), _perturb(asynchronous.model)
    tokenizer = sync.processing_class
    old = _old_logps(sync, tokenizer)
    expert = [False, False, False, True]
    _assert_same(
        _sync_loss(sync, _padded_inputs(tokenizer, old, expert)),
        _async_loss(asynchronous, _packed_inputs(tokenizer, old, expert)),
    )


# ------------------------------------------------------------------------------------------------ runs
def _train_run(tmp_path, model_dir, dataset, worker=None, reward_funcs=length_reward, **overrides):
    from async_helpers import NoTransfer

    args = AsyncTrinityConfig(**tiny_async_kwargs(output_dir=str(tmp_path / "run"), **overrides))
    extra = {"rollout_worker": worker, "weight_transfer": NoTransfer()} if worker is not None else {}
    return AsyncTrinityTrainer(model=model_dir, reward_funcs=reward_funcs, args=args, train_dataset=dataset, **extra)


def test_trains_with_its_own_worker_and_logs_staleness(tmp_path, tiny_model_dir, tiny_dataset):
    trainer = _train_run(tmp_path, tiny_model_dir, tiny_dataset, max_steps=3, algorithm="cispo")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 3
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    logged = [entry for entry in trainer.state.log_history if "actor/loss" in entry]
    assert len(logged) == 3
    assert all(entry["async/staleness"] <= entry["async/staleness_max"] <= 4 for entry in logged)  # max_staleness 4
    assert not trainer.rollout_worker._thread  # stopped by TRL's training loop


def _scripted(stale_every: int = 0, untrained_before: int = 0, **kwargs):
    """A scripted worker of groups of 4 samples; every ``stale_every``-th sample far too stale, and the first
    ``untrained_before`` samples with no token to train (unscorable)."""
    from async_helpers import ScriptedWorker

    stale = []

    def make_sample(n, version):
        old = stale_every and n % stale_every == stale_every - 1
        stale.append(bool(old))
        return rollout_sample(
            [5, 6, 7],
            [8 + n % 10, 9, 10],
            [-1.0, -1.0, -1.0],
            1.0 if n % 2 else -1.0,
            group_id=n // 4,
            model_version=-100 if old else version,
            trained=n >= untrained_before,
        )

    worker = ScriptedWorker(make_sample, **kwargs)
    worker.stale = stale
    return worker


def test_max_staleness_is_honoured_and_drops_are_counted(tmp_path, tiny_model_dir, tiny_dataset):
    """Every third sample is generated by weights far older than max_staleness allows: TRL's queue dataset drops each
    one it takes (``sample/dropped_stale_total``), and no sample is trained more than max_staleness optimizer steps
    behind the weights it trains (TRL's data loader takes a micro-batch one sync early: the loss drops what became
    too old meanwhile, counted in ``async/dropped_stale_total``)."""
    worker = _scripted(stale_every=3, maxsize=1)  # a fresh sample waits at most one sync in the queue
    trainer = _train_run(tmp_path, tiny_model_dir, tiny_dataset, worker=worker, max_steps=4, max_staleness=1)
    trainer.train()
    left = list(worker.rollout_buffer.queue)
    taken_stale = sum(worker.stale) - sum(sample.model_version == -100 for sample in left)
    log = trainer.state.log_history
    dropped = sum(entry.get("sample/dropped_stale_total", 0.0) for entry in log)
    assert taken_stale > 0 and dropped == taken_stale
    trained = [entry["async/staleness_max"] for entry in log if "async/staleness_max" in entry]
    assert len(trained) == 4 and max(trained) <= 1


def test_samples_too_old_for_the_weights_they_train_leave_the_loss(tmp_path, tiny_model_dir, tiny_dataset):
    """A sample more than max_staleness weight syncs behind the weights it would train is no longer trained on (its
    tokens leave the loss) and is counted; the others' loss is what it is without it."""
    from trinity_trl.asynchronous.async_grpo_seams import MODEL_VERSION_KEY

    trainer = _train_run(tmp_path, tiny_model_dir, tiny_dataset, max_staleness=1)
    trainer.model_version = 5
    tokenizer = trainer.processing_class

    def sample(version, completion):
        return rollout_sample(
            [5, 6, 7],
            completion,
            [-1.0] * len(completion),
            1.0,
            group_id=0,
            metrics={POLICY_VERSION_KEY: float(version - 1), MODEL_VERSION_KEY: float(version)},
        )

    fresh, stale = sample(5, [8, 9, 10]), sample(3, [11, 12])
    both = _async_loss(trainer, packed_batch([fresh, stale], tokenizer.pad_token_id))
    logged = trainer._metrics["train"]["async/dropped_stale_total"][-1]
    alone = _async_loss(trainer, packed_batch([fresh], tokenizer.pad_token_id))
    assert logged == 1.0 and trainer._metrics["train"]["async/dropped_stale_total"][-1] == 0.0
    _assert_same(alone, both)  # (the packed rows differ: float rounding apart)


@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_a_worker_that_dies_or_stalls_ends_the_run_in_one_line(how, tmp_path, tiny_model_dir, tiny_dataset):
    worker = _scripted(**({"fail_after": 6} if how == "dies" else {"stall_after": 6}))
    trainer = _train_run(tmp_path, tiny_model_dir, tiny_dataset, worker=worker, max_steps=5, heartbeat_stale_after_s=1)
    with pytest.raises(RuntimeError) as info:
        trainer.train()
    message = str(info.value)
    assert "\n" not in message
    assert ("failed" in message) if how == "dies" else ("stalled" in message)


def test_checkpoint_and_resume_continue_at_the_first_group_not_trained(tmp_path, tiny_model_dir, tiny_dataset):
    """A checkpoint carries the worker's prompt position and the KL state. Micro-batches of 4 samples, groups of 4,
    nothing stale: each optimizer step trains one group, so after 2 steps the loss has trained groups 0 and 1 and the
    checkpoint resumes at group 2, which the resumed run's step 3 trains (a group counted as trained when TRL's
    collator batched it, one micro-batch ahead, would resume at 3: group 2 never trained)."""
    import json
    import os

    first = _train_run(tmp_path, tiny_model_dir, tiny_dataset, max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    checkpoint = os.path.join(first.args.output_dir, "checkpoint-2")
    with open(os.path.join(checkpoint, "trinity_trainer_state.json")) as f:
        state = json.load(f)
    assert state["prompt_position"] == 2 and state["dropped_groups"] == 0
    second = _train_run(tmp_path, tiny_model_dir, tiny_dataset, max_steps=3, save_strategy="steps", save_steps=2)
    second.train(resume_from_checkpoint=checkpoint)
    assert second.state.global_step == 3
    assert min(second._trained_groups) == 2  # the worker started at the saved position, and step 3 trained it


def test_groups_dropped_as_stale_are_counted_and_the_resume_position_skips_them(tmp_path, tiny_model_dir, tiny_dataset):
    """With max_staleness 0 the worker's queued groups go stale at each weight sync and are dropped: the checkpoint
    counts them and resumes after the last group trained or dropped, never at a dropped one."""
    import json
    import os

    trainer = _train_run(
        tmp_path, tiny_model_dir, tiny_dataset, max_steps=3, max_staleness=0, save_strategy="steps", save_steps=3
    )
    trainer.train()
    with open(os.path.join(trainer.args.output_dir, "checkpoint-3", "trinity_trainer_state.json")) as f:
        state = json.load(f)
    ledger = trainer.group_ledger
    assert state["prompt_position"] == ledger.resume() and state["dropped_groups"] == len(ledger.dropped_only)
    assert set(range(state["prompt_position"])) <= ledger.trained | ledger.dropped
    logged = [entry["async/dropped_groups"] for entry in trainer.state.log_history if "async/dropped_groups" in entry]
    assert logged[-1] <= state["dropped_groups"]


def test_max_staleness_zero_trains_every_step_on_samples_of_the_current_weights(tmp_path, tiny_model_dir, tiny_dataset):
    """max_staleness=0: every optimizer step trains on samples of the weights it trains (none left out of the loss as
    too stale). accelerate's prepared loader took each micro-batch one step ahead, before the weight sync that made
    it stale: every step after the first trained nothing."""
    trainer = _train_run(tmp_path, tiny_model_dir, tiny_dataset, max_steps=3, max_staleness=0)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "actor/loss" in entry]
    assert trainer.state.global_step == 3 and len(logged) == 3
    for entry in logged:
        assert entry["async/dropped_stale_total"] == 0.0 and entry.get("async/staleness_max") == 0.0, entry


@pytest.mark.parametrize("untrained", [4, 10**9], ids=["first-step", "every-step"])
def test_a_step_with_no_sample_to_train_takes_no_optimizer_step(
    untrained, tmp_path, tiny_model_dir, tiny_dataset, caplog
):
    """A step whose samples have no token to train (unscorable) takes no optimizer step: global_step and the
    learning-rate schedule do not advance, it is counted (async/skipped_steps_total) and said at the end; a run in
    which no step had a sample says it trained nothing, its weights unchanged."""
    import logging

    worker = _scripted(untrained_before=untrained)
    trainer = _train_run(tmp_path, tiny_model_dir, tiny_dataset, worker=worker, max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with caplog.at_level(logging.WARNING, logger="trinity_trl"):
        trainer.train()
    steps = [state["step"] for state in trainer.optimizer.optimizer.state.values()]
    if untrained == 4:  # the first micro-batch (one step) has nothing to train
        assert trainer.state.global_step == 2 and trainer.skipped_steps == 1
        assert all(int(step) == 2 for step in steps) and trainer.lr_scheduler.last_epoch == 2
        assert sum(entry.get("async/skipped_steps_total", 0.0) for entry in trainer.state.log_history) == 1.0
        assert "1 step(s) had no sample to train" in caplog.text
    else:
        assert trainer.state.global_step == 0 and trainer.skipped_steps >= 2 and not steps
        assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
        assert "trained nothing" in caplog.text


_hang_started: list[float] = []
_release = threading.Event()


def hanging_reward(completions, **kwargs):
    """A reward function that never returns (until the test releases it)."""
    import time

    _hang_started.append(time.monotonic())
    _release.wait(300)
    return [0.0] * len(completions)


def test_a_reward_function_that_hangs_ends_the_run_within_the_heartbeat_limit_naming_it(
    tmp_path, tiny_model_dir, tiny_dataset
):
    """A reward function that hangs ends the run within heartbeat_stale_after_s plus TRL's 5 s poll of the worker's
    health, with one line naming it; the stop does not wait for the thread stuck in it (it stays a daemon)."""
    import time

    trainer = _train_run(tmp_path, tiny_model_dir, tiny_dataset, reward_funcs=hanging_reward, heartbeat_stale_after_s=2)
    try:
        with pytest.raises(RuntimeError) as info:
            trainer.train()
        ended = time.monotonic()
    finally:
        _release.set()
    message = str(info.value)
    assert "inside the reward function 'hanging_reward', which has not returned" in message and "\n" not in message
    assert ended - _hang_started[0] < 2 + 5 + 8, ended - _hang_started[0]  # 8 s for a busy machine


def test_a_trainer_that_trained_can_be_freed(tmp_path, tiny_model_dir, tiny_dataset):
    """TRL's queue dataset starts a thread that never ends and holds the trainer (through the dataset): every trainer
    that trained stayed alive with its models and its worker's copy (a test process grew past 8 GB). After train(),
    nothing of TRL's holds it."""
    import gc
    import weakref

    trainer = _train_run(tmp_path, tiny_model_dir, tiny_dataset, max_steps=1)
    trainer.train()
    held = [weakref.ref(trainer), weakref.ref(trainer.model), weakref.ref(trainer.rollout_worker.model)]
    del trainer
    gc.collect()
    assert [ref() is None for ref in held] == [True, True, True]


def test_a_sliding_window_model_is_refused_before_it_loads(tmp_path, tiny_model_dir, tiny_dataset):
    """The kernels run full causal attention: a model whose config makes layers attend within a window is refused in
    one line when the trainer is built, read from its config (not at the first training forward, after both models
    loaded and the worker generated)."""
    import json
    import shutil

    windowed = tmp_path / "windowed"
    shutil.copytree(tiny_model_dir, windowed)
    config = json.loads((windowed / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    config["layer_types"] = ["full_attention", "sliding_attention"]
    (windowed / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding window of 4 tokens in 1 of its 2 layers") as info:
        _train_run(tmp_path, str(windowed), tiny_dataset)
    assert "\n" not in str(info.value)


def test_teardown_exits_zero(tmp_path, tiny_model_dir):
    """A script that trains with the worker thread and returns ends with exit status 0 and nothing on stderr about
    threads (the worker is stopped by TRL's training loop, its thread joined)."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(tests)!r})
            from async_helpers import tiny_async_kwargs
            from helpers import length_reward, tiny_conversational_dataset
            from trinity_trl import AsyncTrinityConfig, AsyncTrinityTrainer
            args = AsyncTrinityConfig(**tiny_async_kwargs(output_dir={str(tmp_path / "out")!r}))
            trainer = AsyncTrinityTrainer({tiny_model_dir!r}, length_reward, args, tiny_conversational_dataset(8))
            trainer.train()
            print("trained", trainer.state.global_step)
            """
        )
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 2" in result.stdout
    for sign in ("Traceback", "Exception in thread", "terminate called"):
        assert sign not in result.stderr


# ------------------------------------------------------------------------------------------------ config
def test_a_plain_async_grpo_config_is_converted(tmp_path):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from trinity_trl.trainers.config import from_trl_config

    plain = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_staleness=2, num_generations=4)
    converted = from_trl_config(plain, AsyncTrinityConfig, "AsyncTrinityTrainer")
    assert isinstance(converted, AsyncTrinityConfig) and converted.max_staleness == 2


@pytest.mark.parametrize(
    "options, message",
    [
        ({"algorithm": "cispo", "epsilon_high": 5.0}, "epsilon_high=5.0 is not used by trinity_trl"),
        ({"generation_backend": "sglang"}, "generation_backend must be one of"),
        ({"tree_attention_kernel": "flex"}, "tree_attention_kernel must be one of"),
        ({"vllm_server_base_url": "http://x:8000"}, "generation_backend='transformers' does not use"),
        ({"log_completions": True}, "generation_backend='transformers' does not use"),
        ({"eval_strategy": "steps", "eval_steps": 1}, "eval_strategy='steps' asks for evaluation during training"),
        ({"eval_on_start": True}, "eval_on_start=True asks for evaluation"),
    ],
)
def test_config_refusals_are_one_line(options, message, tmp_path):
    with pytest.raises(ValueError, match=message) as info:
        AsyncTrinityConfig(**tiny_async_kwargs(output_dir=str(tmp_path), **options))
    assert "\n" not in str(info.value)


def test_loss_arguments_under_trl_names_reach_the_loss(tmp_path):
    config = AsyncTrinityConfig(**tiny_async_kwargs(output_dir=str(tmp_path), algorithm="gspo", epsilon=3e-4))
    assert config.resolved_algorithm().policy_loss.args["clip_range"] == 3e-4


@pytest.mark.parametrize(
    "options, message",
    [
        ({"algorithm": "reinforceplusplus"}, "computed over a whole generation batch"),
        ({"algorithm": "grpo", "kl_penalty": {"name": "k2", "kl_coef": 0.1}}, "kl_penalty='k2'"),
        ({"algorithm": "opmd", "generation_backend": "vllm"}, "must be 'grpo' at its defaults"),
        ({"algorithm": "grpo", "advantage": {"std_threshold": 0.1}, "generation_backend": "vllm"}, "at its defaults"),
        (
            {"algorithm": "grpo", "advantage": {"duplicate_experiences": True, "std_threshold": 0.0}},
            "refills filtered groups",
        ),
        ({"algorithm": "grpo", "advantage": {"std_cal_level": "batch"}}, "statistics of the whole batch"),
        ({"algorithm": "mix_chord"}, "needs expert rows"),
    ],
)
def test_algorithms_the_asynchronous_trainers_cannot_run_are_refused(options, message, tmp_path):
    from trinity_trl.trainers.async_config import check_async_components

    config = AsyncTrinityConfig(**tiny_async_kwargs(output_dir=str(tmp_path), **options))
    with pytest.raises(ValueError, match=message) as info:
        check_async_components(AsyncTrinityTrainer, config.take_components(), config)
    assert "\n" not in str(info.value)


def test_the_vllm_path_asks_the_advantages_declared_property_never_its_name(tmp_path, monkeypatch):
    """TRL's vLLM worker computes its own group z-score: the advantage that may run there is the one declaring
    `equals_trl_group_zscore`, whatever it is called (docs/asynchronous.md#with-vllm)."""
    from trinity_trl.algorithms.advantage.grpo import GRPOGroupAdvantage
    from trinity_trl.algorithms.advantage.opmd_advantage import OPMDGroupAdvantage
    from trinity_trl.trainers.async_config import check_async_components

    def check(algorithm: str) -> None:
        config = AsyncTrinityConfig(
            **tiny_async_kwargs(output_dir=str(tmp_path), algorithm=algorithm, generation_backend="vllm")
        )
        check_async_components(AsyncTrinityTrainer, config.take_components(), config)

    check("grpo")
    monkeypatch.setattr(GRPOGroupAdvantage, "equals_trl_group_zscore", property(lambda self: False))
    with pytest.raises(ValueError, match="at its defaults"):
        check("grpo")
    monkeypatch.setattr(OPMDGroupAdvantage, "equals_trl_group_zscore", property(lambda self: True))
    check("opmd")


def test_every_async_grpo_config_field_is_honoured_or_refused():
    """Each of TRL's AsyncGRPOConfig fields (beyond TrainingArguments') is listed here with what honours it; a new
    TRL field fails this test until it is sorted."""
    from transformers import TrainingArguments
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from trinity_trl.trainers.async_config import ASYNC_REPLACED_FIELDS, VLLM_WORKER_FIELDS

    honoured = {
        "model_init_kwargs": "both models' loading",
        "dtype": "both models' loading",
        "trust_remote_code": "both models' loading",
        "router_aux_loss_coef": "TrinityLossMixin (aux loss)",
        "num_generations": "the worker's group size",
        "max_completion_length": "the worker's max_new_tokens",
        "temperature": "the worker's sampling and TRL's fused head",
        "top_p": "the worker's sampling",
        "top_k": "the worker's sampling",
        "min_p": "the worker's sampling",
        "repetition_penalty": "the worker's sampling",
        "chat_template_kwargs": "the worker's prompt tokenization",
        "token_budget": "TRL's batcher (None with our worker: per_device_train_batch_size samples)",
        "max_inflight_tasks": "the worker's max_queued_samples",
        "max_staleness": "TRL's queue dataset",
        "queue_maxsize": "the worker's queue",
        "weight_sync_steps": "TRL's sync callback",
        "heartbeat_stale_after_s": "the worker's check_health",
    }
    own = {f.name for f in fields(AsyncGRPOConfig)} - {f.name for f in fields(TrainingArguments)}
    own -= {"learning_rate", "logging_steps", "lr_scheduler_type", "ignore_data_skip"}  # TrainingArguments' own
    sorted_out = set(honoured) | set(ASYNC_REPLACED_FIELDS) | set(VLLM_WORKER_FIELDS)
    assert own <= sorted_out, f"unsorted AsyncGRPOConfig fields: {sorted(own - sorted_out)}"


def test_lora_kl_reference_is_the_policy_without_its_adapter(tmp_path, float64_model_dir, tiny_dataset):
    """With LoRA the KL terms' reference is our own forward of the policy with its adapter disabled (no second model):
    loss and adapter gradients equal the synchronous trainer's, whose reference TRL computes the same way."""
    from helpers import lora_config

    options = {"algorithm": "grpo", "kl_loss": {"name": "k3", "kl_coef": 0.2}}
    sync = TrinityTrainer(
        model=float64_model_dir,
        reward_funcs=length_reward,
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "s"), prefix_packing=False, **F64, **options)),
        train_dataset=tiny_dataset,
        peft_config=lora_config(),
    )
    asynchronous = AsyncTrinityTrainer(
        model=float64_model_dir,
        reward_funcs=length_reward,
        args=AsyncTrinityConfig(**tiny_async_kwargs(output_dir=str(tmp_path / "a"), dtype="auto", **options)),
        train_dataset=tiny_dataset,
        peft_config=lora_config(),
    )
    assert asynchronous.ref_model is None  # no second copy under LoRA
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        theirs = dict(asynchronous.model.named_parameters())
        for name, p in sync.model.named_parameters():
            if "lora_" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype))  # lora_B off 0: KL > 0
                theirs[name].copy_(p)
    tokenizer = sync.processing_class
    old = _old_logps(sync, tokenizer)
    _assert_same(
        _sync_loss(sync, _padded_inputs(tokenizer, old)), _async_loss(asynchronous, _packed_inputs(tokenizer, old))
    )
    assert asynchronous._metrics["train"]["actor/kl_loss"][-1] > 1e-6


REWARD_KWARGS = {"prompts": ["p"] * 4, "completions": ["a", "b", "c", "d"], "completion_ids": [[1]] * 4}


def test_trls_worker_gets_one_picklable_weighted_reward_by_the_rule_of_every_path():
    """For TRL's vLLM worker (which sums its reward functions with weight 1 in a spawned process): one picklable
    function whose weighted sum is `weighted_rewards`' (docs/guarantees.md#bad-rewards): a function's None, NaN or
    inf leaves that function out of the row's sum, and a row no function scored is None (TRL's z-score then leaves
    it out of its group instead of turning the group's advantages into NaN)."""
    import pickle

    from async_helpers import reward_a, reward_b

    from trinity_trl.asynchronous.vllm_rewards import RewardSum

    reward = pickle.loads(pickle.dumps(RewardSum([reward_a, reward_b], [1.0, 2.0])))
    # rows: 1 + 2*0.5; neither scored; inf left out: 2*1; 2 (b's None left out)
    assert reward(**REWARD_KWARGS) == [2.0, None, 2.0, 2.0]


def test_the_reward_sum_scores_in_a_process_spawned_as_trls_worker_spawns_it():
    """TRL pickles the reward functions into a process it starts with ``spawn`` (no state of the parent): RewardSum
    and `weighted_rewards` import there, score by the rule, and name a function whose result is malformed."""
    import multiprocessing

    from async_helpers import one_score, reward_a, reward_b, score_in_spawned_child

    from trinity_trl.asynchronous.vllm_rewards import RewardSum

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    rewards = [RewardSum([reward_a, reward_b], [1.0, 2.0]), RewardSum([one_score], [1.0])]
    child = context.Process(target=score_in_spawned_child, args=(rewards, REWARD_KWARGS, results), daemon=True)
    child.start()
    try:
        outcomes = [results.get(timeout=600) for _ in rewards]
    finally:
        child.join(60)
        if child.is_alive():
            child.terminate()
    assert outcomes == [
        ("ok", [2.0, None, 2.0, 2.0]),
        (
            "error",
            "ValueError: reward function 'one_score' returned 1 rewards for 4 completions; it must return one per "
            "completion (None where it does not score one)",
        ),
    ]


def test_the_worker_needs_reward_functions(tmp_path, tiny_model_dir, tiny_dataset):
    with pytest.raises(ValueError, match="needs reward_funcs") as info:
        AsyncTrinityTrainer(
            tiny_model_dir, None, AsyncTrinityConfig(**tiny_async_kwargs(output_dir=str(tmp_path))), tiny_dataset
        )
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------- multi-step samples
# AsyncStepGRPOTrainer queues each turn of a run as its own sample whose prompt holds the earlier turns' completions
# (untrained there) and observations: in TRL's prefix tree a token is then trained in one sample and context in another.
# Run A: three turns (observations between them), run B: one turn; each turn carries its run's advantage.
TURNS_A = [[17, 23, 40, 41], [50, 51, 52], [60, 61]]
OBSERVATIONS = [[80, 81], [82]]
TURN_B = [70, 71, 72, 73, 74]


def _turn_rows(tokenizer) -> list[tuple[list[int], list[int], float]]:
    """``(prompt ids, completion ids, advantage)`` of each turn: run A's three turns, then run B's."""
    first, second = _prompt_ids(tokenizer)
    rows, prompt = [], list(first)
    for t, turn in enumerate(TURNS_A):
        rows.append((list(prompt), turn, 0.7))
        prompt += turn + (OBSERVATIONS[t] if t < len(OBSERVATIONS) else [])
    rows.append((list(second), TURN_B, -0.7))
    return rows


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_multi_step_samples_packed_in_one_tree_give_the_per_turn_rows_loss(
    loss_agg_mode, tmp_path, float64_model_dir, tiny_dataset
):
    """Each turn as a sample of its own (the layout of AsyncStepGRPOTrainer's worker), tree-packed into one row,
    gives the loss and gradient of the turns as padded rows of the synchronous trainer (StepGRPOTrainer's one row per
    turn)."""
    options = {"algorithm": "grpo", "loss_agg_mode": loss_agg_mode}
    sync, asynchronous = _twins(tmp_path, float64_model_dir, tiny_dataset, options)
    tokenizer = sync.processing_class
    rows = _turn_rows(tokenizer)
    prompts = [torch.tensor(p) for p, _, _ in rows]
    completions = [torch.tensor(c) for _, c, _ in rows]
    inputs = {
        "prompt_ids": pad(prompts, padding_value=tokenizer.pad_token_id, padding_side="left"),
        "prompt_mask": pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left"),
        "completion_ids": pad(completions, padding_value=tokenizer.pad_token_id, padding_side="right"),
        "completion_mask": pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right"),
        "advantages": torch.tensor([a for _, _, a in rows], dtype=torch.float32),
    }
    old = _noisy_logps(sync, inputs, [len(c) for _, c, _ in rows])
    inputs["old_per_token_logps"] = pad(
        [torch.tensor(lp, dtype=torch.float64) for lp in old], padding_value=0.0, padding_side="right"
    )
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    inputs["global_loss_tokens"] = inputs["completion_mask"].sum().float()
    inputs["global_loss_rows"] = torch.tensor(float(len(rows)))
    samples = [
        rollout_sample(p, c, lp, a, group_id=0 if i < len(TURNS_A) else 1, metrics={POLICY_VERSION_KEY: 0.0})
        for i, ((p, c, a), lp) in enumerate(zip(rows, old))
    ]
    packed = packed_batch(samples, tokenizer.pad_token_id)
    # the tree shares run A's turns: fewer tokens forwarded than the rows hold
    assert packed["input_ids"].numel() < sum(len(p) + len(c) for p, c, _ in rows)
    _assert_same(_sync_loss(sync, inputs), _async_loss(asynchronous, packed))
