"""Logs at 64 x 8 ranks: identical lines of many ranks fold on screen under their ranges
(runs/logs/fold.py LineFold), `tail --ranks/--node` filter, `--no-fold` prints every line, and every
rank's lines are split into runs/RUN/ranks/rankN.log as they arrive, exactly once, also across a
controller crash (runs/logs/rankfiles.py)."""

import io
import json
import random
import re

import pytest

from orchestrator.cli import main
from orchestrator.cli.output import Prefixer
from orchestrator.runs.logs.follow import Follower, NodeLog
from orchestrator.runs.logs.rankfiles import RankFiles, rank_file
from orchestrator.runs.logs.fold import LineFold
from orchestrator.runs.spec import RunSpec
from orchestrator.runs.store import Run
from orchestrator.runs.logs.copier import LogCopier
from tests.conftest import write_record

NODES = [f"n{i}" for i in range(1, 9)]  # 8 nodes x 8 ranks = 64 ranks


def node_text(i: int) -> str:
    """What node n{i+1}'s 8 ranks wrote: the same line from every rank, then one line each that
    differs (the rank's own loss), then torchrun's own line."""
    same = "".join(f"[default{lr}]:data: 1000 batches of 8\n" for lr in range(8))
    own = "".join(f"[default{lr}]:loss {8 * i + lr}.0\n" for lr in range(8))
    return same + own + "torchrun: workers started\n"


def write_logs(tmp_path):
    logs = []
    for i, name in enumerate(NODES):
        p = tmp_path / f"{name}.log"
        p.write_text(node_text(i))
        logs.append(NodeLog(name, p, 8 * i))
    return logs


def screen(tmp_path, **kw) -> list[str]:
    out = io.StringIO()
    f = Follower(write_logs(tmp_path), Prefixer(["n1/r63"], out=out, color=False), **kw)
    f.poll(final=True)
    f.close()
    return [re.sub(r" +\|", " |", line) for line in out.getvalue().splitlines()]


def test_64_ranks_printing_the_same_line_show_it_once_with_their_range(tmp_path):
    out = screen(tmp_path)
    same = [line for line in out if "data: 1000 batches" in line]
    assert same == ["n[1-8]/r[0-63] | data: 1000 batches of 8"]
    assert [line for line in out if "torchrun:" in line] == ["n[1-8] | torchrun: workers started"]


def test_differing_lines_are_never_folded(tmp_path):
    out = screen(tmp_path)
    losses = [line for line in out if "| loss " in line]
    assert len(losses) == 64
    assert losses[0] == "n1/r0 | loss 0.0" and losses[-1] == "n8/r63 | loss 63.0"


def test_no_fold_prints_every_line(tmp_path):
    out = screen(tmp_path, fold=False)
    assert sum("data: 1000 batches" in line for line in out) == 64
    assert sum("torchrun: workers started" in line for line in out) == 8


def test_tail_filters_by_ranks_and_node(tmp_path):
    out = screen(tmp_path, ranks={0, 5, 9})
    assert [line for line in out if "loss" in line] == ["n1/r0 | loss 0.0", "n1/r5 | loss 5.0", "n2/r9 | loss 9.0"]
    assert [line for line in out if "data" in line] == ["n[1-2]/r[0,5,9] | data: 1000 batches of 8"]
    out = screen(tmp_path, nodes={"n3"}, ranks={16, 17, 40})
    assert out == ["n3/r[16-17] | data: 1000 batches of 8", "n3/r16 | loss 16.0", "n3/r17 | loss 17.0"]


def test_a_ranks_lines_keep_their_order_and_a_late_repeat_is_not_folded():
    got = []

    def out(lines):
        got.extend(f"{label} | {text}" for label, text, _ in lines)

    fold = LineFold(window=1.0)
    fold.add("n1", 0, "n1/r0", "A", now=0.0)
    fold.add("n1", 0, "n1/r0", "B", now=0.1)
    fold.add("n1", 1, "n1/r1", "B", now=0.2)
    fold.add("n1", 1, "n1/r1", "A", now=0.3)  # rank 1's A comes after its B: it may not join rank 0's A
    fold.add("n2", 8, "n2/r8", "A", now=0.4)  # rank 8 has no line yet: it joins the newest A
    fold.add("n2", 9, "n2/r9", "B", now=5.0)  # past the window: a line of its own
    fold.flush(0.9, out)
    assert got == []  # still inside the window
    fold.flush(0.9, out, all=True)
    assert got == ["n1/r0 | A", "n1/r[0-1] | B", "n[1-2]/r[1,8] | A", "n2/r9 | B"]


def test_lines_held_for_folding_print_before_clusterctl_speaks(tmp_path):
    out = io.StringIO()
    f = Follower(write_logs(tmp_path)[:1], Prefixer(["n1/r7"], out=out, color=False))
    f.poll()  # within the window: held
    assert out.getvalue() == ""
    f.flush()  # what _Show does before a story line
    assert out.getvalue().splitlines()[0] == "n1/r[0-7] | data: 1000 batches of 8"


# ---------------------------------------------------------------- the per-rank files on disk
def rank_lines(run_dir, rank):
    p = rank_file(run_dir, rank)
    return p.read_text().splitlines() if p.exists() else []


def expected(rank):
    return ["data: 1000 batches of 8", f"loss {rank}.0"]


def make_run(tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "home"))
    run = Run.create("r-ranks", RunSpec())
    write_record(run, state="running", nodes=[{"name": n, "rank": i, "host": n, "first_rank": 8 * i, "last_rank": 8 * i + 7}
                                       for i, n in enumerate(NODES)])
    return run


def test_every_ranks_lines_land_in_its_file_once_as_they_arrive(tmp_path, monkeypatch):
    run = make_run(tmp_path, monkeypatch)
    copier = LogCopier(run, NODES, echo=lambda s: None)
    rng = random.Random(7)
    for i, name in enumerate(NODES):  # each node's bytes in chunks cut anywhere, lines torn included
        data = node_text(i).encode()
        while data:
            k = rng.randint(1, 40)
            copier.write_log(name, data[:k])
            data = data[k:]
            if name == "n1":
                assert rank_lines(run.dir, 0)[:1] in ([], ["data: 1000 batches of 8"])  # written as they arrive
    copier.close()
    for r in range(64):
        assert rank_lines(run.dir, r) == expected(r), r
    assert run.node_log("n3").read_text() == node_text(2)  # the node's copy is untouched


def test_a_controller_crash_between_a_write_and_its_index_writes_no_line_twice(tmp_path, monkeypatch):
    run = make_run(tmp_path, monkeypatch)
    copier = LogCopier(run, NODES, echo=lambda s: None)
    half = {name: len(node_text(i)) // 2 + 3 for i, name in enumerate(NODES)}
    for i, name in enumerate(NODES):
        copier.write_log(name, node_text(i).encode()[:half[name]])
    # the crash: the next chunk reaches the node copies and the rank files, the index never does
    for i, name in enumerate(NODES):
        copier.files[name].write(node_text(i).encode()[half[name]:])
        copier.files[name].flush()
        copier.ranks.feed(name, node_text(i).encode()[half[name]:], save=False)
    copier.close()
    assert rank_lines(run.dir, 0) == expected(0)  # on disk, ahead of the index
    again = LogCopier(run, NODES, echo=lambda s: None)  # the adopting supervisor's copier
    again.close()
    for r in range(64):
        assert rank_lines(run.dir, r) == expected(r), r
    index = json.loads((run.dir / "ranks" / "index.json").read_text())
    assert index["at"]["n1"] == len(node_text(0))


def test_torchruns_report_lines_are_not_a_ranks(tmp_path):
    (tmp_path / "n1.log").write_text("[default0]:x\nRoot Cause (first observed failure):\n[0]:\n  rank : 0\n")
    RankFiles(tmp_path, {"n1": tmp_path / "n1.log"}, {"n1": 0}).close()
    assert rank_lines(tmp_path, 0) == ["x"]  # `[0]:` is the report's numbering, not local rank 0's tag


def test_a_node_without_ranks_yet_is_not_split(tmp_path):
    (tmp_path / "n1.log").write_text("[default0]:x\n")
    RankFiles(tmp_path, {"n1": tmp_path / "n1.log"}, {"n1": None}).close()
    assert not rank_file(tmp_path, 0).exists()


# ---------------------------------------------------------------- the CLI
@pytest.fixture
def ended_run(tmp_path, monkeypatch):
    run = make_run(tmp_path, monkeypatch)
    for i, name in enumerate(NODES):
        run.node_log(name).write_text(node_text(i))
    write_record(run, state="finished", exit_code=0, rank_map="rank map: n1 0-7, ...")
    return run


def test_tail_ranks_and_node_on_a_run(ended_run, capsys):
    RankFiles(ended_run.dir, {n: ended_run.node_log(n) for n in NODES}, {n: 8 * i for i, n in enumerate(NODES)}).close()
    assert main(["tail", ended_run.id, "--no-follow", "--ranks", "0-1,5", "--node", "n1"]) == 0
    cap = capsys.readouterr()
    out = [re.sub(r" +\|", " |", line) for line in cap.out.splitlines()]
    assert out == ["n1/r[0-1,5] | data: 1000 batches of 8", "n1/r0 | loss 0.0", "n1/r1 | loss 1.0",
                   "n1/r5 | loss 5.0"]
    assert f"rank 0: {ended_run.dir / 'ranks' / 'rank0.log'}" in cap.err  # the end says where rank 0 is


@pytest.mark.parametrize("args, says", [
    (["--ranks", "0,x"], "'x' is not a rank or a range of ranks"),
    (["--ranks", "7-3"], "'7-3' is not a rank or a range of ranks"),
    (["--node", "n9"], "n9 is not a node of run r-ranks (n1, n2, n3, n4, n5, n6, n7, n8)"),
    (["--node", "n[3-"], "--node"),
])
def test_a_bad_filter_is_a_usage_error_that_says_why(ended_run, capsys, args, says):
    assert main(["tail", ended_run.id, "--no-follow", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_the_index_is_written_at_most_once_a_second_and_a_crash_still_writes_no_line_twice(tmp_path, monkeypatch):
    """A burst of chunks writes its lines at once but the index once per SAVE_S; a splitter that
    starts from that older index (the crash right after the burst) cuts the rank files back and
    writes each line once."""
    from orchestrator.runs.logs import rankfiles

    run = make_run(tmp_path, monkeypatch)
    copier = LogCopier(run, NODES, echo=lambda s: None)
    now = [copier.ranks.saved + rankfiles.SAVE_S]  # a second after the index its start wrote
    copier.ranks.clock = lambda: now[0]
    saves = []
    real_save = copier.ranks.save
    copier.ranks.save = lambda: (saves.append(now[0]), real_save())
    text = {name: node_text(i).encode() for i, name in enumerate(NODES)}
    for name in NODES:  # the first halves: one index write for the burst
        copier.write_log(name, text[name][:len(text[name]) // 2])
    assert len(saves) == 1
    assert rank_lines(run.dir, 0)[:1] == ["data: 1000 batches of 8"]  # the lines themselves are not held back
    now[0] += rankfiles.SAVE_S
    copier.write_log("n1", text["n1"][len(text["n1"]) // 2:])
    assert len(saves) == 2
    for name in NODES[1:]:  # the rest of the burst, not indexed: the crash comes now
        copier.write_log(name, text[name][len(text[name]) // 2:])
    assert len(saves) == 2
    copier.close()
    index = json.loads((run.dir / "ranks" / "index.json").read_text())
    assert index["at"]["n2"] < len(text["n2"])  # behind what the rank files hold
    again = LogCopier(run, NODES, echo=lambda s: None)  # the adopting supervisor's copier
    again.close()
    for r in range(64):
        assert rank_lines(run.dir, r) == expected(r), r
