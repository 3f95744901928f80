"""`clusterctl sync`: push the control machine's workdir to every node, in parallel.

What is pushed is what a git tree would ship: `git ls-files -co --exclude-standard` in a git
checkout, else every file not matched by a .gitignore (orchestrator/remote/nodeinfo.py, the
same walker preflight's code_sync hashes with). Files the nodes have that are not pushed and
not ignored are deleted, so `code_sync` passes afterwards; ignored files (data, checkpoints)
are left alone.

Transport: rsync when both sides have it (its own ssh command line built from the inventory's
SSH settings: IdentityFile, -p, UserKnownHostsFile and StrictHostKeyChecking=yes, the same
options for each ProxyJump hop through a ProxyCommand), else a tar stream over the node's
existing connection into `python -c <nodeinfo> receive WORKDIR`.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


from orchestrator import shell
from orchestrator.checks import load_nodeinfo
from orchestrator.inventory import Inventory, Node
from orchestrator.transport import Cluster


@dataclass(frozen=True)
class SyncResult:
    node: str
    method: str  # rsync | tar | skip
    ok: bool
    detail: str


def file_list(src: str) -> list[str]:
    ni = load_nodeinfo()
    g = ni.git_files(src)
    files = g[0] if g else ni.walk_files(src)
    return [f for f in files if os.path.lexists(os.path.join(src, f))]


def tar_stream(src: str, files: list[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for rel in files:
            tar.add(os.path.join(src, rel), arcname=rel, recursive=False)
        manifest = "\0".join(files).encode("utf-8", "surrogateescape")
        info = tarfile.TarInfo(load_nodeinfo().MANIFEST)
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
    return buf.getvalue()


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


def sync(cluster: Cluster, inv: Inventory, src: str, *, method: str = "auto",
         on_done=None) -> list[SyncResult]:
    """Push src to every connected node; returns one result per node in rank order."""
    results: dict[str, SyncResult] = {}
    lock = threading.Lock()

    def done(r: SyncResult):
        with lock:
            results[r.node] = r
        if on_done:
            on_done(r)

    todo = []
    for n in inv.nodes:
        if n.name in cluster.unreachable or n.name not in cluster.connections:
            err = cluster.unreachable.get(n.name)
            done(SyncResult(n.name, "skip", False, err.error if err else "not connected"))
        elif n.is_local and _same_dir(src, n.workdir):
            done(SyncResult(n.name, "skip", True, "local node: the workdir is the source itself"))
        else:
            todo.append(n)
    if not todo:
        return [results[n.name] for n in inv.nodes]

    # one round trip on the existing connections: does the node have rsync? (also makes the dir)
    use_rsync: set[str] = set()
    if method in ("auto", "rsync") and shutil.which("rsync"):
        probe = cluster.run(lambda n: f"mkdir -p {shell.path(n.workdir)} && command -v rsync",
                            nodes=[n.name for n in todo if not n.is_local], timeout=30)
        use_rsync = {k for k, r in probe.items() if r.ok and r.stdout.strip()}
        use_rsync |= {n.name for n in todo if n.is_local}
    if method == "rsync":
        for n in todo:
            if n.name not in use_rsync:
                done(SyncResult(n.name, "rsync", False, "rsync is missing on this node or here"))
        todo = [n for n in todo if n.name in use_rsync]

    files = file_list(src)
    manifest = "\0".join(files).encode("utf-8", "surrogateescape")
    receiver = shell.quote(load_nodeinfo().__loader__.get_source(load_nodeinfo().__name__))

    def rsync_one(n: Node):
        """rsync exactly the file list (rsync's own .gitignore merge knows no `!negation`), then
        prune what the list does not name over the node's existing connection."""
        if n.is_local:
            os.makedirs(os.path.expanduser(n.workdir), exist_ok=True)
            argv = ["rsync", "-a", "--files-from=-", "--from0", src.rstrip("/") + "/",
                    os.path.expanduser(n.workdir).rstrip("/") + "/"]
        else:
            argv = rsync_argv(src, n)
        try:
            p = subprocess.run(argv, capture_output=True, input=manifest, timeout=3600)
        except (OSError, subprocess.TimeoutExpired) as e:
            return SyncResult(n.name, "rsync", False, str(e))
        if p.returncode != 0:
            return SyncResult(n.name, "rsync", False, p.stderr.decode(errors="replace").strip()[-300:])
        return None

    def prune_cmd(n: Node) -> str:
        return f"{shell.path(n.python)} -c {receiver} prune {shell.path(n.workdir)}"

    tar_nodes = [n for n in todo if n.name not in use_rsync]
    rsync_nodes = [n for n in todo if n.name in use_rsync]
    pool = ThreadPoolExecutor(max_workers=max(1, min(cluster.fanout, len(rsync_nodes))))  # the one fan-out cap
    futures = {n.name: pool.submit(rsync_one, n) for n in rsync_nodes}
    if tar_nodes:
        data = tar_stream(src, files)

        def on_tar(r):
            done(SyncResult(r.node, "tar", r.ok, f"pushed {len(files)} files ({len(data) / 1e6:.1f} MB tar.gz)"
                            if r.ok else (r.error or r.stderr.strip()[-300:] or f"exit {r.exit_code}")))

        cluster.run(lambda n: f"{shell.path(n.python)} -c {receiver} receive {shell.path(n.workdir)}",
                    stdin=data, nodes=[n.name for n in tar_nodes], timeout=3600, on_done=on_tar)
    pushed = []
    for name, f in futures.items():
        r = f.result()
        if r is not None:
            done(r)
        else:
            pushed.append(name)
    pool.shutdown()
    if pushed:
        def on_prune(r):
            done(SyncResult(r.node, "rsync", r.ok, f"pushed {len(files)} files with rsync" if r.ok else
                            "rsync ok, pruning failed: " + (r.error or r.stderr.strip()[-300:])))

        cluster.run(prune_cmd, stdin=manifest, nodes=pushed, timeout=600, on_done=on_prune)
    return [results[n.name] for n in inv.nodes]
