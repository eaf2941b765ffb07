"""Library notices a trinity_trl user can do nothing about, silenced here and nowhere else, each as narrowly as it can
be (a warnings filter by category, module and message, or a filter on one logger's record) and with its reason.

`quiet_notices` runs when ``trinity_trl`` is imported (it imports neither torch nor TRL). A run's console then shows
progress bars, the lines of trinity_trl (``[trinity-trl] ...``, one line per step) and what a user can act on. To see
everything again: ``warnings.resetwarnings()`` and ``logging.getLogger("DeepSpeed").filters.clear()``, or
``python -W default``: a filter given on the command line or in ``PYTHONWARNINGS`` comes first and wins.
"""

from __future__ import annotations

import logging
import warnings

#: (category, module, message regex, why it is silenced): Python warnings filters
QUIET_WARNINGS: tuple[tuple[type[Warning], str, str, str], ...] = (
    (
        UserWarning,
        r"torch\.utils\.data\.dataloader",
        r"'pin_memory' argument is set as true but no accelerator is found",
        "transformers' default dataloader_pin_memory=True on a machine without an accelerator: pinned memory only "
        "speeds up copies to an accelerator, so the option does nothing here and costs nothing",
    ),
    (
        FutureWarning,
        r"transformers\.training_args",
        r"`gradient_checkpointing(_kwargs)?` is deprecated",
        "TRL's configs set the old name gradient_checkpointing=True by default, so transformers warns about every "
        "TRL config built, whatever the user wrote; the value is honoured under its new name "
        "(activation_checkpointing), which trinity_trl's configs set themselves",
    ),
)

#: (logger, message prefix, why it is silenced): records dropped by a filter on that logger
QUIET_LOG_RECORDS: tuple[tuple[str, str, str], ...] = (
    (
        "DeepSpeed",
        "Setting accelerator to CPU",
        "printed by `import deepspeed` (TRL imports it when installed) on every machine without a GPU; trinity_trl "
        "says the same in its own line when a run starts, with what it changes (float32, no checkpointing)",
    ),
    (
        "transformers.trainer_callback",
        "You are adding a <class 'trl.experimental.async_grpo.async_grpo_trainer.StepIntervalCallback'>",
        "TRL's AsyncGRPOTrainer adds two StepIntervalCallbacks on purpose (the weight sync and the step metrics), and "
        "transformers warns about a second callback of one class; printed by every asynchronous trainer's "
        "construction, whatever the user wrote (a user's own duplicate callback still warns)",
    ),
)


class _DropRecords(logging.Filter):
    """A logger filter that drops the records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_notices() -> None:
    """Install the filters of `QUIET_WARNINGS` and `QUIET_LOG_RECORDS` (once; calling it again adds nothing)."""
    for category, module, message, _why in QUIET_WARNINGS:
        # append=True: any filter the user or the command line (-W, PYTHONWARNINGS) set comes first and wins
        warnings.filterwarnings("ignore", message=message, category=category, module=module, append=True)
    for name, prefix, _why in QUIET_LOG_RECORDS:
        logger = logging.getLogger(name)  # DeepSpeed sets its level when it creates it; a filter stays
        if not any(isinstance(f, _DropRecords) and prefix in f.prefixes for f in logger.filters):
            logger.addFilter(_DropRecords((prefix,)))
