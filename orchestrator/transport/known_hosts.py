"""Host-key verification against known_hosts, deciding as OpenSSH's StrictHostKeyChecking does.

The file is parsed by asyncssh's known_hosts module: plain and hashed (`|1|`) host fields,
`[host]:port`, `*`/`?` patterns with `!negation`, several keys per host, and the @revoked and
@cert-authority markers. It is parsed once per change of the file (cached by inode, size and
mtime); each connection then matches only its own host name (a dict lookup for plain names, one
test per pattern or hashed line), so 256 connections over a 256-line file cost 256 lookups, not
256 parses. Two things are adjusted so the answer is OpenSSH's, not asyncssh's: names compare
case-insensitively, and a pattern with `/` (asyncssh reads it as a CIDR block, OpenSSH as a name
that never matches) or an empty one is dropped.

The decision on the key a node presents follows OpenSSH's check_host_key (sshconnect.c):
  the key is @revoked for this host     -> refused (HostKeyError), even if another line lists it
  a plain line for the host lists it    -> accepted
  the host has plain lines, none with it -> changed: paramiko.BadHostKeyException (whatever the
                                           key types: OpenSSH says "changed" too)
  nothing listed (new)                  -> off port 22, "[host]:port" is new but the bare host
                                           lists the key: accepted, as ssh does. Otherwise
                                           appended with --accept-new-host-keys, else refused
                                           with the ssh-keyscan remedy. When a @cert-authority
                                           line matches, the refusal says that clusterctl does
                                           not verify host certificates (paramiko negotiates the
                                           plain key) and names the line.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import paramiko

from orchestrator.errors import HostKeyError

_lock = threading.Lock()
_cache: dict[Path, "_Parsed"] = {}

# paramiko's names for the host-key algorithms that verify each key type
_ALGORITHMS = {"ssh-rsa": ("rsa-sha2-512", "rsa-sha2-256")}


@dataclass(frozen=True)
class _Parsed:
    stamp: tuple[int, int, int]
    lines: tuple[tuple[int, str], ...]  # (line number, text) of every entry line
    table: object  # asyncssh.known_hosts.SSHKnownHosts


@dataclass(frozen=True)
class HostEntries:
    """What one known_hosts file says about one host name ("host" or "[host]:port")."""

    path: Path
    name: str
    keys: tuple[bytes, ...] = ()  # plain entries (SSH wire blobs), in file order
    revoked: frozenset[bytes] = frozenset()
    cert_authority_lines: tuple[int, ...] = ()  # line numbers of matching @cert-authority lines
    bare: "HostEntries | None" = None  # for "[host]:port", the entries for "host"

    def status(self, blob: bytes) -> str:
        """OpenSSH's verdict on a key for this name alone: revoked, ok, changed or new."""
        if blob in self.revoked:
            return "revoked"
        if blob in self.keys:
            return "ok"
        return "changed" if self.keys else "new"

    def disabled_algorithms(self) -> dict[str, list[str]]:
        """paramiko's `disabled_algorithms` that make the handshake use a key type this file
        lists for the host (OpenSSH puts those types first; paramiko can only be restricted).
        Empty when nothing is listed or paramiko knows none of the listed types."""
        offered = tuple(paramiko.Transport._preferred_keys)
        wanted = {alg for k in self.keys for alg in _ALGORITHMS.get(_key_type(k), (_key_type(k),))}
        if not wanted & set(offered):
            return {}
        return {"keys": [alg for alg in offered if alg not in wanted]}

    def line_of(self, blob: bytes, marker: str = "") -> int | None:
        """The first line listing this key (with this marker), for messages."""
        import base64

        b64 = base64.b64encode(blob).decode()
        parsed = _cache.get(self.path)
        for lineno, text in parsed.lines if parsed else ():
            if b64 in text.split() and (text.startswith(marker) if marker else not text.startswith("@")):
                return lineno
        return None


def host_entries(path: Path, name: str) -> HostEntries:
    """The entries of known_hosts `path` that apply to `name` ("host", or "[host]:port" off
    port 22, then with the bare host's entries as `bare`); none when the file is missing."""
    parsed = _load(path)
    if parsed is None:
        return HostEntries(path, name)
    keys, cas, revoked, *_ = parsed.table.match(name.lower(), "", None)
    ca_lines = tuple(ln for ln in (HostEntries(path, name).line_of(k.public_data, "@cert-authority")
                                   for k in cas) if ln is not None)
    bare = host_entries(path, name[1:].rsplit("]:", 1)[0]) if name.startswith("[") else None
    return HostEntries(path, name, tuple(k.public_data for k in keys),
                       frozenset(k.public_data for k in revoked), ca_lines, bare)


def known_host_keys(path: Path, name: str) -> list[paramiko.PKey]:
    """The keys listed on plain (unmarked) lines for `name`, in file order; [] when the file
    does not exist. A damaged line is skipped, as ssh does."""
    return [paramiko.PKey.from_type_string(_key_type(b), b) for b in host_entries(path, name).keys]


def _load(path: Path) -> _Parsed | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    with _lock:  # one parse per change, however many connections ask at once
        parsed = _cache.get(path)
        if parsed is None or parsed.stamp != stamp:
            from asyncssh.known_hosts import SSHKnownHosts

            table, lines = SSHKnownHosts(), []
            with open(path, encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    line = _as_openssh_reads_it(line.strip())
                    if line is None:
                        continue
                    try:
                        table.load(line)
                    except ValueError:
                        continue  # a damaged line (bad marker, bad hash, one field) is skipped
                    lines.append((lineno, line))
            parsed = _cache[path] = _Parsed(stamp, tuple(lines), table)
    return parsed


def _as_openssh_reads_it(line: str) -> str | None:
    """The line with its host patterns as OpenSSH matches them: lowercase, and without the
    patterns that can never match a host name (empty ones, and `/`, which OpenSSH does not
    read as a CIDR block in known_hosts); None for a comment, blank or hopeless line."""
    if not line or line.startswith("#"):
        return None
    marker = ""
    if line.startswith("@"):
        fields = line.split(None, 1)
        if len(fields) < 2:
            return None  # a marker alone
        marker, line = fields[0] + " ", fields[1]
    fields = line.split(None, 1)
    if len(fields) < 2:
        return None
    hosts, data = fields
    if not hosts.startswith("|"):
        hosts = ",".join(p for p in hosts.lower().split(",") if p.lstrip("!") and "/" not in p)
        if not hosts:
            return None
    return f"{marker}{hosts} {data}"


def _key_type(blob: bytes) -> str:
    (n,) = struct.unpack(">I", blob[:4])
    return blob[4:4 + n].decode("ascii", "replace")


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Decides on every key a hop presents (its client holds no keys of its own, so paramiko
    always asks here). `accept_new` = StrictHostKeyChecking=accept-new."""

    def __init__(self, node: str, port: int, entries: HostEntries, accept_new: bool):
        self.node, self.port, self.entries, self.accept_new = node, port, entries, accept_new

    def missing_host_key(self, client, hostname, key):
        e, blob, kind = self.entries, key.asbytes(), key.get_name()
        fp = key.fingerprint
        status = e.status(blob)
        if status == "new" and e.bare is not None and e.bare.status(blob) == "ok":
            return  # ssh's "found matching key w/out port"
        if status == "revoked":
            line = e.line_of(blob, "@revoked")
            raise HostKeyError(
                self.node,
                f"REVOKED HOST KEY for {hostname}: {e.path}{f' line {line}' if line else ''} marks its "
                f"{kind} key ({fp}) @revoked, so clusterctl refuses it, as ssh does, even though another "
                f"line may list it. A stolen key may be impersonating this host; if the host got a new "
                f"key, install it there and list it in {e.path}.", verdict="revoked", fingerprint=fp)
        if status == "ok":
            return
        if status == "changed":
            listed = [k for k in e.keys if _key_type(k) == kind] or list(e.keys)
            try:
                expected = paramiko.PKey.from_type_string(_key_type(listed[0]), listed[0])
            except Exception:  # noqa: BLE001 - a key type paramiko cannot load: say it in words
                raise HostKeyError(self.node, f"WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED for {hostname}: it "
                                   f"presented {kind} {fp}, which {e.path} does not list for it "
                                   f"(it lists {_key_type(listed[0])}). clusterctl refuses to connect "
                                   f"until the file is corrected.", verdict="changed", fingerprint=fp) from None
            raise paramiko.BadHostKeyException(hostname, key, expected)
        if self.accept_new:
            with _lock:
                e.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                with open(e.path, "a") as f:
                    f.write(f"{hostname} {kind} {key.get_base64()}\n")
            return
        host = hostname[1:].rsplit("]:", 1)[0] if hostname.startswith("[") else hostname
        port_opt = f"-p {self.port} " if self.port != 22 else ""
        remedy = (f"    ssh-keyscan {port_opt}-t {kind} {host} >> {e.path}\n"
                  f"or trust keys on first use with --accept-new-host-keys.")
        if e.cert_authority_lines:
            lines = ", ".join(map(str, e.cert_authority_lines))
            raise HostKeyError(
                self.node,
                f"host key for {hostname} ({kind} {fp}) is not listed in {e.path}; its line {lines} "
                f"names a @cert-authority for this host, but clusterctl does not verify host "
                f"certificates (not supported: paramiko negotiates the plain host key). List the host's "
                f"own key after checking its fingerprint:\n{remedy}", fingerprint=fp)
        raise HostKeyError(
            self.node,
            f"Host key verification failed: unknown host key for {hostname} ({kind} {fp}). clusterctl "
            f"verifies host keys like ssh does. Check the fingerprint, then add it with:\n{remedy}", fingerprint=fp)
