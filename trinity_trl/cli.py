"""The ``trinity-trl`` command: ``trinity-trl <recipe> [--config FILE|NAME] [--option value ...]``.

    trinity-trl chord --config chord_cpu                # a bundled example config
    trinity-trl cispo --config my.yaml --max_steps 100  # your YAML plus overrides
    trinity-trl train --algorithm rloo
    trinity-trl demo                                    # CHORD + LoRA on the bundled model and task (CPU)
    trinity-trl configs                                 # list the bundled configs
"""

from __future__ import annotations

import importlib
import sys

from .recipes import RECIPES, bundled_configs, config_path

DEMO_CONFIG = "chord_cpu"


def _usage() -> str:
    lines = ["usage: trinity-trl <recipe> [--config FILE|NAME] [--option value ...]", "", "recipes:"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in RECIPES.items()]
    lines += [f"  {'demo':<10} CHORD + LoRA on the bundled SmolLM2-135M and arithmetic task ({DEMO_CONFIG})",
              f"  {'configs':<10} list the bundled example configs", "",
              "`trinity-trl <recipe> --help` lists every option of that recipe."]
    return "\n".join(lines)


def _resolve_config(argv: list[str]) -> list[str]:
    argv = list(argv)
    for i, token in enumerate(argv):
        if token == "--config" and i + 1 < len(argv):
            argv[i + 1] = config_path(argv[i + 1])
        elif token.startswith("--config="):
            argv[i:i + 1] = ["--config", config_path(token.split("=", 1)[1])]
    return argv


def main(argv: list[str] | None = None) -> None:
    """The console script: runs the recipe and returns nothing (a return value would become the exit status)."""
    run(argv)


def run(argv: list[str] | None = None):
    """Run a recipe; returns its trainer (``None`` for the listing commands)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return None
    command, rest = argv[0], argv[1:]
    if command == "configs":
        print("\n".join(bundled_configs()))
        return None
    if command == "demo":
        command, rest = "chord", ["--config", DEMO_CONFIG] + rest
    if command not in RECIPES:
        print(f"trinity-trl: unknown recipe {command!r}\n\n{_usage()}", file=sys.stderr)
        raise SystemExit(2)
    module = importlib.import_module(f"trinity_trl.recipes.{RECIPES[command][0]}")
    return module.main(_resolve_config(rest))


if __name__ == "__main__":
    main()
