"""clock_skew, disk, python_env and code_sync. The last two compare nodes with each other:
`node_python`/`node_code` read one node, `compare_*` decide across the cluster (pure too)."""

from __future__ import annotations

import json
from collections import Counter

from orchestrator.checks import CheckResult, Ctx, fail, first_line, ok, section, skip, warn

# ------------------------------------------------------------------ clock_skew


def parse_timedatectl(text: str) -> dict[str, str]:
    """`timedatectl show`: KEY=value lines (NTPSynchronized=yes, NTP=yes, Timezone=...)."""
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep and k.strip().isidentifier():
            out[k.strip()] = v.strip()
    return out


def skew(node_time: float, t_send: float, t_recv: float) -> tuple[float, float]:
    """NTP-style: the node read its clock somewhere between t_send and t_recv (control clock);
    skew = node - midpoint, uncertainty = rtt / 2."""
    mid = (t_send + t_recv) / 2
    return node_time - mid, (t_recv - t_send) / 2


def parse_clock_skew(text: str, ctx: Ctx) -> CheckResult:
    s = section(text, "time")
    if s is None or ctx.t_send is None or ctx.t_recv is None:
        return skip("clock_skew", "not probed")
    try:
        node_time = float(s.body.strip().splitlines()[0])
    except (ValueError, IndexError):
        return warn("clock_skew", f"unreadable `date +%s.%N` output: {first_line(s.body)!r}")
    off, unc = skew(node_time, ctx.t_send, ctx.t_recv)
    tdc = section(text, "timedatectl")
    ntp = ""
    facts = parse_timedatectl(tdc.body) if tdc is not None and tdc.rc in (0, None) else {}
    if facts.get("NTPSynchronized") == "yes":
        ntp = ", NTP synchronised"
    elif facts.get("NTPSynchronized") == "no":
        ntp = ", NTP not synchronised"
    detail = f"{off:+.3f}s ±{unc:.3f}s vs control{ntp}"
    remedy = (f"sync the clock on {ctx.node.name}: `sudo timedatectl set-ntp true` (chrony/systemd-timesyncd);"
              " skewed clocks break log ordering, NCCL/gloo timeouts and TLS")
    c = ctx.inventory.checks
    # only what the measurement proves: |skew| minus its uncertainty
    proven = max(0.0, abs(off) - unc)
    if proven >= c.clock_skew_fail:
        return fail("clock_skew", detail, remedy)
    if proven >= c.clock_skew_warn:
        return warn("clock_skew", detail, remedy)
    if facts.get("NTPSynchronized") == "no":
        return warn("clock_skew", detail, "`sudo timedatectl set-ntp true`")
    return ok("clock_skew", detail)


# ------------------------------------------------------------------ disk


def parse_df(text: str) -> list[tuple[str, int]]:
    """`df -Pk A B` -> [(mountpoint, free_kib)] in argument order."""
    out = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) >= 6 and f[3].isdigit():
            out.append((f[5], int(f[3])))
    return out


def parse_disk(text: str, ctx: Ctx) -> CheckResult:
    s = section(text, "df")
    if s is None:
        return skip("disk", "not probed")
    lines = s.body.splitlines()
    names = {}
    for ln in lines[:2]:
        k, _, v = ln.partition(" ")
        names[k] = v
    rows = parse_df("\n".join(lines[2:]))
    if len(rows) < 2:
        return warn("disk", f"df failed: {first_line(chr(10).join(lines[2:]))}")
    floor = ctx.inventory.checks.disk_min_gb
    parts, low = [], []
    for (label, path), (mnt, kib) in zip((("workdir", names.get("workdir")), ("output", names.get("output"))), rows):
        gb = kib / 1024 / 1024
        parts.append(f"{label} {gb:.1f} GB free")
        if gb < floor:
            low.append(f"{label} ({path} on {mnt}) {gb:.1f} GB < {floor:g} GB")
    if low:
        return warn("disk", "; ".join(low), f"free space on {ctx.node.name} or lower checks.disk_min_gb")
    return ok("disk", ", ".join(parts) if rows[0][0] != rows[1][0] else parts[0].replace("workdir", "workdir+output"))


# ------------------------------------------------------------------ python_env / code_sync


def node_info(text: str) -> tuple[dict | None, str | None]:
    """The nodeinfo.py JSON of the @@python section, or (None, why not)."""
    s = section(text, "python")
    if s is None:
        return None, "not probed"
    for line in reversed(s.body.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line), None
            except ValueError:
                break
    return None, first_line(s.body) or f"exit code {s.rc}"


ENV_KEYS = ("python", "torch", "cuda", "hip", "nccl")


def env_of(info: dict) -> dict[str, str]:
    return {k: str(info.get(k) or "-") for k in ENV_KEYS}


def env_text(env: dict[str, str]) -> str:
    return " ".join(f"{k} {env[k]}" for k in ENV_KEYS if env.get(k, "-") != "-") or "-"


def _reference(values: dict[str, object], master: str, control: object = None) -> object:
    """The value the others must equal: the control machine's when given, else the most common
    (ties go to the master's)."""
    if control is not None:
        return control
    counts = Counter(values.values())
    top = max(counts.values())
    tied = [v for v, c in counts.items() if c == top]
    return values[master] if values.get(master) in tied else tied[0]


def compare_python_env(texts: dict[str, str], ctx_of: dict[str, Ctx], master: str) -> dict[str, CheckResult]:
    out, envs = {}, {}
    for name, text in texts.items():
        info, why = node_info(text)
        node = ctx_of[name].node
        if info is None:
            out[name] = fail("python_env", f"{node.python} does not run: {why}",
                             f"install Python (and torch) on {name}, or set `python:` for it in the inventory")
        else:
            envs[name] = env_of(info)
            if envs[name]["torch"] == "-":
                out[name] = fail("python_env", f"{env_text(envs[name])}; torch is not installed for {node.python}",
                                 f"`{node.python} -m pip install torch` on {name}")
    if not envs:
        return out
    ref = _reference({k: tuple(sorted(v.items())) for k, v in envs.items()},
                     master if master in envs else next(iter(envs)))
    ref_env = dict(ref)
    for name, env in envs.items():
        if name in out:
            continue
        diff = [k for k in ENV_KEYS if env[k] != ref_env[k]]
        if not diff:
            out[name] = ok("python_env", env_text(env))
        else:
            side = ", ".join(f"{k} {env[k]} (others {ref_env[k]})" for k in diff)
            out[name] = fail("python_env", f"mismatch: {side}",
                             f"install the same versions on {name} ({env_text(ref_env)}); mixed torch/NCCL "
                             "versions hang or crash in the first collective")
    return out


def compare_code_sync(texts: dict[str, str], ctx_of: dict[str, Ctx], master: str,
                      control: dict | None = None) -> dict[str, CheckResult]:
    """Equal workdir digests everywhere, and equal to the control machine's copy when given."""
    out, digests = {}, {}
    for name, text in texts.items():
        info, why = node_info(text)
        wd = ctx_of[name].node.workdir
        code = (info or {}).get("code")
        if info is None or not code:
            out[name] = skip("code_sync", f"no digest: the node's python does not run ({why})")
        elif code.get("kind") == "missing":
            out[name] = fail("code_sync", f"{wd} does not exist", "`clusterctl sync -i <inventory>` pushes it")
        else:
            digests[name] = code
    if not digests:
        return out
    ref = _reference({k: v["digest"] for k, v in digests.items()}, master if master in digests else next(iter(digests)),
                     control.get("digest") if control and control.get("kind") != "missing" else None)
    against = "the control machine's copy" if control and control.get("kind") != "missing" else "the other nodes"
    for name, code in digests.items():
        head = f" (git {code['head']}{', dirty' if code.get('dirty') else ''})" if code.get("head") else ""
        n = code["files"]
        what = f"{n} file{'' if n == 1 else 's'}, digest {code['digest']}{head}"
        if code["digest"] == ref:
            out[name] = ok("code_sync", what)
        else:
            out[name] = fail("code_sync", f"workdir ({what}) differs from {against} (digest {ref})",
                             "push the same code everywhere: `clusterctl sync -i <inventory>`")
    return out
