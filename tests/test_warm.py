"""The warm interpreter (remote/warm.py) and the rank's side of it (the hook's `_warm`): a rank
forked from it runs as the rank torchrun started would have, and its asker ends as it ended."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from orchestrator.remote import warm as warm_mod
from tests.conftest import pid_ended, wait_for

REPO = Path(__file__).resolve().parent.parent
HOOK = REPO / "orchestrator" / "remote" / "hook" / "sitecustomize.py"
CLIENT = REPO / "orchestrator" / "remote" / "warm_client.py"
JOB = """import os, sys, time
print("FORK=%d" % os.getpid(), "ARGV=%s" % sys.argv[1:], "CWD=%s" % os.getcwd(), flush=True)
print("STEP=%s" % hasattr(sys.modules.get("sitecustomize"), "clusterctl_step"), flush=True)
what = sys.argv[1] if len(sys.argv) > 1 else ""
if what == "raise":
    raise RuntimeError("boom")
if what == "sleep":
    time.sleep(60)
if what == "unflushed":
    print("UNFLUSHED")
    time.sleep(60)
sys.exit(int(what or 0))
"""


def hook_dir(tmp_path):
    """py/ as the waiter writes it (the hook and clusterctl_warm.py), and the job beside it."""
    (tmp_path / "py").mkdir()
    (tmp_path / "py" / "sitecustomize.py").write_text(HOOK.read_text())
    (tmp_path / "py" / "clusterctl_warm.py").write_text(CLIENT.read_text())
    (tmp_path / "job.py").write_text(JOB)


@pytest.fixture
def warm(tmp_path):
    """A warm interpreter (preloading nothing heavy) and the environment of a rank that uses it."""
    hook_dir(tmp_path)
    sock = tmp_path / "w.sock"
    pad = {f"CLUSTERCTL_WARM_PAD{i}": "x" * 60000 for i in range(2)}
    z = subprocess.Popen([sys.executable, "-m", "orchestrator.remote.warm", "serve", str(sock), "json",
                          " " * warm_mod.ARGV_PAD], cwd=REPO,
                         env={**os.environ, **pad, "PYTHONPATH": f"{tmp_path / 'py'}{os.pathsep}{REPO}",
                              "CLUSTERCTL_RUN_KEY": "wr1.warm@n1"}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         text=True)
    assert said(z) == ["listening", "ready"]
    env = {**os.environ, "RANK": "3", "LOCAL_RANK": "1", "CLUSTERCTL_WARM": str(sock),
           "CLUSTERCTL_RUN_KEY": "wr1.a1@n1",
           "PYTHONPATH": f"{tmp_path / 'py'}{os.pathsep}{tmp_path}"}
    yield env, tmp_path
    z.terminate()
    z.wait(10)


def rank(env, *args, cwd=None, **kw):
    return subprocess.Popen([sys.executable, "-u", *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def fork_of(p):
    line = p.stdout.readline()
    assert line.startswith("FORK="), line
    return int(line.split()[0][5:]), line


def test_a_forked_rank_runs_the_script_with_its_own_argv_environment_and_directory_and_exits_as_it(warm):
    env, d = warm
    p = rank(env, str(d / "job.py"), "7", cwd=d)
    pid, line = fork_of(p)
    assert pid != p.pid and f"CWD={d}" in line and "ARGV=['7']" in line, line
    assert p.stdout.readline().strip() == "STEP=True"  # the hook ran in the fork, as in a fresh rank
    assert p.wait(30) == 7
    m = rank(env, "-m", "job", "5", cwd=d)  # -m, found on the rank's PYTHONPATH, not the interpreter's
    assert fork_of(m)[0] != m.pid and m.wait(30) == 5


def test_the_fork_carries_the_ranks_marker_where_the_node_scans_for_it(warm):
    env, d = warm
    p = rank(env, str(d / "job.py"), "sleep")
    pid, _ = fork_of(p)
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"CLUSTERCTL_RUN_KEY=wr1.a1@n1" in environ and b"RANK=3" in environ
        assert not any(v.startswith(b"CLUSTERCTL_WARM=") for v in environ)  # its children start cold
    finally:
        p.kill()
        p.wait(10)


def test_the_fork_shows_the_ranks_command_line_not_the_zygotes(warm):
    """`ps`, `pgrep -f job.py`, psutil and the GPU check's list of a GPU's processes read
    /proc/PID/cmdline: a forked rank shows the command line torchrun gave it there, as a title
    (setproctitle's way: the arguments joined by blanks), and one too long for the room is cut at
    an argument's end."""
    env, d = warm
    p = rank(env, str(d / "job.py"), "sleep", "--flag=1")
    pid, _ = fork_of(p)
    try:
        want = [sys.executable, "-u", str(d / "job.py"), "sleep", "--flag=1"]
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert raw == " ".join(want).encode() + b"\0", raw[:300]
        assert psutil.Process(pid).cmdline() == want
        found = subprocess.run(["pgrep", "-f", f"{d / 'job.py'} sleep"], capture_output=True, text=True).stdout.split()
        assert str(pid) in found, found
    finally:
        p.kill()
        p.wait(10)
    long = rank(env, str(d / "job.py"), "sleep", *[f"--arg{i}={'v' * 100}" for i in range(60)])
    pid, _ = fork_of(long)
    try:
        argv = psutil.Process(pid).cmdline()
        assert argv[:4] == [sys.executable, "-u", str(d / "job.py"), "sleep"]
        assert 4 < len(argv) < 64 and argv[4:] == [f"--arg{i}={'v' * 100}" for i in range(len(argv) - 4)]
    finally:
        long.kill()
        long.wait(10)


def test_a_title_that_fills_the_room_ends_with_a_nul_and_shows_nothing_of_the_environment():
    """Where the room is the arguments' own (a process started without the padding), the longest
    title shown is one byte short of it: Linux reads a title up to its NUL, on into the
    environment (the rank's tokens and keys) if the NUL were missing. One byte more and its last
    argument is left out."""
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
            "from orchestrator.remote.warm_fork import arg_block, own_cmdline\n"
            "start, end = arg_block()\n"
            "over = int(sys.argv[1])\n"
            "fill = 'x' * (end - start - 2 + over - len('python3 -u job.py '))\n"
            "own_cmdline(['python3', '-u', 'job.py', fill])\n"
            "print(open('/proc/self/cmdline', 'rb').read() == "
            "(b'python3 -u job.py' + (b' ' + fill.encode() if not over else b'') + b'\\0'))\n")
    for over in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", code, over], capture_output=True, text=True, timeout=30,
                             env={**os.environ, "SECRET_TOKEN": "s3cr3t"})
        assert out.stdout.strip() == "True", (over, out.stdout, out.stderr[-2000:])


def test_pythonunbuffered_makes_the_forks_stdout_unbuffered_as_it_makes_pythons(warm):
    """A rank started without `-u` but with PYTHONUNBUFFERED set (clusterctl sets it for every
    job) writes each print at once, forked or not: its lines reach the log as they are printed."""
    import threading

    env, d = warm
    p = subprocess.Popen([sys.executable, str(d / "job.py"), "unflushed"], env={**env, "PYTHONUNBUFFERED": "1"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        fork_of(p)
        assert p.stdout.readline().startswith("STEP=")
        got = []
        reader = threading.Thread(target=lambda: got.append(p.stdout.readline()), daemon=True)
        reader.start()
        reader.join(20)  # the job sleeps 60 s after its print: a buffered line comes only at its end
        assert got == ["UNFLUSHED\n"], "the print stayed in the fork's buffer"
    finally:
        p.kill()
        p.wait(10)


def test_an_uncaught_exception_prints_its_traceback_and_exits_1(warm):
    env, d = warm
    p = rank(env, str(d / "job.py"), "raise")
    fork_of(p)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 1 and "RuntimeError: boom" in err, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_asker_reaches_the_fork(warm, sig):
    env, d = warm
    p = rank(env, str(d / "job.py"), "sleep")
    pid, _ = fork_of(p)
    p.send_signal(sig)
    assert p.wait(30) == -sig  # SIGINT: KeyboardInterrupt's traceback, then killed by SIGINT, as a cold rank
    assert wait_for(lambda: pid_ended(pid), 10, "the fork")


def test_the_fork_dies_with_its_asker_and_the_asker_with_the_fork(warm):
    env, d = warm
    p = rank(env, str(d / "job.py"), "sleep")
    pid, _ = fork_of(p)
    p.kill()  # torchrun's last resort: the zygote sees the asker gone
    p.wait(10)
    assert wait_for(lambda: pid_ended(pid), 10, "the fork")
    q = rank(env, str(d / "job.py"), "sleep")
    pid, _ = fork_of(q)
    os.kill(pid, signal.SIGKILL)
    assert q.wait(10) == -signal.SIGKILL  # torchrun sees its worker killed, as it was


def test_a_rank_the_warm_interpreter_cannot_run_starts_cold(warm):
    env, d = warm
    p = rank(env, "-X", "dev", str(d / "job.py"), "4")  # an option the fork does not take: refused
    pid, _ = fork_of(p)
    assert pid == p.pid and p.wait(30) == 4
    big = {**env, "HUGE": "y" * 130000}  # more than the warm interpreter's environment holds: refused
    r = rank(big, str(d / "job.py"), "6")
    assert fork_of(r)[0] == r.pid and r.wait(30) == 6
    gone = {**env, "CLUSTERCTL_WARM": str(d / "nobody.sock")}
    t0 = time.monotonic()
    q = rank(gone, str(d / "job.py"), "2")
    assert fork_of(q)[0] == q.pid and q.wait(30) == 2 and time.monotonic() - t0 < 20


def said(z, last="ready"):
    """The lines the warm interpreter `z` printed, up to `last`."""
    lines = []
    while not lines or lines[-1] not in (last, ""):
        lines.append(z.stdout.readline().strip())
    return lines


def importing_zygote(tmp_path, seconds):
    """A warm interpreter whose imports take `seconds` (a preloaded module that sleeps), and a
    rank's environment that uses it; returned as soon as it listens, before it is ready."""
    hook_dir(tmp_path)
    (tmp_path / "py" / "slow_import.py").write_text(f"import time\ntime.sleep({seconds})\n")
    sock = tmp_path / "w" / "sock"
    sock.parent.mkdir()
    z = subprocess.Popen([sys.executable, "-m", "orchestrator.remote.warm", "serve", str(sock), "json,slow_import"],
                         cwd=REPO, env={**os.environ, "CLUSTERCTL_WARM_PAD0": "x" * 60000,
                                        "PYTHONPATH": f"{tmp_path / 'py'}{os.pathsep}{REPO}"},
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    assert z.stdout.readline().strip() == "listening" and sock.is_socket()  # said once it listens, before its imports
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "CLUSTERCTL_WARM": str(sock),
           "PYTHONPATH": f"{tmp_path / 'py'}{os.pathsep}{tmp_path}"}
    return z, env, sock


def test_a_rank_that_asks_while_the_warm_interpreter_imports_waits_for_its_fork(tmp_path):
    """An early fault's restart: the warm interpreter listens from its start, marked `importing`;
    a rank that asks before it is ready waits for it (longer than WARM_WAIT_S) and is forked,
    rather than importing torch again beside it."""
    from orchestrator.remote import warm_client

    z, env, sock = importing_zygote(tmp_path, warm_client.WARM_WAIT_S + 2)
    try:
        mark = sock.parent / warm_client.IMPORTING
        assert mark.read_text().strip() == str(z.pid)
        assert warm_mod.importing(str(sock)) and warm_mod.answers(str(sock))
        p = rank(env, str(tmp_path / "job.py"), "5")
        pid, _ = fork_of(p)
        assert pid != p.pid and p.wait(30) == 5  # forked once the imports ended, not cold
        assert z.stdout.readline().strip() == "ready" and not mark.exists() and not warm_mod.importing(str(sock))
        q = rank(env, str(tmp_path / "job.py"), "6")  # once ready: forked at once, as before
        assert fork_of(q)[0] != q.pid and q.wait(30) == 6
    finally:
        z.terminate()
        z.wait(10)


def queued(pid):
    """How many connections wait in the queue of process `pid`'s listening Unix sockets (`ss`'s
    Recv-Q of a listener, matched by the socket's inode among the process's descriptors)."""
    inos = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inos.add(target[8:-1])
    out = subprocess.run(["ss", "-xlH"], capture_output=True, text=True, check=True).stdout
    return sum(int(f[2]) for f in (line.split() for line in out.splitlines()) if len(f) >= 6 and f[-3] in inos)


def test_a_warm_interpreter_that_dies_while_it_imports_lets_its_askers_start_cold_at_once(tmp_path):
    z, env, sock = importing_zygote(tmp_path, 120)
    p = rank(env, str(tmp_path / "job.py"), "3")
    wait_for(lambda: queued(z.pid) == 1, 30, "its request in the socket's queue")
    z.kill()
    z.wait(10)
    t0 = time.monotonic()
    pid, _ = fork_of(p)
    assert pid == p.pid and p.wait(30) == 3  # cold, without waiting out IMPORT_WAIT_S
    assert time.monotonic() - t0 < 20
    q = rank(env, str(tmp_path / "job.py"), "4")  # its stale socket: refused at once, cold
    assert fork_of(q)[0] == q.pid and q.wait(30) == 4


def test_the_warm_interpreter_goes_once_let_go_and_idle_and_not_before(tmp_path):
    """Its stdout's reader (the control machine's connection) gone: it ends at once when no rank
    forked from it runs, else when the last one ends."""
    sock = tmp_path / ("d" * 120) / "s"  # longer than a socket path may be: bound in its directory
    sock.parent.mkdir()
    hook_dir(tmp_path)
    pad = {"CLUSTERCTL_WARM_PAD0": "x" * 60000}
    z = subprocess.Popen([sys.executable, "-m", "orchestrator.remote.warm", "serve", str(sock), "json"], cwd=REPO,
                         env={**os.environ, **pad, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, text=True)
    assert said(z) == ["listening", "ready"]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "CLUSTERCTL_WARM": str(sock),
           "PYTHONPATH": f"{tmp_path / 'py'}{os.pathsep}{tmp_path}"}
    p = rank(env, str(tmp_path / "job.py"), "sleep")
    pid, _ = fork_of(p)
    assert pid != p.pid
    z.stdout.close()  # let go while a rank runs: it stays
    time.sleep(1)
    assert z.poll() is None
    os.kill(pid, signal.SIGTERM)
    assert p.wait(10) == -signal.SIGTERM
    assert z.wait(10) == 0  # the last fork ended: it goes


@pytest.mark.slow
def test_warm_run_node_serves_the_run_once_marked_with_its_key_and_goes_when_let_go(tmp_path, monkeypatch):
    """`warm RUN NODE` as a node runs it: the spec on stdin, the interpreter re-executed with the
    run's environment (padded) and marked RUN.warm@NODE, its socket where the waiter looks. A
    second one (an adopting supervisor's) takes the socket's name over; the first one goes."""
    import json

    from orchestrator import probe

    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home)}
    spec = json.dumps({"python": sys.executable, "env": {"FROM_SPEC": "1"}, "cwd": str(tmp_path), "preload": "json"})
    z = subprocess.Popen(probe.local_argv("warm", "wr1", "n1"), env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    z.stdin.write(spec)
    z.stdin.close()
    assert said(z) == ["listening", "ready"]
    sock = home / ".clusterctl" / "warm" / "wr1@n1" / "sock"
    assert sock.is_socket()
    block = Path(f"/proc/{z.pid}/environ").read_bytes()
    environ = block.split(b"\0")
    assert b"CLUSTERCTL_RUN_KEY=wr1.warm@n1" in environ and b"FROM_SPEC=1" in environ
    assert len(block) > 150_000  # the room a fork's environment is written into
    assert b"CLUSTERCTL_WARM_PAD" not in block and block.endswith(b"\0" * 100_000)  # NULs: a scan stops there
    # an adopting supervisor's: it takes the name over, the first one ends (idle) though still held
    again = subprocess.Popen(probe.local_argv("warm", "wr1", "n1"), env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    again.stdin.write(spec)
    again.stdin.close()
    assert said(again) == ["listening", "ready"]
    assert z.wait(20) == 0 and sock.is_socket()  # the name now the second one's
    z, first = again, z
    check = subprocess.run(probe.local_argv("warm", "check", "wr1", "n1"), env=env, capture_output=True, text=True,
                           timeout=30)
    assert json.loads(check.stdout) == {"serving": True, "importing": False}
    from orchestrator.remote.warm import for_key

    monkeypatch.setenv("HOME", str(home))  # the waiter's lookup, by any attempt's key
    assert for_key("wr1.a3@n1") == str(sock) and for_key("wr1@n1") == str(sock) and for_key("wr2@n1") is None
    first.stdout.close()
    z.stdout.close()  # the control machine lets go: idle, it ends, its socket and directory with it
    assert z.wait(10) == 0
    assert not sock.parent.exists()


def test_an_asker_that_gives_up_before_it_commits_leaves_no_fork_that_ran(warm):
    """The fork runs no line of the rank until its asker says `go`: an asker that timed out and
    started cold meanwhile has no twin writing into its log or handing its output to the waiter."""
    import json
    import socket

    env, d = warm
    out = d / "out.txt"
    with open(out, "w") as f:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(env["CLUSTERCTL_WARM"])
        req = {"argv": [sys.executable, "-u", str(d / "job.py"), "0"], "cwd": str(d), "env": env, "umask": 0o22}
        socket.send_fds(s, [json.dumps(req).encode()], [0, f.fileno(), f.fileno()])
        line = s.recv(64)
        assert line.startswith(b"pid "), line
        pid = int(line.split()[1])
        s.close()  # gave up: no `go`
    assert wait_for(lambda: pid_ended(pid), 10, "the fork")
    time.sleep(0.5)
    assert out.read_text() == ""  # it never ran the job


def test_a_bad_spec_ends_warm_run_node_in_one_line_not_a_traceback(tmp_path):
    from orchestrator import probe

    for bad in ("{not json", "[1, 2]", '{"env": "FOO=1"}'):
        r = subprocess.run(probe.local_argv("warm", "wr1", "n1"), input=bad, capture_output=True, text=True,
                           timeout=30, env={**os.environ, "HOME": str(tmp_path)})
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "the spec on stdin is not a JSON object" in r.stderr


def test_warm_interpreters_go_to_the_nodes_a_restart_may_use_only():
    """The current attempt's nodes and the spares left; not a quarantined node, not one left out of
    the run; before the first attempt, the ranked nodes."""
    from orchestrator.inventory import parse_inventory
    from orchestrator.runs.warmpool import restart_nodes

    spare = {i: ", spare: true" if i > 3 else "" for i in range(1, 7)}
    inv = parse_inventory("nodes:\n" + "".join(f"  - {{name: n{i}, host: 10.0.0.{i}{spare[i]}}}\n" for i in spare))
    assert restart_nodes(inv, None, ["n4", "n5", "n6"], set()) == ["n1", "n2", "n3", "n4", "n5", "n6"]
    assert restart_nodes(inv, ["n1", "n4", "n3"], ["n5", "n6"], {"n6", "n2"}) == ["n1", "n4", "n3", "n5"]
    assert restart_nodes(inv, None, ["n4"], {"n1"}) == ["n2", "n3", "n4"]


@pytest.mark.slow
@pytest.mark.parametrize("first", ["step", "collective", "neither"])
def test_the_warm_interpreters_start_once_the_run_progressed_else_after_the_wait(tmp_path, first):
    """Once the step journal shows the run's first step (or, for a script that says none, its
    first collective) the first attempt's start is over: they start then, not `after` seconds into
    the run; a run that shows neither gets them at `after`, and one that ends sooner none."""
    from orchestrator.runs import stepjournal
    from orchestrator.runs.warmpool import WarmPool

    started = []

    class Pool(WarmPool):
        def add(self, names):  # the node side is tests/test_warm_cluster.py's
            started.append(names)

    journal = stepjournal.StepJournal(tmp_path, 1)
    after = 3.0 if first == "neither" else 600.0
    pool = Pool(None, None, "r", print, lambda: ["n1", "n2"], after=after,
                progressed=lambda: stepjournal.progressed(tmp_path))
    pool.start()
    time.sleep(1.5)
    assert started == []  # the attempt is still starting
    if first == "step":
        journal.line("step 1 | loss 2.5 | lr 1e-4")
    elif first == "collective":
        journal.hook(None, 3)
    assert wait_for(lambda: started, 10, "the warm interpreters started") == [["n1", "n2"]]
    assert pool.thread is not None
    pool.thread.join(5)
    ended = Pool(None, None, "r", print, lambda: ["n1"], after=1.0)
    ended.start()
    ended.close()
    ended.thread.join(5)
    assert started == [["n1", "n2"]] and not ended.thread.is_alive()


@pytest.mark.slow
def test_the_pool_starts_a_warm_interpreter_again_where_one_ended_and_lets_every_one_go(tmp_path, monkeypatch):
    """Two `connection: local` nodes, the real `warm RUN NODE` on each: one that dies (its
    connection dropped, or killed) is started again at the pool's next look; `close` lets the
    others go, and they end."""
    import json

    from orchestrator.inventory import parse_inventory
    from orchestrator.runs.warmpool import WarmPool
    from orchestrator.transport import Cluster

    monkeypatch.setenv("HOME", str(tmp_path))
    nodes = "".join(f"  - {{name: n{i}, connection: local, gpus: 0, workdir: {json.dumps(str(tmp_path))}}}\n"
                    for i in range(2))
    inv = parse_inventory(f"python: {json.dumps(sys.executable)}\nnodes:\n{nodes}")

    def zygotes():
        out = {}
        for p in psutil.process_iter():
            try:
                key = p.environ().get("CLUSTERCTL_RUN_KEY", "")
            except psutil.Error:
                continue
            if key.startswith("wp1.warm@"):
                out[key.split("@")[1]] = p
        return out

    said = []
    with Cluster(inv) as cluster:
        cluster.connect()
        pool = WarmPool(cluster, inv, "wp1", said.append, lambda: ["n0", "n1"], after=0, recheck=0.5)
        pool.start()
        # importing torch (seconds): the straggler watch holds meanwhile; then each says `ready`
        wait_for(lambda: pool.importing() == ["n0", "n1"], 30, "both importing", interval=0.02)
        wait_for(lambda: pool.importing() == [], 90, "both ready")
        assert pool.ready == {"n0", "n1"}
        first = wait_for(lambda: (z := zygotes()).keys() == {"n0", "n1"} and z, 90, "one on each node")
        sock = tmp_path / ".clusterctl" / "warm" / "wp1@n1" / "sock"
        wait_for(lambda: sock.is_socket(), 90, "n1's listening")
        first["n1"].kill()
        again = wait_for(lambda: (z := zygotes()).get("n1") and z["n1"].pid != first["n1"].pid and z, 90,
                         "n1's started again")
        assert again["n0"].pid == first["n0"].pid  # the live one is left as it is
        assert pool.starts == {"n0": 1, "n1": 2}
        wait_for(lambda: pool.importing() == [] and pool.ready == {"n0", "n1"}, 90, "the new one on n1 ready")
        assert any("n1 again" in s for s in said), said
        pool.close()
        wait_for(lambda: not zygotes(), 30, "every one gone once let go")


def test_before_a_launch_the_pool_starts_one_on_each_node_and_returns_once_their_sockets_listen(tmp_path,
                                                                                               monkeypatch):
    """The first attempt's torchrun and ranks fork from the warm interpreters (one import of torch
    on a node): `before_launch` starts one on each of the attempt's nodes and returns once each
    socket is there, the launch's waiter then handing it on (agent_waiter.py `for_key`). A node
    whose one cannot start (no such interpreter) is not waited for and not named."""
    import json

    from orchestrator.inventory import parse_inventory
    from orchestrator.runs.warmpool import WarmPool
    from orchestrator.transport import Cluster

    monkeypatch.setenv("HOME", str(tmp_path))
    nodes = "".join(f"  - {{name: n{i}, connection: local, gpus: 0, workdir: {json.dumps(str(tmp_path))}}}\n"
                    for i in range(2))
    nodes += f"  - {{name: n2, connection: local, gpus: 0, python: {json.dumps(str(tmp_path / 'no-python'))}}}\n"
    inv = parse_inventory(f"python: {json.dumps(sys.executable)}\nnodes:\n{nodes}")
    said = []
    with Cluster(inv) as cluster:
        cluster.connect()
        pool = WarmPool(cluster, inv, "wp2", said.append, lambda: ["n0", "n1", "n2"], after=3600)
        try:
            assert pool.before_launch(["n0", "n1", "n2"], timeout=60) == ["n0", "n1"]
            for n in ("n0", "n1"):
                sock = tmp_path / ".clusterctl" / "warm" / f"wp2@{n}" / "sock"
                assert sock.is_socket()  # where the waiter looks; a rank asking now waits while it imports
            assert said and said[0].startswith("warm interpreters: starting on n0, n1, n2 (the ranks fork"), said
            wait_for(lambda: pool.importing() == [] and pool.ready == {"n0", "n1"}, 90, "both imported")
            assert pool.before_launch(["n0", "n1"]) == ["n0", "n1"] and pool.starts["n0"] == 1  # none again
        finally:
            pool.close()


def test_what_a_dead_warm_interpreter_left_is_swept_and_nothing_live_or_new(tmp_path):
    """`warm RUN NODE` first removes what dead ones left (killed while importing: a socket nobody
    listens on, a mark naming a dead pid, in a directory untouched for STALE_S); a listening one's
    directory, one whose importer lives, and one just made (its interpreter about to bind) stay."""
    import socket

    from orchestrator.remote import warm_socket
    from orchestrator.remote.warm_client import mark_of

    def run_dir(name, listening=False, mark=None, age=2 * warm_socket.STALE_S):
        d = tmp_path / name
        d.mkdir()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(d / "sock"))
        if listening:
            s.listen(1)
            keep.append(s)
        else:
            s.close()  # its name stays, nobody behind it
        if mark is not None:
            Path(mark_of(str(d / "sock"))).write_text(f"{mark}\n")
        os.utime(d, (time.time() - age, time.time() - age))
        return d

    keep = []
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        run_dir("ws1@n1")  # killed once it had bound: no mark
        run_dir("ws2@n1", mark=dead.pid)  # killed while importing
        run_dir("ws3@n1", listening=True)  # serving
        run_dir("ws4@n1", mark=os.getpid())  # importing, not bound yet by this test's reckoning
        run_dir("ws5@n1", age=0)  # just made
        assert warm_socket.sweep(str(tmp_path)) == ["ws1@n1", "ws2@n1"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ws3@n1", "ws4@n1", "ws5@n1"]
        assert warm_socket.sweep(str(tmp_path / "none")) == []
    finally:
        for s in keep:
            s.close()


def test_a_node_run_key_is_read_one_way_everywhere():
    from orchestrator.remote.agent_claims import family
    from orchestrator.remote.common import split_key

    assert split_key("r-1.a12@n1") == ("r-1", "a12", "n1")
    assert split_key("r-1.warm@n1") == ("r-1", "warm", "n1")
    assert split_key("r-1@n1") == ("r-1", "", "n1")
    assert split_key("r.ab@n1") == ("r.ab", "", "n1")  # not an attempt's: part of the run id
    mine = family("r-1@n1")
    assert [mine(k) for k in ("r-1@n1", "r-1.a3@n1", "r-1.warm@n1", "r-1.a3@n2", "r-12.a3@n1")] == \
        [True, True, False, False, False]


def test_torchrun_itself_is_forked_warm_and_its_workers_in_turn(warm):
    """The waiter's `python -m torch.distributed.run`: the hook has the warm interpreter fork it
    (torch imported there once, not again per torchrun), notes the fork's pid in the run directory
    for the stop, and the fork's workers ask in turn. SIGTERM to the process the waiter started
    reaches torchrun, which ends its workers."""
    env, d = warm
    env = {k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK")}
    env["CLUSTERCTL_NODE_DIR"] = str(d)
    p = subprocess.Popen([sys.executable, "-u", "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                          "--nproc-per-node", "1", str(d / "job.py"), "sleep"], env=env, cwd=d,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        rank_fork, _ = fork_of(p)
        noted = int((d / "torchrun.fork").read_text())
        tr = psutil.Process(noted)
        zygote = tr.parent()
        assert noted != p.pid and zygote.environ()["CLUSTERCTL_RUN_KEY"] == "wr1.warm@n1"
        assert psutil.Process(rank_fork).parent().pid == zygote.pid  # the worker forked too
        asker = [c for c in tr.children() if c.environ().get("RANK") == "0"]
        assert len(asker) == 1 and asker[0].pid != rank_fork  # torchrun's worker stands in for it
        p.send_signal(signal.SIGTERM)
        p.wait(60)
        assert wait_for(lambda: all(pid_ended(x) for x in (noted, rank_fork, asker[0].pid)), 30, "torchrun and its worker")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
