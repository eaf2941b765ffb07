"""Compiled decoder layers for packed training forwards (``prefix_packing_compile``): fewer kernel launches.

On a GPU at TRL's micro-batch the packed training pass is bound by the host: every operation of every layer is a
kernel launch queued by Python, whatever the number of tokens. Compiling the decoder layers fuses their
elementwise operations and takes the Python of each layer off the host's path. Three pieces make a packed forward
compile once and stay compiled:

* **The tree attention is one custom op** (`tree_attention_op`, ``torch.ops.trinity_trl.tree_attention``,
  registered with ``torch.library``): its plan goes in as tensors (the gathered-key index, the offsets on the
  device and the same offsets on the host, a CPU tensor, so no host synchronisation reads them) and a kernel name, it
  has a fake kernel (output shapes from input shapes) and an autograd formula (a second op,
  ``trinity_trl::tree_attention_backward``). ``torch.compile`` sees one opaque call per layer: no graph break, and no
  recompilation when the tree changes shape (a Python loop over the tree's nodes inside the layer would be unrolled
  into the graph, one graph per distinct node count). Its kernels: ``sdpa_segments`` (every device; per node the
  scaled dot product in plain torch, the backward from the softmax's closed form) and ``flash`` (CUDA: FlashAttention
  through torch's own ``aten::_flash_attention_forward`` / ``_backward`` with bottom-right causal windows; GQA native),
  which the ``varlen`` and ``flash_attn`` kernels run when layers are compiled.
* **A dispatcher set once** (`CompiledLayers.install`): the model's attention implementation becomes
  ``"trinity_tree+<its own>"`` (transformers' public ``AttentionInterface``, ``set_attn_implementation``), a function
  that runs the tree op where the call carries a plan and the model's own implementation (and mask function)
  everywhere else: generation, TRL's padded forwards, the user's calls. Each decoder layer's ``forward`` runs the
  compiled layer where its call carries a plan, else the layer as it was. One forward hook on the backbone keeps only
  the hidden states that predict a scored token. Nothing is installed or removed per forward, so dynamo's guards see
  the same module state every time; activation checkpointing recomputes a layer with its plan (the recomputation is
  in the compiled graph: transformers checkpoints inside the layer's ``forward``).
* **Dynamic shapes**: the layers are compiled with ``dynamic=True`` and the plan's tensors are marked dynamic, so the
  first packed length compiles one graph for every length (per grad mode), counted in the run's `CompileBudget`.

User guide: ``docs/prefix-packing.md#compiled-layers``.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .attention import PLAN_KWARG, TreePlan, keep_hidden_states, layers_of
from .kernels import HALF, TreeKernel, _compute_dtype, _varlen_arrays
from .selection import CompileBudget
from .tree import PackedRows, upload

logger = logging.getLogger("trinity_trl")

#: the ``torch.library`` namespace of our ops
NAMESPACE = "trinity_trl"
#: ``prefix_packing_kernel`` -> the op's kernel when layers are compiled
OP_KERNEL = {"sdpa_segments": "sdpa_segments", "varlen": "flash", "flash_attn": "flash"}
#: the dispatcher's name for a model loaded with attention implementation ``x``: ``"trinity_tree+x"``
DISPATCHER_PREFIX = "trinity_tree+"


# ============================================================================ the custom op
def _nodes(host_cu: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """``(q0, q1, k0, k1)`` per tree node from the host offsets (``cu_q`` then ``cu_k``)."""
    cu = host_cu.tolist()
    half = len(cu) // 2
    return [(cu[i], cu[i + 1], cu[half + i], cu[half + i + 1]) for i in range(half - 1)]


def _maxima(host_cu: torch.Tensor) -> tuple[int, int]:
    cu = host_cu.numpy()
    half = len(cu) // 2
    return int(np.diff(cu[:half]).max(initial=0)), int(np.diff(cu[half:]).max(initial=0))


def _node_mask(length: int, keys: int, device: torch.device) -> torch.Tensor:
    """Bottom-right causal: query ``j`` of a node sees its first ``keys - length + j + 1`` gathered keys."""
    return torch.ones(length, keys, dtype=torch.bool, device=device).tril(keys - length)


def _segments_forward(q, k, v, host_cu, scale):
    """Per node: ``scaled_dot_product_attention`` of its queries against its gathered keys (the eager kernel's
    arithmetic). ``q`` ``(N, H, D)``, ``k``/``v`` ``(K, H_kv, D)``."""
    out = torch.empty_like(q)
    gqa = k.shape[1] != q.shape[1]
    for q0, q1, k0, k1 in _nodes(host_cu):
        if q1 == q0:
            continue
        mask = _node_mask(q1 - q0, k1 - k0, q.device)
        out[q0:q1] = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1),
            k[k0:k1].transpose(0, 1),
            v[k0:k1].transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=gqa,
        ).transpose(0, 1)
    return out


def _segments_backward(grad, q, k, v, out, host_cu, scale):
    """The closed form of attention's gradient per node (scores recomputed; in float32 for half inputs):
    ``P = softmax(S)``, ``dV = Pᵀ dO``, ``dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O))``, ``dQ = dS K s``, ``dK = dSᵀ Q s``,
    summed over the query heads that share a key/value head."""
    compute = torch.float32 if q.dtype in HALF else q.dtype
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dq = torch.zeros_like(q, dtype=compute)
    dk = torch.zeros_like(k, dtype=compute)
    dv = torch.zeros_like(v, dtype=compute)
    for q0, q1, k0, k1 in _nodes(host_cu):
        if q1 == q0:
            continue
        qi = q[q0:q1].transpose(0, 1).to(compute)  # (H, L, D)
        ki = k[k0:k1].transpose(0, 1).to(compute).repeat_interleave(group, 0)  # (H, S, D)
        vi = v[k0:k1].transpose(0, 1).to(compute).repeat_interleave(group, 0)
        scores = torch.matmul(qi, ki.transpose(1, 2)) * scale
        scores = scores.masked_fill(~_node_mask(q1 - q0, k1 - k0, q.device), float("-inf"))
        p = torch.softmax(scores, -1)
        do = grad[q0:q1].transpose(0, 1).to(compute)
        o = out[q0:q1].transpose(0, 1).to(compute)
        dp = torch.matmul(do, vi.transpose(1, 2))
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        dq[q0:q1] = (torch.matmul(ds, ki) * scale).transpose(0, 1)
        dki = torch.matmul(ds.transpose(1, 2), qi) * scale  # (H, S, D)
        dvi = torch.matmul(p.transpose(1, 2), do)
        dk[k0:k1] += dki.unflatten(0, (kv_heads, group)).sum(1).transpose(0, 1)
        dv[k0:k1] += dvi.unflatten(0, (kv_heads, group)).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


#: FlashAttention's causal window: bottom-right aligned, no limit to the left
_FLASH_WINDOW = {"window_size_left": -1, "window_size_right": 0}


@torch.library.custom_op(f"{NAMESPACE}::tree_attention", mutates_args=())
def tree_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    host_cu: torch.Tensor,
    scale: float,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree attention over the gathered-key layout: ``query`` ``(N, H, D)`` (the packed row's queries), ``key`` /
    ``value`` ``(K, H_kv, D)`` (each node's root-to-node path, its own tokens last), ``cu`` the int32 offsets
    ``cu_q`` then ``cu_k`` on the device, ``host_cu`` the same (int64) on the host. Returns ``(out (N, H, D), lse)``:
    ``lse`` ``(H, N)`` float32 for the ``flash`` kernel's backward (empty for ``sdpa_segments``, whose backward
    recomputes the scores)."""
    if kernel == "sdpa_segments":
        return _segments_forward(query, key, value, host_cu, scale), query.new_empty(0)
    if kernel == "flash":
        half = host_cu.numel() // 2
        max_q, max_k = _maxima(host_cu)
        out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
            query, key, value, cu[:half], cu[half:], max_q, max_k, 0.0, True, False, scale=scale, **_FLASH_WINDOW
        )
        return out, lse
    raise ValueError(f"unknown tree-attention op kernel {kernel!r} (sdpa_segments, flash)")


@tree_attention_op.register_fake
def _tree_attention_fake(query, key, value, cu, host_cu, scale, kernel):
    if kernel == "flash":
        return torch.empty_like(query), query.new_empty((query.shape[1], query.shape[0]), dtype=torch.float32)
    return torch.empty_like(query), query.new_empty(0)


@torch.library.custom_op(f"{NAMESPACE}::tree_attention_backward", mutates_args=())
def tree_attention_backward_op(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu: torch.Tensor,
    host_cu: torch.Tensor,
    scale: float,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `tree_attention_op`'s output with respect to ``query``, ``key`` and ``value``."""
    if kernel == "sdpa_segments":
        return _segments_backward(grad, query, key, value, out, host_cu, scale)
    if kernel == "flash":
        half = host_cu.numel() // 2
        max_q, max_k = _maxima(host_cu)
        rng_state = torch.zeros((2,), dtype=torch.uint64, device=query.device)  # no dropout: unused
        unused = torch.empty(0, device=query.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad, query, key, value, out, lse, cu[:half], cu[half:], max_q, max_k, 0.0, True, rng_state, unused,
            scale=scale, **_FLASH_WINDOW,
        )  # fmt: skip
        return dq, dk, dv
    raise ValueError(f"unknown tree-attention op kernel {kernel!r} (sdpa_segments, flash)")


@tree_attention_backward_op.register_fake
def _tree_attention_backward_fake(grad, query, key, value, out, lse, cu, host_cu, scale, kernel):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    query, key, value, cu, host_cu, scale, kernel = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, cu, host_cu)
    ctx.scale, ctx.kernel = scale, kernel


def _backward(ctx, grad, grad_lse):
    query, key, value, out, lse, cu, host_cu = ctx.saved_tensors
    dq, dk, dv = tree_attention_backward_op(
        grad.contiguous(), query, key, value, out, lse, cu, host_cu, ctx.scale, ctx.kernel
    )
    return dq, dk, dv, None, None, None, None


tree_attention_op.register_autograd(_backward, setup_context=_setup_context)


# ============================================================================ the kernel the layers call
@dataclass(eq=False)
class OpPlan:
    """A packed row's plan for `tree_attention_op`, built once per forward: ``key_index`` ``(K,)`` (the gathered
    keys), ``cu`` (int32, on the device) and ``host_cu`` (int64, on the host): ``cu_q`` then ``cu_k``. Every
    tensor is marked dynamic along its length, so a compiled layer takes any tree without recompiling."""

    key_index: torch.Tensor
    cu: torch.Tensor
    host_cu: torch.Tensor


class OpKernel(TreeKernel):
    """A tree kernel (`kernels.TreeKernel`) that runs `tree_attention_op`: what compiled layers call."""

    array_names = ("key_index", "cu")

    def __init__(self, op_kernel: str):
        self.op_kernel = op_kernel
        self.name = f"{op_kernel}_op"

    def unavailable(self, device: torch.device) -> str | None:
        if self.op_kernel == "flash" and device.type != "cuda":
            return f"FlashAttention runs on CUDA only (device {device.type})"
        return None

    def arrays(self, segments, num_tokens):
        return _varlen_arrays(segments)

    def plan(self, packed: PackedRows, device: torch.device) -> OpPlan:
        names = self.array_names
        if all(n in packed.kernel_tensors for n in names):
            host, tensors = packed.kernel_arrays, packed.kernel_tensors
        else:
            host = self.arrays(packed.segments, packed.num_tokens)
            tensors = upload(host, device)
        plan = OpPlan(tensors["key_index"], tensors["cu"].to(torch.int32), torch.from_numpy(host["cu"]))
        for tensor in (plan.key_index, plan.cu, plan.host_cu):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return plan

    def attend(self, plan: OpPlan, query, key, value, scale):
        dtype = _compute_dtype(query)
        query, key, value = (t if t.dtype == dtype else t.to(dtype) for t in (query, key, value))
        q = query[0].transpose(0, 1).contiguous()  # (N, H, D)
        k = key[0].transpose(0, 1).index_select(0, plan.key_index)  # (K, H_kv, D)
        v = value[0].transpose(0, 1).index_select(0, plan.key_index)
        scale = float(query.shape[-1] ** -0.5) if scale is None else float(scale)
        out = tree_attention_op(q, k, v, plan.cu, plan.host_cu, scale, self.op_kernel)[0]
        return out.unsqueeze(0)

    def __call__(self, plan, query, key, value, scale):
        return self.attend(plan, query, key, value, scale).transpose(1, 2)


#: the op kernels by name of the kernel they stand for (`OP_KERNEL`)
OP_KERNELS: dict[str, OpKernel] = {name: OpKernel(op) for name, op in OP_KERNEL.items()}


# ============================================================================ the option
def check_compile_request(compile_layers: bool, prefix_packing: bool, kernel: str, args: Any = None) -> None:
    """Raise ``ValueError`` where ``prefix_packing_compile`` cannot be honoured by the config alone."""
    if not compile_layers:
        return
    if not prefix_packing:
        raise ValueError("prefix_packing_compile=True has no effect with prefix_packing=False")
    if kernel == "flex":
        raise ValueError(
            "prefix_packing_compile=True compiles the layers around the sdpa_segments, varlen or flash_attn kernel; "
            "flex is compiled on its own: use prefix_packing_kernel='auto' (or one of those) with it"
        )
    if getattr(args, "torch_compile", False):
        raise ValueError(
            "prefix_packing_compile=True compiles the decoder layers of packed forwards; torch_compile=True compiles "
            "the whole model: set one of them"
        )


def compile_backend(compile_layers: bool, engine: str) -> str | None:
    """The ``torch.compile`` backend of ``prefix_packing_compile`` in a run on ``engine`` (`engines.engine_of`):
    ``"inductor"``, or ``None`` where off; raises ``ValueError`` under DeepSpeed and FSDP."""
    if not compile_layers:
        return None
    if engine in ("deepspeed", "fsdp"):
        name = "FSDP" if engine == "fsdp" else "DeepSpeed"
        raise ValueError(
            f"prefix_packing_compile=True runs in one process or under DDP, not under {name} (its engine gathers and "
            "reduces around the layers, which the compiled layers are not tested with)"
        )
    return "inductor"


# ============================================================================ the dispatcher
def dispatcher_name(original: str) -> str:
    return DISPATCHER_PREFIX + original


def register_dispatcher(original: str) -> str:
    """Register ``"trinity_tree+<original>"`` in transformers' attention and mask registries (idempotent): the tree op
    for calls with a plan, ``original``'s function and mask for every other call. Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = dispatcher_name(original)
    if name in ALL_ATTENTION_FUNCTIONS.valid_keys():
        return name
    own = ALL_ATTENTION_FUNCTIONS[original]

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        plan = kwargs.pop(PLAN_KWARG, None)
        if plan is None:
            return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if dropout:
            raise ValueError("prefix packing does not support attention dropout (set prefix_packing=False)")
        return plan.kernel.attend(plan.plan, query, key, value, scaling), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    return name


class CompiledLayers:
    """The compiled decoder layers of the models a run trains packed (see the module docs).

    Args:
        backend: ``torch.compile``'s backend (``"inductor"`` on a GPU; ``"aot_eager"`` in the CPU tests) or a callable.
        budget: the run's `CompileBudget` (one per run: flex, these layers and compiled generation); the layers add
            one signature per grad mode and dtype.
        warm_passes: packed passes per grad mode after which a compiled layer is taken as compiled (`warm`): the
            first compiles it, the second would recompile where a dimension was specialised.
    """

    def __init__(self, backend: Any = "inductor", budget: CompileBudget | None = None, warm_passes: int = 2):
        self.backend = backend
        self.budget = budget if budget is not None else CompileBudget()
        self.warm_passes = warm_passes
        self.graphs = 0  # graphs compiled so far (every model, both grad modes)
        self._installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> reason or None
        self._compiled: dict[type, Any] = {}  # layer class -> its compiled forward (shared by every layer)
        self._passes: dict[bool, int] = {}  # grad mode -> packed passes run compiled
        self._warned = False

    def _counting_backend(self):
        from torch._dynamo import lookup_backend

        inner = self.backend if callable(self.backend) else lookup_backend(self.backend)

        def backend(gm, example_inputs):
            self.graphs += 1
            if self.graphs > self.budget.graphs and not self._warned:
                self._warned = True
                logger.warning(
                    "prefix_packing_compile: %d graphs compiled for the decoder layers, more than the %d budgeted "
                    "(a recompilation the packed forward should not cause; see docs/prefix-packing.md#compiled-layers)",
                    self.graphs,
                    self.budget.graphs,
                )
            return inner(gm, example_inputs)

        return backend

    def install(self, model: torch.nn.Module) -> str | None:
        """Set the dispatcher, the layers' compiled forwards and the backbone's hook on ``model`` (the transformers
        model), once; returns why it cannot be compiled (``None``: installed)."""
        if model in self._installed:
            return self._installed[model]
        reason = self._install(model)
        self._installed[model] = reason
        return reason

    def _install(self, model: torch.nn.Module) -> str | None:
        original = model.config._attn_implementation
        if original.startswith(DISPATCHER_PREFIX):
            original = original.removeprefix(DISPATCHER_PREFIX)
        model.set_attn_implementation(register_dispatcher(original))
        backbone = model.base_model
        layers = layers_of(backbone)
        if not layers:
            return "the model has no decoder layers transformers can checkpoint (GradientCheckpointingLayer)"
        backend = self._counting_backend()
        for layer in layers:
            cls = type(layer)
            if cls not in self._compiled:
                # the layer's Python floats (the attention scale, the norms' epsilon) are constants: specialised, not
                # traced as symbols (which would make dynamo restart its analysis and compile the layer twice)
                compiled = torch.compile(cls.forward, backend=backend, dynamic=True)
                self._compiled[cls] = torch._dynamo.config.patch(specialize_float=True)(compiled)
            layer.forward = _LayerForward(layer, self._compiled[cls], self)
        backbone.register_forward_hook(_keep_hook, with_kwargs=True)
        return None

    def signature(self, grad: bool, dtype: torch.dtype) -> None:
        """Count the graphs of a packed forward in ``grad`` mode computing in ``dtype``: one (dynamic shapes), and
        one spare (a recompilation where a dimension was specialised)."""
        self.budget.add((grad, dtype), user="layers")

    def ran(self, grad: bool) -> None:
        self._passes[grad] = self._passes.get(grad, 0) + 1

    def warm(self, grad: bool) -> bool:
        """Whether packed passes in ``grad`` mode have run compiled often enough to be timed without compilation."""
        return self._passes.get(grad, 0) >= self.warm_passes


class _LayerForward:
    """A decoder layer's ``forward`` once layers are compiled: the compiled layer for calls that carry a plan, the
    layer's own forward for every other call."""

    def __init__(self, layer: torch.nn.Module, compiled: Any, owner: CompiledLayers):
        self.layer = weakref.ref(layer)
        self.own = type(layer).forward
        self.compiled = compiled
        self.owner = owner

    def __call__(self, *args, **kwargs):
        layer = self.layer()
        if kwargs.get(PLAN_KWARG) is not None:
            with self.owner.budget.limit():
                return self.compiled(layer, *args, **kwargs)
        return self.own(layer, *args, **kwargs)


def _keep_hook(module, args, kwargs, output):
    plan = kwargs.get(PLAN_KWARG)
    return keep_hidden_states(plan, output) if plan is not None else output


def compiled_inputs(packed: PackedRows, plan: TreePlan) -> dict[str, Any]:
    """The model's inputs for a packed row under compiled layers: no routing hooks (the dispatcher is set once) and,
    as the attention mask, an expanded 4-D tensor of ones (no memory): transformers passes a 4-D mask through without
    building one (nor searching the positions for packed sequences, a host synchronisation), and the tree op ignores
    it."""
    n = packed.input_ids.numel()
    mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=packed.input_ids.device).expand(1, 1, n, n)
    return {
        "input_ids": packed.input_ids[None],
        "position_ids": packed.position_ids[None],
        "attention_mask": mask,
        "use_cache": False,
        PLAN_KWARG: plan,
    }
