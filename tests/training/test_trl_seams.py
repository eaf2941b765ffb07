"""`trinity_trl/training/trl_seams.py`: the TRL workarounds (`temporarily`, `captured_return`,
`skip_trl_reference_pass`) on plain objects. Their use against TRL itself is pinned by test_trl_contract.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trinity_trl.training.trl_seams import (
    CompileEvents,
    cache_keyword,
    captured_return,
    compile_on_every_device,
    input_hooks_kept,
    intercepted,
    is_full_attention_cache,
    skip_trl_reference_pass,
    temporarily,
)


class Scorer:
    def __init__(self, offset: int = 0):
        self.offset = offset
        self.calls = 0

    def score(self, x: int) -> int:
        self.calls += 1
        return x + self.offset


# ------------------------------------------------------------------------------------------------- temporarily
def test_temporarily_sets_and_restores():
    args = SimpleNamespace(beta=0.0, output_dir="out")
    with temporarily(args, beta=1.0, output_dir="elsewhere"):
        assert (args.beta, args.output_dir) == (1.0, "elsewhere")
    assert (args.beta, args.output_dir) == (0.0, "out")


def test_temporarily_restores_on_exception():
    args = SimpleNamespace(beta=0.0)
    with pytest.raises(RuntimeError, match="inside"):
        with temporarily(args, beta=1.0):
            raise RuntimeError("inside")
    assert args.beta == 0.0


def test_temporarily_restores_a_value_changed_inside_the_block():
    args = SimpleNamespace(beta=0.0)
    with temporarily(args, beta=1.0):
        args.beta = 5.0
    assert args.beta == 0.0


def test_temporarily_nests():
    args = SimpleNamespace(beta=0.0)
    with temporarily(args, beta=1.0):
        with temporarily(args, beta=2.0):
            assert args.beta == 2.0
        assert args.beta == 1.0
    assert args.beta == 0.0


def test_temporarily_needs_an_existing_attribute():
    args = SimpleNamespace()
    with pytest.raises(AttributeError):
        with temporarily(args, beta=1.0):
            pass
    assert not hasattr(args, "beta")


# --------------------------------------------------------------------------------------------- captured_return
def test_captured_return_records_the_last_value_and_leaves_no_trace():
    scorer = Scorer(offset=10)
    with captured_return(scorer, "score") as captured:
        assert captured.value is None
        assert scorer.score(1) == 11
        assert scorer.score(2) == 12
    assert captured.value == 12  # the last call's value
    assert scorer.calls == 2  # the original ran, once per call
    assert "score" not in vars(scorer)  # the class method is visible again
    assert scorer.score(3) == 13 and captured.value == 12  # no longer recording


def test_captured_return_without_a_call_keeps_none():
    scorer = Scorer()
    with captured_return(scorer, "score") as captured:
        pass
    assert captured.value is None and "score" not in vars(scorer)


def test_captured_return_restores_an_existing_instance_attribute():
    scorer = Scorer()

    def doubled(x):
        return 2 * x

    scorer.score = doubled  # an instance attribute shadows the class method
    with captured_return(scorer, "score") as captured:
        assert scorer.score(4) == 8
    assert captured.value == 8
    assert vars(scorer)["score"] is doubled  # the same object comes back
    assert scorer.calls == 0  # the class method was never called


def test_captured_return_restores_on_exception():
    scorer = Scorer()
    with pytest.raises(ValueError, match="boom"):
        with captured_return(scorer, "score") as captured:
            scorer.score(1)
            raise ValueError("boom")
    assert captured.value == 1
    assert "score" not in vars(scorer)


def test_nested_captures_both_record_and_unwind_in_order():
    scorer = Scorer(offset=1)
    with captured_return(scorer, "score") as outer:
        scorer.score(1)
        with captured_return(scorer, "score") as inner:
            assert scorer.score(5) == 6
        assert (outer.value, inner.value) == (6, 6)  # the inner call went through both recorders
        assert "score" in vars(scorer)  # the outer recorder is back
        scorer.score(7)
        assert (outer.value, inner.value) == (8, 6)
    assert "score" not in vars(scorer)
    assert scorer.calls == 3


# ------------------------------------------------------------------------------------- skip_trl_reference_pass
def test_skip_trl_reference_pass_zeroes_beta_and_keeps_the_reference():
    reference = object()
    trainer = SimpleNamespace(beta=0.04, ref_model=reference)
    skip_trl_reference_pass(trainer)
    assert trainer.beta == 0.0 and trainer.ref_model is reference


def test_bind_trl_arguments_names_every_argument_whatever_the_base_order():
    from trl import DPOTrainer, GRPOTrainer, SFTTrainer

    from trinity_trl.training.trl_seams import bind_trl_arguments

    grpo = bind_trl_arguments(GRPOTrainer, "m", None, "args", "train", "eval", processing_class="tok")
    assert grpo == {
        "model": "m",
        "reward_funcs": None,
        "args": "args",
        "train_dataset": "train",
        "eval_dataset": "eval",
        "processing_class": "tok",
    }
    assert bind_trl_arguments(SFTTrainer, "m", "args", None, "train", "eval", "tok")["processing_class"] == "tok"
    assert bind_trl_arguments(DPOTrainer, "m", None, "args", None, "train", "eval", "tok")["processing_class"] == "tok"
    with pytest.raises(TypeError):
        bind_trl_arguments(GRPOTrainer, "m", not_an_argument=1)


def test_trained_mask_applies_the_tool_mask_when_present():
    import torch

    from trinity_trl.training.trl_seams import trained_mask

    completion = torch.tensor([[1, 1, 1, 0]])
    assert torch.equal(trained_mask({"completion_mask": completion}), completion)
    tools = torch.tensor([[1, 0, 1, 1]])
    assert torch.equal(trained_mask({"completion_mask": completion, "tool_mask": tools}), torch.tensor([[1, 0, 1, 0]]))


# ---------------------------------------------------------------------------------------------- generation seams
def test_intercepted_stands_in_for_one_object_and_leaves_no_trace():
    scorer, other = Scorer(offset=1), Scorer(offset=1)
    with intercepted(scorer, "score", lambda x: -x):
        assert scorer.score(2) == -2 and other.score(2) == 3
    assert "score" not in vars(scorer) and scorer.score(2) == 3
    scorer.score = lambda x: 0  # an instance attribute of that name comes back
    with intercepted(scorer, "score", lambda x: -x):
        assert scorer.score(2) == -2
    assert scorer.score(2) == 0


@pytest.fixture(scope="module")
def tiny_model():
    from helpers import build_tiny_model, build_tiny_tokenizer

    return build_tiny_model(build_tiny_tokenizer())


def test_input_hooks_kept_removes_the_hooks_a_checkpointing_toggle_adds(tiny_model):
    """Full fine-tuning: the toggle leaves the first hook registered and adds one; the block's hooks are removed
    (the handles, and transformers' list of them, as they were). Where the toggle removed the old hook itself (a
    PEFT adapter loaded through transformers), the new one stays: the model keeps exactly one."""
    model = tiny_model
    model.gradient_checkpointing_enable()
    hooks = model.get_input_embeddings()._forward_hooks
    kept = model._require_grads_hooks
    for _ in range(3):
        with input_hooks_kept(model):
            model.gradient_checkpointing_disable()
            model.gradient_checkpointing_enable()
            assert len(hooks) == 2
        assert len(hooks) == 1 and model._require_grads_hooks is kept
    with input_hooks_kept(model):
        model.disable_input_require_grads()  # what the toggle does with transformers' PEFT integration
        model.enable_input_require_grads()
    assert len(hooks) == 1 and model._require_grads_hooks is not kept
    model.gradient_checkpointing_disable()
    model.disable_input_require_grads()
    assert len(hooks) == 0


def test_compile_on_every_device_sets_transformers_flag_that_lets_generate_compile_on_a_cpu(tiny_model):
    """transformers (5.23, 5.24) compiles ``generate``'s decoding only on CUDA/XPU/TPU-like devices unless the
    private ``CompileConfig._compile_all_devices`` is set (``_valid_auto_compile_criteria``)."""
    from transformers import CompileConfig, GenerationConfig, StaticCache

    model_kwargs = {cache_keyword(tiny_model): StaticCache(config=tiny_model.config, max_cache_len=16)}
    config = GenerationConfig(compile_config=CompileConfig(backend="eager"), disable_compile=False)
    assert not tiny_model._valid_auto_compile_criteria(model_kwargs, config)
    compile_on_every_device(config.compile_config)
    assert config.compile_config._compile_all_devices is True
    assert tiny_model._valid_auto_compile_criteria(model_kwargs, config)


def test_transformers_refuses_a_cache_together_with_cache_implementation(tiny_model):
    """Why the grouped prefill unsets ``cache_implementation`` in its copy of the config when it passes a cache."""
    from transformers import DynamicCache

    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="Passing both `cache_implementation`"):
        tiny_model.generate(
            input_ids=ids,
            max_new_tokens=1,
            cache_implementation="static",
            **{cache_keyword(tiny_model): DynamicCache(config=tiny_model.config)},
        )


def test_cache_keyword_and_full_attention_layers_of_the_installed_transformers(tiny_model):
    import transformers

    assert cache_keyword(tiny_model) == ("cache" if transformers.__version__ >= "5.24" else "past_key_values")
    assert is_full_attention_cache(tiny_model)


def test_compile_events_count_dynamos_compilations():
    """dynamo's compilation callbacks (``torch._dynamo.callback_handler``): one per graph compiled, none for a call
    that reuses one."""

    @torch.compile(backend="eager")
    def double(x):
        return x * 2

    with CompileEvents() as events:
        double(torch.ones(3))
    with CompileEvents() as again:
        double(torch.ones(3))
    assert (events.compilations, again.compilations, events.recordings) == (1, 0, 0)
