"""How the tree attention reaches the layers (`trinity_trl/packing/attention.py`): one named implementation in
transformers' public attention registry, the plan in the forward's keyword arguments, and nothing else changed: not
the functions registered under transformers' own names, not a second model, not the packed model outside its packed
calls, not a saved config."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import build_tiny_model, build_tiny_tokenizer, length_reward, tiny_grpo_kwargs
from packing_helpers import grouped_rows, padded_batch
from tolerance import assert_close

from trinity_trl.packing import TREE_ATTENTION, PrefixPacking, unsupported_reason
from trinity_trl.packing import attention as attention_module

SCRIPT = Path(__file__).resolve().parent / "scripts" / "second_model_untouched.py"
SHIPPED = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


def registered() -> dict:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    return {
        (kind, name): registry.get(name)
        for kind, registry in (("attention", AttentionInterface()), ("mask", AttentionMaskInterface()))
        for name in SHIPPED
    }


def our_hooks(model: torch.nn.Module) -> int:
    """The forward hooks of `attention` still on ``model``'s modules."""
    return sum(
        isinstance(getattr(hook, "__self__", None), attention_module._Route)
        for module in model.modules()
        for hooks in (module._forward_pre_hooks, module._forward_hooks)
        for hook in hooks.values()
    )


def packed_setup(checkpointing: bool = True):
    from trl.trainer.utils import add_fused_lm_head

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs",))
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, mask, keep = padded_batch(grouped_rows(torch.Generator().manual_seed(0), vocab=len(tokenizer)))
    packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext, kernel="sdpa_segments")
    return model, packing, ids, mask, keep


def padded_forward(model, ids, mask, grad: bool = False):
    labels = ids.masked_fill(mask == 0, -100)
    with torch.enable_grad() if grad else torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs


def test_a_second_model_in_the_process_keeps_its_attention():
    """In a fresh process, a second (Llama) model's attention outputs and logits are bit-identical before any packing
    code was imported, while a packed forward's plan is alive, after its backward (activation checkpointing) and
    after a no-grad packed forward; its implementation and the functions under transformers' names are the same
    objects (`scripts/second_model_untouched.py`). The old wrapper re-registered ``sdpa``: this failed there."""
    tests = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tests.parent), str(tests), str(tests / "packing"), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tests.parent,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-4000:]


def test_the_packed_model_runs_its_own_attention_outside_packed_calls(tmp_path):
    """While a packed forward's plan is alive (its backward not yet run), the same model says its own implementation,
    its padded forward is bit-identical to the one before, a save writes no trace of the tree attention and reloads
    as ``sdpa``; the backward recomputes the layers through the tree attention; then no hook is left on the model."""
    from transformers import AutoModelForCausalLM

    model, packing, ids, mask, keep = packed_setup()
    before_registry, before = registered(), padded_forward(model, ids, mask)
    out = packing.logps_and_entropies(model, ids, mask, keep, None, False, False, {})
    assert out is not None and out.forwarded < out.padded
    assert model.config._attn_implementation == "sdpa"
    assert our_hooks(model) > 0  # the route of the alive plan: the backbone and each layer's attention
    assert torch.equal(padded_forward(model, ids, mask), before)
    model.save_pretrained(tmp_path)
    assert TREE_ATTENTION not in (tmp_path / "config.json").read_text()
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"
    out.logps.sum().backward()
    del out
    gc.collect()
    assert our_hooks(model) == 0
    assert model.config._attn_implementation == "sdpa"
    assert registered() == before_registry and all(registered()[k] is f for k, f in before_registry.items())


def test_the_route_leaves_with_the_plan_and_restores_the_name_on_errors():
    """Without gradients the plan (and the hooks) go when the forward returns; a forward that raises inside a packed
    call still gives the model its implementation back."""
    model, packing, ids, mask, keep = packed_setup(checkpointing=False)
    with torch.no_grad():
        assert packing.logps_and_entropies(model, ids, mask, keep, None, False, False, {}) is not None
    assert our_hooks(model) == 0
    model.model.layers[1].self_attn.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        packing.logps_and_entropies(model, ids, mask, keep, None, False, False, {})
    assert model.config._attn_implementation == "sdpa"


def test_the_tree_implementation_runs_only_with_a_plan():
    """A model set to the tree implementation by hand, without a plan, is refused with the reason rather than given a
    wrong attention."""
    model, _, ids, mask, _ = packed_setup(checkpointing=False)
    attention_module.register()
    model.set_attn_implementation(TREE_ATTENTION)
    with pytest.raises(RuntimeError, match="runs packed forwards only"):
        padded_forward(model, ids, mask)


def test_a_flash_attention_loaded_model_is_packed_through_the_registry():
    """A model whose attention is `flash_attention_2` is accepted, and its layers reach the tree kernel through the
    registered implementation without calling FlashAttention (not installed here): its packed log-probs equal those of
    its `sdpa` twin's padded forward, and it says `flash_attention_2` afterwards."""
    from trl.trainer.utils import add_fused_lm_head

    tokenizer = build_tiny_tokenizer()
    flash, twin = build_tiny_model(tokenizer), build_tiny_model(tokenizer)
    flash.config._attn_implementation = "flash_attention_2"
    assert unsupported_reason(flash) is None
    for model in (flash, twin):
        add_fused_lm_head(model, temperature=1.0, outputs=("log_probs",))
    ids, mask, keep = padded_batch(grouped_rows(torch.Generator().manual_seed(0), vocab=len(tokenizer)))
    labels = ids.masked_fill(mask == 0, -100)
    packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext)
    with torch.no_grad():
        packed = packing.logps_and_entropies(flash, ids, mask, keep, None, False, False, {})
        padded = twin(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -keep:]
    assert flash.config._attn_implementation == "flash_attention_2"
    scored = mask[:, -keep:].bool()
    # 2 layers x (MLP 128 + hidden 64 + an attention row of <= 32 keys x head dim 16) + the vocabulary's logsumexp
    assert_close(packed.logps[scored], padded[scored], terms=2 * (128 + 64 + 32 * 16) + len(tokenizer))


def test_a_trained_and_saved_model_says_its_own_implementation(tmp_path, tiny_model_dir):
    """After a packed training run with activation checkpointing and a checkpoint save, the trainer's model, the
    checkpoint's and the final save's configs say ``sdpa``, and no hook of ours is left on the model."""
    from transformers import AutoModelForCausalLM

    from trinity_trl.trainers import TrinityConfig, TrinityTrainer

    system = "You are a careful assistant. Answer with the number only."
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "system", "content": system}, {"role": "user", "content": f"{a}+1?"}] for a in range(4)]}
    )
    args = TrinityConfig(
        **tiny_grpo_kwargs(
            output_dir=str(tmp_path), activation_checkpointing=True, save_strategy="steps", save_steps=1, max_steps=1
        )
    )
    trainer = TrinityTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=dataset)
    trainer.train()
    ratios = [
        e["packing/forwarded_token_ratio"] for e in trainer.state.log_history if "packing/forwarded_token_ratio" in e
    ]
    assert ratios and min(ratios) < 1.0  # the training forward was packed
    trainer.save_model(str(tmp_path / "final"))
    gc.collect()
    assert trainer.model.config._attn_implementation == "sdpa"
    assert our_hooks(trainer.model) == 0
    for saved in (tmp_path / "checkpoint-1", tmp_path / "final"):
        config = json.loads((saved / "config.json").read_text())
        assert TREE_ATTENTION not in json.dumps(config)
        assert AutoModelForCausalLM.from_pretrained(saved).config._attn_implementation == "sdpa"


def test_auto_times_the_padded_layout_with_the_models_own_attention(monkeypatch):
    """``auto``'s calibration on the same model (made to calibrate on CPU, activation checkpointing on): every
    attention call that carries a plan, recomputations included, runs under the tree implementation, and every other
    one (the padded real passes) under the model's own ``sdpa``."""
    from trinity_trl.packing import KERNELS, selection

    model, packing, ids, mask, keep = packed_setup()
    monkeypatch.setattr(packing, "choice", lambda m, d: selection.Choice(KERNELS["sdpa_segments"], calibrate=True))
    seen = []

    def record(module, args, kwargs, output):
        seen.append((module.config._attn_implementation, kwargs.get(attention_module.PLAN_KWARG) is not None))

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(record, with_kwargs=True)  # before the route's: sees its switch
    for _ in range(7):
        model.zero_grad(set_to_none=True)
        out = packing.logps_and_entropies(model, ids, mask, keep, None, False, False, {})
        (padded_forward(model, ids, mask, grad=True) if out is None else out.logps).sum().backward()
    samples = [c.samples for c in packing.calibration.classes.values()]
    assert all(s["packed"] and s["padded"] for s in samples)  # the trial timed both layouts' real passes
    assert {plan for _, plan in seen} == {True, False}
    assert all((name == TREE_ATTENTION) == plan for name, plan in seen), set(seen)
    assert {name for name, plan in seen if not plan} == {"sdpa"}
