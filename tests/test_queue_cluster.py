"""The queue and everyone's runs, on the real test cluster: `train --queue` runs wait for the
nodes' claims and start one after the other, `runs --cluster` shows a run from another control
machine (another CLUSTERCTL_HOME), and `stop` takes a queued run out of the queue."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import pid_ended, wait_for
from tests.test_train_cluster import DDP, wait_clean, prepare, rec_of

pytestmark = pytest.mark.cluster


SCHEMAS = Path(__file__).resolve().parent.parent / "orchestrator" / "schemas"


def schema(name):
    return json.loads((SCHEMAS / f"{name}.json").read_text())


def cli(*args, home, timeout=180):
    env = dict(os.environ, CLUSTERCTL_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def queued_train(inv, home, *script, extra=("--queue",)):
    r = cli("train", "-i", inv, "--skip-preflight", "--detach", *extra, "--", DDP, *script, home=home)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def state(home, run_id):
    return rec_of(home / "runs" / run_id).get("state")


def test_two_queued_runs_on_the_same_nodes_run_one_after_the_other(make_cluster, tmp_path, home):
    cluster = make_cluster(2, gpus=0)
    inv = prepare(cluster, tmp_path)
    first = queued_train(inv, home, "--steps", "4", "--sleep", "0.5")
    second = queued_train(inv, home, "--steps", "2")
    # queued is recorded before the supervisor has asked the nodes; waiting_for follows
    wait_for(lambda: state(home, second) == "queued" and state(home, first) in ("launching", "running")
             and first in (rec_of(home / "runs" / second).get("waiting_for") or ""), 30,
             "the second run queued behind the first while the first holds the nodes")
    wait_for(lambda: state(home, second) in ("finished", "failed", "stopped"), 240, "the second run to end")
    a, b = rec_of(home / "runs" / first), rec_of(home / "runs" / second)
    assert (a["state"], b["state"]) == ("finished", "finished"), (a, b)
    # one after the other, by the records: the second launched after torchrun had ended on every
    # node of the first (the nodes' own end times), and promptly after the first run's recorded end:
    # the queue looks every second, then the second run's launch (claims, directories, torchrun on
    # both nodes) takes a few seconds on this shared 2-core machine
    assert max(n["node_ended"] for n in a["nodes"]) < b["started"], (a["nodes"], b["started"])
    assert b["started"] - a["ended"] < 10, (a["ended"], b["started"])
    wait_clean(cluster, 15, "clean")


def test_a_run_from_another_control_machine_shows_in_runs_cluster(make_cluster, tmp_path, home):
    cluster = make_cluster(2, gpus=0)
    inv = prepare(cluster, tmp_path)
    other = tmp_path / "other-control-home"
    theirs = queued_train(inv, other, "--steps", "200", "--sleep", "0.5", extra=())
    wait_for(lambda: state(other, theirs) == "running", 60, "their run running")
    r = cli("runs", "-i", inv, "--cluster", "--json", home=home)
    assert r.returncode == 0, r.stderr
    held = json.loads(r.stdout)
    jsonschema.validate(held, schema("runs"))
    assert [d["run"] for d in held] == [theirs], held
    assert sorted(held[0]["nodes"]) == sorted(n.name for n in cluster.nodes)
    assert "@" in held[0]["who"] and held[0]["since"] > 0
    assert not (home / "runs").exists() or theirs not in os.listdir(home / "runs")  # not from this home's records
    assert cli("stop", theirs, home=other).returncode == 0
    r = cli("runs", "-i", inv, "--cluster", "--json", home=home)
    assert (r.returncode, json.loads(r.stdout)) == (0, []), r.stderr
    wait_clean(cluster, 15, "clean")


def test_stop_of_a_queued_run_removes_it_from_the_queue(make_cluster, tmp_path, home):
    cluster = make_cluster(2, gpus=0)
    inv = prepare(cluster, tmp_path)
    holder = queued_train(inv, home, "--steps", "200", "--sleep", "0.5", extra=())
    waiting = queued_train(inv, home, "--steps", "1")
    wait_for(lambda: state(home, waiting) == "queued", 30, "the second run queued")
    q = cli("queue", "--json", home=home)
    assert q.returncode == 0, q.stderr
    jsonschema.validate(json.loads(q.stdout), schema("queue"))
    rows = {d["id"]: d for d in json.loads(q.stdout)}
    assert rows[waiting]["state"] == "queued" and holder in rows[waiting]["waiting_for"], rows
    s = cli("stop", waiting, home=home, timeout=60)
    assert s.returncode == 0, s.stderr
    rec = rec_of(home / "runs" / waiting)
    assert rec["state"] == "stopped" and not rec.get("started"), rec  # it never launched
    q = cli("queue", "--json", home=home)
    assert [d["id"] for d in json.loads(q.stdout)] == [holder]
    # the run it waited for is untouched: it goes on to run (detached, it may still be launching
    # under load, the suite's other worker training on the same cores)
    wait_for(lambda: state(home, holder) == "running", 60, "the holder running")
    gives_up = queued_train(inv, home, "--steps", "1", extra=("--queue", "--queue-timeout", "2"))
    wait_for(lambda: state(home, gives_up) == "failed", 30, "the queue timeout")
    assert "--queue-timeout 2s" in rec_of(home / "runs" / gives_up)["error"]
    assert cli("stop", holder, home=home).returncode == 0
    wait_clean(cluster, 15, "clean")


def test_a_queued_run_whose_supervisor_died_is_adopted_and_still_runs(make_cluster, tmp_path, home):
    cluster = make_cluster(2, gpus=0)
    inv = prepare(cluster, tmp_path)
    holder = queued_train(inv, home, "--steps", "200", "--sleep", "0.5", extra=())
    waiting = queued_train(inv, home, "--steps", "2")
    wait_for(lambda: state(home, waiting) == "queued" and state(home, holder) == "running", 60, "queued behind")
    pid = rec_of(home / "runs" / waiting)["supervisor_pid"]
    os.kill(pid, 9)
    wait_for(lambda: pid_ended(pid), 10, "the queued run's supervisor dead")

    def adopted():  # status notices the dead supervisor (once the run is 10 s old) and starts one that adopts
        r = cli("status", waiting, "--json", home=home)
        assert r.returncode == 0, r.stderr
        return rec_of(home / "runs" / waiting).get("supervisor_pid") not in (None, pid)

    wait_for(adopted, 40, "a new supervisor", interval=1.0)
    assert state(home, waiting) == "queued"  # still waiting: it was not failed for dying while queued
    assert cli("stop", holder, home=home, timeout=60).returncode == 0
    wait_for(lambda: state(home, waiting) in ("finished", "failed", "stopped"), 120, "the adopted run to end")
    rec = rec_of(home / "runs" / waiting)
    assert rec["state"] == "finished" and rec.get("adopted_at"), rec
    wait_clean(cluster, 15, "clean")
