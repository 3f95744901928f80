"""firewall: ufw / firewalld / nftables / iptables summarised; warns when rules could drop the
rendezvous port (master_port) or NCCL's ephemeral ports. port_reachable is the real test;
this says *why* and what to run."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from orchestrator.checks import Check, CheckResult, Ctx, Probe, first_line, ok, sections, skip, warn

_DENIED = ("permission denied", "you need to be root", "must be root", "operation not permitted",
           "authorization failed", "not authorized")


@dataclass
class Facts:
    tool: str
    active: bool
    readable: bool = True
    blocks_port: list[str] = field(default_factory=list)  # rules that drop/reject master_port
    default_drop: bool = False  # incoming policy drops what no rule accepts
    allows_port: bool = False  # an accept rule covers master_port
    allows_all: bool = False  # an accept rule covers every port (a trusted subnet, an interface)
    summary: str = ""


def _ports_cover(spec: str, port: int) -> bool:
    """'29500', '29500:29510', '29000-30000', '{ 22, 29500 }', '22,29500' cover port?"""
    for part in re.split(r"[,\s{}]+", spec):
        part = part.strip()
        if not part:
            continue
        m = re.match(r"^(\d+)(?:[:-](\d+))?$", part)
        if m and int(m.group(1)) <= port <= int(m.group(2) or m.group(1)):
            return True
    return False


def parse_ufw(text: str, port: int) -> Facts:
    """`ufw status verbose`."""
    low = text.lower()
    if any(d in low for d in _DENIED):
        return Facts("ufw", False, readable=False, summary="ufw: needs root to read")
    if "status: inactive" in low:
        return Facts("ufw", False, summary="ufw inactive")
    f = Facts("ufw", "status: active" in low)
    m = re.search(r"^Default:\s*(\w+) \(incoming\)", text, re.M)
    f.default_drop = bool(m and m.group(1).lower() in ("deny", "reject"))
    for line in text.splitlines():
        m = re.match(r"^(\S+(?: \(v6\))?)\s+(ALLOW|DENY|REJECT|LIMIT)(?: IN)?\s+(.+)$", line.strip())
        if not m:
            continue
        to, action = m.group(1), m.group(2)
        to_port = to.split("/")[0].replace(" (v6)", "")
        covers = to_port == "Anywhere" or _ports_cover(to_port, port)
        if action in ("ALLOW", "LIMIT") and to_port == "Anywhere":
            f.allows_all = True
        if action in ("ALLOW", "LIMIT") and covers:
            f.allows_port = True
        if action in ("DENY", "REJECT") and covers and to_port != "Anywhere":
            f.blocks_port.append(line.strip())
    f.summary = f"ufw active, incoming {'deny' if f.default_drop else 'allow'} by default"
    return f


def parse_ufw_conf(text: str) -> Facts:
    """`grep ^ENABLED= /etc/ufw/ufw.conf`: what a user without root can learn of ufw."""
    m = re.search(r"^ENABLED=\s*['\"]?(\w+)", text, re.M)
    if m is None:
        return Facts("ufw", False, readable=False, summary=f"ufw: {first_line(text) or 'no ENABLED= in ufw.conf'}")
    if m.group(1).lower() == "yes":
        return Facts("ufw", True, readable=False, summary="ufw enabled (its rules need root to read)")
    return Facts("ufw", False, summary="ufw disabled (ENABLED=no in /etc/ufw/ufw.conf)")


def parse_firewalld(state: str, listing: str, port: int) -> Facts:
    """`firewall-cmd --state` and `firewall-cmd --list-all`."""
    if "running" not in state or "not running" in state:
        return Facts("firewalld", False, summary="firewalld not running")
    if any(d in listing.lower() for d in _DENIED):
        return Facts("firewalld", True, readable=False, summary="firewalld running (rules need root)")
    f = Facts("firewalld", True, default_drop=True)
    kv = {}
    for line in listing.splitlines():
        k, sep, v = line.strip().partition(":")
        if sep:
            kv[k.strip()] = v.strip()
    if kv.get("target", "").upper() in ("ACCEPT",):
        f.default_drop = False
    if kv.get("sources") or kv.get("interfaces") and kv.get("target", "").upper() == "ACCEPT":
        f.allows_all = bool(kv.get("sources")) or f.allows_all
    for spec in kv.get("ports", "").split():
        if spec.endswith("/tcp") and _ports_cover(spec[:-4], port):
            f.allows_port = True
    if f"port=\"{port}\"" in kv.get("rich rules", "") or f"port port=\"{port}\"" in listing:
        f.allows_port = True
    f.summary = f"firewalld running, zone {listing.split()[0] if listing.split() else '?'}"
    return f


def _rule_lines_nft(text: str):
    chain, hook_input, policy = None, False, None
    for raw in text.splitlines():
        line = raw.strip()
        m = re.match(r"^chain (\S+) \{", line)
        if m:
            chain, hook_input, policy = m.group(1), False, None
            continue
        if line.startswith("type filter hook"):
            hook_input = " hook input " in f" {line} "
            pm = re.search(r"policy (\w+)", line)
            policy = pm.group(1) if pm else "accept"
            yield chain, hook_input, policy, None
            continue
        if chain and line and not line.startswith(("}", "table", "type")):
            yield chain, hook_input, policy, line


def parse_nft(text: str, port: int) -> Facts:
    """`nft list ruleset`: input-hook chains' policies, and rules on `tcp dport`."""
    low = text.lower()
    if any(d in low for d in _DENIED):
        return Facts("nftables", False, readable=False, summary="nftables: needs root to read")
    if not text.strip():
        return Facts("nftables", False, summary="nftables: no rules")
    f = Facts("nftables", True)
    input_chains = set()
    for chain, is_input, policy, rule in _rule_lines_nft(text):
        if rule is None:
            if is_input:
                input_chains.add(chain)
                if policy == "drop":
                    f.default_drop = True
            continue
        verdict = re.search(r"\b(accept|drop|reject)\b", rule)
        if not verdict:
            continue
        m = re.search(r"dport (\{[^}]*\}|\S+)", rule)
        if m and _ports_cover(m.group(1), port):
            if verdict.group(1) == "accept":
                f.allows_port = True
            else:
                f.blocks_port.append(rule)
        elif not m and verdict.group(1) == "accept" and chain in input_chains and \
                ("saddr" in rule or "iifname" in rule or "iif " in rule) and "ct state" not in rule \
                and not re.search(r'iif(?:name)? "?lo"?\b', rule):
            f.allows_all = True
    f.summary = "nftables: input policy drop" if f.default_drop else "nftables rules present"
    return f


def parse_iptables_save(text: str, port: int) -> Facts:
    """`iptables-save`: INPUT policy and rules whose --dport/--dports cover master_port."""
    low = text.lower()
    if any(d in low for d in _DENIED):
        return Facts("iptables", False, readable=False, summary="iptables: needs root to read")
    f = Facts("iptables", False)
    for line in text.splitlines():
        if line.startswith(":INPUT "):
            f.active = True
            f.default_drop = line.split()[1] in ("DROP", "REJECT")
        if not line.startswith("-A INPUT"):
            continue
        f.active = True
        target = re.search(r"-j (\w+)", line)
        m = re.search(r"--dports? (\S+)", line)
        if target is None:
            continue
        t = target.group(1)
        if m and _ports_cover(m.group(1), port):
            if t == "ACCEPT":
                f.allows_port = True
            elif t in ("DROP", "REJECT"):
                f.blocks_port.append(line)
        elif not m and t == "ACCEPT" and ("-s " in line or "-i " in line) and "--state" not in line \
                and "--ctstate" not in line and "-i lo" not in line:
            f.allows_all = True
    f.summary = "iptables: INPUT policy drop" if f.default_drop else (
        "iptables rules present" if f.active and (f.blocks_port or f.allows_port) else "iptables: no INPUT rules")
    return f


def facts_from_probe(text: str, port: int) -> list[Facts]:
    out = []
    secs = {s.name: s for s in sections(text)}
    if "ufw" in secs:
        out.append(parse_ufw(secs["ufw"].body, port))
    elif "ufw-conf" in secs:
        out.append(parse_ufw_conf(secs["ufw-conf"].body))
    if "firewalld-state" in secs:
        out.append(parse_firewalld(secs["firewalld-state"].body,
                                   secs["firewalld"].body if "firewalld" in secs else "", port))
    if "nft" in secs:
        s = secs["nft"]
        out.append(parse_nft(s.body, port) if s.rc in (0, None) or any(d in s.body.lower() for d in _DENIED)
                   else Facts("nftables", False, readable=False, summary=f"nft: {first_line(s.body)}"))
    if "iptables" in secs:
        s = secs["iptables"]
        out.append(parse_iptables_save(s.body, port) if s.rc in (0, None) or
                   any(d in s.body.lower() for d in _DENIED)
                   else Facts("iptables", False, readable=False, summary=f"iptables: {first_line(s.body)}"))
    return out


def parse_firewall(text: str, ctx: Ctx) -> CheckResult:
    port = ctx.port
    facts = facts_from_probe(text, port)
    if not facts:
        return ok("firewall", "no ufw/firewalld/nft/iptables on the node")
    readable = [f for f in facts if f.readable]
    if not readable:
        known = "".join(f"{f.summary}; " for f in facts if f.active)
        return skip("firewall", known + "rules not readable without root (" + ", ".join(f.tool for f in facts)
                    + "); port_reachable tests the real path")
    blocks = [r for f in readable for r in f.blocks_port]
    tool = readable[0].tool
    if blocks:
        fix = {"ufw": f"sudo ufw allow {port}/tcp",
               "firewalld": f"sudo firewall-cmd --permanent --add-port={port}/tcp && sudo firewall-cmd --reload",
               }.get(tool, f"remove the rule: `sudo iptables -D INPUT {blocks[0][len('-A INPUT '):]}`"
                     if blocks[0].startswith("-A INPUT") else f"remove the rule dropping {port} (`sudo nft -a list ruleset`)")
        return warn("firewall", f"a rule drops/rejects {port}: {blocks[0][:120]}", fix)
    dropping = [f for f in readable if f.active and f.default_drop]
    if dropping and not any(f.allows_all for f in readable):
        d = dropping[0]
        if not any(f.allows_port for f in readable):
            return warn("firewall", f"{d.summary}; nothing accepts {port} or NCCL's ephemeral ports",
                        f"allow the cluster's subnet: `sudo ufw allow from <subnet>` (or at least "
                        f"`sudo ufw allow {port}/tcp`)" if d.tool == "ufw" else
                        f"accept TCP {port} and the peers' subnet in the input chain")
        return warn("firewall", f"{d.summary}; {port} accepted, but NCCL's ephemeral ports are not",
                    "allow the other nodes' subnet (NCCL opens random ports): "
                    + ("`sudo ufw allow from <subnet>`" if d.tool == "ufw" else "accept its saddr in the input chain"))
    active = [f.summary for f in readable if f.active] or [readable[0].summary]
    return ok("firewall", "; ".join(active))


# sudo only when it asks for no password; ufw (a Python program, ~0.1 s) is not run without
# root: it would only say it needs root, and its config says whether it is on.
RULES = Probe("firewall", r"""sudo=""
if [ "$(id -u)" != 0 ] && has sudo && sudo -n true >/dev/null 2>&1; then sudo="sudo -n"; fi
if has ufw; then
  if [ "$(id -u)" = 0 ] || [ -n "$sudo" ]; then
    echo "@@ufw"; $sudo ufw status verbose 2>&1; echo "@@rc $?"
  else
    echo "@@ufw-conf"; grep '^ENABLED=' /etc/ufw/ufw.conf 2>&1; echo "@@rc $?"
  fi
fi
if has firewall-cmd; then
  echo "@@firewalld-state"; firewall-cmd --state 2>&1; echo "@@rc $?"
  echo "@@firewalld"; $sudo firewall-cmd --list-all 2>&1; echo "@@rc $?"
fi
if has nft; then echo "@@nft"; $sudo nft list ruleset 2>&1; echo "@@rc $?"; fi
if has iptables-save; then echo "@@iptables"; $sudo iptables-save 2>&1; echo "@@rc $?"; fi
""")

FIREWALL = Check(
    "firewall", "no ufw/firewalld/nftables/iptables rule drops master_port or NCCL's ports",
    "allow the other nodes' subnet in the firewall (NCCL opens random ports)",
    probes=(RULES,), parse=parse_firewall)
