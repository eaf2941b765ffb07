"""`trinity_trl/training/grpo_seams.py`: the TRL workarounds (`temporarily`, `captured_return`,
`skip_trl_reference_pass`) on plain objects. Their use against TRL itself is pinned by test_trl_contract.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trinity_trl.training.grpo_seams import captured_return, skip_trl_reference_pass, temporarily


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

    from trinity_trl.training.grpo_seams import bind_trl_arguments

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

    from trinity_trl.training.grpo_seams import trained_mask

    completion = torch.tensor([[1, 1, 1, 0]])
    assert torch.equal(trained_mask({"completion_mask": completion}), completion)
    tools = torch.tensor([[1, 0, 1, 1]])
    assert torch.equal(trained_mask({"completion_mask": completion, "tool_mask": tools}), torch.tensor([[1, 0, 1, 0]]))
