"""The node agent, run locally exactly as a node runs it: the node code and its boot line
(probe.local_argv: `python -c BOOT CODE node_agent CMD ARGS`)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.probe import REMOTE, load, local_argv
from tests.conftest import wait_for

WAITER = load("agent_waiter")  # the node agent's modules, as the nodes run them
LINES = load("agent_lines")


@pytest.fixture
def agent(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path))

    def call(*args, timeout=30, text=True):
        r = subprocess.run(local_argv("node_agent", *map(str, args)), stdin=subprocess.DEVNULL, env=env,
                           capture_output=True, timeout=timeout)
        return r if not text else subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(),
                                                              r.stderr.decode())

    call.home = tmp_path
    call.env = env
    return call


def rundir(agent, key):
    return agent.home / ".clusterctl" / "node-runs" / key


def start(agent, key, code, env=None):
    spec = {"argv": [sys.executable, "-c", code], "cwd": str(agent.home), "env": env or {}}
    r = agent("start", key, json.dumps(spec).encode().hex())
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def pids_with(key):
    marker = f"CLUSTERCTL_RUN_KEY={key}".encode()
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and marker + b"\0" in (p / "environ").read_bytes() and \
                    (p / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(int(p.name))
        except OSError:
            pass
    return out


def test_start_records_the_run_and_its_exit_code(agent):
    info = start(agent, "a1@n1", "import os,sys; print('out', os.environ['CLUSTERCTL_RUN_ID'], "
                                 "os.environ['X']); print('err', file=sys.stderr); sys.exit(3)", env={"X": "y"})
    d = rundir(agent, "a1@n1")
    assert info["pid"] == info["pgid"] and info["waiter"] != info["pid"]
    assert wait_for(lambda: (d / "exit_code").exists())
    assert (d / "exit_code").read_text() == "3"
    assert sorted((d / "log").read_bytes().splitlines()) == [b"err", b"out a1 y"]
    st = json.loads(agent("status", "a1@n1").stdout)
    assert st["exit_code"] == 3 and st["alive"] == 0 and st["pid"] == info["pid"] and st["exists"]
    assert json.loads(agent("live").stdout) == []
    assert agent("start", "a1@n1", "7b7d").returncode != 0  # one run per key, never reused


def test_a_command_that_cannot_start_exits_127(agent):
    spec = {"argv": ["/nonexistent/python"], "cwd": str(agent.home), "env": {}}
    r = agent("start", "bad@n1", json.dumps(spec).encode().hex())
    assert r.returncode == 0
    assert (rundir(agent, "bad@n1") / "exit_code").read_text() == "127"
    assert b"cannot start" in (rundir(agent, "bad@n1") / "log").read_bytes()


def test_bad_run_ids_are_refused(agent):
    for key in ("../x", ".hidden", "a/b"):
        r = agent("status", key)
        assert r.returncode != 0 and "bad run id" in r.stderr


def test_tail_from_an_offset_follows_until_the_exit_and_every_byte_once(agent):
    code = "import time\nfor i in range(300):\n    print('line', i, flush=True)\n    time.sleep(0.002)\n"
    start(agent, "t1@n1", code)
    d = rundir(agent, "t1@n1")
    assert wait_for(lambda: (d / "log").exists() and (d / "log").stat().st_size > 50)
    first = agent("tail", "t1@n1", 0, text=False).stdout  # follows until the run ended
    assert (d / "exit_code").read_text() == "0"
    whole = (d / "log").read_bytes()
    assert first == whole and whole.count(b"\n") == 300
    for off in (1, 100, len(whole) - 5, len(whole)):
        assert agent("tail", "t1@n1", off, text=False).stdout == whole[off:]


def test_tail_ends_when_the_waiter_vanished_without_an_exit_code(agent):
    info = start(agent, "v1@n1", "import time; print('x', flush=True); time.sleep(1)")
    os.kill(info["waiter"], signal.SIGKILL)
    t0 = time.time()
    r = agent("tail", "v1@n1", 0, text=False, timeout=20)
    assert r.stdout == b"x\n" and time.time() - t0 < 15


ESCAPER = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
# a grandchild in its own session: out of torchrun's process group, found by its environment
subprocess.Popen([sys.executable, "-c", "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "time.sleep(600)"], start_new_session=True)
print("ready", flush=True)
time.sleep(600)
"""


def test_stop_terms_then_kills_every_process_of_the_run_and_nothing_else(agent):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 env=dict(agent.env, CLUSTERCTL_RUN_KEY="other@n1"))
    try:
        start(agent, "s1@n1", ESCAPER)
        d = rundir(agent, "s1@n1")
        assert wait_for(lambda: b"ready" in (d / "log").read_bytes() and len(pids_with("s1@n1")) == 2)
        assert json.loads(agent("live").stdout) == ["s1@n1"]
        t0 = time.time()
        r = agent("stop", "s1@n1", 1)
        assert json.loads(r.stdout) == {"left": 0}
        assert time.time() - t0 < 10
        assert pids_with("s1@n1") == []
        assert (d / "exit_code").read_text() == "137"  # SIGTERM ignored: SIGKILL after the grace
        assert bystander.poll() is None  # another run's process is untouched
        assert json.loads(agent("live").stdout) == []
    finally:
        bystander.kill()
        bystander.wait()


def test_stop_graceful_exit_code_is_the_signal(agent):
    start(agent, "s2@n1", "import time; print('up', flush=True); time.sleep(600)")
    d = rundir(agent, "s2@n1")
    assert wait_for(lambda: b"up" in (d / "log").read_bytes())
    assert json.loads(agent("stop", "s2@n1", 5).stdout) == {"left": 0}
    assert (d / "exit_code").read_text() == "143"  # 128 + SIGTERM


# torchrun's part as the node sees it: start the rank (RANK in its environment, not in torchrun's),
# reap it at the next 0.1 s poll, exit as it did
TORCHRUN = """
import os, subprocess, sys, time
rank = {"RANK": "0", "LOCAL_RANK": os.environ.pop("TEST_LOCAL_RANK")}
p = subprocess.Popen(sys.argv[1:], env=dict(os.environ, **rank))
while p.poll() is None:
    time.sleep(0.1)
sys.exit(p.returncode if p.returncode >= 0 else 128 - p.returncode)
"""
HOOK = (REMOTE / "hook" / "sitecustomize.py").read_text()


def start_rank(agent, key, target, local_rank="3"):
    """A run of one rank under a torchrun stand-in, with the hook in it as launch.py ships it."""
    spec = {"argv": [sys.executable, "-c", TORCHRUN, sys.executable, "-u", *target], "cwd": str(agent.home),
            "env": {"TEST_LOCAL_RANK": local_rank}, "hook": HOOK}
    r = agent("start", key, json.dumps(spec).encode().hex())
    assert r.returncode == 0, r.stderr
    d = rundir(agent, key)
    assert wait_for(lambda: (d / "exit_code").exists(), timeout=60)
    return d


TEARER = """
import os, sys, time
out = sys.stdout.buffer
for i in range(50):  # half lines, flushed apart: a readline() tailer prints them torn
    out.write(b"line %d " % i); out.flush(); time.sleep(0.002)
    out.write(b"end\\n"); out.flush()
    os.write(2, b"err %d\\n" % i)
out.write(b"no newline at the end"); out.flush()
sys.exit(7)
"""


def test_a_ranks_lines_reach_the_log_whole_and_tagged_with_its_exit_code(agent, tmp_path):
    script = tmp_path / "tearer.py"
    script.write_text(TEARER)
    t0 = time.time()
    d = start_rank(agent, "l1@n1", [str(script)])
    assert (d / "exit_code").read_text() == "7"
    lines = (d / "log").read_bytes().split(b"\n")
    assert lines.pop() == b""
    assert sorted(ln for ln in lines if b"]:line " in ln) == sorted(b"[default3]:line %d end" % i for i in range(50))
    assert sorted(ln for ln in lines if b"err" in ln) == sorted(b"[default3]:err %d" % i for i in range(50))
    assert lines[-1] == b"[default3]:no newline at the end" and len(lines) == 101
    at, code = (d / "failed.3").read_text().split()  # the rank's end, by the node's clock, with its status
    assert code == "7" and t0 <= float(at) <= float((d / "ended").read_text())


@pytest.mark.parametrize("code, note", [("pass", None), ("import sys; sys.exit(5)", "5"),
                                        ("raise ValueError('boom')", "1"),
                                        ("import os, signal; os.kill(os.getpid(), 9)", "-9")])
def test_the_waiter_notes_when_a_rank_failed_and_how(agent, code, note):
    """A rank that fails (an exit code, an exception, a signal: whatever gave its real end) has the
    moment noted in failed.LOCAL_RANK in the run directory; one that succeeds notes nothing."""
    t0 = time.time()
    d = start_rank(agent, f"n{abs(hash(code)) % 1000}@n1", ["-c", code], local_rank="2")
    notes = sorted(p.name for p in d.glob("failed.*"))
    if note is None:
        assert notes == [] and (d / "exit_code").read_text() == "0"
        return
    assert notes == ["failed.2"]  # nothing half-written left
    at, rc = (d / "failed.2").read_text().split()
    # the status from /proc while the rank is a zombie; reaped first, the hook's word, and a
    # signal's number is torchrun's alone
    assert rc in ((note, "?") if note == "-9" else (note,)) and t0 <= float(at) <= float((d / "ended").read_text())


def test_status_reports_when_a_rank_first_failed(agent):
    start(agent, "f1@n1", "import sys; sys.exit(5)")
    d = rundir(agent, "f1@n1")
    assert wait_for(lambda: (d / "exit_code").exists())
    assert json.loads(agent("status", "f1@n1").stdout)["rank_failed"] is None  # no hook: unknown
    (d / "failed.1").write_text("1000.250000 1\n")
    (d / "failed.0").write_text("1000.125000 -15\n")
    (d / "failed.3.tmp").write_text("999.0 1\n")  # a note being written is not read
    (d / "failed.2").write_text("garbage")
    assert json.loads(agent("status", "f1@n1").stdout)["rank_failed"] == 1000.125


def test_a_rank_is_one_process_that_runs_modules_and_takes_signals_itself(agent, tmp_path):
    """No wrapper between torchrun and the rank: the rank is torchrun's child, a `-m` target runs,
    SIGTERM reaches the script and its last lines still reach the log."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('checkpointed', flush=True), sys.exit(0)))\n"
        "print('up', sys.argv[1:], flush=True)\n"
        "time.sleep(60)\n")
    spec = {"argv": [sys.executable, "-c", TORCHRUN, sys.executable, "-u", "-m", "mypkg", "--flag"],
            "cwd": str(tmp_path), "env": {"TEST_LOCAL_RANK": "0"}, "hook": HOOK}
    info = json.loads(agent("start", "m1@n1", json.dumps(spec).encode().hex()).stdout)
    d = rundir(agent, "m1@n1")
    assert wait_for(lambda: b"[default0]:up ['--flag']\n" in (d / "log").read_bytes(), timeout=30)
    procs = pids_with("m1@n1")
    assert len(procs) == 2 and info["pid"] in procs  # torchrun's stand-in and the rank, nothing beside it
    rank = next(p for p in procs if p != info["pid"])
    assert (Path(f"/proc/{rank}/stat").read_text().rsplit(")", 1)[1].split()[1]) == str(info["pid"])
    os.kill(rank, signal.SIGTERM)
    assert wait_for(lambda: (d / "exit_code").exists(), timeout=30)
    assert (d / "exit_code").read_text() == "0" and not list(d.glob("failed.*"))
    assert (d / "log").read_bytes() == b"[default0]:up ['--flag']\n[default0]:checkpointed\n"


def test_spec_on_stdin_keeps_env_off_the_command_line_and_the_run_dir_private(agent):
    """The controller sends the spec on stdin: no env value in any process's argv."""
    spec = {"argv": [sys.executable, "-c", "import os, time; print(os.environ['API_TOKEN'], flush=True); "
                     "time.sleep(600)"], "cwd": str(agent.home), "env": {"API_TOKEN": "tok-s3cr3t"}}
    r = subprocess.run(local_argv("node_agent", "start", "p1@n1", "-"), input=json.dumps(spec).encode(),
                       env=agent.env, capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    d = rundir(agent, "p1@n1")
    try:
        assert wait_for(lambda: b"tok-s3cr3t" in (d / "log").read_bytes())
        hexed = "tok-s3cr3t".encode().hex()
        for pid in pids_with("p1@n1"):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:  # ended since it was listed
                continue
            assert b"tok-s3cr3t" not in cmdline and hexed.encode() not in cmdline
        assert (d.stat().st_mode & 0o777) == 0o700 and (d.parent.stat().st_mode & 0o777) == 0o700
    finally:
        agent("stop", "p1@n1", 1)
    missing = subprocess.run(local_argv("node_agent", "start", "p2@n1", "-"), input=b"", env=agent.env,
                             capture_output=True, timeout=30)
    assert missing.returncode != 0 and b"no spec" in missing.stderr


def test_the_waiter_sees_torchruns_end_at_once_without_passing_on_its_signal_mask(agent):
    """The waiter blocks SIGCHLD and waits for it (a poll would see the end up to 0.2 s late);
    torchrun must not inherit the block. (The waiter's own SigBlk cannot be checked: the kernel
    unblocks the waited-for signals while it sleeps in sigtimedwait.)"""
    info = start(agent, "m1@n1", "import time; print('up', flush=True); time.sleep(600)")
    d = rundir(agent, "m1@n1")
    try:
        assert wait_for(lambda: b"up" in (d / "log").read_bytes())

        def blocked(pid):
            mask = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("SigBlk:"))
            return bool(int(mask.split()[1], 16) >> (signal.SIGCHLD - 1) & 1)

        assert not blocked(info["pid"])
    finally:
        agent("stop", "m1@n1", 0)
    lags = []
    for i in range(5):
        start(agent, f"m{i + 2}@n1", "import os, time; time.sleep(0.3); print(repr(time.time()), flush=True); "
                                     "os._exit(0)")
        d = rundir(agent, f"m{i + 2}@n1")
        assert wait_for(lambda: (d / "ended").exists())
        lags.append(float((d / "ended").read_text()) - float((d / "log").read_text()))
    assert sorted(lags)[2] < 0.06, lags  # polling every 0.2 s: a median near 0.1 s


SIGTERM_IGNORED = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); " \
                  "time.sleep(600)"


def test_a_peer_failed_stop_kills_at_once_whatever_the_grace(agent):
    start(agent, "f1@n1", SIGTERM_IGNORED)
    d = rundir(agent, "f1@n1")
    assert wait_for(lambda: b"up" in (d / "log").read_bytes())
    t0 = time.time()
    assert json.loads(agent("stop", "f1@n1", 60, "peer-failed").stdout) == {"left": 0}
    assert time.time() - t0 < 5 and pids_with("f1@n1") == []
    assert (d / "exit_code").read_text() == "137"
    assert json.loads((d / "stop").read_text())["peer_failed"] is True
    assert agent("stop", "f1@n1", 1, "whatever").returncode != 0


def test_the_waiter_carries_out_a_peer_failed_stop_request(agent):
    """A stop cut off after writing its request: the waiter kills at once, not after the grace."""
    start(agent, "f2@n1", SIGTERM_IGNORED)
    d = rundir(agent, "f2@n1")
    assert wait_for(lambda: b"up" in (d / "log").read_bytes())
    (d / "stop").write_text(json.dumps({"grace": 60, "at": time.time(), "peer_failed": True}))
    assert wait_for(lambda: (d / "exit_code").exists(), 10, "the waiter's kill")
    assert (d / "exit_code").read_text() == "137" and pids_with("f2@n1") == []


CKPT_WRITER = """
import os, signal, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
tmp = f"ckpt_00000010.pt.tmp.{os.getpid()}"
with open(tmp, "wb") as f:  # a checkpoint half written when the stop comes
    f.write(b"half"); f.flush()
    print("writing", flush=True)
    while not stop:
        time.sleep(0.01)
    time.sleep(1)
    f.write(b" and the rest")
os.replace(tmp, "ckpt_00000010.pt")
sys.exit(0)
"""


def test_a_peer_failed_stop_lets_a_checkpoint_being_written_finish(agent):
    start(agent, "f3@n1", CKPT_WRITER)
    d = rundir(agent, "f3@n1")
    assert wait_for(lambda: b"writing" in (d / "log").read_bytes())
    assert json.loads(agent("stop", "f3@n1", 10, "peer-failed").stdout) == {"left": 0}
    assert (agent.home / "ckpt_00000010.pt").read_bytes() == b"half and the rest"
    assert (d / "exit_code").read_text() == "0"


LINGERER = """
import subprocess, sys, time
# a worker that takes a second to stop on SIGTERM (a trainer tearing down), and a "torchrun" that
# takes its time to exit once the worker is gone
w = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: "
                      "(time.sleep(1), sys.exit(1))); print('up', flush=True); time.sleep(600)"])
w.wait()
time.sleep(30)
"""


@pytest.mark.slow
def test_a_stop_gives_torchrun_a_moment_not_seconds_once_its_workers_are_gone(agent):
    start(agent, "l1@n1", LINGERER)
    d = rundir(agent, "l1@n1")
    assert wait_for(lambda: b"up" in (d / "log").read_bytes() and len(pids_with("l1@n1")) == 2)
    t0 = time.time()
    assert json.loads(agent("stop", "l1@n1", 20).stdout) == {"left": 0}
    # the worker's 1 s, then TORCHRUN_EXIT_S (3 s) for torchrun to exit on its own, not the grace's
    # 20 s (before f0d4278: until the grace's half + 2 s, 12 s)
    assert time.time() - t0 < 7
    assert (d / "exit_code").read_text() == "143"


def test_tail_can_end_with_the_runs_status_so_nobody_has_to_ask_again(agent):
    start(agent, "t2@n1", "import sys; print('bye', flush=True); sys.exit(5)")
    r = agent("tail", "t2@n1", 0, "status")
    assert r.returncode == 0 and r.stdout == "bye\n"
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("clusterctl-status ")
    doc = json.loads(last[len("clusterctl-status "):])
    assert doc == json.loads(agent("status", "t2@n1").stdout)
    assert doc["exit_code"] == 5 and doc["alive"] == 0 and doc["ended"] is not None
    assert agent("tail", "t2@n1", 0).stderr == ""  # asked for only
    assert agent("tail", "t2@n1", 0, "x").returncode != 0


def claims_of(agent) -> dict:
    return json.loads(agent("claims").stdout)


def test_a_claim_is_held_by_every_attempt_and_stale_once_they_ended(agent):
    """A spare that only ran attempt 2 (RUN.a2@NODE) frees the node as soon as that attempt
    ended, not CLAIM_START_S later; a claim renewed for the next attempt is held again until it
    ends; a claim whose run started nothing here is held (its launch may be under way)."""
    run = "run-20261128-101010-abcd"
    assert json.loads(agent("claim", "n5", f"{run}@n5", "me@ctl").stdout)["ok"]
    assert claims_of(agent)["n5"]["stale"] is False  # nothing ran here yet: held
    start(agent, f"{run}.a2@n5", "import time; print('up', flush=True); time.sleep(600)")
    assert claims_of(agent)["n5"]["stale"] is False  # attempt 2 is alive: held
    agent("stop", f"{run}.a2@n5", 1)
    assert claims_of(agent)["n5"]["stale"] is True  # attempt 2 ended: free, at once
    renewed = json.loads(agent("claim", "n5", f"{run}@n5", "me@ctl").stdout)  # attempt 3 begins here
    assert renewed["ok"] and renewed["renewed"] >= renewed["since"]
    assert claims_of(agent)["n5"]["stale"] is False  # attempt 2's end is older than the renewal
    other = json.loads(agent("claim", "n5", "run-20261128-111111-beef@n5", "you@ctl").stdout)
    assert other["ok"] is False and other["run"] == run
    start(agent, f"{run}.a3@n5", "print('done')")
    assert wait_for(lambda: claims_of(agent)["n5"]["stale"], 20)
    assert json.loads(agent("claim", "n5", "run-20261128-111111-beef@n5", "you@ctl").stdout)["ok"]


def test_another_runs_attempts_do_not_hold_a_claim(agent):
    """RUN.a2 of a run whose id only begins like the claim's is not of its family."""
    run = "run-20261128-101010-abcd"
    assert json.loads(agent("claim", "n1", f"{run}@n1", "me@ctl").stdout)["ok"]
    start(agent, f"{run}@n1", "print('x')")
    start(agent, f"{run}x.a2@n1", "import time; time.sleep(600)")
    start(agent, f"{run}.a2@n2", "import time; time.sleep(600)")  # the same run, on another node
    try:
        assert wait_for(lambda: claims_of(agent)["n1"]["stale"], 20)
    finally:
        agent("stop", f"{run}x.a2@n1", 0)
        agent("stop", f"{run}.a2@n2", 0)


SAVER = """
import signal, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
print('up', flush=True)
while not stop:
    time.sleep(0.05)
time.sleep(3.5)  # a checkpoint written on SIGTERM, longer than half the grace
print('saved', flush=True)
"""
LAUNCHER = f"""
import signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))  # as torchrun: a SIGTERM of its own fails the run
sys.exit(subprocess.Popen([sys.executable, "-c", {SAVER!r}]).wait())
"""


@pytest.mark.slow
def test_a_stop_records_the_exit_of_ranks_that_saved_and_ended_within_the_grace(agent):
    """The worker (not the launcher) is asked to stop and has the whole grace to checkpoint and
    end on its own; its launcher then ends with its verdict (0), not signalled (torchrun's 1) nor
    killed (137)."""
    start(agent, "sv1@n1", LAUNCHER)
    d = rundir(agent, "sv1@n1")
    assert wait_for(lambda: b"up" in (d / "log").read_bytes(), 20)
    assert json.loads(agent("stop", "sv1@n1", 6).stdout) == {"left": 0}
    assert b"saved" in (d / "log").read_bytes()
    assert (d / "exit_code").read_text() == "0"


# torchrun in its exit barrier: its rank ended, it waits for the other nodes' torchruns
IN_EXIT_BARRIER = """
import os, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", os.environ["CHILD"]], env=dict(os.environ, RANK="0", LOCAL_RANK="0"))
rank.wait()
time.sleep(600)
"""
ENDS_ON_TERM = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.5), sys.exit({code})))  # a trainer saving, then leaving
print('up', flush=True)
while True:
    time.sleep(0.05)
"""


@pytest.mark.slow
@pytest.mark.parametrize("code, recorded", [(0, "0"), (3, "143")], ids=["ranks-ended-well", "a-rank-failed"])
def test_torchrun_ended_by_a_stop_after_its_ranks_exited_0_records_their_0(agent, code, recorded):
    """On a loaded cluster a node's torchrun can outlive its ranks' clean exit on a stop (its exit
    barrier waits for the other nodes, and fails when node 0's torchrun leaves first). The ranks'
    0 is the job's verdict, not torchrun's 143 (CI, test_a_stop_of_a_job_that_saves_on_sigterm_…:
    node2 143 after 'saved at step 15'). Once the waiter saw every rank end with 0, the stop ends
    torchrun at once (SIGKILL) instead of waiting TORCHRUN_EXIT_S for it, then SIGTERM; a rank
    that failed leaves torchrun its moment to exit with the verdict, and then its SIGTERM."""
    spec = {"argv": [sys.executable, "-c", IN_EXIT_BARRIER, "--nproc-per-node", "1"], "cwd": str(agent.home),
            "env": {"CHILD": ENDS_ON_TERM.format(code=code)}, "hook": HOOK}
    assert agent("start", "lg1@n1", json.dumps(spec).encode().hex()).returncode == 0
    d = rundir(agent, "lg1@n1")
    assert wait_for(lambda: b"up" in (d / "log").read_bytes(), 30)
    assert json.loads(agent("stop", "lg1@n1", 10, timeout=60).stdout) == {"left": 0}
    assert wait_for(lambda: (d / "exit_code").exists(), 30)
    assert (d / "exit_code").read_text() == recorded
    said = re.findall(rb"the stop ended torchrun \(signal (\d+)\) after every rank on this node had exited 0",
                      (d / "log").read_bytes())
    assert said == ([b"9"] if code == 0 else [])


def test_nproc_of_reads_torchruns_flag_in_either_spelling():
    ns = vars(WAITER)
    assert ns["nproc_of"](["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "8", "t.py"]) == 8
    assert ns["nproc_of"](["--nproc_per_node=4"]) == 4
    assert ns["nproc_of"](["--nproc-per-node", "gpu"]) is None and ns["nproc_of"](["t.py"]) is None


def test_a_rank_reaped_before_the_waiter_read_its_status_is_judged_by_its_hooks_word():
    word = LINES.hooks_word
    assert word(b"x\n") == 0  # through Python's finalization, nothing said against it
    assert word(b"e\nx\n") == 1 and word(b"s5\nx\n") == 5 and word(b"o3\n") == 3 and word(b"o0\n") == 0
    assert word(b"") == "?"  # no finalization: a signal or a crash, its number torchrun's alone


def test_a_rank_dies_with_torchrun_though_the_waiter_is_gone_too(agent):
    """No wrapper arms the death signal any more: the hook does, in the rank itself."""
    spec = {"argv": [sys.executable, "-c", TORCHRUN, sys.executable, "-u", "-c",
                     "import time; print('up', flush=True); time.sleep(120)"],
            "cwd": str(agent.home), "env": {"TEST_LOCAL_RANK": "0"}, "hook": HOOK}
    info = json.loads(agent("start", "k1@n1", json.dumps(spec).encode().hex()).stdout)
    d = rundir(agent, "k1@n1")
    assert wait_for(lambda: b"[default0]:up" in (d / "log").read_bytes(), timeout=30)
    assert len(pids_with("k1@n1")) == 2
    os.kill(info["waiter"], signal.SIGKILL)  # nobody left to end the run by its key
    os.kill(info["pid"], signal.SIGKILL)
    assert wait_for(lambda: not pids_with("k1@n1"), timeout=10, what="the rank to die with torchrun")


def test_a_run_directory_too_long_for_a_socket_address_still_gets_tagged_lines(tmp_path):
    home = tmp_path / ("h" * 60) / ("o" * 60)  # RUNDIR/lines.sock past sun_path's 108 bytes
    home.mkdir(parents=True)
    env = dict(os.environ, HOME=str(home))

    def call(*args):
        return subprocess.run(local_argv("node_agent", *map(str, args)), stdin=subprocess.DEVNULL, env=env,
                              capture_output=True, timeout=30)

    call.home = home
    d = start_rank(call, "long@n1", ["-c", "print('hello')"], local_rank="1")
    assert len(str(d / "lines.sock")) > 108
    assert (d / "log").read_bytes() == b"[default1]:hello\n"


def test_a_run_s_processes_are_waited_for_by_pid_with_one_scan_to_confirm_they_are_gone():
    """A run ending on a node is waited for by the stop and the waiter at once; each /proc scan
    reads every process of the node (quadratic on the test cluster, whose nodes share one /proc).
    wait_gone watches what one scan found by pid and start time, and scans again only once those
    are gone: for what they started meanwhile, which it then waits for as well."""
    from orchestrator.remote.agent_base import started_at, wait_gone

    first = subprocess.Popen(["sleep", "30"])
    later = []
    scans = []

    def find():  # the stand-in for a /proc scan: the run's live processes
        scans.append(time.monotonic())
        return [p.pid for p in [first, *later] if p.poll() is None]

    def end_first_then_start_another():
        time.sleep(0.3)
        later.append(subprocess.Popen(["sleep", "30"]))  # started by the run before it ended
        first.kill()
        first.wait()
        time.sleep(0.3)
        later[0].kill()
        later[0].wait()

    import threading
    t = threading.Thread(target=end_first_then_start_another)
    t.start()
    try:
        assert wait_gone(find, time.time() + 20) is True
    finally:
        t.join()
    # one scan to start, one once the first was gone (it finds the later one), one to confirm
    assert len(scans) == 3, scans
    assert started_at(first.pid) is None  # a pid that ended reads as gone

    stuck = subprocess.Popen(["sleep", "30"])
    try:
        assert wait_gone(lambda: [stuck.pid], time.time() + 0.3) is False  # the deadline holds
        assert started_at(stuck.pid) is not None
    finally:
        stuck.kill()
        stuck.wait()
