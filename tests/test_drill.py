"""`clusterctl drill`'s pure parts (the faults flag, the plan with its spares, each fault's figures,
the goodput estimate, the report and its schema), its node-side hands (remote/drill.py) on real
local processes found by their run key, and its user errors. The drill on a cluster:
tests/test_drill_cluster.py."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from orchestrator import probe
from orchestrator.runs.drillreport import Outcome, Report, goodput_at, line, parse_faults, plan
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "orchestrator" / "schemas" / "drill.json").read_text())


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


# ---------------------------------------------------------------- the faults flag and the plan
def test_faults_keep_their_order_once_each_and_a_wrong_one_is_named():
    assert parse_faults("hang, kill,hang") == ("hang", "kill")
    assert parse_faults("KILL") == ("kill",)
    with pytest.raises(ValueError, match=r"'boom': the faults are kill, hang, lost, straggler"):
        parse_faults("kill,boom")
    with pytest.raises(ValueError, match="nothing"):
        parse_faults(" , ")


def test_each_hang_or_lost_takes_a_spare_and_one_without_is_skipped_with_the_reason():
    got = plan(("kill", "hang", "lost", "straggler"), workers=3, spares=1)
    assert [(p.fault, p.skip is None) for p in got] == [("kill", True), ("hang", True), ("lost", False),
                                                       ("straggler", True)]
    assert "no spare left for it (the inventory has 1" in got[2].skip and "spare: true" in got[2].skip
    assert all(p.skip is None for p in plan(("hang", "lost"), workers=3, spares=2))
    one = plan(("kill",), workers=1, spares=3)
    assert one[0].skip.startswith("the run has one node")


# ---------------------------------------------------------------- one fault's figures
def fault(**kw):
    base = dict(fault="kill", node="node3", rank=5, attempt=1, injected_at=100.0, declared_at=102.0,
                detected_by="killed by signal", culprit_node="node3", culprit_rank=5, recovered_at=112.0,
                steps_redone=10, step_s=0.5)
    base.update(kw)
    return Outcome(**base)


def test_a_fault_costs_injection_to_the_next_first_step_plus_its_steps_redone_at_the_pace():
    o = fault()
    assert (o.detected_s, o.relaunch_s, o.lost_s) == (2.0, 10.0, 17.0)
    assert o.ok and o.named_right
    hour, day = goodput_at(o.lost_s)
    assert hour == pytest.approx(1 - 17 / 3600) and day == pytest.approx(1 - 17 / 86400)
    assert goodput_at(None) == (None, None) and goodput_at(10 * 3600)[0] == 0.0
    assert line(o) == ("kill (rank 5 on node3): detected after 2.0s as killed by signal; named node3/rank 5 (right); "
                       "relaunch 10.0s; steps redone 10; time lost 17.0s; goodput at one per hour 0.995, per day 0.9998")


def test_a_wrong_culprit_a_missed_detection_or_no_recovery_is_not_ok():
    wrong_rank = fault(culprit_rank=4)
    assert not wrong_rank.named_right and not wrong_rank.ok
    assert "named node3/rank 4 (WRONG: injected rank 5 on node3)" in line(wrong_rank)
    assert not fault(culprit_node="node2").ok
    assert not fault(culprit_rank=None).named_right  # a kill or a hang names the rank too
    assert fault(fault="lost", culprit_rank=None).named_right  # a lost node is named by its node
    assert fault(fault="lost", culprit_rank=3).named_right  # ...whichever of its ranks the watch saw first
    missed = fault(declared_at=None, culprit_node=None, notes=["no verdict on attempt 1 within 300s"])
    assert not missed.ok and line(missed) == "kill (rank 5 on node3): NOT detected (no verdict on attempt 1 within 300s)"
    stuck = fault(recovered_at=None)
    assert not stuck.ok and stuck.lost_s is None and "NOT recovered" in line(stuck)
    skipped = Outcome("hang", skip="no spare left for it")
    assert not skipped.ok and line(skipped) == "hang: skipped: no spare left for it"


def test_a_straggler_costs_its_ledger_slowdown_and_has_no_relaunch():
    o = fault(fault="straggler", detected_by="straggler", recovered_at=170.0, steps_redone=None, straggler_s=6.0)
    assert o.relaunch_s is None and o.lost_s == 6.0 and o.ok
    assert "relaunch" not in line(o) and "time lost 6.0s" in line(o)


def test_the_report_matches_its_schema_and_anything_left_fails_it():
    r = Report("drill-1", [fault(), Outcome("lost", skip="no spare")], settings=["--max-restarts 1"])
    doc = r.to_json()
    jsonschema.validate(doc, SCHEMA)
    assert doc["faults"][0]["lost_s"] == 17.0 and doc["faults"][1]["named_right"] is None
    assert not r.ok  # a skipped fault is not one recovered from
    good = Report("drill-1", [fault()])
    assert good.ok
    good.left = {"node2": [123]}
    assert not good.ok
    jsonschema.validate(good.to_json(), SCHEMA)
    with pytest.raises(jsonschema.ValidationError):  # the schema's check is not vacuous
        jsonschema.validate(dict(doc, faults=[dict(doc["faults"][0], fault="flood")]), SCHEMA)


# ---------------------------------------------------------------- the node side: found by run key
@pytest.fixture
def marked():
    """Run `r1`'s attempt 2 on node n: rank 3 (asleep), a torchrun-like process (no RANK) and rank 4
    (computing, busy on a core); and rank 3 of another run, r10, which is never the drill's."""
    def start(key, rank=None, code="import time; time.sleep(60)"):
        env = {**os.environ, "CLUSTERCTL_RUN_KEY": key}
        env.pop("RANK", None)
        if rank is not None:
            env["RANK"] = str(rank)
        return subprocess.Popen([sys.executable, "-c", code], env=env)

    procs = [start("r1.a2@n", 3), start("r1.a2@n"), start("r10@n", 3),
             start("r1.a2@n", 4, "import time\nend = time.time() + 60\nwhile time.time() < end: pass")]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def agent_line(*args):
    """A process whose command line is the node agent's as the node code starts it (`PYTHON -c BOOT
    CODE node_agent ARGS`), sleeping in place of the boot."""
    return [sys.executable, "-c", "import time; time.sleep(60)", str(probe.local_code()), "node_agent", *args]


def drill_program(*args):
    r = subprocess.run(probe.local_argv("drill", *args), stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.decode().splitlines()[-1])


def state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_ranks_are_found_by_the_run_key_and_stopped_and_let_go_by_it(marked):
    rank3, launcher, other, busy = marked
    assert drill_program("ranks", "r1.a2@n") == {"ranks": {"3": [rank3.pid], "4": [busy.pid]}}
    assert drill_program("signal", "r1.a2@n", str(int(signal.SIGSTOP)), "3") == {"pids": [rank3.pid]}
    assert state(rank3.pid) == "T" and state(other.pid) != "T"
    # the node agent's log stream of the attempt carries no marker: found by its verb and key
    stream = subprocess.Popen(agent_line("tail", "r1.a2@n", "0", "stream"))
    other_stream = subprocess.Popen(agent_line("tail", "r10@n", "0", "stream"))
    try:
        frozen = drill_program("freeze", "r1.a2@n")["pids"]
        assert sorted(frozen) == sorted([rank3.pid, launcher.pid, busy.pid, stream.pid])
        # a SIGSTOP lands a moment after kill() returns: a process on a busy core reads R until then
        assert wait_for(lambda: state(launcher.pid) == "T", 10, "the launcher stopped")
        assert wait_for(lambda: state(stream.pid) == "T", 10, "the stream stopped") and state(other_stream.pid) != "T"
        drill_program("thaw", "r1.a2@n")
        assert state(rank3.pid) != "T" and state(launcher.pid) != "T" and state(stream.pid) != "T"
    finally:
        for p in (stream, other_stream):
            p.kill()
            p.wait()
    left = drill_program("left", "r1")["pids"]
    assert sorted(left) == sorted([rank3.pid, launcher.pid, busy.pid])  # any attempt of r1; never r10's
    assert drill_program("signal", "r1.a2@n", str(int(signal.SIGKILL)), "3", "top") == {"pids": [rank3.pid]}
    rank3.wait(10)
    assert drill_program("ranks", "r1.a2@n") == {"ranks": {"4": [busy.pid]}}


def test_a_throttle_stops_a_computing_rank_in_turn_and_ends_with_it_running(marked):
    busy = marked[3]
    got = drill_program("throttle", "r1.a2@n", "4", "1.0", "0.2", "0.1")
    assert got["cycles"] >= 1 and state(busy.pid) != "T"
    asleep = drill_program("throttle", "r1.a2@n", "3", "1.0", "0.2", "0.1")  # never computing: never stopped
    assert asleep == {"cycles": 0}
    # ended by SIGTERM (the drill's connection closed, a stop) while the rank is stopped: it runs again
    p = subprocess.Popen(probe.local_argv("drill", "throttle", "r1.a2@n", "4", "60", "30", "0.1"),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while state(busy.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state(busy.pid) == "T"
    p.terminate()
    assert json.loads(p.stdout.read().decode().splitlines()[-1]) == {"cycles": 0}
    p.wait(10)
    assert state(busy.pid) != "T"


# ---------------------------------------------------------------- user errors
def test_user_errors_end_in_one_paragraph_and_exit_2_without_a_traceback(tmp_path):
    r = cli("drill", "-i", "x.yaml", "--faults", "kill,flood")
    assert r.returncode == 2 and "'flood': the faults are kill, hang, lost, straggler" in r.stderr
    assert "Traceback" not in r.stderr
    r = cli("drill", "--faults", "kill", env={"CLUSTERCTL_INVENTORY": ""})
    assert r.returncode == 2 and "give its inventory, clusterctl drill -i nodes.yaml" in r.stderr
    assert "Traceback" not in r.stderr
    r = cli("drill", "-i", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_a_cluster_that_cannot_recover_from_any_chosen_fault_starts_nothing(tmp_path):
    inv = tmp_path / "nodes.yaml"
    inv.write_text("nodes:\n  - {name: a, connection: local, gpus: 0}\n  - {name: b, connection: local, gpus: 0}\n")
    home = tmp_path / "home"
    r = cli("drill", "-i", str(inv), "--faults", "hang,lost", env={"CLUSTERCTL_HOME": str(home)})
    assert r.returncode == 1, r.stderr
    assert "drill: hang: skipped: no spare left for it (the inventory has 0" in r.stdout
    assert "nothing was started" in r.stdout and "Traceback" not in r.stderr
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())


def test_a_train_that_does_not_return_ends_the_drill_in_one_paragraph(monkeypatch, capsys):
    """`train --detach` stuck past the drill's wait: a message and exit 1, never TimeoutExpired's traceback."""
    from orchestrator.cli import drill

    monkeypatch.setattr(drill, "START_WAIT_S", 0.5)
    run_id, rc = drill._start([sys.executable, "-c", "import time; time.sleep(30)"])
    assert (run_id, rc) == (None, 1)
    err = capsys.readouterr().err
    assert "did not return within 0 s" in err or "did not return within 1 s" in err
    assert "clusterctl stop RUN" in err
