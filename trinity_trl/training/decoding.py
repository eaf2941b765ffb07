"""How our trainers decode with transformers' ``generate``: compiled decoding and one prefill per group
(docs/generation.md).

Two options of every trainer config (`trinity_trl.trainers.config.GenerationFields`) say what happens:

* ``compile_generation`` (``"auto"`` / ``"on"`` / ``"off"``): decode with transformers' static KV cache and its
  own compilation of the model's forward (``torch.compile``, CUDA graphs on CUDA). `choose_decoding` decides once per
  run; `compile_refusal` names the setups it cannot run in.
* ``one_prefill_per_group``: TRL's sampler puts a prompt's G copies in consecutive rows and ``generate`` would encode
  each copy. `GroupedDecoding.generate` encodes each distinct prompt once (without its last token) into a KV cache,
  copies that cache to the group's rows, and lets ``generate`` go on from there: each row then encodes its prompt's
  last token and draws its own first token, exactly as with G separate prefills.

`GroupedDecoding` stands between TRL's generation and the model's ``generate`` for one call at a time
(`GroupedDecoding.around`). With compiled decoding it owns the static caches: one per run and batch bucket, its length
fixed once per run (`CacheLength`), reset between calls, so compiled graphs (and CUDA graphs) see the same shapes and
addresses at every step. It counts what ``torch.compile`` does while it decodes (`CompileEvents`) and warns when a
batch shape it had compiled before compiles again (a recompilation: after ``torch._dynamo.config.recompile_limit`` of
them torch decodes eagerly without a word).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .trl_seams import (
    CompileEvents,
    cache_keyword,
    compile_on_every_device,
    input_hooks_kept,
    intercepted,
    is_full_attention_cache,
)

logger = logging.getLogger("trinity_trl")

COMPILE_GENERATION_CHOICES = ("auto", "on", "off")

#: ``generate`` keyword arguments the grouped prefill understands; anything else (images, token type ids) is passed
#: to a plain ``generate``
PLAIN_INPUTS = ("input_ids", "attention_mask")


@dataclass(frozen=True)
class DecodingChoice:
    """What a run's generation does: ``compiled`` decoding (static cache + ``torch.compile``), ``grouped`` prefill
    (one per distinct prompt)."""

    compiled: bool
    grouped: bool


def compile_refusal(
    *, engine: str, zero3: bool = False, quantized: bool = False, offloaded: bool = False, cache: str | None = None
) -> str | None:
    """Why compiled decoding cannot run here, or ``None``. ``engine``: ``"single"``, ``"ddp"``, ``"deepspeed"`` or
    ``"fsdp"``; ``zero3``: DeepSpeed's stage 3; ``quantized``: the model's weights are quantized (bitsandbytes, ...);
    ``offloaded``: some of its layers live on the CPU or disk; ``cache``: the ``cache_implementation`` the user asked
    ``generate`` for."""
    if engine == "fsdp":
        return "under FSDP (generation gathers the sharded weights around every call)"
    if engine == "deepspeed" and zero3:
        return "under DeepSpeed ZeRO-3 (generation gathers the sharded weights around every call)"
    if quantized:
        return "with a quantized model"
    if offloaded:
        return "with layers offloaded to the CPU or disk"
    if cache not in (None, "static"):
        return f"with cache_implementation={cache!r} (compiled decoding needs transformers' static cache)"
    return None


def model_facts(model: Any) -> dict[str, bool]:
    """``{"quantized": ..., "offloaded": ...}`` of a transformers model (or a PEFT model around one), as
    `compile_refusal` takes them: quantized weights (transformers' ``hf_quantizer``), layers placed on the CPU or disk
    beside another device (``hf_device_map``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    devices = {str(d) for d in (getattr(base, "hf_device_map", None) or {}).values()}
    return {
        "quantized": getattr(base, "hf_quantizer", None) is not None,
        "offloaded": "disk" in devices or ("cpu" in devices and len(devices) > 1),
    }


def choose_decoding(
    compile_generation: str,
    one_prefill_per_group: bool,
    *,
    device: torch.device | str,
    backend: str,
    refusal: str | None,
    cache: str | None = None,
    owner: str = "the trainer",
) -> DecodingChoice:
    """The run's `DecodingChoice` from the two options, where it runs, and ``backend`` (``"transformers"``: the
    model's ``generate``; otherwise the name of what generates instead, ``"vLLM"`` or ``"continuous batching"``, which
    compile and share prompts in their own way: an option set explicitly is then ignored with one log line).

    ``compile_generation="auto"`` is on on CUDA where `compile_refusal` gives no reason, off elsewhere (on a CPU
    compiled decoding does not pay, docs/generation.md#measured); ``"on"`` where a reason is given is an error naming
    it. ``one_prefill_per_group`` needs a KV cache ``generate`` can start from: with ``cache`` (the user's
    ``cache_implementation``) other than the default dynamic cache and no compiled decoding it is off, with one line.
    """
    if compile_generation not in COMPILE_GENERATION_CHOICES:
        raise ValueError(f"compile_generation must be one of {COMPILE_GENERATION_CHOICES}, got {compile_generation!r}")
    if backend != "transformers":
        if compile_generation == "on":
            logger.warning("compile_generation='on' is ignored: %s generates, and compiles its own decoding", backend)
        if not one_prefill_per_group:
            logger.warning(
                "one_prefill_per_group=False is ignored: %s generates, and shares a prompt's encoding its own way",
                backend,
            )
        return DecodingChoice(compiled=False, grouped=False)
    device_type = torch.device(device).type
    if compile_generation == "on" and refusal is not None:
        raise ValueError(
            f"{owner}: compile_generation='on' cannot run {refusal}; set compile_generation='auto' (off there) or 'off'"
        )
    compiled = compile_generation == "on" or (
        compile_generation == "auto" and device_type == "cuda" and refusal is None
    )
    grouped = one_prefill_per_group
    if grouped and not compiled and cache not in (None, "dynamic"):
        logger.warning(
            "one_prefill_per_group: off, generation uses cache_implementation=%r (the grouped prefill fills a dynamic "
            "cache, or with compile_generation a static one)",
            cache,
        )
        grouped = False
    return DecodingChoice(compiled=compiled, grouped=grouped)


def plan_decoding(
    compile_generation: str,
    one_prefill_per_group: bool,
    *,
    config: Any,
    device: torch.device | str,
    refusal: str | None,
    longest_prompt: Callable[[], int],
    owner: str,
    compile_config: Any = None,
    on_prefill: Callable[[], None] | None = None,
    compile_budget: Any = None,
) -> GroupedDecoding:
    """The `GroupedDecoding` of a run that generates with transformers' ``generate`` and the generation ``config``
    (TRL's, or the asynchronous worker's): `choose_decoding`, and for compiled decoding that config set for it
    (compilation on, transformers' static cache, ``compile_config`` or the config's own or transformers' default) and
    the static cache's length from ``longest_prompt()`` (tokens) and the config's ``max_new_tokens``;
    ``compile_budget``: the run's `trinity_trl.packing.selection.CompileBudget`, shared with compiled layers."""
    cache = config.cache_implementation
    choice = choose_decoding(
        compile_generation,
        one_prefill_per_group,
        device=device,
        backend="transformers",
        refusal=refusal,
        cache=cache,
        owner=owner,
    )
    length = None
    if choice.compiled:
        length = CacheLength(longest_prompt(), config.max_new_tokens)
        config.compile_config = compile_config_for(device, compile_config or config.compile_config)
        config.disable_compile = False
        config.cache_implementation = "static"
        config.max_cache_len = length.tokens
    return GroupedDecoding(choice, length, on_prefill, compile_budget)


def compile_config_for(device: torch.device | str, given: Any = None) -> Any:
    """The ``CompileConfig`` of compiled decoding: ``given`` (a ``CompileConfig`` or its fields as a dict, e.g. from
    ``generation_kwargs={"compile_config": {...}}``) or transformers' default (inductor, ``reduce-overhead``: CUDA
    graphs on CUDA); on a device other than CUDA with transformers' flag that lets ``generate`` compile there."""
    from transformers import CompileConfig

    config = CompileConfig(**given) if isinstance(given, dict) else copy.copy(given) if given else CompileConfig()
    if torch.device(device).type != "cuda":
        compile_on_every_device(config)
    return config


def length_bucket(tokens: int) -> int:
    """``tokens`` rounded up to a bucket: a multiple of a quarter of the power of two below it (at least 64), so a
    bucket holds at most a quarter more than asked and a run sees few distinct lengths (..., 768, 1024, 1280, ...)."""
    if tokens <= 64:
        return 64
    step = 2 ** (math.floor(math.log2(tokens)) - 2)
    return -(-tokens // step) * step


def batch_bucket(rows: int, largest: int) -> int:
    """The batch a call of ``rows`` rows decodes in: ``largest`` (the largest batch of the run so far) halved while
    it still holds them, so shrinking batches (StepGRPO's later turns) share a few shapes."""
    if rows >= largest:
        return rows
    bucket = largest
    while bucket % 2 == 0 and bucket // 2 >= rows:
        bucket //= 2
    return bucket


class CacheLength:
    """The static cache's length for a run: the longest prompt it expects plus ``max_new_tokens``, rounded up to a
    bucket (`length_bucket`), fixed once; a longer prompt grows it to the next bucket, with one log line (the decoding
    compiles again once for the new length)."""

    def __init__(self, longest_prompt: int, max_new_tokens: int):
        self.max_new_tokens = max_new_tokens
        self.tokens = length_bucket(longest_prompt + max_new_tokens)

    def fit(self, prompt_width: int) -> int:
        """The length that holds a call whose padded prompts are ``prompt_width`` tokens wide."""
        needed = prompt_width + self.max_new_tokens
        if needed > self.tokens:
            grown = length_bucket(needed)
            logger.warning(
                "compiled decoding: a prompt of %d tokens + max_completion_length %d exceeds the static cache of %d "
                "tokens; growing it to %d (decoding compiles once more)",
                prompt_width,
                self.max_new_tokens,
                self.tokens,
                grown,
            )
            self.tokens = grown
        return self.tokens


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, owner)``: the first row of each run of consecutive identical rows (ids and mask) ``(D,)``, and for
    each row the index of its run ``(B,)``. Rows of one group that are not consecutive (or a group split across
    processes) are simply more runs."""
    same = (input_ids[1:] == input_ids[:-1]).all(-1) & (attention_mask[1:] == attention_mask[:-1]).all(-1)
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=input_ids.device), ~same])
    return torch.nonzero(starts).flatten(), torch.cumsum(starts.long(), 0) - 1


def prefill_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows, as ``generate`` makes them: count of real tokens before, 0 on padding."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def shared_prefill(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, first: torch.Tensor, cache: Any):
    """Encode the distinct prompts ``input_ids[first]`` without their last token into ``cache`` (a dynamic cache),
    through ``model``'s forward (its adapters, as ``generate`` would)."""
    ids, mask = input_ids[first, :-1], attention_mask[first, :-1]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # only the cache is wanted: the LM head on one position where the model allows it
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(type(base).forward).parameters else {}
    model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=prefill_positions(mask),
        use_cache=True,
        **keep,
        **{cache_keyword(model): cache},
    )
    return cache


class GroupedDecoding:
    """Our side of transformers' ``generate`` for one run (see the module docs).

    Args:
        choice: the run's `DecodingChoice`.
        cache_length: the static cache's length (compiled decoding only).
        on_prefill: called after each shared prefill (a forward: progress, for a worker's heartbeat).
        compile_budget: the run's compile budget (`trinity_trl.packing.selection.CompileBudget`), which compiled
            layers share: each (mode, batch, length) decoded counts one graph of user ``"generation"``, and a
            compiled call runs with dynamo's recompile limit above the run's total.
    """

    def __init__(
        self,
        choice: DecodingChoice,
        cache_length: CacheLength | None = None,
        on_prefill: Callable[[], None] | None = None,
        compile_budget: Any = None,
    ):
        if choice.compiled and cache_length is None:
            raise ValueError("compiled decoding needs a CacheLength")
        self.choice = choice
        self.cache_length = cache_length
        self.on_prefill = on_prefill
        self.compile_budget = compile_budget
        self.compilations = 0  # graphs torch.compile built while this object decoded
        self.recompilations = 0  # ... for a (mode, batch, length) it had decoded before
        self.recordings = 0  # CUDA graphs recorded while it decoded
        self._static: dict[tuple[int, int], Any] = {}  # (batch, length) -> static cache
        self._seen: set[tuple[bool, int, int]] = set()
        self._largest_batch = 0

    @contextlib.contextmanager
    def around(self, model: Any) -> Iterator[None]:
        """While the block runs (one of TRL's generation calls): ``model.generate`` goes through `generate`, and the
        forward hooks transformers adds to ``model`` when TRL turns activation checkpointing off and on around the
        call are removed again (`trinity_trl.training.trl_seams.input_hooks_kept`)."""
        original = model.generate
        with (
            input_hooks_kept(model),
            intercepted(model, "generate", lambda *a, **k: self.generate(model, original, *a, **k)),
        ):
            yield

    def generate(self, model: Any, original: Callable, *args: Any, **kwargs: Any) -> Any:
        """``original(*args, **kwargs)`` (``model``'s ``generate``), grouped and compiled as the run chose."""
        plain = not args and set(kwargs) - {"generation_config", "stopping_criteria", "logits_processor"} <= set(
            PLAIN_INPUTS
        )
        if not plain or "input_ids" not in kwargs or not (self.choice.compiled or self.choice.grouped):
            return original(*args, **kwargs)
        input_ids = kwargs.pop("input_ids")
        attention_mask = kwargs.pop("attention_mask", None)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        config = copy.deepcopy(kwargs.pop("generation_config", None) or model.generation_config)
        config.cache_implementation = config.max_cache_len = None  # the cache is passed: transformers refuses both
        rows, width = input_ids.shape
        first, owner = prompt_groups(input_ids, attention_mask)
        grouped = self.choice.grouped and width > 1 and len(first) < rows and is_full_attention_cache(model)
        if not self.choice.compiled:
            if not grouped:
                return original(input_ids=input_ids, attention_mask=attention_mask, generation_config=config, **kwargs)
            cache = self._prefill(model, input_ids, attention_mask, first)
            cache.batch_select_indices(owner)
            return original(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                **{cache_keyword(model): cache},
                **kwargs,
            )
        self._largest_batch = max(self._largest_batch, rows)
        batch = batch_bucket(rows, self._largest_batch)
        length = self.cache_length.fit(width)
        if batch > rows:  # filler rows: copies of the last row, dropped from the output
            filler = torch.full((batch - rows,), rows - 1, dtype=torch.long, device=input_ids.device)
            keep = torch.cat([torch.arange(rows, device=input_ids.device), filler])
            input_ids, attention_mask, owner = input_ids[keep], attention_mask[keep], owner[keep]
        cache = self._static_cache(model, batch, length)
        if grouped:
            prefix = self._prefill(model, input_ids, attention_mask, first)
            for index, layer in enumerate(prefix.layers):
                cache.update(layer.keys[owner], layer.values[owner], index)
        key = (bool(model.training), batch, length)
        if self.compile_budget is not None:
            self.compile_budget.add(key, user="generation", graphs=1)
        limit = self.compile_budget.limit() if self.compile_budget is not None else contextlib.nullcontext()
        with limit, CompileEvents() as events:
            out = original(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                **{cache_keyword(model): cache},
                **kwargs,
            )
        self._count(events, key)
        if batch > rows:
            out = out[:rows] if isinstance(out, torch.Tensor) else _first_rows(out, rows)
        return out

    def _prefill(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, first: torch.Tensor) -> Any:
        cache = shared_prefill(model, input_ids, attention_mask, first, _dynamic_cache(model))
        if self.on_prefill is not None:
            self.on_prefill()
        return cache

    def _static_cache(self, model: Any, batch: int, length: int) -> Any:
        """The run's static cache for ``batch`` rows of ``length`` tokens, emptied (one object per shape: the same
        tensors at every call)."""
        from transformers import StaticCache

        cache = self._static.get((batch, length))
        if cache is None:
            self._static = {k: v for k, v in self._static.items() if k[1] == length}  # a grown length replaces all
            cache = StaticCache(config=_text_config(model), max_cache_len=length)
            self._static[(batch, length)] = cache
        else:
            cache.reset()
        return cache

    def _count(self, events: CompileEvents, key: tuple[bool, int, int]) -> None:
        self.recordings += events.recordings
        if not events.compilations:
            self._seen.add(key)
            return
        recompiled = key in self._seen
        self._seen.add(key)
        self.compilations += events.compilations
        if recompiled:
            self.recompilations += events.compilations
            logger.warning(
                "compiled decoding compiled again for a batch shape it had compiled before (%s, %d rows, cache of %d "
                "tokens; %d recompilations so far): after torch._dynamo.config.recompile_limit (%d) recompilations "
                "torch decodes without compilation. TORCH_LOGS=recompiles says why",
                "training" if key[0] else "evaluation",
                key[1],
                key[2],
                self.recompilations,
                _recompile_limit(),
            )


def _text_config(model: Any) -> Any:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config.get_text_config(decoder=True)


def _dynamic_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=_text_config(model))


def _first_rows(out: Any, rows: int) -> Any:
    """A ``generate`` output (``return_dict_in_generate``) cut to its first ``rows`` rows."""
    out.sequences = out.sequences[:rows]
    for name in ("scores", "logits"):
        steps = getattr(out, name, None)
        if steps is not None:
            setattr(out, name, tuple(step[:rows] for step in steps))
    return out


def _recompile_limit() -> int:
    import torch._dynamo

    return int(getattr(torch._dynamo.config, "recompile_limit", getattr(torch._dynamo.config, "cache_size_limit", 8)))
