"""`clusterctl cp NODE:PATH DEST` and `clusterctl cp SRC NODE:PATH`: files and trees off and onto
nodes over their existing connections (orchestrator/transfer/copy.py)."""

from __future__ import annotations

import sys

import click

from orchestrator.cli.fetch import size_text
from orchestrator.cli.jsonout import emit
from orchestrator.cli.options import ClusterOptions, cluster_options
from orchestrator.errors import EXIT_FAILED, EXIT_OK, UsageError, with_unreachable
from orchestrator.inventory import Inventory
from orchestrator.transfer.copy import TIMEOUT, download, upload


def split_side(arg: str) -> tuple[str | None, str]:
    """(NODES, PATH) for `NODES:PATH` (no `/` before the colon, as with scp), else (None, arg):
    a path here. An empty NODES is every node selected."""
    head, sep, tail = arg.partition(":")
    if sep and "/" not in head:
        return head, tail
    return None, arg


def pick_nodes(inv: Inventory, spec: str) -> Inventory:
    """The inventory's nodes that NODES names (names or ranges: node[1-3],gpu9), in inventory order."""
    from orchestrator.inventory.ranges import expand

    if not spec:
        return inv
    try:
        names = expand(spec, what="NODE")
    except ValueError as e:
        raise UsageError(str(e)) from None
    unknown = [n for n in names if n not in {x.name for x in inv.nodes}]
    if unknown:
        raise UsageError(f"{', '.join(unknown)}: no such node in {inv.source} (its nodes: "
                         f"{', '.join(n.name for n in inv.nodes)}); a local path with a colon is written ./{spec}:...")
    return inv.select(names)


def _report(results, notes) -> int:
    for f in results:
        if f.ok:
            click.echo(f"{f.name}: {f.files} files, {size_text(f.bytes)} → {f.dest}", err=True)
        else:
            click.echo(f"{f.name}: not copied: {f.error}", err=True)
    for note in notes:
        click.echo(f"note: {note}", err=True)
    unreachable = [f.name for f in results if f.unreachable]
    failed = [f.name for f in results if not f.ok and not f.unreachable]
    if unreachable:
        click.echo(f"clusterctl: error: could not reach {', '.join(unreachable)}, so nothing was copied "
                   f"{'to or from it' if len(unreachable) == 1 else 'to or from them'}"
                   + ("; the other nodes' copies were made" if len(unreachable) < len(results) else ""), err=True)
    elif failed:
        click.echo(f"clusterctl: error: the copy failed on {', '.join(failed)} (see above)", err=True)
    return with_unreachable(unreachable, EXIT_FAILED if failed else EXIT_OK)


@click.command("cp")
@cluster_options
@click.argument("src")
@click.argument("dest")
@click.option("--timeout", type=click.FloatRange(1), default=TIMEOUT, show_default=True,
              help="Seconds the whole copy may take.")
@click.option("--direct", is_flag=True,
              help="Onto several nodes: send from here to each node, not relayed node to node.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (orchestrator/schemas/cp.json).")
def cp_command(opts: ClusterOptions, src: str, dest: str, timeout: float, direct: bool, as_json: bool):
    """Copy a file or a tree off a node (`cp node1:out/ckpt.pt .`) or onto nodes (`cp data/
    'node[1-4]:data/'`), through each node's SSH connection: no sftp or scp needed, any bytes,
    directories (empty ones too) and symbolic links (as links) kept.

    A node PATH is relative to the node's workdir; `~/` is its home. `:PATH` alone means every
    node (or those of --nodes). Onto nodes, SRC lands inside PATH when PATH is a directory there
    or ends in `/`, else as PATH; one stream, relayed node to node and checked by sha256 on each.
    Off several nodes, each copy lands in DEST/NODE/. Exits 1 when a copy failed or a PATH does
    not exist (naming node and path), 2 for a usage error, 3 naming the nodes not reached."""
    (src_nodes, src_path), (dst_nodes, dst_path) = split_side(src), split_side(dest)
    if (src_nodes is None) == (dst_nodes is None):
        raise UsageError("one side of cp is a node path (NODE:PATH) and the other a path here: "
                         f"got {src!r} and {dest!r}" + (" (node to node: copy here first)" if src_nodes is not None else ""))
    inv = pick_nodes(opts.load(), src_nodes if src_nodes is not None else dst_nodes)
    with opts.cluster(inv) as cluster:
        if src_nodes is not None:
            results, notes = download(cluster, list(inv.nodes), src_path, dst_path, timeout=timeout), []
        else:
            results, notes = upload(cluster, list(inv.nodes), src_path, dst_path, relay=not direct,
                                    timeout=timeout)
    code = _report(results, notes)
    if as_json:
        emit({"ok": code == EXIT_OK, "direction": "from_nodes" if src_nodes is not None else "to_nodes",
              "source": src, "dest": dest, "notes": notes, "nodes": [f.doc() for f in results]})
    sys.exit(code)
