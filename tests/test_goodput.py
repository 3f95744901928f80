"""The goodput ledger (orchestrator/runs/goodput.py) on recorded runs (tests/fixtures/goodput/, made
by its record.py on the test cluster): every second of the wall time in one category, each
category where the record's and the story's own times put it; the step journal that gives the
ledger its clock (orchestrator/runs/stepjournal.py); the figures `goodput --json` prints."""

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from orchestrator.cli import main
from orchestrator.runs import faults, goodput, stepjournal
from orchestrator.runs.goodput import CATEGORIES, Facts, ledger, of_dir
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.spec import RunState
from orchestrator.runs.stepjournal import StepJournal, Steps

FIXTURES = Path(__file__).parent / "fixtures" / "goodput"
SCHEMAS = Path(__file__).resolve().parent.parent / "orchestrator" / "schemas"
SCHEMA = json.loads((SCHEMAS / "goodput.json").read_text())


def rec(name: str) -> dict:
    return json.loads((FIXTURES / name / "run.json").read_text())


def story(name: str) -> list[dict]:
    return [json.loads(ln) for ln in (FIXTURES / name / "story.jsonl").read_text().splitlines()]


def journal(name: str, attempt: int) -> list[dict]:
    return [json.loads(ln) for ln in (FIXTURES / name / "progress" / f"steps-a{attempt}.jsonl").read_text().splitlines()]


def steps(name: str, attempt: int) -> list[tuple[float, int]]:
    return sorted((d["at"], d["step"]) for d in journal(name, attempt) if "step" in d and d.get("from") != "hook")


def adds_up(doc: dict) -> None:
    """productive + badput is the wall time, the whole run's and each attempt's; nothing negative."""
    assert doc["productive_s"] + sum(doc["badput"].values()) == pytest.approx(doc["wall_s"], abs=0.05)
    assert all(v >= 0 for v in doc["badput"].values()) and doc["productive_s"] >= 0
    assert sum(a["wall_s"] for a in doc["attempts"]) == pytest.approx(doc["wall_s"], abs=0.05)
    for a in doc["attempts"]:
        assert a["productive_s"] + sum(a["badput"].values()) == pytest.approx(a["wall_s"], abs=0.05)
    jsonschema.validate(doc, SCHEMA)


def test_a_run_without_a_fault_loses_only_its_startup_and_its_end():
    r = rec("nofault")
    doc = of_dir(FIXTURES / "nofault").to_json()
    adds_up(doc)
    pts = steps("nofault", 1)
    b = doc["badput"]
    assert doc["live"] is False and doc["wall_s"] == pytest.approx(r["ended"] - r["created"], abs=0.01)
    assert b["startup_s"] == pytest.approx(pts[0][0] - r["created"], abs=0.01)  # train -> the first step
    assert b["other_s"] == pytest.approx(r["ended"] - pts[-1][0], abs=0.01)  # the last step -> the end
    assert b["detection_s"] == b["restore_s"] == b["recompute_s"] == b["hang_s"] == b["straggler_s"] == 0
    assert doc["goodput"] == pytest.approx(1 - (b["startup_s"] + b["other_s"]) / doc["wall_s"], abs=1e-3)
    assert doc["step"] == 400 and doc["target_step"] == 400 and doc["eta_s"] is None  # ended: no ETA
    [a] = doc["attempts"]
    assert a["first_step_at"] == pts[0][0] and a["fault_at"] is None and a["reached_step"] == 400


def test_a_node_cut_costs_detection_restore_and_recompute_at_the_storys_times():
    r = rec("restart")
    a1, a2 = r["attempts"]
    lost = next(d for d in story("restart") if d.get("lost") == "node2")
    doc = of_dir(FIXTURES / "restart").to_json()
    adds_up(doc)
    d1, d2 = doc["attempts"]
    # the fault: node2 last heard (the loss's line less its silence), or the job's last step after that
    heard = lost["at"] - lost["silent_s"]
    last_step = max(t for t, _ in steps("restart", 1) if t <= lost["at"])
    assert d1["declared_at"] == pytest.approx(lost["at"], abs=1e-3)
    assert d1["fault_at"] == pytest.approx(max(heard, last_step), abs=1e-3)
    assert d1["badput"]["detection_s"] == pytest.approx(lost["at"] - max(heard, last_step), abs=0.01)
    assert d1["badput"]["detection_s"] > 0
    # restore: the loss declared -> attempt 2 launched
    assert d2["badput"]["restore_s"] == pytest.approx(a2["launched"] - lost["at"], abs=0.01)
    assert d2["badput"]["restore_s"] > 0
    # recompute: the steps from the checkpoint attempt 2 restored to those attempt 1 had reached
    assert a2["checkpoint"] == "ckpt_00000050.pt" and d2["start_step"] == 50
    assert d1["reached_step"] == max(s for t, s in steps("restart", 1) if t <= d1["fault_at"])
    redone = d1["reached_step"] - 50
    assert redone > 0
    assert d1["badput"]["recompute_s"] == pytest.approx(redone * d1["step_s"], abs=0.01)
    assert doc["badput"]["detection_s"] == d1["badput"]["detection_s"]
    # each attempt's own startup: launch -> its first step
    assert d2["badput"]["startup_s"] == pytest.approx(steps("restart", 2)[0][0] - a2["launched"], abs=0.01)
    assert d1["badput"]["startup_s"] == pytest.approx(steps("restart", 1)[0][0] - r["created"], abs=0.01)
    assert 0 < doc["goodput"] < 1 and doc["badput"]["hang_s"] == 0


def test_a_hang_costs_the_hung_time_before_the_verdict():
    r = rec("hang")
    a1, a2 = r["attempts"]
    verdict = next(d for d in story("hang") if d["text"] == a1["hang"])
    doc = of_dir(FIXTURES / "hang").to_json()
    adds_up(doc)
    d1, d2 = doc["attempts"]
    last = steps("hang", 1)[-1]
    assert d1["fault_at"] == pytest.approx(last[0], abs=1e-3) and d1["declared_at"] == pytest.approx(verdict["at"])
    assert d1["badput"]["hang_s"] == pytest.approx(verdict["at"] - last[0], abs=0.01)
    assert d1["badput"]["hang_s"] > 4  # --hang-timeout 4
    assert d1["badput"]["detection_s"] == 0
    assert d2["badput"]["restore_s"] == pytest.approx(a2["launched"] - verdict["at"], abs=0.01)
    # the script keeps no checkpoint: attempt 2 started over at step 0, so every step of attempt 1 was redone
    assert d2["start_step"] == 0 and d1["reached_step"] == last[1] == 19
    assert d1["badput"]["recompute_s"] == pytest.approx(min(19 * d1["step_s"], d1["wall_s"]), abs=0.01)


def test_a_running_run_has_an_eta_at_its_pace():
    pts = steps("running", 1)
    now = pts[-1][0] + 1.0
    lg = of_dir(FIXTURES / "running", now=now)
    doc = lg.to_json()
    adds_up(doc)
    assert doc["live"] is True and doc["until"] == pytest.approx(now)
    assert doc["target_step"] == 400  # the inventory's train.args: --max-steps 400
    assert doc["step"] == pts[-1][1]
    pace = sorted((b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(pts, pts[1:]))
    assert doc["step_s"] == pytest.approx(pace[len(pace) // 2] if len(pace) % 2 else
                                          (pace[len(pace) // 2 - 1] + pace[len(pace) // 2]) / 2, rel=1e-3)
    assert doc["eta_s"] == pytest.approx((400 - pts[-1][1]) * doc["step_s"], abs=0.1)
    assert doc["eta_s"] > 0
    assert doc["badput"]["other_s"] == 0  # a live attempt computes until now


def test_a_live_run_that_stopped_moving_stops_counting_as_productive():
    """No progress for a while: the quiet is `other` until a verdict says what it was (or the job
    moves again), not productive time, and the ETA stays at the pace it had."""
    last = steps("running", 1)[-1][0]
    moving = of_dir(FIXTURES / "running", now=last + 30).to_json()
    quiet = of_dir(FIXTURES / "running", now=last + 300).to_json()
    assert moving["badput"]["other_s"] == 0 and not moving["notes"]
    assert quiet["badput"]["other_s"] == pytest.approx(300, abs=0.01)
    assert quiet["productive_s"] == pytest.approx(moving["productive_s"] - 30, abs=0.01)
    assert quiet["notes"] == ["attempt 1: no progress for 300s: counted as other until a verdict says why (or the "
                              "job moves again)"]
    assert quiet["eta_s"] == moving["eta_s"]


@pytest.mark.parametrize("name", ["nofault", "running", "hang", "restart"])
@pytest.mark.parametrize("late", [0.0, 3.0, 300.0])
def test_every_second_is_counted_once_whenever_it_is_asked(name, late):
    r = rec(name)
    end = r.get("ended") or max(t for t, _ in steps(name, r["attempt"]))
    adds_up(of_dir(FIXTURES / name, now=end + late).to_json())


def test_the_schema_check_is_not_vacuous():
    doc = of_dir(FIXTURES / "restart").to_json()
    for broken in ({**doc, "badput": {**doc["badput"], "hang_s": -1}}, {k: v for k, v in doc.items() if k != "goodput"},
                   {**doc, "attempts": [{**doc["attempts"][0], "badput": {}}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, SCHEMA)


# ---------------------------------------------------------------- what the ledger takes from the story
def attempt(k, launched, ended, verdict, **kw) -> dict:
    return {"attempt": k, "key": "r" if k == 1 else f"r.a{k}", "nodes": ["n1", "n2"], "started": launched - 1,
            "launched": launched, "ended": ended, "failed_at": kw.pop("failed_at", ended if verdict != "finished"
                                                                         else None), "verdict": verdict, **kw}


def facts(attempts, journals, lines=(), state="finished", ended=None, now=0.0, target=None) -> Facts:
    doc = {"id": "r", "state": state, "created": 1000.0, "attempts": attempts, "attempt": len(attempts),
           "ended": ended}
    return Facts(RunRecord.from_json(doc), list(lines), journals, target, now)


def walk(t0, t1, s0, s1) -> list[tuple[float, int]]:
    """A step a second from (t0, s0) to (t1, s1)."""
    n = s1 - s0
    return [(t0 + (t1 - t0) * i / n, s0 + i) for i in range(n + 1)]


def test_recompute_reaches_back_into_the_attempt_that_computed_the_lost_steps():
    """Attempt 3 restarted from step 20, older than attempt 2's start (40): attempt 2's steps are
    redone, and steps 20-40 of attempt 1 too."""
    a = [attempt(1, 1010, 1070, "exit code"), attempt(2, 1080, 1100, "exit code", checkpoint="ckpt_00000040.pt"),
         attempt(3, 1110, 1200, "finished", checkpoint="ckpt_00000020.pt")]
    j = {1: Steps(log=walk(1020, 1070, 0, 50)), 2: Steps(log=walk(1085, 1100, 40, 55)),
         3: Steps(log=walk(1115, 1195, 20, 100))}
    lg = ledger(facts(a, j, ended=1200))
    s1, s2, s3 = lg.shares
    assert s1.badput["recompute"] == pytest.approx((50 - 20) * 1.0)  # 20..50: 10 by fault 1, 20 more by fault 2
    assert s2.badput["recompute"] == pytest.approx(15 * 1.0) and s3.badput["recompute"] == 0
    assert lg.productive_s + sum(lg.badput.values()) == pytest.approx(lg.wall_s)


def test_a_straggler_costs_its_excess_compute_for_each_step_while_named():
    lines = [{"at": 1050.0, "text": "straggler: n2 rank 1 computes 2.0x the median (400 ms vs 200 ms over the last "
                                    "50 steps)"},
             {"at": 1070.0, "text": "straggler: n2 rank 1 no longer computes slower than the median"}]
    lg = ledger(facts([attempt(1, 1010, 1100, "finished")], {1: Steps(log=walk(1020, 1100, 0, 80))}, lines,
                      ended=1100))
    assert lg.badput["straggler"] == pytest.approx(20 * 0.2)  # 20 steps in the 20 s named, 200 ms each
    spans = faults.straggler_spans(lines, 1000, 1100)
    assert [(s.start, s.end, s.unit) for s in spans] == [(1050.0, 1070.0, "steps")]


def test_checkpoint_stalls_are_the_ones_the_log_says():
    j = Steps(log=walk(1020, 1100, 0, 80), saves=[(1030.0, 0.5), (1060.0, 1.25), (1105.0, 9.0)])
    lg = ledger(facts([attempt(1, 1010, 1110, "finished")], {1: j}, ended=1110))
    assert lg.badput["checkpoint"] == pytest.approx(1.75)  # the save after the last step is the run's end
    assert stepjournal.save_seconds("saved checkpoint ckpt_00000040.pt in 0.21 s") == 0.21
    assert stepjournal.save_seconds("checkpoint 40 saved: stall 12 ms (write 3.1 s in the background)") == 0.012
    assert stepjournal.save_seconds("Saving ckpt took 3.2s") == 3.2
    assert stepjournal.save_seconds("startup 9.83 s: imports 3.21 s, checkpoint 0.06 s") is None  # a load
    assert stepjournal.save_seconds("SIGTERM received: saved checkpoint ckpt_40.pt at step 40, exiting") is None
    assert stepjournal.total_of("Step 45/1000 | loss 2.1") == 1000
    assert stepjournal.total_of(" 17%|█▋        | 5/30 [00:00<00:02, 11.2it/s]") == 30
    assert stepjournal.total_of("step 40 | loss 2.1 | 412 ms") is None
    # the cheap pre-tests on every line keep what the searches find: any case, spaces around the slash
    assert stepjournal.save_seconds("Wrote CKPT in 2 s") == 2.0
    assert stepjournal.save_seconds("step 40 | tok/s 12,345 | saved in 2 s") is None  # no checkpoint named
    assert stepjournal.total_of("ITER 45 / 1000 | tok/s 12,345") == 1000
    assert stepjournal.total_of("step 45 | tok/s 12,345 | mfu n/a") is None


def test_a_lost_nodes_fault_is_when_it_was_last_heard_and_a_hangs_from_the_watchs_silence():
    a = RunRecord.from_json({"id": "r", "attempts": [attempt(1, 1010, 1060, "node lost", failed_at=1056.0,
                                                             bad_nodes=["n2"]),
                                                     attempt(2, 1070, 1090, "hang", hang="hang: rank 1 ...")]})
    lines = [{"at": 1050.0, "text": "n2: silent for 3.0s (...)", "event": "node_silent", "node": "n2", "silent_s": 3.0},
             {"at": 1055.0, "text": "n2 lost: no answer for 8.0s (...)"},  # written before lines carried data
             {"at": 1080.0, "text": "no rank wrote a line for 6s: taking a snapshot"},
             {"at": 1085.0, "text": "hang: rank 1 ..."}]
    f = faults.fault_of(a.attempts[0], lines, [])
    assert (f.at, f.declared) == (1047.0, 1055.0)
    f = faults.fault_of(a.attempts[0], lines, [(1049.5, 7)])  # it still stepped after: the node was there
    assert (f.at, f.declared) == (1049.5, 1055.0)
    f = faults.fault_of(a.attempts[1], lines, [])
    assert (f.at, f.declared, f.kind) == (1074.0, 1085.0, "hang")


# ---------------------------------------------------------------- the step journal
def test_the_journal_thins_steady_steps_but_keeps_both_edges_of_a_pause_and_the_last_step(tmp_path):
    j = StepJournal(tmp_path, 2)
    t = 100.0
    for s in range(50):  # 10 steps a second for 5 s
        j.line(f"step {s} | loss 1.0", t + s * 0.1)
    j.line("step 50 | loss 1.0", 120.0)  # after a 15 s pause
    j.line("step 51 | loss 1.0", 120.1)
    j.close()
    got = stepjournal.read(tmp_path)[2].log
    assert got[0] == (100.0, 0) and len(got) < 10
    assert (104.9, 49) in got and (120.0, 50) in got  # the pause's edges at their own times
    assert got[-1] == (120.1, 51)  # the last step, written when the copy closed
    assert stepjournal.attempt_of("run-20261128-211905-244f.a12") == 12
    assert stepjournal.attempt_of("my.a5-20261128-211905-244f") == 1


def test_the_journal_takes_rank_zeros_lines_only_and_keeps_saves_and_the_target(tmp_path):
    j = StepJournal(tmp_path, 1)
    j.rank_line(1, b"step 99 | loss 1.0\n")
    j.rank_line(0, b"Step 3/1000 | loss 1.0\n")
    j.rank_line(0, b"saved checkpoint ckpt_00000003.pt in 250 ms\n")
    j.hook(None, 812, now=50.0)
    j.close()
    s = stepjournal.read(tmp_path)[1]
    assert [v for _, v in s.log] == [3] and s.total == 1000 and [x for _, x in s.saves] == [0.25]
    assert s.collectives == [(50.0, 812)] and s.points == s.log


# ---------------------------------------------------------------- the command
@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "runs").mkdir(parents=True)
    return tmp_path / "home"


def put(home: Path, name: str) -> str:
    rid = rec(name)["id"]
    shutil.copytree(FIXTURES / name, home / "runs" / rid)
    return rid


def test_goodput_json_and_text(home, capsys):
    rid = put(home, "restart")
    assert main(["goodput", rid[:12], "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    adds_up(doc)
    assert doc["run_id"] == rid and doc == of_dir(home / "runs" / rid).to_json()
    assert main(["goodput", rid]) == 0
    out = capsys.readouterr().out
    assert f"goodput {doc['goodput']:.2f}" in out and "detect" in out and "restore" in out
    assert "attempt 1: node lost at " in out and "steps redone" in out


def test_the_end_of_a_run_in_json_carries_its_ledger(home):
    """train/tail/stop --json end with the run's document: its goodput ledger is in it."""
    from orchestrator.cli.jsonout import run_doc

    rid = put(home, "hang")
    doc = run_doc(RunRecord.from_json(json.loads((home / "runs" / rid / "run.json").read_text())))
    assert doc["goodput"] == of_dir(home / "runs" / rid).to_json()
    schema = json.loads((SCHEMAS / "train.json").read_text())
    jsonschema.validate(doc, {**schema, "$ref": "#/$defs/end"})
    jsonschema.validate(doc["goodput"], SCHEMA)
    assert run_doc(RunRecord("gone", RunState.FINISHED))["goodput"] is None


def test_goodput_of_an_unknown_run_is_a_usage_error(home, capsys):
    assert main(["goodput", "nope", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["exit_code"] == 2


def test_every_category_is_in_the_json_and_the_target_is_read_from_the_arguments():
    doc = of_dir(FIXTURES / "hang").to_json()
    assert list(doc["badput"]) == [f"{c}_s" for c in CATEGORIES]
    assert doc["target_step"] is None  # hang_ddp.py's --steps is not a target the ledger knows
    assert goodput.target_in(["--max_iters=5000"]) == 5000 and goodput.target_in(["--max-steps", "12"]) == 12
    assert goodput.target_in(["--max-steps", "x", "--steps", "3"]) is None
