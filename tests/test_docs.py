"""The docs (docs/, built by `make docs` with `mkdocs build --strict`, which checks the links between pages): the
README stays short and links only to pages that exist, and every docs section the code cites exists.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
CITING = ["trinity_trl", "recipes", "tests", "benchmarks"]
# a cited docs section: the docs folder, a page path, an optional #anchor (built so this file does not cite itself)
CITATION = re.compile("docs" + r"/([\w./-]+\.md)(?:#([\w-]+))?")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*(?:\{\s*#([\w-]+)\s*\})?\s*$")


def slugify(text: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading without an explicit ``{ #id }``."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    found, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else HEADING.match(line)
        if match:
            found.add(match.group(2) or slugify(match.group(1)))
    return found


def citations() -> list[tuple[str, str, str | None]]:
    """``(where, page, anchor)`` for every docs section cited in the code, the tests and the benchmarks."""
    cited = []
    for folder in CITING:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in {".py", ".md", ".yaml", ".yml", ".txt"} or not path.is_file():
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                for match in CITATION.finditer(line):
                    cited.append((f"{path.relative_to(ROOT)}:{number}", match.group(1), match.group(2)))
    return cited


def test_the_readme_is_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300


def test_the_readme_links_to_pages_that_exist():
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([\w-]+))?\)", README.read_text())
    assert links, "the README links to no docs page"
    for target, anchor in links:
        page = ROOT / target
        assert page.is_file(), f"README links to {target}, which does not exist"
        if anchor:
            assert anchor in anchors(page), f"README links to {target}#{anchor}: no such heading"


def test_the_helpers_read_headings_and_citations():
    # the anchor rules the citations rely on, on a page whose headings are known
    page_anchors = anchors(DOCS / "algorithms" / "policy-losses.md")
    assert {"cispo", "ppo", "sequence-masking"} <= page_anchors
    assert slugify("Any preset: `TrinityTrainer`") == "any-preset-trinitytrainer"
    assert CITATION.findall("see " + "docs" + "/algorithms/kl.md#kl-loss.") == [("algorithms/kl.md", "kl-loss")]


@pytest.mark.parametrize("where, page, anchor", citations())
def test_every_cited_docs_section_exists(where, page, anchor):
    path = DOCS / page
    assert path.is_file(), f"{where} cites docs/{page}, which does not exist"
    if anchor:
        assert anchor in anchors(path), f"{where} cites docs/{page}#{anchor}: no such heading on that page"


def test_the_docs_build_fails_on_a_broken_anchor(tmp_path):
    """`make docs` runs the strict build as the Makefile writes it (a `--quiet` there once let warnings pass): on a
    copy of the docs with one link to a missing heading, it must fail and name that link."""
    import shutil
    import subprocess
    import sys

    recipe = re.search(r"^docs:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    command = recipe.replace("$(VENV)/bin/", str(Path(sys.executable).parent) + "/")
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "trinity_trl").symlink_to(ROOT / "trinity_trl")  # the API pages read the package's source
    with (tmp_path / "docs" / "index.md").open("a") as page:
        page.write("\nSee [the KL loss](algorithms/kl.md#no-such-heading).\n")
    result = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "no-such-heading" in result.stdout + result.stderr


def fenced_blocks(path: Path, language: str) -> list[tuple[int, str]]:
    """``(start offset, dedented code)`` of every ```language block of a Markdown file (indented ones included)."""
    import textwrap

    text = path.read_text()
    pattern = rf"^([ \t]*)```{language}\n(.*?)^\1```"
    return [(m.start(), textwrap.dedent(m.group(2))) for m in re.finditer(pattern, text, re.M | re.S)]


def removed_config_fields() -> set[str]:
    """The config fields of 0.1 that 0.2 removed (each config's ``removed_spellings``, CHANGELOG.md)."""
    import trinity_trl.trainers as trainers

    found = set()
    for name in trainers.__all__:
        found |= set(getattr(getattr(trainers, name), "removed_spellings", {}))
    return found


PAGES = [README, *sorted(DOCS.rglob("*.md"))]


def test_no_yaml_or_command_line_example_uses_a_removed_field():
    """The Python blocks are run (tests/test_readme.py), so a removed spelling fails them; the YAML and shell blocks
    are read: none sets a field of 0.1 (`policy_loss_fn:`, `--sapo_form`, ...)."""
    deprecated = removed_config_fields()
    assert {"policy_loss_fn", "kl_loss_fn_args", "sapo_form", "advantage_epsilon", "clip_range_high"} <= deprecated
    for page in PAGES:
        for _, code in fenced_blocks(page, "yaml"):
            keys = set(re.findall(r"^(\w+):", code, re.M))
            assert not keys & deprecated, f"{page.relative_to(ROOT)}: a YAML example sets {sorted(keys & deprecated)}"
        for _, code in fenced_blocks(page, "bash"):
            options = set(re.findall(r"(?<![\w-])--(\w+)(?![\w.])", code))
            assert not options & deprecated, f"{page.relative_to(ROOT)}: a command sets {sorted(options & deprecated)}"


def test_a_config_file_shown_is_the_shipped_one():
    """A YAML block introduced as `recipes/configs/NAME.yaml` holds only settings of that file, with its values."""
    import yaml

    shown = 0
    for page in PAGES:
        text = page.read_text()
        for start, code in fenced_blocks(page, "yaml"):
            named = re.findall(r"recipes/configs/(\w+)\.yaml", text[max(0, start - 300) : start])
            if not named:
                continue
            shipped = yaml.safe_load((ROOT / "recipes" / "configs" / f"{named[-1]}.yaml").read_text())
            example = yaml.safe_load(code)
            differ = {k: v for k, v in example.items() if shipped.get(k, object()) != v}
            assert not differ, f"{page.relative_to(ROOT)} shows {named[-1]}.yaml with {differ}, not as shipped"
            shown += 1
    assert shown, "no page shows a bundled config"
