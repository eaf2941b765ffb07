"""`trinity_trl/training/model_card.py` (the algorithm section of a model card, the `ModelCard` a trainer composes)
and the card our trainers write (`AlgorithmCardMixin` in `trainers/card.py`): on `save_model`, on a Hub push, with extra
sections.

The SFT and DPO trainers' cards: tests/trainers/test_sft_dpo.py."""

from __future__ import annotations

import json
import os

import pytest
from datasets import Dataset
from helpers import length_reward, lora_config, tiny_conversational_dataset, tiny_grpo_kwargs

from trinity_trl.algorithms import ALGORITHM_TYPE
from trinity_trl.trainers import ChordConfig, ChordTrainer, StepGRPOConfig, TrinityConfig, TrinityTrainer
from trinity_trl.training.model_card import ModelCard, algorithm_card_section, paper_for

CHORD_PAPER = (
    "On-Policy RL Meets Off-Policy Experts: Harmonizing Supervised Fine-Tuning and Reinforcement Learning "
    "via Dynamic Weighting"
)
CHORD_PAPER_LINE = f"Paper: [{CHORD_PAPER}](https://huggingface.co/papers/2508.11408) (arXiv:2508.11408)."


def table_rows(section: str) -> dict[str, tuple[str, str]]:
    """`{component: (name, arguments)}` of the section's table, backticks stripped."""
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and cells[0] not in ("component", "---"):
            rows[cells[0]] = (cells[1].strip("`"), cells[2].strip("`"))
    return rows


# --------------------------------------------------------------------------------------------- the section
TRL_CARD = "---\nlicence: license\ntags:\n- trl\n---\n\n# Model Card\n\nThis model is a fine-tuned version of x.\n"


def completed_card(
    tmp_path, card: ModelCard, dataset_name=None, train_dataset=None, expert_dataset=None, template=TRL_CARD
) -> str:
    """`card` completing a TRL-like card for a plain (non-PEFT) model named `local-base`."""
    from types import SimpleNamespace

    import torch
    from transformers import TrainingArguments

    model = torch.nn.Linear(1, 1)
    model.config = SimpleNamespace(_name_or_path="local-base")
    path = tmp_path / "README.md"
    path.write_text(template)
    card.complete(
        str(path),
        algorithm=StepGRPOConfig(**tiny_grpo_kwargs(output_dir="unused")).resolved_algorithm(),
        components=None,
        args=TrainingArguments(output_dir=str(tmp_path), learning_rate=3e-4, max_steps=7, report_to=[]),
        model=model,
        dataset_name=dataset_name,
        train_dataset=train_dataset,
        load_from="someone/result",
        expert_dataset=expert_dataset,
    )
    return path.read_text()


def test_the_quick_start_asks_a_prompt_of_the_runs_own_data(tmp_path):
    """The card's quick start asks the first training prompt (chat messages through the chat template, a text prompt
    as it is), not an arithmetic question whatever the task; without a prompt, a generic one."""
    trl = TRL_CARD + "\n## Quick start\n\n```python\nTRL's quick start\n```\n\n## Training procedure\n"

    def card(dataset):
        return completed_card(tmp_path, ModelCard("T"), train_dataset=dataset, template=trl)

    guess = [{"role": "system", "content": "Play fair."}, {"role": "user", "content": "Guess my number (1-20)."}]
    chat = card(Dataset.from_dict({"prompt": [guess]}))
    assert f"messages = {json.dumps(guess)}  # a prompt of the training data" in chat
    text = card(Dataset.from_dict({"prompt": ["Q: 2+2? A:"]}))
    assert 'inputs = tokenizer("Q: 2+2? A:", return_tensors="pt")  # a prompt of the training data' in text
    generic = card(None)
    assert 'messages = [{"role": "user", "content": "Hello! What can you do?"}]\n' in generic
    assert all("apples" not in card for card in (chat, text, generic))


def test_the_card_names_the_demonstrations(tmp_path):
    """A trainer with demonstrations (CHORD, MIX) names them: as set on the card (a recipe: their source), else their
    own name, else their number of rows."""
    expert = Dataset.from_dict({"prompt": ["a", "b"], "completion": ["c", "d"]})
    assert "| demonstrations | 2 rows given as `expert_dataset` |" in completed_card(
        tmp_path, ModelCard("T"), expert_dataset=expert
    )
    expert.info.dataset_name = "hub/solutions"
    assert "| demonstrations | `hub/solutions` |" in completed_card(tmp_path, ModelCard("T"), expert_dataset=expert)
    card = ModelCard("T")
    card.demonstrations = "`my/folder`"
    assert "| demonstrations | `my/folder` |" in completed_card(tmp_path, card, expert_dataset=expert)
    assert "| demonstrations |" not in completed_card(tmp_path, ModelCard("T"))


def test_the_composed_card_appends_its_sections_in_order_with_what_was_set_on_it(tmp_path):
    card = ModelCard("StepGRPOTrainer")
    card.environment = "Calculator, Echo"
    card.dataset = "mine/tasks"
    card.add_section("\n## Evaluation\n\naccuracy 0.5\n")
    text = completed_card(tmp_path, card, train_dataset=Dataset.from_dict({"prompt": ["a"]}))
    assert "library_name: transformers" in text and "licence:" not in text  # TRL's header corrected
    positions = [
        text.index(s)
        for s in ("## Algorithm: Step-wise GRPO", "## Training set-up", "| environment | `Calculator, Echo` |")
    ]
    assert positions == sorted(positions) and text.index("## Evaluation") > positions[-1]
    assert "`StepGRPOTrainer`" in text and "| dataset | `mine/tasks` |" in text and "| max steps | 7 |" in text


def test_the_card_names_the_data_given_to_trl_first_then_its_own_then_the_datasets(tmp_path):
    named = Dataset.from_dict({"prompt": ["a"]})
    named.info.dataset_name = "hub/own-name"
    card = ModelCard("TrinityTrainer")
    assert "| dataset | `hub/own-name` |" in completed_card(tmp_path, card, train_dataset=named)
    card.dataset = "set/by-hand"
    assert "| dataset | `set/by-hand` |" in completed_card(tmp_path, card, train_dataset=named)
    assert "| dataset | `given/to-trl` |" in completed_card(tmp_path, card, "given/to-trl", named)
    text = completed_card(tmp_path, ModelCard("TrinityTrainer"), train_dataset=Dataset.from_dict({"p": ["a"]}))
    assert "| dataset |" not in text and "| environment |" not in text  # nothing to name: no row


def test_section_names_trainer_preset_paper_and_every_component():
    algorithm = ChordConfig(**tiny_grpo_kwargs(output_dir="unused", mu_peak=0.4)).resolved_algorithm()
    section = algorithm_card_section(algorithm, "ChordTrainer")
    lines = section.splitlines()
    assert "## Algorithm: CHORD" in lines
    description = ALGORITHM_TYPE.get("mix_chord").description
    assert f"Trained with `trinity_trl`'s `ChordTrainer` using the `mix_chord` preset: {description}." in lines
    assert CHORD_PAPER_LINE in lines
    rows = table_rows(section)
    components = ("policy_loss", "advantage", "kl_loss", "kl_penalty", "entropy_loss")  # the config's names
    assert {"policy_loss", "loss_agg_mode"} <= set(rows) <= {*components, "loss_agg_mode"}
    for component in set(rows) & set(components):  # each listed component as resolved
        name, arguments = rows[component]
        assert name == getattr(algorithm, component).name, component
        assert json.loads(arguments) == json.loads(json.dumps(getattr(algorithm, component).args, default=str))
    assert json.loads(rows["policy_loss"][1])["mu_peak"] == 0.4
    assert rows["loss_agg_mode"] == (algorithm.loss_agg_mode, "")


def test_a_preset_without_an_arxiv_paper_gives_its_reference():
    section = algorithm_card_section(
        StepGRPOConfig(**tiny_grpo_kwargs(output_dir="unused")).resolved_algorithm(), "StepGRPOTrainer"
    )
    assert "## Algorithm: Step-wise GRPO" in section.splitlines()
    assert "Reference: rLLM (github.com/rllm-org/rllm)." in section.splitlines()
    assert "Paper:" not in section


@pytest.mark.parametrize("preset", ALGORITHM_TYPE.names())
def test_paper_for_every_preset(preset):
    name, paper = paper_for(preset)
    reference = ALGORITHM_TYPE.get(preset).paper
    assert name
    if reference.startswith("arXiv:"):
        assert paper["id"] == reference.removeprefix("arXiv:")
        assert paper["title"]  # the paper's title, or "<name> (arXiv:<id>)" where none is recorded
    else:
        assert paper == {}


def test_paper_titles_that_are_known():
    assert paper_for("mix_chord") == ("CHORD", {"id": "2508.11408", "title": CHORD_PAPER})
    assert paper_for("cispo")[1]["title"].startswith("MiniMax-M1")
    assert paper_for("asymre") == ("AsymRE", {"id": "2506.20520", "title": "AsymRE (arXiv:2506.20520)"})


# ------------------------------------------------------------------------------------- the card a trainer writes
def test_save_model_writes_adapter_and_algorithm_card(tmp_path, tiny_model_dir):
    expert = Dataset.from_list(
        [{"messages": [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "2"}]}]
    )
    trainer = ChordTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        expert_dataset=expert,
        peft_config=lora_config(),
        args=ChordConfig(
            **tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), max_steps=1, mu_peak=0.4, mu_decay_steps=10)
        ),
        train_dataset=tiny_conversational_dataset(),
    )
    trainer.train()
    target = tmp_path / "saved"
    trainer.save_model(str(target))
    files = set(os.listdir(target))
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= files
    card = (target / "README.md").read_text()
    lines = card.splitlines()
    assert "## Algorithm: CHORD" in lines
    assert any(
        line.startswith("Trained with `trinity_trl`'s `ChordTrainer` using the `mix_chord` preset: ") for line in lines
    )
    assert CHORD_PAPER_LINE in lines
    assert '"mu_peak": 0.4' in card and "| policy_loss | `mix_chord` |" in card
    # the preset's line names both variants; the variant line says which one trained (CHORD-μ by default)
    assert "plain for CHORD-μ, φ-weighted for CHORD-φ" in card and "Variant: CHORD-μ" in card
    # no run of blank lines where TRL's template leaves room for a tracker badge
    assert "\n\n\n" not in card.split("## Citations")[0]
    # the local base model is named, not linked as "[None](https://huggingface.co/None)"
    assert "huggingface.co/None" not in card
    assert f"`{os.path.basename(tiny_model_dir)}` (a local model)" in card


def test_push_to_hub_uploads_adapter_and_card(tmp_path, tiny_model_dir, monkeypatch):
    import transformers.trainer as hf_trainer

    uploaded = {}

    class FakeApi:
        def upload_folder(self, repo_id, folder_path, **kwargs):
            uploaded["repo_id"] = repo_id
            uploaded["files"] = set(os.listdir(folder_path))
            uploaded["card"] = open(os.path.join(folder_path, "README.md"), encoding="utf-8").read()

    monkeypatch.setattr(hf_trainer, "hf_api", lambda: FakeApi())
    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        peft_config=lora_config(),
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), algorithm="cispo", max_steps=1)),
        train_dataset=tiny_conversational_dataset(),
    )
    trainer.train()
    trainer.hub_model_id = "someone/tiny-cispo"
    trainer.push_to_hub()
    assert uploaded["repo_id"] == "someone/tiny-cispo"
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= uploaded["files"]
    assert "## Algorithm: CISPO" in uploaded["card"]
    assert "Trained with `trinity_trl`'s `TrinityTrainer` using the `cispo` preset: " in uploaded["card"]
    assert "MiniMax-M1" in uploaded["card"] and "clip_range_high" in uploaded["card"]


def test_added_sections_follow_the_algorithm_section(tmp_path, tiny_model_dir):
    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), algorithm="grpo")),
        train_dataset=tiny_conversational_dataset(),
    )
    trainer.add_model_card_section("\n## Evaluation\n\naccuracy 0.5\n")
    trainer.add_model_card_section("\n## Notes\n\nsecond\n")
    trainer.save_model(str(tmp_path / "saved"))
    card = (tmp_path / "saved" / "README.md").read_text()
    positions = [card.index(s) for s in ("## Algorithm: GRPO", "## Evaluation", "accuracy 0.5", "## Notes")]
    assert positions == sorted(positions)
    assert card.count("## Evaluation") == 1
    assert not os.path.exists(tmp_path / "out" / "README.md")  # written next to the saved weights, not into output_dir


# ------------------------------------------------------------------------------------- the saved adapter's base
def test_only_the_process_that_saves_records_the_bundled_models_hub_id(tmp_path):
    """`AlgorithmCardMixin._save` rewrites an adapter's base model (the bundled model's cache folder -> its Hub id)
    after transformers' ``_save``. Under DeepSpeed every process calls ``_save``, but only the one that saves writes
    the folder: another process reading ``adapter_config.json`` while it is written failed a ZeRO-3 run
    (JSONDecodeError on rank 1) and could write it at the same time. (On the old code the other process rewrote it.)"""
    from types import SimpleNamespace

    from trinity_trl.data import model as bundled
    from trinity_trl.trainers.card import AlgorithmCardMixin

    bundled_dir = tmp_path / "bundled"
    bundled_dir.mkdir()
    (bundled_dir / bundled._MARKER).write_text("{}")  # what bundled_model_dir() writes after a conversion
    saved = tmp_path / "saved"
    saved.mkdir()
    adapter_config = saved / "adapter_config.json"

    class TransformersTrainer:  # transformers' _save as a non-writing process runs it: nothing written
        def _save(self, output_dir=None, state_dict=None):
            pass

    class Host(AlgorithmCardMixin, TransformersTrainer):
        def __init__(self, should_save):
            self.args = SimpleNamespace(should_save=should_save, output_dir=str(tmp_path / "out"))

    original = json.dumps({"base_model_name_or_path": str(bundled_dir), "r": 4})
    adapter_config.write_text(original)
    Host(should_save=False)._save(str(saved))
    assert adapter_config.read_text() == original
    Host(should_save=True)._save(str(saved))
    assert json.loads(adapter_config.read_text()) == {"base_model_name_or_path": bundled.BUNDLED_MODEL_HUB_ID, "r": 4}


# ----------------------------------------------------------------------------------- the card's own loading code
def python_blocks(card: str) -> list[str]:
    import re

    return re.findall(r"```python\n(.*?)```", card, re.S)


def test_the_cards_loading_code_runs_offline_for_a_bundled_and_a_local_base(tmp_path, tiny_model_dir):
    """Issue 43: the card of an adapter of the bundled model shows first the load that works offline (its base from
    the installed package, `bundled_model_dir()`), then the Hub one; the card of an adapter of a local model loads it
    from that folder. Both first blocks, run as written in a fresh offline process with an empty Hub cache (here
    `bundled_model_dir()` finds the tiny model as its conversion), load the adapter and generate."""
    import shutil
    import subprocess
    import sys

    from launching import scaled_timeout

    from trinity_trl.data import model as bundled

    cache = tmp_path / "cache"
    bundled_dir = cache / bundled.BUNDLED_MODEL_NAME
    shutil.copytree(tiny_model_dir, bundled_dir)
    (bundled_dir / bundled._MARKER).write_text("{}")  # what bundled_model_dir() writes after a conversion
    cards = {}
    for name, base in (("bundled", str(bundled_dir)), ("local", tiny_model_dir)):
        trainer = TrinityTrainer(
            model=base,
            reward_funcs=length_reward,
            peft_config=lora_config(),
            train_dataset=tiny_conversational_dataset(),
            args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / name), max_steps=1)),
        )
        trainer.save_model(str(tmp_path / name))
        cards[name] = (tmp_path / name / "README.md").read_text()
    bundled_blocks, local_blocks = python_blocks(cards["bundled"]), python_blocks(cards["local"])
    assert len(bundled_blocks) == 2 and "bundled_model_dir()" in bundled_blocks[0]
    assert "AutoPeftModelForCausalLM.from_pretrained" in bundled_blocks[1]  # the Hub's (HuggingFaceTB/...)
    assert "Offline, on the weights it was trained on" in cards["bundled"] and "With the Hub" in cards["bundled"]
    assert len(local_blocks) == 1 and "bundled_model_dir" not in local_blocks[0]
    script = "\n".join(
        f"exec({block!r}, {{}})\nprint('loaded {name}')"
        for name, block in (("bundled", bundled_blocks[0]), ("local", local_blocks[0]))
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "empty_hf_home"),  # no Hub cache: the original model cannot come from there
        "TRINITY_TRL_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled_timeout(300),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded bundled" in result.stdout and "loaded local" in result.stdout
