"""`clusterctl drill` on the real test cluster (gloo on CPU): 3 nodes and a spare, a small DDP job
(tests/scripts/step_logger.py), a worker rank killed and then a rank stopped. Each fault is
detected, its culprit named (the node and rank the drill injected on), the run trains again after
each, the report carries each fault's figures, and nothing of the run is left on any node."""

import json
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import wait_for
from tests.test_hang_cluster import cli, inventory, no_job_left

pytestmark = pytest.mark.cluster

STEPS = str(Path(__file__).parent / "scripts" / "step_logger.py")
SCHEMA = json.loads((Path(__file__).resolve().parent.parent / "orchestrator" / "schemas" / "drill.json").read_text())


def test_a_drill_of_kill_and_hang_on_three_nodes_and_a_spare_recovers_from_both_and_leaves_nothing(
        cluster4, tmp_path, home):
    inv = inventory(cluster4, tmp_path, spare=True)
    r = cli("drill", "-i", inv, "--faults", "kill,hang", "--json", "--", STEPS, "--steps", "2000", "--step-s", "0.2",
            timeout=420)
    print(r.stderr[-4000:])
    assert r.returncode == 0, r.stdout[-3000:]
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["ok"] and doc["left"] == {} and doc["unchecked"] == {}
    kill, hang = doc["faults"]
    assert kill["fault"] == "kill" and kill["detected_by"] == "killed by signal", kill
    assert hang["fault"] == "hang" and hang["detected_by"] == "hang", hang
    for f in (kill, hang):
        assert f["ok"] and f["named_right"], f
        assert f["culprit"] == {"node": f["node"], "rank": f["rank"]}, f
        assert f["node"] != "node1", f  # never the master's node
        assert 0 < f["detected_s"] < 120 and 0 < f["relaunch_s"] < 180, f
        assert f["steps_redone"] is not None and f["lost_s"] >= f["detected_s"] + f["relaunch_s"] - 0.2, f
        assert f["goodput_at_one_per_hour"] == pytest.approx(1 - f["lost_s"] / 3600, abs=2e-4), f
        assert f["goodput_at_one_per_day"] == pytest.approx(1 - f["lost_s"] / 86400, abs=2e-5), f
    assert hang["attempt"] == kill["attempt"] + 1  # the hang went into the attempt the kill's restart began
    # one line per fault as it happens, and the drill's settings said up front
    assert "--hang-timeout 60" in r.stderr and "drill: kill: SIGKILL" in r.stderr
    assert f"kill (rank {kill['rank']} on {kill['node']}): detected after " in r.stderr
    assert f"hang (rank {hang['rank']} on {hang['node']}): detected after " in r.stderr
    # the run's record: stopped by the drill after the last recovery, three attempts, the spare in the third
    rec = json.loads((home / "runs" / doc["run_id"] / "run.json").read_text())
    assert [a["verdict"] for a in rec["attempts"][:2]] == ["killed by signal", "hang"], rec["attempts"]
    assert "node4" in rec["attempts"][2]["nodes"] and hang["node"] not in rec["attempts"][2]["nodes"]
    # nothing of the run on any node, seen from the test's side too (not only the drill's own check)
    assert wait_for(lambda: no_job_left(cluster4), 10, "the run's processes to go")


def test_a_rank_throttled_while_it_computes_is_named_a_straggler_without_a_restart(cluster4, tmp_path, home):
    """The straggler fault: one rank of a job whose steps compute on the CPU (step_logger --busy) is
    stopped three quarters of the time it computes; the straggler watch, judging from the Flight Recorder (the
    job reports no compute of its own), names that rank on that node while the throttle lasts, and
    the run goes on without a restart."""
    inv = inventory(cluster4, tmp_path, spare=True)
    r = cli("drill", "-i", inv, "--faults", "straggler", "--json", "--", STEPS, "--steps", "4000", "--step-s", "0.05",
            "--busy", timeout=420)
    print(r.stderr[-4000:])
    assert r.returncode == 0, r.stdout[-3000:]
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, SCHEMA)
    (s,) = doc["faults"]
    assert s["fault"] == "straggler" and s["ok"] and s["named_right"] and s["detected_by"] == "straggler", s
    assert s["culprit"] == {"node": s["node"], "rank": s["rank"]} and 0 < s["detected_s"] < 90, s
    assert s["relaunch_s"] is None and s["steps_redone"] is None, s  # warned, not restarted
    run_dir = home / "runs" / doc["run_id"]
    assert len(json.loads((run_dir / "run.json").read_text())["attempts"]) == 1
    told = [json.loads(ln)["text"] for ln in (run_dir / "story.jsonl").read_text().splitlines() if ln.strip()]
    assert any(t.startswith(f"straggler: {s['node']} rank {s['rank']} computes") for t in told), told
    assert doc["left"] == {} and wait_for(lambda: no_job_left(cluster4), 10, "the run's processes to go")
