"""Why an SSH connect failed, named as OpenSSH's client names it.

`ssh` says "connect to host H port 22: No route to host" for a cut link or an address nobody
holds, "Connection refused" for a closed port, "Connection timed out" behind a firewall that
drops, "Host key verification failed" and "Permission denied" for a node that refuses us. A user
who tries `ssh` by hand reads the same words here. `explain` is pure: the exception paramiko (or
the socket under it) raised, and where we tried to go, in; the fault and its sentence out.
tests/test_ssh_faults.py checks it against OpenSSH's and paramiko's output recorded for each
fault on the test cluster (tests/fixtures/ssh_errors).
"""

from __future__ import annotations

import enum
import errno
import socket


class Fault(str, enum.Enum):
    """A failed connect, by the words ssh uses for it."""

    NO_ROUTE = "No route to host"
    NET_UNREACHABLE = "Network is unreachable"
    REFUSED = "Connection refused"
    TIMED_OUT = "Connection timed out"
    UNRESOLVED = "Could not resolve hostname"
    HOST_KEY_CHANGED = "REMOTE HOST IDENTIFICATION HAS CHANGED"
    HOST_KEY_UNKNOWN = "Host key verification failed"
    AUTH = "Permission denied"
    HANDSHAKE = "SSH handshake failed"
    OTHER = "cannot connect"


ERRNO_FAULT = {errno.EHOSTUNREACH: Fault.NO_ROUTE, errno.ENETUNREACH: Fault.NET_UNREACHABLE,
               errno.ECONNREFUSED: Fault.REFUSED, errno.ETIMEDOUT: Fault.TIMED_OUT}


def _errno(e: BaseException) -> int | None:
    """The socket error under `e`: paramiko folds a refused or unrouted connect to every address
    of the host into NoValidConnectionsError({addr: OSError}), errno None; the first address's."""
    import paramiko

    if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError):
        return next((err.errno for err in e.errors.values() if err.errno is not None), None)
    return e.errno if isinstance(e, OSError) else None


def fault_of(e: BaseException) -> Fault:
    import paramiko  # imported here: a command that never connects over SSH never loads it (0.2 s)

    if isinstance(e, paramiko.BadHostKeyException):
        return Fault.HOST_KEY_CHANGED
    if isinstance(e, paramiko.AuthenticationException) or \
            (isinstance(e, paramiko.SSHException) and "No authentication methods" in str(e)):
        return Fault.AUTH
    if isinstance(e, socket.gaierror):
        return Fault.UNRESOLVED
    if isinstance(e, (socket.timeout, TimeoutError)):
        return Fault.TIMED_OUT
    code = _errno(e)
    if code in ERRNO_FAULT:
        return ERRNO_FAULT[code]
    if isinstance(e, paramiko.SSHException):
        return Fault.HANDSHAKE
    return Fault.OTHER


def explain(e: BaseException, host: str, port: int, user: str | None, timeout: float) -> tuple[Fault, str]:
    """The fault and one sentence for a failed connect to user@host:port: ssh's own words first
    (what `ssh` prints for the same failure), then what to check."""
    fault = fault_of(e)
    where = f"{user}@{host}:{port}" if user else f"{host}:{port}"
    at = f"connect to host {host} port {port}: {fault.value}"
    if fault is Fault.HOST_KEY_CHANGED:
        return fault, (f"WARNING: {fault.value} for {e.hostname}: it presented {e.key.get_name()} "
                       f"{e.key.fingerprint}, known_hosts lists {e.expected_key.fingerprint}. Someone could be "
                       f"intercepting the connection, or the machine was reinstalled. If you know why, remove the "
                       f"old key with `ssh-keygen -R {e.hostname}` and add the new one; clusterctl refuses to "
                       f"connect until then.")
    if fault is Fault.AUTH:
        if "No authentication methods" in str(e):
            return fault, (f"{fault.value}: authentication failed for {where}, no key to offer. Set "
                           f"ssh.identity_file in the inventory, add the key to ssh-agent (ssh-add), or name it "
                           f"in ~/.ssh/config")
        return fault, (f"{fault.value}: authentication failed for {where}: add your public key to that user's "
                       f"~/.ssh/authorized_keys (ssh-copy-id), or set ssh.user / ssh.identity_file in the inventory")
    if fault is Fault.UNRESOLVED:
        return fault, f"{fault.value} {host}: {e.strerror or e} (check the inventory, ~/.ssh/config or /etc/hosts)"
    if fault is Fault.NO_ROUTE:
        return fault, f"{at} (the host is down, its link is cut, or the address is wrong)"
    if fault is Fault.NET_UNREACHABLE:
        return fault, f"{at} (this machine has no route to that network: check the address)"
    if fault is Fault.REFUSED:
        return fault, f"{at} (nothing listens there, or a firewall rejects it: is sshd running, on port {port}?)"
    if fault is Fault.TIMED_OUT:
        return fault, (f"{at} after {timeout:g}s (the host is down, the address is wrong, or a firewall drops "
                       f"port {port})")
    if fault is Fault.HANDSHAKE:
        return fault, f"{fault.value} with {where}: {e}"
    return fault, f"cannot connect to {where}: {type(e).__name__}: {e}"
