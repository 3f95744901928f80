"""Starting a run on the nodes through the node agent (its client: node/agent.py).

A run's processes on a node are found by its key RUN_ID@NODE, never by name. The nodes are
claimed for the run first, one at a time; `launch` starts the master first and the others once
its rendezvous port listens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from orchestrator.errors import EXIT_FAILED, EXIT_UNREACHABLE, ConnectError, LaunchError
from orchestrator.inventory import Inventory, Node
from orchestrator.probe import REMOTE
from orchestrator.node import agent
from orchestrator.node.agent import Claim, RunKey
from orchestrator.runs.spec import NodeState, NodeStatus, RunSpec
from orchestrator.runs.store import Run
from orchestrator.torchrun import node_env, rdzv_conf, target_argv, torchrun_argv
from orchestrator.transport import Cluster

if TYPE_CHECKING:
    from orchestrator.runs.record import Book

# in every rank: hands its output to the node's waiter, which writes it into the log as whole lines
# tagged `[default<local rank>]:`, and answers the node agent's `snapshot` with its stacks and
# Flight Recorder (runs/judge/hang.py)
HOOK = (REMOTE / "hook" / "sitecustomize.py").read_text()


class ClaimFailed(LaunchError):
    """The run could not claim its nodes. `maybe_held`: nodes that went away while they were
    claimed, so their claim may have landed all the same (recorded as held: the run's end drops it)."""

    def __init__(self, message: str, maybe_held: Sequence[str] = (), exit_code: int = EXIT_FAILED):
        super().__init__(message, exit_code)
        self.maybe_held = tuple(maybe_held)


class NodeBusy(ClaimFailed):
    """A node is claimed by another run: its claim rides along."""

    def __init__(self, node: str, holder: Claim, maybe_held: Sequence[str] = ()):
        self.node, self.holder = node, holder
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.since))
        super().__init__(f"{node} is running {holder.run or '?'} (claimed by {holder.who or '?'} "
                         f"since {since}). Stop it with `clusterctl stop {holder.run or 'RUN'}`, pass "
                         "--queue to wait for it, or --force to share the node", maybe_held)


class ClaimLost(ClaimFailed):
    """A node went away while it was being claimed: the claim may have landed there all the same."""

    def __init__(self, node: str, why: str, maybe_held: Sequence[str] = ()):
        super().__init__(f"{node}: unreachable while claiming it: {why}", maybe_held or (node,))
        self.node = node


class NodesNotReady(LaunchError):
    """Nodes entering a relaunch could not be claimed or brought to the run's code: {node: why}."""

    def __init__(self, why: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in why.items()))
        self.why = why


def no_agent(node: Node, why: str) -> LaunchError:
    return LaunchError(f"{node.name}: cannot run the node agent with {node.python}: {why}")


def claim_round(cluster: Cluster, names: list[str], run_id: str, who: str,
                tell: Callable[[str], None] | None = None, live: bool = False, dirs: bool = False
                ) -> dict[str, agent.Claimed]:
    """The node agent's `claim` (atomic on the node) on each of `names` at once: {node: its
    answer}; with `live`, each answer also holds the runs alive on its node, with `dirs` (the
    claim taken) the run's artifact directories there. A node refused by
    the claim of a run recorded on this machine that has ended with no supervisor left to
    release it (`left_over`) has that claim dropped, told, and is claimed again."""
    got = agent.run(cluster, lambda n: agent.claim(n, run_id, who, live, dirs), names)
    stale = {n: got[n].claim.run for n in names if got[n].error is None and not got[n].ok and left_over(got[n].claim)}
    if stale:
        agent.run(cluster, lambda n: agent.release(n, stale[n.name]), stale)
        for name, holder in stale.items():
            if tell is not None:
                tell(f"{name}: dropped the claim run {holder} left there (it ended, and nothing "
                     "of it was left to release it)")
        got.update(agent.run(cluster, lambda n: agent.claim(n, run_id, who, live, dirs), stale))
    return got


def refusal(cluster: Cluster, inv: Inventory, name: str, got: agent.Claimed, maybe_held: Sequence[str] = ()
            ) -> ClaimFailed:
    """Why `name` was not claimed: lost while it was asked (ClaimLost), its node agent would not
    run, or another run holds it (NodeBusy)."""
    if got.error is None:
        return NodeBusy(name, got.claim, maybe_held)
    if cluster.live([name]):
        return ClaimFailed(str(no_agent(inv.node(name), got.error)), maybe_held)
    return ClaimLost(name, got.error, maybe_held)


def claim_nodes(cluster: Cluster, inv: Inventory, run_id: str, who: str,
                tell: Callable[[str], None] | None = None, live: bool = False, dirs: bool = False
                ) -> dict[str, agent.Claimed]:
    """Take every node for this run, all or none: the first node in rank order alone, then the
    others at once (`claim_round`). Two launches at once on the same nodes both ask for the first
    node first, and the node agent gives it to exactly one, so that one gets them all and the
    other is refused having taken nothing; the others at once cost one round trip instead of one
    per node (one at a time, 64 test nodes took 11.5 s). The run's own claim is renewed.
    Refused: the claims taken are released (with `dirs`, the empty directories they made removed)
    and ClaimFailed says why, naming the first node in rank order that was refused (NodeBusy: the
    run holding it; ClaimLost: it went away). Returns
    each node's answer (with `live`, the runs alive there: `check_free` need not ask again; with
    `dirs`, the run's artifact directories: runs/restart.py `prepare_artifacts` need not make them)."""
    names = [n.name for n in inv.nodes]
    taken: list[str] = []
    answers: dict[str, agent.Claimed] = {}
    for part in (names[:1], names[1:]):
        if not part:
            continue
        answers.update(got := claim_round(cluster, part, run_id, who, tell, live, dirs))
        taken += [n for n in part if got[n].error is None and got[n].ok]
        refused = [n for n in part if n not in taken]
        if refused:
            agent.run(cluster, lambda n: agent.release(n, run_id, dirs=dirs), taken)
            maybe = [n for n in refused if got[n].error is not None and not cluster.live([n])]
            raise refusal(cluster, inv, refused[0], got[refused[0]], maybe)
    return answers


def left_over(holder: Claim) -> bool:
    """The claim of a run recorded on this control machine that has ended and has no supervisor
    (which would drop it once the node answered): nobody else will."""
    if not holder.run or not all(c.isalnum() or c in "-_." for c in holder.run) or holder.run.startswith("."):
        return False  # not a run id this machine could have made (store.new_run_id)
    run = Run(holder.run)
    return (run.dir / "run.json").exists() and run.terminal and not run.supervisor_alive()


def stand_ins(wanted: list[str], spares: list[str], out: dict[str, str]
              ) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """The first attempt's nodes in rank order, each node that cannot be used (`out`: {node: why},
    quarantined or unreachable) replaced by the next spare. -> (nodes, {node left without a
    stand-in: why}, {node: the spare in its place})."""
    spares = [s for s in spares if s not in out]
    nodes, short, instead = [], {}, {}
    for name in wanted:
        if name not in out:
            nodes.append(name)
        elif spares:
            instead[name] = spares.pop(0)
            nodes.append(instead[name])
        else:
            short[name] = out[name]
    return nodes, short, instead


def first_lineup(inv: Inventory, cluster: Cluster, held: dict, min_nodes: int | None, book: "Book") -> list[str]:
    """The first attempt's nodes: the ranked nodes, the place of one that is quarantined
    (`held`: {node: runs/quarantine.py Entry}) or cannot be reached taken by a spare (or, with
    --min-nodes, left empty), each told and left out of the run. Nothing was launched, so no
    restart is spent. Not enough nodes: LaunchError naming them (exit 3 for an unreachable one)."""
    wanted = [n.name for n in inv.nodes if not n.spare]
    down = {n: cluster.unreachable[n].error or "unreachable" for n in wanted if n in cluster.unreachable}
    out = {**{n: held[n].line() for n in wanted if n in held}, **{n: f"unreachable: {w}" for n, w in down.items()}}
    if not out:
        return wanted
    spares = [n.name for n in inv.nodes if n.spare and n.name not in held and n.name in cluster.connections]
    nodes, short, instead = stand_ins(wanted, spares, out)
    if short and len(nodes) < (min_nodes or len(wanted)):
        raise LaunchError(too_few(inv, cluster, wanted, short, down), EXIT_UNREACHABLE if set(short) & set(down)
                          else EXIT_FAILED)
    for name in wanted:
        if name in out:
            why = held[name].line() if name in held else f"{name} is unreachable ({down[name]})"
            book.tell(f"{why}; " + (f"{instead[name]} takes its place" if name in instead
                                    else f"left out (--min-nodes {min_nodes})") +
                      ("; nothing was launched, so no restart is spent" if name in down else ""))
    book.leave_out({n: f"quarantined: {held[n].reason}" if n in held else f"unreachable at launch: {down[n]}"
                    for n in out})
    return nodes


def too_few(inv: Inventory, cluster: Cluster, wanted: list[str], short: dict[str, str], down: dict[str, str]
            ) -> str:
    """Why the first attempt cannot start without the nodes in `short`, and what to do."""
    held, lost = [n for n in short if n not in down], [n for n in short if n in down]
    parts = []
    if lost:
        them, its = ("it", "its") if len(lost) == 1 else ("them", "their")
        parts.append(f"cannot reach {', '.join(lost)}, nothing was started. " + "; ".join(
            f"{n}: {down[n]}" for n in lost) + ".")
        parts += [f"Spare {n.name} cannot be reached either ({cluster.unreachable[n.name].error})."
                  for n in inv.nodes if n.spare and n.name in cluster.unreachable]
        parts.append("Check the addresses and the links: `ssh` to each says the same." if len(lost) == len(wanted)
                     else f"Check the address and the link (`ssh` says the same), add a spare to take {its} "
                          f"place (`spare: true` in the inventory), or start without {them} with --min-nodes "
                          f"{len(wanted) - len(short)}.")
    if held:
        parts.append(f"{'; '.join(short[n] for n in held)}. No spare is left to take "
                     f"{'its' if len(held) == 1 else 'their'} place: release a repaired node with "
                     f"`clusterctl health --release {','.join(held)}`, or use it for this run with "
                     "`train --allow-unhealthy`; nothing was started.")
    return " ".join(parts)


def reopen(cluster: Cluster, names: list[str]) -> None:
    """A dropped connection to a node entering an attempt is opened again first (a spare idle
    since the run began, a node whose link blinked): one try each, the node's connect timeout."""
    for name in names:
        conn = cluster.connections.get(name)
        if conn is not None and not conn.alive:
            try:
                conn.reopen()
            except ConnectError:
                pass  # its claim fails next, naming why


def silent_nodes(cluster: Cluster, names: list[str], tell: Callable[[str], None]) -> dict[str, str]:
    """Those of `names` that do not answer now, {node: why}: each is asked to run `true` (within
    the lost timeout), and a node whose connection dropped is reconnected with the backoff a
    running node gets (runs/logs/streams.py `reconnect`), until the lost timeout after it was last
    heard from. A launch that failed on them failed because they went away."""
    from orchestrator.runs.logs.streams import reconnect

    out = {n: (cluster.unreachable[n].error if n in cluster.unreachable else None) or "not connected"
           for n in names if n not in cluster.connections}
    asked = cluster.run("true", nodes=[n for n in names if n not in out], timeout=cluster.lost_timeout)
    silent = {name: r for name, r in asked.items() if r.exit_code is None}
    whys: dict[str, str | None] = {}

    def again(name: str) -> None:
        whys[name] = reconnect(cluster, cluster.inventory.node(name), silent[name], tell)

    threads = [threading.Thread(target=again, args=(n,), daemon=True, name=f"relaunch-{n}") for n in silent]
    for t in threads:
        t.start()
    for t in threads:  # each gives up within the lost timeout after its node was last heard from
        t.join(cluster.lost_timeout + 60)
    for name in silent:
        why = whys.get(name, "no answer")  # None: it answered again
        if why is not None:
            out[name] = why
    return out


def check_free(cluster: Cluster, inv: Inventory, force: bool, found: Mapping[str, agent.Live] | None = None
               ) -> None:
    """Runs alive on the nodes that hold no claim (started with --force, or by an older
    clusterctl, or an attempt whose stop is still pending): LaunchError naming them, unless forced.
    `found`: what the nodes said of it as they were claimed (`claim_nodes` with live); only the
    nodes it does not cover are asked."""
    found = {n: v for n, v in (found or {}).items() if v.error is None}
    ask = [n.name for n in inv.nodes if n.name not in found]
    live = {**{n.name: found[n.name] for n in inv.nodes if n.name in found},
            **(agent.run(cluster, agent.live, ask) if ask else {})}
    for name, found in live.items():
        if found.error is not None:
            raise no_agent(inv.node(name), found.error)
    busy = {k: v.keys for k, v in live.items() if v.keys}
    if busy and not force:
        desc = "; ".join(f"{k} is running {', '.join(x.run for x in v)}" for k, v in busy.items())
        raise LaunchError(f"{desc}. Stop it with `clusterctl stop RUN`, or pass --force to share the node")


def stray_processes(cluster: Cluster, run_id: str, names: list[str]) -> tuple[dict[str, list[RunKey]], dict[str, str]]:
    """Every attempt of `run_id` still alive on these nodes: {node: [keys]}, and {node: why} for the
    nodes not asked."""
    live = agent.run(cluster, agent.live, names)
    strays = {n: ks for n, found in live.items() if (ks := [k for k in found.keys if k.run == run_id])}
    return strays, {n: found.error for n, found in live.items() if found.error is not None}


class Launcher:
    """Builds each node's start command and spec, and starts torchrun in rank order."""

    def __init__(self, cluster: Cluster, inv: Inventory, run_id: str, spec: RunSpec,
                 statuses: dict[str, NodeStatus], resume_args: Sequence[str] = ()):
        self.cluster, self.inv, self.run_id, self.statuses = cluster, inv, run_id, statuses
        self.extra_env: dict[str, dict[str, str]] = {}  # node -> its own additions (checkpoint dir, attempt)
        # torchrun runs `python -u TARGET` for each rank; `resume_args` (--resume-args) follow the
        # job's own when the launch starts from a checkpoint
        self.target = [*target_argv(inv, spec.args), *resume_args]
        self.rendezvous_timeout = spec.rendezvous_timeout  # torchrun's --rdzv-conf timeout (runs/scaling.py)

    def start_spec(self, node: Node) -> agent.StartSpec:
        """What the node's agent starts: torchrun for the node's ranks, its environment (env: tokens
        stay off every command line)."""
        inv, st = self.inv, self.statuses[node.name]
        env = node_env(inv, node, extra={"CLUSTERCTL_RUN_ID": self.run_id, **self.extra_env.get(node.name, {})})
        argv = torchrun_argv(python=node.python, nnodes=len(inv.nodes), nproc=st.nproc, node_rank=st.rank,
                             master_addr=inv.master.address, master_port=inv.master_port, run_id=self.run_id,
                             target=self.target, extra=["--log-dir", "{rundir}/torchrun"],
                             rdzv=rdzv_conf(env, self.rendezvous_timeout))
        return agent.StartSpec(argv, node.workdir, env, {}, HOOK)

    def start(self, names: list[str]) -> None:
        started = agent.run(self.cluster, lambda n: agent.start(n, self.run_id, self.start_spec(n)), names)
        for name, got in started.items():
            if got.error is None:
                st = self.statuses[name]
                st.state, st.pid = NodeState.RUNNING, got.pid
        failed = {name: got.error for name, got in started.items() if got.error is not None}
        for name in failed:  # the start may have reached it: its stop stays pending until it answers
            if not self.cluster.live([name]):
                self.statuses[name].state = NodeState.LOST
        if failed:
            raise LaunchError("; ".join(f"{name}: could not start torchrun: {why}" for name, why in failed.items()))

    def launch(self) -> None:
        """In rank order: node 0 first, then every other node at once, without waiting for node 0's
        rendezvous store to listen. Their torchruns start (an interpreter, `import torch`) while
        node 0's does and connect to its store when it listens: torch's store client retries a
        refused connection within the rendezvous timeout ("is not yet listening ..., will retry").
        Waiting for the store put one torchrun start (1-3 s on the test cluster, seconds more on a
        GPU node) on the path of every launch and every restart. A master that exits at once
        fails the attempt, and the failure policy stops the others."""
        self.start([self.inv.master.name])
        if len(self.inv.nodes) > 1:
            self.start([n.name for n in self.inv.nodes[1:]])
