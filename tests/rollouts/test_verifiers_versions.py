"""Which verifiers ``VerifiersAgent`` (trinity_trl/rollouts/verifiers.py) takes: the classic environment API of 0.3.x
(covered by tests/rollouts/test_verifiers.py); verifiers 0.4 is refused when the agent is built, naming the version
found and the one needed.

verifiers 0.4.0's package root defines only ``__version__`` (its stack lives in ``verifiers.v1``; ``verifiers.legacy``
is gone). This test lays out a package with that shape and imports it in a fresh interpreter, so it runs whatever
verifiers the environment has (the same check against the real 0.4.0 wheel is in the issue 36 report).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_verifiers_0_4_is_refused_naming_the_version(tmp_path):
    package = tmp_path / "verifiers"
    (package / "v1").mkdir(parents=True)
    (package / "__init__.py").write_text('__version__ = "0.4.0"\n')
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
    assert "classic environment API (verifiers>=0.3.1,<0.4)" in message and "found verifiers 0.4.0" in message
