"""output_shared: whether the nodes share the output directory (one filesystem, e.g. NFS).

Each node creates `.clusterctl-dir-id` in the output directory if it is missing, atomically (a
temp file hard-linked to the name: the first node wins on a shared filesystem), and prints the
id found there. Nodes that print the master's id see the master's files. Not shared is fine for
clusterctl (checkpoints are copied off the nodes and put back before a restart); a mix, where
some nodes share with the master and others do not, is worth a warning."""

from __future__ import annotations

from orchestrator.checks import Check, CheckResult, Ctx, Probe, ok, section, skip, warn

WRITE_ID = Probe("output-shared", r"""echo "@@output-shared $out"
if mkdir -p "$out" 2>/dev/null; then
  f="$out/.clusterctl-dir-id"
  if [ ! -s "$f" ]; then
    t="$f.$$"
    (cat /proc/sys/kernel/random/uuid 2>/dev/null || echo "$(hostname)-$$-$(date +%s%N)") > "$t" && ln "$t" "$f" 2>/dev/null
    rm -f "$t"
  fi
  cat "$f" 2>/dev/null; echo "@@rc 0"
else
  echo "@@rc 1"
fi
""")


def _id(text: str) -> str | None:
    s = section(text, "output-shared")
    if s is None or s.rc != 0:
        return None
    return s.body.strip() or None


def compare_output_shared(texts: dict[str, str], ctx_of: dict[str, Ctx]) -> dict[str, CheckResult]:
    master = next((n for n, c in ctx_of.items() if c.is_master), None)
    ids = {n: _id(t) for n, t in texts.items()}
    if master is None or ids.get(master) is None:
        return {n: skip("output_shared", "the master's output directory could not be probed") for n in texts}
    workers = [n for n in texts if n != master and ids[n] is not None]
    shared = [n for n in workers if ids[n] == ids[master]]
    out = {}
    mixed = 0 < len(shared) < len(workers)
    for n in texts:
        if ids[n] is None:
            out[n] = skip("output_shared", "the output directory could not be created")
        elif n == master:
            what = ("shared with every node" if len(shared) == len(workers) and workers else
                    "not shared: clusterctl copies checkpoints off the nodes" if not shared else
                    f"shared with {', '.join(shared)} only")
            out[n] = (warn if mixed else ok)("output_shared", what)
        elif ids[n] == ids[master]:
            out[n] = (warn if mixed else ok)("output_shared", "the master's output directory (shared)")
        else:
            out[n] = (warn if mixed else ok)("output_shared", "its own output directory (not shared with the master)")
    return out


OUTPUT_SHARED = Check(
    "output_shared", "whether the output directory is one filesystem shared by every node",
    "mount one filesystem at the output directory on every node, or none (checkpoints are copied either way)",
    probes=(WRITE_ID,), compare=compare_output_shared, fast=True)
