"""Connections to nodes and the fan-out engine.

The transport is a small interface: a `Connection` opens once and `exec`s commands, returning a
`Proc` (`fds()`, `read()`, `done()`, `exit_code()`, `lost_reason()`, `kill()`, `close()`).
`SSHConnection` and `LocalConnection` are its two implementations; `Cluster` holds one
connection per node for the life of a command and runs commands on all of them at once through
the one engine (`stream`, `first_line`, `wait`). Problems come back typed: a NodeResult's
`kind` (ErrorKind) and `exception()`, or ConnectError / ConnectionLost / CommandTimeout raised.
"""

from orchestrator.transport.base import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_LOST_TIMEOUT,
    BytesCallback,
    ClusterResult,
    Connection,
    ErrorKind,
    LineCallback,
    NodeResult,
    Proc,
    quiet_paramiko,
    retry_wait,
)
from orchestrator.transport.engine import (
    DEFAULT_FANOUT,
    Cluster,
    Engine,
    connection_for,
    first_line,
    open_all,
    stream,
    wait,
)
from orchestrator.transport.faults import Fault
from orchestrator.transport.local import LocalConnection

__all__ = ["DEFAULT_CONNECT_TIMEOUT", "DEFAULT_FANOUT", "DEFAULT_LOST_TIMEOUT", "BytesCallback",
           "Cluster", "ClusterResult", "Connection", "Engine", "ErrorKind", "Fault", "LineCallback", "LocalConnection",
           "NodeResult", "Proc", "SSHConnection", "connection_for", "first_line", "known_host_keys", "open_all", "quiet_paramiko",
           "retry_wait", "stream", "wait"]


def __getattr__(name: str):
    """SSHConnection and known_host_keys on first use: they import paramiko, 0.2 s of every command
    that never connects over SSH (`--help`, `plan`, `status` of a run its supervisor answers, an
    inventory's error, a run on `connection: local` nodes)."""
    if name == "SSHConnection":
        from orchestrator.transport.ssh import SSHConnection

        return SSHConnection
    if name == "known_host_keys":
        from orchestrator.transport.known_hosts import known_host_keys

        return known_host_keys
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
