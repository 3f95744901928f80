"""runs/nodefaults.py: each node's record across runs, what is attributed to a node and what is not,
and the quarantine it leads to. Three runs losing a node on the test cluster: test_nodefaults_cluster.py."""

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from orchestrator.inventory import parse_inventory
from orchestrator.cli import health
from orchestrator.observe.metrics import RunsCollector, node_samples
from orchestrator.runs import nodefaults, quarantine
from orchestrator.runs.restart import Outcome, Verdict, classify

pytestmark = pytest.mark.usefixtures("home")

TEXT = ("nodes:\n  - {name: n1, host: 10.0.0.1}\n  - {name: n2, host: 10.0.0.2}\n"
        "  - {name: n3, host: 10.0.0.3, spare: true}\n")
INV = parse_inventory(TEXT)
ROOT = Path(__file__).resolve().parent.parent


def told():
    out = []
    return out, out.append


def lost(k, run="run-a"):
    return Verdict(True, "node lost", "n2 lost", ("n2",), ("n2",))


def test_three_attributed_faults_within_the_window_quarantine_the_node_and_say_why():
    said, tell = told()
    for i, run in enumerate(("run-a", "run-b")):
        assert nodefaults.attribute(INV, run, 1, "lost", {"n2": "n2 lost"}, tell) == []
    assert quarantine.of(INV.nodes) == {} and said == []
    assert nodefaults.attribute(INV, "run-c", 2, "killed", {"n2": "a worker was killed by signal 9"}, tell) == ["n2"]
    held = quarantine.of(INV.nodes)
    assert list(held) == ["n2"] and held["n2"].run == "run-c"
    assert held["n2"].reason == "3 faults within 24 h: lost (run-a), lost (run-b), killed (run-c)"
    assert len(said) == 1 and said[0].startswith("n2 quarantined: 3 faults within 24 h") and \
        "clusterctl health --release n2" in said[0]
    # n1 was never named: nothing against it
    assert nodefaults.of(INV.node("n1"), nodefaults.load()) == []


def test_a_fault_is_recorded_once_per_run_attempt_node_and_kind():
    f = nodefaults.Fault("n2", "10.0.0.2", "lost", "run-a", 1, time.time())
    assert nodefaults.record([f, f]) == [f]
    assert nodefaults.record([f]) == []  # an adopted run recording its verdict again
    assert len(nodefaults.load()) == 1
    g = nodefaults.Fault("n2", "10.0.0.2", "lost", "run-a", 2, time.time())
    assert nodefaults.record([g]) == [g]


def test_faults_outside_the_window_or_before_a_release_or_of_another_host_do_not_count():
    now = time.time()
    old = nodefaults.Fault("n2", "10.0.0.2", "lost", "run-old", 1, now - 2 * 86400)
    other = nodefaults.Fault("n2", "10.9.9.9", "lost", "run-x", 1, now)
    mine = nodefaults.Fault("n2", "10.0.0.2", "hung", "run-y", 1, now - 10)
    nodefaults.record([old, other, mine])
    n2 = INV.node("n2")
    assert nodefaults.counted(n2, nodefaults.load(), 86400, now) == [mine]
    assert nodefaults.counted(n2, nodefaults.load(), 3 * 86400, now) == [old, mine]
    quarantine.add([n2], {"n2": "why"}, "run-y")
    nodefaults.released(quarantine.release([n2]))
    later = nodefaults.Fault("n2", "10.0.0.2", "lost", "run-z", 1, time.time() + 1)
    nodefaults.record([later])
    assert nodefaults.counted(n2, nodefaults.load(), 3 * 86400, time.time() + 2) == [later]


def test_quarantine_after_zero_never_quarantines_and_the_window_is_the_inventorys():
    never = parse_inventory(TEXT + "train: {quarantine_after: 0}\n")
    for run in ("a", "b", "c", "d"):
        assert nodefaults.attribute(never, run, 1, "lost", {"n2": ""}, print) == []
    assert len(nodefaults.load()) == 4 and quarantine.of(never.nodes) == {}
    short = parse_inventory(TEXT + "train: {quarantine_after: 2, quarantine_window: 3600}\n")
    said, tell = told()
    assert nodefaults.attribute(short, "e", 1, "hung", {"n1": ""}, tell) == []
    assert nodefaults.attribute(short, "f", 1, "straggled", {"n1": ""}, tell) == ["n1"]
    assert "2 faults within 1 h: hung (e), straggled (f)" in said[0] and "quarantine_after 2" in said[0]
    assert nodefaults.attribute(short, "g", 1, "lost", {"n2": ""}, tell, quarantine_on=False) == []  # --allow-unhealthy


def test_only_a_fault_of_the_nodes_is_attributed_never_the_scripts():
    root = Outcome("n1", "failed", 1, "Traceback\nValueError: bad batch\n")
    script = classify([root, Outcome("n2", "failed", 1, "")], "n1")
    assert script.cause == "script error" and script.culprits == ()
    peer = classify([Outcome("n1", "failed", 1, "RuntimeError: Connection reset by peer\n"),
                     Outcome("n2", "failed", 1, "")], "n1")
    assert peer.cause == "peer failure" and peer.culprits == ()
    listed = classify([Outcome("n1", "failed", 3, "")], "n1", exit_codes=(3,))
    assert listed.cause == "exit code" and listed.culprits == ()
    killed = classify([Outcome("n1", "failed", -9, "")], "n1")
    assert killed.cause == "killed by signal" and killed.culprits == ("n1",)
    gone = classify([Outcome("n1", "failed", 1, ""), Outcome("n2", "lost", None, "")], "n2")
    assert gone.culprits == ("n2",) and gone.bad_nodes == ("n2",)
    for v in (script, peer, listed):
        assert nodefaults.of_verdict(INV, "run-s", 1, ["n1", "n2"], v, print, True, lambda: ["n3"]) is v
    assert nodefaults.load() == []


def test_a_node_quarantined_by_this_attempt_is_left_out_of_the_next_when_a_spare_can_take_its_place():
    for run in ("a", "b"):
        nodefaults.attribute(INV, run, 1, "killed", {"n1": ""}, print)
    v = Verdict(True, "killed by signal", "n1: a worker was killed by signal 9", culprits=("n1",))
    said, tell = told()
    got = nodefaults.of_verdict(INV, "run-c", 1, ["n1", "n2"], v, tell, True, lambda: ["n3"])
    assert got.bad_nodes == ("n1",) and got.retry
    # with no spare the run keeps it this time, and says so
    nodefaults.released(quarantine.release([INV.node("n1")]))
    for run in ("d", "e"):
        nodefaults.attribute(INV, run, 1, "killed", {"n1": ""}, print)
    said, tell = told()
    got = nodefaults.of_verdict(INV, "run-f", 1, ["n1", "n2"], v, tell, True, lambda: [])
    assert got.bad_nodes == () and any("n1 stays in this run's next attempt" in s for s in said), said


def test_a_damaged_line_is_skipped():
    nodefaults.record([nodefaults.Fault("n2", "10.0.0.2", "lost", "run-a", 1, time.time())])
    with open(nodefaults.path(), "a") as f:
        f.write("{not json\n" + json.dumps({"node": "n2"}) + "\n")
    assert [f.run for f in nodefaults.load()] == ["run-a"]


APPEND = """
import sys, time
from orchestrator.runs import nodefaults
for i in range(int(sys.argv[1]), 40, 4):
    nodefaults.record([nodefaults.Fault("n2", "10.0.0.2", "lost", f"run-{i}", 1, time.time())])
"""


def test_runs_ending_at_once_lose_no_line():
    # separate interpreters, not a fork of this (threaded) test process: a fork taken while
    # another thread holds a lock hangs the child (it did in CI)
    procs = [subprocess.Popen([sys.executable, "-c", APPEND, str(k)], cwd=ROOT) for k in range(4)]
    assert [p.wait(timeout=60) for p in procs] == [0] * 4
    assert sorted(f.run for f in nodefaults.load()) == sorted(f"run-{i}" for i in range(40))


def test_the_exporter_serves_each_nodes_faults_and_quarantine(home):
    (home / "runs").mkdir(parents=True, exist_ok=True)
    for run in ("a", "b", "c"):
        nodefaults.attribute(INV, run, 1, "lost", {"n2": ""}, print)
    nodefaults.attribute(INV, "d", 1, "hung", {"n1": ""}, print)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(RunsCollector(home / "runs"))
    text = generate_latest(reg).decode()
    assert 'clusterctl_node_faults_total{host="10.0.0.2",kind="lost",node="n2"} 3.0' in text, text
    assert 'clusterctl_node_faults_total{host="10.0.0.1",kind="hung",node="n1"} 1.0' in text
    assert 'clusterctl_node_quarantined{host="10.0.0.2",node="n2"} 1.0' in text
    assert "clusterctl_node_quarantined{" + 'host="10.0.0.1"' not in text


def test_a_full_control_disk_costs_the_record_not_the_run(monkeypatch):
    import errno

    def no_room(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(nodefaults, "record", no_room)
    said, tell = told()
    v = Verdict(True, "killed by signal", "n1: a worker was killed by signal 9", culprits=("n1",))
    assert nodefaults.of_verdict(INV, "run-a", 1, ["n1", "n2"], v, tell, True, lambda: ["n3"]) is v
    assert len(said) == 1 and "could not be written: [Errno 28] No space left on device" in said[0], said
    nodefaults.health(INV, "run-a", 1, {"n2": "gpu_health: GPU 0: Xid 79"})  # raises nothing


DAY = 86400.0


def _write(faults):
    nodefaults.path().parent.mkdir(parents=True, exist_ok=True)
    nodefaults.path().write_text("".join(json.dumps(dataclasses.asdict(f)) + "\n" for f in faults))


def _counts():
    return sorted(s for s in node_samples(nodefaults.path().parent) if s[0] == "clusterctl_node_faults")


def test_faults_past_the_horizon_fold_into_tallies_that_keep_every_count_and_the_release():
    now = time.time()
    F = nodefaults.Fault
    old = [F("n2", "10.0.0.2", "lost", f"run-{i}", 1, now - (10 + i) * DAY) for i in range(3)]
    old_hung = F("n1", "10.0.0.1", "hung", "run-h", 1, now - 9 * DAY)
    old_release = F("n2", "10.0.0.2", nodefaults.RELEASED, "run-2", 0, now - 9 * DAY)
    recent = [F("n2", "10.0.0.2", "lost", "run-r", 1, now - 3600), F("n1", "10.0.0.1", "killed", "run-k", 1, now - 7200)]
    release = F("n1", "10.0.0.1", nodefaults.RELEASED, "", 0, now - 3000)
    _write(old + [old_hung, old_release] + recent + [release])
    before = _counts()
    counted = {n.name: nodefaults.counted(n, nodefaults.load(), 3 * DAY, now) for n in INV.nodes}
    ino = nodefaults.path().stat().st_ino
    new = F("n2", "10.0.0.2", "hung", "run-n", 1, now)
    assert nodefaults.record([new]) == [new]
    kept = nodefaults.load()
    assert nodefaults.path().stat().st_ino != ino  # rewritten by a rename, not in place
    assert [(f.node, f.kind, f.tally) for f in kept if f.tally] == [("n2", "lost", 3), ("n1", "hung", 1)]
    assert kept[0].at == old[0].at and kept[1].at == old_hung.at  # a tally: up to its newest fault
    assert [f for f in kept if not f.tally] == recent + [release, new]  # the old release went, the new stays
    assert _counts() == sorted(before + [("clusterctl_node_faults", ("n2", "10.0.0.2", "hung"), 1)])
    for n in INV.nodes:  # the count toward a quarantine is the same (the new fault aside)
        assert [f for f in nodefaults.counted(n, kept, 3 * DAY, now) if f != new] == counted[n.name]
    assert counted["n1"] == []  # n1's killed fault came before its release
    assert kept[0].line().endswith("3 lost (older faults, counted together)")
    assert len(nodefaults.path().read_text().splitlines()) == 6


def test_the_record_is_rewritten_only_a_day_past_the_horizon_and_keeps_the_longest_window():
    now = time.time()
    F = nodefaults.Fault
    month = F("n1", "10.0.0.1", "lost", "run-m", 1, now - 20 * DAY, window=30 * DAY)
    week = F("n2", "10.0.0.2", "lost", "run-w", 1, now - 7.5 * DAY)
    _write([month, week])
    ino = nodefaults.path().stat().st_ino
    nodefaults.record([F("n2", "10.0.0.2", "hung", "run-a", 1, now)])
    assert nodefaults.path().stat().st_ino == ino and [f.tally for f in nodefaults.load()] == [0, 0, 0]
    _write([F("n2", "10.0.0.2", "lost", "run-w", 1, now - 9 * DAY)])
    nodefaults.record([F("n2", "10.0.0.2", "hung", "run-a", 1, now)])
    assert [f.tally for f in nodefaults.load()] == [1, 0]  # past 7 days and a day more: folded
    _write([month, F("n2", "10.0.0.2", "lost", "run-w", 1, now - 9 * DAY)])
    nodefaults.record([F("n2", "10.0.0.2", "hung", "run-a", 1, now)])
    assert [f.tally for f in nodefaults.load()] == [0, 0, 0]  # an inventory's 30-day window keeps them


def test_the_exporter_parses_the_record_again_only_when_it_changed():
    reader = nodefaults.Reader()
    assert reader.load() == [] and reader.parsed == 0
    nodefaults.attribute(INV, "a", 1, "lost", {"n2": ""}, print)
    assert len(reader.load()) == 1 and len(reader.load()) == 1 and reader.parsed == 1
    nodefaults.attribute(INV, "b", 1, "lost", {"n2": ""}, print)
    assert len(reader.load()) == 2 and reader.parsed == 2


def test_health_counts_a_tally_as_the_faults_it_stands_for(capsys):
    now = time.time()
    tally = nodefaults.Fault("n2", "10.0.0.2", "lost", "", 0, now - 10 * DAY, tally=7)
    singles = [nodefaults.Fault("n2", "10.0.0.2", "hung", f"run-{i}", 1, now - i) for i in range(5)]
    row = {"name": "n2", "faults": [dataclasses.asdict(f) for f in [tally] + singles], "faults_counted": 5}
    assert health._faults(row) == "lost 7, hung 5 (5 counted)"
    health._fault_lines([row])
    assert capsys.readouterr().out.startswith("n2 faults (and 7 earlier):\n")


def test_a_full_control_disk_costs_a_sick_nodes_quarantine_record_not_the_run(monkeypatch):
    import errno

    def no_room(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    sick = {"n2": "gpu_health: GPU 0: Xid 79"}
    monkeypatch.setattr(nodefaults, "record", no_room)
    monkeypatch.setattr(quarantine, "add", no_room)
    said, tell = told()
    assert nodefaults.quarantine_sick(INV, "run-a", 1, sick, tell, True) == sick  # still left out of this run
    assert len(said) == 1 and said[0].startswith("n2 not quarantined: the quarantine (") and \
        "[Errno 28] No space left on device; this run leaves it out" in said[0], said
    assert nodefaults.quarantine_sick(INV, "run-a", 1, sick, tell, False) == {}  # --allow-unhealthy

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(quarantine, "add", denied)  # not the disk's: the user's to see
    with pytest.raises(PermissionError):
        nodefaults.quarantine_sick(INV, "run-a", 1, sick, tell, True)


def test_a_sick_node_is_recorded_and_quarantined():
    said, tell = told()
    sick = {"n2": "gpu_health: GPU 0: Xid 79"}
    assert nodefaults.quarantine_sick(INV, "run-a", 1, sick, tell, True) == sick
    assert [f.kind for f in nodefaults.load()] == ["health"] and list(quarantine.of(INV.nodes)) == ["n2"]
    assert said == ["n2 quarantined: gpu_health: GPU 0: Xid 79 (no run from this machine uses it until "
                    "`clusterctl health --release n2`)"]


def test_a_fold_that_finds_no_room_leaves_the_record_whole_and_still_appends(monkeypatch):
    import errno

    now = time.time()
    old = nodefaults.Fault("n2", "10.0.0.2", "lost", "run-o", 1, now - 10 * DAY)
    _write([old])
    real = Path.write_text

    def no_room(self, *a, **k):
        if self.name.endswith(".tmp"):
            self.write_bytes(b'{"node": "n2", "ho')  # a torn start, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", no_room)
    new = nodefaults.Fault("n2", "10.0.0.2", "hung", "run-n", 1, now)
    assert nodefaults.record([new]) == [new]
    assert nodefaults.load() == [old, new] and not list(nodefaults.path().parent.glob("*.tmp"))
