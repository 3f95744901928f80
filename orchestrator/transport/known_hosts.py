"""Host-key verification against known_hosts, the way ssh decides."""

from __future__ import annotations

import binascii
import threading
from pathlib import Path

import paramiko

from orchestrator.errors import HostKeyError

_known_hosts_lock = threading.Lock()
_known_hosts_cache: dict[Path, tuple[tuple[int, int, int], list[tuple[int, list[str], str]]]] = {}


def known_host_keys(path: Path, name: str) -> list[paramiko.PKey]:
    """The keys known_hosts lists for `name` ("host", or "[host]:port" off port 22), hashed
    entries included, in file order; [] when the file does not exist.

    paramiko's HostKeys.load checks every line against every earlier one, so each connection
    loading a 256-line known_hosts cost 50 ms of CPU, all of it again for every node (12 s for
    256 nodes). Here the file is split into lines once per change (cached by inode, size and
    mtime) and only the lines naming this host become key objects."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return []
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    with _known_hosts_lock:
        cached = _known_hosts_cache.get(path)
    if cached is None or cached[0] != stamp:
        lines = []
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if line and not line.startswith("#"):
                    lines.append((lineno, line.split(None, 1)[0].split(","), line))
        cached = (stamp, lines)
        with _known_hosts_lock:
            _known_hosts_cache[path] = cached
    keys = []
    for lineno, names, line in cached[1]:
        if not any(h == name or h.startswith("|1|") and _hashed_match(name, h) for h in names):
            continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line, lineno)
        except (paramiko.SSHException, paramiko.hostkeys.InvalidHostKey):
            continue  # a damaged line is skipped, as ssh does
        if entry is not None:
            keys.append(entry.key)
    return keys


def _hashed_match(name: str, entry: str) -> bool:
    import hmac

    try:
        return hmac.compare_digest(paramiko.HostKeys.hash_host(name, entry), entry)
    except (ValueError, TypeError, IndexError, binascii.Error):
        return False  # a malformed |1|salt|hash


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse unknown keys with the exact remedy; `accept_new` = StrictHostKeyChecking=accept-new."""

    def __init__(self, node: str, port: int, known_hosts: Path, accept_new: bool):
        self.node, self.port, self.known_hosts, self.accept_new = node, port, known_hosts, accept_new

    def missing_host_key(self, client, hostname, key):
        fp = key.fingerprint if hasattr(key, "fingerprint") else key.get_name()
        if self.accept_new:
            client.get_host_keys().add(hostname, key.get_name(), key)
            entry = f"{hostname} {key.get_name()} {key.get_base64()}\n"
            with _known_hosts_lock:
                self.known_hosts.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                with open(self.known_hosts, "a") as f:
                    f.write(entry)
            return
        host = hostname.strip("[]").rsplit("]:", 1)[0] if hostname.startswith("[") else hostname
        port_opt = f"-p {self.port} " if self.port != 22 else ""
        raise HostKeyError(
            self.node,
            f"unknown host key for {hostname} ({key.get_name()} {fp}). clusterctl verifies host keys "
            f"like ssh does. Check the fingerprint, then add it with:\n"
            f"    ssh-keyscan {port_opt}-t {key.get_name()} {host} >> {self.known_hosts}\n"
            f"or trust keys on first use with --accept-new-host-keys.")


