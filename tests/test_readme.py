"""Every Python block of the README runs as written (issue 14 item 1), with only what a GPU machine and the Hub
would change: the model becomes the tiny test model, steps, completions and dataset sizes shrink, and Hub pushes go
to the local fake Hub. A block that breaks (an undefined name, a wrong argument, a renamed API) fails here.

All blocks run in one fresh interpreter (one `import trl` instead of one per block), each in its own namespace and
working directory, in README order.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launching import scaled_timeout

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = [
    (README.read_text()[: m.start()].count("\n") + 1, m.group(1))
    for m in re.finditer(r"```python\n(.*?)```", README.read_text(), re.S)
]

# what changes between a GPU machine with the Hub and this CPU test run
SUBSTITUTIONS = [
    (r'\b(model|teacher_model)="[^"]+"', r"\1=TINY_MODEL"),
    (r"\bmax_steps=\d+", "max_steps=1"),
    (r"\bmax_completion_length=\d+", "max_completion_length=8"),
    (r"\bnum_rows=\d+", "num_rows=16"),
    (r"\bcritic_warmup_steps=\d+", "critic_warmup_steps=0"),  # warm-up must leave steps to train the policy
    (r'hub_model_id="you/', 'hub_model_id="tester/'),
]

RUNNER = """
import json, os, sys, traceback
results = {}
for line, path in json.loads(sys.argv[1]):
    folder = os.path.join(os.path.dirname(path), f"block-{line}")
    os.makedirs(folder, exist_ok=True)
    os.chdir(folder)
    try:
        exec(compile(open(path).read(), f"README.md:{line}", "exec"), {"__name__": "__main__"})
        results[line] = None
    except BaseException:
        results[line] = traceback.format_exc()[-3000:]
print("RESULTS " + json.dumps(results), flush=True)
"""


def adapted(code: str, model_dir: str) -> str:
    for pattern, replacement in SUBSTITUTIONS:
        code = re.sub(pattern, replacement, code)
    return f"TINY_MODEL = {model_dir!r}\n" + code


@pytest.fixture(scope="module")
def readme_model_dir(tmp_path_factory):
    """The tiny model with TRL's stored Qwen2.5 chat template (ChatML that renders tools, as Qwen2.5's own does),
    so the tool-environment block runs as it would with the model it names."""
    import trl.chat_template_utils
    from helpers import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = trl.chat_template_utils.qwen2_5_chat_template
    model = build_tiny_model(tokenizer)
    model.config.max_position_embeddings = 4096  # tool schemas in the prompt are long in the tiny vocabulary
    path = tmp_path_factory.mktemp("readme_model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def block_results(tmp_path_factory, readme_model_dir):
    """Run every block once; ``{line: None or the traceback}`` and the fake Hub that received the pushes."""
    from fake_hub import FakeHub

    tiny_model_dir = readme_model_dir
    root = tmp_path_factory.mktemp("readme")
    scripts = []
    for line, code in BLOCKS:
        path = root / f"block_{line}.py"
        path.write_text(adapted(code, tiny_model_dir))
        scripts.append((line, str(path)))
    hub = FakeHub().start()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": "hf_dummy",
        "HF_HUB_OFFLINE": "0",
        "HF_HOME": str(root / "hf_home"),
    }
    try:
        result = subprocess.run(
            [sys.executable, "-c", RUNNER, json.dumps(scripts)],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=scaled_timeout(1800),
            env=env,
        )
        lines = [x for x in result.stdout.splitlines() if x.startswith("RESULTS ")]
        assert lines, result.stderr[-3000:]
        yield {int(k): v for k, v in json.loads(lines[-1].removeprefix("RESULTS ")).items()}, hub
    finally:
        hub.stop()


def test_the_readme_has_its_quick_starts():
    codes = [code for _, code in BLOCKS]
    assert len(codes) >= 10
    assert 'model="bundled"' in codes[0]  # the first quick start runs offline
    assert not any(re.search(r"[(\\[,=] *\\.\\.\\.", code) for code in codes), (
        "a block with a `...` argument cannot run"
    )


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code, block_results):
    results, hub = block_results
    assert results[line] is None, results[line]
    if "hub_model_id" in code:
        repo = re.search(r'hub_model_id="you/([^"]+)"', code).group(1)
        assert "README.md" in hub.files(f"tester/{repo}")
