"""The node side of resilience, with the node agent run locally as it is shipped: no orphan outlives
torchrun, a stop request left on the node is carried out, claims are atomic, the stop grace covers
a checkpoint."""

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

from orchestrator.runs.policy import MAX_GRACE, stop_grace
from tests.test_node_agent import agent, pids_with, rundir, start, wait_for  # noqa: F401 - fixture

# torchrun's stand-in: a worker in its own session (out of the process group), which ignores
# SIGTERM; then the parent waits forever
ORPHANING = """
import os, signal, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "time.sleep(600)"], start_new_session=True)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_killed_torchrun_leaves_no_worker_behind(agent):
    info = start(agent, "o1@n1", ORPHANING)
    d = rundir(agent, "o1@n1")
    assert wait_for(lambda: b"ready" in (d / "log").read_bytes() and len(pids_with("o1@n1")) == 2)
    os.kill(info["pid"], signal.SIGKILL)  # nobody asks the agent: the waiter acts on its own
    assert wait_for(lambda: pids_with("o1@n1") == [], 10)
    assert wait_for(lambda: (d / "exit_code").exists())
    assert (d / "exit_code").read_text() == "137"
    ended = float((d / "ended").read_text())
    assert ended <= os.path.getmtime(d / "exit_code")  # the end time is torchrun's, not the cleanup's


def test_a_stop_request_left_on_the_node_is_carried_out_by_the_waiter(agent):
    start(agent, "rm1@n1", ORPHANING)
    d = rundir(agent, "rm1@n1")
    assert wait_for(lambda: b"ready" in (d / "log").read_bytes() and len(pids_with("rm1@n1")) == 2)
    # what a `stop` writes first; here its connection "dropped" before it signalled anything
    (d / "stop").write_text(json.dumps({"grace": 0.5, "at": time.time()}))
    assert wait_for(lambda: pids_with("rm1@n1") == [], 15)
    assert wait_for(lambda: (d / "exit_code").exists())
    st = json.loads(agent("status", "rm1@n1").stdout)
    assert st["stop_requested"] and st["alive"] == 0 and st["exit_code"] is not None


def test_of_many_simultaneous_claims_exactly_one_wins(agent):
    with ThreadPoolExecutor(8) as ex:
        docs = list(ex.map(lambda i: json.loads(agent("claim", "n1", f"run{i}@n1", f"u{i}@ctl").stdout), range(8)))
    winners = [d for d in docs if d["ok"]]
    assert len(winners) == 1
    holder = winners[0]
    for d in docs:  # every loser names the holder: run, who, since
        assert (d["run"], d["who"], d["since"]) == (holder["run"], holder["who"], holder["since"])
    assert json.loads(agent("claim", "n1", holder["key"], "x@y").stdout)["ok"]  # its own claim again
    assert json.loads(agent("release", "n1", "someone-else@n1").stdout) == {"released": False}
    assert json.loads(agent("release", "n1", holder["key"]).stdout) == {"released": True}
    assert json.loads(agent("claim", "n1", "next@n1", "u@ctl").stdout)["ok"]


def test_a_claim_of_a_run_that_ended_on_the_node_is_stale(agent):
    claimed = time.time()  # a run's claim is taken before it starts there
    start(agent, "done@n1", "print('bye')")
    assert wait_for(lambda: (rundir(agent, "done@n1") / "exit_code").exists())
    claims = agent.home / ".clusterctl" / "claims"
    claims.mkdir(parents=True, exist_ok=True)
    (claims / "n1").write_text(json.dumps({"run": "done", "key": "done@n1", "who": "u@c", "since": claimed}))
    assert json.loads(agent("claim", "n1", "new@n1", "u@ctl").stdout)["ok"]
    # a fresh claim whose run has not started yet is not stale: launch is on its way
    assert not json.loads(agent("claim", "n1", "third@n1", "u@ctl").stdout)["ok"]


def test_a_restarted_attempt_keeps_its_runs_claim(agent):
    """Attempt 2 of run r runs under r.a2@n1; the claim r@n1 is its run's and must not look stale."""
    start(agent, "r@n1", "print('attempt 1 ended')")
    assert wait_for(lambda: (rundir(agent, "r@n1") / "exit_code").exists())
    assert json.loads(agent("claim", "n1", "r@n1", "u@ctl").stdout)["ok"]
    start(agent, "r.a2@n1", "import time; print('up', flush=True); time.sleep(60)")
    assert wait_for(lambda: len(pids_with("r.a2@n1")) >= 1)
    try:
        refused = json.loads(agent("claim", "n1", "rother@n1", "u@ctl").stdout)
        assert not refused["ok"] and refused["run"] == "r", refused
    finally:
        agent("stop", "r.a2@n1", "0")


def test_the_stop_grace_covers_twice_the_last_checkpoint_save(agent):
    assert stop_grace(5, 0) == 5 and stop_grace(5, 7) == 14 and stop_grace(5, 1000) == MAX_GRACE
    assert stop_grace(600, 1000) == 600  # a longer grace asked for is kept
    code = ("import signal, sys, time\n"
            "def checkpoint(*_):\n"
            "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "    time.sleep(1.5)\n"
            "    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, checkpoint)\n"
            "print('ready', flush=True)\n"
            "time.sleep(600)\n")
    start(agent, "g1@n1", code)
    d = rundir(agent, "g1@n1")
    assert wait_for(lambda: b"ready" in (d / "log").read_bytes())
    (d / "save_seconds").write_text("1.0\n")  # what trainer/checkpoint.py leaves after a save
    r = agent("stop", "g1@n1", 0.2)  # 0.2 s alone would SIGKILL the 1.5 s "checkpoint"
    assert json.loads(r.stdout) == {"left": 0}
    assert (d / "exit_code").read_text() == "0"
    assert json.loads((d / "stop").read_text())["grace"] == 2.0
