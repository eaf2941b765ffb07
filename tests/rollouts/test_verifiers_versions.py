"""Which verifiers ``VerifiersAgent`` (trinity_trl/rollouts/verifiers.py) takes: the classic environment API of 0.3.x
(tests/rollouts/test_verifiers.py, in .venv) and the v1 stack of 0.4 (tests/rollouts/test_verifiers_v1.py, in the
environment ``make test-verifiers-04`` builds). A verifiers with neither is refused when the agent is built, naming
the version found and the two it takes.

This test lays out a package with neither API (the package root defines only ``__version__``, its ``v1`` is empty)
and imports it in a fresh interpreter, so it runs whatever verifiers the environment has.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_verifiers_without_either_api_is_refused_naming_the_version(tmp_path):
    package = tmp_path / "verifiers"
    (package / "v1").mkdir(parents=True)
    (package / "__init__.py").write_text('__version__ = "0.9.0"\n')
    (package / "v1" / "__init__.py").write_text("")
    code = (
        "from trinity_trl.rollouts.verifiers import VerifiersAgent\n"
        "try:\n"
        "    VerifiersAgent(object())\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    message = out.stdout.strip()
    assert "classic environment API (verifiers>=0.3.1,<0.4) or its v1 Env (verifiers 0.4)" in message
    assert "found verifiers 0.9.0" in message
