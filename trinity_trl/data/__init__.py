"""Bundled data for examples and tests: the real bundled model (SmolLM2-135M-Instruct) loader.

Importing this package is cheap: transformers and torch are imported only when a conversion runs.
"""

from .model import (
    BUNDLED_GGUF_FILE,
    BUNDLED_MODEL_NAME,
    BUNDLED_MODEL_PACKAGE,
    bundled_gguf_path,
    bundled_model_dir,
    default_cache_dir,
)

__all__ = [
    "BUNDLED_GGUF_FILE",
    "BUNDLED_MODEL_NAME",
    "BUNDLED_MODEL_PACKAGE",
    "bundled_gguf_path",
    "bundled_model_dir",
    "default_cache_dir",
]
