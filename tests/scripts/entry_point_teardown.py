"""One process of a 2-process gloo group that runs each entry point in turn (tests/test_process_group_teardown.py).

Usage: entry_point_teardown.py RANK STORE_DIR OUT_JSON. For each scenario the process joins a fresh gloo group (a
FileStore of its own, no port), records the barrier and destroy calls of ``torch.distributed``, runs the entry point
as a user's command would (``trinity-trl ...`` is ``trinity_trl.cli.main``, ``python recipes/chord.py ...`` runs the
file as ``__main__``), and records its exit status and whether the group was still alive afterwards. A group left
alive is destroyed here so that the next scenario can start.
"""

import contextlib
import io
import json
import os
import runpy
import sys

import torch.distributed as dist

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BAD_OPTION = ["--no_such_option", "1"]


def trinity_trl(*argv):
    from trinity_trl.cli import main

    return lambda: main(list(argv))


def recipe_script(name, *argv):
    def run():
        sys.argv = [os.path.join(REPO_ROOT, "recipes", f"{name}.py"), *argv]
        runpy.run_path(sys.argv[0], run_name="__main__")

    return run


# scenario -> (what rank 0 runs, what rank 1 runs)
SCENARIOS = {
    "command_success": (trinity_trl("configs"),) * 2,
    "command_user_error": (trinity_trl("chord", *BAD_OPTION),) * 2,
    "demo_user_error": (trinity_trl("demo", *BAD_OPTION),) * 2,
    "script_user_error": (recipe_script("chord", *BAD_OPTION),) * 2,
    "one_process_fails": (trinity_trl("configs"), trinity_trl("cispo", *BAD_OPTION)),
}


def main():
    rank, store_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    calls = []
    for name in ("barrier", "monitored_barrier", "destroy_process_group"):
        original = getattr(dist, name)

        def recording(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, recording)
    results = {}
    for scenario, runs in SCENARIOS.items():
        store = dist.FileStore(os.path.join(store_dir, scenario), 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        calls.clear()
        code = 0
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                runs[rank]()
            except SystemExit as exit_:
                code = exit_.code
        alive = dist.is_initialized()
        results[scenario] = {"exit": code, "calls": list(calls), "alive_after": alive, "stderr": err.getvalue()}
        if alive:
            dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
