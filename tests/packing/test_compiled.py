"""Compiled decoder layers for packed forwards (`trinity_trl/packing/compiled.py`, ``prefix_packing_compile``).

On CPU with ``backend="aot_eager"`` (dynamo and AOT autograd trace the layers, forward and backward, with the tree op
and its fake kernel and autograd formula; no code generation): no graph break, the graphs compiled constant after the
first packed forward whatever the tree (its length, its number of nodes), and the log-probs, entropies, loss and every
gradient equal to the eager packed forward's in float64 within the packing tests' tolerance. The GPU check counts the
same on CUDA with the inductor backend (`benchmarks/packing_profile.py`).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import build_tiny_model, build_tiny_tokenizer
from packing_helpers import GRAD_TERMS, LOGP_TERMS, grouped_rows, padded_batch
from tolerance import assert_close
from transformers import TrainerCallback

from trinity_trl.packing import PrefixPacking
from trinity_trl.packing.compiled import DISPATCHER_PREFIX, OP_KERNELS, tree_attention_op


def _gathered(generator: torch.Generator, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    """Three nodes (a root of 5 tokens and two children of 3 and 4) in the gathered-key layout, float64."""
    paths = [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 8, 9, 10, 11]]
    cu_q = [0, 5, 8, 12]
    cu_k = [0]
    for path in paths:
        cu_k.append(cu_k[-1] + len(path))
    index = torch.tensor(sum(paths, []))
    host_cu = torch.tensor(cu_q + cu_k)
    q = torch.randn(12, heads, dim, dtype=torch.float64, generator=generator, requires_grad=True)
    k = torch.randn(12, kv_heads, dim, dtype=torch.float64, generator=generator, requires_grad=True)
    v = torch.randn(12, kv_heads, dim, dtype=torch.float64, generator=generator, requires_grad=True)
    return q, k, v, index, host_cu, list(zip(cu_q, cu_q[1:])), paths


def test_the_tree_op_and_its_gradient_equal_per_node_attention():
    """The op (its forward and the closed-form backward) against per-node SDPA differentiated by autograd, GQA, in
    float64; and ``torch.library.opcheck`` (schema, fake kernel, autograd registration, AOT dispatch with dynamic
    shapes)."""
    q, k, v, index, host_cu, nodes, paths = _gathered(torch.Generator().manual_seed(0))
    keys, values = k.index_select(0, index), v.index_select(0, index)
    out, _ = tree_attention_op(q, keys, values, host_cu.int(), host_cu, 0.3, "sdpa_segments")
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    reference = []
    for (a, b), path in zip(nodes, paths):
        keys = torch.tensor(path)
        mask = torch.ones(b - a, len(path), dtype=torch.bool).tril(len(path) - (b - a))
        reference.append(
            F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[keys].transpose(0, 1), v[keys].transpose(0, 1), attn_mask=mask, scale=0.3,
                enable_gqa=True,
            ).transpose(0, 1)
        )  # fmt: skip
    reference = torch.cat(reference)
    want = torch.autograd.grad(reference, (q, k, v), grad)
    assert_close(out, reference, terms=12 * 8)
    for name, a, b in zip("qkv", got, want):
        assert_close(a, b, terms=12 * 8 * 4, msg=name)
    args = (q.detach(), k.detach()[index].requires_grad_(), v.detach()[index].requires_grad_(), host_cu.int(), host_cu)
    result = torch.library.opcheck(tree_attention_op, (*args, 0.3, "sdpa_segments"))
    assert set(result.values()) == {"SUCCESS"}, result


def _model():
    from trl.trainer.utils import add_fused_lm_head

    model = build_tiny_model(build_tiny_tokenizer()).double()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _pass(packing, model, rows):
    ids, mask, keep = padded_batch(rows)
    model.zero_grad(set_to_none=True)
    out = packing.logps_and_entropies(model, ids, mask, keep, None, True, False, {})
    assert out is not None, "the packed forward fell back to padded rows"
    loss = out.logps.sum() + 0.1 * out.entropies.sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, loss.detach(), grads


def test_compiled_layers_compile_once_without_graph_breaks_and_equal_eager():
    """Activation checkpointing on (TRL's default on a GPU). The compiled model forwards trees of 18 to 100 tokens and
    3 to 16 nodes: after the first, no graph is compiled again, no graph breaks (the only compiled frames are the
    decoder layers), and every forward's log-probs, entropies, loss and gradients equal the eager packed forward's
    (float64, the packing tests' tolerances). A hook installed per forward (the eager route) recompiles every
    forward, and a per-node loop in the layer (the eager kernel) once per node count: both fail the count."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled_model = _model()
    eager_model = copy.deepcopy(compiled_model)
    backend = CompileCounterWithBackend("aot_eager")
    packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext, "sdpa_segments", compile=backend)
    eager = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext, "sdpa_segments")
    trees = [(1, 2), (2, 3), (3, 1), (4, 4), (6, 5)]  # (seed, groups): lengths 34, 53, 18, 75, 100
    frames, nodes = [], []
    try:
        for seed, groups in trees:
            rows = grouped_rows(torch.Generator().manual_seed(seed), groups=groups)
            out, loss, grads = _pass(packing, compiled_model, rows)
            assert out.kernel == OP_KERNELS["sdpa_segments"].name
            frames.append(backend.frame_count)
            nodes.append(out.forwarded)
            want_out, want_loss, want_grads = _pass(eager, eager_model, rows)
            assert_close(out.logps, want_out.logps, terms=LOGP_TERMS)
            assert_close(out.entropies, want_out.entropies, terms=LOGP_TERMS)
            assert_close(loss, want_loss, terms=GRAD_TERMS)
            assert grads.keys() == want_grads.keys() and grads
            for name, grad in want_grads.items():
                assert_close(grads[name], grad, terms=GRAD_TERMS, msg=name)
        assert compiled_model.config._attn_implementation == DISPATCHER_PREFIX + "sdpa"
        assert len(set(nodes)) == len(trees), nodes  # every tree a new length
        assert frames[0] >= 1 and frames == [frames[0]] * len(trees), f"graphs compiled after each forward: {frames}"
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        assert packing.compiled.graphs == frames[-1] <= packing.compile_budget.graphs
        # the model's own forwards (no plan) run the model's own attention, uncompiled
        ids, mask, _ = padded_batch(grouped_rows(torch.Generator().manual_seed(9)))
        with torch.no_grad():
            a = compiled_model(input_ids=ids, attention_mask=mask).logits
            b = eager_model(input_ids=ids, attention_mask=mask).logits
        assert_close(a, b, terms=LOGP_TERMS)
        assert backend.frame_count == frames[-1]
    finally:
        torch._dynamo.reset()


def test_compiled_layers_refuse_flex():
    with pytest.raises(ValueError, match="flex is compiled on its own"):
        PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext, "flex", compile="aot_eager")


def test_auto_times_compiled_passes_only_after_compilation(monkeypatch):
    """Under compiled layers ``auto``'s trial starts only once a grad mode's packed passes have run compiled (the
    first passes compile, and a timing of them would charge the compilation to packing): those passes run packed,
    untimed. (Layers left uncompiled here: the accounting is what is tested, the op runs eagerly.)"""
    from test_selection import _calibrating, _fused_tiny_model, _padded_logps

    from trinity_trl.packing import compiled as compiled_module

    monkeypatch.setattr(compiled_module.torch, "compile", lambda fn, **kwargs: fn)
    model = _fused_tiny_model()
    ids, mask, keep = padded_batch(grouped_rows(torch.Generator().manual_seed(0)))
    packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext, compile="aot_eager")
    _calibrating(monkeypatch, packing)
    ran, trial = [], []
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        out = packing.logps_and_entropies(model, ids, mask, keep, None, False, False, {})
        (_padded_logps(model, ids, mask, keep) if out is None else out.logps).sum().backward()
        ran.append("padded" if out is None else out.kernel)
        classes = packing.calibration.classes
        trial.append(
            sum(len(c.samples["packed"]) + len(c.samples["padded"]) + len(c.pending) for c in classes.values())
        )
    op = OP_KERNELS["sdpa_segments"].name
    assert ran[:2] == [op, op] and trial[:2] == [0, 0], (ran, trial)  # the warm-up: packed, nothing timed
    assert ran[2:] == [op, "padded"] and trial[2:] == [1, 2], (ran, trial)  # then the trial: each pass timed


def test_a_trainer_trains_with_compiled_layers_as_without(tmp_path, tiny_model_dir, monkeypatch):
    """`TrinityTrainer(prefix_packing_compile=True)` with activation checkpointing on (TRL switches it off and on
    around every generation): its packed training forwards run the compiled layers (``aot_eager`` here, the
    trainers' ``inductor`` on a GPU), compile once, with no graph break, and the run's losses and gradient norms are
    those of the same run uncompiled (float32, the packing tests' tolerances)."""
    from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs
    from torch._dynamo.utils import counters

    from trinity_trl.trainers import TrinityConfig, TrinityTrainer
    from trinity_trl.trainers import trinity as trinity_module

    monkeypatch.setattr(trinity_module, "compile_backend", lambda on, engine: "aot_eager" if on else None)

    def run(compiled: bool):
        args = TrinityConfig(
            **tiny_grpo_kwargs(
                output_dir=str(tmp_path / str(compiled)),
                activation_checkpointing=True,
                prefix_packing_compile=compiled,
                max_steps=3,
            )
        )
        trainer = TrinityTrainer(
            model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_conversational_dataset(8)
        )
        kernels, graphs = [], []
        forward = trainer.prefix_packing.logps_and_entropies

        def recording(*a, **k):
            out = forward(*a, **k)
            kernels.append(None if out is None else out.kernel)
            return out

        trainer.prefix_packing.logps_and_entropies = recording
        trainer.add_callback(_StepGraphs(trainer, graphs))
        trainer.train()
        logs = trainer.state.log_history
        return (
            kernels,
            graphs,
            [e["loss"] for e in logs if "loss" in e],
            [e["grad_norm"] for e in logs if "grad_norm" in e],
        )

    torch._dynamo.reset()
    counters.clear()
    try:
        kernels, graphs, losses, norms = run(True)
        assert set(kernels) == {OP_KERNELS["sdpa_segments"].name}, kernels
        assert graphs[0] >= 1 and graphs == [graphs[0]] * len(graphs), graphs  # compiled once, at the first step
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    eager_kernels, _, eager_losses, eager_norms = run(False)
    assert set(eager_kernels) == {"sdpa_segments"}
    assert_close(torch.tensor(losses), torch.tensor(eager_losses), terms=GRAD_TERMS)
    assert_close(torch.tensor(norms), torch.tensor(eager_norms), terms=GRAD_TERMS)


class _StepGraphs(TrainerCallback):
    """Records the compiled layers' graph count after each optimizer step (none without compiled layers)."""

    def __init__(self, trainer, graphs: list):
        self.trainer, self.graphs = trainer, graphs

    def on_step_end(self, args, state, control, **kwargs):
        compiled = self.trainer.prefix_packing.compiled
        if compiled is not None:
            self.graphs.append(compiled.graphs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by `make test-gpu` on a GPU machine)")
@pytest.mark.parametrize("kernel", ["varlen", "flash_attn"])
def test_compiled_layers_on_cuda_compile_once_and_equal_the_padded_forward(kernel):
    """On CUDA with the trainers' backend (inductor) and the tree op's FlashAttention kernels, bf16, activation
    checkpointing on: the graphs compiled stay those of the first packed forward across trees of other lengths and
    node counts, no graph break, and each forward's log-probs and gradients equal the float32 padded forward of the
    same weights within the bf16 bounds of `packing_helpers` (a wrong kernel fails them)."""
    from packing_helpers import assert_bf16_grad_close, assert_bf16_logps_close
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from trinity_trl.packing import KERNELS

    reason = KERNELS[kernel].unavailable(torch.device("cuda")) or KERNELS[kernel].unsupported_dtype(torch.bfloat16)
    if reason:
        pytest.skip(reason)
    torch._dynamo.reset()
    counters.clear()
    model = _model().to("cuda", torch.bfloat16)
    reference = copy.deepcopy(model).float()
    backend = CompileCounterWithBackend("inductor")
    packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext, kernel, "cuda", compile=backend)
    frames = []
    try:
        for seed, groups in [(1, 2), (2, 3), (3, 1), (4, 4)]:
            ids, mask, keep = padded_batch(grouped_rows(torch.Generator().manual_seed(seed), groups=groups))
            ids, mask = ids.cuda(), mask.cuda()
            model.zero_grad(set_to_none=True)
            out = packing.logps_and_entropies(model, ids, mask, keep, None, True, False, {})
            assert out is not None and out.kernel == OP_KERNELS[kernel].name
            scored = mask[:, -keep:].bool()
            out.logps.float()[scored].sum().backward()
            frames.append(backend.frame_count)
            reference.zero_grad(set_to_none=True)
            labels = ids.masked_fill(mask == 0, -100)
            labels[:, :-keep] = -100
            want = reference(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -keep:]
            want[scored].sum().backward()
            assert_bf16_logps_close(out.logps.float()[scored], want[scored].detach())
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                assert_bf16_grad_close(p.grad.float(), q.grad, msg=name)
        assert frames == [frames[0]] * len(frames), frames
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
