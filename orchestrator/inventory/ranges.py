"""Node ranges in the inventory: `name: gpu[01-32]` is 32 nodes, in the syntax pdsh, clush and
SLURM share (parsed by ClusterShell's NodeSet, the reference implementation of it).

    nodes:
      - name: gpu[01-32]
        host: 10.0.0.[11-42]      # a range of the same size, paired in order, or
      # host: "{name}.cluster"    # a template: {name} is each node's name

A range entry becomes one ordinary node entry per name, before validation, so every other key
(gpus, iface, ssh, env, ...) applies to each of them and every later check is the same as for
nodes written out. Ranks follow the range's sorted order (gpu01 is rank 0); list ranges one
after another for any other order. `address:` takes a range or a template like `host:`.

`expand_ranges` works on the composed YAML tree and the plain data built from it, and returns
both with the ranges expanded: the tree's node list holds the written entry once per node it
became, so an error about gpu17 still points at the line of `name: gpu[01-32]`.
"""

from __future__ import annotations

import copy
import re

import yaml
from ClusterShell.NodeSet import NodeSet, NodeSetException

from orchestrator.errors import InventoryError
from orchestrator.inventory.fields import excerpt
from orchestrator.inventory.models import MAX_NODES

_BRACKET = re.compile(r"\[([^\]]*)\]")
_RANGE_PIECE = re.compile(r"^\s*(\d+)(?:\s*-\s*(\d+)(?:\s*/\s*(\d+))?)?\s*$")
_PATTERN_KEYS = ("host", "address")


def is_range(text: str) -> bool:
    """A node name or host written as a range: brackets holding numbers (not an IPv6 `[::1]`)."""
    return ":" not in text and bool(_BRACKET.search(text))


def range_size(pattern: str) -> int | None:
    """How many names `pattern` stands for, counted from its brackets without expanding them
    (so `n[1-100000000]` is refused before anything that size is built); None when the brackets
    are not plain numeric ranges (NodeSet then says what is wrong)."""
    total = 1
    for group in pattern.split(","):  # `a[1-2],b[3-4]` is a union; `n[1-2]-[1-2]` a product
        size = 1
        for inner in _BRACKET.findall(group):
            count = 0
            for piece in inner.split(","):
                m = _RANGE_PIECE.match(piece)
                if not m:
                    return None
                lo, hi, step = int(m[1]), int(m[2] or m[1]), int(m[3] or 1)
                if hi < lo or step < 1:
                    return None
                count += (hi - lo) // step + 1
            size *= count
        total += size
    return total - 1


def expand(pattern: str, *, what: str = "range") -> list[str]:
    """The names of a node range, in NodeSet's (sorted) order. Raises ValueError with the reason."""
    size = range_size(pattern)
    if size is not None and size > MAX_NODES:
        raise ValueError(f"{what} {excerpt(pattern)} is {size:,} nodes; an inventory holds at most "
                         f"{MAX_NODES:,}")
    try:
        names = list(NodeSet(pattern))
    except NodeSetException as e:
        raise ValueError(f"{what} {excerpt(pattern)} is not a node range like gpu[01-32]: {e}") from None
    if len(names) > MAX_NODES:
        raise ValueError(f"{what} {excerpt(pattern)} is {len(names):,} nodes; an inventory holds at most "
                         f"{MAX_NODES:,}")
    return names


def fold(names) -> str:
    """Names folded back into one range: ['n1', 'n2', 'n3', 'n5'] -> 'n[1-3,5]'."""
    return str(NodeSet.fromlist(list(names)))


def _line(node) -> int | None:
    return node.start_mark.line + 1 if node is not None and node.start_mark is not None else None


def _value_node(entry_node, key: str):
    if isinstance(entry_node, yaml.MappingNode):
        for k, v in reversed(entry_node.value):
            if k.value == key:
                return v
    return entry_node


def _expand_entry(entry: dict, entry_node, source: str, i: int) -> list[dict]:
    name = entry["name"]
    try:
        names = expand(name, what="name")
    except ValueError as e:
        raise InventoryError(str(e), path=source, line=_line(_value_node(entry_node, "name")),
                             key=f"nodes[{i}].name") from None
    values: dict[str, list[str]] = {}
    for key in _PATTERN_KEYS:
        text = entry.get(key)
        if not isinstance(text, str):
            continue
        where = dict(path=source, line=_line(_value_node(entry_node, key)), key=f"nodes[{i}].{key}")
        if is_range(text):
            try:
                values[key] = expand(text, what=key)
            except ValueError as e:
                raise InventoryError(str(e), **where) from None
            if len(values[key]) != len(names):
                raise InventoryError(f"name {excerpt(name)} is {len(names)} nodes but {key} {excerpt(text)} is "
                                     f"{len(values[key])}; give a range of the same size, or a template such "
                                     f"as \"{{name}}.cluster\"", **where)
        elif "{name}" in text:
            values[key] = [text.replace("{name}", n) for n in names]
    out = []
    for j, n in enumerate(names):
        node = copy.deepcopy(entry)
        node["name"] = n
        for key, vals in values.items():
            node[key] = vals[j]
        out.append(node)
    return out


def expand_ranges(root, data, source: str = "<string>"):
    """(YAML tree, data) -> (YAML tree, data) with every range entry of `nodes:` expanded.
    Pure: the inputs are not changed. Anything that is not a range is left for validation."""
    nodes = data.get("nodes") if isinstance(data, dict) else None
    seq = _value_node(root, "nodes") if isinstance(root, yaml.MappingNode) else None
    if not isinstance(nodes, list) or not isinstance(seq, yaml.SequenceNode) or len(seq.value) != len(nodes):
        return root, data
    if not any(isinstance(e, dict) and isinstance(e.get("name"), str) and is_range(e["name"]) for e in nodes):
        return root, data
    new_nodes, new_items = [], []
    for i, (entry, item) in enumerate(zip(nodes, seq.value)):
        if isinstance(entry, dict) and isinstance(entry.get("name"), str) and is_range(entry["name"]):
            expanded = _expand_entry(entry, item, source, i)
        else:
            expanded = [entry]
        new_nodes += expanded
        new_items += [item] * len(expanded)
        if len(new_nodes) > MAX_NODES:
            raise InventoryError(f"the node ranges add up to more than {MAX_NODES:,} nodes, the most an "
                                 f"inventory holds", path=source, line=_line(item), key=f"nodes[{i}]")
    new_seq = yaml.SequenceNode(seq.tag, new_items, seq.start_mark, seq.end_mark, flow_style=seq.flow_style)
    new_root = yaml.MappingNode(root.tag, [(k, new_seq if v is seq else v) for k, v in root.value],
                                root.start_mark, root.end_mark, flow_style=root.flow_style)
    return new_root, dict(data, nodes=new_nodes)
