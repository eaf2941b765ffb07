"""The host work of a packed forward, counted where a CPU can see it (issue 42: at TRL's micro-batch the packed step on
a GPU is bound by the host, so what the host does per packed forward must not grow back).

The packed forward runs the ``varlen`` kernel's call sites (the CUDA path: gathered keys, the GQA expansion of torch
2.11, which has no ``enable_gqa``, the plan's offsets) with the exact CPU reference of torch 2.11's ``varlen_attn``
standing in for the CUDA kernel, on the tiny Qwen2 (2 layers, 4 query / 2 key-value heads) with activation
checkpointing on (non-reentrant, TRL's default on a GPU). Per packed forward (and its backward) it counts, outside the
stand-in kernel (which on a GPU is one launch and reads nothing back):

* hooks installed on modules (each costs the host, and a hook left on a module costs every later call);
* host reads of device data: ``.item()``/``int()``/``float()``/``bool()`` of a tensor, ``.tolist()``, ``.numpy()``,
  ``.cpu()``, ``nonzero``, boolean indexing (each a device synchronisation on a GPU);
* tensors made from host data (``torch.tensor``/``as_tensor``/``from_numpy``: each a host-to-device copy on a GPU);
* the operations dispatched per layer at the attention call site (each a launch or a dispatch on the host).

Each bound is derived below from what the forward needs; the old code (per-forward hook for the kept hidden states,
nine host arrays copied one by one, three reads of the rows, ``repeat_interleave`` and the transposes around the
kernel) exceeded each of them.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from helpers import build_tiny_model, build_tiny_tokenizer
from packing_helpers import grouped_rows, padded_batch, reference_varlen_attn_2_11
from torch.utils._python_dispatch import TorchDispatchMode

from trinity_trl.packing import KERNELS, PrefixPacking
from trinity_trl.packing import kernels as kernels_module

ATEN = torch.ops.aten
#: data-dependent reads: a value or an output shape the host must wait for
READS = {ATEN._local_scalar_dense.default, ATEN.nonzero.default, ATEN.masked_select.default}


class HostWork(TorchDispatchMode):
    """Counts what the host does while active (see the module docs); ``paused`` while the stand-in kernel runs."""

    def __init__(self):
        super().__init__()
        self.counts = {"hook_installs": 0, "host_reads": 0, "host_tensors": 0}
        self.ops: list[str] = []
        self.paused = False
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops.append(str(func))
            bool_index = func is ATEN.index.Tensor and any(
                getattr(i, "dtype", None) == torch.bool for i in args[1] if i is not None
            )
            if func in READS or bool_index:
                self.counts["host_reads"] += 1
                self.reads.append(str(func))
            elif func is ATEN.lift_fresh.default:
                self.counts["host_tensors"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting():
    """A `HostWork` over the block, with the Python-level hook installs and host reads (which torch does not
    dispatch) counted too: ``.cpu()`` and ``.tolist()`` count; ``.numpy()`` counts unless its tensor came from a
    counted ``.cpu()`` (on a GPU the copy is the read; on a CPU ``.cpu()`` returns the tensor itself)."""
    work = HostWork()
    originals = {}

    def wrap(owner, name, count):
        original = originals[(owner, name)] = getattr(owner, name)

        def counted(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            if not work.paused:
                count(self, out, name)
            return out

        setattr(owner, name, counted)

    def hook(module, out, name):
        work.counts["hook_installs"] += 1

    def read(tensor, out, name):
        if name == "numpy" and getattr(tensor, "_counted_read", False):
            return
        work.counts["host_reads"] += 1
        work.reads.append(name)
        if name == "cpu":
            out._counted_read = True

    for name in ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook"):
        wrap(torch.nn.Module, name, hook)
    for name in ("tolist", "numpy", "cpu"):
        wrap(torch.Tensor, name, read)
    try:
        with work:
            yield work
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


@pytest.fixture
def varlen_on_cpu(monkeypatch):
    """The ``varlen`` kernel's call sites on CPU: torch 2.11's ``varlen_attn`` as its exact reference (the kernel reads
    the signature: no ``enable_gqa``, so it expands the key/value heads), available on this device and dtype. Returns
    a list that `HostWork` sets to pause counting inside the stand-in."""
    import torch.nn.attention.varlen as varlen_module

    current: list[HostWork | None] = [None]
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(1)
        work = current[0]
        if work is not None:
            work.paused = True
        try:
            return reference_varlen_attn_2_11(*args, **kwargs)
        finally:
            if work is not None:
                work.paused = False

    stand_in.__signature__ = inspect.signature(reference_varlen_attn_2_11)
    monkeypatch.setattr(varlen_module, "varlen_attn", stand_in)
    kernels_module._varlen_api.cache_clear()
    monkeypatch.setattr(KERNELS["varlen"], "unavailable", lambda device: None)
    monkeypatch.setattr(KERNELS["varlen"], "dtypes", None)
    yield current, calls
    kernels_module._varlen_api.cache_clear()


def _setup():
    from trl.trainer.utils import add_fused_lm_head

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs",))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, mask, keep = padded_batch(grouped_rows(torch.Generator().manual_seed(0), vocab=len(tokenizer)))
    packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext, kernel="varlen")
    return model, packing, ids, mask, keep


def _packed_step(model, packing, ids, mask, keep, grad: bool = True):
    with torch.enable_grad() if grad else torch.no_grad():
        out = packing.logps_and_entropies(model, ids, mask, keep, None, False, False, {})
        assert out is not None and out.kernel == "varlen"  # packed, through the CUDA path's call sites
        if grad:
            out.logps.sum().backward()
    return out


def test_a_packed_forward_reads_the_rows_once_copies_once_and_syncs_nowhere_else(varlen_on_cpu, monkeypatch):
    """A training forward and its backward (activation checkpointing: every layer recomputed): one read of the rows
    (to build the tree on the host), one host-to-device copy (the packed row and the kernel's plan together), no
    other read anywhere (none inside the model's forward or backward), and hooks only where the recomputation needs
    them: the backbone and each layer's attention module, a pre- and a post-hook each."""
    current, calls = varlen_on_cpu
    model, packing, ids, mask, keep = _setup()
    _packed_step(model, packing, ids, mask, keep)  # first forward: registration, caches
    layers = model.config.num_hidden_layers
    for _ in range(2):  # the same count every forward: nothing accumulates
        model.zero_grad(set_to_none=True)
        calls.clear()
        with counting() as work:
            current[0] = work
            _packed_step(model, packing, ids, mask, keep)
            current[0] = None
        assert len(calls) == 2 * layers  # the kernel ran: forward and recomputation of each layer
        assert work.counts["host_reads"] == 1, work.reads  # the rows, once
        assert work.counts["host_tensors"] == 1  # one upload
        assert work.counts["hook_installs"] == 2 * (layers + 1)


def test_a_forward_without_gradients_routes_the_backbone_only(varlen_on_cpu, monkeypatch):
    """No backward, no recomputation: the backbone's two hooks are all the routing a forward without gradients needs
    (the behaviour and reference log-prob passes)."""
    current, _ = varlen_on_cpu
    model, packing, ids, mask, keep = _setup()
    _packed_step(model, packing, ids, mask, keep, grad=False)
    with counting() as work:
        current[0] = work
        _packed_step(model, packing, ids, mask, keep, grad=False)
        current[0] = None
    assert work.counts == {"hook_installs": 2, "host_reads": 1, "host_tensors": 1}


def _ops_per_attention_call(model, packing, ids, mask, keep, current, monkeypatch) -> list[list[str]]:
    """The operations each attention call (forward and recomputation) dispatches outside the kernel."""
    from trinity_trl.packing import attention as attention_module

    per_call: list[list[str]] = []
    original = attention_module.tree_attention_forward

    def recorded(*args, **kwargs):
        work = current[0]
        start = len(work.ops)
        try:
            return original(*args, **kwargs)
        finally:
            per_call.append(work.ops[start:])

    from transformers import AttentionInterface

    # the registry's entry (registered once) and the module's name (which a registration per forward would read)
    monkeypatch.setattr(attention_module, "tree_attention_forward", recorded)
    AttentionInterface.register(attention_module.TREE_ATTENTION, recorded)
    try:
        with counting() as work:
            current[0] = work
            _packed_step(model, packing, ids, mask, keep)
            current[0] = None
    finally:
        AttentionInterface.register(attention_module.TREE_ATTENTION, original)
    return per_call


def test_the_attention_call_site_dispatches_what_the_kernel_needs_and_no_more(varlen_on_cpu, monkeypatch):
    """Per layer, around the kernel: the queries as the packed row holds them (a select and a transpose: views), each
    of the key and value heads gathered at the plan's key index (a select, a transpose, one ``index_select``), then,
    as torch 2.11 has no ``enable_gqa``, repeated for their query heads (an unsqueeze, an expand and one copy: a
    ``clone`` into an ``_unsafe_view``), and the output given back in transformers' layout (an unsqueeze): 2 + 2 x 3 +
    2 x 4 + 1 = 17 operations, 4 of them launches (2 gathers, 2 copies). The old call site dispatched 19 (the
    transposes around the kernel's output)."""
    current, _ = varlen_on_cpu
    model, packing, ids, mask, keep = _setup()
    _packed_step(model, packing, ids, mask, keep)
    model.zero_grad(set_to_none=True)
    per_call = _ops_per_attention_call(model, packing, ids, mask, keep, current, monkeypatch)
    assert len(per_call) == 2 * model.config.num_hidden_layers
    views = {"aten.select.int", "aten.transpose.int", "aten.unsqueeze.default", "aten.expand.default"}
    views |= {"aten._unsafe_view.default", "aten.view.default"}
    for ops in per_call:
        assert len(ops) <= 17, ops
        launches = [op for op in ops if op not in views]
        assert sorted(launches) == ["aten.clone.default"] * 2 + ["aten.index_select.default"] * 2, ops


def test_the_counts_see_a_host_read_a_host_copy_and_a_hook_added_per_forward(varlen_on_cpu, monkeypatch):
    """The counting itself can fail: a kernel whose plan reads an offset back (``int(cu[1])``), builds an extra index
    on the host and installs a hook per forward is seen on each count."""
    current, _ = varlen_on_cpu
    model, packing, ids, mask, keep = _setup()
    varlen = KERNELS["varlen"]
    original_plan = varlen.plan

    def careless_plan(packed, device):
        plan = original_plan(packed, device)
        int(plan.cu_q[1])  # a read back
        torch.as_tensor([0, 1])  # a host array copied on its own
        model.register_forward_hook(lambda *a: None).remove()  # a hook per forward
        return plan

    monkeypatch.setattr(varlen, "plan", careless_plan)
    _packed_step(model, packing, ids, mask, keep)
    model.zero_grad(set_to_none=True)
    with counting() as work:
        current[0] = work
        _packed_step(model, packing, ids, mask, keep)
        current[0] = None
    layers = model.config.num_hidden_layers
    assert work.counts == {"hook_installs": 2 * (layers + 1) + 1, "host_reads": 2, "host_tensors": 2}


def test_the_gathered_keys_equal_the_old_layout_for_either_memory_layout():
    """The plan's gather reads the key/value heads where they lie, token-major (a projection's view) or head-major
    (a contiguous tensor), and gives the same gathered keys as indexing a copy would."""
    from packing_helpers import long_grouped_rows

    from trinity_trl.packing import gathered_keys, pack_rows

    (packed,) = pack_rows(*padded_batch(long_grouped_rows(torch.Generator().manual_seed(3))))
    varlen_plan = kernels_module._varlen_plan(KERNELS["varlen"], packed, torch.device("cpu"))
    index = torch.as_tensor(gathered_keys(packed.segments).key_index)
    n = packed.num_tokens
    token_major = torch.randn(1, n, 2, 8).transpose(1, 2)  # (1, H_kv, N, D) viewed from (1, N, H_kv, D)
    head_major = token_major.contiguous()
    for x in (token_major, head_major):
        assert torch.equal(varlen_plan.gather(x), x[0].transpose(0, 1).contiguous()[index])
    assert varlen_plan.max_q == int(torch.diff(varlen_plan.cu_q).max()) and varlen_plan.cu_q.dtype == torch.int32
