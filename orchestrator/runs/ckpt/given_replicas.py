"""Checkpoint replicas: each node's checkpoints copied node to node, never through the control machine.

With `train.checkpoint_replica: true`, while a run trains, every node's newest complete checkpoint
(its own CLUSTERCTL_CHECKPOINT_DIR: a DDP master's file, or the FSDP shards that node wrote) is
copied to the next node in the attempt's rank order, wrapping around, into that node's
~/.clusterctl/artifacts/RUN/replicas/SOURCE/ (orchestrator/transfer/pair.py: a TCP stream between
the two nodes, set up over their SSH channels). The newest KEEP replicas of each source are kept.

Before a relaunch, `restore_from_nodes` asks the attempt's nodes what they hold (their own
checkpoints and replicas) and, when that is newer than the control machine's newest, puts it where
the trainer looks: a file checkpoint on the first node, an FSDP directory's pieces merged on every
node (each piece copied node to node from a node that holds it).
"""

from __future__ import annotations

import posixpath
import time
from dataclasses import dataclass
from typing import Callable

from orchestrator.node import artifacts, wire
from orchestrator.runs.ckpt.given_home import KEEP
from orchestrator.transfer import pair
from orchestrator.transport import Cluster


def ring(nodes: list[str]) -> dict[str, str]:
    """Who holds whose replica: node i's goes to node (i+1) % n. One node alone has none."""
    return {n: nodes[(i + 1) % len(nodes)] for i, n in enumerate(nodes)} if len(nodes) > 1 else {}


@dataclass(frozen=True)
class Piece:
    """A checkpoint (or, for FSDP without a shared filesystem, one node's part of it) on a node."""

    holder: str  # the node it is on
    origin: str  # the node that wrote it (== holder: the holder's own; else a replica)
    name: str
    step: int
    kind: str  # file | dir
    files: frozenset[str]  # for a dir: names inside it
    manifest: frozenset[str] = frozenset()  # for a dir: every name its MANIFEST lists


@dataclass(frozen=True)
class Move:
    piece: Piece
    target: str  # into this node's own checkpoint directory


def pieces_of(holder: str, held: dict) -> list[Piece]:
    """Parse the node agent's `held` answer for one node."""
    out = []
    for origin, found in [(holder, held.get("own", []))] + sorted(held.get("replicas", {}).items()):
        for c in found:
            prefix = c["name"] + "/"
            files = frozenset(r[len(prefix):] if r.startswith(prefix) else r for r, _ in c["files"])
            out.append(Piece(holder, origin, c["name"], int(c["step"]), c["kind"], files,
                             frozenset(c.get("manifest", ()))))
    return out


def plan_restore(pieces: list[Piece], targets: list[str], newer_than: int = -1) -> tuple[str, list[Move]] | None:
    """The newest checkpoint the nodes can put together, newer than step `newer_than` (the
    control machine's newest), and the copies that put it where the trainer looks: a file on the
    first target; a directory complete (every name its manifest lists) on every target.
    None: nothing newer on the nodes. ([] moves: already in place.)"""
    for step in sorted({p.step for p in pieces}, reverse=True):
        if step <= newer_than:
            return None
        here = [p for p in pieces if p.step == step]
        if here[0].kind == "file":
            t = targets[0]
            files = [p for p in here if p.kind == "file"]
            if any(p.holder == t and p.origin == t for p in files):
                return here[0].name, []
            return here[0].name, [Move(next((p for p in files if p.holder == t), files[0]), t)]
        moves = _merge_moves([p for p in here if p.kind == "dir"], targets)
        if moves is not None:
            return here[0].name, moves
    return None


def _merge_moves(here: list[Piece], targets: list[str]) -> list[Move] | None:
    """Copies that make a directory checkpoint complete on every target; None if the pieces on
    the nodes do not cover its manifest."""
    need = frozenset().union(*(p.manifest for p in here))
    if not need or not need <= frozenset().union(*(p.files for p in here)):
        return None
    moves = []
    for t in targets:
        have = set(next((p.files for p in here if p.holder == t and p.origin == t), frozenset()))
        # a piece already on the target first (a local copy), then the pieces adding the most
        for p in sorted(here, key=lambda p: (p.holder != t, -len(p.files - have))):
            if not need - have:
                break
            if (p.holder, p.origin) != (t, t) and (p.files & need) - have:
                moves.append(Move(p, t))
                have |= p.files
    return moves


class Replicator:
    """Copies each node's newest complete checkpoint to its replica holder (`ring`); called from
    ArtifactCopier's copying thread as the nodes' streams report new checkpoints, and by its
    end-of-attempt sweep. `dirs` is the attempt's prepare() answer per node."""

    def __init__(self, cluster: Cluster, dirs: dict[str, dict], say: Callable[[str], None] = print,
                 keep: int = KEEP):
        self.cluster, self.dirs, self.say, self.keep = cluster, dirs, say, keep
        self.done: set[tuple[str, str, str]] = set()  # (source, holder, checkpoint) copied
        self.copy_s = 0.0
        self.bytes = 0
        self.events: list[tuple[float, str, str, str]] = []  # (time, source, holder, checkpoint)

    def poll(self, nodes: list[str], found: dict[str, list[dict]]) -> None:
        """`found`: each node's complete checkpoints, newest first (as the node's stream or the
        sweep's poll reported them)."""
        alive = self.cluster.live(nodes)
        holders = {s: h for s, h in ring(nodes).items() if s in alive and h in alive}
        for src, holder in holders.items():
            ckpts = found.get(src) or []
            if ckpts and (src, holder, ckpts[0]["name"]) not in self.done:
                self.replicate(src, holder, ckpts[0]["name"])

    def replicate(self, src: str, holder: str, name: str) -> bool:
        t0 = time.monotonic()
        dst_dir = posixpath.join(self.dirs[holder]["replicas"], src)
        cl = self.cluster
        r = pair.copy(cl, cl.inventory.node(src), self.dirs[src]["checkpoints"], [name],
                      cl.inventory.node(holder), dst_dir)
        self.copy_s += time.monotonic() - t0
        if not r.ok:
            self.say(f"could not copy {name} from {src} to {holder}: {r.detail}")
            return False
        self.done.add((src, holder, name))
        self.bytes += r.bytes
        self.events.append((time.time(), src, holder, name))
        self.say(f"checkpoint {name} of {src} replicated to {holder}")
        wire.send(cl, lambda n: artifacts.prune(n, dst_dir, self.keep), [holder], timeout=artifacts.TIMEOUT)
        return True


class NodeRestoreError(Exception):
    pass


def restore_from_nodes(cluster: Cluster, dirs: dict[str, dict], nodes: list[str], newer_than: int,
                       say: Callable[[str], None] = print) -> tuple[str, list[str]] | None:
    """Put the newest checkpoint the attempt's `nodes` hold (own or replica), if newer than step
    `newer_than`, where the trainer looks. Returns its name and the nodes written to; None:
    nothing newer on the nodes."""
    res = wire.run(cluster, lambda n: artifacts.held(n, dirs[n.name]["checkpoints"], dirs[n.name]["replicas"]), nodes)
    pieces = []
    for name, got in res.items():
        if got.error is not None:
            say(f"{name}: could not list the checkpoints it holds: {got.error}")
            continue
        try:
            pieces += pieces_of(name, got.held)
        except (ValueError, KeyError, TypeError):
            say(f"{name}: could not read the checkpoints it holds")
    plan = plan_restore(pieces, nodes, newer_than)
    if plan is None:
        return None
    name, moves = plan
    for m in moves:
        p = m.piece
        src_dir = dirs[p.holder]["checkpoints"] if p.holder == p.origin else \
            posixpath.join(dirs[p.holder]["replicas"], p.origin)
        r = pair.copy(cluster, cluster.inventory.node(p.holder), src_dir, [name],
                      cluster.inventory.node(m.target), dirs[m.target]["checkpoints"])
        if not r.ok:
            raise NodeRestoreError(f"could not restore {name} from {p.holder} to {m.target}: {r.detail}")
        whose = f" ({p.origin}'s, replica on {p.holder})" if p.holder != p.origin else ""
        say(f"checkpoint {name}{whose} copied from {p.holder} to {m.target}, node to node")
    return name, sorted({m.target for m in moves})
