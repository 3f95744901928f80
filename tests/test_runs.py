"""Pure parts of train/tail/status: run records, ids, exit meanings, offset tailing, rank labels."""

import io
import json
from pathlib import Path

import pytest

from orchestrator.errors import UsageError
from orchestrator.runs.logs.follow import Follower, NodeLog, last_lines_offset
from orchestrator.cli.output import Prefixer
from orchestrator.runs.policy import root_cause
from orchestrator.runs.spec import FirstFailure, NodeStatus, RunResult, RunSpec, RunState
from orchestrator.home import runs_dir
from orchestrator.runs.store import Run, exit_meaning, new_run_id, read_json, write_json
from tests.conftest import write_record


pytestmark = pytest.mark.usefixtures("home")  # every test gets its own CLUSTERCTL_HOME


def test_run_ids_carry_the_name_and_refuse_path_characters():
    rid = new_run_id("gpt2-small")
    assert rid.startswith("gpt2-small-") and len(rid.split("-")) == 5
    assert new_run_id(None).startswith("run-")
    assert new_run_id("x") != new_run_id("x")
    for bad in ("a/b", "../x", ".hidden", "a b", "a;rm"):
        with pytest.raises(UsageError):
            new_run_id(bad)


def test_create_find_update_and_latest(home):
    a = Run.create("alpha-1", RunSpec(args=("x.py",)))
    b = Run.create("beta-1", RunSpec(args=()))
    assert (a.dir / "nodes").is_dir() and a.spec == RunSpec(args=("x.py",))
    assert a.record.state is RunState.STARTING
    assert not list(runs_dir().glob(".*"))  # the hidden build directory was renamed away
    assert Run.find(None).id == "beta-1"  # latest
    assert Run.find("alph").id == "alpha-1"  # unique prefix
    write_record(a, state="running", nodes=[{"name": "n1"}])
    assert a.record.state is RunState.RUNNING and [nd.name for nd in a.record.nodes] == ["n1"]
    assert [r.id for r in Run.all()] == ["alpha-1", "beta-1"]
    with pytest.raises(UsageError, match="no run 'zzz'"):
        Run.find("zzz")


def test_ambiguous_prefix_and_no_runs(home):
    with pytest.raises(UsageError, match="no runs recorded"):
        Run.find(None)
    Run.create("job-1", RunSpec())
    Run.create("job-2", RunSpec())
    with pytest.raises(UsageError, match="ambiguous"):
        Run.find("job")


def test_half_made_run_dirs_are_ignored(home):
    Run.create("ok-1", RunSpec())
    (runs_dir() / ".ok-2.tmp").mkdir()
    write_json(runs_dir() / ".ok-2.tmp" / "run.json", {"id": "ok-2"})
    (runs_dir() / "empty").mkdir()  # no run.json yet
    assert [r.id for r in Run.all()] == ["ok-1"]


def test_records_are_written_atomically(tmp_path):
    p = tmp_path / "r.json"
    write_json(p, {"a": 1})
    write_json(p, {"a": 2})
    assert read_json(p) == {"a": 2}
    assert [x.name for x in tmp_path.iterdir()] == ["r.json"]
    p.write_text("{torn")
    assert read_json(p) is None


def test_a_dead_or_foreign_supervisor_pid_is_not_alive(home):
    import os

    r = Run.create("s-1", RunSpec())
    assert not r.supervisor_alive()
    write_record(r, supervisor_pid=os.getpid())  # a live pid without CLUSTERCTL_SUPERVISOR=s-1: not ours
    assert not r.supervisor_alive()


@pytest.mark.parametrize("code,words", [
    (0, "success"), (137, "SIGKILL"), (143, "SIGTERM"), (139, "SIGSEGV"), (127, "could not start"),
    (1, "script failed"), (None, "node lost"),
])
def test_exit_meaning(code, words):
    assert words in exit_meaning(code)


def test_last_lines_offset(tmp_path):
    p = tmp_path / "log"
    p.write_bytes(b"a\nb\nc\nd\n")
    assert last_lines_offset(p, 2) == 4
    assert last_lines_offset(p, 0) == 8
    assert last_lines_offset(p, 10) == 0
    p.write_bytes(b"a\nb\npartial")
    assert p.read_bytes()[last_lines_offset(p, 1):] == b"partial"
    big = b"".join(b"line %06d\n" % i for i in range(100_000))
    p.write_bytes(big)
    assert p.read_bytes()[last_lines_offset(p, 3):] == b"line 099997\nline 099998\nline 099999\n"
    assert last_lines_offset(tmp_path / "missing", 5) == 0


def test_node_log_yields_whole_lines_across_partial_writes(tmp_path):
    p = tmp_path / "n.log"
    lg = NodeLog("node2", p, first_rank=4)
    assert lg.read_lines() == []  # not there yet
    with open(p, "ab") as f:
        f.write(b"[default0]:hello\n[default1]:par")
        f.flush()
        assert lg.read_lines() == ["[default0]:hello"]
        f.write("tial ünï\nno newline at exit".encode()[:-1])  # a character cut in two by a write
        f.flush()
        assert lg.read_lines() == ["[default1]:partial ünï"]
        f.write(b"t")
        f.flush()
        assert lg.read_lines(final=True) == ["no newline at exit"]
    assert lg.offset == p.stat().st_size


def test_rank_labels_are_global():
    lg = NodeLog("node3", None, first_rank=8)
    assert lg.label("[default1]:loss 3.2") == ("node3/r9", 9, "loss 3.2")
    assert lg.label("[trainer0]:x") == ("node3/r8", 8, "x")
    assert lg.label("[default1]:again") == ("node3/r9", 9, "again")  # the tag's label, kept
    assert lg.label("W1122 torchrun warning") == ("node3", None, "W1122 torchrun warning")
    assert lg.label("[W1122 c10d] warning") == ("node3", None, "[W1122 c10d] warning")
    assert lg.label("[not a tag 1]: x") == ("node3", None, "[not a tag 1]: x")
    assert lg.label("[0]:") == ("node3", None, "[0]:")  # torchrun's ChildFailedError report, not rank 0
    assert NodeLog("n", None, None).label("[default0]:x") == ("n", None, "[default0]:x")


def test_follower_prints_prefixed_lines_filtered_by_node_and_rank(tmp_path):
    (tmp_path / "a.log").write_bytes(b"[default0]:a0\n[default1]:a1\ntorchrun says\n")
    (tmp_path / "b.log").write_bytes(b"[default0]:b0\n[default1]:b1\n")

    def run(**kw):
        out = io.StringIO()
        logs = [NodeLog("node1", tmp_path / "a.log", 0), NodeLog("node2", tmp_path / "b.log", 2)]
        Follower(logs, Prefixer(["node1/r1", "node2/r3"], out=out, color=False), **kw).poll(final=True)
        return out.getvalue().splitlines()

    assert run() == ["node1/r0 | a0", "node1/r1 | a1", "node1    | torchrun says", "node2/r2 | b0",
                     "node2/r3 | b1"]
    assert run(node="node2") == ["node2/r2 | b0", "node2/r3 | b1"]
    assert run(rank=1) == ["node1/r1 | a1"]


def test_color_only_on_request():
    out = io.StringIO()
    Prefixer(["node1/r0"], out=out, color=True)("node1/r0", "stdout", "x", "node1")
    assert out.getvalue().startswith("\x1b[")
    out = io.StringIO()
    Prefixer(["node1/r0"], out=out)("node1/r0", "stdout", "x", "node1")  # StringIO is no terminal
    assert out.getvalue() == "node1/r0 | x\n"


def test_root_cause_prefers_the_error_file_then_the_log_tail():
    st = NodeStatus("node2", 1, "h2", first_rank=2, last_rank=3, error_file=json.dumps(
        {"message": {"message": "RuntimeError: boom", "extraInfo": {"py_callstack": "Traceback ...\nboom"}}}))
    ff = FirstFailure("node2", 1, exit_meaning(1))
    s = root_cause(ff, st, b"")
    assert s.startswith("node2 (ranks 2-3) failed first: exit code 1") and s.endswith("Traceback ...\nboom")
    st.error_file = None
    log = b"".join(b"line %d\n" % i for i in range(100)) + b"Killed\n"
    s = root_cause(FirstFailure("node2", 137, exit_meaning(137)), st, log)
    assert "exit code 137" in s and s.endswith("line 99\nKilled") and "line 84" not in s


FIXTURE = Path(__file__).parent / "fixtures" / "torchrun_child_failed.log"


def test_torchrun_root_cause_block_names_the_failing_worker():
    """A real node log: rank 5 (local 1) exits 3, torchrun SIGTERMs local rank 0 and exits 1."""
    from orchestrator.runs.logs.follow import rank_tail, worker_failure

    log = FIXTURE.read_bytes()
    assert worker_failure(log) == {"rank": 5, "local_rank": 1, "exitcode": 3}
    assert rank_tail(log, 1, 2) == ["rank 5 step 0 sum 36", "rank 5 failing on purpose"]
    assert worker_failure(b"no torchrun summary here\n") is None


def test_root_cause_names_the_worker_and_quotes_its_own_lines():
    st = NodeStatus("node3", 2, "h3", first_rank=4, last_rank=5)
    s = root_cause(FirstFailure("node3", 1, exit_meaning(1)), st, FIXTURE.read_bytes())
    assert s.splitlines()[0] == ("node3 (ranks 4-5) failed first: exit code 1 — the training script failed; "
                                 "rank 5 exited 3 first (the training script failed)")
    assert s.splitlines()[-1] == "rank 5 failing on purpose"


def test_root_cause_explains_a_rank_that_aborted_in_teardown():
    """torch 2.13 aborts a rank at exit when a gloo group is still held then (seen across hosts)."""
    log = FIXTURE.read_bytes().replace(b"[default1]:rank 5 failing on purpose",
                                       b"[default1]:terminate called without an active exception")
    log = log.replace(b"  exitcode  : 3 (pid: 5169) ", b"  exitcode  : -6 (pid: 5169)  (SIGABRT)")
    st, ff = NodeStatus("node3", 2, "h3", first_rank=4, last_rank=5), FirstFailure("node3", 1, exit_meaning(1))
    lines = root_cause(ff, st, log).splitlines()
    assert lines[0].endswith("rank 5 exited 134 first (killed by SIGABRT)")
    assert lines[1].startswith("hint: a rank aborted (SIGABRT) in C++ teardown") and "destroy_process_group" in lines[1]
    assert lines[-1] == "terminate called without an active exception"
    # the same exit code without the marker is not explained away
    assert "hint:" not in root_cause(ff, st, log.replace(b"terminate called", b"free(): invalid pointer;"))


def test_runs_table_never_cuts_a_run_id_short(home, monkeypatch, capsys):
    from orchestrator.cli import main

    ids = [new_run_id("a-long-experiment-name") for _ in range(2)]
    for rid in ids:
        Run.create(rid, RunSpec())
    monkeypatch.setenv("COLUMNS", "60")  # a narrow terminal: the other columns give way
    assert main(["runs"]) == 0
    out = capsys.readouterr().out
    for rid in ids:
        assert rid in out


def test_the_json_of_runs_status_and_tail_is_the_record_as_written(home, capsys):
    """What --json prints of a record is run.json as Book wrote it (status adds its own keys), and
    the end document's first failure is the record's, as JSON: one serialiser, RunRecord.to_json."""
    import jsonschema

    from orchestrator.cli import main
    from orchestrator.runs.record import Book
    from orchestrator.runs.runrecord import AttemptRecord

    schemas = Path(__file__).resolve().parent.parent / "orchestrator" / "schemas"
    book = Book(Run.create("r-json", RunSpec()))
    book.connecting()
    book.attempt_started(AttemptRecord(1, "r-json", ["a", "b"]), [NodeStatus("a", 0, "h"), NodeStatus("b", 1, "h")])
    book.recovering("attempt 1: node lost")
    book.attempt_started(AttemptRecord(2, "r-json.a2", ["a", "c"]), [NodeStatus("a", 0, "h", first_rank=0, last_rank=0),
                                                                    NodeStatus("c", 1, "h", first_rank=1, last_rank=1)])
    ff = FirstFailure("c", 1, "the training script failed", at=5.0)
    book.ended(RunResult(RunState.FAILED, 1, "c failed first", ff))
    written = json.loads((book.run.dir / "run.json").read_text())
    assert main(["runs", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == [written]
    jsonschema.validate(doc, json.loads((schemas / "runs.json").read_text()))
    assert main(["status", "r-json", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in doc.items() if k not in ("supervisor_alive", "nodes_now", "ranks_now", "goodput")} == written
    jsonschema.validate(doc, json.loads((schemas / "status.json").read_text()))
    assert main(["tail", "r-json", "--no-follow", "--json"]) == 1  # the run's exit code
    end = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert end["first_failure"] == written["first_failure"] == ff.to_json() and end["state"] == "failed"
    assert [n["name"] for n in end["nodes"]] == ["a", "c"]
    jsonschema.validate(end, json.loads((schemas / "tail.json").read_text()))
