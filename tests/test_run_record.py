"""The run record: one typed document, written only through the named transitions of one table."""

import json

import pytest

from orchestrator.runs.record import TRANSITIONS, Book, TransitionError
from orchestrator.runs.runrecord import AttemptRecord, PendingStop, RunRecord
from orchestrator.runs.spec import FirstFailure, NodeStatus, RunResult, RunSpec, RunState
from orchestrator.runs.store import Run

pytestmark = pytest.mark.usefixtures("home")


def new_book():
    return Book(Run.create("r-1", RunSpec()))


def test_a_restarted_run_goes_through_recovering_and_every_step_is_on_disk():
    book = new_book()
    book.connecting()
    book.claimed(["a", "b"])
    book.attempt_started(AttemptRecord(1, "r-1", ["a", "b"]), [NodeStatus("a", 0, "h"), NodeStatus("b", 1, "h")])
    book.launching("rank 0 → a", 2)
    book.running()
    book.attempt_changed(verdict="node lost", retry=True, bad_nodes=["b"])
    book.leave_out({"b": "attempt 1: node lost"})
    book.recovering("attempt 1: node lost")
    assert book.run.record.state is RunState.RECOVERING and book.run.record.recovering == "attempt 1: node lost"
    book.attempt_started(AttemptRecord(2, "r-1.a2", ["a", "c"], prepared=["c"]), [NodeStatus("a", 0, "h")])
    book.launching("rank 0 → a", 2)
    book.running()
    book.ended(RunResult(RunState.FINISHED, 0, "every node finished"))
    rec = book.run.record
    assert rec.state is RunState.FINISHED and rec.exit_code == 0 and rec.recovering is None
    assert [(a.attempt, a.key, a.nodes, a.prepared) for a in rec.attempts] == \
        [(1, "r-1", ["a", "b"], []), (2, "r-1.a2", ["a", "c"], ["c"])]
    assert rec.attempts[0].bad_nodes == ["b"] and rec.left_out == ["b"] and rec.claimed == ["a", "b"]


@pytest.mark.parametrize("path", [
    ["running"],  # never launched
    ["connecting", "finished"],  # finished without an attempt
    ["connecting", "recovering"],  # recovering from nothing
    ["connecting", "queued", "preflight"],  # left the queue without a claim
])
def test_a_transition_the_table_does_not_allow_is_refused_and_not_written(path):
    book = new_book()
    steps = {"connecting": book.connecting, "queued": lambda: book.queued(["a"]),
             "recovering": lambda: book.recovering("x"), "running": book.running,
             "finished": lambda: book.ended(RunResult(RunState.FINISHED, 0, "ok")),
             "preflight": lambda: book.attempt_started(AttemptRecord(1, "r-1", ["a"]), [])}
    for step in path[:-1]:
        steps[step]()
    before = (book.run.dir / "run.json").read_text()
    with pytest.raises(TransitionError):
        steps[path[-1]]()
    assert (book.run.dir / "run.json").read_text() == before


def test_the_table_has_every_state_and_ended_states_lead_nowhere():
    assert set(TRANSITIONS) == set(RunState)
    for st in (RunState.FINISHED, RunState.FAILED, RunState.STOPPED):
        assert not TRANSITIONS[st]
    # every live state can fail or be stopped
    for st, to in TRANSITIONS.items():
        if not st.terminal:
            assert {RunState.FAILED, RunState.STOPPED} <= to, st


def test_pending_stops_name_the_attempt_they_are_for_and_the_names_stay_readable():
    book = new_book()
    book.stops([PendingStop("n2", "r-1", 5.0, 1.0), PendingStop("n4", "r-1.a2", 5.0, 2.0)])
    doc = json.loads((book.run.dir / "run.json").read_text())
    assert doc["stop_pending"] == ["n2", "n4"]
    assert [(p["node"], p["key"]) for p in doc["pending_stops"]] == [("n2", "r-1"), ("n4", "r-1.a2")]
    assert book.run.record.pending_stops[1] == PendingStop("n4", "r-1.a2", 5.0, 2.0)


def test_an_older_record_reads_with_defaults_and_unknown_keys_are_ignored(home):
    run = Run.create("r-2", RunSpec())
    (run.dir / "run.json").write_text(json.dumps({"id": "r-2", "state": "running", "retired": 1,
                                                  "attempts": [{"attempt": 1, "key": "r-2", "nodes": ["a"],
                                                                "old_field": 3}],
                                                  "nodes": [{"name": "a", "state": "running"}]}))
    rec = run.record
    assert rec.state is RunState.RUNNING and rec.current.nodes == ["a"] and rec.pending_stops == []
    assert RunRecord.from_json(None, "x").state is RunState.UNKNOWN


def test_a_record_that_is_not_a_json_object_reads_as_unknown(home):
    run = Run.create("r-3", RunSpec())
    (run.dir / "run.json").write_text("[1, 2]")
    assert run.record.state is RunState.UNKNOWN and run.record.id == "r-3"


def test_the_key_is_the_current_attempts_after_a_restart():
    """What `status` asks the nodes under once the supervisor is gone (cli/status.py ask_nodes):
    attempt 2's processes are known there as RUN.a2@NODE, attempt 1's have ended."""
    book = new_book()
    assert book.run.record.key == "r-1"  # before any attempt: the run id
    book.connecting()
    book.attempt_started(AttemptRecord(1, "r-1", ["a", "b"]), [NodeStatus("a", 0, "h"), NodeStatus("b", 1, "h")])
    assert book.run.record.key == "r-1"
    book.recovering("attempt 1: node lost")
    book.attempt_started(AttemptRecord(2, "r-1.a2", ["a", "c"]), [NodeStatus("a", 0, "h"), NodeStatus("c", 1, "h")])
    assert book.run.record.key == "r-1.a2"
    older = RunRecord.from_json({"id": "r-9", "attempts": [{"attempt": 1, "nodes": ["a"]}]})
    assert older.key == "r-9"  # a record written before attempts had keys


def test_the_first_failure_reads_back_typed_and_prints_as_written():
    book = new_book()
    book.connecting()
    book.attempt_started(AttemptRecord(1, "r-1", ["a"]), [NodeStatus("a", 0, "h")])
    ff = FirstFailure("a", 1, "the training script failed", at=5.0, ended=4.5)
    book.ended(RunResult(RunState.FAILED, 1, "a failed first", ff))
    rec = book.run.record
    assert rec.first_failure == ff
    assert json.loads((book.run.dir / "run.json").read_text())["first_failure"] == ff.to_json() == rec.to_json()["first_failure"]
    assert FirstFailure.from_json(None) is None and FirstFailure.from_json({"reason": "no node"}) is None
