"""output_shared: whether the nodes share the output directory (one filesystem, e.g. NFS).

Nothing is written: each node names the output directory by what it already is. The nearest
existing directory on its path (the output directory itself once it exists) is named by its
inode and the rest of the path below it; on a local filesystem also by the machine (its boot id)
and device, since inode numbers repeat across machines, while a network filesystem's inode is
the server's, the same on every client. Nodes that print the master's name see the master's
files. Not shared is fine for clusterctl (checkpoints are copied off the nodes and put back
before a restart); a mix, where some nodes share with the master and others do not, is worth a
warning."""

from __future__ import annotations

from orchestrator.checks import Check, CheckResult, Ctx, Probe, ok, section, skip, warn

# Filesystems whose inode numbers are the same on every node that mounts them.
NETWORK_FS = "nfs*|smb*|cifs|fuse*|lustre|gpfs|ceph|9p|afs|beegfs|glusterfs|gfs*|ocfs*|UNKNOWN*"

NAME_DIR = Probe("output-shared", r"""echo "@@output-shared $out"
d=$out rest=
while [ -n "$d" ] && [ ! -d "$d" ]; do
  case $d in */*) rest=${d##*/}/$rest; d=${d%/*} ;; *) rest=$d/$rest; d=. ;; esac
done
d=${d:-/}
if ino=$(stat -L -c '%d %i' "$d" 2>/dev/null) && fs=$(stat -f -L -c '%T' "$d" 2>/dev/null); then
  case $fs in
    @@NETWORK@@) echo "$fs ${ino#* } $rest" ;;
    *) echo "$fs $(cat /proc/sys/kernel/random/boot_id 2>/dev/null || hostname) $ino $rest" ;;
  esac
  echo "@@rc 0"
else
  echo "@@rc 1"
fi
""".replace("@@NETWORK@@", NETWORK_FS))


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
            out[n] = skip("output_shared", "the output directory could not be read (stat)")
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
    probes=(NAME_DIR,), compare=compare_output_shared, fast=True)
