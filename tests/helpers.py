"""Shared test helpers: a tiny tokenizer and model built offline, tiny datasets, CPU GRPO/SFT/DPO settings, rewards,
and for trainer tests: `recording(cls)` (a trainer that records what flows through TRL's seams), batches made through
the generation seam (`generate_batch`, `harden_batch`), `loss_and_grads`, and independent log-probs and gradients
(`plain_token_logps`, `parameter_grads`, `assert_grads_close`).

`tests/conftest.py` puts this directory on `sys.path`, so test modules (and scripts started from tests, e.g. under
`torchrun`) import these with `from helpers import ...`. Heavy imports (transformers, datasets) happen inside the
functions, so importing this module is cheap.

Everything here is deterministic and needs no network: the tokenizer is a byte-level BPE trained in about 0.3 s on a
synthetic corpus, and the model is a randomly initialised 2-layer Qwen2 (about 200k parameters).
"""

from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass, field
from typing import Any

# ChatML, as used by Qwen2: `<|im_start|>role\ncontent<|im_end|>\n` per message.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PAD_TOKEN = "<|endoftext|>"
BOS_CHAT_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_CHAT_TOKEN, EOS_TOKEN]

TINY_VOCAB_SIZE = 512

# `transformers/models/qwen2/tokenization_qwen2.py` PRETOKENIZE_REGEX.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_WORDS = (  # noqa: SIM905
    "the a an is are was what how many much plus minus times equals answer question number sum total "
    "apples books cats dogs friends has have gives takes left right more less first then so because "
    "please think step by step final result correct wrong yes no and or of to in on with for from"
).split()


def tiny_corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """A synthetic arithmetic / English corpus (`num_lines` strings), deterministic for a given seed."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        kind = i % 4
        if kind == 0:
            lines.append(f"What is {a}+{b}? The answer is {a + b}.")
        elif kind == 1:
            lines.append(f"Question: {a} - {b} = {a - b}\nAnswer: {a - b}")
        elif kind == 2:
            lines.append(f"{a} * {b} = {a * b}. Let's think step by step.")
        else:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))).capitalize() + ".")
    return lines


def build_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE):
    """Train a byte-level BPE on `tiny_corpus()` and wrap it in a `PreTrainedTokenizerFast`.

    Special tokens: `<|im_start|>`, `<|im_end|>` (eos) and `<|endoftext|>` (pad); ChatML chat template; left
    padding (what generation wants). The byte-level alphabet makes it lossless on any text.
    """
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    # The same normalizer / pre-tokenizer / decoder as `Qwen2Tokenizer`. Transformers 5 loads any tokenizer saved
    # next to a Qwen2 `config.json` as `Qwen2Tokenizer`, which rebuilds this pipeline around the saved vocab and
    # merges; matching it keeps the token ids identical whichever directory the tokenizer is loaded from.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHATML_TEMPLATE,
        padding_side="left",
    )


def build_tiny_model(tokenizer, arch: str = "qwen2", seed: int = 0):
    """A randomly initialised tiny causal LM whose vocabulary and eos/pad ids match `tokenizer`.

    `arch="qwen2"` (default) or `"llama"`: hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads (head_dim 16),
    tied embeddings. Weights are drawn under `seed` without disturbing the global torch RNG.
    """
    import torch

    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
    }
    if arch == "qwen2":
        from transformers import Qwen2Config as Config
        from transformers import Qwen2ForCausalLM as Model
    elif arch == "llama":
        from transformers import LlamaConfig as Config
        from transformers import LlamaForCausalLM as Model
    else:
        raise ValueError(f"arch must be 'qwen2' or 'llama', got {arch!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Model(Config(**common))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny_model(path: str | os.PathLike, tokenizer=None, arch: str = "qwen2", seed: int = 0) -> str:
    """Build the tiny model (and tokenizer if not given) and `save_pretrained` both into `path`; return `str(path)`.

    Pass the returned path as `model=` to trainers: TRL reloads the reference model from `config._name_or_path`,
    which is empty for an in-memory model.
    """
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, arch=arch, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def arithmetic_rows(n: int = 32) -> list[tuple[int, int]]:
    """`n` distinct `(a, b)` pairs (n <= 81), in a fixed order."""
    pairs = [(a, b) for b in range(1, 10) for a in range(1, 10)]
    if not 1 <= n <= len(pairs):
        raise ValueError(f"n must be in [1, {len(pairs)}], got {n}")
    return pairs[:n]


def tiny_conversational_dataset(n: int = 32):
    """`datasets.Dataset` with columns `prompt` (one user message) and `answer` (str); all prompts distinct."""
    from datasets import Dataset

    rows = arithmetic_rows(n)
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {a}+{b}?"}] for a, b in rows],
            "answer": [str(a + b) for a, b in rows],
        }
    )


def tiny_plain_text_dataset(n: int = 32):
    """`datasets.Dataset` with columns `prompt` (plain string) and `answer` (str); all prompts distinct."""
    from datasets import Dataset

    rows = arithmetic_rows(n)
    return Dataset.from_dict(
        {
            "prompt": [f"Question: what is {a}+{b}? Answer:" for a, b in rows],
            "answer": [str(a + b) for a, b in rows],
        }
    )


# tests/tolerance.py's `terms` for a value the tiny model computes on a tiny batch (a loss, a log-prob, a gradient
# element): the longest chain of additions behind it is a sum over the batch's tokens (at most 8 rows x 64 positions)
# plus, backwards through the model, the vocabulary softmax (512), and per layer the MLP (128), three hidden-size
# projections (64) and an attention row (64 keys): 512 + 512 + 2 * (128 + 3 * 64 + 64) = 1792, rounded up.
TINY_MODEL_TERMS = 2048
# the magnitude of one token's log-prob under the random tiny model (nearly uniform over its 512 tokens): log(512);
# a summed log-prob of n tokens is about n times this, the scale of a comparison of sums that cancel (DPO margins)
TINY_LOGP_SCALE = 6.25


def trained_weights_atol(steps: int, lr: float, terms: int = TINY_MODEL_TERMS) -> float:
    """Absolute tolerance on weights after ``steps`` Adam(W) steps at learning rate ``lr`` from the same start, when
    the two runs' gradients differ by rounding only: Adam moves an element by at most about ``lr`` a step in a
    direction ``m / sqrt(v)`` that inherits the gradients' relative error (tests/tolerance.py's ``rtol`` for
    ``terms``), and each update rounds the weight (float32, |w| < 1): ``steps * (lr * rtol + eps)``."""
    import torch
    from tolerance import tolerance

    return steps * (lr * tolerance(torch.float32, terms=terms)["rtol"] + torch.finfo(torch.float32).eps)


def tiny_grpo_kwargs(**overrides: Any) -> dict[str, Any]:
    """CPU-friendly `GRPOConfig` keyword arguments for the tiny model; `overrides` replace or add entries.

    Does not set `output_dir`: pass `output_dir=str(tmp_path)`. Generation batch: 4 rows = 1 prompt x 4 completions
    of at most 8 tokens; 2 optimizer steps.
    """
    kwargs: dict[str, Any] = {
        "use_cpu": True,
        "bf16": False,
        "activation_checkpointing": False,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 2,
        "learning_rate": 1e-3,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "ddp_find_unused_parameters": False,
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    kwargs.update(overrides)
    return kwargs


def completion_text(completion: Any) -> str:
    """Text of one completion: a string, or the concatenated `content` of a list of chat messages."""
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content") or "" for message in completion)


def length_reward(completions: list, **kwargs: Any) -> list[float]:
    """Reward = number of characters in the completion / 10. Random models give group variance > 0 almost surely."""
    return [len(completion_text(c)) / 10.0 for c in completions]


def answer_reward(completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 where the completion contains the row's `answer` string, else 0.0."""
    return [float(str(a) in completion_text(c)) for c, a in zip(completions, answer, strict=True)]


# --------------------------------------------------------------------------------------------------- trainer tests
def lora_config(r: int = 4):
    """The LoRA adapter of the trainer tests: rank `r` on `q_proj`/`v_proj` of the tiny model."""
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def detached(batch: dict) -> dict:
    """`batch` with every tensor detached and cloned (other values as they are)."""
    import torch

    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@dataclass
class RewardCall:
    """One `_calculate_rewards` call: its arguments and the `(N, n_funcs)` rewards it returned (every process's,
    NaN where a function did not score), cloned."""

    prompts: list
    completions: list
    completion_ids: list[list[int]]
    rewards: Any


@dataclass
class LogpsCall:
    """One `_get_per_token_logps_and_entropies` call. `arguments`: its arguments by name, defaults applied
    (`model`, `input_ids`, `logits_to_keep`, `batch_size`, `compute_entropy`, ...); `result`: what it returned,
    as returned (`(logps, entropies, aux_loss)`, not cloned: the log-probs of a training forward carry their graph,
    which the record keeps alive as long as the trainer: fine for the tiny models of the tests)."""

    arguments: dict[str, Any]
    result: Any


@dataclass
class LossCall:
    """One loss call (`_compute_loss` of a GRPOTrainer, `compute_loss` of any other trainer).

    `inputs`: the micro-batch as the call received it (tensors cloned before the call); `forward`: the first
    `LogpsCall` made inside the call (None if none), whose `result[0]` are the grad-carrying log-probs the loss was
    built from; `loss`: the returned loss, detached and cloned; `global_step`: `state.global_step` during the call
    (0-based: the step being trained is `global_step + 1`).
    """

    inputs: dict
    forward: LogpsCall | None
    loss: Any
    global_step: int

    @property
    def logps(self):
        return None if self.forward is None else self.forward.result[0]


@dataclass
class Recorded:
    """What a `recording(cls)` trainer saw, in call order.

    `batches`: every training batch `_generate_and_score_completions` returned (tensors cloned); `rows`: the rows
    passed to it, after the call (so with the fields TRL wrote into them, e.g. a rollout's `run`), one list per call;
    `reward_calls`, `logps_calls`, `loss_calls`: see `RewardCall`, `LogpsCall`, `LossCall`.
    """

    batches: list[dict] = field(default_factory=list)
    rows: list[list[dict]] = field(default_factory=list)
    reward_calls: list[RewardCall] = field(default_factory=list)
    logps_calls: list[LogpsCall] = field(default_factory=list)
    loss_calls: list[LossCall] = field(default_factory=list)


@functools.cache
def recording(cls: type) -> type:
    """A subclass of the trainer class `cls` (TRL's `GRPOTrainer`, any trinity_trl trainer, TRL's SFT/DPO trainers)
    that records what flows through the seams into `trainer.recorded` (a `Recorded`) without changing anything.

    The same class comes back for the same `cls`. Seams `cls` lacks are never called, so recording them costs
    nothing. A test that needs more (a value changed on its way, another hook) subclasses the result locally.
    """
    import inspect

    from trl import GRPOTrainer

    class Recording(cls):
        def __init__(self, *args, **kwargs):
            self.recorded = Recorded()
            super().__init__(*args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.recorded.rows.append([dict(row) for row in inputs])
            self.recorded.batches.append(detached(output))
            return output

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self.recorded.reward_calls.append(
                RewardCall(
                    list(prompts),
                    list(completions),
                    [list(ids) for ids in completion_ids_list],
                    rewards.detach().clone(),
                )
            )
            return rewards

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            bound = inspect.signature(super()._get_per_token_logps_and_entropies).bind(*args, **kwargs)
            bound.apply_defaults()
            self.recorded.logps_calls.append(LogpsCall(dict(bound.arguments), result))
            return result

        def _recorded_loss_call(self, call, model, inputs, *args, **kwargs):
            cloned, first = detached(inputs), len(self.recorded.logps_calls)
            loss = call(model, inputs, *args, **kwargs)
            forwards = self.recorded.logps_calls[first:]
            value = loss[0] if isinstance(loss, tuple) else loss  # compute_loss(return_outputs=True)
            self.recorded.loss_calls.append(
                LossCall(cloned, forwards[0] if forwards else None, value.detach().clone(), self.state.global_step)
            )
            return loss

        def _compute_loss(self, model, inputs):
            return self._recorded_loss_call(super()._compute_loss, model, inputs)

        def compute_loss(self, model, inputs, *args, **kwargs):
            return self._recorded_loss_call(super().compute_loss, model, inputs, *args, **kwargs)

    # one loss seam: GRPOTrainer.compute_loss calls _compute_loss; the other trainers' seam is compute_loss
    delattr(Recording, "compute_loss" if issubclass(cls, GRPOTrainer) else "_compute_loss")
    Recording.__name__ = Recording.__qualname__ = f"Recording{cls.__name__}"
    Recording.__doc__ = f"`{cls.__name__}` recording what it sees in `self.recorded` (tests/helpers.py `recording`)."
    return Recording


def generate_batch(trainer, dataset, prompts=(0,), seed: int = 0, group: int = 4) -> dict:
    """One generation batch through the trainer's `_generate_and_score_completions` seam: `group` copies of each
    dataset row in `prompts` (what TRL's sampler hands it), scored, with advantages; tensors detached and cloned."""
    import torch

    trainer.model.train()
    torch.manual_seed(seed)
    rows = [dict(dataset[i]) for i in prompts for _ in range(group)]
    return detached(trainer._generate_and_score_completions(rows))


def policy_logps(trainer, batch: dict):
    """No-grad log-probs of `batch`'s completions under the trainer's current policy, through TRL's own helper
    (`GRPOTrainer`'s, so a recording subclass does not record the call)."""
    import torch
    from trl import GRPOTrainer

    with torch.no_grad():
        logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer,
            trainer.model,
            torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
            batch["completion_ids"].size(1),
        )
    return logps


def harden_batch(
    trainer, batch: dict, *, ragged=True, old_noise=0.3, ref_noise=0.2, empty_row=False, lengths=None
) -> dict:
    """A copy of a 4-row `batch` made harder: ragged completion masks (the random model never emits EOS, so every
    row is full otherwise; `lengths` per row, default `[width, width - 2, 3, 1]`, 0 for the last with
    `empty_row`), an off-policy `old_per_token_logps` (ratios far from 1, so clips and gates are exercised) and a
    perturbed `ref_per_token_logps` where present (a non-zero KL)."""
    import torch

    batch = detached(batch)
    width = batch["completion_mask"].shape[1]
    if ragged:
        lengths = torch.tensor(lengths if lengths is not None else [width, width - 2, 3, 0 if empty_row else 1])
        ragged_mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(batch["completion_mask"].dtype)
        batch["completion_mask"] = batch["completion_mask"] * ragged_mask
        batch["num_items_in_batch"] = batch["completion_mask"].sum()
        if "global_loss_tokens" in batch:  # TrinityConfig(loss_normalization="global"): the same count
            batch["global_loss_tokens"] = batch["completion_mask"].sum().float()
    generator = torch.Generator().manual_seed(1)
    logps = policy_logps(trainer, batch)
    if old_noise:
        batch["old_per_token_logps"] = logps + old_noise * torch.randn(logps.shape, generator=generator)
    if ref_noise and "ref_per_token_logps" in batch:
        batch["ref_per_token_logps"] = logps + ref_noise * torch.randn(logps.shape, generator=generator)
    return batch


def loss_and_grads(trainer, inputs: dict, ga: int = 1):
    """`(loss, {name: grad})` of one `_compute_loss` call on `inputs` in training mode, as the trainer's loop runs
    it with `ga` accumulation steps (the returned loss is divided by `ga`); the gradients are cleared afterwards."""
    import torch

    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = ga  # set by Trainer's loop; _compute_loss divides by it
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, dict(inputs))
    loss.backward()
    grads = {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


# ------------------------------------------------------------------------------------- TRL's SFT and DPO trainers
def tiny_sft_dpo_kwargs(output_dir, **overrides: Any) -> dict[str, Any]:
    """CPU-friendly `SFTConfig` / `DPOConfig` keyword arguments for the tiny model: batches of 4, 2 steps, sequences
    of at most 64 tokens; `overrides` replace or add entries."""
    kwargs: dict[str, Any] = {
        "output_dir": str(output_dir),
        "use_cpu": True,
        "bf16": False,
        "activation_checkpointing": False,
        "per_device_train_batch_size": 4,
        "max_steps": 2,
        "max_length": 64,
        "learning_rate": 1e-3,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "seed": 0,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    return {**kwargs, **overrides}


def first_batch(trainer) -> dict:
    """The first training micro-batch of a transformers `Trainer`, prepared as `compute_loss` gets it."""
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def plain_token_logps(model, input_ids, attention_mask, labels):
    """Per-token log-probs and entropies of the shifted `labels` (-100: not a target) from a plain forward of `model`
    (`logits -> log_softmax -> gather`), independent of TRL's fused head: `(B, T-1)` each, and the target mask."""
    import torch

    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    targets = labels[:, 1:]
    mask = targets != -100
    log_probs = torch.log_softmax(logits, dim=-1)
    token = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return token * mask, entropy * mask, mask


def parameter_grads(model) -> dict:
    """`{name: gradient}` (cloned) of every parameter of `model` that has one."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(a: dict, b: dict, terms: int | None = None) -> None:
    """The same non-empty set of parameters, and each gradient close within tests/tolerance.py's bound for
    ``terms`` (default :data:`TINY_MODEL_TERMS`), relative to that parameter's largest gradient."""
    from tolerance import assert_close

    assert a.keys() == b.keys() and a
    for name in a:
        assert_close(a[name], b[name], terms=terms or TINY_MODEL_TERMS, msg=lambda m, n=name: f"{n}: {m}")
