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
A bracket holds numbers and `lo-hi[/step]` ranges, comma-separated: a negative number
(`n[-1-3]`), a range that runs backwards (`n[5-2]`) or a step of 0 is refused in words, and a
range of hosts is then checked host by host (`10.0.0.[250-260]` stops at 10.0.0.256).

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
_RANGE_PIECE = re.compile(r"^\s*(\d+)(?:\s*-\s*(\d+)(?:\s*/\s*(\d+))?)?\s*$", re.ASCII)
_NEGATIVE = re.compile(r"^\s*-|-\s*-", re.ASCII)
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


def check_brackets(pattern: str, what: str = "range") -> None:
    """Each bracket of `pattern` holds numbers, ranges `lo-hi` with lo <= hi and an optional step
    of 1 or more (`1-9/2`), separated by commas; else ValueError saying which piece is wrong.
    NodeSet itself reads `n[-1-3]` as n-1, n0, ..., n3 and explains `n[5-2]` in its own terms."""
    bad = f"{what} {excerpt(pattern)} is not a node range like gpu[01-32]"
    for inner in _BRACKET.findall(pattern):
        for piece in inner.split(","):
            shown = excerpt(piece.strip(), 30)
            m = _RANGE_PIECE.match(piece)
            if m is None:
                if not piece.strip():
                    raise ValueError(f"{bad}: a bracket or a comma-separated part of one is empty")
                if _NEGATIVE.search(piece):
                    raise ValueError(f"{bad}: {shown} holds a negative number, and node numbers start at 0")
                raise ValueError(f"{bad}: {shown} is not a number or a range like 01-32, 1-9/2")
            if m[2] is not None and int(m[2]) < int(m[1]):
                raise ValueError(f"{bad}: {m[1]}-{m[2]} runs backwards; write it low to high, {m[2]}-{m[1]}")
            if m[3] is not None and int(m[3]) < 1:
                raise ValueError(f"{bad}: the step in {shown} is {m[3]}, and a step is 1 or more")


_SET_OPERATORS = re.compile(r"[!&^]")


def check_inventory_pattern(pattern: str, what: str) -> None:
    """What an inventory's range may not hold though NodeSet reads it: set operators
    (`gpu[1-3]!gpu2`: list the nodes meant), white space (`n[ 1-3 ]`), or a bracket with no name in
    front (`[1-3]` names the nodes 1, 2, 3). ValueError saying which."""
    bad = f"{what} {excerpt(pattern)} is not a node range like gpu[01-32]"
    if _SET_OPERATORS.search(pattern):
        raise ValueError(f"{bad}: {_SET_OPERATORS.search(pattern)[0]!r} is a ClusterShell set operator; an "
                         "inventory lists its nodes, so write the ones you mean (gpu[1,3], or two entries)")
    if any(ch.isspace() for ch in pattern):
        raise ValueError(f"{bad}: it holds white space; write it without spaces, as gpu[01-32]")
    if any(group.startswith("[") for group in pattern.split(",")):
        raise ValueError(f"{bad}: a bracket needs a name in front of it (gpu[1-3]); [1-3] alone would name "
                         "the nodes 1, 2 and 3")


def expand(pattern: str, *, what: str = "range") -> list[str]:
    """The names of a node range, in NodeSet's (sorted) order. Raises ValueError with the reason."""
    check_brackets(pattern, what)
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
        check_inventory_pattern(name, f"nodes[{i}].name")
        names = expand(name, what=f"nodes[{i}].name")
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
                check_inventory_pattern(text, f"nodes[{i}].{key}")
                values[key] = expand(text, what=f"nodes[{i}].{key}")
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
