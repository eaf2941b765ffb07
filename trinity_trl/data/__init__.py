"""Bundled data for examples and tests: the real bundled model (SmolLM2-135M-Instruct) loader and the
arithmetic word-problem task (training/held-out splits, expert solutions, preference pairs, reward), and the loading
of your own data (``load_splits``: a Hub id, a folder, one data file or a Dataset; ``check_prompts``).

Importing this package is cheap: transformers and torch are imported only when a conversion runs.
"""

from .arithmetic import (
    accuracy_by_kind,
    arithmetic_dataset,
    arithmetic_expert_dataset,
    arithmetic_preference_dataset,
    arithmetic_reward,
    evaluate_accuracy,
    extract_answer,
)
from .loading import check_demonstrations, check_prompts, load_splits
from .model import (
    BUNDLED,
    BUNDLED_GGUF_FILE,
    BUNDLED_MODEL_HUB_ID,
    BUNDLED_MODEL_NAME,
    BUNDLED_MODEL_PACKAGE,
    bundled_gguf_path,
    bundled_model_dir,
    default_cache_dir,
    resolve_model,
)

__all__ = [
    "BUNDLED",
    "BUNDLED_GGUF_FILE",
    "BUNDLED_MODEL_HUB_ID",
    "BUNDLED_MODEL_NAME",
    "BUNDLED_MODEL_PACKAGE",
    "accuracy_by_kind",
    "arithmetic_dataset",
    "arithmetic_expert_dataset",
    "arithmetic_preference_dataset",
    "arithmetic_reward",
    "bundled_gguf_path",
    "bundled_model_dir",
    "check_demonstrations",
    "check_prompts",
    "default_cache_dir",
    "evaluate_accuracy",
    "extract_answer",
    "load_splits",
    "resolve_model",
]
