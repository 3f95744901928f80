"""Connections to nodes and the fan-out engine.

The transport is a small interface: a `Connection` opens once and `exec`s commands, returning a
`Proc`. `SSHConnection` and `LocalConnection` are its two implementations; `Cluster` holds one
connection per node for the life of a command and runs commands on all of them at once.
"""

from orchestrator.transport.base import (
                                         DEFAULT_CONNECT_TIMEOUT,
                                         DEFAULT_FANOUT,
                                         DEFAULT_LOST_TIMEOUT,
                                         KEEPALIVE_S,
                                         ClusterResult,
                                         Connection,
                                         LineCallback,
                                         NodeResult,
                                         Proc,
)
from orchestrator.transport.engine import Cluster, connection_for, stream
from orchestrator.transport.known_hosts import known_host_keys
from orchestrator.transport.local import LocalConnection
from orchestrator.transport.ssh import SSHConnection

__all__ = ["DEFAULT_CONNECT_TIMEOUT", "DEFAULT_FANOUT", "DEFAULT_LOST_TIMEOUT", "KEEPALIVE_S", "Cluster",
           "ClusterResult", "Connection", "LineCallback", "LocalConnection", "NodeResult", "Proc",
           "SSHConnection", "connection_for", "known_host_keys", "stream"]
