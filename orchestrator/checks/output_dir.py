"""output_dir: a real write, fsync and delete of a small file in the run's output directory
(where the trainer writes checkpoints), so a read-only mount or a directory owned by another
user stops `clusterctl train` before any process starts, not at the first checkpoint.

A directory that does not exist yet is tested at its nearest existing ancestor: that is where
the trainer's makedirs creates it, so the same write permission and filesystem decide."""

from __future__ import annotations

from orchestrator.checks import Check, CheckResult, Ctx, Probe, fail, first_line, ok, section, skip

TIMEOUT_S = 20  # a hung network mount must not hold the whole probe


def parse_output_dir(text: str, ctx: Ctx) -> CheckResult:
    s = section(text, "output-dir")
    if s is None:
        return skip("output_dir", "not probed")
    target = s.arg or "the output directory"
    lines = s.body.splitlines()
    tested = lines[0].strip() if lines else target
    why = first_line("\n".join(lines[1:])) or f"exit code {s.rc}"
    under = "" if tested.rstrip("/") == target.rstrip("/") else f" in {tested} (where it will be created)"
    remedy = (f"make {target} writable for the SSH user on {ctx.node.name} (`chmod u+w`, `chown`), remount "
              "its filesystem read-write, or point `output_dir:` in the inventory elsewhere")
    if s.rc == 124:
        return fail("output_dir", f"writing to {tested} hung for {TIMEOUT_S}s (a stale network mount?)", remedy)
    if s.rc not in (0, None):
        return fail("output_dir", f"cannot write to {tested}{under}: {why}", remedy)
    return ok("output_dir", f"{target} writable: a file written, fsynced and deleted{under}")


# The test file's name carries the shell's pid: two preflights at once do not collide.
WRITE = Probe("output-dir", r"""echo "@@output-dir $out"
d=$out
while [ -n "$d" ] && [ ! -e "$d" ]; do case $d in */*) d=${d%/*} ;; *) d=. ;; esac; done
d=${d:-/}
echo "$d"
t=""
if has timeout; then t="timeout @@TIMEOUT@@"; fi
if [ ! -d "$d" ]; then
  echo "$d is not a directory"; echo "@@rc 20"
else
  f="$d/.clusterctl-write-test.$$"
  if err=$($t dd if=/dev/zero of="$f" bs=4096 count=1 conv=fsync 2>&1); then
    rm -f "$f" 2>&1; echo "@@rc $?"
  else
    rc=$?
    rm -f "$f" 2>/dev/null
    printf '%s\n' "$err" | grep -v 'records \(in\|out\)$' | head -n 3; echo "@@rc $rc"
  fi
fi
""".replace("@@TIMEOUT@@", str(TIMEOUT_S)))

OUTPUT_DIR = Check(
    "output_dir", "the run's output directory takes a real write (write, fsync, delete)",
    "make the output directory writable, or set `output_dir:` in the inventory",
    probes=(WRITE,), parse=parse_output_dir, fast=True)
