"""port_free, port_reachable and iface: `ss -Hltnp` (or /proc/net/tcp), a worker's connect to
the master, `ip -j addr` / `ip -j route get` (or /sys/class/net without iproute2)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from orchestrator.checks import Check, CheckResult, Ctx, Probe, fail, first_line, ok, section, sections, skip, warn


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
        ss = section(text, "ss")
        why = (f"ss exited {ss.rc}: {first_line(ss.body) or 'no output'}" if ss is not None
               else "the probe did not run ss or read /proc/net/tcp")
        return warn("port_free", f"could not list listening sockets ({why})", unanswered=True)
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
                remedy + ", or pick another master_port in the inventory")


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
    # a refusal is asked again: the listener may have been late or gone early (a REJECT rule is
    # refused every time, and still fails). A timeout is not: no listener state makes a SYN go
    # unanswered for connect_timeout, a DROP rule does, and asking again would only wait again.
    unanswered = "refused" in body.lower()
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
                f"`sudo ufw allow from {ctx.node.address} to any port {ctx.port} proto tcp`", unanswered=unanswered)


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
        return master, {k: replace(v, status="warn", detail=v.detail + f" (the master's side: see {master_name})")
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
    sysfs = section(text, "sys-net")
    if s is None and sysfs is not None:
        return _iface_from_sysfs(iface, sysfs, ctx)
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
    unresolved = section(text, "unresolved")
    if r is None and unresolved is not None:
        # a scheduler's DNS name for the master can appear only once the master's pod is up;
        # port_reachable fails if it never does
        return warn("iface", f"{iface} up, {addr}; the master {unresolved.arg} does not resolve here (yet?)",
                    f"check the master's name from {ctx.node.name} (`getent ahosts {unresolved.arg}`)")
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


def _iface_from_sysfs(iface: str, s, ctx: Ctx) -> CheckResult:
    """/sys/class/net/IFACE/operstate, read where iproute2 is not installed (slim containers)."""
    state = first_line(s.body)
    if s.rc not in (0, None):
        return fail("iface", f"{iface} does not exist (no /sys/class/net/{iface})",
                    f"set the node's iface to one listed in /sys/class/net on {ctx.node.name}; "
                    f"NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME={iface} would make rendezvous fail")
    if state.lower() in ("down", "lowerlayerdown", "notpresent"):
        return fail("iface", f"{iface} is down (state {state})", f"`sudo ip link set {iface} up` on {ctx.node.name}")
    return ok("iface", f"{iface} {state} (no `ip` on the node: address and route not checked)")


# ------------------------------------------------------------------ probes and registration

SS = Probe("ss", r"""if has ss; then
  echo "@@ss"; ss -Hltnp 2>&1; echo "@@rc $?"
else
  echo "@@proc-net-tcp"; cat /proc/net/tcp /proc/net/tcp6 2>/dev/null
  hex=$(printf '%04X' "$port")
  for ino in $(awk -v p=":$hex" '$4 == "0A" && substr($2, length($2) - 4) == p { print $10 }' \
               /proc/net/tcp /proc/net/tcp6 2>/dev/null); do
    for fd in $(find /proc/[0-9]*/fd -lname "socket:\[$ino\]" 2>/dev/null); do
      pid=${fd#/proc/}; pid=${pid%%/*}
      echo "@@sockowner $pid $ino"
      tr '\000' ' ' < "/proc/$pid/cmdline" 2>/dev/null; echo
    done
  done
fi
""")

# $ct is 0 when the master's test listener did not start: nothing to connect to then.
CONNECT = Probe("connect", r"""if [ "$role" = worker ] && [ "$ct" != 0 ]; then
  echo "@@connect $master $port"
  if has bash && has timeout; then
    timeout "$ct" bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$master" "$port" 2>&1; echo "@@rc $?"
  elif has nc; then
    nc -z -w "$ct" "$master" "$port" 2>&1; echo "@@rc $?"
  else
    echo "@@rc 127"; echo "neither bash+timeout nor nc on the node"
  fi
fi
""")

IP = Probe("ip", r"""if [ -n "$iface" ] && has ip; then
  echo "@@ip-addr"; ip -j addr show dev "$iface" 2>&1; echo "@@rc $?"
  if [ "$role" != master ]; then
    dest=$master
    case $dest in *[!0-9.:]*) dest=$(getent ahosts "$dest" 2>/dev/null | awk 'NR == 1 { print $1 }') ;; esac
    if [ -n "$dest" ]; then
      echo "@@ip-route $dest"; ip -j route get "$dest" 2>&1; echo "@@rc $?"
    else
      echo "@@unresolved $master"
    fi
  fi
elif [ -n "$iface" ]; then
  echo "@@sys-net"; cat "/sys/class/net/$iface/operstate" 2>&1; echo "@@rc $?"
fi
""")

PORT_FREE = Check(
    "port_free", "nothing else listens on master_port on the master",
    "stop the process on master_port, or pick another master_port in the inventory",
    probes=(SS,), parse=parse_port_free, nodes="master", fast=True)
PORT_REACHABLE = Check(
    "port_reachable", "every worker can open a TCP connection to master:master_port",
    "allow TCP master_port (and NCCL's ephemeral ports) into the master",
    probes=(CONNECT,), parse=parse_port_reachable, fast=True)
IFACE = Check(
    "iface", "the inventory's iface exists, is up, has an address and routes to the master",
    "set `iface:` to the interface that reaches the master (`ip -br addr`)",
    probes=(IP,), parse=parse_iface)
