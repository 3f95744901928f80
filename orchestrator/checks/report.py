"""The preflight report: per-node results, JSON, and a rendering that fits the console.

The node x check matrix has one row per group of nodes with the same statuses (`node[1-4,6]`,
as `clush -b` gathers identical output) and folds into several narrower tables when its columns
do not fit the width; findings (warn/fail) that are the same on several nodes are one line; the
rank map wraps between nodes. Rich's Console is 80 columns when not a terminal."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from orchestrator.checks import CheckResult
from orchestrator.checks.registry import BY_NAME
from orchestrator.inventory import Inventory, Node
from orchestrator.torchrun import nprocs_for, rank_map, rank_map_text

STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
_NUMBERED = re.compile(r"^(.*?)(\d+)(\D*)$")


def nodeset(names: list[str]) -> str:
    """Fold node names into ranges: node1 node2 node3 node5 -> node[1-3,5] (ClusterShell's
    NodeSet notation; zero-padded numbers keep their width). Groups keep first-seen order."""
    groups: dict[tuple[str, str], list[int]] = {}
    pads: dict[tuple[str, str], int] = {}
    order: list[object] = []
    for n in dict.fromkeys(names):
        m = _NUMBERED.match(n)
        if not m:
            order.append(n)
            continue
        digits, key = m.group(2), (m.group(1), m.group(3))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(digits))
        if digits.startswith("0") and len(digits) > 1:
            pads[key] = max(pads.get(key, 0), len(digits))
    out = []
    for item in order:
        if isinstance(item, str):
            out.append(item)
            continue
        prefix, suffix = item
        pad = pads.get(item, 0)
        nums = sorted(set(groups[item]))
        if len(nums) == 1:
            out.append(f"{prefix}{nums[0]:0{pad}d}{suffix}")
            continue
        spans, start, prev = [], nums[0], nums[0]
        for x in nums[1:] + [None]:
            if x is not None and x == prev + 1:
                prev = x
                continue
            spans.append(f"{start:0{pad}d}" if start == prev else f"{start:0{pad}d}-{prev:0{pad}d}")
            if x is not None:
                start = prev = x
        out.append(f"{prefix}[{','.join(spans)}]{suffix}")
    return ",".join(out)


@dataclass
class NodeReport:
    node: Node
    results: dict[str, CheckResult] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.status != "fail" for r in self.results.values())


@dataclass
class PreflightReport:
    inventory: Inventory
    checks: list[str]
    nodes: list[NodeReport]
    gpus_found: dict[str, int | None]
    seconds: float = 0.0
    asked_again: list[list[str]] = field(default_factory=list)  # per extra round: the nodes probed again

    @property
    def ok(self) -> bool:
        return all(n.ok for n in self.nodes)

    @property
    def failures(self) -> list[tuple[str, CheckResult]]:
        return [(n.node.name, r) for n in self.nodes for r in n.results.values() if r.status == "fail"]

    def nprocs(self) -> dict[str, int]:
        return nprocs_for(self.inventory, self.gpus_found)

    def ranked(self) -> Inventory:
        """The nodes that get ranks: spares sit out until a restart needs them."""
        keep = [n.name for n in self.inventory.nodes if not n.spare]
        return self.inventory.select(keep) if keep and len(keep) < len(self.inventory.nodes) else self.inventory

    def spares_text(self) -> str:
        spares = [n.name for n in self.inventory.nodes if n.spare]
        return f"; spare{'s' if len(spares) > 1 else ''} {nodeset(spares)} (no rank until a restart)" if spares else ""

    def rank_map(self) -> str:
        return rank_map_text(self.ranked(), self.nprocs()) + self.spares_text()

    def to_json(self) -> dict:
        return {"ok": self.ok, "nodes": [
            {"name": n.node.name, "host": n.node.host, "rank": n.node.rank,
             "checks": [n.results[c].to_json() for c in self.checks if c in n.results]}
            for n in self.nodes]}

    def failed_checks(self) -> dict[str, dict[str, str]]:
        """{node: {failed check: its detail}}."""
        out: dict[str, dict[str, str]] = {}
        for node, r in self.failures:
            out.setdefault(node, {})[r.check] = r.detail
        return out

    # ------------------------------------------------------------------ rendering

    def text(self, ranks: bool = True) -> str:
        """`render` as plain text, 140 columns (the run directory's preflight.txt)."""
        import io

        from rich.console import Console
        console = Console(file=io.StringIO(), width=140, record=True, color_system=None)
        self.render(console, ranks=ranks)
        return console.export_text()

    def render(self, console, details: bool = False, ranks: bool = True) -> None:
        """The matrix, then every finding not ok (grouped across nodes, with its remedy), then
        the rank map (ranks=False: none, for a launch that will not happen) and the verdict.
        details=True adds the ok/skip details too."""
        width = console.size.width
        console.print(f"preflight: {len(self.nodes)} nodes, master {self.inventory.master.address}:"
                      f"{self.inventory.master_port} ({self.seconds:.1f}s)", markup=False, highlight=False)
        for i, names in enumerate(self.asked_again, 2):
            console.print(f"probed {nodeset(names)} again (try {i}): its probe could not answer",
                          markup=False, highlight=False)
        for table in self._tables(width):
            console.print(table)
        console.print(self._findings(details))
        if ranks:
            console.print(self._rank_map_text(width), markup=False, highlight=False)
        fails = self.failures
        console.print("[green]preflight ok[/]" if self.ok else
                      f"[bold red]{len(fails)} check(s) failed on {len({name for name, _ in fails})} node(s)[/]")

    def _rows(self) -> list[tuple[str, list[str]]]:
        """(node set, statuses): nodes with the same statuses in every column share a row."""
        groups: dict[tuple[str, ...], list[str]] = {}
        for n in self.nodes:
            key = tuple(r.status if (r := n.results.get(c)) else "" for c in self.checks)
            groups.setdefault(key, []).append(n.node.name)
        return [(nodeset(names), list(key)) for key, names in groups.items()]

    def _tables(self, width: int) -> list:
        from rich import box
        from rich.table import Table

        rows = self._rows()
        heads = {c: c.replace("_", "\n") for c in self.checks}
        # a column is as wide as its widest header word (statuses are 4), plus a space between
        col = {c: max(4, *(len(p) for p in heads[c].split("\n"))) + 2 for c in self.checks}
        node_w = min(max(len("node"), *(len(r[0]) for r in rows)), max(12, width // 3)) + 2
        chunks, cur, used = [], [], node_w
        for c in self.checks:
            if cur and used + col[c] > width:
                chunks.append(cur)
                cur, used = [], node_w
            cur.append(c)
            used += col[c]
        chunks.append(cur)
        tables = []
        for chunk in chunks:
            t = Table(box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False, show_edge=False)
            t.add_column("node", overflow="fold", max_width=node_w - 2)
            for c in chunk:
                t.add_column(heads[c], justify="center", no_wrap=True)
            for names, statuses in rows:
                by = dict(zip(self.checks, statuses))
                t.add_row(names, *(f"[{STYLE[by[c]]}]{by[c]}[/]" if by[c] else "" for c in chunk))
            tables.append(t)
        return tables

    def _findings(self, details: bool):
        """One line per (check, status, detail, remedy) shared by a set of nodes; a node's own
        name in the text stands for the whole set."""
        from rich.table import Table
        from rich.text import Text

        groups: dict[tuple, list[str]] = {}
        for c in self.checks:
            for n in self.nodes:
                r = n.results.get(c)
                if r is None or not (details or r.status in ("warn", "fail")):
                    continue
                own = re.compile(rf"(?<![\w.-]){re.escape(n.node.name)}(?![\w.-])")
                remedy = r.remedy or (BY_NAME[c].remedy if r.status == "fail" else "")
                key = (c, r.status, own.sub("\0", r.detail), own.sub("\0", remedy))
                groups.setdefault(key, []).append(n.node.name)
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True)
        grid.add_column(overflow="fold")
        for (c, status, detail, remedy), names in groups.items():
            who = nodeset(names)
            line = Text()
            line.append(who, style="bold")
            line.append(f" {c}: {detail.replace(chr(0), who)}")
            if remedy and status in ("warn", "fail"):
                line.append(f"\n→ {remedy.replace(chr(0), who)}")
            grid.add_row(Text(f"{status:4}", style=STYLE[status]), line)
        return grid

    def _rank_map_text(self, width: int) -> str:
        """rank_map_text() when it fits on a line, else the same entries wrapped between nodes."""
        text = self.rank_map()
        if len(text) <= width:
            return text
        nprocs = self.nprocs()
        rows = rank_map(self.ranked(), nprocs)
        entries = [f"{f'rank {a}' if a == b else f'rank {a}-{b}'} → {node.name} ({node.address})"
                   for node, a, b in rows]
        lines, cur = [f"world size {sum(nprocs[n.name] for n, _, _ in rows)} on {len(rows)} nodes:"], "  "
        for i, e in enumerate(entries):
            piece = e + ("," if i < len(entries) - 1 else "")
            if cur.strip() and len(cur) + 1 + len(piece) > width:
                lines.append(cur)
                cur = "  "
            cur += ("" if not cur.strip() else " ") + piece
        lines.append(cur)
        if self.spares_text():
            lines.append("  " + self.spares_text().removeprefix("; "))
        return "\n".join(lines)
