"""One error said once (runs/logs/screen.py, runs/logs/follow.py Follower, the end of `tail`/`train`), from
torchrun's output recorded on the test cluster: tests/fixtures/torchrun_crash/ (a RuntimeError at
step 0 on 3 nodes of 1 rank) and torchrun_crash_nproc2/ (the same on 2 nodes of 2 ranks), the node
logs byte for byte as clusterctl copied them (tests/scripts/crash_step0.py)."""

import io
import re
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.cli.output import Prefixer
from orchestrator.runs.logs.follow import Follower, NodeLog
from orchestrator.runs.policy import root_cause
from orchestrator.runs.logs.fold import LineFold
from orchestrator.runs.logs.screen import Screen
from orchestrator.runs.spec import FirstFailure, NodeStatus, RunSpec
from orchestrator.runs.store import Run
from tests.conftest import write_record

FIXTURES = Path(__file__).parent / "fixtures"
CRASH3 = FIXTURES / "torchrun_crash"  # node1..3, one rank each
CRASH2X2 = FIXTURES / "torchrun_crash_nproc2"  # node1..2, two ranks each
ERROR = "RuntimeError: shapes do not match at step 0: (4, 8) vs (8, 4)"


def shown(logs: list[NodeLog], quiet=(), **kw) -> list[str]:
    out = io.StringIO()
    f = Follower(logs, Prefixer(["node1/r0"], out=out, color=False), **kw)
    f.quiet = set(quiet)
    f.poll(final=True)
    f.close()
    return [re.sub(r" +\|", " |", line) for line in out.getvalue().splitlines()]


def crash3(quiet=()) -> list[str]:
    return shown([NodeLog(f"node{i + 1}", CRASH3 / f"node{i + 1}.log", i) for i in range(3)], quiet)


@pytest.mark.parametrize("quiet", [(), ("node2", "node3")])  # before and after clusterctl stops the others
def test_a_crash_on_three_nodes_shows_its_traceback_once_and_hides_torchruns_echo(quiet):
    out = crash3(quiet)
    text = "\n".join(out)
    assert text.count("Traceback (most recent call last)") == 1 and text.count(ERROR) == 1, text
    assert f"node1/r0 | {ERROR}" in out  # torch's `[rank0]: ` is the label's
    assert out.count("node2/r1 | [clusterctl: the same traceback as node1/r0 above]") == 1, text
    assert out.count("node3/r2 | [clusterctl: the same traceback as node1/r0 above]") == 1, text
    assert "[rank" not in text and "Root Cause" not in text and "=====" not in text and "socket.cpp" not in text
    notes = [line for line in out if "is not shown" in line]
    assert len(notes) == 2 and "c10d's warning" in notes[0] and "ChildFailedError report" in notes[1], notes
    assert f"{CRASH3} keeps" in notes[0]  # where they are
    assert len(out) == 13, text  # against 43 lines in each node's log


def test_two_ranks_of_a_node_fold_under_their_range_and_the_next_node_refers_to_them():
    out = shown([NodeLog(f"node{i + 1}", CRASH2X2 / f"node{i + 1}.log", 2 * i) for i in range(2)])
    text = "\n".join(out)
    assert text.count("Traceback (most recent call last)") == 1, text
    assert f"node1/r[0-1] | {ERROR}" in out
    assert "node2/r[2-3] | [clusterctl: the same traceback as node1/r[0-1] above]" in out
    assert "OMP_NUM_THREADS=1 for each process is not shown" in text and "*****" not in text
    assert not [line for line in out if line.endswith("| ")]  # torchrun's blank lines and its `[0]:` are not a rank's


def test_no_fold_and_json_keep_every_line():
    logs = [NodeLog(f"node{i + 1}", CRASH3 / f"node{i + 1}.log", i) for i in range(3)]
    assert len(shown(logs, fold=False)) == 3 * 43
    got = []
    f = Follower([NodeLog(f"node{i + 1}", CRASH3 / f"node{i + 1}.log", i) for i in range(3)], None,
                 sink=lambda label, stream, text, key: got.append(text))
    f.poll(final=True)
    assert len(got) == 3 * 43 and sum("[rank0]: Traceback" in t for t in got) == 1


# ---------------------------------------------------------------- the screen, line by line
TRACE = ["Traceback (most recent call last):", '  File "train.py", line 8, in <module>', "    step()",
         "ValueError: bad batch"]


class Printed:
    def __init__(self):
        self.lines = []

    def __call__(self, lines):
        self.lines.extend(f"{label} | {text}" for label, text, _ in lines)


def feed(screen: Screen, rows, now=0.0):
    for node, rank, text in rows:
        screen.line(node, rank, f"{node}/r{rank}" if rank is not None else node, text, now)


def test_tracebacks_of_many_ranks_arriving_together_print_once_under_their_range():
    s, got = Screen(), Printed()
    rows = [(f"n{r // 2 + 1}", r, f"[rank{r}]: {t}") for t in TRACE for r in range(6)]  # interleaved, as they land
    feed(s, rows)
    s.flush(0.5, got, all=True)
    assert got.lines == [f"n[1-3]/r[0-5] | {t}" for t in TRACE]


def test_a_traceback_that_differs_prints_whole_and_a_chained_one_keeps_its_order():
    s, got = Screen(), Printed()
    feed(s, [("n1", 0, t) for t in TRACE])
    other = TRACE[:-1] + ["ValueError: bad batch on rank 1"]
    feed(s, [("n1", 1, t) for t in other])
    chained = TRACE + ["", "During handling of the above exception, another exception occurred:", ""] + \
        TRACE[:-1] + ["KeyError: 'x'"]
    feed(s, [("n2", 2, t) for t in chained])
    s.flush(0.5, got, all=True)
    assert got.lines[:4] == [f"n[1-2]/r[0,2] | {t}" for t in TRACE]  # the first of n2's chain is n1's
    assert got.lines[4:8] == [f"n1/r1 | {t}" for t in other]
    assert got.lines[8:] == [f"n2/r2 | {t}" for t in chained[len(TRACE) + 1:]]  # the blank it ended with: not


def test_torchruns_own_traceback_shows_unless_it_is_its_child_failed_echo():
    s, got = Screen(), Printed()
    rdzv = ["Traceback (most recent call last):", '  File "run.py", line 9, in <module>',
            "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: "]
    feed(s, [("n1", None, t) for t in rdzv])
    s.flush(0.5, got, all=True)
    assert got.lines == [f"n1 | {t}" for t in rdzv]


def test_a_stopped_ranks_traceback_that_was_shown_folds_with_it_and_another_is_counted():
    s, got = Screen("RUN/nodes"), Printed()
    feed(s, [("n1", 0, t) for t in TRACE])
    s.quiet = {"n2"}
    feed(s, [("n2", 1, t) for t in TRACE])  # the same error: one with the first
    feed(s, [("n2", 1, t) for t in TRACE[:-1] + ["RuntimeError: Connection closed by peer"]])
    feed(s, [("n2", 1, "saved checkpoint")])
    s.flush(0.5, got, all=True)
    assert got.lines == [f"n[1-2]/r[0-1] | {t}" for t in TRACE] + [
        "n2/r1 | [clusterctl: 4 lines of a stopped rank's traceback folded; RUN/nodes has them]",
        "n2/r1 | saved checkpoint"]


# ---------------------------------------------------------------- the fold of identical lines
def test_distinct_lines_pass_as_one_batch_and_a_twin_in_a_later_poll_still_folds():
    fold, got = LineFold(window=1.0), Printed()
    fold.lines("n1", ["n1/r0"] * 3, ["a", "b", "c"], [0, 0, 0], now=0.0)
    fold.lines("n2", ["n2/r1"] * 2, ["b", "x"], [1, 1], now=0.4)  # b's twin, within the window: folds
    fold.flush(1.2, got)
    assert got.lines == ["n1/r0 | a", "n[1-2]/r[0-1] | b", "n1/r0 | c"]  # x waits for its own window
    fold.lines("n3", ["n3/r2"], ["c"], [2], now=1.3)  # n1's c was printed: a line of its own
    fold.lines("n4", ["n4/r3"] * 2, ["y", "z"], [3, 3], now=1.3)
    fold.lines("n5", ["n5/r4"], ["z"], [4], now=2.5)  # past the window of n4's z: not folded
    fold.flush(9.0, got, all=True)
    assert got.lines[3:] == ["n2/r1 | x", "n3/r2 | c", "n4/r3 | y", "n4/r3 | z", "n5/r4 | z"]


def test_a_rank_whose_later_line_is_held_does_not_join_an_earlier_twin():
    fold, got = LineFold(window=1.0), Printed()
    fold.lines("n1", ["n1/r0", "n1/r1"], ["A", "r1 first"], [0, 1], now=0.0)
    fold.lines("n1", ["n1/r1"], ["A"], [1], now=0.1)  # r1's "r1 first" is held after r0's A
    fold.flush(9.0, got, all=True)
    assert got.lines == ["n1/r0 | A", "n1/r1 | r1 first", "n1/r1 | A"]


def test_identical_lines_from_every_rank_print_once_the_last_rank_said_them_not_after_the_window():
    fold, got = LineFold(window=1.0), Printed()
    fold.expect(["n1/r0", "n1/r1", "n2/r2"], ["n1", "n2"])
    fold.lines("n1", ["n1/r0", "n1/r1"], ["step 5 loss 2.1", "step 5 loss 2.1"], [0, 1], now=0.0)
    fold.flush(0.1, got)
    assert got.lines == []  # n2/r2 may still say it
    fold.lines("n2", ["n2/r2"], ["step 5 loss 2.1"], [2], now=0.2)
    fold.flush(0.2, got)
    assert got.lines == ["n[1-2]/r[0-2] | step 5 loss 2.1"]


def test_a_held_line_goes_once_every_other_rank_has_a_line_after_it():
    fold, got = LineFold(window=1.0), Printed()
    fold.expect(["n1/r0", "n2/r1"], ["n1", "n2"])
    fold.lines("n1", ["n1/r0"], ["rank 0 at 5"], [0], now=0.0)
    fold.lines("n2", ["n2/r1"], ["rank 1 at 5"], [1], now=0.1)
    fold.flush(0.1, got)
    assert got.lines == ["n1/r0 | rank 0 at 5"]  # r1 is past it; r1's own line: r0 may still say it
    fold.lines("n1", ["n1/r0"], ["rank 0 at 6"], [0], now=0.2)
    fold.flush(0.2, got)
    assert got.lines == ["n1/r0 | rank 0 at 5", "n2/r1 | rank 1 at 5"]
    fold.add("n2", None, "n2", "torchrun says", 0.3)  # torchrun's own lines wait for the other nodes'
    fold.flush(0.4, got)
    assert got.lines[-1] == "n2/r1 | rank 1 at 5"
    fold.flush(1.3, got)
    assert got.lines[-2:] == ["n1/r0 | rank 0 at 6", "n2 | torchrun says"]


def interleaved(seed: int, nranks: int = 6, length: int = 60) -> tuple[list, float]:
    """Polls of `nranks` ranks (two a node) each printing the same script at its own pace: most of
    its lines the same for every rank, the others the rank's own; (polls, the last poll's time)."""
    import random

    rnd = random.Random(seed)
    script = [f"s{i}" if rnd.random() < 0.6 else None for i in range(length)]
    pos, polls, now = [0] * nranks, [], 0.0
    while min(pos) < length:
        now += rnd.choice([0.0, 0.02, 0.1, 0.3, 0.8])
        node = rnd.randrange(nranks // 2)
        rows = []
        for r in [2 * node + rnd.randrange(2) for _ in range(rnd.randrange(1, 5))]:
            if pos[r] < length:
                rows.append((r, script[pos[r]] or f"r{r} own {pos[r]}"))
                pos[r] += 1
        polls.append((now, f"n{node + 1}", rows))
    return polls, now


def test_what_folds_is_the_same_whether_a_line_goes_at_its_window_or_as_soon_as_nobody_can_join_it():
    """The lines printed, their labels and their order are those of the window alone, only
    sooner. (A release one line too soon, for a batch of distinct lines or for one line, changes
    what folds in tens of these 150 interleavings.)"""
    ranks = [f"n{r // 2 + 1}/r{r}" for r in range(6)]
    sooner = 0  # polls after which the early fold had printed more
    for seed in range(150):
        polls, end = interleaved(seed)
        outs, counts = [], []
        for early in (False, True):
            fold, got, count = LineFold(window=1.0), Printed(), []
            if early:
                fold.expect(ranks, ["n1", "n2", "n3"])
            for at, node, rows in polls:
                fold.lines(node, [f"{node}/r{r}" for r, _ in rows], [t for _, t in rows], [r for r, _ in rows], now=at)
                fold.flush(at, got)
                count.append(len(got.lines))
            fold.flush(end + 9, got, all=True)
            outs.append(got.lines)
            counts.append(count)
        assert outs[0] == outs[1], seed
        sooner += sum(e > w for w, e in zip(*counts))
    assert sooner > len(polls)


# ---------------------------------------------------------------- the end of the run
def crash_run(tmp_path, monkeypatch) -> Run:
    """A finished run made of the recorded node logs, its summary as runs/policy.py writes it."""
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "home"))
    run = Run.create("crash-20261128-191332-db9c", RunSpec())
    nodes = [{"name": f"node{i + 1}", "rank": i, "host": "h", "state": "failed", "exit_code": 1, "pid": 10 + i,
              "first_rank": i, "last_rank": i} for i in range(3)]
    for i in range(3):
        run.node_log(f"node{i + 1}").write_bytes((CRASH3 / f"node{i + 1}.log").read_bytes())
    log = (CRASH3 / "node1.log").read_bytes()
    summary = root_cause(FirstFailure("node1", 1, "the training script failed", 0.0, None), NodeStatus("node1", 0, "h", first_rank=0),
                         log)
    write_record(run, state="failed", exit_code=1, nodes=nodes, rank_map="world size 3", summary=summary,
               first_failure={"node": "node1", "exit_code": 1})
    return run


def test_the_summary_names_the_traceback_just_shown_instead_of_repeating_it(tmp_path, monkeypatch, capsys):
    run = crash_run(tmp_path, monkeypatch)
    assert ERROR in run.record.summary  # what runs/policy.py quotes
    assert main(["tail", run.id, "--no-follow"]) == 1
    cap = capsys.readouterr()
    assert (cap.out + cap.err).count(ERROR) == 1, cap.out + cap.err
    assert f"clusterctl: run {run.id} failed (exit code 1): node1 (rank 0) failed first: exit code 1" in cap.err
    assert f"(rank 0's last lines and traceback are above; all of them: {run.dir / 'ranks' / 'rank0.log'})" in cap.err


def test_a_tail_that_did_not_show_the_ranks_lines_quotes_them(tmp_path, monkeypatch, capsys):
    run = crash_run(tmp_path, monkeypatch)
    assert main(["tail", run.id, "--no-follow", "-n", "3"]) == 1  # the traceback is not among the last 3
    cap = capsys.readouterr()
    assert ERROR in cap.err and "are above" not in cap.err
    assert main(["tail", run.id, "--no-follow", "--node", "node2"]) == 1
    assert ERROR in capsys.readouterr().err


def test_a_quiet_nodes_cpp_frames_fold_and_its_plain_lines_pass(tmp_path):
    log = tmp_path / "node2.log"
    log.write_text("[default0]:step 7 | loss 2.0\n[default0]:terminate called after throwing an instance of 'c10::Error'\n"
                   "[default0]:  what():  Connection reset by peer\n[default0]:frame #0: c10::Error::Error() + 0x8f\n"
                   "[default0]:frame #1: <unknown function> + 0x1a2b\n[default0]:saved checkpoint ckpt_7.pt\n")
    out = shown([NodeLog("node2", log, 2)], quiet={"node2"})
    assert out == ["node2/r2 | step 7 | loss 2.0",
                   f"node2/r2 | [clusterctl: 4 lines of a stopped rank's traceback folded; {log} has them]",
                   "node2/r2 | saved checkpoint ckpt_7.pt"], out
