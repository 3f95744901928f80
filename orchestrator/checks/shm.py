"""shm: the size of /dev/shm. NCCL keeps its intra-node buffers there and DataLoader workers pass
batches through it; a container's default 64 MiB makes both crash ("Bus error", "No space left
on device" in NCCL's shm transport) once a real model trains."""

from __future__ import annotations

from orchestrator.checks import Check, CheckResult, Ctx, Probe, fail, first_line, ok, section, skip, warn

FAIL_MIB = 64  # the Docker default: fails at the first real batch
WARN_MIB = 1024  # enough for NCCL on a few GPUs; DataLoader workers with big batches want more

REMEDY = ("give /dev/shm more memory: `docker run --shm-size=16g` (Kubernetes: an emptyDir with "
          "`medium: Memory` mounted on /dev/shm), or on a host `sudo mount -o remount,size=16G /dev/shm`")


def _mib(kib: int) -> str:
    return f"{kib / 1024 / 1024:.1f} GiB" if kib >= 1024 * 1024 else f"{kib // 1024} MiB"


def parse_shm(text: str, ctx: Ctx) -> CheckResult:
    s = section(text, "shm")
    if s is None:
        return skip("shm", "not probed")
    rows = [ln.split() for ln in s.body.splitlines()[1:]]
    row = next((f for f in rows if len(f) >= 6 and f[1].isdigit() and f[3].isdigit()), None)
    if s.rc not in (0, None) or row is None:
        return warn("shm", f"no /dev/shm to measure: {first_line(s.body) or f'df exited {s.rc}'}",
                    "NCCL and DataLoader workers need a shared-memory tmpfs on /dev/shm; " + REMEDY)
    size, free = int(row[1]), int(row[3])
    detail = f"/dev/shm {_mib(size)} ({_mib(free)} free)"
    where = f" on {ctx.node.name}"
    if size <= FAIL_MIB * 1024:
        return fail("shm", f"{detail}: NCCL and DataLoader workers crash with so little",
                    REMEDY.replace("give /dev/shm", f"give /dev/shm{where}", 1))
    if size < WARN_MIB * 1024:
        return warn("shm", f"{detail}: below {WARN_MIB // 1024} GiB", REMEDY.replace("give /dev/shm", f"give /dev/shm{where}", 1))
    if free <= FAIL_MIB * 1024:
        return fail("shm", f"{detail}: full (a leftover run's segments?)",
                    f"remove stale files in /dev/shm{where} (`ls -la /dev/shm`)")
    if free < WARN_MIB * 1024:
        return warn("shm", f"{detail}: less than {WARN_MIB // 1024} GiB free",
                    f"remove stale files in /dev/shm{where} (`ls -la /dev/shm`)")
    return ok("shm", detail)


SHM_PROBE = Probe("shm", """echo "@@shm"; df -Pk /dev/shm 2>&1; echo "@@rc $?"
""")

SHM = Check(
    "shm", f"/dev/shm holds at least {WARN_MIB // 1024} GiB (fails at {FAIL_MIB} MiB, the Docker default)",
    REMEDY, probes=(SHM_PROBE,), parse=parse_shm, fast=True)
