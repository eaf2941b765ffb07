"""The ``trinity-trl`` command: ``trinity-trl <recipe> [--config FILE|NAME] [--option value ...]``.

    trinity-trl chord --config chord_cpu                # a bundled example config
    trinity-trl cispo --config my.yaml --max_steps 100  # your YAML plus overrides
    trinity-trl train --algorithm rloo
    trinity-trl demo                                    # CHORD + LoRA on the bundled model and task (CPU)
    trinity-trl configs                                 # the bundled configs: recipe, model, task, steps, measured

A mistake in the command line or a config (unknown recipe, config or option, an invalid combination)
prints one line and exits with status 2; ``--debug`` shows the traceback instead. ``trinity-trl --version``
prints the installed version.
"""

from __future__ import annotations

import difflib
import importlib
import sys

DEMO_CONFIG = "chord_cpu"
DEMO_OUTPUT_DIR = "outputs/demo-chord-smollm2"
# errors a user can fix from the command line or the config (anything else is an internal error: traceback)
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, ImportError)


def _usage() -> str:
    from .recipes import RECIPES

    lines = [
        "usage: trinity-trl <recipe> [--config FILE|NAME] [--option value ...] [--debug]",
        "       trinity-trl --version",
        "",
        "recipes:",
    ]
    lines += [f"  {name:<10} {text}" for name, (_, text) in RECIPES.items()]
    lines += [
        f"  {'demo':<10} CHORD + LoRA on the bundled SmolLM2-135M and arithmetic task ({DEMO_CONFIG}, "
        f"into {DEMO_OUTPUT_DIR})",
        f"  {'configs':<10} the bundled example configs",
        "",
        "`trinity-trl <recipe> --help` shows that recipe's options (--help-all: every option).",
    ]
    return "\n".join(lines)


#: the width `trinity-trl configs` fits in
CONFIGS_WIDTH = 100


def _configs_table() -> str:
    """One row per bundled config (config, recipe, model, task, steps), then its measured result and purpose
    wrapped beneath it, all within `CONFIGS_WIDTH` columns."""
    import textwrap

    from .recipes import bundled_configs, config_summary

    summaries = {name: config_summary(name) for name in bundled_configs()}
    rows = [("config", "recipe", "model", "task", "steps")]
    rows += [(name, s["recipe"], s["model"], s["task"], s["steps"]) for name, s in summaries.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def row_line(row) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()

    lines = [row_line(rows[0]), "    (measured: the held-out metric before -> after one run of the config as shipped)"]
    for row in rows[1:]:
        lines.append(row_line(row))
        summary = summaries[row[0]]
        for label in ("measured", "purpose"):
            lines += textwrap.wrap(
                summary[label] or "-",
                width=CONFIGS_WIDTH,
                initial_indent=f"    {label + ':':<10}",
                subsequent_indent=" " * 14,
                break_on_hyphens=False,
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """The console script: runs the recipe; exits 0 on success, 2 on a usage error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if a != "--debug"), "<none>")
    exit_on_user_error(run, argv, f"trinity-trl {command}")


def exit_on_user_error(function, argv: list[str], prog: str):
    """``function(argv)``; a user error (`USER_ERRORS`) becomes one line ``<prog>: error: ...`` on stderr and
    exit status 2, unless ``argv`` holds ``--debug`` (then it propagates with its traceback). Any other exception
    is a bug and keeps its traceback. The ``trinity-trl`` command and the recipe scripts both go through here, so
    under a launcher every process then ends its process group (a barrier, then ``destroy_process_group``,
    `trinity_trl.distributed.ending_process_group`): on success, on a user error and on a bug alike."""
    from .distributed import ending_process_group

    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    with ending_process_group():
        try:
            return function(argv)
        except USER_ERRORS as err:
            if debug:
                raise
            text = " ".join(str(err).split()) or type(err).__name__
            print(f"{prog}: error: {text} (--debug shows the traceback)", file=sys.stderr)
            raise SystemExit(2) from None


def version() -> str:
    """The installed package's version."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("trinity-trl")
    except PackageNotFoundError:  # a source checkout that was never installed
        return "unknown (not installed)"


def run(argv: list[str] | None = None):
    """Run a recipe; returns its trainer (``None`` for the listing commands). Usage errors raise."""
    from .recipes import RECIPES
    from .recipes.common import UsageError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(_usage(), file=sys.stderr)
        raise SystemExit(2)
    if argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return None
    if argv[0] in ("-V", "--version"):
        print(f"trinity-trl {version()}")
        return None
    command, rest = argv[0], argv[1:]
    if command == "configs":
        print(_configs_table())
        return None
    if command == "demo":
        command, rest = (
            "chord",
            ["--config", DEMO_CONFIG, "--output_dir", DEMO_OUTPUT_DIR, "--overwrite_output_dir", "true", *rest],
        )
    if command not in RECIPES:
        close = difflib.get_close_matches(command, [*RECIPES, "demo", "configs"], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"unknown recipe {command!r}{hint}; recipes: {', '.join(RECIPES)}, demo, configs")
    module = importlib.import_module(f"trinity_trl.recipes.{RECIPES[command][0]}")
    return module.main(rest)


if __name__ == "__main__":
    main()
