"""Reading an inventory: bounded, typed, and every refusal names file:line.

The inventory decides what runs, as whom, on which machines, so this loader is clusterctl's
input boundary. Whatever the file holds, loading it ends in an `Inventory` or in one
`InventoryError` paragraph (exit code 2) that names `file:line` where a line exists and quotes
at most a short, escaped excerpt of the offending value. Refused, before any YAML tree is built:

- a path that is not a regular file (directory, FIFO, device, socket), a symlink loop, or a
  file over MAX_BYTES (1 MiB): checked with stat, then opened with O_NONBLOCK, so a FIFO
  never blocks;
- bytes that are not UTF-8, and characters YAML forbids (control characters), by line:column;
- nesting deeper than MAX_DEPTH (32), more than MAX_YAML_NODES (200,000) values counting each
  alias as the values it stands for, more than MAX_ALIASES (10,000) aliases, or an alias to an
  anchor that is not complete yet. These are counted on libyaml's event stream, so an alias
  bomb costs what its bytes cost;
- explicit tags (`!!binary`, `!!python/...`, `!!set`, `!!str`, `!custom`), keys that are not
  plain scalars, and anchors or aliases used as keys.
Then, while building values: keys that are not strings, duplicate keys, and strings holding
control or invisible format characters (from escapes such as "\\x01" or a raw U+202E).
Then ports, on their text as written (YAML 1.1 reads `0x50`, `0777`, `1_000` and `+22` as
numbers): decimal digits, 1 to 65535. Last, the pydantic models validate in strict mode: a YAML
boolean is never a port, a GPU count or a path, a node list holds at most MAX_NODES (4,096)
nodes, and hosts, addresses and ProxyJump hops are what hosts.py allows.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from orchestrator.errors import InventoryError
from orchestrator.inventory.fields import excerpt
from orchestrator.inventory.hosts import port_problem
from orchestrator.inventory.models import DEFAULT_INVENTORY, Inventory, InventoryModel, _resolve
from orchestrator.inventory.ranges import expand_ranges
from orchestrator.inventory.read import (
    MAX_ERRORS_SHOWN,
    _check_characters,
    _compose_and_construct,
    _show_path,
    _yaml_line,
    decode_inventory,
    read_inventory_bytes,
)

# ---------------------------------------------------------------- validation

# The most characters the errors of one refusal take before "... and N more", so the whole
# paragraph stays under 2 KiB with its path (and ten host refusals, each saying why, would not).
MAX_MESSAGE_CHARS = 1536


def _node_at(root, loc: tuple) -> tuple[Any, Any]:
    """Walk a composed YAML tree along a pydantic error location.
    Returns (deepest node found, key node of the last mapping step)."""
    node, key_node = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in reversed(node.value):  # a merged key is overridden by the mapping's own
                if k.value == part:
                    node, key_node = v, k
                    break
            else:
                return node, key_node
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node, key_node = node.value[part], None
        else:
            return node, key_node
    return node, key_node


def _format_loc(loc: tuple) -> str:
    """A key path as a message shows it: `nodes[2].ssh.port`; a key with a control character or
    a space in it is quoted as repr quotes it, so the message stays one printable paragraph."""
    out = ""
    for p in loc:
        p = p if isinstance(p, int) or (str(p).isprintable() and " " not in str(p)) else repr(str(p))
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


# Where the models take free text (env values, train args): a plain YAML number there means
# the text as written, so `X: 010` is "010" and `X: 1.10` is "1.10", not "8" and "1.1".
_FREE_TEXT = (("env", "*"), ("nodes", "[]", "env", "*"), ("train", "env", "*"), ("train", "args", "[]"))


def _use_written_numbers(root, data) -> None:
    def walk(node, value, path):
        if not path:
            return
        step, rest = path[0], path[1:]
        if step == "[]" and isinstance(node, yaml.SequenceNode) and isinstance(value, list):
            for i, (n, v) in enumerate(zip(node.value, value)):
                if rest:
                    walk(n, v, rest)
                elif _is_plain_number(n, v):
                    value[i] = n.value
        elif step == "*" and isinstance(node, yaml.MappingNode) and isinstance(value, dict):
            for k, n in node.value:
                if isinstance(k.value, str) and k.value in value and _is_plain_number(n, value[k.value]):
                    value[k.value] = n.value
        elif isinstance(node, yaml.MappingNode) and isinstance(value, dict) and step in value:
            sub, _ = _node_at(node, (step,))
            walk(sub, value[step], rest)

    for path in _FREE_TEXT:
        walk(root, data, path)


def _is_plain_number(node, value) -> bool:
    return (isinstance(node, yaml.ScalarNode) and not node.style  # libyaml marks plain with ''
            and isinstance(value, (int, float)) and not isinstance(value, bool))


def _check_ports(root, data, source: str) -> None:
    """Ports as written. YAML 1.1 reads `0x50`, `0777`, `0b101`, `1_000`, `+22` and `1:30` as
    numbers, so a port is checked on its text here (hosts.port_problem), and a port that is not
    a number gets the same sentence instead of a type error. An unset ssh port (null) is left to
    the models, as are lists and mappings."""
    locs = [("master_port",), ("ssh", "port")]
    nodes = data.get("nodes")
    if isinstance(nodes, list):
        locs += [("nodes", i, "ssh", "port") for i in range(len(nodes))]
    for loc in locs:
        value = _value_at(data, loc)
        if value is None:
            continue
        node, _ = _node_at(root, loc)
        if not isinstance(node, yaml.ScalarNode):
            continue
        if node.style:  # quoted: a string even when it holds digits
            why = f"{excerpt(value)} is quoted, so it is text and not a port: write the number without quotes"
        else:
            why = port_problem(node.value, value if isinstance(value, int) and not isinstance(value, bool) else None)
        if why:
            key = _format_loc(loc)
            raise InventoryError(f"{key}: {why}", path=source, line=_yaml_line(node.start_mark), key=key)


def _value_at(data, loc: tuple):
    for part in loc:
        if isinstance(part, int) and isinstance(data, list) and part < len(data):
            data = data[part]
        elif isinstance(part, str) and isinstance(data, dict):
            data = data.get(part)
        else:
            return None
    return data


def _written(node) -> str:
    """The offending value as the user wrote it, short."""
    if isinstance(node, yaml.ScalarNode):
        return excerpt(node.value)
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    return "nothing"


_TYPE_HINTS = {
    "string_type": "quote it if you mean the text",
    "int_type": "write a whole number",
    "int_from_float": "write a whole number",
    "float_type": "write a number",
    "bool_type": "write true or false",
}


def _validation_error(e: ValidationError, root, source: str) -> InventoryError:
    msgs = []
    errors = e.errors(include_url=False, include_input=False)
    for err in errors[:MAX_ERRORS_SHOWN]:
        loc = tuple(err["loc"])
        node, key_node = _node_at(root, loc)
        kn = key_node if err["type"] == "extra_forbidden" and key_node is not None else node
        line = _yaml_line(kn.start_mark) if kn is not None else None
        key = _format_loc(loc)
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = f"unknown key {excerpt(str(loc[-1]))}"
        elif err["type"] == "missing":
            msg = f"missing required key {excerpt(str(loc[-1]))}"
        elif err["type"] in ("value_error", "assertion_error"):
            msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        else:
            msg += f" (got {_written(node)})"
            if err["type"] in _TYPE_HINTS and isinstance(node, yaml.ScalarNode):
                msg += f"; {_TYPE_HINTS[err['type']]}"
        msgs.append((line, f"{key}: {msg}" if key else msg))
    head_line, text = msgs[0]
    shown = 1
    for ln, m in msgs[1:]:  # further errors, one line each, while the paragraph stays short
        more = f"\n  {source}:{ln}: {m}" if ln else f"\n  {source}: {m}"
        if len(text) + len(more) > MAX_MESSAGE_CHARS:
            break
        text, shown = text + more, shown + 1
    if len(errors) > shown:
        text += f"\n  ... and {len(errors) - shown} more"
    return InventoryError(text, path=source, line=head_line, key=_format_loc(tuple(errors[0]["loc"])))


def parse_inventory(text: str, source: str = "<string>") -> Inventory:
    """Parse and validate inventory YAML. Raises InventoryError with file:line."""
    source = _show_path(source)
    _check_characters(text, source)
    root, data = _compose_and_construct(text, source)
    if data is None:
        raise InventoryError("the inventory is empty: it needs at least a 'nodes:' list", path=source,
                             line=_yaml_line(root.start_mark) if root is not None else 1)
    if not isinstance(data, dict):
        raise InventoryError("the inventory must be a mapping with a 'nodes:' list at the top", path=source,
                             line=_yaml_line(root.start_mark))
    root, data = expand_ranges(root, data, source)  # `name: gpu[01-32]` -> 32 node entries (ranges.py)
    _use_written_numbers(root, data)
    _check_ports(root, data, source)
    try:
        model = InventoryModel.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e, root, source) from None
    lines = {}
    nodes_node, _ = _node_at(root, ("nodes",))
    if isinstance(nodes_node, yaml.SequenceNode):
        lines = {i: n.start_mark.line + 1 for i, n in enumerate(nodes_node.value)}
    return _resolve(model, source, lines, _key_lines(root, len(model.nodes)))


def _key_lines(root, n: int) -> dict[int, int]:
    """Node index -> the line of the ssh.identity_file it uses (its own, else the top level's)."""
    out = {}
    for i in range(n):
        for loc in (("nodes", i, "ssh", "identity_file"), ("ssh", "identity_file")):
            node, key = _node_at(root, loc)
            if key is not None and key.value == "identity_file":
                out[i] = key.start_mark.line + 1
                break
    return out


def load_inventory(path: str | Path | None) -> Inventory:
    """Load an inventory file; None means the embedded default (two local nodes)."""
    if path is None:
        text = resources.files("orchestrator.inventory").joinpath(DEFAULT_INVENTORY).read_text()
        return parse_inventory(text, source=f"<embedded {DEFAULT_INVENTORY}>")
    data = read_inventory_bytes(path)
    return parse_inventory(decode_inventory(data, _show_path(path)), source=str(path))


def check_local_files(inv: Inventory) -> Inventory:
    """`inv`, once every ssh.identity_file it names exists on this machine: a missing key is the
    inventory's error (file:line, exit 2), found before any node is tried, not one connection
    error per node."""
    for node in inv.nodes:
        key = node.ssh.identity_file
        if node.connection == "ssh" and key and not Path(key).expanduser().exists():
            users = [n.name for n in inv.nodes if n.connection == "ssh" and n.ssh.identity_file == key]
            raise InventoryError(
                f"ssh.identity_file {key!r} does not exist on this machine (used by "
                f"{', '.join(users[:4])}{' and more' if len(users) > 4 else ''}): give the path of a private key "
                "here, or remove identity_file to use ssh-agent and ~/.ssh/config", path=inv.source,
                line=node.key_line or node.line, key="ssh.identity_file")
    return inv
