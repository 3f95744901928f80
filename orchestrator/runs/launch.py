"""Starting a run on the nodes through the node agent (its client: runs/agent.py).

A run's processes on a node are found by its key RUN_ID@NODE, never by name. The nodes are
claimed for the run first, one at a time; `launch` starts the master first and the others once
its rendezvous port listens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from orchestrator.errors import LaunchError
from orchestrator.inventory import Inventory, Node
from orchestrator.probe import REMOTE, program
from orchestrator.runs import agent
from orchestrator.runs.agent import Claim, RunKey
from orchestrator.runs.spec import NodeState, NodeStatus, RunSpec
from orchestrator.torchrun import node_env, target_argv, torchrun_argv
from orchestrator.transport import Cluster

# runs each worker so its lines reach the log whole and tagged `[default<local rank>]:`
RANK_LINES = program("rank_lines").decode()
# in every rank: answers the node agent's `snapshot` with its stacks and Flight Recorder (runs/hang.py)
HOOK = (REMOTE / "hook" / "sitecustomize.py").read_text()
LISTEN_WAIT = 120  # how long the master's rendezvous port may take to listen


class NodeBusy(LaunchError):
    """A node is claimed by another run: its claim rides along."""

    def __init__(self, node: str, holder: Claim):
        self.node, self.holder = node, holder
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.since))
        super().__init__(f"{node} is running {holder.run or '?'} (claimed by {holder.who or '?'} "
                         f"since {since}). Stop it with `clusterctl stop {holder.run or 'RUN'}`, pass "
                         "--queue to wait for it, or --force to share the node")


def no_agent(node: Node, why: str) -> LaunchError:
    return LaunchError(f"{node.name}: cannot run the node agent with {node.python}: {why}")


def claim_nodes(cluster: Cluster, inv: Inventory, run_id: str, who: str) -> None:
    """Take every node for this run, one at a time in rank order (the node agent's `claim`,
    atomic on the node): of two launches at once on the same nodes exactly one gets them all.
    Refused: the claims taken are released and NodeBusy names the run holding the node."""
    taken: list[str] = []
    for node in inv.nodes:
        got = agent.run(cluster, lambda n: agent.claim(n, run_id, who), [node.name])[node.name]
        if got.error is not None or not got.ok:
            agent.run(cluster, lambda n: agent.release(n, run_id), taken)
            raise no_agent(node, got.error) if got.error is not None else NodeBusy(node.name, got.claim)
        taken.append(node.name)


def check_free(cluster: Cluster, inv: Inventory, force: bool) -> None:
    """Runs alive on the nodes that hold no claim (started with --force, or by an older
    clusterctl, or an attempt whose stop is still pending): LaunchError naming them, unless forced."""
    live = agent.run(cluster, agent.live, [n.name for n in inv.nodes])
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
        # torchrun runs the wrapper as the script; it runs `python -u TARGET` as torchrun would have;
        # `resume_args` (--resume-args) follow the job's own when the launch starts from a checkpoint
        self.target = ["{rundir}/rank_lines.py", *target_argv(inv, spec.args), *resume_args]

    def start_spec(self, node: Node) -> agent.StartSpec:
        """What the node's agent starts: torchrun for the node's ranks, its environment (env: tokens
        stay off every command line)."""
        inv, st = self.inv, self.statuses[node.name]
        argv = torchrun_argv(python=node.python, nnodes=len(inv.nodes), nproc=st.nproc, node_rank=st.rank,
                             master_addr=inv.master.address, master_port=inv.master_port, run_id=self.run_id,
                             target=self.target, extra=["--log-dir", "{rundir}/torchrun"])
        env = node_env(inv, node, extra={"CLUSTERCTL_RUN_ID": self.run_id, **self.extra_env.get(node.name, {})})
        return agent.StartSpec(argv, node.workdir, env, {"rank_lines.py": RANK_LINES}, HOOK)

    def start(self, names: list[str]) -> None:
        started = agent.run(self.cluster, lambda n: agent.start(n, self.run_id, self.start_spec(n)), names)
        for name, got in started.items():
            if got.error is not None:
                raise LaunchError(f"{name}: could not start torchrun: {got.error}")
            st = self.statuses[name]
            st.state, st.pid = NodeState.RUNNING, got.pid

    def master_listening(self) -> bool:
        master, port = self.inv.master, self.inv.master_port
        got = agent.run(self.cluster, lambda n: agent.wait_listening(n, self.run_id, port, LISTEN_WAIT), [master.name])
        return got[master.name] is agent.Port.LISTENING

    def launch(self) -> None:
        """Node 0 first: the others start once its rendezvous store listens. When the master
        exits or never listens, the others are not started and the log watch reports it."""
        master = self.inv.master
        self.start([master.name])
        if len(self.inv.nodes) > 1 and self.master_listening():
            self.start([n.name for n in self.inv.nodes[1:]])
