"""ping: ICMP echo from the control machine to every node at once, from one socket.

An ICMP datagram socket (Linux ping sockets, allowed by net.ipv4.ping_group_range) or a raw
one (root) sends all echoes and collects the replies with one select loop; without either,
`ping -c1` per node (bounded threads). A node that answers SSH but not ICMP is a warn."""

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


def _echo(ident: int, seq: int) -> bytes:
    payload = struct.pack("!d", time.monotonic())
    hdr = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
    return struct.pack("!BBHHH", 8, 0, _checksum(hdr + payload), ident, seq) + payload


def _open_socket() -> tuple[socket.socket, bool] | None:
    for kind, raw in ((socket.SOCK_DGRAM, False), (socket.SOCK_RAW, True)):
        try:
            return socket.socket(socket.AF_INET, kind, socket.IPPROTO_ICMP), raw
        except OSError:
            continue
    return None


def ping_all(hosts: list[str], timeout: float = 1.0, tries: int = 2) -> dict[str, float | None]:
    """host -> round trip in seconds, or None (no reply within timeout)."""
    addrs: dict[str, str] = {}
    for h in hosts:
        try:
            addrs[h] = socket.gethostbyname(h.strip("[]"))
        except OSError:
            pass
    opened = _open_socket()
    if opened is None:
        return _ping_processes(hosts, timeout)
    sock, raw = opened
    ident = os.getpid() & 0xFFFF
    seq_of = {}
    sent_at = {}
    rtts: dict[str, float | None] = {h: None for h in hosts}
    by_addr: dict[str, list[str]] = {}
    for h, a in addrs.items():
        by_addr.setdefault(a, []).append(h)
    try:
        sock.setblocking(False)
        for attempt in range(tries):
            for i, (a, hs) in enumerate(by_addr.items()):
                if all(rtts[h] is not None for h in hs):
                    continue
                seq = (attempt * len(by_addr) + i) & 0xFFFF
                seq_of[seq] = a
                sent_at[seq] = time.monotonic()
                try:
                    sock.sendto(_echo(ident, seq), (a, 0))
                except OSError:
                    pass
            deadline = time.monotonic() + timeout / tries
            while time.monotonic() < deadline and any(v is None for v in rtts.values()):
                r, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
                if not r:
                    break
                try:
                    data, (src, _) = sock.recvfrom(2048)
                except OSError:
                    continue
                if raw:
                    data = data[(data[0] & 0x0F) * 4:]
                if len(data) < 8 or data[0] != 0:
                    continue
                _, _, _, rid, rseq = struct.unpack("!BBHHH", data[:8])
                if (raw and rid != ident) or seq_of.get(rseq) != src:
                    continue
                rtt = time.monotonic() - sent_at[rseq]
                for h in by_addr.get(src, []):
                    if rtts[h] is None:
                        rtts[h] = rtt
    finally:
        sock.close()
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
