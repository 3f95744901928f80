"""The inventory's models: the YAML as pydantic models, validated once, and the frozen `Node` and
`Inventory` that the rest of clusterctl is handed.

Everything downstream trusts these values: names, hosts (hosts.py), users, interfaces and
env keys are checked against strict patterns here, and every value that goes
into a remote command is still quoted (see `orchestrator.shell`).  Errors name
file:line and the key, and exit with code 2.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.errors import InventoryError
from orchestrator.inventory.fields import USER_RE, _check_env, _check_path, _Model, excerpt
from orchestrator.inventory.hosts import canonical_host, check_host, check_proxy_jump
from orchestrator.inventory.sections import ChecksSection, SetupSection, SyncSection, TrainSection
from orchestrator.inventory.sshconfig import config_hostname
from orchestrator.probe import common

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")
IFACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,14}\Z")

DEFAULT_INVENTORY = "default_inventory.yaml"
MAX_NODES = 4096  # the most nodes an inventory lists (the --fanout ceiling too)





class SSHSettings(_Model):
    """Per-inventory SSH defaults; each node may override any key."""

    user: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    identity_file: str | None = None
    known_hosts: str | None = None
    connect_timeout: float | None = Field(default=None, gt=0, le=600)
    proxy_jump: str | None = None
    config_file: str | None = None  # default ~/.ssh/config

    @field_validator("user")
    @classmethod
    def _user(cls, v):
        if v is not None and not USER_RE.match(v):
            raise ValueError(f"{excerpt(v)} is not a valid user name")
        return v

    @field_validator("identity_file", "known_hosts", "config_file")
    @classmethod
    def _paths(cls, v):
        return _check_path(v)

    @field_validator("proxy_jump")
    @classmethod
    def _jump(cls, v):
        return v if v is None else check_proxy_jump(v)

    def merged(self, override: "SSHSettings | None") -> "SSHSettings":
        if override is None:
            return self
        data = self.model_dump()
        data.update(override.model_dump(exclude_none=True))
        return SSHSettings(**data)


class NodeModel(_Model):
    name: str
    host: str | None = None
    gpus: int | None = Field(default=None, ge=0, le=1024)
    iface: str | None = None
    connection: Literal["ssh", "local"] = "ssh"
    env: dict[str, str] = Field(default_factory=dict)
    ssh: SSHSettings | None = None
    python: str | None = None
    workdir: str | None = None
    address: str | None = None  # address other nodes use to reach this one (default: host)
    spare: bool = False  # not used at first: takes a lost node's place when a run restarts
    cpu: bool | None = None  # a CPU node on purpose: one process, its GPUs (if any) left alone

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not NAME_RE.match(v):
            raise ValueError(f"{excerpt(v)} is not a valid node name (letters, digits, '.', '_', '-')")
        return v

    @field_validator("host", "address")
    @classmethod
    def _host(cls, v):
        return v if v is None else check_host(v)

    @field_validator("iface")
    @classmethod
    def _iface(cls, v):
        if v is not None and not IFACE_RE.match(v):
            raise ValueError(f"{excerpt(v)} is not a valid interface name")
        return v

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v):
        return _check_env(v) if isinstance(v, dict) else v

    @field_validator("python", "workdir")
    @classmethod
    def _paths(cls, v):
        return _check_path(v)

    @model_validator(mode="after")
    def _need_host(self):
        if self.connection == "ssh" and not self.host:
            raise ValueError("'host' is required for ssh nodes")
        return self


class InventoryModel(_Model):
    ssh: SSHSettings = Field(default_factory=SSHSettings)
    master_port: int = Field(default=29500, ge=1, le=65535)
    workdir: str = "~/gpt_train"
    output_dir: str | None = None
    python: str = "python3"
    env: dict[str, str] = Field(default_factory=dict)
    nodes: list[NodeModel] = Field(max_length=MAX_NODES)
    train: TrainSection = Field(default_factory=TrainSection)
    checks: ChecksSection = Field(default_factory=ChecksSection)
    sync: SyncSection = Field(default_factory=SyncSection)
    setup: SetupSection | None = None
    # what clusterctl writes (run records here, artifacts and node-run records on the nodes) is
    # readable by the user's group too: 0750/0640 instead of 0700/0600 (home.py, remote/common.py)
    share_with_group: bool = False
    cpu: bool = False  # every node a CPU node on purpose (a node's own cpu: overrides it)

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v):
        return _check_env(v) if isinstance(v, dict) else v

    @field_validator("workdir", "python", "output_dir")
    @classmethod
    def _paths(cls, v):
        return _check_path(v)

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, v):
        if not v:
            raise ValueError("the node list is empty: list at least one node (nodes[0] is the master)")
        return v


# ---------------------------------------------------------------- resolved view


@dataclass(frozen=True)
class Node:
    """One node with every inventory default merged in. `rank` is the node rank of the run:
    its position among the nodes selected (`Inventory.select`), so rank 0 is the master."""

    name: str
    rank: int
    host: str
    # what other nodes use to reach it (MASTER_ADDR for rank 0): `address:`, else the ssh_config
    # HostName of `host`, else `host`
    address: str
    gpus: int | None
    iface: str | None
    connection: str
    ssh: SSHSettings
    env: dict[str, str]
    python: str
    workdir: str
    line: int | None = None
    key_line: int | None = None  # the line of the ssh.identity_file it uses, for an error about the key
    spare: bool = False  # held back for restarts (runs/restart.py)
    share_with_group: bool = False  # the inventory's: what clusterctl writes on the node, the group reads too
    cpu: bool = False  # `cpu: true`: a CPU node on purpose (gpus is 0): GPUs found there are no warning

    @property
    def is_local(self) -> bool:
        return self.connection == "local"

    def hostport(self, port: int) -> str:
        """address:port, an IPv6 address in brackets (as given, or added)."""
        a = self.address
        return f"[{a}]:{port}" if ":" in a and not a.startswith("[") else f"{a}:{port}"

    @property
    def program_env(self) -> str:
        """What goes in front of a shipped program's command line on this node: the assignment
        that carries share_with_group there (remote/common.py `private_files`), else nothing."""
        return f"{common().GROUP_ENV}=1 " if self.share_with_group else ""


@dataclass(frozen=True)
class Inventory:
    nodes: tuple[Node, ...]
    master_port: int
    workdir: str
    output_dir: str | None
    python: str
    env: dict[str, str]
    train: TrainSection
    checks: ChecksSection
    source: str = "<memory>"
    sync: SyncSection = field(default_factory=SyncSection)
    setup: SetupSection | None = None
    share_with_group: bool = False
    _by_name: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def master(self) -> Node:
        """Rank 0: the first node of this (possibly selected) inventory."""
        return self.nodes[0]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def select(self, names: list[str] | None) -> "Inventory":
        """A copy with only the named nodes, in inventory order and renumbered from 0: the
        first one selected is the master of whatever runs on the subset."""
        if not names:
            return self
        unknown = [n for n in names if n not in {x.name for x in self.nodes}]
        if unknown:
            raise InventoryError(f"unknown node(s): {', '.join(unknown)}", path=self.source)
        keep = tuple(replace(n, rank=i) for i, n in enumerate(n for n in self.nodes if n.name in names))
        return Inventory(keep, self.master_port, self.workdir, self.output_dir, self.python,
                         self.env, self.train, self.checks, self.source, self.sync, self.setup,
                         self.share_with_group)


def _python_of(model: InventoryModel, nm: NodeModel, source: str, line: int | None, i: int) -> str:
    """The node's interpreter. With a `setup:` section it is the venv's, and a `python:` anywhere
    is refused: two sources for one interpreter would let nodes run something setup did not build."""
    if model.setup is not None:
        if nm.python is not None or "python" in model.model_fields_set:
            key = f"nodes[{i}].python" if nm.python is not None else "python"
            raise InventoryError(
                f"{key} and setup.venv both name the nodes' interpreter: with a setup section every node "
                f"runs {model.setup.python}. Remove {key}; name the interpreter that creates the venv as "
                "setup.interpreter", path=source, line=line if nm.python is not None else None, key=key)
        return model.setup.python
    if nm.connection == "local" and nm.python is None and "python" not in model.model_fields_set:
        return sys.executable  # a local node runs where clusterctl runs: same interpreter
    return nm.python or model.python


def _gpus_of(model: InventoryModel, nm: NodeModel, source: str, line: int | None, i: int) -> int | None:
    """The node's `gpus`: 0 for a CPU node (`cpu: true` on the node or at the top), which may not
    also name a number of GPUs."""
    cpu = nm.cpu if nm.cpu is not None else model.cpu
    if cpu and nm.gpus:
        raise InventoryError(f"nodes[{i}] ({nm.name}) says cpu: true and gpus: {nm.gpus}: a CPU node runs one "
                             "process on no GPU. Drop one of the two", path=source, line=line, key=f"nodes[{i}].gpus")
    return 0 if cpu else nm.gpus


def _resolve(model: InventoryModel, source: str, lines: dict[int, int], key_lines: dict[int, int] | None = None
             ) -> Inventory:
    nodes = []
    seen_names: dict[str, int] = {}
    seen_hosts: dict[tuple, int] = {}
    for i, nm in enumerate(model.nodes):
        ssh = model.ssh.merged(nm.ssh)
        host = nm.host or "127.0.0.1"
        line = lines.get(i)
        if nm.name in seen_names:
            raise InventoryError(f"duplicate node name {nm.name!r} (first at node {seen_names[nm.name]})",
                                 path=source, line=line, key=f"nodes[{i}].name")
        seen_names[nm.name] = i
        if nm.connection == "ssh":
            hk = (canonical_host(host), ssh.port or 22)  # `n1.`, `::ffff:10.0.0.1`: one host, any spelling
            if hk in seen_hosts:
                first = model.nodes[seen_hosts[hk]]
                spelled = f" (written {first.host!r} there)" if (first.host or "127.0.0.1") != host else ""
                raise InventoryError(
                    f"duplicate host {host!r} (port {hk[1]}) for node {nm.name!r}: already used by node "
                    f"{first.name!r}{spelled}; one node per host", path=source, line=line, key=f"nodes[{i}].host")
            seen_hosts[hk] = i
        env = {**model.env, **nm.env}
        python = _python_of(model, nm, source, line, i)
        address = nm.address or (config_hostname(host, ssh.config_file) if nm.connection == "ssh" else host)
        nodes.append(Node(
            name=nm.name, rank=i, host=host, address=address, gpus=_gpus_of(model, nm, source, line, i), iface=nm.iface,
            connection=nm.connection, ssh=ssh, env=env, python=python,
            workdir=nm.workdir or model.workdir, line=line, key_line=(key_lines or {}).get(i), spare=nm.spare,
            share_with_group=model.share_with_group, cpu=nm.cpu if nm.cpu is not None else model.cpu,
        ))
    return Inventory(tuple(nodes), model.master_port, model.workdir, model.output_dir, model.python,
                     dict(model.env), model.train, model.checks, source, model.sync, model.setup,
                     model.share_with_group)
