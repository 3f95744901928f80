"""The goodput ledger of a real run with a restart (test cluster, gloo on CPU): the shipped trainer on
3 nodes and a spare, node2's link cut for good between two checkpoints, the spare takes its place
from the newest copy. `clusterctl goodput RUN --json` adds up to the wall time, and the restart's
detection, restore and recompute are each there, where the story's, the record's and the step
journal's own times put them."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import wait_for
from tests.test_restarts_cluster import copies, inventory, run_dir_of, start

pytestmark = pytest.mark.cluster

SCHEMA = json.loads((Path(__file__).resolve().parent.parent / "orchestrator" / "schemas" / "goodput.json").read_text())
EVERY = 50  # steps between checkpoints: the cut falls well inside one interval
STEP = re.compile(rb"^step (\d+) \| loss", re.M)


def rank0_step(run_dir: Path) -> int | None:
    try:
        found = STEP.findall((run_dir / "ranks" / "rank0.log").read_bytes()[-4096:])
    except OSError:
        return None
    return int(found[-1]) if found else None


def between_checkpoints(run_dir: Path) -> int | None:
    """Rank 0's step, once the checkpoint before it is home and it is 10-35 steps past it."""
    s = rank0_step(run_dir)
    if s is None or s < EVERY or not 10 <= s % EVERY <= 35:
        return None
    home = {int(p.name[5:13]) for p in copies(run_dir)}
    return s if s // EVERY * EVERY in home else None


def journal(run_dir: Path, attempt: int) -> list[tuple[float, int]]:
    """Rank 0's steps as they arrived (runs/RUN/progress/steps-aK.jsonl; none: [])."""
    p = run_dir / "progress" / f"steps-a{attempt}.jsonl"
    lines = p.read_text().splitlines() if p.exists() else []
    return sorted((d["at"], d["step"]) for d in map(json.loads, lines) if "step" in d and d.get("from") != "hook")


def test_goodput_of_a_run_with_a_restart_matches_its_story(make_cluster, tmp_path, home):
    cluster = make_cluster(4, gpus=0)
    inv = inventory(cluster, tmp_path, 1000, "--ckpt-every", str(EVERY))
    proc = start(inv)
    try:
        run_dir = run_dir_of(home)
        cut_at = wait_for(lambda: between_checkpoints(run_dir) or (proc.poll() is not None and pytest.fail(
            f"the run ended first:\n{proc.stderr.read()[-3000:]}")), 300, "a step between two checkpoints")
        cluster.nodes[1].link_down()
        out, err = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    rec = json.loads((run_dir / "run.json").read_text())
    a1, a2 = rec["attempts"]
    assert a1["verdict"] == "node lost" and a2["nodes"][1] == cluster.nodes[3].name, rec["attempts"]

    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "goodput", rec["id"], "--json"], capture_output=True,
                       text=True, timeout=120, env=os.environ.copy())
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["wall_s"] == pytest.approx(rec["ended"] - rec["created"], abs=0.05)
    assert doc["productive_s"] + sum(doc["badput"].values()) == pytest.approx(doc["wall_s"], rel=0.05)
    d1, d2 = doc["attempts"]

    # detection: node2 last heard (the story's loss line less the silence it measured; or the job's last
    # step after that, which needed node2) -> the loss declared, at the line's own time
    lost = next(json.loads(ln) for ln in (run_dir / "story.jsonl").read_text().splitlines()
                if json.loads(ln).get("lost") == "node2")
    heard = lost["at"] - lost["silent_s"]
    stepped = [t for t, _ in journal(run_dir, 1) if heard < t <= lost["at"]]
    fault = stepped[-1] if stepped else heard
    assert d1["declared_at"] == pytest.approx(lost["at"], abs=1e-3)
    assert d1["fault_at"] == pytest.approx(fault, abs=1e-3)
    assert doc["badput"]["detection_s"] == pytest.approx(lost["at"] - fault, abs=0.02)
    assert doc["badput"]["detection_s"] > 0

    # restore: the loss declared -> attempt 2's launch (its record)
    assert doc["badput"]["restore_s"] == pytest.approx(a2["launched"] - lost["at"], abs=0.02)
    assert doc["badput"]["restore_s"] > 0

    # recompute: attempt 2 restarted at its checkpoint's step, below the step attempt 1 had reached
    start_step = int(a2["checkpoint"][5:13])
    assert d2["start_step"] == start_step and start_step % EVERY == 0
    reached = d1["reached_step"]
    assert reached is not None and reached >= cut_at - 1 > start_step, (reached, cut_at, start_step, doc["notes"])
    assert doc["badput"]["recompute_s"] == pytest.approx((reached - start_step) * d1["step_s"], abs=0.02)
    assert doc["badput"]["recompute_s"] > 0

    # the end of the run says it in one line, with its largest causes
    line = next(ln for ln in err.splitlines() if ln.startswith("clusterctl: goodput "))
    assert f"goodput {doc['goodput']:.2f}" in line and "badput" in line
