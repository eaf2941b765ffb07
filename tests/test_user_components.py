"""A user's loss defined in a file outside the package (issue 26, items 2-3): registered by ``--import`` (or the
YAML key ``import``), configured with one hyperparameter in YAML and on the command line, trained through the CLI
and through the generic trainers, and shown on the model card, on the console line and in the pooled metrics,
with no file of the package changed."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs, tiny_sft_dpo_kwargs

from trinity_trl.algorithms import ADVANTAGE_FN, POLICY_LOSS_FN
from trinity_trl.algorithms.component import Component
from trinity_trl.algorithms.registry import import_components

PLUGIN = textwrap.dedent(
    '''
    """Two losses of a user's project, each with one hyperparameter."""
    from trinity_trl.algorithms import POLICY_LOSS_FN, PolicyLossFn


    @POLICY_LOSS_FN.register("scaled_reinforce")
    class ScaledReinforce(PolicyLossFn):
        """-scale * A * logprob."""

        def __init__(self, backend: str = "trl", scale: float = 1.0):
            super().__init__(backend)
            self.scale = scale

        def token_losses(self, logprob, advantages, **_):
            return -self.scale * advantages * logprob, {}


    @POLICY_LOSS_FN.register("scaled_sft")
    class ScaledSFT(PolicyLossFn):
        """-scale * logprob on demonstrations (reads nothing but the trained tokens)."""

        inputs = ("action_mask",)

        def __init__(self, backend: str = "trl", scale: float = 1.0):
            super().__init__(backend)
            self.scale = scale

        def token_losses(self, logprob, **_):
            return -self.scale * logprob, {}
    '''
)


@pytest.fixture
def plugin(tmp_path):
    """The user's file, outside the package; its losses are unregistered afterwards."""
    path = tmp_path / "user_losses.py"
    path.write_text(PLUGIN)
    yield path
    for name in ("scaled_reinforce", "scaled_sft"):
        if name in POLICY_LOSS_FN._entries:
            POLICY_LOSS_FN.unregister(name)
    sys.modules.pop("user_losses", None)


def test_cli_trains_a_loss_from_a_file_with_yaml_and_a_command_line_override(tmp_path, tiny_model_dir, plugin, capsys):
    from trinity_trl.cli import run

    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    config.write_text(
        f"import: {plugin}\n"
        "algorithm: grpo\n"
        "policy_loss: {name: scaled_reinforce, scale: 0.5}\n"
        "kl_loss: none\n"
        f"model_name_or_path: {tiny_model_dir}\n"
        f"output_dir: {out}\n"
        "max_steps: 1\nnum_train_rows: 8\nmax_completion_length: 8\nper_device_train_batch_size: 4\n"
        "num_generations: 4\nlora_r: 4\nlora_alpha: 8\neval_accuracy: false\nlogging_steps: 1\nplot: false\n"
        "report_to: none\nsave_strategy: 'no'\ndisable_tqdm: false\nuse_cpu: true\n"
    )
    trainer = run(["train", "--config", str(config), "--policy_loss.scale", "0.25"])
    loss = trainer.components.policy_loss
    assert type(loss).__name__ == "ScaledReinforce" and loss.scale == 0.25  # the command line wins over the YAML
    assert any("actor/scaled_reinforce_loss" in entry for entry in trainer.state.log_history)
    console = capsys.readouterr()
    assert "step 1/1 | reward" in console.out + console.err and "| rl " in console.out + console.err
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "`scaled_reinforce`" in card and '"scale": 0.25' in card


def test_generic_trainers_train_a_loss_from_a_file(tmp_path, tiny_model_dir, plugin):
    from transformers import AutoTokenizer

    from trinity_trl.trainers import TrinityConfig, TrinitySFTConfig, TrinitySFTTrainer, TrinityTrainer
    from trinity_trl.training.metrics import pool_metrics, summary_line, summary_metrics

    import_components(str(plugin))
    args = TrinityConfig(
        **tiny_grpo_kwargs(output_dir=str(tmp_path / "rl"), max_steps=1),
        policy_loss=Component("scaled_reinforce", scale=0.5),
    )
    trainer = TrinityTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, train_dataset=tiny_conversational_dataset(), args=args
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    logged = next(entry for entry in trainer.state.log_history if "actor/scaled_reinforce_loss" in entry)
    line = summary_line(1, 1, logged, summary_metrics(POLICY_LOSS_FN.get("scaled_reinforce")))
    assert f"rl {logged['actor/scaled_reinforce_loss']:.4g}" in line
    trainer.save_model()
    assert '"scale": 0.5' in (tmp_path / "rl" / "README.md").read_text(encoding="utf-8")

    # its metric is pooled across processes like the package's own (two ranks' values)
    store = {"actor/scaled_reinforce_loss": [1.0]}
    pool_metrics(store, lambda objects: [objects[0], {"actor/scaled_reinforce_loss": [3.0]}])
    assert store["actor/scaled_reinforce_loss"] == [1.0, 3.0]

    # an SFT-type loss (it reads only the trained tokens) is accepted by TrinitySFTTrainer
    from datasets import Dataset

    demos = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i}+1?"}] for i in range(8)],
            "completion": [[{"role": "assistant", "content": f"The answer is {i + 1}."}] for i in range(8)],
        }
    )
    sft = TrinitySFTTrainer(
        model=tiny_model_dir,
        args=TrinitySFTConfig(
            **tiny_sft_dpo_kwargs(tmp_path / "sft", max_steps=1), policy_loss={"name": "scaled_sft", "scale": 2.0}
        ),
        train_dataset=demos,
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    assert sft.policy_loss.scale == 2.0
    sft.train()
    entry = next(e for e in sft.state.log_history if "actor/scaled_sft_loss" in e)
    assert "sft " in summary_line(1, 1, entry, summary_metrics(POLICY_LOSS_FN.get("scaled_sft")))
    with pytest.raises(ValueError, match="reads only the trained tokens"):
        TrinitySFTConfig(**tiny_sft_dpo_kwargs(tmp_path / "bad"), policy_loss="scaled_reinforce")


def test_import_errors_are_one_line(tmp_path):
    with pytest.raises(ImportError, match="no such file"):
        import_components(str(tmp_path / "missing.py"))
    with pytest.raises(ImportError, match="no module named 'no_such_user_module'"):
        import_components("no_such_user_module")


CONTRACT_PLUGIN = textwrap.dedent(
    '''
    """Losses of a user's project against the aggregation contract (issue 37 item 1, issue 54 item 1)."""
    from trinity_trl.algorithms import POLICY_LOSS_FN, PolicyLossFn, agg_loss


    @POLICY_LOSS_FN.register("self_averaging")
    class SelfAveraging(PolicyLossFn):
        """Averages its own tokens and says nothing about aggregation."""

        def compute(self, logprob, old_logprob, action_mask, advantages, **_):
            loss = (-advantages * logprob * action_mask).sum() / action_mask.sum().clamp(min=1)
            return loss, {"self_averaging_loss": loss.detach()}


    @POLICY_LOSS_FN.register("renamed_mode")
    class RenamedMode(PolicyLossFn):
        """Keeps its mode under another attribute name than loss_agg_mode."""

        def __init__(self, backend: str = "trl", agg: str = "token-mean"):
            super().__init__(backend)
            self.agg = agg

        def compute(self, logprob, old_logprob, action_mask, advantages, **_):
            loss = agg_loss(-advantages * logprob, action_mask, self.agg)
            return loss, {"renamed_mode_loss": loss.detach()}


    @POLICY_LOSS_FN.register("declared_self_averaging")
    class DeclaredSelfAveraging(SelfAveraging):
        """The same self-averaging loss, declaring it."""

        weighs_samples_itself = True


    @POLICY_LOSS_FN.register("per_token")
    class PerToken(PolicyLossFn):
        """The contract: per-token losses, which the trainer aggregates."""

        def token_losses(self, logprob, advantages, **_):
            return -advantages * logprob, {}


    @POLICY_LOSS_FN.register("scalar_token_losses")
    class ScalarTokenLosses(PolicyLossFn):
        """A per-token method that averages its own tokens."""

        def token_losses(self, logprob, action_mask, advantages, **_):
            return (-advantages * logprob * action_mask).sum() / action_mask.sum().clamp(min=1), {}


    @POLICY_LOSS_FN.register("takes_aggregation")
    class TakesAggregation(PolicyLossFn):
        """The old contract (issue 37): it receives its aggregation in compute (deprecated, issue 54)."""

        def __init__(self, backend: str = "trl", scale: float = 1.0):
            super().__init__(backend)
            self.scale = scale

        def compute(self, logprob, old_logprob, action_mask, advantages, loss_agg_mode, **_):
            loss = agg_loss(-self.scale * advantages * logprob, action_mask, loss_agg_mode)
            return loss, {"takes_aggregation_loss": loss.detach()}
    '''
)


CONTRACT_LOSSES = (
    "self_averaging",
    "renamed_mode",
    "declared_self_averaging",
    "per_token",
    "scalar_token_losses",
    "takes_aggregation",
)


@pytest.mark.parametrize("name", ["self_averaging", "renamed_mode"])
def test_a_loss_that_does_not_take_its_aggregation_is_refused_at_construction(tmp_path, name):
    """Issue 37 item 1: such a loss passed every check and failed at step 1 (``Unknown loss_agg_mode None`` or its
    mode silently replaced); it is now refused when the config (so the trainer) is built, in one line naming what
    to add."""
    from trinity_trl.trainers import TrinityConfig

    path = tmp_path / "contract_losses.py"
    path.write_text(CONTRACT_PLUGIN)
    try:
        import_components(str(path))
        with pytest.raises(ValueError, match="loss_agg_mode.*weighs_samples_itself = True") as error:
            TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out")), policy_loss=name, kl_loss="none")
        assert "\n" not in str(error.value) and name in str(error.value)
    finally:
        for registered in CONTRACT_LOSSES:
            if registered in POLICY_LOSS_FN._entries:
                POLICY_LOSS_FN.unregister(registered)
        sys.modules.pop("contract_losses", None)


def test_a_per_token_method_that_averages_its_tokens_is_refused_when_the_trainer_is_built(tmp_path):
    """Issue 54 item 1: a ``token_losses`` returning no ``(B, T)`` tensor (here its own mean) would train at the wrong
    scale; a probe call with dummy inputs refuses it, in one line, when the config (so the trainer) is built."""
    from trinity_trl.trainers import TrinityConfig

    path = tmp_path / "contract_losses.py"
    path.write_text(CONTRACT_PLUGIN)
    try:
        import_components(str(path))
        with pytest.raises(ValueError, match=r"token_losses\(\) must return .*probe call .* gave shape \(\)") as error:
            TrinityConfig(
                **tiny_grpo_kwargs(output_dir=str(tmp_path / "out")), policy_loss="scalar_token_losses", kl_loss="none"
            )
        assert "\n" not in str(error.value) and "scalar_token_losses" in str(error.value)
    finally:
        for registered in CONTRACT_LOSSES:
            if registered in POLICY_LOSS_FN._entries:
                POLICY_LOSS_FN.unregister(registered)
        sys.modules.pop("contract_losses", None)


@pytest.mark.parametrize("name", ["per_token", "takes_aggregation", "declared_self_averaging"])
def test_a_loss_that_keeps_the_contract_trains(tmp_path, tiny_model_dir, name):
    """A loss that gives per-token losses, or keeps the old contract (it receives its aggregation, with one deprecation
    warning), or declares that it weighs its samples itself, trains; the trainer never copies or changes the user's
    object."""
    import warnings

    from trinity_trl.trainers import TrinityConfig, TrinityTrainer

    path = tmp_path / "contract_losses.py"
    path.write_text(CONTRACT_PLUGIN)
    try:
        import_components(str(path))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            args = TrinityConfig(
                **tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), max_steps=1), policy_loss=name, kl_loss="none"
            )
        deprecations = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        if name == "takes_aggregation":
            assert len(deprecations) == 1 and "\n" not in deprecations[0]
            assert "token_losses()" in deprecations[0] and "until trinity_trl 0.3.0" in deprecations[0]
        else:
            assert deprecations == []
        trainer = TrinityTrainer(
            model=tiny_model_dir, reward_funcs=length_reward, train_dataset=tiny_conversational_dataset(), args=args
        )
        loss = trainer.components.policy_loss
        state = dict(vars(loss))
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
        assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
        assert any(f"actor/{name.replace('declared_', '')}_loss" in e for e in trainer.state.log_history)
        assert trainer.components.policy_loss is loss and vars(loss) == state
    finally:
        for registered in CONTRACT_LOSSES:
            if registered in POLICY_LOSS_FN._entries:
                POLICY_LOSS_FN.unregister(registered)
        sys.modules.pop("contract_losses", None)


ADVANTAGE_PLUGIN = textwrap.dedent(
    '''
    """A user's advantage estimator with one hyperparameter (issue 37, item 6)."""
    import torch

    from trinity_trl.algorithms import ADVANTAGE_FN, GroupAdvantageFn, gather_metrics, group_by


    @ADVANTAGE_FN.register("median_baseline")
    class MedianBaseline(GroupAdvantageFn):
        """scale * (reward - the group's median reward)."""

        def __init__(self, scale: float = 1.0):
            self.scale = scale

        def process(self, experiences):
            kept, metrics = [], []
            for group in group_by(experiences, "task").values():
                rewards = torch.tensor([float(exp.reward) for exp in group])
                baseline = rewards.median()
                for exp, reward in zip(group, rewards):
                    exp.set_advantage(self.scale * (reward - baseline))
                metrics.append({"baseline": baseline.item(), "scale": self.scale})
                kept.extend(group)
            return kept, gather_metrics(metrics, "median_baseline")
    '''
)


@pytest.fixture
def advantage_plugin(tmp_path):
    path = tmp_path / "user_advantages.py"
    path.write_text(ADVANTAGE_PLUGIN)
    yield path
    if "median_baseline" in ADVANTAGE_FN._entries:
        ADVANTAGE_FN.unregister("median_baseline")
    sys.modules.pop("user_advantages", None)


def _logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def test_an_advantage_estimator_from_a_file_through_python(tmp_path, tiny_model_dir, advantage_plugin):
    """The docs' custom advantage (docs/algorithms/custom-components.md#advantage) from a file outside the package:
    built with its hyperparameter, run on every group, its metrics logged."""
    from trinity_trl.trainers import TrinityConfig, TrinityTrainer

    import_components(str(advantage_plugin))
    args = TrinityConfig(
        **tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), max_steps=1),
        advantage=Component("median_baseline", scale=0.5),
        kl_loss="none",
    )
    trainer = TrinityTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, train_dataset=tiny_conversational_dataset(), args=args
    )
    assert type(trainer.components.advantage_fn).__name__ == "MedianBaseline"
    trainer.train()
    assert _logged(trainer, "median_baseline/scale/mean") == [0.5]


def test_an_advantage_estimator_from_a_file_through_yaml_and_the_cli(tmp_path, tiny_model_dir, advantage_plugin):
    """``import:`` (relative to the YAML file) and ``advantage: {name: ..., scale: ...}`` in YAML, the hyperparameter
    overridden on the command line."""
    from trinity_trl.cli import run

    config = tmp_path / "run.yaml"
    config.write_text(
        "import: user_advantages.py\n"  # beside run.yaml
        "algorithm: grpo\n"
        "advantage: {name: median_baseline, scale: 0.5}\n"
        "kl_loss: none\n"
        f"model_name_or_path: {tiny_model_dir}\n"
        f"output_dir: {tmp_path / 'out'}\n"
        "max_steps: 1\nnum_train_rows: 8\nmax_completion_length: 8\nper_device_train_batch_size: 4\n"
        "num_generations: 4\nlora_r: 4\nlora_alpha: 8\neval_accuracy: false\nlogging_steps: 1\nplot: false\n"
        "report_to: none\nsave_strategy: 'no'\nuse_cpu: true\n"
    )
    trainer = run(["train", "--config", str(config), "--advantage.scale", "0.25"])
    assert trainer.components.advantage_fn.scale == 0.25  # the command line wins over the YAML
    assert _logged(trainer, "median_baseline/scale/mean") == [0.25]
