"""ChordTrainer: expert rows in the rollout batch, the CHORD/MIX loss, μ schedule, configuration errors."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from helpers import (
    TINY_LOGP_SCALE,
    TINY_MODEL_TERMS,
    length_reward,
    lora_config,
    recording,
    tiny_conversational_dataset,
    tiny_grpo_kwargs,
)
from tolerance import approx, assert_close

from trinity_trl.algorithms import POLICY_LOSS_FN, mu_schedule_function
from trinity_trl.trainers import ChordConfig, ChordTrainer

ANSWERS = {(1, 2): "The answer is 3.", (3, 4): "It is 7.", (5, 6): "11", (7, 8): "Fifteen, so 15.", (2, 2): "4"}


def expert_messages() -> Dataset:
    return Dataset.from_list(
        [
            {"messages": [{"role": "user", "content": f"What is {a}+{b}?"}, {"role": "assistant", "content": text}]}
            for (a, b), text in ANSWERS.items()
        ]
    )


def expert_prompt_completion(conversational: bool) -> Dataset:
    rows = []
    for (a, b), text in ANSWERS.items():
        if conversational:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
                    "completion": [{"role": "assistant", "content": text}],
                }
            )
        else:
            rows.append({"prompt": f"What is {a}+{b}?", "completion": text})
    return Dataset.from_list(rows)


def make_trainer(tmp_path, model_dir, cls=None, expert=None, peft=False, **config):
    kwargs = tiny_grpo_kwargs(output_dir=str(tmp_path / "out"))
    kwargs.update(config)
    return (cls or recording(ChordTrainer))(
        model=model_dir,
        reward_funcs=length_reward,
        args=ChordConfig(**kwargs),
        train_dataset=tiny_conversational_dataset(),
        expert_dataset=expert if expert is not None else expert_messages(),
        peft_config=lora_config() if peft else None,
    )


def test_expert_rows_join_the_batch_tokenized_like_rollouts(tmp_path, tiny_model_dir):
    # a KL term (named: none by default), so expert rows get reference log-probs too
    trainer = make_trainer(tmp_path, tiny_model_dir, max_steps=1, expert_batch_size=2, kl_loss="k2")
    trainer.train()
    batch = trainer.recorded.batches[0]
    expert = batch["expert_mask"]
    assert expert.tolist() == [False] * 4 + [True] * 2
    tok = trainer.processing_class
    answers = {text for text in ANSWERS.values()}
    for row in torch.nonzero(expert).flatten().tolist():
        ids = batch["completion_ids"][row][batch["completion_mask"][row].bool()].tolist()
        assert ids[-1] == tok.eos_token_id
        assert tok.decode(ids[:-1]) in answers
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        question = tok.decode(prompt)
        assert question.startswith("<|im_start|>user\nWhat is ") and question.endswith("<|im_start|>assistant\n")
        # left-padded prompt, right-padded completion
        assert batch["prompt_mask"][row, -1] == 1 and batch["completion_mask"][row, 0] == 1
    assert torch.all(batch["advantages"][expert] == 0)
    assert batch["prompt_ids"].shape[0] == batch["completion_ids"].shape[0] == batch["advantages"].shape[0] == 6
    assert batch["ref_per_token_logps"].shape == batch["completion_ids"].shape


@pytest.mark.parametrize("dataset", ["messages", "prompt_completion_text", "prompt_completion_chat"])
def test_expert_dataset_formats(tmp_path, tiny_model_dir, dataset):
    expert = {
        "messages": expert_messages(),
        "prompt_completion_text": expert_prompt_completion(False),
        "prompt_completion_chat": expert_prompt_completion(True),
    }[dataset]
    trainer = make_trainer(tmp_path, tiny_model_dir, max_steps=1, expert=expert, expert_batch_size=2)
    trainer.train()
    batch = trainer.recorded.batches[0]
    tok = trainer.processing_class
    for row in torch.nonzero(batch["expert_mask"]).flatten().tolist():
        prompt = tok.decode(batch["prompt_ids"][row][batch["prompt_mask"][row].bool()])
        if dataset == "prompt_completion_text":
            assert prompt.startswith("What is ")  # plain text prompts are not chat-templated, as in TRL
        else:
            assert prompt.startswith("<|im_start|>user")


def test_loss_equals_library_mix_chord_on_the_same_tensors(tmp_path, tiny_model_dir):
    trainer = make_trainer(
        tmp_path,
        tiny_model_dir,
        max_steps=3,
        mu_warmup_steps=1,
        mu_decay_steps=2,
        mu_peak=0.5,
        mu_valley=0.02,
        kl_loss="none",
        entropy_loss="none",
        expert_batch_size=2,
    )
    trainer.train()
    cls = POLICY_LOSS_FN.get("mix_chord")
    reference = cls(
        **{
            **cls.default_args(),
            "enable_phi_function": False,  # ChordConfig()'s CHORD-μ (the loss's own default is φ)
            "mu_warmup_steps": 1,
            "mu_decay_steps": 2,
            "mu_peak": 0.5,
            "mu_valley": 0.02,
            "ppo_mini_batch_size": 1,
            "train_batch_size_usual": 4,
            "train_batch_size_expert": 2,
        }
    )
    assert len(trainer.recorded.loss_calls) == 3
    for call in trainer.recorded.loss_calls:
        inputs, logps, step = call.inputs, call.logps.detach(), call.global_step + 1
        expected, metrics = reference(
            logprob=logps,
            old_logprob=logps,
            action_mask=inputs["completion_mask"],
            advantages=inputs["advantages"],
            expert_mask=inputs["expert_mask"],
            step=torch.full((6,), step),
        )
        # the same per-token terms over the batch's tokens in another order; advantages times ratios set the scale
        terms, scale = inputs["completion_mask"].numel(), inputs["advantages"].abs().max() * TINY_LOGP_SCALE
        assert call.loss.item() == approx(expected.item(), terms=terms, scale=scale)
        assert metrics["mu"] == approx(mu_schedule_function(step, 1, 2, 0.5, 0.02))
    logged = [h["actor/mu"] for h in trainer.state.log_history if "actor/mu" in h]
    assert logged == approx([0.5, 0.26, 0.02])  # a few float32 operations of the schedule


def test_logs_mu_losses_and_token_counts(tmp_path, tiny_model_dir):
    trainer = make_trainer(tmp_path, tiny_model_dir, max_steps=2, expert_batch_size=2)
    trainer.train()
    log = trainer.state.log_history[0]
    for key in (
        "actor/mu",
        "actor/expert/sft_loss",  # ChordConfig()'s CHORD-μ: a plain SFT term
        "actor/usual/pg_loss",
        "chord/expert_tokens",
        "chord/on_policy_tokens",
        "chord/expert_rows",
    ):
        assert key in log, key
    batch = trainer.recorded.batches[0]
    assert log["chord/expert_tokens"] == batch["completion_mask"][batch["expert_mask"]].sum().item()
    assert log["chord/on_policy_tokens"] == batch["completion_mask"][~batch["expert_mask"]].sum().item()


def test_no_row_is_dropped_by_the_micro_batch_split(tmp_path, tiny_model_dir):
    trainer = make_trainer(tmp_path, tiny_model_dir, max_steps=1, gradient_accumulation_steps=2, expert_batch_size=2)
    trainer.train()
    rows = sum(call.inputs["prompt_ids"].shape[0] for call in trainer.recorded.loss_calls)
    experts = sum(int(call.inputs["expert_mask"].sum()) for call in trainer.recorded.loss_calls)
    assert rows == 8 + 2 and experts == 2


def test_expert_stream_visits_every_row_each_pass(tmp_path, tiny_model_dir):
    trainer = make_trainer(tmp_path, tiny_model_dir, max_steps=1, expert_batch_size=1)
    seen = [trainer._next_expert_indices()[0] for _ in range(10)]
    assert sorted(seen[:5]) == sorted(seen[5:]) == list(range(5))
    again = make_trainer(tmp_path, tiny_model_dir, max_steps=1, expert_batch_size=1)
    assert [again._next_expert_indices()[0] for _ in range(10)] == seen  # seeded


def test_lora_reference_logps_of_expert_rows_come_from_the_base_model(tmp_path, tiny_model_dir):
    trainer = make_trainer(tmp_path, tiny_model_dir, max_steps=2, peft=True, expert_batch_size=2, kl_loss="k2")
    trainer.train()
    batch = trainer.recorded.batches[-1]  # generated after one update: adapter non-zero
    expert = batch["expert_mask"]
    rows = {k: batch[k][expert] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    model = trainer.accelerator.unwrap_model(trainer.model)
    with model.disable_adapter():
        base = trainer.scoring.logps(trainer.model, rows)
    mask = rows["completion_mask"].bool()
    width = base.shape[1]
    # the base model's forward in the trainer and here (another batch layout): the tiny model's chain
    assert_close(
        batch["ref_per_token_logps"][expert][:, :width][mask], base[mask], terms=TINY_MODEL_TERMS, scale=TINY_LOGP_SCALE
    )
    policy = trainer.scoring.logps(trainer.model, rows)
    assert not torch.allclose(policy[mask], base[mask], atol=1e-5)


def test_mix_uses_a_constant_mu(tmp_path, tiny_model_dir):
    trainer = make_trainer(
        tmp_path, tiny_model_dir, algorithm="mix", policy_loss={"mu": 0.3}, max_steps=1, expert_batch_size=2
    )
    assert trainer.components.policy_loss.mu == 0.3
    trainer.train()
    assert "actor/expert/sft_loss" in trainer.state.log_history[0]


def test_expert_row_count_defaults_from_the_ratio():
    config = ChordConfig(
        **tiny_grpo_kwargs(
            output_dir="unused", per_device_train_batch_size=12, num_generations=4, gradient_accumulation_steps=2
        )
    )
    assert config.local_expert_rows() % config.steps_per_generation == 0
    assert config.local_expert_rows() == 8  # 0.25/0.75 · 24 rollouts = 8


@pytest.mark.parametrize(
    "config, match",
    [
        ({"algorithm": "grpo"}, "ChordConfig trains"),
        ({"expert_batch_size": 3, "gradient_accumulation_steps": 2}, "multiple of steps_per_generation"),
        ({"expert_data_ratio": 1.0}, "expert_data_ratio"),
        ({"algorithm": "mix", "mu_peak": 0.5}, "only apply to CHORD"),
        ({"mu_peak": 0.5, "policy_loss": {"mu_peak": 0.2}}, "set them in one place"),
        ({"mu_valley": 2.0}, "mu_valley"),
    ],
)
def test_bad_chord_configs(config, match):
    with pytest.raises(ValueError, match=match):
        ChordConfig(**tiny_grpo_kwargs(output_dir="unused", **config))


PAPER_GEOMETRY = {"num_generations": 8, "per_device_train_batch_size": 8, "max_steps": 30}


@pytest.mark.parametrize(
    "variant, schedule",
    [
        ("chord_mu", {"mu_warmup_steps": 0, "mu_decay_steps": 30, "mu_peak": 0.9, "mu_valley": 0.05}),
        ("chord_phi", {"mu_warmup_steps": 0, "mu_decay_steps": 0, "mu_peak": 0.1, "mu_valley": 0.1}),
    ],
)
def test_paper_configs_take_the_released_values(variant, schedule):
    """Issue 45: the paper's variants by name, with the released settings (docs/trainers/chord.md#paper): a fifth of
    the rows demonstrations, 8 rollouts per prompt, no KL, the variant's mu schedule (CHORD-mu's decay over the run)
    and phi."""
    config = ChordConfig(**tiny_grpo_kwargs(output_dir="unused", **PAPER_GEOMETRY), paper_config=variant)
    algorithm = config.resolved_algorithm()
    assert algorithm.kl_loss.name == "none" and not algorithm.needs_reference
    assert {k: algorithm.policy_loss.args[k] for k in schedule} == schedule
    assert algorithm.policy_loss.args["enable_phi_function"] is (variant == "chord_phi")
    expert, rollouts = config.local_expert_rows(), config.per_device_train_batch_size * config.steps_per_generation
    assert expert / (expert + rollouts) == 0.2 and config.num_generations == 8
    # the same values spelled out are accepted, and a CHORD-mu decay length of your own is the run's scaling
    spelled_out = {"paper_config": variant, "expert_data_ratio": 0.2, **schedule}
    assert (
        ChordConfig(**tiny_grpo_kwargs(output_dir="unused", **PAPER_GEOMETRY), **spelled_out)
        .resolved_algorithm()
        .policy_loss.args
        == algorithm.policy_loss.args
    )
    if variant == "chord_mu":
        released = ChordConfig(
            **tiny_grpo_kwargs(output_dir="unused", **PAPER_GEOMETRY), paper_config=variant, mu_decay_steps=200
        )
        assert released.resolved_algorithm().policy_loss.args["mu_decay_steps"] == 200


@pytest.mark.parametrize("variant", ["chord_mu", "chord_phi"])
def test_the_asynchronous_chord_takes_the_paper_configs_as_the_synchronous_one(variant):
    """`--asynchronous` on a paper config: AsyncChordConfig resolves paper_config to the same loss arguments and no
    KL, with one demonstration per four rollouts in each micro-batch, and refuses another share."""
    from trinity_trl.trainers.async_algorithms import AsyncChordConfig

    schedule = ("mu_warmup_steps", "mu_decay_steps", "mu_peak", "mu_valley", "enable_phi_function")
    sync = ChordConfig(output_dir="unused", **PAPER_GEOMETRY, paper_config=variant).resolved_algorithm()
    config = AsyncChordConfig(output_dir="unused", **PAPER_GEOMETRY, paper_config=variant)
    asynchronous = config.resolved_algorithm()
    assert {k: asynchronous.policy_loss.args[k] for k in schedule} == {k: sync.policy_loss.args[k] for k in schedule}
    assert asynchronous.kl_loss.name == "none" and config.expert_share() == 0.2
    with pytest.raises(ValueError, match=f"paper_config='{variant}' trains a fifth"):
        AsyncChordConfig(
            output_dir="unused", **{**PAPER_GEOMETRY, "per_device_train_batch_size": 6}, paper_config=variant
        )
    with pytest.raises(ValueError, match="samples 8 rollouts per prompt"):
        AsyncChordConfig(output_dir="unused", **{**PAPER_GEOMETRY, "num_generations": 4}, paper_config=variant)


def test_paper_config_trains_with_its_mu_phi_and_expert_share(tmp_path, tiny_model_dir):
    trainer = make_trainer(tmp_path, tiny_model_dir, paper_config="chord_mu", **{**PAPER_GEOMETRY, "max_steps": 2})
    assert trainer.ref_model is None  # no KL: no reference forward
    trainer.train()
    log = trainer.state.log_history
    assert [e["actor/mu"] for e in log if "actor/mu" in e] == [
        approx(mu_schedule_function(step, 0, 2, 0.9, 0.05)) for step in (1, 2)
    ]
    assert "actor/expert/sft_loss" in log[0] and "actor/expert/sft_phi_loss" not in log[0]
    assert [e["chord/expert_rows"] for e in log if "chord/expert_rows" in e] == [2.0, 2.0]  # beside 8 rollouts


@pytest.mark.parametrize(
    "config, match",
    [
        ({"paper_config": "chord"}, r"paper_config must be one of \['chord_mu', 'chord_phi'\]"),
        ({"num_generations": 4, "per_device_train_batch_size": 8}, "samples 8 rollouts per prompt"),
        ({"kl_loss": {"name": "k3", "kl_coef": 0.001}}, "trains without a KL term"),
        ({"mu_peak": 0.5}, r"sets mu_peak=0.9, got mu_peak=0.5"),
        ({"enable_phi_function": True}, "sets enable_phi_function=False"),
        ({"mu_warmup_steps": 10}, "sets mu_warmup_steps=0"),
        ({"expert_data_ratio": 0.25}, "sets expert_data_ratio=0.2"),
        ({"expert_batch_size": 4}, "a fifth of each step's rows"),
        ({"per_device_train_batch_size": 16, "gradient_accumulation_steps": 2, "num_generations": 8}, None),
        ({"per_device_train_batch_size": 2, "steps_per_generation": 4}, "4 expert rows beside 8 rollouts"),
        ({"algorithm": "mix"}, "is CHORD"),
        ({"max_steps": -1, "num_train_epochs": 1}, "decays mu over the whole run: set max_steps"),
        ({"policy_loss": {"mu_valley": 0.0}}, "set them in one place"),
    ],
)
def test_paper_config_refuses_other_values(config, match):
    kwargs = tiny_grpo_kwargs(output_dir="unused", **{**PAPER_GEOMETRY, **config})
    if match is None:  # a geometry whose share is exactly 0.2: accepted
        assert ChordConfig(**kwargs, paper_config="chord_mu").local_expert_rows() == 8
        return
    with pytest.raises(ValueError, match=match):
        ChordConfig(**{"paper_config": "chord_mu", **kwargs})


def test_bad_expert_datasets(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="needs an expert_dataset"):
        ChordTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            args=ChordConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path))),
            train_dataset=tiny_conversational_dataset(),
        )
    with pytest.raises(ValueError, match="'messages' column"):
        make_trainer(tmp_path, tiny_model_dir, expert=Dataset.from_list([{"text": "hello"}]))
    with pytest.raises(ValueError, match="empty"):
        make_trainer(tmp_path, tiny_model_dir, expert=Dataset.from_list([{"messages": []}]).select([]))
    trainer = make_trainer(
        tmp_path,
        tiny_model_dir,
        max_steps=1,
        expert_batch_size=1,
        expert=Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}]}]),
    )
    with pytest.raises(ValueError, match="row 0: the last message must be the assistant"):
        trainer.train()


def test_resume_restores_the_expert_stream_position(tmp_path, tiny_model_dir):
    straight = make_trainer(
        tmp_path, tiny_model_dir, max_steps=3, expert_batch_size=2, save_strategy="steps", save_steps=1
    )
    straight.train()
    resumed = make_trainer(tmp_path, tiny_model_dir, max_steps=3, expert_batch_size=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed._expert_cursor == straight._expert_cursor == 6
    expert_rows = lambda t: t.recorded.batches[-1]["completion_ids"][t.recorded.batches[-1]["expert_mask"]]  # noqa: E731
    assert torch.equal(expert_rows(resumed), expert_rows(straight))


def test_eval_loss_does_not_depend_on_the_eval_batch_size(tmp_path, tiny_model_dir):
    trainer = make_trainer(
        tmp_path, tiny_model_dir, max_steps=1, expert_batch_size=2, per_device_eval_batch_size=8, mu_peak=0.1,
        mu_valley=0.1,
    )  # fmt: skip
    loss_fn = trainer._policy_loss_for("eval")
    torch.manual_seed(0)
    logps, adv = -torch.rand(8, 5), torch.randn(8, 5)
    inputs = dict(
        logprob=logps,
        old_logprob=logps,
        action_mask=torch.ones(8, 5),
        advantages=adv,
        expert_mask=torch.zeros(8, dtype=torch.bool),
        step=torch.ones(8),
    )
    full = loss_fn(**inputs)[0]
    half = loss_fn(**{k: v[:4] for k, v in inputs.items()})[0]
    reference = POLICY_LOSS_FN.get("ppo")(clip_range=0.2)
    # weighted sums of the same 8 x 5 per-token terms (advantages times a ratio of 1) in another order
    expected = 0.9 * reference(logprob=logps, old_logprob=logps, action_mask=torch.ones(8, 5), advantages=adv)[0]
    assert full.item() == approx(expected.item(), terms=8 * 5, scale=adv.abs().max())
    # each sample weighs 1/per_device_eval_batch_size: a half-full eval batch contributes half
    half_reference = reference(
        logprob=logps[:4], old_logprob=logps[:4], action_mask=torch.ones(4, 5), advantages=adv[:4]
    )[0].item()
    assert half.item() == approx(0.9 * 0.5 * half_reference, terms=4 * 5, scale=adv.abs().max())


def test_chord_rejects_environment_factory(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="environment_factory"):
        ChordTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            expert_dataset=expert_messages(),
            args=ChordConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path))),
            train_dataset=tiny_conversational_dataset(),
            environment_factory=object,
        )
