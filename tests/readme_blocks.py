"""The fenced code blocks of README.md (and docs/*.md) as a test sees them.

Every ```bash and ```python block is either run as written by tests/test_readme.py or carries,
in the lines right above it, a visible note a reader sees:

    > **Not run by the tests:** <why> ...

The test checks that such a note exists and says why; a block with neither fails the suite.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

NOTE = re.compile(r"^> \*\*Not run by the tests:\*\*\s*(?P<why>\S.*)$")
FENCE = re.compile(r"^```(?P<lang>[A-Za-z0-9_+-]*)\s*$")
RUNNABLE = ("bash", "python")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    section: str  # the nearest heading above the block
    note: str | None  # the "Not run by the tests" reason, when the block carries one

    @property
    def name(self) -> str:
        return f"{self.path.name}:{self.line}"


def read_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, in order."""
    lines = Path(path).read_text().split("\n")
    out: list[Block] = []
    section, i = "", 0
    while i < len(lines):
        if lines[i].startswith("#") and not lines[i].startswith("#!"):
            section = lines[i].lstrip("#").strip()
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start + 1}: a code fence is never closed")
        out.append(Block(Path(path), start + 1, m.group("lang"), "\n".join(body) + "\n", section,
                         _note_above(lines, start)))
        i += 1
    return out


def _note_above(lines: list[str], fence: int) -> str | None:
    """The note in the paragraph right above a fence (blank lines and the note's own
    continuation lines may sit between)."""
    j = fence - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    para = []
    while j >= 0 and lines[j].startswith(">"):
        para.append(lines[j])
        j -= 1
    for line in reversed(para):
        m = NOTE.match(line)
        if m:
            return m.group("why")
    return None
