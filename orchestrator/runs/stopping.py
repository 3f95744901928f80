"""Stopping a run on every node: the grace (stretched to cover a checkpoint save), the nodes
reached now, and a retry per node that cannot be reached until it answers again (its name stays
in the record's stop_pending until then). Mixed into the Supervisor, whose state it uses."""

from __future__ import annotations

import threading
import time

from orchestrator.errors import ClusterctlError
from orchestrator.inventory import Node
from orchestrator.runs.launch import AGENT, agent_cmd, agent_status, node_key, stop_on
from orchestrator.runs.policy import stop_grace
from orchestrator.runs.spec import NodeState
from orchestrator.transport import wait

LOST_PATIENCE = 300.0  # how long a lost node is retried, to stop the run there once it answers
LOG_DRAIN_S = 60.0  # after a stop's grace, how long the nodes' logs may take to close


def say(text: str) -> None:
    print(f"supervisor: {text}", flush=True)  # stdout is runs/RUN/supervisor.log


class Stopping:
    def grace(self) -> float:
        """A second stop request kills; else the grace asked for (stop --grace, else the run's),
        stretched to cover the job's last checkpoint save on any node."""
        if self.policy.stop_requests >= 2:
            return 0.0
        req = self.run.stop_request or {}
        grace = req.get("grace") if req.get("grace") is not None else self.spec.grace
        live = [n for n, c in self.cluster.connections.items() if c.alive] if self.cluster else []
        saves = [d.get("save_seconds") or 0
                 for d in agent_status(self.cluster, self.key, live, timeout=10).values()] if live else []
        return stop_grace(grace, max(saves, default=0))

    def teardown(self, why: str) -> None:
        """Stop the run on every node; a node that cannot be reached now is stopped once it answers
        (its name stays in the record's stop_pending until then)."""
        cluster = self.cluster
        if cluster is None:
            return
        with self.tlock:
            grace = self.grace()
            self.save(teardown=why, teardown_at=time.time(), stop_grace=grace)
            if self.drain_timer is None:  # the logs may take the grace, then LOG_DRAIN_S, to close
                self.drain_timer = threading.Timer(grace + LOG_DRAIN_S, self.drained.set)
                self.drain_timer.daemon = True
                self.drain_timer.start()
        # every reachable node, the failed one too: what is left of the run there is stopped
        live = [n.name for n in self.inv.nodes if (c := cluster.connections.get(n.name)) is not None and c.alive]
        res = stop_on(cluster, self.key, grace, live) if live else {}
        with self.tlock:
            for n in self.inv.nodes:  # nodes not reached: stop them as soon as they answer again
                r = res.get(n.name)
                if (r is None or not r.reachable) and self.statuses[n.name].state in (NodeState.RUNNING,
                                                                                    NodeState.LOST):
                    say(f"{n.name}: could not confirm the stop ({r.describe() if r else 'not connected'}); "
                        "retrying until the node answers")
                    self.start_stopper(n, grace)
            self.save(stop_pending=sorted(self.stoppers))

    def start_stopper(self, node: Node, grace: float) -> None:
        if node.name not in self.stoppers:
            t = threading.Thread(target=self.stop_lost, args=(node, grace), daemon=True)
            self.stoppers[node.name] = t
            t.start()

    def stop_lost(self, node: Node, grace: float) -> None:
        """Retry a node on a fresh connection until it answers, then stop the run there."""
        deadline = time.time() + LOST_PATIENCE
        while time.time() < deadline:
            c = self.cluster.connection_for(node, connect_timeout=3)
            try:
                c.open()
                res = wait(c.exec(agent_cmd(node, "stop", node_key(self.key, node), grace), stdin=AGENT),
                           grace + 30)
                if res.reachable:
                    say(f"stopped the run on {node.name} after it answered again")
                    wait(c.exec(agent_cmd(node, "release", node.name, node_key(self.run.id, node)),
                                stdin=AGENT), 30)
                    if node.name in self.statuses:
                        self.statuses[node.name].stopped_after_loss = True
                    with self.tlock:
                        self.stoppers.pop(node.name, None)
                        self.save(stop_pending=sorted(self.stoppers))
                    return
                say(f"{node.name}: the stop did not finish ({res.describe()}); retrying")
            except ClusterctlError as e:  # ConnectError, ConnectionLost: not answering yet
                say(f"{node.name} still unreachable ({e}); retrying")
            finally:
                c.close()
            time.sleep(1)

