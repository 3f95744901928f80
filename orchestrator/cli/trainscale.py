"""`train`'s settings that grow with the cluster (runs/scaling.py): the flags and inventory values
the user gave laid over the rule's values for the run's nodes and ranks, and `train --dry-run`'s
report of them."""

from __future__ import annotations

import dataclasses

import click
from click.core import ParameterSource

from orchestrator.cli.jsonout import emit
from orchestrator.errors import InventoryError
from orchestrator.inventory import Inventory
from orchestrator.runs import scaling
from orchestrator.runs.spec import DEFAULTS
from orchestrator.torchrun import RDZV_CONF_ENV, node_env, nproc_for, rank_map_text, rdzv_timeout_given


def options(f):
    """`train`'s flags for the scaled settings that have no other home (--fanout is a cluster option)."""
    f = click.option("--rendezvous-timeout", type=click.IntRange(1, 86400), default=None, metavar="SECONDS",
                     help="How long torchrun's rendezvous waits for every node to join (node 0's store waits for "
                          "the others; each node tries to join), passed as --rdzv-conf timeout=N [default: the "
                          f"inventory env's {RDZV_CONF_ENV} timeout=N, else 900, +300 per doubling of the nodes "
                          "past 64: `train --dry-run` shows it].")(f)
    return click.option("--lost-timeout", type=click.FloatRange(1, 3600), default=DEFAULTS.lost_timeout,
                        help="A node that does not answer for this long is lost, and the run is torn down [default: "
                             "30, +30 per doubling of the nodes past 64: `train --dry-run` shows it].")(f)


def _given_flag(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)


def counts(inv: Inventory, nproc_per_node) -> tuple[int, int]:
    """The run's nodes (spares left out) and ranks, as the inventory states them (a node with no
    `gpus:` counts one rank until its GPUs are found at launch)."""
    chosen = nproc_per_node if nproc_per_node not in (None, "auto") else inv.train.nproc_per_node
    nodes = [n for n in inv.nodes if not n.spare]
    return len(nodes), sum(nproc_for(n, None, chosen) for n in nodes)


def _collective_given(inv: Inventory) -> int | None:
    """NCCL_TIMEOUT set in the inventory's env or train.env (it wins on the nodes: torchrun.node_env)."""
    value = {**inv.env, **inv.train.env}.get("NCCL_TIMEOUT")
    return int(value) if value is not None and str(value).isdigit() else None


def _rendezvous_given(inv: Inventory) -> int | None:
    """The rendezvous timeout the inventory sets through PET_RDZV_CONF (env, a node's env, train.env,
    as torchrun.node_env lays them), the longest where nodes differ: one rendezvous waits for all.
    A value torchrun would refuse on the nodes is an inventory error here (exit 2)."""
    found = []
    for node in inv.nodes:
        env = node_env(inv, node)  # the environment the node's torchrun gets, one layering rule
        try:
            found.append(rdzv_timeout_given(env))
        except ValueError as e:
            raise InventoryError(f"the inventory sets {RDZV_CONF_ENV}={env[RDZV_CONF_ENV]!r} for {node.name} (env, the "
                                 f"node's env or train.env), which torchrun would refuse there: {e}. Nothing was "
                                 "started.", key=RDZV_CONF_ENV) from None
    given = [t for t in found if t is not None]
    return max(given) if given else None


def resolve(ctx: click.Context, inv: Inventory, *, nproc_per_node, fanout: int, lost_timeout: float,
            hang_timeout: float | None, rendezvous_timeout: int | None) -> dict:
    """RunSpec's fields for the scaled settings: the user's (a flag, else the inventory's train:
    value) where given, else the rule's; with `scaling`, the record of both."""
    nodes, ranks = counts(inv, nproc_per_node)
    given: dict = {}
    if _given_flag(ctx, "fanout"):
        given["fanout"] = fanout
    if _given_flag(ctx, "lost_timeout"):
        given["lost_timeout"] = lost_timeout
    if hang_timeout is not None:
        given["hang_timeout"] = hang_timeout
    elif "hang_timeout" in inv.train.model_fields_set:
        given["hang_timeout"] = inv.train.hang_timeout
    if (collective := _collective_given(inv)) is not None:
        given["collective_timeout"] = collective
    inventory_rdzv = _rendezvous_given(inv)  # checked even when the flag wins: the nodes would refuse it
    if rendezvous_timeout is not None or inventory_rdzv is not None:
        given["rendezvous_timeout"] = rendezvous_timeout if rendezvous_timeout is not None else inventory_rdzv
    values, source = scaling.resolve(nodes, ranks, given)
    doc = {"nodes": nodes, "ranks": ranks, "values": dataclasses.asdict(values), "source": source}
    return {"fanout": values.fanout, "lost_timeout": values.lost_timeout, "hang_timeout": values.hang_timeout,
            "suspect_s": values.suspect_s, "probe_s": values.probe_s, "snapshot_wait": values.snapshot_wait,
            "rendezvous_timeout": values.rendezvous_timeout, "stream_stall": values.stream_stall,
            "progress_s": values.progress_s, "scaling": doc}


def dry_run(inv: Inventory, nproc_per_node, scaled: dict, as_json: bool) -> None:
    """Print what the run would use, start nothing."""
    doc = scaled["scaling"]
    if as_json:
        emit({"ok": True, "dry_run": True, "scaling": doc})
        return
    chosen = nproc_per_node if nproc_per_node not in (None, "auto") else inv.train.nproc_per_node
    nodes = inv.select([n.name for n in inv.nodes if not n.spare])
    nprocs = {n.name: nproc_for(n, None, chosen) for n in nodes.nodes}
    click.echo(f"train --dry-run: nothing was started\n{rank_map_text(nodes, nprocs)}")
    click.echo(f"settings for {doc['nodes']} nodes and {doc['ranks']} ranks (derived: runs/scaling.py's rule; "
               "given: a flag or the inventory):")
    values = scaling.Scaled(**doc["values"])
    for line in scaling.lines(values, doc["source"]):
        click.echo(line)
