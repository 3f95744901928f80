"""The node's one stream (`tail KEY OFFSET stream CKPTDIR|- TBDIR OFFSETS_HEX`), run locally as it
is shipped (remote/artifacts.py prepended to the agent), and read by the control side's Frames."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator import probe
from orchestrator.node import agent
from orchestrator.runs.logs import copier as log_copier
from orchestrator.node.agent import AgentStatus, StreamFrom
from orchestrator.runs.ckpt.given_home import ArtifactCopier
from orchestrator.runs.logs.copier import Frames, LogCopier
from orchestrator.runs.runrecord import RunRecord
from tests.test_straggler import LAUNCH  # the hooked rank under the process the waiter starts

REMOTE = Path(__file__).parent.parent / "orchestrator" / "remote"
JOB = r"""
import hashlib, os, sys, time
ck, tb = os.environ["CK"], os.environ["TB"]
os.makedirs(os.path.join(tb, "sub"), exist_ok=True)
for step in range(1, 13):
    sys.stdout.buffer.write(b"step %d " % step + bytes(range(256)) * (40 if step % 4 == 0 else 1) + b"\n")
    sys.stdout.flush()
    with open(os.path.join(tb, "sub", "events.0"), "ab") as f:
        f.write(b"tb%d;" % step)
    if step % 4 == 0:
        name = os.path.join(ck, "ckpt_%08d.pt" % step)
        data = os.urandom(5000)
        with open(name + ".sha256", "w") as f:
            f.write(hashlib.sha256(data).hexdigest() + "  ckpt_%08d.pt\n" % step)
        with open(name + ".tmp", "wb") as f:
            f.write(data)
        os.replace(name + ".tmp", name)
    time.sleep(0.4)
"""


def agent_env(tmp_path):
    return dict(os.environ, HOME=str(tmp_path), CK=str(tmp_path / "ck"), TB=str(tmp_path / "tb"))


def start_job(tmp_path, key):
    (tmp_path / "ck").mkdir()
    spec = {"argv": [sys.executable, "-c", JOB], "cwd": str(tmp_path), "env": {}}
    r = subprocess.run(probe.local_argv("node_agent", "start", key, json.dumps(spec).encode().hex()),
                       stdin=subprocess.DEVNULL, env=agent_env(tmp_path), capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr


def stream(tmp_path, key, offset, tb_have, ckdir=None, progress_s=None):
    args = ["tail", key, str(offset), "stream", ckdir or str(tmp_path / "ck"), str(tmp_path / "tb"),
            json.dumps(tb_have).encode().hex(), *([str(progress_s)] if progress_s is not None else [])]
    return subprocess.Popen(probe.local_argv("node_agent", *args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=agent_env(tmp_path))


def records(proc, stop_after=None):
    """(head, body) records as they arrive; `stop_after(records)` true: the stream is cut there."""
    proc.stdin.close()
    frames, out = Frames(), []
    while chunk := os.read(proc.stdout.fileno(), 7001):  # odd pieces: records split anywhere
        out += list(frames.feed(chunk))
        if stop_after is not None and stop_after(out):
            proc.kill()
            break
    proc.wait(30)
    return out


@pytest.mark.slow
def test_log_checkpoints_tensorboard_and_status_on_one_stream_resumed_where_the_copy_ends(tmp_path):
    key = "ns1@n1"
    start_job(tmp_path, key)
    # the first stream is cut once it announced a checkpoint and sent some TensorBoard bytes
    first = records(stream(tmp_path, key, 0, {}), lambda rs: any(h["t"] == "ckpts" and json.loads(b) for h, b in rs)
                    and any(h["t"] == "tb" for h, _ in rs))
    log, tb = b"", {}
    for head, body in first:
        if head["t"] == "log":
            assert head["offset"] == len(log)
            log += body
        elif head["t"] == "tb":
            assert head["offset"] == tb.get(head["rel"], 0)
            tb[head["rel"]] = tb.get(head["rel"], 0) + len(body)
    assert not any(h["t"] == "end" for h, _ in first)
    # resumed at the copy's sizes: every byte once, the end status last
    second = records(stream(tmp_path, key, len(log), tb))
    kinds = [h["t"] for h, _ in second]
    assert kinds[-1] == "end" and kinds.count("end") == 1
    for head, body in second[:-1]:
        if head["t"] == "log":
            assert head["offset"] == len(log)
            log += body
        elif head["t"] == "tb":
            assert head["offset"] == tb.get(head["rel"], 0)
            tb[head["rel"]] = tb.get(head["rel"], 0) + len(body)
    run = tmp_path / ".clusterctl" / "node-runs" / key
    assert log == (run / "log").read_bytes()
    assert tb == {"sub/events.0": (tmp_path / "tb" / "sub" / "events.0").stat().st_size}
    assert json.loads(second[-1][1])["exit_code"] == 0
    # the checkpoint list is the one `artifacts.py poll` prints, and only when it changed
    lists = [json.loads(b) for h, b in second if h["t"] == "ckpts"]
    assert lists[0] != [] and all(a != b for a, b in zip(lists, lists[1:]))
    poll = subprocess.run(probe.local_argv("artifacts", "poll", str(tmp_path / "ck"), str(tmp_path / "tb"), "-"),
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=30, env=agent_env(tmp_path))
    assert lists[-1] == json.loads(poll.stdout.split(b"\n", 1)[0])
    assert [c["name"] for c in lists[-1]] == ["ckpt_00000012.pt", "ckpt_00000008.pt", "ckpt_00000004.pt"]


@pytest.mark.slow
def test_without_a_checkpoint_directory_only_log_tensorboard_and_status(tmp_path):
    key = "ns2@n1"
    start_job(tmp_path, key)
    rs = records(stream(tmp_path, key, 0, {}, ckdir="-"))
    assert {h["t"] for h, _ in rs} == {"log", "tb", "end"}


HOOK = (REMOTE / "hook" / "sitecustomize.py").read_text()
RANK = """
import time
import sitecustomize
for step in range(1, 6):
    sitecustomize.clusterctl_step(step, step / 100)
print("ready", flush=True)
time.sleep(6)
"""


@pytest.mark.slow
def test_with_progress_s_the_stream_carries_the_ranks_progress_and_without_it_none(tmp_path):
    """The straggler watch's source: every PROGRESS_S s the stream asks the ranks' hooks, in its own
    process, and sends the answers (`snapshot ... progress`'s document) as records; a stream asked
    for none (an older control side) sends none."""
    key = "nsp1@n1"
    spec = {"argv": [sys.executable, "-c", LAUNCH], "cwd": str(tmp_path), "env": {"CHILD": RANK}, "hook": HOOK}
    r = subprocess.run(probe.local_argv("node_agent", "start", key, json.dumps(spec).encode().hex()),
                       stdin=subprocess.DEVNULL, env=agent_env(tmp_path), capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    with_progress, without = stream(tmp_path, key, 0, {}, "-", 0.5), stream(tmp_path, key, 0, {}, "-")
    got = {}
    threads = [threading.Thread(target=lambda n, p: got.__setitem__(n, records(p)), args=a)
               for a in (("with", with_progress), ("without", without))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [h["t"] for h, _ in got["with"]][-1] == "end" and [h["t"] for h, _ in got["without"]][-1] == "end"
    docs = [json.loads(b) for h, b in got["with"] if h["t"] == "progress"]
    assert len(docs) >= 2, [h for h, _ in got["with"]]  # ~6 s of run, a request every 0.5 s (a loaded machine: fewer)
    answered = [rank for doc in docs for rank in doc["ranks"] if "answer" in rank]
    assert answered and all(rank["rank"] == 0 for rank in answered), docs
    assert [st[:2] for st in answered[-1]["answer"]["steps"]] == [[s, s / 100] for s in range(1, 6)]
    assert not [h for h, _ in got["without"] if h["t"] == "progress"]
    assert b"ready" in b"".join(b for h, b in got["without"] if h["t"] == "log")


class Copier:
    def __init__(self, tmp_path):
        self.tb_dir, self.found = tmp_path / "tb-here", []

    def stream_from(self, node):
        return StreamFrom(None, "-")

    def on_checkpoints(self, node, found):
        self.found.append((node, found))

    def on_tb(self, node, head, body):
        from orchestrator.runs.curves import write_frame

        write_frame(head, body, self.tb_dir / node)


def test_the_control_side_demultiplexes_a_stream_cut_anywhere(tmp_path):
    """Records cut into single bytes, a reconnect half way through a record: the log copy gets each
    byte once, in order; checkpoint lists and TensorBoard bytes go to the copier."""
    (tmp_path / "nodes").mkdir()

    class Run:
        dir, record = tmp_path, RunRecord.from_json({"nodes": [{"name": "n1", "first_rank": 0}]})

        def node_log(self, name):
            return tmp_path / "nodes" / f"{name}.log"

    copier = Copier(tmp_path)
    lc = LogCopier(Run(), ["n1"], echo=print, artifacts=copier)
    assert lc.tail_stream("n1") == StreamFrom(None, "-")
    whole = bytes(range(256)) * 50
    ck = [{"name": "ckpt_00000004.pt", "step": 4, "kind": "file", "files": []}]
    data = (frame({"t": "log", "offset": 0}, whole[:3000]) + frame({"t": "ckpts"}, json.dumps(ck).encode())
            + frame({"t": "tb", "rel": "a/events", "offset": 0}, b"xyz") + frame({"t": "log", "offset": 3000},
                                                                                 whole[3000:9000]))
    for i in range(len(data) - 10):  # the last record arrives cut: its connection dropped
        lc.on_bytes("n1", "stdout", data[i:i + 1])
    assert lc.offset("n1") == 3000
    lc.tail_stream("n1")  # the reconnected tail starts afresh, at the copy's size
    again = frame({"t": "log", "offset": 3000}, whole[3000:]) + frame({"t": "end"}, b'{"exit_code": 0}')
    lc.on_bytes("n1", "stdout", again)
    lc.close()
    assert (tmp_path / "nodes" / "n1.log").read_bytes() == whole
    assert copier.found == [("n1", ck)] and (copier.tb_dir / "n1" / "a" / "events").read_bytes() == b"xyz"
    assert lc.final["n1"] == AgentStatus(exit_code=0)


def test_a_progress_sink_asks_the_streams_for_progress_and_gets_their_records(tmp_path):
    (tmp_path / "nodes").mkdir()

    class Run:
        dir, record = tmp_path, RunRecord.from_json({"nodes": [{"name": "n1", "first_rank": 0}]})

        def node_log(self, name):
            return tmp_path / "nodes" / f"{name}.log"

    fed = []
    lc = LogCopier(Run(), ["n1"], echo=print, artifacts=Copier(tmp_path), progress=lambda n, d: fed.append((n, d)),
                   progress_s=10.0)
    assert lc.tail_stream("n1") == StreamFrom(None, "-", progress_s=10.0)
    doc = {"ranks": [{"rank": 0, "answer": {"steps": [[1, 0.5]]}}], "time": 1.0}
    lc.on_bytes("n1", "stdout", frame({"t": "progress"}, json.dumps(doc).encode()))
    lc.close()
    assert fed == [("n1", doc)]
    node = SimpleNamespace(name="n1", python="python3", program_env="")
    assert agent.tail(node, "r", 0, StreamFrom(None, "-", progress_s=10.0)).command.split()[-1] == "10"
    assert agent.tail(node, "r", 0, StreamFrom(None, "-")).command.split()[-1] == json.dumps({}).encode().hex()
    # without a sink, the streams are not asked for progress
    plain = LogCopier(Run(), ["n1"], echo=print, artifacts=Copier(tmp_path))
    assert plain.tail_stream("n1").progress_s == 0.0
    plain.close()


def frame(head, body):
    return probe.load("artifacts").frame(head, body)


def test_the_record_kinds_are_the_node_sides():
    """The control side reads the kinds from remote/artifacts.py itself (one definition)."""
    from orchestrator.node import artifacts as door

    node = probe.load("artifacts")
    kinds = ("FRAME_LOG", "FRAME_TB", "FRAME_CKPTS", "FRAME_PROGRESS", "FRAME_END", "FRAME_STOPPING", "FRAME_SNAPSHOT",
             "FRAME_CLOCK")
    assert [getattr(door, k) for k in kinds] == [getattr(node, k) for k in kinds]
    assert [getattr(log_copier, k) for k in kinds] == [getattr(node, k) for k in kinds]


SLEEPER = r"""
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (print("term", flush=True), sys.exit(3)))
print("up", flush=True)
time.sleep(120)
"""


def ask_on_stdin(proc, ready: bytes, request: bytes):
    """The stream's records: read until `ready` is in its log, `request` written on its stdin, read
    on until its end record."""
    frames, got, log = Frames(), [], b""
    deadline = time.monotonic() + 60
    while ready not in log:
        assert time.monotonic() < deadline, got
        for head, body in frames.feed(os.read(proc.stdout.fileno(), 4096)):
            got.append((head, body))
            log += body if head["t"] == "log" else b""
    proc.stdin.write(request)
    proc.stdin.flush()
    while not any(h["t"] == "end" for h, _ in got):
        assert time.monotonic() < deadline, got
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, got
        got += list(frames.feed(chunk))
    proc.stdin.close()
    proc.wait(30)
    return got


def test_a_stop_asked_on_the_streams_stdin_is_answered_and_carried_out_by_the_woken_waiter(tmp_path):
    """The stream's stdin takes stop requests (a JSON line each): one that is not a request is
    answered with its error and changes nothing; a request is written as `stop` writes it, the
    waiter woken (SIGUSR1, which it blocks: it lives to record the exit code), the job ended with
    SIGTERM and its exit code the stream's end."""
    key = "ns9@n1"
    (tmp_path / "ck").mkdir()
    spec = {"argv": [sys.executable, "-c", SLEEPER], "cwd": str(tmp_path), "env": {}}
    r = subprocess.run(probe.local_argv("node_agent", "start", key, json.dumps(spec).encode().hex()),
                       stdin=subprocess.DEVNULL, env=agent_env(tmp_path), capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    run = tmp_path / ".clusterctl" / "node-runs" / key
    got = ask_on_stdin(stream(tmp_path, key, 0, {}), b"up",
                       b"not json\n" + json.dumps({"stop": 7, "peer_failed": False}).encode() + b"\n")
    answers = [json.loads(b) for h, b in got if h["t"] == "stopping"]
    assert "error" in answers[0] and answers[1:] == [{"stop": 7}]
    assert json.loads((run / "stop").read_text())["grace"] == 7
    assert json.loads(got[-1][1])["exit_code"] == 3
    assert b"term" in (run / "log").read_bytes()


def test_a_snapshot_asked_on_the_streams_stdin_is_every_ranks_stacks_as_the_verb_takes_them(tmp_path):
    """A snapshot request on the stream's stdin ({"snapshot": N, "wait": S}) is answered with a
    FRAME_SNAPSHOT record: the `snapshot` verb's document for request N (each rank's /proc state and
    its hook's stacks) with "ask": N, while the log goes on; nothing else is done to the run."""
    key = "nss1@n1"
    spec = {"argv": [sys.executable, "-c", LAUNCH], "cwd": str(tmp_path), "env": {"CHILD": RANK}, "hook": HOOK}
    r = subprocess.run(probe.local_argv("node_agent", "start", key, json.dumps(spec).encode().hex()),
                       stdin=subprocess.DEVNULL, env=agent_env(tmp_path), capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    got = ask_on_stdin(stream(tmp_path, key, 0, {}, "-"), b"ready",
                       json.dumps({"snapshot": 77, "wait": 5}).encode() + b"\n" + json.dumps({"clock": 78}).encode() + b"\n")
    docs = [json.loads(b) for h, b in got if h["t"] == "snapshot"]
    assert len(docs) == 1 and docs[0]["ask"] == 77, got
    [clock] = [json.loads(b) for h, b in got if h["t"] == "clock"]
    assert clock["clock"] == 78 and abs(clock["time"] - time.time()) < 60, clock  # the node's clock as it read it
    snap = agent.snapshot_of(docs[0])
    assert snap.error is None and [r["rank"] for r in snap.ranks] == [0], docs
    stacks = snap.ranks[0]["answer"]["stacks"]
    assert any("time.sleep" in json.dumps(th) or "<module>" in json.dumps(th) for th in stacks), stacks
    assert json.loads(got[-1][1])["exit_code"] == 0  # the run was not stopped by it
    assert not (tmp_path / ".clusterctl" / "node-runs" / key / "stop").exists()


def test_a_waiter_is_woken_only_where_its_record_says_it_takes_the_signal(tmp_path):
    """agent_stop.wake signals the waiter proc.json names only with its "wake" and its start time
    matching: an older waiter (no "wake") or a pid reused by another process is never sent SIGUSR1."""
    stop = probe.load("agent_stop")
    key = "ns10@n1"
    spec = {"argv": [sys.executable, "-c", SLEEPER], "cwd": str(tmp_path), "env": {}}
    r = subprocess.run(probe.local_argv("node_agent", "start", key, json.dumps(spec).encode().hex()),
                       stdin=subprocess.DEVNULL, env=agent_env(tmp_path), capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    run = tmp_path / ".clusterctl" / "node-runs" / key
    info = json.loads((run / "proc.json").read_text())
    assert info["wake"] == "SIGUSR1" and info["waiter_start"]
    assert not stop.wake({k: v for k, v in info.items() if k != "wake"})
    assert not stop.wake(dict(info, waiter_start="1"))
    assert stop.wake(info)  # no stop request written: the waiter wakes, looks, and goes on waiting
    time.sleep(0.5)
    os.kill(info["waiter"], 0)  # alive
    assert not (run / "exit_code").exists()
    subprocess.run(probe.local_argv("node_agent", "stop", key, "0"), stdin=subprocess.DEVNULL,
                   env=agent_env(tmp_path), capture_output=True, timeout=60)
    assert (run / "exit_code").exists()


def test_the_copier_hands_reported_checkpoints_to_its_thread_not_the_stream(tmp_path):
    """on_checkpoints returns at once; the copy runs on the copier's thread; a failed copy is tried
    again without news from the node."""
    release, calls = threading.Event(), []

    class Cluster:
        connections = {}

        def run(self, cmd, *, stdin, nodes, timeout, capture, on_bytes):
            calls.append(cmd(SimpleNamespace(python="python3", name=nodes[0], program_env="")))
            release.wait(10)
            from orchestrator.transport import NodeResult

            return {nodes[0]: NodeResult(nodes[0], 1)}

    copier = ArtifactCopier(Cluster(), tmp_path, {"n1": {"checkpoints": "/c", "tensorboard": "/t"}}, say=print)
    copier.start(lambda: ["n1"])
    t0 = time.monotonic()
    copier.on_checkpoints("n1", [{"name": "ckpt_00000004.pt", "step": 4, "kind": "file", "files": []}])
    assert time.monotonic() - t0 < 0.1
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls and "send" in calls[0]
    release.set()
    while len(calls) < 2 and time.monotonic() < deadline:  # failed: tried again after POLL_S
        time.sleep(0.05)
    copier.stop()
    assert len(calls) >= 2
    assert copier.stream_from("n1") == StreamFrom("/c", "/t", {}) and copier.stream_from("n2") is None

