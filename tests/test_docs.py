"""The docs (docs/, built by `make docs` with `mkdocs build --strict`, which checks the links between pages): the
README stays short and links only to pages that exist, and every docs section the code cites exists.
"""

from __future__ import annotations

import os
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


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    """The docs site, built once for this module with the strict build ``make docs`` runs, into a temporary folder."""
    import subprocess
    import sys

    site = tmp_path_factory.mktemp("site")
    mkdocs = Path(sys.executable).parent / "mkdocs"
    result = subprocess.run(
        [str(mkdocs), "build", "--strict", "--quiet", "-d", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return site


# markup that did not render: a Hugging Face doc-builder reference (`[`TrinityConfig`]`, `[`~trl.GRPOTrainer`]`), a
# bare `[ClassName]` (not Python's True / False / None, written as defaults in brackets), a `<Tip>` block or a Sphinx
# role (`:class:`Name``), all of which mkdocs shows as literal text
LITERAL_MARKUP = re.compile(
    r"\[<code>~?[\w.]+</code>\]|\[~[\w.]+\]|\[(?!(?:True|False|None)\])[A-Z]\w*(?:\.\w+)*\]"
    r"|&lt;/?Tip\b|<Tip\b|:(?:class|func|meth|mod|attr|data|obj|exc):<code>"
)


def literal_markup(html: str) -> list[str]:
    """The unrendered markup in a built page, outside code blocks and inline code (which show code as written)."""
    html = re.sub(r"<(pre|script)\b.*?</\1>", "", html, flags=re.S)
    html = re.sub(r"(?<!\[)<code>.*?</code>(?!\])", "<code></code>", html, flags=re.S)
    return LITERAL_MARKUP.findall(html)


def test_the_literal_markup_check_finds_what_does_not_render():
    page = (
        "<p>See [<code>TrinityConfig</code>] and [<code>~trl.GRPOTrainer</code>], [ChordTrainer], [~datasets.Dataset]"
        ", :class:<code>Environment</code>.</p>&lt;Tip warning={true}&gt;"
        "<pre><code>[TrinityConfig] stays: code</code></pre><p><code>x[Name]</code> [False] [mul, div] [a]</p>"
    )
    assert literal_markup(page) == [
        "[<code>TrinityConfig</code>]",
        "[<code>~trl.GRPOTrainer</code>]",
        "[ChordTrainer]",
        "[~datasets.Dataset]",
        ":class:<code>",
        "&lt;Tip",
    ]


def test_the_built_docs_hold_no_unrendered_references_or_tips(built_site):
    """The API pages render docstrings: their cross-references must be links (mkdocstrings' `[`Name`][]`) and their
    notes admonitions (`Warning:`), never Hugging Face doc-builder or Sphinx markup shown as text."""
    found = {
        str(page.relative_to(built_site)): hits
        for page in sorted(built_site.rglob("*.html"))
        if (hits := literal_markup(page.read_text(encoding="utf-8")))
    }
    assert not found, found
    trainers = (built_site / "api" / "trainers" / "index.html").read_text(encoding="utf-8")
    assert 'href="#trinity_trl.trainers.TrinityConfig"><code>TrinityConfig</code></a>' in trainers
    assert (
        'href="https://huggingface.co/docs/trl/grpo_trainer#trl.GRPOTrainer"><code>GRPOTrainer</code></a>' in trainers
    )
    assert '<details class="warning" open>' in trainers  # CISPOConfig's warning on TRL's absolute cap


def test_the_api_reference_renders_its_type_cells(built_site):
    """A "Type" cell holds a type (mkdocstrings renders it as code), never the TRL-style markdown of the docstring
    it came from (`` `float`, *optional*, defaults to `1.0` ``; docs/griffe_trl_types.py rewrites it)."""
    trainers = (built_site / "api" / "trainers" / "index.html").read_text(encoding="utf-8")
    cells = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td>\s*<code>(.*?)</code>\s*</td>", trainers, re.S)]
    raw = [c for c in cells if "`" in c or "*optional*" in c or "defaults to" in c]
    assert not raw, raw
    # TrinityConfig's first field: its type, and its default moved to the description
    assert "str | dict | Component | None" in cells and "*optional*" not in trainers
    assert "Defaults to" in trainers


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
