"""ping: ICMP echo from the control machine to every node at once, one socket per address family.

An ICMP datagram socket (Linux ping sockets, allowed by net.ipv4.ping_group_range, which covers
ICMPv6 too) or a raw one (root) sends all echoes and collects the replies with one select loop;
without either, `ping -c1` per node (bounded threads; ping picks IPv4 or IPv6 from the address).
A node that answers SSH but not ICMP is a warn."""

from __future__ import annotations

import os
import select
import socket
import struct
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from orchestrator.checks import CheckResult, fail, ok, warn
from orchestrator.transport import DEFAULT_FANOUT


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


# per address family: (protocol, echo request type, echo reply type)
_ICMP = {socket.AF_INET: (socket.IPPROTO_ICMP, 8, 0), socket.AF_INET6: (socket.IPPROTO_ICMPV6, 128, 129)}


def _echo(ident: int, seq: int, family: int = socket.AF_INET) -> bytes:
    payload = struct.pack("!d", time.monotonic())
    kind = _ICMP[family][1]
    hdr = struct.pack("!BBHHH", kind, 0, 0, ident, seq)
    # ICMPv6's checksum covers a pseudo-header only the kernel knows: it fills that one in
    csum = _checksum(hdr + payload) if family == socket.AF_INET else 0
    return struct.pack("!BBHHH", kind, 0, csum, ident, seq) + payload


def _open_socket(family: int = socket.AF_INET) -> tuple[socket.socket, bool] | None:
    for kind, raw in ((socket.SOCK_DGRAM, False), (socket.SOCK_RAW, True)):
        try:
            return socket.socket(family, kind, _ICMP[family][0]), raw
        except OSError:
            continue
    return None


def _resolve(host: str) -> tuple[int, str] | None:
    """(address family, address) of host as a connection to it would use it (getaddrinfo's first)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        if family in _ICMP:
            return family, sockaddr[0]
    return None


class _Round:
    """One ICMP echo exchange over one socket per address family, matched by (family, seq)."""

    def __init__(self, by_addr: dict[tuple[int, str], list[str]], socks: dict[int, tuple[socket.socket, bool]],
                 rtts: dict[str, float | None]):
        self.by_addr, self.socks, self.rtts = by_addr, socks, rtts
        self.ident = os.getpid() & 0xFFFF
        self.seq_of: dict[tuple[int, int], str] = {}
        self.sent_at: dict[tuple[int, int], float] = {}
        self.family_of = {s.fileno(): f for f, (s, _) in socks.items()}

    def pending(self) -> bool:
        return any(self.rtts[h] is None for hs in self.by_addr.values() for h in hs)

    def send(self, attempt: int) -> None:
        for i, ((family, a), hs) in enumerate(self.by_addr.items()):
            if all(self.rtts[h] is not None for h in hs):
                continue
            seq = (attempt * len(self.by_addr) + i) & 0xFFFF
            self.seq_of[family, seq] = a
            self.sent_at[family, seq] = time.monotonic()
            try:
                self.socks[family][0].sendto(_echo(self.ident, seq, family), (a, 0))
            except OSError:
                pass

    def receive(self, sock: socket.socket) -> None:
        family = self.family_of[sock.fileno()]
        raw = self.socks[family][1]
        try:
            data, src = sock.recvfrom(2048)
        except OSError:
            return
        if raw and family == socket.AF_INET:
            data = data[(data[0] & 0x0F) * 4:]  # a raw IPv4 socket keeps the IP header
        if len(data) < 8 or data[0] != _ICMP[family][2]:
            return
        _, _, _, rid, rseq = struct.unpack("!BBHHH", data[:8])
        if (raw and rid != self.ident) or self.seq_of.get((family, rseq)) != src[0]:
            return
        rtt = time.monotonic() - self.sent_at[family, rseq]
        for h in self.by_addr.get((family, src[0]), []):
            if self.rtts[h] is None:
                self.rtts[h] = rtt

    def wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.pending():
            ready, _, _ = select.select([s for s, _ in self.socks.values()], [], [],
                                        max(0.0, deadline - time.monotonic()))
            if not ready:
                return
            for sock in ready:
                self.receive(sock)


def ping_all(hosts: list[str], timeout: float = 1.0, tries: int = 2) -> dict[str, float | None]:
    """host -> round trip in seconds, or None (no reply within timeout). IPv4 and IPv6 hosts
    alike: one ICMP socket per address family for all hosts, `ping` processes without one."""
    rtts: dict[str, float | None] = {h: None for h in hosts}
    by_addr: dict[tuple[int, str], list[str]] = {}
    for h in hosts:
        resolved = _resolve(h)
        if resolved is not None:
            by_addr.setdefault(resolved, []).append(h)
    socks: dict[int, tuple[socket.socket, bool]] = {}
    for family in sorted({f for f, _ in by_addr}):
        opened = _open_socket(family)
        if opened is not None:
            socks[family] = opened
    no_socket = [h for (f, _), hs in by_addr.items() if f not in socks for h in hs]
    if no_socket:
        rtts.update(_ping_processes(no_socket, timeout))
    exchange = _Round({k: hs for k, hs in by_addr.items() if k[0] in socks}, socks, rtts)
    try:
        for s, _ in socks.values():
            s.setblocking(False)
        for attempt in range(tries if exchange.by_addr else 0):
            exchange.send(attempt)
            exchange.wait(timeout / tries)
    finally:
        for s, _ in socks.values():
            s.close()
    return rtts


def _ping_processes(hosts: list[str], timeout: float) -> dict[str, float | None]:
    def one(h):
        t0 = time.monotonic()
        try:
            r = subprocess.run(["ping", "-n", "-c1", f"-W{max(1, int(timeout + 0.999))}", h.strip("[]")],
                               capture_output=True, timeout=timeout + 2)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return time.monotonic() - t0 if r.returncode == 0 else None

    with ThreadPoolExecutor(max_workers=min(DEFAULT_FANOUT, max(1, len(hosts)))) as ex:
        return dict(zip(hosts, ex.map(one, hosts)))


def ping_result(host: str, rtt: float | None, ssh_ok: bool) -> CheckResult:
    if rtt is not None:
        return ok("ping", f"{rtt * 1000:.1f} ms")
    if ssh_ok:
        return warn("ping", f"no ICMP echo reply from {host}, but SSH works (ICMP blocked?)")
    return fail("ping", f"no ICMP echo reply from {host} and no SSH",
                f"check that {host} is up and the address is right")
