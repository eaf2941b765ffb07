"""trinity_trl/notices.py: the library notices a user cannot act on are silenced when trinity_trl is imported, each
narrowly (the same text from elsewhere, and every other warning or log line, still shows); the console of a whole run
is tests/test_cli.py's console-script test."""

from __future__ import annotations

import os
import subprocess
import sys

from launching import scaled_timeout

# In a fresh process: the real sources of each notice after `import trinity_trl`, then (after a marker line) the same
# notices with every filter removed, which shows that they do happen here; a user's own warning and log line each time.
SCRIPT = r"""
import logging, sys, warnings
import trinity_trl
import deepspeed  # its accelerator line, on a machine without a GPU
from torch.utils.data import DataLoader
from transformers.trainer_callback import CallbackHandler, PrinterCallback
from trl import GRPOConfig
from trl.experimental.async_grpo.async_grpo_trainer import StepIntervalCallback

def notices():
    GRPOConfig(output_dir="unused", use_cpu=True)  # TRL's default gradient_checkpointing=True: transformers warns
    list(DataLoader([1, 2], pin_memory=True))  # pin_memory without an accelerator
    warnings.warn("the user's own warning", UserWarning)
    logging.getLogger("DeepSpeed").warning("another DeepSpeed line")
    handler = CallbackHandler([], None, None, None, None)
    for _ in range(2):  # TRL's AsyncGRPOTrainer adds two on purpose
        handler.add_callback(StepIntervalCallback(print, 1))
    handler.add_callback(PrinterCallback)  # a user's own duplicate
    handler.add_callback(PrinterCallback)

notices()
print("=== filters removed ===", flush=True)
print("=== filters removed ===", file=sys.stderr, flush=True)
warnings.resetwarnings()
warnings.simplefilter("always")
logging.getLogger("DeepSpeed").filters.clear()
logging.getLogger("transformers.trainer_callback").filters.clear()
logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU. (the same line again)")
notices()
"""

NOTICES = (
    "Setting accelerator to CPU",
    "`gradient_checkpointing` is deprecated",
    "'pin_memory' argument is set as true",
    "StepIntervalCallback'> to the callbacks of this Trainer",
)


def test_notices_a_user_cannot_act_on_are_silenced_and_nothing_else():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONWARNINGS", None)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=scaled_timeout(300), env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr  # DeepSpeed logs to stdout, warnings go to stderr
    marker = "=== filters removed ==="
    assert marker in result.stdout and marker in result.stderr, output[-3000:]
    quiet = result.stdout.split(marker)[0] + result.stderr.split(marker)[0]
    for notice in NOTICES:
        assert notice not in quiet, notice
        assert notice in output, f"{notice!r} no longer happens here: the filter may be stale"
    assert quiet.count("the user's own warning") == 1 and quiet.count("another DeepSpeed line") == 1
    assert quiet.count("PrinterCallback'> to the callbacks of this Trainer") == 1
