"""A requirements file's previous resolution, for an edit of the file to start from.

resolve.py keeps, per file and target, the key of the last wheelhouse it resolved or found
(ROOT/latest/<hash16 of the file's path and the target>), and each lock.json keeps what it was
resolved from (`Source`). When adding requirement lines is the only edit since (wheels.added_lines),
the new resolution starts from that wheelhouse: pip sees only the added lines, with the options
they need from the file, and every previous pin as a constraint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from orchestrator.pyenv.wheels import added_lines

INCLUDE = re.compile(r"^\s*(-r|-c|--requirement|--constraint)[\s=]+(\S+)")


@dataclass(frozen=True)
class Source:
    """What a resolution was made from: the file's text, the digest of the files it includes
    (-r, -c), and the requirements of the wheel made here (None: none was added)."""

    text: str
    nested: str
    add: list[str] | None

    def to_json(self) -> dict:
        return {"text": self.text, "nested": self.nested, "add": self.add}


def pointer(root: Path, req: Path, target_key: str) -> Path:
    return root / "latest" / hashlib.sha256(f"{req.resolve()}\0{target_key}".encode()).hexdigest()[:16]


def remember(root: Path, req: Path, target_key: str, key: str) -> None:
    """`key` is the file's latest resolution for this target."""
    path = pointer(root, req, target_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    tmp.write_text(key + "\n")
    os.replace(tmp, path)


def previous(root: Path, req: Path, target_key: str, now: Source, lock_format: int
             ) -> tuple[Path, list[str]] | None:
    """(the wheelhouse of the file's previous resolution, the lines added since) when adding
    lines is the only edit of the file, the files it includes are the same, and so are the
    requirements of the wheel made here; None otherwise (the whole file is resolved)."""
    try:
        d = root / pointer(root, req, target_key).read_text().strip()
        doc = json.loads((d / "lock.json").read_text())
    except (OSError, ValueError):
        return None
    src = doc.get("source") or {}
    if doc.get("format") != lock_format or src.get("nested") != now.nested or src.get("add") != now.add:
        return None
    added = added_lines(src.get("text", ""), now.text)
    return (d, added) if added is not None else None


def added_file(text: str, added: list[str], base: Path) -> str:
    """A requirements file of the added lines with the options of the file they were added to
    (indexes, find-links, included files: relative paths made absolute against `base`, the
    file's directory, since this one is read from elsewhere)."""
    opts = [_absolute(ln.strip(), base) for ln in text.splitlines() if ln.strip().startswith("-")]
    return "".join(f"{ln}\n" for ln in opts + added)


def _absolute(line: str, base: Path) -> str:
    m = INCLUDE.match(line)
    if not m or "://" in m.group(2) or os.path.isabs(os.path.expanduser(m.group(2))):
        return line
    return f"{m.group(1)} {base / os.path.expanduser(m.group(2))}"
