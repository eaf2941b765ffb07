"""The few places where TRL 1.16 leaves no clean seam, each done once and explained.

``GRPOTrainer`` offers no hooks: some values we need are only visible inside one of its private
methods, and some behaviour is switched by a config attribute rather than an argument. Every
workaround of that kind lives here, so a reader (or a TRL upgrade) finds all of them in one file;
the contract tests (``tests/trainers/test_trl_contract.py``) fail loudly if TRL changes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def temporarily(obj: Any, **values: Any) -> Iterator[None]:
    """Set attributes of ``obj`` for the duration of the block, then restore them (even on error).

    Used where TRL reads a value from an attribute instead of taking an argument:

    * ``args.beta`` while ``GRPOTrainer.__init__`` runs: TRL loads a reference model (or plans to
      disable the LoRA adapter for it) and computes reference log-probs iff ``beta != 0``. Our KL
      terms are components (``kl_loss_fn``, ``kl_penalty_fn``) and never read ``beta``, so it is only
      raised while TRL decides whether to load the reference.
    * ``args.output_dir`` while TRL's ``create_model_card`` runs: it always writes the card into
      ``args.output_dir``; ``save_model(other_dir)`` wants it next to the saved weights.
    """
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


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
