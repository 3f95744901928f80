"""Progress for any script (runs/progress.py, runs/progresslog.py, runs/liveview.py): the step in
a log line in the common forms, on lines recorded from Lightning 2.6, transformers 5 and tqdm on
CPU (tests/fixtures/progress/record.py writes them), every rank's hook-reported progress as the
supervisor keeps it, and what `watch` and the stall flag make of both."""

import json
import os
import time
from pathlib import Path

import pytest

from orchestrator.cli.watch import stack_lines
from orchestrator.runs import progresslog
from orchestrator.runs.liveview import LiveView, RankTail
from orchestrator.runs.progress import Progress, collectives, parse
from orchestrator.runs.progresslog import ProgressLog
from orchestrator.runs.runrecord import AttemptRecord
from orchestrator.runs.spec import NodeState, NodeStatus

FIXTURES = Path(__file__).parent / "fixtures" / "progress"


@pytest.mark.parametrize("line, step", [
    ("step 45", 45), ("step=45", 45), ("step: 45", 45), ("Step 45/1000 | loss 2.1", 45), ("it 45", 45),
    ("iter 45: loss 2.1012, time 12.3ms, mfu 3.2%", 45), ("iteration 45", 45), ("global_step=12 lr=3e-4", 12),
    ("[Rank 0] step=45, skipped=0, lr=[0.0001]", 45), ("epoch 2 step 45", 45),
    ("step 40 | loss 2.1 | lr 3e-4 | tok/s 12,345 | mfu n/a | step 977 ms", 40),  # the shipped trainer's
    ("Epoch 3: 45/100 [00:10<00:12]", 345), ("45/100 [00:10<00:12, 4.50it/s]", 45), ("45it [00:10, 4.50it/s]", 45),
    ('{"step": 7, "loss": 1.5}', 7),
])
def test_the_step_in_each_common_form(line, step):
    assert parse(line) == Progress(step)


@pytest.mark.parametrize("line", ["step 977 ms", "step_time=0.5", "loss 3/4 [0.5]", "the model is it", "steps: 45",
                                  "Validation DataLoader 0:  53%|█████▎    | 8/15 [00:00<00:00, 198.75it/s]",
                                  "Sanity Checking: |          | 0/? [00:00<?, ?it/s]", "{'loss': 4.5}"])
def test_what_is_not_a_step(line):
    assert parse(line) is None


def steps_in(name: str) -> list[str]:
    """What a rank's file says, line by line, as RankTail reads it."""
    return [p.text for line in (FIXTURES / name).read_bytes().decode().split("\n") if (p := parse(line))]


def test_lightning_s_bars_give_the_global_step():
    # TQDMProgressBar, 2 epochs of 30 batches: epoch 0 ends at 30, epoch 1 at 60; validation's bar is not a step
    assert steps_in("lightning_tqdm_rank0.log")[:2] == ["30", "60"]
    assert steps_in("lightning_rich_rank0.log") == ["120"]  # the Rich bar, printed once at the end: 2 x 60
    assert steps_in("lightning_tqdm_rank1.log") == []  # rank 1 prints no bar


def test_the_hf_trainers_bar_and_log_dicts():
    assert steps_in("hf_trainer_tqdm_rank0.log")[:4] == ["0", "4", "8", "11"]  # its bar, newest update per line
    assert steps_in("hf_trainer_notqdm_rank0.log")[:3] == ["ep 0.05", "ep 0.1", "ep 0.15"]  # dicts: the epoch
    assert steps_in("tqdm_rank0.log") == ["50"]


def test_a_progress_bar_updating_in_place_is_read_before_its_line_ends(tmp_path):
    data = (FIXTURES / "lightning_tqdm_rank0.log").read_bytes()
    cut = data.index(b"Epoch 1:  50%")  # mid-epoch 1: no newline since epoch 0's
    (tmp_path / "rank0.log").write_bytes(data[:cut + 80])
    t = RankTail(tmp_path / "rank0.log")
    t.read(0.0)
    assert t.step == 30 + 15, t.step  # epoch 1, batch 15 of 30: 45 (the partial update after it is not whole)
    # the last whole line: validation's bar, its cursor movement taken off
    assert t.lines[-1] == "Validation DataLoader 0: 100%|██████████| 15/15 [00:00<00:00, 103.07it/s]", t.lines[-1]


def test_collectives_are_the_highest_seq_per_process_group():
    assert collectives([["0", 1, 10], ["0", 3, 30], ["1", 2, 20], ["0", "x", 40]]) == {"0": 3, "1": 2}


def doc(ranks: dict[int, dict]) -> dict:
    """A node's progress document as the node agent sends it (snapshot_doc, what=progress)."""
    return {"ranks": [{"rank": str(r), "pid": 100 + r, "state": "S", "answer": a} for r, a in ranks.items()],
            "time": 0.0}


def test_the_supervisor_keeps_every_ranks_progress_per_node(tmp_path):
    log = ProgressLog(tmp_path, "run-a.1")
    log.feed("n1", doc({0: {"steps": [[4, 0.1], [5, 0.1]]}, 1: {"entered": [["0", 7, 1], ["1", 2, 1]]}}), now=10.0)
    log.feed("n1", doc({0: {"steps": [[5, 0.1]]}, 1: {"entered": [["0", 7, 1], ["1", 2, 1]]}}), now=20.0)
    got = progresslog.read(tmp_path, "run-a.1")
    assert (got[0].step, got[0].moved, got[0].asked) == (5, 10.0, 20.0)  # asked again, not moved
    assert (got[1].collectives, got[1].moved) == (9, 10.0)
    log.feed("n1", doc({1: {"entered": [["0", 8, 1]]}}), now=30.0)
    assert progresslog.read(tmp_path, "run-a.1")[1].collectives == 10  # pg 1's 2 kept: its entries aged out
    assert progresslog.read(tmp_path, "run-a.2") == {}  # another attempt's files are not this one's
    assert json.loads((tmp_path / "progress" / "n1.json").read_text())["node"] == "n1"


def node(name, first, last, state=NodeState.RUNNING):
    return NodeStatus(name, 0, "h", state=state, first_rank=first, last_rank=last)


def test_a_script_logging_on_rank_0_only_shows_progress_on_every_node_and_its_stall(tmp_path):
    """The issue's DCP job: `step=45` on rank 0 only; the others' progress is their collectives."""
    (tmp_path / "ranks").mkdir()
    now = time.time()
    (tmp_path / "ranks" / "rank0.log").write_text("loading shards\nstep=44 loss=2.1\nstep=45 loss=2.0\n")
    os.utime(tmp_path / "ranks" / "rank0.log", (now - 2, now - 2))
    log = ProgressLog(tmp_path, "k")
    log.feed("n1", doc({0: {"entered": [["0", 90, 1]]}, 1: {"entered": [["0", 90, 1]]}}), now=now - 5)
    log.feed("n2", doc({2: {"entered": [["0", 90, 1]]}, 3: {"entered": [["0", 88, 1]]}}), now=now - 100)
    v = LiveView(tmp_path, 60)
    v.look([node("n1", 0, 1), node("n2", 2, 3)], AttemptRecord(1, "k", []), now=now)
    rows = {r.name: r for r in v.rows(now=now)}
    assert rows["n1"].progress == "45" and rows["n1"].flags == ()
    assert rows["n2"].progress == "c90" and rows["n2"].flags == ("stall 100s",)  # its collectives stopped
    by_rank = {r.name: r.progress for r in v.rows(by_rank=True, now=now)}
    assert by_rank == {"n1/r0": "45", "n1/r1": "c90", "n2/r2": "c90", "n2/r3": "c88"}
    doc_ = {d["rank"]: d for d in v.ranks_json(now=now)}
    assert doc_[0]["step"] == 45 and doc_[0]["step_from"] == "log" and doc_[0]["last_line"] == "step=45 loss=2.0"
    assert doc_[3]["collectives"] == 88 and doc_[3]["stall"] and doc_[3]["step"] is None
    v.look([node("n1", 0, 1), node("n2", 2, 3, NodeState.FINISHED)], AttemptRecord(1, "k", []), now=now)
    assert {r.name: r.flags for r in v.rows(now=now)}["n2"] == ()  # an ended node does not stall


def test_a_rank_whose_step_stopped_moving_stalls_though_it_still_prints(tmp_path):
    (tmp_path / "ranks").mkdir()
    p = tmp_path / "ranks" / "rank0.log"
    p.write_text("step 5\n")
    os.utime(p, (1000.0, 1000.0))
    v = LiveView(tmp_path, 30)
    v.look([node("n1", 0, 0)], AttemptRecord(1, "k", []), now=1010.0)
    with open(p, "a") as f:
        f.write("waiting for the data loader\n")  # heard, but no progress
    os.utime(p, (1040.0, 1040.0))
    v.look([node("n1", 0, 0)], AttemptRecord(1, "k", []), now=1041.0)
    assert v.rows(now=1041.0)[0].flags == ("stall 41s",)


def test_the_stack_panel_keeps_the_innermost_frames_at_80_columns():
    frames = "".join(f"    /home/u/gpt_train/model/layer_{i}.py:{i + 10} in forward_{i}\n      x = layer_{i}(x)\n"
                     for i in range(10))
    text = (f"---- rank 1 (node2 r1 pid 4242)\n  thread MainThread:\n{frames}"
            "    /usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py:3252 in all_reduce\n"
            "      work.wait()\n  collectives entered: pg 0 #41 gloo:all_reduce\n")
    lines = stack_lines(text, 12, 78)
    assert len(lines) == 12 and all(len(ln) <= 78 for ln in lines)
    assert lines[:3] == ["---- rank 1 (node2 r1 pid 4242)", "  thread MainThread:", "    … 7 outer frames"]
    assert lines[-3].startswith("    …") and lines[-3].endswith("/torch/distributed/distributed_c10d.py:3252 in all_reduce")
    assert lines[-2:] == ["      work.wait()", "  collectives entered: pg 0 #41 gloo:all_reduce"]
    assert "in forward_9" in lines[-5]  # the job's innermost frame, right above torch's


def test_the_slowest_rank_handed_to_the_journal_is_the_slowest_of_every_node(tmp_path):
    """Each node's document updates that node's slowest rank; the journal gets the slowest of all
    (the same as looking at every rank, as before), also after a rank's node changes."""
    import random

    class Hooks:
        got: list = []

        def hook(self, step, collectives, now=None):
            self.got.append((step, collectives))

    log = ProgressLog(tmp_path, "k")
    log.steps = Hooks()
    rng = random.Random(3)
    truth: dict[int, dict] = {}  # rank -> {"node", "step", "coll"}: what every rank said, newest
    for i in range(400):
        node = f"n{rng.randrange(6)}"
        ranks = rng.sample(range(24), rng.randrange(1, 5))
        answers = {}
        for r in ranks:
            t = truth.setdefault(r, {"step": None, "coll": None})
            if rng.random() < 0.5:
                step = rng.randrange(100)
                t["step"] = step if t["step"] is None else max(t["step"], step)
                answers[r] = {"steps": [[step, 0.1]]}
            else:
                seq = rng.randrange(100)
                t["coll"] = seq if t["coll"] is None else max(t["coll"], seq)
                answers[r] = {"entered": [["0", seq, 1]]}
        log.feed(node, doc(answers), now=float(i))
        stepped = [t["step"] for t in truth.values() if t["step"] is not None]
        entered = [t["coll"] for t in truth.values() if t["coll"] is not None]
        assert Hooks.got[-1] == (min(stepped) if stepped else None, min(entered) if entered else None)
    on_file = {r for p in (tmp_path / "progress").glob("*.json") for r in json.loads(p.read_text())["ranks"]}
    assert on_file == {str(r) for r in truth}  # every rank in one node's file: the one that last answered for it
    assert sum(len(json.loads(p.read_text())["ranks"]) for p in (tmp_path / "progress").glob("*.json")) \
        == len(truth)
