"""port_free, port_reachable and iface: `ss -Hltnp` (or /proc/net/tcp), a worker's connect to
the master, `ip -j addr` / `ip -j route get`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from orchestrator.checks import CheckResult, Ctx, fail, first_line, ok, section, sections, skip, warn


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    pid: int | None = None
    command: str | None = None


_USERS = re.compile(r'\("([^"]*)",pid=(\d+)')


def parse_ss(text: str) -> list[Listener]:
    """`ss -Hltnp`: `LISTEN 0 128 0.0.0.0:22 0.0.0.0:* users:(("sshd",pid=1,fd=3))`; the users
    part is missing for other users' sockets when not root."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) < 4 or not f[0].startswith("LISTEN"):
            continue
        local = f[3]
        addr, _, port = local.rpartition(":")
        if not port.isdigit():
            continue
        users = _USERS.findall(line)
        if users:
            for name, pid in users:
                out.append(Listener(addr, int(port), int(pid), name))
        else:
            out.append(Listener(addr, int(port)))
    return out


def _hex_addr(h: str) -> str:
    if len(h) == 8:
        b = bytes.fromhex(h)[::-1]
        return ".".join(str(x) for x in b)
    words = [bytes.fromhex(h[i:i + 8])[::-1].hex() for i in range(0, 32, 8)]
    full = "".join(words)
    return "[" + ":".join(full[i:i + 4] for i in range(0, 32, 4)) + "]"


def parse_proc_net_tcp(text: str, owners: dict[int, tuple[int, str | None]] | None = None) -> list[Listener]:
    """/proc/net/tcp(6) rows in state 0A (LISTEN); owners: inode -> (pid, command)."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) < 10 or f[3] != "0A" or ":" not in f[1]:
            continue
        h, _, p = f[1].partition(":")
        try:
            port, inode = int(p, 16), int(f[9])
            addr = _hex_addr(h)
        except ValueError:
            continue
        pid, cmd = (owners or {}).get(inode, (None, None))
        out.append(Listener(addr, port, pid, cmd))
    return out


def listeners_from_probe(text: str) -> list[Listener] | None:
    ss = section(text, "ss")
    if ss is not None and ss.rc in (0, None):
        return parse_ss(ss.body)
    owners = {}
    for s in sections(text):
        if s.name == "sockowner":
            pid, _, ino = s.arg.partition(" ")
            if pid.isdigit() and ino.strip().isdigit():
                owners[int(ino)] = (int(pid), s.body.strip() or None)
    tcp = section(text, "proc-net-tcp")
    return parse_proc_net_tcp(tcp.body, owners) if tcp is not None else None


def parse_port_free(text: str, ctx: Ctx) -> CheckResult:
    if not ctx.is_master:
        return skip("port_free", "only the master listens on master_port")
    found = listeners_from_probe(text)
    if found is None:
        return warn("port_free", "could not list listening sockets (no ss, no /proc/net/tcp)")
    port = ctx.port
    busy = [x for x in found if x.port == port and (x.pid is None or x.pid not in ctx.own_pids)]
    ours = [x for x in found if x.port == port and x.pid in ctx.own_pids]
    if busy and ours and all(x.pid is None for x in busy):
        busy = []  # our listener's socket, seen again without an owner
    if not busy:
        return ok("port_free", f"nothing else listens on {port}")
    who = "; ".join(f"pid {x.pid} ({x.command})" if x.pid else "a process of another user"
                    for x in busy[:3])
    kill = " ".join(str(x.pid) for x in busy if x.pid)
    remedy = (f"stop it on {ctx.node.name} (`kill {kill}`)" if kill
              else f"find it with `sudo ss -ltnp 'sport = :{port}'` on {ctx.node.name}")
    return fail("port_free", f"{port} already in use by {who}",
                remedy + f", or pick another master_port in the inventory")


# ------------------------------------------------------------------ port_reachable

def parse_port_reachable(text: str, ctx: Ctx) -> CheckResult:
    """A worker's connect to master:master_port (the @@connect section)."""
    if ctx.is_master:
        return skip("port_reachable", "the master is the listener")
    s = section(text, "connect")
    if s is None:
        return skip("port_reachable", "the probe did not try to connect")
    target = s.arg or f"master:{ctx.port}"
    target = target.replace(" ", ":")
    if s.rc == 0:
        return ok("port_reachable", f"connected to {target}")
    body = first_line(s.body)
    if s.rc == 124:
        why = "timed out: a firewall drops it"
    elif "refused" in body.lower():
        why = "connection refused: nothing listens there, or a firewall rejects it"
    elif "no route" in body.lower() or "unreachable" in body.lower():
        why = "no route to the master"
    elif s.rc == 127 or "neither" in body:
        return warn("port_reachable", f"cannot test the connect: {body or 'no bash/nc on the node'}")
    else:
        why = body or f"exit code {s.rc}"
    return fail("port_reachable", f"cannot connect to {target}: {why}",
                f"allow TCP {ctx.port} (and NCCL's ephemeral ports) from {ctx.node.name} on the master: "
                f"`sudo ufw allow from {ctx.node.address} to any port {ctx.port} proto tcp`")


def attribute_port_reachable(worker: dict[str, CheckResult], master_name: str, port: int,
                             listener_error: str | None = None) -> tuple[CheckResult, dict[str, CheckResult]]:
    """The master's verdict from the workers' connects. When every worker (two or more) fails
    the same way, the cause is on the master: it fails, the workers only warn, pointing at it."""
    if listener_error:
        return skip("port_reachable", listener_error), {
            k: skip("port_reachable", f"no test listener on {master_name}: {listener_error}") for k in worker}
    tried = {k: v for k, v in worker.items() if v.status in ("ok", "fail")}
    failed = {k: v for k, v in tried.items() if v.status == "fail"}
    if not tried:
        return skip("port_reachable", "no worker could try"), dict(worker)
    if not failed:
        return ok("port_reachable", f"{len(tried)}/{len(tried)} workers connected to {port}"), dict(worker)
    if len(failed) == len(tried) and len(tried) >= 2:
        why = next(iter(failed.values())).detail.split(": ", 1)[-1]
        master = fail("port_reachable", f"no worker can connect to {port} ({why})",
                      f"open TCP {port} and NCCL's ephemeral ports on {master_name}: "
                      f"`sudo ufw allow {port}/tcp` (or remove the DROP rule: `sudo iptables -S INPUT`)")
        return master, {k: warn("port_reachable", v.detail + f" (the master's side: see {master_name})")
                        if k in tried else v for k, v in worker.items()}
    master = ok("port_reachable", f"{len(tried) - len(failed)}/{len(tried)} workers connected; "
                                  f"failing: {', '.join(failed)}")
    return master, dict(worker)


# ------------------------------------------------------------------ iface

def parse_ip_addr(text: str) -> dict | None:
    """`ip -j addr show dev IFACE` -> its object, None when the tool says it does not exist."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data[0] if isinstance(data, list) and data else None


def parse_ip_route(text: str) -> dict | None:
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data[0] if isinstance(data, list) and data else None


def parse_iface(text: str, ctx: Ctx) -> CheckResult:
    iface = ctx.node.iface
    if not iface:
        return skip("iface", "no iface in the inventory (NCCL picks one itself)")
    s = section(text, "ip-addr")
    if s is None:
        return skip("iface", "not probed")
    if s.rc == 127 or "not found" in s.body and s.rc:
        return warn("iface", "`ip` (iproute2) is not installed on the node")
    info = parse_ip_addr(s.body) if s.rc in (0, None) else None
    names = f"{ctx.node.name}: `ip -br link`"
    if info is None:
        return fail("iface", f"{iface} does not exist ({first_line(s.body) or 'no such device'})",
                    f"set the node's iface to one listed by {names}; NCCL_SOCKET_IFNAME/"
                    f"GLOO_SOCKET_IFNAME={iface} would make rendezvous fail")
    flags = info.get("flags") or []
    state = info.get("operstate", "UNKNOWN")
    if "UP" not in flags or state in ("DOWN", "LOWERLAYERDOWN", "NOTPRESENT"):
        return fail("iface", f"{iface} is down (state {state})", f"`sudo ip link set {iface} up` on {ctx.node.name}")
    addrs = [a for a in info.get("addr_info") or [] if a.get("family") in ("inet", "inet6")
             and a.get("scope", "global") != "link"]
    if not addrs:
        return fail("iface", f"{iface} is up but has no address", f"configure an address on {iface} ({ctx.node.name})")
    addr = f"{addrs[0].get('local')}/{addrs[0].get('prefixlen')}"
    if ctx.is_master:
        return ok("iface", f"{iface} up, {addr}")
    r = next((x for x in sections(text) if x.name == "ip-route"), None)
    if r is None:
        return ok("iface", f"{iface} up, {addr} (route not checked)")
    route = parse_ip_route(r.body) if r.rc in (0, None) else None
    if route is None:
        return fail("iface", f"{iface} up, {addr}, but no route to the master {r.arg}: {first_line(r.body)}",
                    f"check the network between {ctx.node.name} and the master")
    dev = route.get("dev")
    if dev != iface:
        return fail("iface", f"{iface} up, {addr}, but the route to the master {r.arg} leaves through {dev}",
                    f"set iface: {dev} for {ctx.node.name} (export NCCL_SOCKET_IFNAME={dev} "
                    f"GLOO_SOCKET_IFNAME={dev}), or fix the routes")
    return ok("iface", f"{iface} up, {addr}, route to master via {dev}")
