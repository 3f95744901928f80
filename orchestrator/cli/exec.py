"""`clusterctl exec`: one command on every node, prefixed output, worst exit code (pdsh -S)."""

from __future__ import annotations

import json
import sys

from orchestrator.cli.gather import Gatherer, group_by
from orchestrator.cli.jsonout import node_result
from orchestrator.cli.options import ClusterOptions
from orchestrator.cli.output import Prefixer
from orchestrator.errors import with_unreachable
from orchestrator.transport import ClusterResult

EXIT_TIMED_OUT = 124  # a node's command ran past --timeout (timeout(1)'s code)


def summarize(result: ClusterResult, gathered: bool = False) -> str:
    """One line per failed node (per group of nodes that failed alike, when gathered), for stderr
    after the output."""
    failed = {name: r.describe() for name, r in result.failed.items()}
    if gathered:
        return "\n".join(f"clusterctl: {nodes}: {why}" for nodes, why in group_by(failed))
    return "\n".join(f"clusterctl: {name}: {why}" for name, why in failed.items())


def exit_code(result: ClusterResult) -> int:
    """3 when any node could not be reached (or was lost before its command ended), else the
    worst node's exit code, a command past --timeout counting as 124."""
    unreachable = [name for name, r in result.items() if not r.reachable]
    codes = [EXIT_TIMED_OUT if r.exit_code is None else r.exit_code for r in result.values()]
    return with_unreachable(unreachable, max(codes, default=0))


def run_exec(opts: ClusterOptions, command: str, *, as_json: bool = False,
             timeout: float | None = None, gather: bool = False) -> int:
    inv = opts.load()
    names = [n.name for n in inv.nodes]
    printer = None if as_json else Gatherer(names) if gather else Prefixer(names)
    with opts.cluster(inv) as cluster:
        result = cluster.run(command, timeout=timeout, on_line=printer, capture=as_json)
    if isinstance(printer, Gatherer):
        sys.stdout.write(printer.render())
        sys.stdout.flush()
    if as_json:
        ranks = {n.name: n.rank for n in inv.nodes}
        doc = {"ok": result.all_ok, "exit_code": exit_code(result), "nodes": [
            node_result(r, ranks.get(r.node), node=r.node, stdout=r.stdout, stderr=r.stderr,
                        duration=round(r.duration, 3)) for r in result.values()]}
        print(json.dumps(doc, indent=2))
    elif not result.all_ok:
        print(summarize(result, gathered=gather), file=sys.stderr)
    return exit_code(result)
