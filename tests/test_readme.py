"""Every Python block of the README and of the docs pages (docs/**/*.md) runs as written (issue 14 item 1, issue 26
item 6), with only what a GPU machine and the Hub would change: the model becomes the tiny test model, steps,
completions and dataset sizes shrink, and Hub pushes go to the local fake Hub. A block that breaks (an undefined name,
a wrong argument, a renamed API) fails here. A ```py block is a template (the reader's own paths and objects): it
must compile.

All blocks run in one fresh interpreter (one `import trl` instead of one per block), each in its own namespace and
working directory, README first, then the docs pages in path order. A block that appears on several pages (the
README's quick starts are repeated on the trainers' pages) runs once and counts for each page.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
from launching import scaled_timeout

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(line, code)`` of every ```python block of a Markdown file."""
    text = path.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


# ("README.md:12" or "docs/trainers/chord.md:30", code), in run order
BLOCKS = [(f"{path.relative_to(ROOT)}:{line}", code) for path in PAGES for line, code in python_blocks(path)]
README_BLOCKS = [code for name, code in BLOCKS if name.startswith("README.md:")]
# one run per distinct block, named after its first place, in run order
FIRST_PLACE: dict[str, str] = {}
for _name, _code in BLOCKS:
    FIRST_PLACE.setdefault(_code, _name)
UNIQUE_BLOCKS = list(FIRST_PLACE.items())

# what changes between a GPU machine with the Hub and this CPU test run
SUBSTITUTIONS = [
    (r'\b(model|teacher_model)="[^"]+"', r"\1=TINY_MODEL"),
    (r"\bmax_steps=\d+", "max_steps=1"),
    (r"\bmax_completion_length=\d+", "max_completion_length=8"),
    (r"\bmax_tokens=\d+", "max_tokens=8"),  # an agent's request may ask for max_completion_length tokens at most
    (r"\bnum_rows=\d+", "num_rows=16"),
    (r"\bcritic_warmup_steps=\d+", "critic_warmup_steps=0"),  # warm-up must leave steps to train the policy
    (r'hub_model_id="you/', 'hub_model_id="tester/'),
    (r'tool_chat_template\("[^"]+"\)', "tool_chat_template(TINY_MODEL)"),  # the tokenizer of the block's model
]

# trinity_trl's FutureWarning for a deprecated spelling ("X: old is deprecated and will be removed in the next release;
# write ...") fails the block, so the docs teach only the current spelling (0.2 has none: its removed spellings are
# errors, see test_a_removed_spelling_fails_its_block)
DEPRECATION = r"\w+: .* deprecated and will be removed in the next release"

RUNNER = """
import json, os, sys, traceback, warnings
warnings.filterwarnings("error", message=sys.argv[2], category=FutureWarning)
results = {}
for name, path in json.loads(sys.argv[1]):
    folder = os.path.join(os.path.dirname(path), "run-" + os.path.basename(path)[:-3])
    os.makedirs(folder, exist_ok=True)
    os.chdir(folder)
    try:
        exec(compile(open(path).read(), name, "exec"), {"__name__": "__main__"})
        results[name] = None
    except BaseException:
        results[name] = traceback.format_exc()[-3000:]
print("RESULTS " + json.dumps(results), flush=True)
"""


def run_blocks(scripts: list[tuple[str, str]], cwd: Path, env: dict[str, str]) -> dict[str, str | None]:
    """Run the ``(name, path)`` scripts in one fresh interpreter; ``{name: None or the traceback}``."""
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(scripts), DEPRECATION],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=scaled_timeout(1800),
        env=env,
    )
    lines = [x for x in result.stdout.splitlines() if x.startswith("RESULTS ")]
    assert lines, result.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULTS "))


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
    """Run every distinct block once; ``{code: None or the traceback}`` and the fake Hub that received the pushes."""
    from fake_hub import FakeHub

    tiny_model_dir = readme_model_dir
    root = tmp_path_factory.mktemp("readme")
    scripts = []
    for index, (code, name) in enumerate(UNIQUE_BLOCKS):
        path = root / f"block_{index}.py"
        path.write_text(adapted(code, tiny_model_dir))
        scripts.append((name, str(path)))
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
        by_name = run_blocks(scripts, root, env)
        yield {code: by_name[name] for code, name in UNIQUE_BLOCKS}, hub
    finally:
        hub.stop()


def test_the_readme_has_a_quick_start_per_trainer():
    assert 'model="bundled"' in README_BLOCKS[0]  # the first quick start runs offline
    for trainer in (
        "ChordTrainer",
        "CISPOTrainer",
        "SAPOTrainer",
        "StepGRPOTrainer",
        "TrinityTrainer",
        "PPOTrainer",
        "TrinitySFTTrainer",
        "TrinityDPOTrainer",
    ):
        assert any(f"{trainer}(" in code for code in README_BLOCKS), f"no README quick start builds {trainer}"


def test_the_tool_environment_block_runs_on_the_bundled_model():
    """The README's TRL tool-environment block names the bundled model and gives it a tool-rendering chat template
    (issue 27 item 6); test_block_runs runs it."""
    assert any('model="bundled"' in code and 'tool_chat_template("bundled")' in code for code in README_BLOCKS)


def code_without_comments(code: str) -> str:
    """``code`` with its comments removed (a comment may elide what the code may not)."""
    tokens = tokenize.generate_tokens(io.StringIO(code).readline)
    return tokenize.untokenize((t.type, t.string) for t in tokens if t.type != tokenize.COMMENT)


def test_every_block_runs_on_the_tiny_model():
    """A block names its model by keyword (``model="bundled"``), so the substitution above gives it the tiny test model:
    a positional ``"bundled"`` trained the real SmolLM2-135M with full fine-tuning inside the blocks' interpreter
    (docs/asynchronous.md's multi-step block: 2.7 GB more resident memory, kept for the rest of the run)."""
    for name, code in BLOCKS:
        assert '"bundled"' not in adapted(code, "/tiny"), f"{name}: give the model as model=..., so the test swaps it"


def test_no_block_has_an_elided_argument():
    for name, code in BLOCKS:
        elided = re.search(r"[(\[,=] *\.\.\.", code_without_comments(code))
        assert not elided, f"{name}: a block with a `...` argument cannot run"


def test_the_elided_argument_check_sees_code_and_not_comments():
    assert re.search(r"[(\[,=] *\.\.\.", code_without_comments("f(model=...)\n"))
    assert not re.search(r"[(\[,=] *\.\.\.", code_without_comments("f(1)  # as f(x=...)\n"))


# A ```py block is a template: it names the reader's own paths and objects, so it cannot run here; it must compile.
TEMPLATES = [
    (f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}", m.group(1))
    for path in PAGES
    for text in [path.read_text()]
    for m in re.finditer(r"```py\n(.*?)```", text, re.S)
]


@pytest.mark.parametrize("name, code", TEMPLATES, ids=[name for name, _ in TEMPLATES])
def test_a_template_block_compiles(name, code):
    compile(code, name, "exec")


@pytest.mark.parametrize("name, code", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_block_runs(name, code, block_results):
    results, hub = block_results
    assert results[code] is None, results[code]
    if "hub_model_id" in code:
        repo = re.search(r'hub_model_id="you/([^"]+)"', code).group(1)
        assert "README.md" in hub.files(f"tester/{repo}")


def test_a_removed_spelling_fails_its_block(tmp_path):
    """A block with a spelling of 0.1 fails with the new spelling named; the same block with the new spelling runs."""
    blocks = {
        "old_component": 'TrinityConfig(output_dir="o", policy_loss_fn="ppo", policy_loss_fn_args={"clip_range": 0.3})',
        "old_cispo_field": 'CISPOConfig(output_dir="o", clip_range_high=0.3)',
        "new": 'CISPOConfig(output_dir="o", policy_loss={"clip_range_high": 0.3})',
    }
    scripts = []
    for name, call in blocks.items():
        path = tmp_path / f"{name}.py"
        path.write_text(f"from trinity_trl.trainers import CISPOConfig, TrinityConfig\n{call}\n")
        scripts.append((name, str(path)))
    results = run_blocks(scripts, tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert results["new"] is None, results["new"]
    for name in ("old_component", "old_cispo_field"):
        assert results[name] is not None and "was removed in trinity_trl 0.2; write policy_loss=" in results[name]
