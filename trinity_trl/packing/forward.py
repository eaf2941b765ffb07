"""The packed forward of a trainer: log-probs (and entropies) through TRL's fused LM head, critic values.

Log-probs keep TRL's fused LM head (``add_fused_lm_head``): the model is called with
``fused_lm_head=True`` and pre-shifted labels, and while it runs a forward hook on the backbone keeps
only the hidden states of the tokens that predict a completion token (a shared prompt's last token
once per row below it), so the chunked head scores only those and full-vocabulary logits are never
materialised. The critic (PPO) is called on the same packed row and read at the same positions.

The packed row reaches the attention layers through transformers' attention registry (`attention`):
its `attention.TreePlan` rides in the forward's keyword arguments.

Only verified causal decoders are packed (`VERIFIED_MODEL_TYPES`, full attention, attention
``sdpa`` or FlashAttention 2/3); anything else (other architectures, sliding-window layers, eager
attention, attention dropout, multimodal inputs, MoE auxiliary losses, masks that are not one
contiguous run per row) falls back to TRL's padded forward with one log line naming the reason
(`PrefixPacking`), and so does a forward that `selection` sends to the padded layout.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import attention
from .attention import PLAN_KWARG, TreePlan
from .compiled import OP_KERNELS, CompiledLayers, OpKernel, check_compile_request, compiled_inputs
from .kernels import TreeKernel
from .selection import (
    Calibration,
    Choice,
    CompileBudget,
    Gather,
    Stopwatch,
    Timer,
    check_kernel_request,
    choose,
    compute_dtype,
    shape_class,
    time_model,
)
from .tree import NotPackable, PackedRows, pack_rows

logger = logging.getLogger("trinity_trl")

#: ``config.model_type`` of the causal decoders whose packed forward is tested equal to the padded one
VERIFIED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")


def causal_lm(model: torch.nn.Module, unwrap: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.nn.Module:
    """The transformers model inside ``model`` (DDP, PEFT), the one TRL patched with its fused head."""
    inner = unwrap(model)
    get_base = getattr(inner, "get_base_model", None)  # PEFT
    return get_base() if callable(get_base) else inner


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` (a transformers model, unwrapped) cannot run the packed forward, or ``None``."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in VERIFIED_MODEL_TYPES:
        return (
            f"model type {model_type!r} is not verified for prefix packing (verified: "
            f"{', '.join(VERIFIED_MODEL_TYPES)})"
        )
    implementation = config._attn_implementation
    if implementation not in attention.PACKABLE_IMPLEMENTATIONS:
        return (
            f"the model's attention is {implementation!r}; the packed forward runs where it is one of "
            f"{', '.join(repr(i) for i in attention.PACKABLE_IMPLEMENTATIONS)} (load the model with "
            "attn_implementation='sdpa')"
        )
    if len(attention.attention_modules(model.base_model)) != config.num_hidden_layers:
        return "the model's decoder layers have no `self_attn` attention module"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or getattr(config, "sliding_window", None) is not None:
        return "the model has sliding-window attention layers"
    if getattr(config, "output_router_logits", False):
        return "the model returns router logits (MoE auxiliary loss)"
    if getattr(config, "attention_dropout", 0.0):
        return f"the model has attention dropout ({config.attention_dropout})"
    return None


def tree_inputs(
    packed: PackedRows, kernel: TreeKernel, backbone: torch.nn.Module, keep: torch.Tensor | None = None
) -> dict[str, Any]:
    """The model's inputs for ``packed``: the packed row, its positions, a mask of ones (a packed row has no padding;
    the registered mask function makes no mask of it, and with a mask transformers does not search the positions for
    packed sequences, a host synchronisation) and the `attention.TreePlan` of ``kernel``, built once for the whole
    forward, under which ``backbone``'s calls run the tree attention (`attention.route`); ``keep``: the positions of
    the backbone's output to keep (``None``: all)."""
    device = packed.input_ids.device
    if isinstance(kernel, OpKernel):  # compiled layers: the dispatcher set once routes the plan (no hooks)
        return compiled_inputs(packed, TreePlan(kernel, kernel.plan(packed, device), keep))
    plan = attention.route(backbone, TreePlan(kernel, kernel.plan(packed, device), keep))
    return {
        "input_ids": packed.input_ids[None],
        "position_ids": packed.position_ids[None],
        "attention_mask": torch.ones((1, packed.input_ids.numel()), dtype=torch.bool, device=device),
        PLAN_KWARG: plan,
    }


def packed_logps(
    model: torch.nn.Module,
    backbone: torch.nn.Module,
    packed: PackedRows,
    kernel: TreeKernel,
    compute_entropy: bool,
    autocast: Callable[[], Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(K,)`` log-probs (and entropies) of ``packed``'s scored tokens through TRL's fused LM head.

    ``model`` is called as TRL's helper calls it (``fused_lm_head=True``), with the packed row, its
    positions and its plan (`tree_inputs`), whose ``keep`` makes the backbone (the module whose
    ``last_hidden_state`` the fused head reads) return the hidden states at ``scored_index`` only; the
    pre-shifted ``shift_labels`` name each one's next token.
    """
    index, labels = packed.scored_index, packed.scored_labels
    if index.numel() == 0:  # nothing scored: one ignored position keeps the output connected to the graph
        index, labels = index.new_zeros(1), labels.new_full((1,), -100)
    with autocast():
        out = model(**tree_inputs(packed, kernel, backbone, keep=index), shift_labels=labels[None], fused_lm_head=True)
    count = packed.scored_index.numel()
    entropy = out.entropy[0, :count] if compute_entropy else None
    return out.log_probs[0, :count], entropy


def packed_critic_values(
    critic: torch.nn.Module,
    backbone: torch.nn.Module,
    packed: PackedRows,
    kernel: TreeKernel,
    autocast: Callable[[], Any],
) -> torch.Tensor:
    """``(K,)`` values of a token-classification critic at ``packed``'s scored positions (the state
    each completion token was chosen in); ``backbone`` is the critic's transformers backbone."""
    with autocast():
        logits = critic(**tree_inputs(packed, kernel, backbone)).logits
    if logits.dim() != 3 or logits.shape[-1] != 1:
        raise ValueError(f"the critic must return logits of shape (B, L, 1), got {tuple(logits.shape)}")
    return logits[0, packed.scored_index, 0]


@dataclass
class PackedOutput:
    """``(B, logits_to_keep)`` results of a packed forward (0 where not scored, as TRL's helper) and
    its token counts: ``forwarded`` tokens (padding to the kernel's block included) against the
    padded layout's ``padded``; ``kernel`` the kernel that ran."""

    logps: torch.Tensor
    entropies: torch.Tensor | None
    forwarded: int
    padded: int
    kernel: str = ""


@dataclass
class _Plan:
    """What `PrefixPacking._pack` decided for one forward."""

    chunks: list[PackedRows]
    kernel: TreeKernel
    inner: torch.nn.Module


def _sharded(model: torch.nn.Module, inner: torch.nn.Module) -> str | None:
    """The sharding engine over ``model`` (FSDP2, DeepSpeed), where the calibration's extra runs on the
    unwrapped model would bypass its gathers and hooks; ``None`` for plain and DDP models."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        FSDPModule = ()  # noqa: N806
    if FSDPModule and any(isinstance(m, FSDPModule) for m in inner.modules()):
        return "FSDP"
    if type(model).__name__ == "DeepSpeedEngine" or any(hasattr(p, "ds_id") for p in inner.parameters()):
        return "DeepSpeed"
    return None


def _real_pass_timeable(model: torch.nn.Module, grad: bool) -> bool:
    """Whether the real forward(+backward) of ``model`` runs without a gradient all-reduce in it: always
    without a backward, else unless ``model`` is DDP on its synchronising micro-batch."""
    if not grad:
        return True
    from torch.nn.parallel import DistributedDataParallel

    return not (isinstance(model, DistributedDataParallel) and model.require_backward_grad_sync)


class PrefixPacking:
    """Decides, per forward, between the packed layout (and its kernel) and TRL's padded one, and runs
    the packed one.

    Args:
        enabled: ``prefix_packing`` of the config.
        max_token_ratio: pack only when the packed rows hold at most this fraction of the padded
            layout's tokens (``prefix_packing_max_token_ratio``).
        unwrap: the accelerator's ``unwrap_model``.
        autocast: the accelerator's ``autocast`` (what TRL's helper runs the model under).
        kernel: ``prefix_packing_kernel`` (`selection`).
        device: the training device; a forced kernel that can never run there raises ``ValueError``
            here (``None``: checked at each forward instead, where it falls back with one log line).
        gather: with several processes, ``all_gather_object`` over them: ``auto``'s verdicts are taken
            from every rank's timings at `synchronize` (`selection.Calibration`).
        timer: the stopwatch factory of the calibration (tests inject one).
        compile: ``prefix_packing_compile``: ``None`` (off), or the ``torch.compile`` backend (a name or a callable) of
            the decoder layers of packed forwards (`compiled.CompiledLayers`; the trainers pass ``"inductor"``).
        compile_budget: the run's `selection.CompileBudget` (one per run, shared with compiled generation); a new
            one where not given.
    """

    def __init__(
        self,
        enabled: bool,
        max_token_ratio: float,
        unwrap: Callable,
        autocast: Callable,
        kernel: str = "auto",
        device: torch.device | str | None = None,
        gather: Gather | None = None,
        timer: Timer = Stopwatch,
        compile: Any = None,
        compile_budget: CompileBudget | None = None,
    ):
        check_compile_request(compile is not None, True, kernel)
        if enabled and device is not None:
            check_kernel_request(kernel, device)
        elif kernel not in ("auto", "varlen", "flash_attn", "flex", "sdpa_segments"):
            check_kernel_request(kernel, "cpu")  # the unknown-name error
        self.enabled = enabled
        self.max_token_ratio = max_token_ratio
        self.kernel = kernel
        self._unwrap = unwrap
        self._autocast = autocast
        # per model as passed (DDP / PEFT wrapper): (the transformers model inside, why it runs padded);
        # unwrapping costs milliseconds per call in accelerate
        self._models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # per transformers model, per (device, autocast on): its compute dtype (FSDP2's policy: a walk over modules)
        self._dtypes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._choices: dict[tuple, Choice] = {}
        self._logged: set[str] = set()
        self.calibration = Calibration(timer, gather)
        self.compile_budget = compile_budget if compile_budget is not None else CompileBudget()
        self.compiled = CompiledLayers(compile, self.compile_budget) if enabled and compile is not None else None

    def _inspect(self, model: torch.nn.Module) -> tuple[torch.nn.Module, str | None]:
        if model not in self._models:
            inner = causal_lm(model, self._unwrap)
            self._models[model] = (inner, unsupported_reason(inner))
        return self._models[model]

    def model_reason(self, model: torch.nn.Module) -> str | None:
        """Why ``model`` runs padded (``None``: it can be packed); checked once per model."""
        return self._inspect(model)[1]

    def choice(self, model: torch.nn.Module, device: torch.device) -> Choice:
        """The kernel choice for forwards of ``model`` on ``device`` (`selection.choose`)."""
        inner = self._inspect(model)[0]
        dtype = self._compute_dtype(inner, device)
        key = (device, dtype)
        if key not in self._choices:
            self._choices[key] = choose(self.kernel, device, dtype)
        return self._choices[key]

    def _compute_dtype(self, inner: torch.nn.Module, device: torch.device) -> torch.dtype:
        """`selection.compute_dtype`, found once per model, device and autocast state."""
        with self._autocast():
            autocast = torch.is_autocast_enabled(device.type)
        known = self._dtypes.setdefault(inner, {})
        if (device, autocast) not in known:
            known[(device, autocast)] = compute_dtype(inner, device, self._autocast)
        return known[(device, autocast)]

    def _fall_back(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning("prefix packing off for this forward, padded rows instead: %s", reason)

    def synchronize(self) -> None:
        """Every process at the same points (each optimizer step): ``auto``'s verdicts from every rank's
        timings (`selection.Calibration.synchronize`); nothing where no forward calibrates (a forced kernel,
        ``auto`` on CPU: the same on every rank)."""
        if any(choice.calibrate for choice in self._choices.values()):
            self.calibration.synchronize()

    def _pack(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size, extra_reason=None, critic=False
    ) -> _Plan | None:
        if not self.enabled:
            return None
        reason = extra_reason or self.model_reason(model)
        choice = None
        if reason is None:
            choice = self.choice(model, input_ids.device)
            reason = choice.reason
        if reason is not None:
            self._fall_back(reason)
            return None
        inner = self._inspect(model)[0]
        rows, width = input_ids.shape
        grad = torch.is_grad_enabled()
        chunked = batch_size is not None and batch_size < rows
        kernel = self._compiled_kernel(inner, choice.kernel, input_ids.device)
        if kernel is not choice.kernel and not self.compiled.warm(grad):
            # compiling: the first packed passes of each grad mode run packed, untimed (auto times compiled passes)
            chunks = self._chunks(kernel, input_ids, attention_mask, logits_to_keep, batch_size if chunked else None)
            return _Plan(chunks, kernel, inner) if chunks is not None and self._passes(chunks, input_ids) else None
        if choice.calibrate:
            if chunked:  # TRL forwards these in chunks of batch_size rows: follow the verdict for such chunks
                if not self.calibration.verdict(shape_class(inner, grad, batch_size, width)):
                    return None
            else:
                key = shape_class(inner, grad, rows, width)
                if self.calibration.calibrating(key):
                    return self._calibrate(
                        model, inner, key, grad, kernel, input_ids, attention_mask, logits_to_keep, critic
                    )
                if not self.calibration.verdict(key):
                    return None  # decided padded (or waiting for the ranks' verdict): the tree is not built
        chunks = self._chunks(kernel, input_ids, attention_mask, logits_to_keep, batch_size if chunked else None)
        if chunks is None or not self._passes(chunks, input_ids):
            return None  # too little shared or padded to be worth it: the padded forward is as fast
        return _Plan(chunks, kernel, inner)

    def _compiled_kernel(self, inner: torch.nn.Module, kernel: TreeKernel, device: torch.device) -> TreeKernel:
        """``kernel``, or under ``prefix_packing_compile`` the tree op that stands for it in compiled layers (the
        layers compiled and the dispatcher set on ``inner`` at its first packed forward)."""
        if self.compiled is None or kernel.name not in OP_KERNELS:
            return kernel
        reason = self.compiled.install(inner)
        if reason is not None:
            self._fall_back(f"prefix_packing_compile: the layers are not compiled ({reason}); eager packed forwards")
            return kernel
        self.compiled.signature(torch.is_grad_enabled(), self._compute_dtype(inner, device))
        return OP_KERNELS[kernel.name]

    def _chunks(self, kernel, input_ids, attention_mask, logits_to_keep, batch_size) -> list[PackedRows] | None:
        try:
            budget = batch_size * input_ids.shape[1] if batch_size is not None else None
            chunks = pack_rows(
                input_ids,
                attention_mask,
                logits_to_keep,
                budget,
                kernel.pad_multiple,
                kernel.min_tokens,
                arrays=kernel.arrays,
            )
        except NotPackable as err:
            self._fall_back(str(err))
            return None
        chunks = [c for c in chunks if c.num_tokens]  # rows without any token have nothing to score
        return chunks or None

    def _passes(self, chunks: list[PackedRows], input_ids: torch.Tensor) -> bool:
        """The ``prefix_packing_max_token_ratio`` check."""
        return sum(c.num_tokens for c in chunks) <= self.max_token_ratio * input_ids.numel()

    def _calibrate(self, model, inner, key, grad, kernel, input_ids, attention_mask, logits_to_keep, critic):
        """A micro-batch of a shape class ``auto`` is measuring (`selection.Calibration`): its real pass in the
        layout the measurement asks for, timed (and, where the real pass cannot be timed, that layout timed as an
        extra run before it, its gradients discarded)."""
        engine = _sharded(model, inner)
        if engine is not None:
            self._fall_back(
                f"'auto' times packed against padded on the unwrapped model, which {engine} does not allow; padded "
                "rows (force a kernel with prefix_packing_kernel to pack)"
            )
            self.calibration.classes[key].verdict = False
            return None
        device = input_ids.device
        packed_watch = self.calibration.timer(device, "packed")
        packed_watch.start()  # building the tree counts to the packed layout
        chunks = self._chunks(kernel, input_ids, attention_mask, logits_to_keep, None)
        packed_watch.stop()
        if chunks is None:
            self.calibration.unpackable(key)
            return None
        passes = self._passes(chunks, input_ids)
        trial = self.calibration.next_trial(key, _real_pass_timeable(model, grad), passes)
        if trial is None:
            return _Plan(chunks, kernel, inner) if passes and self.calibration.verdict(key) else None
        if trial.extras and grad and any(p.grad is not None for p in inner.parameters() if p.requires_grad):
            trial = None  # a later micro-batch of an accumulation: an extra run would hold a 2nd set of gradients
        watches = {"packed": packed_watch}
        for layout in trial.extras if trial else ():
            watch = watches.setdefault(layout, self.calibration.timer(device, layout))
            try:
                self._extra_run(
                    inner, layout, chunks, kernel, input_ids, attention_mask, logits_to_keep, grad, critic, watch
                )
            except RuntimeError as err:  # e.g. out of memory, reentrant activation checkpointing (no autograd.grad)
                self._fall_back(f"'auto' could not time the {layout} layout ({str(err).splitlines()[0]}); padded rows")
                self.calibration.classes[key].verdict = False
                return None
            self.calibration.record(key, layout, watch, extra=True)
            watches.pop(layout)  # the real pass gets a stopwatch of its own
        if trial is None:
            return None
        if trial.time_real:
            watch = watches.setdefault(trial.real, self.calibration.timer(device, trial.real))
            time_model(inner, watch, grad)  # stops at the end of the backward (or forward); the hooks go away
            self.calibration.record(key, trial.real, watch)
        return _Plan(chunks, kernel, inner) if trial.real == "packed" else None

    def _extra_run(self, inner, layout, chunks, kernel, input_ids, attention_mask, logits_to_keep, grad, critic, watch):
        """One timed run of ``layout`` on this micro-batch beside the real pass: the unwrapped model (no DDP
        hooks), its gradients returned by ``torch.autograd.grad`` and dropped (nothing accumulates)."""
        timing = time_model(inner, watch, grad)
        try:
            with torch.enable_grad() if grad else torch.no_grad():
                if layout == "packed":
                    if critic:
                        outputs = [
                            packed_critic_values(inner, inner.base_model, c, kernel, self._autocast) for c in chunks
                        ]
                    else:
                        outputs = [
                            packed_logps(inner, inner.base_model, c, kernel, False, self._autocast)[0] for c in chunks
                        ]
                else:
                    with self._autocast():
                        if critic:
                            outputs = [inner(input_ids=input_ids, attention_mask=attention_mask).logits]
                        else:
                            labels = input_ids.masked_fill(attention_mask == 0, -100)
                            labels[:, :-logits_to_keep] = -100
                            out = inner(
                                input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True
                            )
                            outputs = [out.log_probs]
                if grad:
                    loss = sum(o.float().sum() for o in outputs)
                    params = [p for p in inner.parameters() if p.requires_grad]
                    torch.autograd.grad(loss, params + timing.anchors, allow_unused=True)
        finally:
            timing.remove()

    def _ran(self, kernel: TreeKernel) -> None:
        """A packed forward ran: under compiled layers, counted towards their warm-up (`_pack`)."""
        if isinstance(kernel, OpKernel):
            self.compiled.ran(torch.is_grad_enabled())

    def _compiling(self, kernel: TreeKernel, model: torch.nn.Module, device: torch.device):
        """Around a packed forward: a forced ``flex`` counts its graphs and keeps the recompile limit above them."""
        if kernel.name != "flex":
            return contextlib.nullcontext()
        inner = self._inspect(model)[0]
        config = inner.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        dtype = self._compute_dtype(inner, device)
        self.compile_budget.add((torch.is_grad_enabled(), dtype, head_dim, heads, kv_heads))
        return self.compile_budget.limit()

    def logps_and_entropies(
        self,
        model,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None,
        compute_entropy: bool,
        compute_aux_loss: bool,
        multimodal: dict[str, Any],
    ) -> PackedOutput | None:
        """The arguments of TRL's ``_get_per_token_logps_and_entropies``; ``None`` where the padded
        forward must run instead (the reason logged once)."""
        extra = None
        present = sorted(k for k, v in multimodal.items() if v is not None)
        if present:
            extra = f"multimodal inputs ({', '.join(present)})"
        elif compute_aux_loss:
            extra = "the MoE auxiliary loss counts every padded row's tokens"
        plan = self._pack(model, input_ids, attention_mask, logits_to_keep, batch_size, extra)
        if plan is None:
            return None
        backbone = plan.inner.base_model
        logps, entropies = [], []
        for packed in plan.chunks:
            with self._compiling(plan.kernel, model, input_ids.device):
                lp, ent = packed_logps(model, backbone, packed, plan.kernel, compute_entropy, self._autocast)
            logps.append(lp)
            entropies.append(ent)
        self._ran(plan.kernel)
        shape = (input_ids.shape[0], logits_to_keep)
        return PackedOutput(
            _scatter(plan.chunks, logps, shape),
            _scatter(plan.chunks, entropies, shape) if compute_entropy else None,
            sum(c.num_tokens for c in plan.chunks),
            input_ids.numel(),
            plan.kernel.name,
        )

    def critic_values(
        self, critic, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, batch_size: int | None
    ) -> torch.Tensor | None:
        """``(B, logits_to_keep)`` critic values of the completion tokens (0 elsewhere), or ``None``
        where the padded forward must run instead."""
        plan = self._pack(critic, input_ids, attention_mask, logits_to_keep, batch_size, critic=True)
        if plan is None:
            return None
        with self._compiling(plan.kernel, critic, input_ids.device):
            backbone = plan.inner.base_model
            values = [packed_critic_values(critic, backbone, p, plan.kernel, self._autocast) for p in plan.chunks]
        self._ran(plan.kernel)
        return _scatter(plan.chunks, values, (input_ids.shape[0], logits_to_keep))


def _scatter(chunks: list[PackedRows], values: list[torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """``shape`` (``(B, logits_to_keep)``): each chunk's per-scored-token ``values`` at its rows and columns, 0
    elsewhere (one ``index_put`` over the flattened output)."""
    flat = chunks[0].scored_flat if len(chunks) == 1 else torch.cat([c.scored_flat for c in chunks])
    joined = values[0] if len(values) == 1 else torch.cat(values)
    return joined.new_zeros(shape[0] * shape[1]).index_put((flat,), joined).view(shape)
