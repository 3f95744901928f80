"""`clusterctl watch` without a cluster (runs/liveview.py, cli/watch.py): what it reads from a run's
record and its per-rank files, the flags, and the view at 80 columns. The live view in a real
terminal is tests/test_watch_cluster.py."""

import json
import os
import re
import time

import pytest

from orchestrator.cli import main
from orchestrator.runs.liveview import LiveView, RankTail, slow_ranks
from orchestrator.runs.spec import RunSpec
from orchestrator.runs.store import Run, write_json
from orchestrator.runs.judge.straggler import Slow, describe

T0 = 1795000000.0


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def node(name, rank, first, state="running"):
    return {"name": name, "rank": rank, "host": "h", "state": state, "nproc": 2, "first_rank": first,
            "last_rank": first + 1, "pid": 100 + rank}


def a_run(home, state="running", hang_dir=None, straggler=None) -> Run:
    run = Run.create("watch-20261118-082640-a1b2", RunSpec(max_restarts=1, hang_timeout=30))
    att = {"attempt": 1, "key": run.id, "nodes": ["node1", "node2"], "launched": T0 + 5}
    if hang_dir:
        att["hang_dir"] = hang_dir
    if straggler:
        att["straggler"] = straggler
    write_json(run.dir / "run.json", {"id": run.id, "state": state, "created": T0, "started": T0 + 5,
                                      "nodes": [node("node1", 0, 0), node("node2", 1, 2)], "attempts": [att],
                                      "world_size": 4, "exit_code": 0 if state == "finished" else None,
                                      "summary": "finished" if state == "finished" else None})
    (run.dir / "ranks").mkdir()
    return run


def rank_lines(run, rank, text, age=0.0):
    p = run.dir / "ranks" / f"rank{rank}.log"
    with open(p, "a") as f:
        f.write(text)
    os.utime(p, (time.time() - age, time.time() - age))


def test_a_ranks_step_step_time_and_tokens_come_from_its_own_lines(tmp_path):
    p = tmp_path / "rank0.log"
    p.write_text("world size 4\nstep 10 | loss 2.1 | lr 3e-4 | tok/s 12,345 | mfu n/a | step 977 ms\n")
    t = RankTail(p)
    t.read(100.0)
    assert (t.step, t.seconds_per_step, t.tokens_s) == (10, 0.977, 12345.0)
    with open(p, "a") as f:
        f.write("step 20 | val loss 2.0\nhalf a li")
    t.read(101.0)
    assert t.step == 20 and t.lines[-1] == "step 20 | val loss 2.0"  # a partial line waits
    q = tmp_path / "rank1.log"  # no figures in the log: the step time is measured from its pace here
    q.write_text("rank 1 step 3\n")
    u = RankTail(q)
    u.read(10.0)
    with open(q, "a") as f:
        f.write("rank 1 step 4\nprogress 40%|████      | 4/10\r 50%|█████     | 5/10\nrank 1 step 7\n")
    u.read(13.0)
    assert u.step == 7 and u.seconds_per_step == pytest.approx(0.75) and u.tokens_s is None
    assert " 50%|█████     | 5/10" in u.lines  # a progress bar's latest state


def test_the_straggler_line_names_its_ranks_as_straggler_py_writes_it():
    line = describe([Slow(2, "node3", 0.093, 0.018, 20), Slow(3, "node3", 0.05, 0.018, 20), Slow(6, "node4", 0.04, 0.018, 20)])
    assert slow_ranks(line) == {2: pytest.approx(5.2, abs=0.1), 3: pytest.approx(5.2, abs=0.1), 6: pytest.approx(2.2, abs=0.1)}


def test_stall_hang_and_straggler_flags(home):
    d = home / "runs" / "watch-20261118-082640-a1b2" / "hangs" / "1"
    run = a_run(home, hang_dir="hangs/1", straggler="straggler: node1 rank 1 computes 2.6x the median (...)")
    d.mkdir(parents=True)
    (d / "verdict.json").write_text(json.dumps({"culprits": [{"rank": 3, "node": "node2", "pid": 7,
                                                              "why": "is stopped (state T)"}]}))
    for r in range(4):
        rank_lines(run, r, f"rank {r} step 5\n", age=45 if r >= 2 else 1)
    v = LiveView(run.dir, run.spec.hang_timeout)
    v.look(run.record.nodes, run.record.current)
    rows = {r.name: r for r in v.rows()}
    assert rows["node1"].flags == ("slow r1 2.6x",) and rows["node1"].step == 5
    assert rows["node2"].flags[0].startswith("stall 4") and "HANG r3 stopped" in rows["node2"].flags
    by_rank = {r.name: r.flags for r in v.rows(by_rank=True)}
    assert by_rank["node1/r0"] == () and by_rank["node2/r3"][1] == "HANG r3 stopped"


def test_watch_once_fits_80_columns_and_ends_with_the_runs_summary(home, capsys, monkeypatch):
    run = a_run(home, state="finished")
    monkeypatch.setattr(Run, "supervisor_alive", lambda self: False)
    monkeypatch.setenv("COLUMNS", "80")
    rank_lines(run, 0, "step 40 | loss 2.041 | lr 3.000e-04 | tok/s 1,234,567 | mfu n/a | step 412 ms\n")
    rank_lines(run, 2, "rank 2 step 40\n")
    assert main(["watch", run.id, "--ranks"]) == 0  # the run's exit code
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert all(len(ln) <= 80 for ln in lines), lines
    assert lines[0].startswith(f"{run.id}: finished, attempt 1 of at most 2")
    assert lines[1] == "goodput 0.00 · badput startup 5.0s"  # launched 5 s after train, no step recorded
    header = lines[2].split()
    assert header == ["rank", "state", "step", "s/step", "tok/s", "heard", "flags"], lines[2]
    r0 = next(ln for ln in lines if ln.startswith("node1/r0")).split()
    # heard: seconds since the line was written, 0 unless this machine is loaded (it ran 1 s late in a suite run)
    assert r0[:5] == ["node1/r0", "running", "40", "412ms", "1,235k"] and re.fullmatch(r"\d+s", r0[5]), r0
    assert [ln.split()[0] for ln in lines[3:7]] == ["node1/r0", "node1/r1", "node2/r2", "node2/r3"]
    assert f"clusterctl: run {run.id} finished" in out.err


def test_the_stack_panel_at_80x24_shows_the_innermost_frames(home):
    """30.9: a deep stack asked with a rank's number used to lose its innermost frames (the ones
    that say where the rank waits) off the bottom of an 80 x 24 screen."""
    from rich.console import Console

    from orchestrator.cli.watch import Screen

    run = a_run(home)
    rank_lines(run, 0, "step 7 | loss 2.0\n")
    screen = Screen(run, by_rank=False)
    screen.look(run.record)
    frames = "".join(f"    /home/u/gpt_train/model/block_{i}.py:{i + 10} in forward\n      x = self.block_{i}(x)\n"
                     for i in range(12))
    screen.detail = type("Asked", (), {"rank": 0, "node": "node1", "text": (
        f"---- rank 0 (node1 r0 pid 4101)\n  thread MainThread:\n{frames}"
        "    /usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py:3252 in all_reduce\n"
        "      work.wait()\n  collectives entered: pg 0 #41 gloo:all_reduce\n")})()
    con = Console(width=80, height=24, record=True, file=open(os.devnull, "w"), color_system=None)
    con.print(screen.render(run.record, 80, 24))
    out = con.export_text().splitlines()
    assert len(out) <= 24 and all(len(ln) <= 80 for ln in out), out
    assert out[-2].strip() == "collectives entered: pg 0 #41 gloo:all_reduce", out
    assert out[-3].strip() == "work.wait()" and out[-4].endswith("distributed_c10d.py:3252 in all_reduce"), out
    assert any("outer frames" in ln for ln in out) and any("block_11.py:21 in forward" in ln for ln in out), out
