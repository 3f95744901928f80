"""An Ansible inventory (INI or YAML) -> a clusterctl inventory.

What is taken from each host: its inventory name, `ansible_host`, `ansible_user`,
`ansible_port`, `ansible_ssh_private_key_file` and `ansible_python_interpreter`; other variables
are left out (the header of the result says which). Variables apply as Ansible applies them, the
more specific winning: the `all` group, then the other groups the host is in (parents before
their children), then the host's own line or mapping.

Ansible's INI is not strict INI, so it is read line by line rather than with configparser:
`[group]` holds host lines (`name key=value ...`, values shell-quoted), `[group:vars]` holds
`key=value` lines, `[group:children]` names groups; `#` and `;` start comments; a host name may
hold a numeric range, `gpu[01:32]`, which becomes NodeSet's `gpu[01-32]`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import yaml

from orchestrator.errors import InventoryError
from orchestrator.inventory.fields import excerpt
from orchestrator.inventory.hosts import PORT_RULE, port_problem
from orchestrator.inventory.load import parse_inventory
from orchestrator.inventory.models import NAME_RE
from orchestrator.inventory.ranges import expand

# Ansible variable -> where it goes in a clusterctl node entry.
KEYS = {
    "ansible_host": ("host",),
    "ansible_user": ("ssh", "user"),
    "ansible_port": ("ssh", "port"),
    "ansible_ssh_private_key_file": ("ssh", "identity_file"),
    "ansible_python_interpreter": ("python",),
}
_ANSIBLE_RANGE = re.compile(r"\[(\d+):(\d+)(?::(\d+))?\]")


@dataclass
class Group:
    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> its own vars, in order
    vars: dict[str, Any] = field(default_factory=dict)
    children: list[str] = field(default_factory=list)


def _host_names(pattern: str, source: str, line: int | None) -> list[str]:
    """`gpu[01:04]` (Ansible's range) -> gpu01..gpu04; a plain name -> itself."""
    if "[" not in pattern:
        return [pattern]
    nodeset = _ANSIBLE_RANGE.sub(lambda m: f"[{m[1]}-{m[2]}{'/' + m[3] if m[3] else ''}]", pattern)
    try:
        return expand(nodeset, what="host range")
    except ValueError as e:
        raise InventoryError(f"{e} (only numeric ranges like gpu[01:32] are supported)", path=source,
                             line=line) from None


def parse_ini(text: str, source: str) -> dict[str, Group]:
    groups: dict[str, Group] = {"all": Group(), "ungrouped": Group()}
    section, kind = "ungrouped", "hosts"
    for ln, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            m = re.fullmatch(r"\[([^\]:\s]+)(?::(vars|children))?\]", line)
            if not m:
                raise InventoryError(f"cannot read section header {excerpt(line)}; expected [group], "
                                     f"[group:vars] or [group:children]", path=source, line=ln)
            section, kind = m[1], m[2] or "hosts"
            groups.setdefault(section, Group())
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError as e:
            raise InventoryError(f"cannot read {excerpt(line)}: {e}", path=source, line=ln) from None
        if not words:
            continue
        g = groups[section]
        if kind == "children":
            g.children.append(words[0])
            groups.setdefault(words[0], Group())
            continue
        pairs = words if kind == "vars" else words[1:]
        values = {}
        for w in pairs:
            key, eq, value = w.partition("=")
            if not eq or not key:
                raise InventoryError(f"expected key=value, got {excerpt(w)}", path=source, line=ln)
            values[key.strip()] = value
        if kind == "vars":
            g.vars.update(values)
        else:
            for name in _host_names(words[0], source, ln):
                g.hosts.setdefault(name, {}).update(values)
    return groups


def parse_yaml(doc: dict, source: str) -> dict[str, Group]:
    groups: dict[str, Group] = {"all": Group()}

    def walk(name: str, body: Any) -> None:
        g = groups.setdefault(name, Group())
        if body is None:
            return
        if not isinstance(body, dict):
            raise InventoryError(f"group {excerpt(name)} must be a mapping with hosts:, vars:, children:",
                                 path=source)
        for pattern, hvars in (body.get("hosts") or {}).items():
            for host in _host_names(str(pattern), source, None):
                g.hosts.setdefault(host, {}).update(hvars or {})
        g.vars.update(body.get("vars") or {})
        for child, cbody in (body.get("children") or {}).items():
            if child not in g.children:
                g.children.append(str(child))
            walk(str(child), cbody)

    for name, body in doc.items():
        walk(str(name), body)
    return groups


def _members(groups: dict[str, Group], name: str, seen: tuple[str, ...] = ()) -> list[tuple[str, list[str]]]:
    """Every host of `name` and its children as (host, [groups from `name` down to the host's own])."""
    if name in seen:
        raise InventoryError(f"group {excerpt(name)} is its own child ({' -> '.join(seen + (name,))})")
    g = groups[name]
    out = [(h, [name]) for h in g.hosts]
    for child in g.children:
        out += [(h, [name] + path) for h, path in _members(groups, child, seen + (name,))]
    return out


def to_nodes(groups: dict[str, Group], group: str, source: str) -> tuple[list[dict], set[str]]:
    """The hosts of `group` as clusterctl node entries, in the order Ansible lists them, and the
    variable names left out."""
    if group not in groups:
        known = ", ".join(sorted(g for g in groups if groups[g].hosts or groups[g].children))
        raise InventoryError(f"no group {excerpt(group)} in the Ansible inventory (groups: {known})",
                             path=source)
    if group == "all":  # every host is in `all`, whether or not its group is listed under it
        listed = groups["all"].children
        groups["all"].children = listed + [g for g in groups if g != "all" and g not in listed]
    paths: dict[str, list[str]] = {}
    for host, path in _members(groups, group):
        paths.setdefault(host, [])
        paths[host] += [p for p in path if p not in paths[host]]
    nodes, left_out = [], set()
    for host, path in paths.items():
        merged: dict[str, Any] = dict(groups["all"].vars)
        for gname in path:
            merged.update(groups[gname].vars)
        for gname in path:
            merged.update(groups[gname].hosts.get(host, {}))
        node: dict[str, Any] = {"name": host if NAME_RE.match(host) else re.sub(r"[^A-Za-z0-9._-]", "-", host)}
        node["host"] = host
        for key, value in merged.items():
            if key not in KEYS:
                left_out.add(key)
                continue
            where = KEYS[key]
            if where == ("ssh", "port"):
                value = _port(value, host, source)
            else:
                value = str(value)
            if len(where) == 1:
                node[where[0]] = value
            else:
                node.setdefault("ssh", {})[where[1]] = value
        nodes.append(node)
    if not nodes:
        raise InventoryError(f"group {excerpt(group)} has no hosts", path=source)
    return nodes, left_out


def _port(value: Any, host: str, source: str) -> int:
    """ansible_port as a number. An INI value is text, checked as the inventory checks a port
    written in YAML (`+22`, `0x16`, `1_000` and `022` are refused); a YAML inventory's number
    is checked for its range."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        why = f"{excerpt(value)} is not a port: {PORT_RULE}"
    else:
        why = port_problem(value if isinstance(value, str) else str(value))
    if why:
        raise InventoryError(f"{host}: ansible_port {why}", path=source)
    return int(value)


def _lift_common_ssh(nodes: list[dict]) -> dict:
    """ssh settings every node shares move to the top-level `ssh:` section."""
    common = {}
    first = nodes[0].get("ssh", {})
    for key, value in first.items():
        if all(n.get("ssh", {}).get(key) == value for n in nodes):
            common[key] = value
    for n in nodes:
        ssh = {k: v for k, v in n.pop("ssh", {}).items() if k not in common}
        if ssh:
            n["ssh"] = ssh
    return common


def ansible_to_yaml(text: str, source: str, *, group: str = "all", master_port: int = 29500) -> str:
    """An Ansible inventory's text -> clusterctl inventory YAML (checked to load)."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        doc = None
    groups = parse_yaml(doc, source) if isinstance(doc, dict) else parse_ini(text, source)
    nodes, left_out = to_nodes(groups, group, source)
    out: dict[str, Any] = {}
    ssh = _lift_common_ssh(nodes)
    if ssh:
        out["ssh"] = ssh
    out["master_port"] = master_port
    out["nodes"] = nodes
    head = f"# imported from {source} (group {group}); nodes[0] is the master (rank 0)\n"
    if left_out:
        head += f"# Ansible variables not used: {', '.join(sorted(left_out))}\n"
    text = head + yaml.safe_dump(out, sort_keys=False, default_flow_style=None)
    parse_inventory(text, source=f"<imported from {source}>")  # what we write must load
    return text
