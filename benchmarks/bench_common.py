"""Helpers shared by the benchmark scripts: offline environment, machine description, load, memory,
the tiny random model, formatting. Importing this module sets the offline environment variables
(before transformers or trl are imported by the caller) and puts the repository root and ``tests/``
(for ``helpers.build_tiny_tokenizer``) on ``sys.path``.
"""

from __future__ import annotations

import ctypes
import os
import platform
import statistics
import sys
from pathlib import Path

_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
_OFFLINE |= {"WANDB_MODE": "disabled", "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
_OFFLINE |= {"DISABLE_MLFLOW_INTEGRATION": "TRUE"}
for _name, _value in _OFFLINE.items():
    os.environ.setdefault(_name, _value)

ROOT = Path(__file__).resolve().parent.parent
for _path in (str(ROOT / "tests"), str(ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)


# --------------------------------------------------------------------------------------- machine
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loadavg() -> list[float] | None:
    """1/5/15-minute load averages: other work on the machine slows (and blurs) the timings."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def niceness() -> int | None:
    try:
        return os.nice(0)
    except OSError:
        return None


def package_version(name: str) -> str | None:
    """The installed version of ``name`` from its metadata (nothing imported), None when not installed."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine_basics(device: str = "cpu") -> dict:
    """Platform, CPU, core count, library versions and niceness, without importing torch or the libraries."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        **{name: package_version(name) for name in ("torch", "transformers", "trl", "peft")},
        "cpu": cpu_model(),
        "os_cpu_count": os.cpu_count(),
        "niceness": niceness(),
        "device": device,
    }
    return {k: v for k, v in info.items() if v is not None or k in ("torch", "transformers", "trl")}


def machine_description(device: str = "cpu") -> dict:
    """`machine_basics` plus this process's torch threads (and the GPU on CUDA)."""
    import torch

    info = {**machine_basics(device), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def machine_line(m: dict) -> str:
    """One Markdown sentence describing the machine of a report."""
    gpu = f" ({m['gpu']})" if m.get("gpu") else ""
    return (
        f"Machine: {m['platform']}; CPU: {m['cpu']} ({m['os_cpu_count']} visible cores); device "
        f"`{m['device']}`{gpu}; Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"trl {m['trl']}; torch threads {m['torch_threads']}; niceness {m['niceness']}."
    )


def interpreter() -> str:
    rel = os.path.relpath(sys.executable)
    return sys.executable if rel.startswith("..") else rel


# ---------------------------------------------------------------------------------------- memory
def read_status_kb(field: str) -> int | None:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``), None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` (peak RSS) to the current RSS; False where ``/proc/self/clear_refs`` is not writable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_LIBC = None


def malloc_trim() -> None:
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def max_rss_mib() -> float:
    """Peak resident set size of this process since it started (``getrusage``), in MiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ------------------------------------------------------------------------------------ tiny model
REAL_VOCAB = 151936
#: random models of these shapes (Qwen2.5 configs; tied embeddings) with the real vocabulary
MODEL_SHAPES = {
    "qwen2.5-0.5b": {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864},
    "qwen2.5-1.5b": {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960},
}
TINY_SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128}


def qwen2_config(shape: dict, vocab: int = REAL_VOCAB, max_positions: int = 4096, **extra):
    """The ``Qwen2Config`` of a random model of ``shape`` (``hidden``, ``intermediate``, ``layers``, ``heads``,
    ``kv_heads``) with ``vocab`` entries and tied embeddings (as Qwen2.5-0.5B/1.5B); ``extra``: more config fields."""
    from transformers import Qwen2Config

    sizes = {"hidden_size": shape["hidden"], "intermediate_size": shape["intermediate"], **extra}
    sizes |= {"num_hidden_layers": shape["layers"], "num_attention_heads": shape["heads"]}
    sizes |= {"num_key_value_heads": shape["kv_heads"], "max_position_embeddings": max_positions}
    return Qwen2Config(vocab_size=vocab, tie_word_embeddings=True, **sizes)


def save_random_qwen2(
    path: str | os.PathLike,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 688,
    max_positions: int = 1024,
    seed: int = 0,
    vocab: int | None = None,
    device: str = "cpu",
    bf16: bool = False,
) -> str:
    """A random Qwen2 with the tests' tiny BPE tokenizer (vocab ~490, ChatML), saved with it to ``path``. ``vocab``:
    a larger vocabulary (the real one's LM head; the tokenizer still the tiny one); ``device``: where it is initialised
    (fast on a GPU); ``bf16``: saved in bf16 (the dtype of the real checkpoints), else in float32."""
    import torch
    from helpers import build_tiny_tokenizer
    from transformers import Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    shape = {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads, "intermediate": intermediate}
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None}
    config = qwen2_config(shape, vocab or len(tokenizer), max_positions, **ids)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model = model.to(torch.bfloat16) if bf16 else model
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the workers need the memory, not this process
    return str(path)


def random_model(name: str, path: str | os.PathLike, device: str = "cpu", seed: int = 0, bf16: bool = False) -> dict:
    """``{"path", "about"}`` of ``name``: ``bundled`` (SmolLM2-135M-Instruct), ``tiny`` (`TINY_SHAPE`) or a random
    model of a `MODEL_SHAPES` shape with the real vocabulary, saved to ``path`` with the tests' tiny tokenizer."""
    if name == "bundled":
        from trinity_trl.data import bundled_model_dir

        return {"path": str(bundled_model_dir()), "about": "SmolLM2-135M-Instruct (bundled; Llama, vocab 49152)"}
    tiny = name == "tiny"
    shape = TINY_SHAPE if tiny else MODEL_SHAPES[name]
    vocab = None if tiny else REAL_VOCAB
    path = save_random_qwen2(path, **shape, max_positions=4096, seed=seed, vocab=vocab, device=device, bf16=bf16)
    about = f"random Qwen2 of the {name.replace('qwen', 'Qwen')} shape ({describe_shape(shape, vocab or 489)})"
    return {"path": path, "about": f"{about}{' saved in bf16' if bf16 else ''}, with the tests' tiny tokenizer"}


def describe_shape(s: dict, vocab: int) -> str:
    return (
        f"hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads / {s['kv_heads']} KV, intermediate "
        f"{s['intermediate']}, vocab {vocab}"
    )


# --------------------------------------------------------------------------------------- reports
def write_report(out_dir: str | os.PathLike, name: str, report: dict, markdown: str) -> None:
    """Write ``<name>.json`` and ``<name>.md`` to ``out_dir``, print the Markdown and where both went."""
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown)
    print(markdown)
    print(f"wrote {out / (name + '.json')} and {out / (name + '.md')} ({report['total_wall_s']:.0f} s)")


# ------------------------------------------------------------------------------------ statistics
def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a, b) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def fmt(value, spec: str = ".3f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"
