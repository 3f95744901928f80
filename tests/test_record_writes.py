"""How often the run record is written: a teardown's node ends, which arrive together on the log
copies' loop, cost one write of run.json, not one each (each is the whole record, fsync'd); what a
crash must not lose (the first failure, the teardown, the run's end) is still written at once, and
carries the node ends that wait. Pure: the real Book and AttemptRunner over a run directory; the
nodes' ends are handed in as the log copies' loop hands them (AttemptRunner.node_ended)."""

import time

import pytest

from orchestrator.runs import record
from orchestrator.runs.spec import NodeState, RunResult, RunState

from tests.recordrun import N, end, running

pytestmark = pytest.mark.usefixtures("home")


@pytest.fixture
def writes(monkeypatch):
    """The writes of run.json, counted where Book makes them."""
    seen = []
    real = record.write_json

    def counted(path, doc, *a, **k):
        if path.name == "run.json":
            seen.append(doc.get("state"))
        return real(path, doc, *a, **k)

    monkeypatch.setattr(record, "write_json", counted)
    return seen


def test_a_teardowns_node_ends_cost_one_write_of_the_record_not_one_each(writes, monkeypatch):
    # the burst is one turn however slow this machine is (raising=False: on a Book without it the count fails)
    monkeypatch.setattr(record, "FLUSH_S", 3600.0, raising=False)
    run, book, runner = running(stop_requests=1)  # a stop: the nodes end with the stop's exit, none of them first
    writes.clear()
    for i, name in enumerate(runner.statuses):
        end(runner, name, 0 if i % 2 else 143, 100.0 + i)
    assert len(writes) <= 1, f"{len(writes)} writes of run.json for {N} node ends in one burst"
    book.flush()
    assert len(writes) == 1
    book.flush()  # nothing waits: nothing written
    assert len(writes) == 1
    rec = run.record  # every node's end reached the disk with that one write
    assert [(n.state, n.exit_code, n.node_ended) for n in rec.nodes] == \
        [(NodeState.FINISHED if i % 2 else NodeState.FAILED, 0 if i % 2 else 143, 100.0 + i) for i in range(N)]


def test_node_ends_reach_the_disk_by_themselves_within_the_flush(writes, monkeypatch):
    monkeypatch.setattr(record, "FLUSH_S", 0.05)
    run, book, runner = running(stop_requests=1)
    writes.clear()
    for i, name in enumerate(runner.statuses):
        end(runner, name, 0, 100.0 + i)
    deadline = time.monotonic() + 30  # a bounded wait for the timer's write, not a timing check
    while time.monotonic() < deadline and not all(n.state is NodeState.FINISHED for n in run.record.nodes):
        time.sleep(0.02)
    assert all(n.state is NodeState.FINISHED and n.exit_code == 0 for n in run.record.nodes)
    assert 1 <= len(writes) < N


def test_the_first_failure_the_teardown_and_the_runs_end_are_written_at_once_with_the_waiting_ends(writes,
                                                                                                   monkeypatch):
    monkeypatch.setattr(record, "FLUSH_S", 3600.0)  # nothing is written by the timer in this test
    run, book, runner = running()
    names = list(runner.statuses)
    end(runner, names[0], 0, 100.0)  # a node finished before the failure: its end waits
    assert run.record.nodes[0].state is NodeState.RUNNING
    end(runner, names[5], 1, 101.0)  # the first failure: written before the teardown acts on it
    rec = run.record
    assert rec.current.failed_at is not None and rec.nodes[5].exit_code == 1 and rec.nodes[0].exit_code == 0
    assert runner.stopper.asked.wait(30)  # the teardown's thread asked the nodes to stop, recorded first
    runner.close()
    assert run.record.teardown == f"{names[5]} failed"
    writes.clear()
    for i, name in enumerate(names[6:], 6):  # the peers' ends, killed by the teardown: deferred
        end(runner, name, 143, 102.0 + i)
    assert writes == []
    book.ended(runner.result())  # the run's end: at once, whatever waits, and with every end that waited
    assert writes == ["failed"]
    rec = run.record
    assert rec.state is RunState.FAILED and rec.exit_code == 1 and rec.first_failure.node == names[5]
    assert all(n.exit_code is not None for i, n in enumerate(rec.nodes) if i not in range(1, 5))


def test_an_older_snapshot_written_late_never_replaces_a_newer_record(monkeypatch):
    monkeypatch.setattr(record, "FLUSH_S", 3600.0)
    run, book, runner = running(n=4, stop_requests=1)
    end(runner, "n1", 0, 100.0)
    with book._lock:  # the flush's snapshot, taken just before the run's end is written on another thread
        old = book._snapshot()
    book.ended(RunResult(RunState.STOPPED, 130, "stopped on request"))
    book._put(*old)  # the flush's write comes last: skipped, the newer record stays
    assert run.record.state is RunState.STOPPED
