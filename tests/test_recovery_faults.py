"""The pieces of a recovery that survives its own faults, without a cluster: which nodes an
adopting supervisor prepares again (runs/readying.py), how a relaunch asks a survivor's preflight
failure again (checks/retry.py ask_survivors), a full disk said once and its spell kept
(runs/space.py, runs/record.py), and what `status` shows of attempts that never launched."""

import errno
import json

import pytest

from orchestrator.checks import CheckResult
from orchestrator.checks.report import NodeReport, PreflightReport
from orchestrator.checks.retry import RELAUNCH_BUDGET_S, ask_survivors
from orchestrator.cli import tables
from orchestrator.inventory import parse_inventory
from orchestrator.runs import record
from orchestrator.runs.readying import fresh_nodes
from orchestrator.runs.record import Book
from orchestrator.runs.runrecord import AttemptRecord, RunRecord
from orchestrator.runs.space import RESERVE, RESERVE_BYTES, Space, end_writes
from orchestrator.runs.spec import NodeState, RunResult, RunSpec, RunState
from orchestrator.runs.store import Run

INV = parse_inventory("nodes:\n" + "".join(f"  - {{name: n{i}, host: 10.0.0.{i}, gpus: 0{', spare: true' if i == 4 else ''}}}\n"
                                           for i in range(1, 5)))


def report(failing: set[str]) -> PreflightReport:
    nodes = [NodeReport(n, {"port_reachable": CheckResult("port_reachable", "fail" if n.name in failing else "ok",
                                                          "timed out: a firewall drops it")}) for n in INV.nodes]
    return PreflightReport(INV, ["port_reachable"], nodes, {})


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def wait(self, seconds):
        self.t += seconds
        return False


def test_a_survivors_failure_is_asked_again_with_backoff_until_it_passes():
    clock, answers = Clock(), [report({"n1"}), report(set())]
    asked = ask_survivors(report({"n1"}), lambda: answers.pop(0), {"n1", "n2", "n3"}, clock.wait, clock)
    assert asked.report.ok and asked.rounds == 3 and asked.seconds == 3.0  # waited 1 s, then 2 s
    assert asked.retried == "asked 3 times over 3s" and asked.first == ("n1 port_reachable: timed out: a firewall drops it",)


def test_a_new_nodes_failure_is_not_asked_again_and_a_survivors_ends_within_the_budget():
    clock = Clock()
    asked = ask_survivors(report({"n4"}), lambda: pytest.fail("asked again"), {"n1", "n2", "n3"}, clock.wait, clock)
    assert asked.rounds == 1 and asked.retried == ""
    clock = Clock()
    asked = ask_survivors(report({"n1"}), lambda: report({"n1"}), {"n1"}, clock.wait, clock)
    assert not asked.report.ok and asked.seconds <= RELAUNCH_BUDGET_S and asked.rounds > 3


def test_a_stop_cuts_the_asking_short():
    asked = ask_survivors(report({"n1"}), lambda: pytest.fail("asked again"), {"n1"}, lambda s: True, Clock())
    assert asked.rounds == 1 and not asked.report.ok


def test_a_spare_whose_preparation_did_not_finish_is_prepared_again():
    one = AttemptRecord(attempt=1, key="r", nodes=["n1", "n2", "n3"])
    died = AttemptRecord(attempt=2, key="r.a2", nodes=["n1", "n4", "n3"], prepared=["n4"], ready=[])
    assert fresh_nodes(3, ["n1", "n4", "n3"], [one, died], INV) == ["n4"]
    done = AttemptRecord(attempt=2, key="r.a2", nodes=["n1", "n4", "n3"], prepared=["n4"], ready=["n4"])
    assert fresh_nodes(3, ["n1", "n4", "n3"], [one, done], INV) == []
    older = AttemptRecord(attempt=2, key="r.a2", nodes=["n1", "n4", "n3"], prepared=["n4"])  # no `ready`
    assert fresh_nodes(3, ["n1", "n4", "n3"], [one, older], INV) == []


def test_a_full_disk_is_said_once_and_its_spell_kept_in_the_record(home):
    run = Run.create("r-1", RunSpec())
    space = Space(run.dir, check_s=3600)
    book = Book(run, space)
    full = OSError(errno.ENOSPC, "No space left on device")
    assert not space.full(OSError(errno.EIO, "I/O error"), "the log copies")
    assert space.full(full, "the log copies") and space.full(full, "the run record") and space.is_full
    book.tell("held in memory")
    space.ended()
    assert not space.is_full and len(book.rec.disk_full) == 1
    assert book.rec.disk_full[0]["what"] == ["the log copies", "the run record"]
    text = (run.dir / "story.jsonl").read_text()
    assert text.count('"event": "disk_full"') == 1 and "held in memory" in text and '"event": "disk_room"' in text
    assert text.index("no room") < text.index("held in memory") < text.index("room again")
    space.close()


def test_a_run_ending_on_a_full_disk_spends_its_reserve_on_the_final_record_at_once(home, monkeypatch):
    run = Run.create("r-2", RunSpec())
    space = Space(run.dir, check_s=3600)
    book = Book(run, space)
    assert space.keep_reserve() and (run.dir / RESERVE).stat().st_size == RESERVE_BYTES
    first = (run.dir / RESERVE).read_bytes()
    assert space.keep_reserve() and (run.dir / RESERVE).read_bytes() == first  # a taking-over supervisor keeps it
    book.connecting()
    full = OSError(errno.ENOSPC, "No space left on device")

    def no_room(*a, **k):
        raise full

    with monkeypatch.context() as m:
        m.setattr(record, "write_json", no_room)
        book.ended(RunResult(RunState.FAILED, 1, "n2 lost"))  # in memory only: the disk is full
    assert space.is_full and json.loads((run.dir / "run.json").read_text())["state"] == "connecting"
    assert space.spend_reserve() and not (run.dir / RESERVE).exists()
    rec = json.loads((run.dir / "run.json").read_text())
    assert rec["state"] == "failed" and rec["disk_full"][0]["reserve"] is True, rec
    assert '"reserve": true' in (run.dir / "story.jsonl").read_text()
    assert not space.spend_reserve()  # spent once
    space.drop_reserve()
    space.close()


def test_with_no_reserve_or_one_too_small_for_the_record_the_end_waits_for_room(home, monkeypatch):
    run = Run.create("r-3", RunSpec())
    space = Space(run.dir, check_s=3600)
    book = Book(run, space)
    said = []

    def no_room(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    assert space.keep_reserve()
    monkeypatch.setattr(record, "write_json", no_room)  # not even the reserve's room is enough
    book.connecting()
    assert space.is_full and book.unsaved
    end_writes(space, lambda: book.unsaved, said.append, patience=0)
    assert not (run.dir / RESERVE).exists() and space.is_full and book.unsaved  # spent, in vain
    assert said == ["waiting up to 0s for room on this machine's disk to write the run's record"]
    said.clear()
    end_writes(space, lambda: book.unsaved, said.append, patience=0)  # no reserve at all
    assert len(said) == 1
    monkeypatch.undo()
    space.ended()
    said.clear()
    end_writes(space, lambda: book.unsaved, said.append, patience=0)  # room: nothing to wait for
    assert said == []
    space.close()


def test_status_counts_attempts_that_never_launched_and_shows_unstarted_nodes_of_an_ended_run():
    rec = RunRecord.from_json({"state": "finished", "attempts": [{"launched": 1.0}, {}, {"launched": 2.0}]})
    assert tables.at_most(rec, 1) == 3
    assert tables.at_most(RunRecord.from_json({"attempts": [{"launched": 1.0}, {}]}), 0) == 1  # the current one is not counted
    assert tables.shown_state(NodeState.PENDING, RunRecord("r", RunState.FAILED)) == "not started"
    assert tables.shown_state(NodeState.PENDING, RunRecord("r", RunState.PREFLIGHT)) == "pending"


def test_a_progress_file_that_finds_no_room_leaves_no_temporary_file(tmp_path, monkeypatch):
    from orchestrator.runs import progresslog

    def no_room(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(progresslog.os, "replace", no_room)
    progresslog.ProgressLog(tmp_path, "r-1").write("n1")
    # the step journal (runs/stepjournal.py) appends beside it, in place: only a temporary file is a leftover
    assert not [p for p in (tmp_path / progresslog.DIR).iterdir() if p.name.endswith(".tmp")], \
        list((tmp_path / progresslog.DIR).iterdir())
