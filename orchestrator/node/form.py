"""The one command form: how a program of orchestrator/remote/ is run on a node.

orchestrator/remote/ is a package, and a node keeps it once per version, keyed by its hash
(probe.py `node_code`), in ~/.clusterctl/node-code/HASH: `PYTHON [FLAGS] -c BOOT CODE PROGRAM
ARGS`, every argument quoted by orchestrator/shell.py (`NodePath` arguments keep a leading `~/` as
the node user's home, everything else is one literal word). Stdin is the caller's (a spec, a
manifest, a tar stream, nothing).

The code crosses the wire once per version and node, as a tar: `place` looks on each connection
once (`test -f`, one round trip), sends it only where it is missing, and remembers the
connection. The door's runners (node/wire.py `run`, `send`, `Call.over`, `Exec.start`) place it
before they run; a caller that runs a command line of its own calls `place` first. A node whose
code went missing after all (removed by hand while a connection was open) answers with
probe.MISSING, which `missing` reads: the connection is forgotten, and the next call places the
code again.

Why a directory and not a zipapp: Python's zipimport compiles every module twice per start
(get_filename, then get_code) and can cache no bytecode, which made each program's start
1.1-1.6x slower than sending its text; unpacked, the node's Python compiles a module once per version
(bench/bench_node_code.py).
"""

from __future__ import annotations

import subprocess
import threading
import weakref
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

from orchestrator import probe, shell
from orchestrator.inventory import Node
from orchestrator.transport import wait

KEEP = 16  # versions of the node code a node keeps (the newest; an upgrade or a downgrade finds its own)
PLACE_TIMEOUT = 60.0

_placed: "weakref.WeakSet" = weakref.WeakSet()  # connections whose node holds this version
_lock = threading.Lock()


class NodePath(str):
    """An argument that is a path on the node: a leading `~` is the node user's home there."""


def word(arg: object) -> str:
    """One argument as one shell word (a NodePath keeps a leading `~` as the node's home)."""
    return shell.path(arg) if isinstance(arg, NodePath) else shell.quote(arg)


@dataclass(frozen=True)
class Exec:
    """A node command: the shell line and the bytes on its stdin (None: nothing)."""

    command: str
    stdin: bytes | None

    def then(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """The stdin: this command's own bytes, then the caller's data."""
        if self.stdin:
            yield self.stdin
        yield from chunks

    def start(self, conn, keep_stdin: bool = False):
        """Started on one open connection (transport Connection), the node code placed on it
        first; raises what `conn.exec` raises. keep_stdin: its stdin stays open (Proc.send)."""
        place_on(conn)
        return conn.exec(self.command, stdin=self.stdin, keep_stdin=keep_stdin)


def boot(program: str, *args: str, python: str, flags: tuple[str, ...] = ()) -> str:
    """`PYTHON [FLAGS] -c BOOT CODE PROGRAM ARGS`: args are shell words as they stand (a script's
    "$@", or words quoted by the caller)."""
    return " ".join([python, *flags, "-c", shell.quote(probe.BOOT), shell.path(probe.node_code_path()),
                     program, *args])


def command(node: Node, program: str, *args: object, python: str | None = None,
            env: Mapping[str, object] | None = None, flags: tuple[str, ...] = (), group_env: bool = True,
            stdin: bytes | None = None) -> Exec:
    """`[GROUP_ENV=1 ][K=V ...]PYTHON [FLAGS] -c BOOT CODE PROGRAM ARGS` running remote/PROGRAM.py on
    `node`. python: the interpreter (default the node's); env: assignments in front of it (names
    are the house's, values quoted); group_env: the node's program_env (share_with_group) in
    front; stdin: bytes the program reads (a spec that must not appear on a command line: `ps`
    shows argv)."""
    head = [f"{k}={shell.quote(v)}" for k, v in (env or {}).items()]
    line = boot(program, *(word(a) for a in args), python=shell.path(python or node.python), flags=flags)
    return Exec((node.program_env if group_env else "") + " ".join([*head, line]), stdin)


def script_line(program: str, python: str, *args: str, flags: tuple[str, ...] = ()) -> str:
    """A line of a node-side `sh` script that runs remote/PROGRAM.py (`PYTHON [FLAGS] -c BOOT CODE
    PROGRAM ARGS 2>&1`). python and args are shell words as the script has them ("$py", "$@"):
    the script's own variables, not values from here. The caller places the code first."""
    return boot(program, *args, python=python, flags=flags) + " 2>&1\n"


# ------------------------------------------------------------------ placing the code on the nodes


def check_command() -> str:
    """Exit 0 when the node holds this version, 1 when not."""
    return f"test -f {shell.path(probe.node_code_path())}/{probe.PACKAGE}/{probe.COMPLETE}"


def install_command() -> str:
    """The tar from stdin unpacked beside the node's versions and renamed into place: whole or not
    at all (COMPLETE is its last member: a stream cut short never has it); a version another
    command placed meanwhile is kept. Then only the KEEP newest versions stay. POSIX sh and tar:
    the interpreter that will run the code may not exist yet (setup makes it)."""
    h = probe.node_code()[0]
    # the staging name carries the host as well as the pid: nodes that share one home (NFS) may
    # place the same version at once, with the same pid on two hosts
    return (f"umask 077; d={shell.path(probe.CACHE)}; v=\"$d/{h}\"; n=\".in.$(hostname 2>/dev/null).$$\"; "
            f"t=\"$d/$n\"; mkdir -p \"$d\" && rm -rf \"$t\" && mkdir \"$t\" || exit 1; "
            f"if tar -xf - -C \"$t\" && [ -f \"$t/{probe.PACKAGE}/{probe.COMPLETE}\" ]; then "
            f"if [ -d \"$v\" ]; then rm -rf \"$t\"; else mv \"$t\" \"$v\"; rm -rf \"$v/$n\"; fi; "
            f"ls -t \"$d\" | grep -v '^\\.' | tail -n +{KEEP + 1} | while read -r f; do rm -rf \"$d/$f\"; done; "
            f"else rm -rf \"$t\"; echo \"clusterctl: could not write its node code into $d\" >&2; exit 1; fi")


def _why(r) -> str:
    """Why a placing command failed: the transport's word, or its exit code, and the end of stderr."""
    return f"{r.describe()} {r.stderr.strip()[-300:]}".strip()


def _ensure(run) -> str | None:
    """The one placing rule, on one node: look (`test -f`), send the tar only when it is missing.
    run(command, stdin) -> (ok, exit code, why not); -> None when the code is there, else why not."""
    ok, code, why = run(check_command(), None)
    if code == 1:
        ok, code, why = run(install_command(), probe.node_code()[1])
    return None if ok else why


def place_on(conn, timeout: float = PLACE_TIMEOUT) -> str | None:
    """This version on the node of one open connection (looked for once per connection):
    None when it is there, else why not. Raises what `conn.exec` raises (ConnectionLost)."""
    if conn in _placed:
        return None

    def run(command, stdin):
        r = wait(conn.exec(command, stdin=stdin), timeout)
        return r.ok, r.exit_code, _why(r)

    why = _ensure(run)
    if why is None:
        known(conn)
    return why


def place(cluster, names: Iterable[str] | None = None, timeout: float = PLACE_TIMEOUT) -> dict[str, str]:
    """This version on each chosen node of the cluster (all when None) that is connected and
    not known to hold it: one `test -f` each, at once, then the code sent to those without it.
    -> node -> why it could not be placed (the node's own command will fail and say so too)."""
    chosen = list(cluster.connections) if names is None else [n for n in names if n in cluster.connections]
    todo = [n for n in chosen if cluster.connections[n] not in _placed]
    if not todo:
        return {}
    res = cluster.run(check_command(), nodes=todo, timeout=timeout)
    missing = [n for n, r in res.items() if r.exit_code == 1]
    if missing:
        res.update(cluster.run(install_command(), stdin=probe.node_code()[1], nodes=missing, timeout=timeout))
    errors = {}
    for name, r in res.items():
        conn = cluster.connections.get(name)
        if r.ok and conn is not None:
            known(conn)
        elif not r.ok:
            errors[name] = _why(r)
    return errors


def place_here(env: Mapping[str, str] | None = None, timeout: float = PLACE_TIMEOUT) -> str | None:
    """This version on this machine, for a program run here as on a node (`launch --from-env`'s
    own preflight probe): the same look and the same install, through /bin/sh, under `env` (its
    HOME) or this process's environment. None when it is there, else why not."""
    environ = dict(env) if env is not None else None

    def run(command, stdin):
        r = subprocess.run(["/bin/sh", "-c", command], input=stdin or b"", env=environ, capture_output=True,
                           timeout=timeout)
        return r.returncode == 0, r.returncode, r.stderr.decode(errors="replace").strip()[-300:] or f"exit {r.returncode}"

    try:
        return _ensure(run)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not place clusterctl's node code here: {e}"


def known(conn) -> None:
    """The connection's node holds this version (a program of it just ran there)."""
    with _lock:
        _placed.add(conn)


def missing(r) -> bool:
    """A node command's result (transport NodeResult) that says the code was not on the node."""
    return r.exit_code == probe.MISSING_EXIT and probe.MISSING in (r.stderr or "")


def forget(conn) -> None:
    """The connection's node may no longer hold the code: the next call looks again."""
    if conn is not None:
        with _lock:
            _placed.discard(conn)
