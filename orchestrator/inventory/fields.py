"""The inventory's base model and the value checks its sections share."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict

ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?\Z")


def excerpt(value: Any, limit: int = 60) -> str:
    """A value as an error message may quote it: repr (control characters escaped), cut short."""
    if isinstance(value, str):
        return repr(value if len(value) <= limit else value[:limit - 3] + "...")
    text = repr(value) if isinstance(value, (int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _Model(BaseModel):
    """Strict: a YAML boolean is never a number or a string, a number never a string."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _check_path(v: str | None) -> str | None:
    if v is None:
        return v
    if not v or "\x00" in v or "\n" in v:
        raise ValueError("must be a non-empty path on one line")
    if v.startswith("~") and not (v == "~" or v.startswith("~/")):
        raise ValueError("'~user' paths are not supported; use an absolute path or ~/...")
    return v


def _check_env(v: dict[str, Any]) -> dict[str, str]:
    out = {}
    for k, val in v.items():
        if not ENV_KEY_RE.match(str(k)):
            raise ValueError(f"environment variable name {excerpt(k)} is not a valid identifier")
        if isinstance(val, bool):
            raise ValueError(f"environment variable {k} is a YAML boolean; quote the text you mean "
                             f"(\"1\", \"true\")")
        if not isinstance(val, (str, int, float)):
            raise ValueError(f"environment variable {k} must be a string or number")
        out[str(k)] = str(val)
    return out
