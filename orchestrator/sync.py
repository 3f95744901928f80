"""`clusterctl sync`: push the control machine's workdir to every node.

What is pushed is what a git tree would ship (`git ls-files -co --exclude-standard` in a git
checkout, else every file not matched by a .gitignore: orchestrator/remote/nodeinfo.py, the
walker preflight's code_sync hashes with), plus the inventory's `sync.include` and --include,
minus `sync.exclude` and --exclude (orchestrator/transfer/files.py). Never pushed: the run's
output directories inside the workdir (`run_outputs`: the trainer's, the inventory's
`output_dir`), what git does not track in the folders tools write by default (lightning_logs/,
wandb/, runs/, outputs/, multirun/, __pycache__/), and the inventory file with the key and
known_hosts files it names. Each node records the list pushed (.clusterctl-code): that list is
its code from then on, for code_sync and for a spare it hands code to, so whatever a job writes
on a node is never taken for code. A file the previous push shipped and this one does not is
deleted afterwards (unless a .gitignore ignores it now); nothing else on the node is touched.

Methods (`auto` picks per push, after one probe round trip that also creates the workdir):
  relay  one tar stream from here to the first node, forwarded node to node (each byte leaves
         this machine once; orchestrator/transfer/chain.py); direct pushes where nodes cannot
         reach each other
  tar    the same stream pushed from here to every node directly
  rsync  rsync per node, which sends only what changed; its own ssh command line is built from the
         inventory's SSH settings (IdentityFile, -p, UserKnownHostsFile, StrictHostKeyChecking=yes,
         and the same options for each ProxyJump hop through a ProxyCommand)
  auto   rsync where every candidate has it and the bytes rsync would send (each node's changed
         files, by size and mtime, summed over nodes) are at most one stream's worth, i.e. small
         updates of a synced tree; otherwise the relay.
Every method compares and carries mtimes in whole seconds, so a push first waits out the second
in which the newest file was written (under a second, only right after an edit).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from orchestrator import shell
from orchestrator.errors import UsageError
from orchestrator.inventory import Inventory, Node
from orchestrator.node import nodeinfo, wire
from orchestrator.node import relay as relay_door
from orchestrator.node.form import Exec, NodePath
from orchestrator.transfer import SyncReport, SyncResult
from orchestrator.transfer import chain as relay
from orchestrator.transfer.archive import estimate
from orchestrator.transfer.files import git_list, private_files, run_outputs, select_files
from orchestrator.transfer.progress import SyncEvents
from orchestrator.transport import Cluster

__all__ = ["SyncReport", "SyncResult", "choose_methods", "file_list", "rsync_argv", "sync",
           "wait_out_the_newest_second"]


def file_list(src: str) -> list[str]:
    """The files a git tree would ship (no include/exclude)."""
    return git_list(src)


def rsync_ssh_command(node: Node) -> str:
    """The `-e` of rsync: ssh with the inventory's settings, host keys verified against the same
    known_hosts as clusterctl's own connections, on the node and on every ProxyJump hop.

    rsync splits this string itself, at spaces, honouring '...' and "..." (no shell): the
    single-quoted words of shlex.quote survive that split intact."""
    return " ".join(shell.quote(a) for a in ssh_argv(node))


def ssh_argv(node: Node) -> list[str]:
    """`ssh` with the node's port, identity, known_hosts and StrictHostKeyChecking=yes; the
    destination (user@host) is for the caller to add. ProxyJump becomes a ProxyCommand that runs
    `ssh -W` with the same options for each hop (`-J` would give the hops none of them)."""
    s = node.ssh
    argv = ["ssh", *_ssh_options(node), *(["-p", str(s.port)] if s.port else [])]
    if s.proxy_jump:
        argv += ["-o", "ProxyCommand=" + _proxy_command(node, s.proxy_jump.split(","))]
    return argv


def _ssh_options(node: Node) -> list[str]:
    """Options every ssh process reaching this node takes (itself and each jump hop). Values go
    through ssh's own parsing: % is ssh's token character, and a -o value is split at spaces
    unless double-quoted."""
    s = node.ssh
    known_hosts = os.path.abspath(os.path.expanduser(s.known_hosts or "~/.ssh/known_hosts"))
    argv = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", "UserKnownHostsFile=" + _config_value(known_hosts),
            "-o", "GlobalKnownHostsFile=/dev/null"]  # clusterctl's connections read only one file
    if s.identity_file:
        # not -i: ssh checks that an -i path exists before expanding its % tokens, so no
        # spelling of a path with % in it works there
        argv += ["-o", "IdentityFile=" + _config_value(os.path.abspath(os.path.expanduser(s.identity_file))),
                 "-o", "IdentitiesOnly=yes"]
    if s.config_file:
        argv += ["-F", os.path.abspath(os.path.expanduser(s.config_file))]
    if s.connect_timeout:
        argv += ["-o", f"ConnectTimeout={int(s.connect_timeout + 0.999)}"]
    return argv


def _proxy_command(node: Node, hops: list[str]) -> str:
    """The ProxyCommand that connects to %h:%p through the last of `hops`, itself reached
    through the ones before it. ssh expands % tokens in it, then runs it with `sh -c`: every
    word is %-escaped and shell-quoted, except the -W target that ssh is meant to fill in."""
    *before, hop = hops
    user, _, hostport = hop.rpartition("@")
    host, port = _split_host_port(hostport)
    words = ["ssh", *_ssh_options(node), *(["-p", port] if port else []), *(["-l", user] if user else [])]
    if before:
        words += ["-o", "ProxyCommand=" + _proxy_command(node, before)]
    words = [shell.quote(_percent(w)) for w in words]
    return " ".join(words + ["-W", "'[%h]:%p'", shell.quote(_percent(host))])


def _split_host_port(hostport: str) -> tuple[str, str | None]:
    """"host:port", "[v6]:port", "host" or a bare IPv6 address -> (host, port or None)."""
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        return host, rest[1:] or None
    if hostport.count(":") == 1:
        host, _, port = hostport.partition(":")
        return host, port or None
    return hostport, None


def _percent(value: str) -> str:
    return value.replace("%", "%%")


def _config_value(value: str) -> str:
    """A value for `ssh -o Key=VALUE`: ssh splits it like a config line (quotes, backslash
    escapes) and expands % tokens in file names."""
    return '"' + _percent(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def rsync_argv(src: str, node: Node) -> list[str]:
    dest = node.workdir
    if dest == "~":
        dest = "."
    elif dest.startswith("~/"):
        dest = dest[2:]  # rsync's remote side starts in the home directory
    host = f"[{node.host}]" if ":" in node.host and not node.host.startswith("[") else node.host
    target = f"{node.ssh.user + '@' if node.ssh.user else ''}{host}:{dest.rstrip('/')}/"
    return ["rsync", "-a", "--files-from=-", "--from0", "-e", rsync_ssh_command(node),
            src.rstrip("/") + "/", target]


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(os.path.expanduser(a), os.path.expanduser(b))
    except OSError:
        return False


def choose_methods(method: str, rsync_here: bool, probes: dict[str, tuple[int, bool]],
                   stream_bytes: int) -> dict[str, str]:
    """node -> rsync | relay | tar, from each node's (changed bytes, has rsync). See the module doc."""
    if method in ("relay", "tar"):
        return {n: method for n in probes}
    if method == "rsync":
        return {n: "rsync" if rsync_here and has else "missing" for n, (_, has) in probes.items()}
    capable = [n for n, (_, has) in probes.items() if has and rsync_here]
    small = sum(probes[n][0] for n in capable) <= stream_bytes
    return {n: "rsync" if n in capable and small else "relay" for n in probes}


_RSYNC_SENT = re.compile(r"^Total bytes sent: ([\d,.]+)", re.M)


def _rsync_one(src: str, n: Node, manifest: bytes) -> tuple[SyncResult | None, int]:
    """rsync exactly the file list (rsync's own .gitignore merge knows no `!negation`); returns
    (a failure or None, bytes rsync sent)."""
    t0 = time.monotonic()
    if n.is_local:
        os.makedirs(os.path.expanduser(n.workdir), exist_ok=True)
        argv = ["rsync", "-a", "--files-from=-", "--from0", src.rstrip("/") + "/",
                os.path.expanduser(n.workdir).rstrip("/") + "/"]
    else:
        argv = rsync_argv(src, n)
    argv.insert(1, "--stats")
    try:
        p = subprocess.run(argv, capture_output=True, input=manifest, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return SyncResult(n.name, "rsync", False, str(e), 0, time.monotonic() - t0), 0
    m = _RSYNC_SENT.search(p.stdout.decode(errors="replace"))
    sent = int(re.sub(r"[,.]", "", m.group(1))) if m else 0
    if p.returncode != 0:
        err = p.stderr.decode(errors="replace").strip()[-300:]
        return SyncResult(n.name, "rsync", False, err, 0, time.monotonic() - t0), sent
    return None, sent


def wait_out_the_newest_second(src: str, files: list[str], clock=time.time, sleep=time.sleep) -> float:
    """Before any copy is taken, wait (under a second) until the clock has left the second in
    which the newest file was written; returns the seconds waited.

    The push and the next sync's quick check (the probe below, rsync's default --modify-window 0)
    compare size and mtime in whole seconds, and the tar stream carries whole seconds. A copy taken
    within the second its file was written carries that second, so a same-size edit later in the
    same second looked unchanged to the next sync: rsync skipped it and code_sync failed after a
    "successful" push. Git's index has the same racy window. Once the second is over, any later
    write has a later second and is seen."""
    newest = None
    for rel in files:
        try:
            m = os.lstat(os.path.join(src, rel)).st_mtime
        except OSError:
            continue
        newest = m if newest is None else max(newest, m)
    now = clock()  # after the stats: a write during them is older than now, not "from the future"
    if newest is None or int(newest) != int(now):  # older, or from the future (no wait helps)
        return 0.0
    wait = int(now) + 1 - now
    sleep(wait)
    return wait


def _probe(cluster: Cluster, todo: list[Node], src: str, files: list[str]) -> dict:
    """One round trip per node: create the workdir, count the bytes that differ there (size or
    mtime), say whether rsync is installed. node -> (changed bytes, has rsync) or an error."""
    recs = []
    for rel in files:
        try:
            st = os.lstat(os.path.join(src, rel))
        except OSError:
            continue
        recs.append(f"{st.st_size} {int(st.st_mtime)} ".encode() + rel.encode("utf-8", "surrogateescape"))
    payload = b"\0".join(recs) + b"\0"
    res = wire.send(cluster, lambda n: relay_door.changed(n, n.workdir), [n.name for n in todo],
                    data=lambda n: [payload], timeout=60)
    out = {}
    for name, r in res.items():
        got = relay_door.read_changed(r.stdout) if r.ok else None
        if got is not None:
            out[name] = got
        else:
            out[name] = (r.error or r.stderr.strip()[-300:] or f"exit code {r.exit_code}")
    return out


def _refuse_local_overwrite(n: Node, src: str) -> None:
    """A local node's workdir is mirrored from src and pruned of what src does not have. Refuse
    when that directory holds the caller (the current directory or one of its parents, such as a
    relative `workdir: .` in the embedded default) or is the home or root directory: a sync from
    elsewhere would delete what is there."""
    target = os.path.realpath(os.path.expanduser(n.workdir))
    cwd = os.path.realpath(os.getcwd())
    if target in ("/", os.path.realpath(os.path.expanduser("~"))) or \
            cwd == target or cwd.startswith(target.rstrip("/") + "/"):
        raise UsageError(f"node {n.name} is local and its workdir {n.workdir!r} is {target}, which holds the "
                         f"current directory (or is your home or /): syncing {src} there would replace it and "
                         "delete what it does not have. Give the node an absolute workdir of its own, or run "
                         "sync with -i pointing at the inventory whose nodes should receive the code")


def _targets(cluster: Cluster, inv: Inventory, src: str, done) -> list[Node]:
    todo = []
    for n in inv.nodes:
        if n.is_local and not _same_dir(src, n.workdir):
            _refuse_local_overwrite(n, src)
    for n in inv.nodes:
        if n.name in cluster.unreachable or n.name not in cluster.connections:
            err = cluster.unreachable.get(n.name)
            done(SyncResult(n.name, "skip", False, err.error if err else "not connected"))
        elif n.is_local and _same_dir(src, n.workdir):
            done(SyncResult(n.name, "skip", True, "local node: the workdir is the source itself"))
        else:
            todo.append(n)
    return todo


def _explain_choice(methods: dict[str, str], probes: dict, stream_bytes: int) -> str:
    rs = [n for n, m in methods.items() if m == "rsync"]
    changed = sum(probes[n][0] for n in probes if probes[n][1])
    if rs:
        return (f"auto: rsync to {len(rs)} node(s): {changed / 1e6:.1f} MB differ there in all, at "
                f"most one stream ({stream_bytes / 1e6:.1f} MB)")
    return (f"auto: relay: a full stream ({stream_bytes / 1e6:.1f} MB) sent once costs less than "
            f"rsync's per-node changes")


def _push(cluster: Cluster, src: str, files: list[str], methods: dict[str, str], by_name: dict,
          events: SyncEvents, done) -> tuple[list[str], int, list[str]]:
    """Run every method's push; returns (nodes pushed, bytes sent from here, notes)."""
    manifest = "\0".join(files).encode("utf-8", "surrogateescape")
    pick = {m: [by_name[n] for n, x in methods.items() if x == m] for m in ("rsync", "relay", "tar", "missing")}
    for n in pick["missing"]:
        done(SyncResult(n.name, "rsync", False, "rsync is missing on this node or here"))
    pool = ThreadPoolExecutor(max_workers=max(1, min(cluster.fanout, len(pick["rsync"]) or 1)))
    futures = {n.name: pool.submit(_rsync_one, src, n, manifest) for n in pick["rsync"]}
    pushed, sent, notes = [], 0, []
    for m in ("relay", "tar"):
        if pick[m]:
            res, nbytes, more = relay.push(cluster, pick[m], src, files, chain=m == "relay",
                                           on_bytes=events.advanced)
            sent, notes = sent + nbytes, notes + more
            for r in res:
                if r.ok:
                    pushed.append((r.node, r))
                else:
                    done(r)
    for name, f in futures.items():
        failure, nbytes = f.result()
        sent += nbytes
        if failure is not None:
            done(failure)
        else:
            pushed.append((name, SyncResult(name, "rsync", True, f"{len(files)} files with rsync",
                                            nbytes)))
    pool.shutdown()
    return pushed, sent, notes


def prune_command(inv: Inventory, node: Node) -> Exec:
    """nodeinfo's prune of node's workdir (the manifest on stdin), the run's outputs named."""
    outputs = [a for d in run_outputs(inv, node) for a in ("--output", d)]
    return nodeinfo.command(node, "prune", NodePath(node.workdir), *outputs)


def _prune(cluster: Cluster, inv: Inventory, pushed: list[tuple[str, SyncResult]], files: list[str], done) -> None:
    """On the pushed nodes, delete what the previous push shipped and this one does not, and
    record this push's list: the nodes' code from now on (nodeinfo `prune`)."""
    if not pushed:
        return
    manifest = "\0".join(files).encode("utf-8", "surrogateescape")
    by = dict(pushed)

    def on_prune(r):
        p = by[r.node]
        done(p if r.ok else SyncResult(p.node, p.method, False, "pushed, but removing stale files failed: "
                                       + (r.error or r.stderr.strip()[-300:]), p.bytes, p.seconds))

    wire.send(cluster, lambda n: prune_command(inv, n), list(by), data=lambda n: [manifest], timeout=600,
              on_done=on_prune)


def sync(cluster: Cluster, inv: Inventory, src: str, *, method: str = "auto", include=(), exclude=(),
         events: SyncEvents | None = None) -> SyncReport:
    """Push src to every connected node; one result per inventory node in rank order."""
    events = events or SyncEvents()
    t0 = time.monotonic()
    results: dict[str, SyncResult] = {}

    def done(r: SyncResult):
        results[r.node] = r
        events.finished(r)

    todo = _targets(cluster, inv, src, done)
    files = select_files(src, tuple(inv.sync.include) + tuple(include), tuple(inv.sync.exclude) + tuple(exclude),
                         {d for n in inv.nodes for d in run_outputs(inv, n)}, private_files(inv, src))
    tree_bytes, stream_bytes = estimate(src, files)
    sent, notes = 0, []
    if todo:
        wait_out_the_newest_second(src, files)
        probes = _probe(cluster, todo, src, files)
        for name, p in probes.items():
            if isinstance(p, str):
                done(SyncResult(name, "skip", False, f"cannot prepare the workdir: {p}"))
        probes = {k: v for k, v in probes.items() if not isinstance(v, str)}
        methods = choose_methods(method, bool(shutil.which("rsync")), probes, stream_bytes)
        if method == "auto" and probes:
            notes.append(_explain_choice(methods, probes, stream_bytes))
        for name, m in methods.items():
            events.planned(name, m, probes[name][0] if m == "rsync" else stream_bytes)
        pushed, sent, more = _push(cluster, src, files, methods, {n.name: n for n in todo}, events, done)
        notes += more
        _prune(cluster, inv, pushed, files, done)
    return SyncReport([results[n.name] for n in inv.nodes], time.monotonic() - t0, tree_bytes,
                      len(files), sent, notes)
