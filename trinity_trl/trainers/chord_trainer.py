"""CHORD (and MIX): on-policy RL on rollouts plus SFT on expert demonstrations in one batch.

Each generation batch gets ``expert_batch_size`` demonstration rows per process, appended after
TRL has generated and scored the rollouts. Expert rows go through the same forward pass as the
rollouts; the ``mix_chord`` loss weighs the PPO loss of rollouts and the (φ-weighted) SFT loss of
demonstrations with ``μ``, scheduled over training steps (docs/algorithms/chord.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from datasets import Dataset

from ..algorithms import POLICY_LOSS_FN
from ..algorithms.component import Component, argument_types
from ..algorithms.policy_loss import step_sample_weights
from ..data.loading import SeededPasses
from ..training import checks
from ..training.grpo_seams import pad
from ..training.loss import LossBatch
from ..training.metrics import append_metrics
from .config import TrinityConfig, from_trl_config, preset_component
from .spellings import component_argument_spelling
from .trinity import TrinityTrainer


def _policy_loss_class(config: TrinityConfig):
    return POLICY_LOSS_FN.get(config._policy_loss_name())


@dataclass(frozen=True)
class ChordPaperConfig:
    """The settings of one CHORD variant as the paper's authors released them (Trinity-RFT's `mix_chord` example,
    docs/trainers/chord.md#paper). ``mu_decay_steps=None``: μ decays over the whole run (``max_steps``)."""

    expert_data_ratio: float
    num_generations: int
    mu_warmup_steps: int
    mu_decay_steps: int | None
    mu_peak: float
    mu_valley: float
    enable_phi_function: bool


#: ``ChordConfig(paper_config=name)``: expert rows a fifth of each step's rows, 8 rollouts per prompt, no KL term, and
#: the variant's μ / φ. CHORD-μ: plain SFT term, μ cosine from 0.9 to 0.05 without warm-up (the release decays over
#: 200 steps; here over the run unless ``mu_decay_steps`` is set). CHORD-φ: φ-weighted SFT term, constant μ 0.1.
PAPER_CONFIGS: dict[str, ChordPaperConfig] = {
    "chord_mu": ChordPaperConfig(0.2, 8, 0, None, 0.9, 0.05, False),
    "chord_phi": ChordPaperConfig(0.2, 8, 0, 0, 0.1, 0.1, True),
}
#: μ decay steps of the release's CHORD-μ (Trinity-RFT's example run); the paper configuration scales it to the run
RELEASED_MU_DECAY_STEPS = 200
DEFAULT_EXPERT_DATA_RATIO = 0.25
#: the config's fields that are the CHORD loss's arguments of the same names (one left unset keeps the loss's default)
CHORD_LOSS_FIELDS = (
    "mu_warmup_steps",
    "mu_decay_steps",
    "mu_peak",
    "mu_valley",
    "enable_phi_function",
    "sft_loss_agg_mode",
)
#: ``ChordConfig()``'s CHORD (each field, left unset and not given in ``policy_loss``, takes this value): CHORD-μ, a
#: plain SFT term whose weight μ decays (cosine) from 0.9 to 0.05 without warm-up over the run (``max_steps``; the
#: release's 200 steps when it is unset), the variant our pre-registered study found ahead of SFT then GRPO and
#: CHORD-φ behind it (one 135M model, one toy task: docs/trainers/chord.md#default). The ``mix_chord`` loss's own
#: ``default_args()`` stay Trinity-RFT's (CHORD-φ, constant μ 0.1).
DEFAULT_CHORD = {"enable_phi_function": False, "mu_warmup_steps": 0, "mu_peak": 0.9, "mu_valley": 0.05}


@dataclass
class ChordFields:
    """CHORD's and MIX's own fields and checks, shared by [`ChordConfig`][] and the asynchronous
    [`AsyncChordConfig`][trinity_trl.trainers.async_algorithms.AsyncChordConfig]: the preset (a loss that mixes
    expert rows), the target expert share and μ's schedule, passed to the ``mix_chord`` loss as its arguments of the
    same names."""

    removed_spellings = {
        **TrinityConfig.removed_spellings,
        "rl_loss_agg_mode": component_argument_spelling("policy_loss", "grpo_loss_agg_mode"),
    }

    algorithm: str = field(default="mix_chord", metadata={"help": "'mix_chord' (CHORD) or 'mix'."})
    expert_data_ratio: float | None = field(
        default=None,
        metadata={"help": "Target expert fraction when expert_batch_size is None; unset 0.25 (0.2 with paper_config)."},
    )
    paper_config: str | None = field(
        default=None,
        metadata={
            "help": "'chord_mu' or 'chord_phi': the paper's released settings (expert share 0.2, 8 rollouts per "
            "prompt, no KL, the variant's mu and phi; CHORD-mu decays over max_steps unless mu_decay_steps is set)."
        },
    )
    mu_warmup_steps: int | None = field(
        default=None, metadata={"help": "Linear warm-up steps of mu (0 -> mu_peak); unset: 0."}
    )
    mu_decay_steps: int | None = field(
        default=None,
        metadata={"help": "Cosine decay steps of mu (mu_peak -> mu_valley); unset: max_steps (200 if unset)."},
    )
    mu_peak: float | None = field(default=None, metadata={"help": "Peak mu; unset: 0.9 (CHORD-mu)."})
    mu_valley: float | None = field(default=None, metadata={"help": "Final mu; unset: 0.05 (CHORD-mu)."})
    enable_phi_function: bool | None = field(
        default=None,
        metadata={"help": "phi(p)=p(1-p) token weights on the SFT loss (CHORD-phi); unset: False (CHORD-mu)."},
    )
    sft_loss_agg_mode: str | None = field(default=None, metadata={"help": "Aggregation of the SFT part."})

    def __post_init__(self):
        preset_loss = preset_component(self.algorithm, "policy_loss").name
        if "expert_mask" not in POLICY_LOSS_FN.get(preset_loss).inputs:
            raise ValueError(
                f"{type(self).__name__} trains presets whose loss mixes expert rows ('mix_chord' for CHORD, 'mix'); "
                f"got algorithm={self.algorithm!r}"
            )
        super().__post_init__()

    def _check_own_fields(self) -> None:
        if self.loss_normalization != "micro_batch":
            raise ValueError(
                f"{type(self).__name__}: loss_normalization must be 'micro_batch': MIX/CHORD weigh usual and expert "
                "samples with their own per-sample normalisation (docs/algorithms/chord.md#normalisation)"
            )
        if self.paper_config is not None:
            self._apply_paper_config()  # first: it sets the expert share
        elif self._policy_loss_name() == "mix_chord":
            self._apply_default_chord()
        if self.expert_data_ratio is None:
            self.expert_data_ratio = DEFAULT_EXPERT_DATA_RATIO
        if not 0.0 < self.expert_data_ratio < 1.0:
            raise ValueError(f"expert_data_ratio must be in (0, 1), got {self.expert_data_ratio}")

    def _check_paper_share(self, expert: int, rollouts: int, where: str) -> None:
        """With ``paper_config``, refuse ``expert`` demonstrations beside ``rollouts`` rollouts (per ``where``) unless
        they are exactly the released fifth of the rows."""
        if self.paper_config is not None and expert * 4 != rollouts:  # one demonstration per four rollouts
            raise ValueError(
                f"paper_config={self.paper_config!r} trains a fifth of each step's rows on demonstrations: "
                f"{expert} expert rows beside {rollouts} rollouts per {where} give "
                f"{expert / (expert + rollouts):.3f}; make per_device_train_batch_size a multiple of 4 "
                "(and leave expert_batch_size unset)"
            )

    def _apply_default_chord(self) -> None:
        """Fill the μ / φ fields left unset (and not given in ``policy_loss``) with `DEFAULT_CHORD`: CHORD-μ."""
        given = self.policy_loss.args if self.policy_loss is not None else {}
        decay = self.max_steps if self.max_steps > 0 else RELEASED_MU_DECAY_STEPS
        for name, value in {**DEFAULT_CHORD, "mu_decay_steps": decay}.items():
            if getattr(self, name) is None and name not in given:
                setattr(self, name, value)

    def _apply_paper_config(self) -> None:
        """Fill the unset fields with the paper variant's released values; refuse fields set to other values."""
        if self.paper_config not in PAPER_CONFIGS:
            raise ValueError(f"paper_config must be one of {sorted(PAPER_CONFIGS)}, got {self.paper_config!r}")
        paper = PAPER_CONFIGS[self.paper_config]
        owner = f"paper_config={self.paper_config!r}"
        if self.algorithm != "mix_chord":
            raise ValueError(f"{owner} is CHORD (algorithm='mix_chord'), got algorithm={self.algorithm!r}")
        if self.num_generations != paper.num_generations:
            raise ValueError(
                f"{owner} samples {paper.num_generations} rollouts per prompt, "
                f"got num_generations={self.num_generations}"
            )
        if self.kl_loss is not None and self.kl_loss.name != "none":
            raise ValueError(f"{owner} trains without a KL term, got kl_loss={self.kl_loss.to_dict()!r}")
        self.kl_loss = Component("none", **(self.kl_loss.args if self.kl_loss is not None else {}))
        decay = paper.mu_decay_steps
        if decay is None:  # CHORD-μ: the release's 200-step decay, scaled to the run
            decay = self.mu_decay_steps if self.mu_decay_steps is not None else self.max_steps
            if decay <= 0:
                raise ValueError(
                    f"{owner} decays mu over the whole run: set max_steps (or mu_decay_steps), got max_steps="
                    f"{self.max_steps}"
                )
        values = {
            "expert_data_ratio": paper.expert_data_ratio,
            "mu_warmup_steps": paper.mu_warmup_steps,
            "mu_decay_steps": decay,
            "mu_peak": paper.mu_peak,
            "mu_valley": paper.mu_valley,
            "enable_phi_function": paper.enable_phi_function,
        }
        for name, value in values.items():
            given = getattr(self, name)
            if given is not None and given != value:
                raise ValueError(f"{owner} sets {name}={value!r}, got {name}={given!r}; leave it unset")
            setattr(self, name, value)

    def _implied_components(self) -> dict[str, Component]:
        given = {name: getattr(self, name) for name in CHORD_LOSS_FIELDS if getattr(self, name) is not None}
        takes = argument_types(_policy_loss_class(self))
        misplaced = [name for name in given if name not in takes]
        if misplaced:
            raise ValueError(f"{misplaced} only apply to CHORD (mix_chord); MIX takes a constant policy_loss.mu")
        return {"policy_loss": Component(**given)}


@dataclass
class ChordConfig(ChordFields, TrinityConfig):
    r"""
    Configuration of [`ChordTrainer`][]: CHORD (`algorithm="mix_chord"`, default) or MIX (`"mix"`).

    Parameters:
        expert_batch_size (`int` or `None`, *optional*):
            Expert (demonstration) rows added to each process's generation batch. Must be a multiple of
            `steps_per_generation` so every micro-batch keeps the same size. `None`: derived from
            `expert_data_ratio`.
        expert_data_ratio (`float`, *optional*, defaults to `0.25`, `0.2` with `paper_config`):
            Target fraction of expert rows in the mixed batch, used when `expert_batch_size` is `None`;
            the count is rounded to a multiple of `steps_per_generation` (at least one per micro-step).
        paper_config (`str` or `None`, *optional*):
            `"chord_mu"` or `"chord_phi"`: the paper's variant with the values its authors released (expert share
            0.2, 8 rollouts per prompt, no KL term; CHORD-μ: plain SFT term, μ cosine from 0.9 to 0.05 without
            warm-up over the whole run, `max_steps`, unless `mu_decay_steps` is set (the release decays over 200
            steps); CHORD-φ: φ-weighted SFT term, constant μ 0.1). Unset fields take these values; a field set to
            another value is an error, as is a batch whose expert share would not be exactly 0.2.
        mu_warmup_steps (`int`, *optional*): Steps of linear warm-up of μ from 0 to `mu_peak` (default 0).
        mu_decay_steps (`int`, *optional*): Steps of cosine decay of μ from `mu_peak` to `mu_valley` (default:
            `max_steps`, the whole run; 200, the release's, when `max_steps` is unset).
        mu_peak (`float`, *optional*): μ at the end of the warm-up (default 0.9).
        mu_valley (`float`, *optional*): μ after the decay (default 0.05).
        enable_phi_function (`bool`, *optional*):
            Weight each expert token's NLL by `φ(p) = p(1 − p)` (CHORD-φ); `False` (the default) uses plain SFT
            (CHORD-μ). The defaults make `ChordConfig()` CHORD-μ, the variant the study in docs/benchmarks.md found
            ahead of SFT then GRPO (one 135M model, one toy task); CHORD-φ with its released constant μ:
            `enable_phi_function=True, mu_peak=0.1, mu_valley=0.1, mu_decay_steps=0` (the default before 0.2.0).
        sft_loss_agg_mode (`str` or `None`, *optional*): Aggregation of the SFT part (default: `loss_agg_mode`).
        policy_loss (`dict`, *optional*): the loss's other arguments, e.g.
            `{"grpo_loss_agg_mode": "seq-mean-token-mean"}` (aggregation of the RL (PPO) part, default:
            `loss_agg_mode`).

    The μ fields are the `mix_chord` loss's arguments of the same names: a field left unset takes the default above
    (or the value given in `policy_loss`, where `policy_loss={"mu_peak": 0.9}` is the same as `mu_peak=0.9`); the
    same argument set to two values is an error. The paper's variants with their released settings:
    `paper_config="chord_mu"` or `"chord_phi"`. For MIX, μ is constant: set it with `policy_loss={"mu": ...}` (the
    schedule fields must then stay unset).
    """

    expert_batch_size: int | None = field(
        default=None, metadata={"help": "Expert rows per process per generation batch."}
    )

    def _check_own_fields(self) -> None:
        super()._check_own_fields()
        spg = self.steps_per_generation
        if self.expert_batch_size is not None and (self.expert_batch_size < spg or self.expert_batch_size % spg):
            raise ValueError(
                f"expert_batch_size ({self.expert_batch_size}) must be a positive multiple of steps_per_generation "
                f"({spg}); otherwise TRL's batch split would drop rows"
            )
        self._check_paper_share(self.local_expert_rows(), self.per_device_train_batch_size * spg, "generation batch")

    def local_expert_rows(self) -> int:
        """Expert rows each process adds to one generation batch."""
        if self.expert_batch_size is not None:
            return self.expert_batch_size
        spg = self.steps_per_generation
        rollouts = self.per_device_train_batch_size * spg
        wanted = self.expert_data_ratio / (1.0 - self.expert_data_ratio) * rollouts
        return max(1, round(wanted / spg)) * spg

    def derived_policy_loss_arguments(self) -> dict[str, Any]:
        """The loss's per-sample weights (docs/algorithms/chord.md#normalisation), from this config's batch geometry:
        every usual (expert) sample of an optimizer step weighs ``w = GA / (usual (expert) samples per process per
        optimizer step)``; the trainer divides by GA, so each sample counts ``1 / B_u``."""
        steps = self.gradient_accumulation_steps / self.steps_per_generation  # generation batches per step
        rollouts = self.per_device_train_batch_size * self.steps_per_generation
        usual, expert = step_sample_weights(
            rollouts * steps, self.local_expert_rows() * steps, self.gradient_accumulation_steps
        )
        return {"usual_sample_weight": usual, "expert_sample_weight": expert}


def _expert_columns(dataset: Dataset) -> str:
    columns = set(dataset.column_names)
    if "messages" in columns:
        return "messages"
    if {"prompt", "completion"} <= columns:
        return "prompt_completion"
    raise ValueError(
        "expert_dataset needs a 'messages' column (conversations ending with the assistant's answer) or "
        f"'prompt' and 'completion' columns; it has {sorted(columns)}"
    )


def expert_example(dataset: Dataset, index: int, expert_format: str) -> tuple[Any, str]:
    """``(prompt, answer text)`` of row ``index`` of ``dataset`` in ``expert_format`` (`_expert_columns`): the
    conversation before the assistant's answer (or the ``prompt`` column) and that answer."""
    row = dataset[index]
    if expert_format == "messages":
        messages = row["messages"]
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError(f"expert_dataset row {index}: the last message must be the assistant's answer")
        prompt, answer = messages[:-1], messages[-1]["content"]
    else:
        prompt, answer = row["prompt"], row["completion"]
        if isinstance(answer, list):
            if len(answer) != 1 or answer[0].get("role") != "assistant":
                raise ValueError(
                    f"expert_dataset row {index}: a conversational completion must be one assistant message"
                )
            answer = answer[0]["content"]
    if not isinstance(answer, str) or not answer:
        raise ValueError(f"expert_dataset row {index}: empty completion")
    return prompt, answer


def expert_completion_ids(tokenizer: Any, answer: str, max_completion_length: int) -> list[int]:
    """The trained tokens of a demonstration: its answer's ids and the end-of-sequence id, cut to
    ``max_completion_length`` like a rollout."""
    ids = tokenizer(text=answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids[:max_completion_length]


class ExpertRowsLoss:
    """Trainer mixin (before `TrinityLossMixin` in the bases): the expert rows' inputs of a MIX/CHORD policy loss,
    for ChordTrainer and AsyncChordTrainer alike."""

    def _loss_inputs(self, batch: LossBatch, logps: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
        loss_inputs = super()._loss_inputs(batch, logps, mask)
        loss_inputs["expert_mask"] = batch.expert_rows
        # demonstrations' behaviour log-probs are 0 (docs/algorithms/chord.md#expert-rows) whether or not TRL computed
        # old log-probs
        loss_inputs["old_logprob"] = loss_inputs["old_logprob"].masked_fill(batch.expert_rows.unsqueeze(1), 0.0)
        # Trinity stamps samples with the step being trained, counted from 1 (docs/algorithms/chord.md#chord)
        loss_inputs["step"] = self.state.global_step + 1
        return loss_inputs


class ChordTrainer(ExpertRowsLoss, TrinityTrainer):
    """[`TrinityTrainer`][] that mixes expert demonstrations into every generation batch (CHORD / MIX).

    Args:
        expert_dataset (`datasets.Dataset`): demonstrations, in the formats TRL's `SFTTrainer`
            accepts: conversational `messages` (the last message is the assistant's answer), or
            `prompt` (text or messages) + `completion` (text or an assistant message list).
        Other arguments: as [`TrinityTrainer`][].

    Logged: `actor/mu`, the SFT loss (`actor/expert/sft_phi_loss` or `actor/expert/sft_loss`), the
    RL loss (`actor/usual/pg_loss`), both scaled as in docs/algorithms/chord.md#normalisation, and per generation batch
    `chord/expert_rows`, `chord/expert_tokens`, `chord/on_policy_tokens`.
    """

    config_class = ChordConfig
    supports_expert_rows = True

    def __init__(self, model, reward_funcs=None, args: ChordConfig | None = None, *pos, expert_dataset=None, **kwargs):
        args = from_trl_config(args, ChordConfig, "ChordTrainer")  # a plain GRPOConfig is converted
        for name in ("environment_factory", "agent"):  # checked first: the agent, not the missing dataset, is wrong
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"ChordTrainer does not support {name}: expert rows have no environment (train agents with "
                    "StepGRPOTrainer)"
                )
        if expert_dataset is None:
            raise ValueError("ChordTrainer needs an expert_dataset (demonstrations for the SFT part)")
        if len(expert_dataset) == 0:
            raise ValueError("expert_dataset is empty")
        self._expert_format = _expert_columns(expert_dataset)
        self.expert_dataset = expert_dataset
        self._expert_cache: dict[int, tuple[Any, list[int]]] = {}
        self._expert_cursor = 0  # rows of the global expert stream consumed so far
        self._expert_order: SeededPasses | None = None  # built with the run's seed at the first draw
        self._eval_policy_loss = None  # built at the first evaluation
        super().__init__(model, reward_funcs, args, *pos, **kwargs)

    # ---------------------------------------------------------------------------- expert rows
    def _next_expert_indices(self) -> list[int]:
        """This process's slice of the next expert rows: one global stream, reshuffled every pass over the dataset
        with the run's seed (`SeededPasses`), split contiguously across processes."""
        per_process = self.args.local_expert_rows()
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        if self._expert_order is None:
            self._expert_order = SeededPasses(len(self.expert_dataset), self.args.seed)
        start = self._expert_cursor + rank * per_process
        rows = [self._expert_order.row(position) for position in range(start, start + per_process)]
        self._expert_cursor += world * per_process
        return rows

    def _trainer_state(self) -> dict[str, Any]:
        return {**super()._trainer_state(), "expert_cursor": self._expert_cursor}

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        super()._load_trainer_state(state)
        self._expert_cursor = state["expert_cursor"]

    def _policy_loss_for(self, mode: str):
        # evaluation batches hold rollouts only, in eval micro-batches: weigh each of their samples
        # equally instead of with the training step's geometry (docs/algorithms/chord.md#normalisation weights)
        if mode == "train":
            return self.components.policy_loss
        if self._eval_policy_loss is None:
            rows = self.args.per_device_eval_batch_size  # an eval micro-batch is its own step
            usual, expert = step_sample_weights(rows, rows, 1)
            self._eval_policy_loss = self.algorithm.build_policy_loss(
                usual_sample_weight=usual, expert_sample_weight=expert
            )
        return self._eval_policy_loss

    def _tokenize_expert(self, index: int) -> tuple[Any, list[int]]:
        """``(prompt for TRL's prompt tokenizer, completion ids + eos)`` of expert row ``index``."""
        if index not in self._expert_cache:
            prompt, answer = expert_example(self.expert_dataset, index, self._expert_format)
            self._expert_cache[index] = (
                prompt,
                expert_completion_ids(self._tokenizer, answer, self.max_completion_length),
            )
        return self._expert_cache[index]

    def _expert_batch(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Expert rows tokenized like rollouts: left-padded prompts, right-padded completions."""
        indices = self._next_expert_indices()
        prompts, completions = zip(*(self._tokenize_expert(i) for i in indices))
        prompt_ids, images, multimodal = self._tokenize_prompts(list(prompts))
        if images is not None or multimodal:
            raise ValueError("expert_dataset prompts with images are not supported")
        checks.check_context(
            [len(p) for p in prompt_ids],
            [len(c) for c in completions],
            self._max_positions,
            lambda i: f"expert_dataset row {indices[i]}",
        )
        pad_id = self._tokenizer.pad_token_id

        def padded(rows, value, side):  # masks come from lengths: the pad token may equal eos
            return pad([torch.as_tensor(r, dtype=torch.long) for r in rows], padding_value=value, padding_side=side).to(
                device
            )

        return {
            "prompt_ids": padded(prompt_ids, pad_id, "left"),
            "prompt_mask": padded([[1] * len(p) for p in prompt_ids], 0, "left"),
            "completion_ids": padded(completions, pad_id, "right"),
            "completion_mask": padded([[1] * len(c) for c in completions], 0, "right"),
        }

    def _training_batch(self, output: dict, inputs: list[dict], rewards: torch.Tensor, mode: str) -> dict:
        output = super()._training_batch(output, inputs, rewards, mode)
        n_rollouts = output["prompt_ids"].shape[0]
        device = output["prompt_ids"].device
        if mode == "eval":  # evaluation scores rollouts only
            output["expert_mask"] = torch.zeros(n_rollouts, dtype=torch.bool, device=device)
            return output
        expert = self._expert_batch(device)
        n_expert = expert["prompt_ids"].shape[0]
        merged: dict[str, Any] = {
            "prompt_ids": _stack(output["prompt_ids"], expert["prompt_ids"], self._tokenizer.pad_token_id, left=True),
            "prompt_mask": _stack(output["prompt_mask"], expert["prompt_mask"], 0, left=True),
            "completion_ids": _stack(
                output["completion_ids"], expert["completion_ids"], self._tokenizer.pad_token_id, left=False
            ),
            "completion_mask": _stack(output["completion_mask"], expert["completion_mask"], 0, left=False),
            "expert_mask": torch.arange(n_rollouts + n_expert, device=device) >= n_rollouts,
            "num_items_in_batch": output["num_items_in_batch"],
        }
        width = merged["completion_ids"].shape[1]

        def extend(key: str, fill: float) -> torch.Tensor:
            value = output[key]
            rows = torch.full((n_expert, *value.shape[1:]), fill, dtype=value.dtype, device=device)
            stacked = torch.cat([value, rows]) if value.dim() == 1 else _stack(value, rows, fill, left=False)
            return stacked if value.dim() == 1 or value.shape[1] == 1 else _widen(stacked, width, fill)

        merged["advantages"] = extend("advantages", 0.0)
        # demonstrations' behaviour log-probs are 0 (docs/algorithms/chord.md#expert-rows); the PPO part never sees
        # these rows
        for key, fill in (
            ("old_per_token_logps", 0.0),
            ("sampling_per_token_logps", float("nan")),
            ("tool_mask", 1),
            ("importance_sampling_ratio", 1.0),
        ):
            if key in output:
                merged[key] = extend(key, fill)
        if "ref_per_token_logps" in output:
            merged["ref_per_token_logps"] = torch.cat(
                [
                    _widen(output["ref_per_token_logps"], width, 0.0),
                    _widen(self.scoring.reference_logps(expert), width, 0.0),
                ]
            )
        unknown = set(output) - set(merged)
        if unknown:
            raise ValueError(f"ChordTrainer cannot append expert rows to batches with {sorted(unknown)}")
        append_metrics(
            self._metrics["train"],
            {
                "chord/expert_rows": float(n_expert),
                "chord/expert_tokens": expert["completion_mask"].sum(),
                "chord/on_policy_tokens": output["completion_mask"].sum(),
            },
        )
        return merged


def _widen(x: torch.Tensor, width: int, value: float, left: bool = False) -> torch.Tensor:
    """Pad ``(B, T)`` to ``(B, width)`` on the right (or left) with ``value``."""
    missing = width - x.shape[1]
    if missing <= 0:
        return x
    pad = torch.full((x.shape[0], missing), value, dtype=x.dtype, device=x.device)
    return torch.cat([pad, x] if left else [x, pad], dim=1)


def _stack(a: torch.Tensor, b: torch.Tensor, value: float, left: bool) -> torch.Tensor:
    """Rows of ``a`` then ``b``, padded to a common width (prompts on the left, completions on the right)."""
    width = max(a.shape[1], b.shape[1])
    return torch.cat([_widen(a, width, value, left), _widen(b.to(a.dtype), width, value, left)])
