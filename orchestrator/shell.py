"""The one quoting rule: no inventory value reaches a shell unquoted.

Remote commands are POSIX `sh` scripts built only through these helpers.
Paths keep `~/` meaning the remote user's home (`"$HOME"/'rest'`) while the
rest of the path is single-quoted.
"""

from __future__ import annotations

import shlex
from typing import Iterable, Mapping


def quote(value: object) -> str:
    return shlex.quote(str(value))


def path(p: str) -> str:
    """Quote a path, expanding a leading `~` to the remote $HOME."""
    if p == "~":
        return '"$HOME"'
    if p.startswith("~/"):
        rest = p[2:]
        return '"$HOME"/' + shlex.quote(rest) if rest else '"$HOME"/'
    return shlex.quote(p)


def join(argv: Iterable[object]) -> str:
    return " ".join(quote(a) for a in argv)


def exports(env: Mapping[str, str]) -> str:
    """`export K='v'; ...` for an env mapping whose keys were validated as identifiers."""
    parts = []
    for k, v in env.items():
        if not k.replace("_", "a").isalnum() or k[0].isdigit():
            raise ValueError(f"invalid environment variable name {k!r}")
        parts.append(f"export {k}={quote(v)};")
    return " ".join(parts)


def wrap(script: str) -> str:
    """Run `script` under /bin/sh whatever the login shell is (bash, zsh, fish)."""
    return "exec /bin/sh -c " + quote(script)
