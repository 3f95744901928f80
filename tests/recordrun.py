"""A run of N nodes through the real Book and AttemptRunner, attempt 1 running on every node, whose
nodes' ends are handed in as the log copies' loop hands them: tests/test_record_writes.py and
bench/bench_record_writes.py count the run record's writes over it. Not a test module."""

import threading

import yaml

from orchestrator.inventory import parse_inventory
from orchestrator.node.agent import AgentStatus
from orchestrator.runs.attempt import AttemptRunner
from orchestrator.runs.record import Book
from orchestrator.runs.runrecord import AttemptRecord
from orchestrator.runs.spec import NodeState, RunSpec
from orchestrator.runs.store import Run
from orchestrator.transport import NodeResult

N = 64


class Cluster:
    connections: dict = {}  # the log copies handed in each node's final status: nobody is asked

    def live(self, names):
        return []


class Stopper:
    def __init__(self):
        self.asked = threading.Event()
        self.calls: list[tuple[list[str], bool]] = []  # (nodes, peer_failed) of each stop

    def stop(self, key, nodes, grace, unreached_ok=(), peer_failed=False, streams=None):
        self.calls.append((list(nodes), peer_failed))
        self.asked.set()
        return []


def running(n=N, stop_requests=0, run_id="r-w"):
    """A run of `n` nodes, attempt 1 running on every one of them."""
    names = [f"n{i}" for i in range(1, n + 1)]
    inv = parse_inventory(yaml.safe_dump({"nodes": [{"name": m, "host": f"10.0.{i // 250}.{i % 250 + 1}"}
                                                    for i, m in enumerate(names)]}), "<t>")
    run = Run.create(run_id, RunSpec())
    book = Book(run)
    a = AttemptRecord(1, run.id, names)
    runner = AttemptRunner(run=run, spec=RunSpec(), book=book, cluster=Cluster(), inv=inv, record=a,
                           stopper=Stopper(), stop_requests=stop_requests, say=lambda s: None)
    book.connecting()
    book.claimed(names)
    book.attempt_started(a, list(runner.statuses.values()))
    for i, st in enumerate(runner.statuses.values()):
        st.state, st.pid, st.nproc, st.first_rank, st.last_rank = NodeState.RUNNING, 1000 + i, 1, i, i
    runner.save()
    book.launching("ranks", n)
    book.running()
    return run, book, runner


def end(runner, name, code, at):
    runner.node_ended(NodeResult(name, code), AgentStatus(exists=True, exit_code=code, ended=at))
