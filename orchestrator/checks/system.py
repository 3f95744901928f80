"""clock_skew and disk: `date +%s.%N` and `timedatectl show`; `df -Pk` of workdir and output dir."""

from __future__ import annotations

from orchestrator.checks import Check, CheckResult, Ctx, Probe, fail, first_line, ok, section, skip, warn

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


# ------------------------------------------------------------------ probes and registration

CLOCK = Probe("clock", """echo "@@time"; date +%s.%N
if has timedatectl; then echo "@@timedatectl"; timedatectl show 2>&1; echo "@@rc $?"; fi
""", first=True)

# near(): the nearest existing ancestor (an output dir may not exist before the first run)
DF = Probe("df", r"""near() { d=$1; while [ -n "$d" ] && [ ! -e "$d" ]; do case $d in */*) d=${d%/*} ;; *) d=. ;; esac; done; printf '%s' "${d:-/}"; }
echo "@@df"
printf 'workdir %s\noutput %s\n' "$wd" "$out"
df -Pk "$(near "$wd")" "$(near "$out")" 2>&1
echo "@@rc $?"
""")

CLOCK_SKEW = Check(
    "clock_skew", "the node's clock is within checks.clock_skew_warn/fail of the control machine's",
    "sync the clock: `sudo timedatectl set-ntp true` (chrony/systemd-timesyncd)",
    probes=(CLOCK,), parse=parse_clock_skew)
DISK = Check(
    "disk", "workdir and output dir have checks.disk_min_gb free",
    "free space on the node or lower checks.disk_min_gb",
    probes=(DF,), parse=parse_disk)
