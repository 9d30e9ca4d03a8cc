"""The documentation holds: the site builds in strict mode, README stays a short front door whose
links all resolve, and the configuration reference is what the schema and its ledger say.

A broken link, a missing anchor, a page left out of mkdocs.yml's nav, or a schema change without
regenerating docs/config.md fails here, so the docs cannot drift from the code unnoticed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_BYTES = 12_288
# Inline Markdown links and images: [text](target) / ![alt](target); the target stops at a space
# (an optional "title" follows) or the closing parenthesis.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _outside_code(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (links there are not links)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def _anchors(markdown_file: Path) -> set[str]:
    """The heading anchors MkDocs (Python-Markdown's toc) gives ``markdown_file``'s headings."""
    from markdown.extensions.toc import slugify, unique

    seen: set[str] = set()
    for line in _outside_code(markdown_file.read_text(encoding="utf-8")).splitlines():
        match = _HEADING.match(line)
        if match:
            # Anchors are made from the heading's text, without its Markdown markup.
            text = re.sub(r"[`*_]", "", match.group(2))
            unique(slugify(text, "-"), seen)
    return seen


def _broken_links(markdown_file: Path, root: Path = ROOT) -> list[str]:
    """``target: why`` for each relative link in ``markdown_file`` that does not resolve
    inside ``root``."""
    broken = []
    for target in _LINK.findall(_outside_code(markdown_file.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (markdown_file.parent / path_part).resolve() if path_part else markdown_file
        if not dest.is_relative_to(root):
            broken.append(f"{target}: leads outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: {dest.relative_to(root)} does not exist")
        elif anchor and (dest.suffix != ".md" or anchor not in _anchors(dest)):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return broken


def test_readme_is_a_short_front_door() -> None:
    """README.md stays at most 12 KiB: details belong on the docs pages it links to."""
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes, over {README_MAX_BYTES}: move the detail to a page under "
        "docs/ and link it"
    )


def test_readme_links_resolve() -> None:
    """Every relative link in README.md names a file in the repository, and every ``#anchor``
    a heading in its target."""
    broken = _broken_links(README)
    assert not broken, "README.md has broken links:\n" + "\n".join(broken)


def test_link_checker_sees_broken_links(tmp_path: Path) -> None:
    """The README check itself fails on a missing file, a missing anchor and a link out of the
    repository, and passes a good link and links inside code."""
    (tmp_path / "repo" / "docs").mkdir(parents=True)
    (tmp_path / "repo" / "docs" / "page.md").write_text("# A page\n\n## Quick start\n")
    probe = tmp_path / "repo" / "README.md"
    probe.write_text(
        "[a](docs/page.md#quick-start) [b](nope.md) [c](docs/page.md#nope) [d](../outside.md) "
        "[e](https://example.com) `[f](gone.md)`\n\n```\n[g](gone.md)\n```\n",
        encoding="utf-8",
    )
    broken = _broken_links(probe, root=tmp_path / "repo")
    assert [b.split(":")[0] for b in broken] == ["nope.md", "docs/page.md#nope", "../outside.md"]


def test_site_builds_in_strict_mode(tmp_path: Path) -> None:
    """``mkdocs build --strict``: no broken link or anchor, no page missing from the nav
    (mkdocs comes with the ``dev`` extra)."""
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml")]
    result = subprocess.run(
        [*cmd, "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=240
    )
    warnings = [line for line in result.stderr.splitlines() if not line.startswith("INFO")]
    assert result.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(warnings)
    assert (tmp_path / "site" / "config" / "index.html").exists()


def test_config_reference_is_generated() -> None:
    """docs/config.md is exactly what `partita.config.reference.render()` writes from the
    schema and the ledger; a change to either without regenerating fails here."""
    from partita.config import reference

    committed = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert committed == reference.render(), (
        "docs/config.md is not what the config schema and ledger generate; regenerate it with "
        f"`{reference.COMMAND}` and commit docs/config.md"
    )
