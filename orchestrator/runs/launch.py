"""Starting a run on the nodes through the node agent (orchestrator/remote/node_agent.py).

The agent is shipped on stdin to every command (`python - CMD ARGS`); a run's processes on a
node are found by its key RUN_ID@NODE, never by name. `launch` starts the master first and the
others once its rendezvous port listens.
"""

from __future__ import annotations

import json
import re
import time
from importlib import resources

from orchestrator import shell
from orchestrator.errors import LaunchError
from orchestrator.inventory import Inventory, Node
from orchestrator.runs.spec import NodeState, NodeStatus, RunSpec
from orchestrator.torchrun import node_env, target_argv, torchrun_argv
from orchestrator.transport import Cluster, ClusterResult

AGENT = resources.files("orchestrator").joinpath("remote/node_agent.py").read_bytes()
# runs each worker so its lines reach the log whole and tagged `[default<local rank>]:`
RANK_LINES = resources.files("orchestrator").joinpath("remote/rank_lines.py").read_text()
STATUS_MARK = "clusterctl-status "  # the node agent's STATUS_MARK: `tail KEY OFFSET status`'s last stderr line
AGENT_TIMEOUT = 60.0  # one agent command (start, status, live)
LISTEN_WAIT = 120  # how long the master's rendezvous port may take to listen


def agent_cmd(node: Node, *args: object) -> str:
    return f"{shell.path(node.python)} - {shell.join(args)}"


def node_key(run_id: str, node: Node) -> str:
    return f"{run_id}@{node.name}"


def agent_status(cluster: Cluster, run_id: str, nodes: list[str] | None = None,
                 timeout: float = 30) -> dict[str, dict]:
    """Each node's own view of the run (agent `status`): node -> its JSON, or {"error": why}."""
    res = cluster.run(lambda n: agent_cmd(n, "status", node_key(run_id, n)), stdin=AGENT, timeout=timeout,
                      nodes=nodes)
    out: dict[str, dict] = {}
    for name, r in res.items():
        try:
            out[name] = json.loads(r.stdout) if r.ok else {"error": r.describe()}
        except ValueError:
            out[name] = {"error": r.stdout[-200:]}
    return out


def stop_on(cluster: Cluster, run_id: str, grace: float, nodes: list[str] | None = None,
            peer_failed: bool = False) -> ClusterResult:
    """SIGTERM the run on each node, SIGKILL after `grace` seconds (the agent stretches it to cover
    a checkpoint save). `peer_failed`: a node of the run already failed, so no collective save can
    complete: the agent kills at once, unless a checkpoint is being written there."""
    mode = ["peer-failed"] if peer_failed else []
    return cluster.run(lambda n: agent_cmd(n, "stop", node_key(run_id, n), grace, *mode), stdin=AGENT, nodes=nodes,
                       timeout=grace + 30)


def _agent_json(name: str, inv: Inventory, r):
    """The JSON an agent command printed last; LaunchError when the agent could not run."""
    if not r.ok:
        raise LaunchError(f"{name}: cannot run the node agent with {inv.node(name).python}: "
                          f"{r.describe()} {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


class NodeBusy(LaunchError):
    """A node is claimed by another run: its claim record {"run", "who", "since"} rides along."""

    def __init__(self, node: str, holder: dict):
        self.node, self.holder = node, holder
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since") or 0))
        super().__init__(f"{node} is running {holder.get('run', '?')} (claimed by {holder.get('who', '?')} "
                         f"since {since}). Stop it with `clusterctl stop {holder.get('run', 'RUN')}`, pass "
                         "--queue to wait for it, or --force to share the node")


def node_claims(cluster: Cluster, nodes: list[str] | None = None, timeout: float = AGENT_TIMEOUT) -> ClusterResult:
    """Every claim on each node's machine (agent `claims`): the raw results, JSON on stdout."""
    return cluster.run(lambda n: agent_cmd(n, "claims"), stdin=AGENT, nodes=nodes, timeout=timeout)


def claim_nodes(cluster: Cluster, inv: Inventory, run_id: str, who: str) -> None:
    """Take every node for this run, one at a time in rank order (the node agent's `claim`,
    atomic on the node): of two launches at once on the same nodes exactly one gets them all.
    Refused: the claims taken are released and NodeBusy names the run holding the node."""
    taken: list[str] = []
    for node in inv.nodes:
        r = cluster.run(agent_cmd(node, "claim", node.name, node_key(run_id, node), who), stdin=AGENT,
                        nodes=[node.name], timeout=AGENT_TIMEOUT)[node.name]
        doc = _agent_json(node.name, inv, r)
        if not doc.get("ok"):
            release_nodes(cluster, inv, run_id, taken)
            raise NodeBusy(node.name, doc)
        taken.append(node.name)


def release_nodes(cluster: Cluster, inv: Inventory, run_id: str, names: list[str] | None = None) -> ClusterResult:
    """Drop this run's claims (a claim held by another run is left alone)."""
    return cluster.run(lambda n: agent_cmd(n, "release", n.name, node_key(run_id, n)), stdin=AGENT,
                       nodes=names, timeout=AGENT_TIMEOUT)


KEY_RE = re.compile(r"^(?P<run>[^@]+?)(?:\.a(?P<attempt>\d+))?@(?P<node>[^@]+)$")


def parse_key(key: str) -> tuple[str, int, str] | None:
    """RUN_ID[.aK]@NODE -> (run id, attempt, node); None for what is not a run key. A run id ends
    in 4 hex digits (store.new_run_id), so a trailing .aK is always the attempt."""
    m = KEY_RE.match(key)
    return (m["run"], int(m["attempt"] or 1), m["node"]) if m else None


def live_keys(cluster: Cluster, names: list[str]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The keys of runs with a live process on each node (agent `live`: found by the run key in
    their environment) and {node: why} for the nodes that could not be asked."""
    res = cluster.run(lambda n: agent_cmd(n, "live"), stdin=AGENT, timeout=AGENT_TIMEOUT, nodes=names)
    out, failed = {}, {}
    for name, r in res.items():
        try:
            keys = json.loads(r.stdout.strip().splitlines()[-1]) if r.ok else None
        except (ValueError, IndexError):
            keys = None
        if keys is None:
            failed[name] = r.describe() if not r.ok else f"the node agent printed {r.stdout[-200:]!r}"
        else:
            out[name] = [k for k in keys if k.endswith("@" + name)]
    return out, failed


def check_free(cluster: Cluster, inv: Inventory, force: bool) -> None:
    """Runs alive on the nodes that hold no claim (started with --force, or by an older
    clusterctl, or an attempt whose stop is still pending): LaunchError naming them, unless forced."""
    live, failed = live_keys(cluster, [n.name for n in inv.nodes])
    if failed:
        name, why = next(iter(failed.items()))
        raise LaunchError(f"{name}: cannot run the node agent with {inv.node(name).python}: {why}")
    busy = {k: v for k, v in live.items() if v}
    if busy and not force:
        desc = "; ".join(f"{k} is running {', '.join(x.split('@')[0] for x in v)}" for k, v in busy.items())
        raise LaunchError(f"{desc}. Stop it with `clusterctl stop RUN`, or pass --force to share the node")


def stray_processes(cluster: Cluster, run_id: str, names: list[str]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Every attempt of `run_id` still alive on these nodes: {node: [keys]}, and the nodes not asked."""
    live, failed = live_keys(cluster, names)
    return {n: ks for n, keys in live.items() if (ks := [k for k in keys if (p := parse_key(k)) and p[0] == run_id])}, failed


class Launcher:
    """Builds each node's start command and spec, and starts torchrun in rank order."""

    def __init__(self, cluster: Cluster, inv: Inventory, run_id: str, spec: RunSpec,
                 statuses: dict[str, NodeStatus]):
        self.cluster, self.inv, self.run_id, self.statuses = cluster, inv, run_id, statuses
        self.extra_env: dict[str, dict[str, str]] = {}  # node -> its own additions (checkpoint dir, attempt)
        # torchrun runs the wrapper as the script; it runs `python -u TARGET` as torchrun would have
        self.target = ["{rundir}/rank_lines.py", *target_argv(inv, spec.args)]

    def start_cmd(self, node: Node) -> str:
        return agent_cmd(node, "start", node_key(self.run_id, node), "-")

    def start_stdin(self, node: Node) -> bytes:
        """The agent script with the node's spec prepended: the spec (env: tokens) stays off argv."""
        inv, st = self.inv, self.statuses[node.name]
        argv = torchrun_argv(python=node.python, nnodes=len(inv.nodes), nproc=st.nproc, node_rank=st.rank,
                             master_addr=inv.master.address, master_port=inv.master_port, run_id=self.run_id,
                             target=self.target, extra=["--log-dir", "{rundir}/torchrun"])
        spec = {"argv": argv, "cwd": node.workdir, "files": {"rank_lines.py": RANK_LINES},
                "env": node_env(inv, node, extra={"CLUSTERCTL_RUN_ID": self.run_id,
                                                               **self.extra_env.get(node.name, {})})}
        return f"SPEC_HEX = {json.dumps(spec).encode().hex()!r}\n".encode() + AGENT

    def start(self, names: list[str]) -> None:
        res = self.cluster.run(self.start_cmd, nodes=names, stdin=self.start_stdin, timeout=AGENT_TIMEOUT)
        for name, r in res.items():
            if not r.ok:
                raise LaunchError(f"{name}: could not start torchrun: {r.describe()} {r.stderr.strip()[-500:]}")
            info = json.loads(r.stdout.strip().splitlines()[-1])
            st = self.statuses[name]
            st.state, st.pid = NodeState.RUNNING, info.get("pid")

    def master_listening(self) -> bool:
        master = self.inv.master
        r = self.cluster.run(agent_cmd(master, "wait-listening", node_key(self.run_id, master),
                                       self.inv.master_port, LISTEN_WAIT),
                             nodes=[master.name], stdin=AGENT, timeout=LISTEN_WAIT + 30)[master.name]
        return r.stdout.strip() == "listening"

    def launch(self) -> None:
        """Node 0 first: the others start once its rendezvous store listens. When the master
        exits or never listens, the others are not started and the log watch reports it."""
        master = self.inv.master
        self.start([master.name])
        if len(self.inv.nodes) > 1 and self.master_listening():
            self.start([n.name for n in self.inv.nodes[1:]])
