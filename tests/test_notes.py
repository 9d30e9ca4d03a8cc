"""Every ``[Note: ...]`` block in src/partita is referred to from code it explains.

A note that nothing points at is found only by reading the top of its file; a ``See [Note:
<title>]`` where the invariant matters tells the reader of that line that there is more.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "partita"
_DEFINITION = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]", re.MULTILINE)
_WRAP = re.compile(r"\s*\n\s*(?:#\s*)?")


def _texts() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_note_is_referred_to() -> None:
    """Each note title appears at least twice in the package: its block and a reference (a
    reference may wrap across comment or docstring lines)."""
    texts = _texts()
    defined = {
        " ".join(t.split()): name for name, text in texts.items() for t in _DEFINITION.findall(text)
    }
    seen: Counter[str] = Counter()
    for text in texts.values():
        flat = _WRAP.sub(" ", text)
        for title in defined:
            seen[title] += flat.count(f"[Note: {title}]")
    lonely = sorted(
        f"{where}: [Note: {title}]" for title, where in defined.items() if seen[title] < 2
    )
    assert len(defined) >= 20  # the scan finds the notes at all
    assert not lonely, "notes nothing refers to:\n" + "\n".join(lonely)
