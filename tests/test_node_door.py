"""orchestrator/node/: the one command form and the one reading of a node's answer.

The command lines are held byte for byte (the strings below are the wire's record): every
program runs from the node code through the one boot line, its arguments one shell word
each."""

import io
import json
import os
import shlex
import shutil
import sys
import tarfile

import pytest

from orchestrator import probe, shell
from orchestrator.inventory import parse_inventory
from orchestrator.node import (agent, artifacts, ckptdir, drill, form, netprobe, nodeinfo, portlisten, preflight, pyenv,
                               relay, wire)
from orchestrator.transport import Cluster, NodeResult, wait
from orchestrator.transport.base import ErrorKind


def node(share: bool = False, python: str = "~/venv/bin/python"):
    inv = parse_inventory(f"python: {json.dumps(python)}\nworkdir: ~/w x\nshare_with_group: {str(share).lower()}\n"
                          "nodes:\n  - {name: n0, host: 10.0.0.5, gpus: 0}\n")
    return inv.node("n0")


def boot(python: str, program: str, flags: str = "") -> str:
    """The head of every node program's line: `PYTHON [FLAGS] -c BOOT CODE PROGRAM`."""
    return f"{python} {flags + ' ' if flags else ''}-c {shell.quote(probe.BOOT)} " \
           f"{shell.path(probe.node_code_path())} {program}"


# ------------------------------------------------------------------ the form, byte for byte


def test_every_program_runs_from_the_node_code_with_every_argument_one_word():
    n = node(share=True)
    e = artifacts.command(n, "prune", "/d i r", 3)
    assert e.command == f"{n.program_env}{boot(chr(34) + '$HOME' + chr(34) + '/venv/bin/python', 'artifacts')} " \
                        "prune '/d i r' 3"
    assert e.stdin is None  # the program is on the node already: stdin is the caller's
    assert n.program_env  # the share_with_group assignment went in front
    hostile = artifacts.tree(n, {"path": "a'b;$(rm -rf ~)"})
    assert shlex.split(hostile.command)[-1] == json.dumps({"path": "a'b;$(rm -rf ~)"})
    words = shlex.split(hostile.command)
    at = words.index("-c")
    assert words[at + 1:at + 4] == [probe.BOOT, probe.node_code_path().replace("~", "$HOME", 1), "artifacts"]


def test_a_verbs_data_is_the_whole_stdin():
    n = node()
    e = ckptdir.command(n, "look", "/ck", "/p", 2.0, 1.0, "-")
    assert e.command == f"{boot(shell.path(n.python), 'ckptdir')} look /ck /p 2.0 1.0 -"
    assert e.stdin is None and b"".join(e.then([b"DATA"])) == b"DATA"
    call = ckptdir.call(n, "digest", "/d", data=b"[1]")
    assert call.stdin == b"[1]" and call.timeout == ckptdir.TIMEOUT


def test_the_relay_and_nodeinfo_lines():
    n = node(share=True)
    py = shell.path(n.python)
    got = relay.end(n, "ab12", "recv", "~/dst", idle=120.0, connect=5.0, listen=n.address).command
    assert got == (f"{n.program_env}CLUSTERCTL_XFER=ab12 {boot(py, 'relay')} "
                   f"recv ab12 {shell.path('~/dst')} --idle 120 --connect-timeout 5 --listen {shell.quote(n.address)}")
    assert relay.stop(n, "ab12", "~/dst", python="/opt/py").command == \
        f"{boot(shell.path('/opt/py'), 'relay')} stop ab12 {shell.path('~/dst')}"
    assert relay.changed(n, n.workdir).command == f"{boot(py, 'relay')} changed {shell.path(n.workdir)}"
    outputs = ["--output", "~/w x/runs"]
    assert nodeinfo.prune(n, outputs).command == (
        f"{boot(py, 'nodeinfo')} prune {shell.path(n.workdir)} {shell.join(outputs)}")
    assert nodeinfo.prune(n, []).command == f"{boot(py, 'nodeinfo')} prune {shell.path(n.workdir)}"
    assert nodeinfo.workdir(n, "select", outputs, "--include", "*.py", timeout=5).command == (
        f"{boot(py, 'nodeinfo', '-S')} select {shell.path(n.workdir)} {shell.join([*outputs, '--include', '*.py'])}")
    assert nodeinfo.send(n, "ab12", "~/w x", idle=120.0, connect=5.0).command == (
        f"CLUSTERCTL_XFER=ab12 {boot(py, 'nodeinfo')} send {shell.path('~/w x')} --idle 120 --connect-timeout 5")


def test_setup_drill_netbench_and_the_listener_lines():
    n = node(share=True)
    py = shell.path(n.python)
    assert pyenv.command(n, "~/base/python3", "install", "~/.venv", "~/.cache/clusterctl", "abc", "--online").command \
        == f"{boot(shell.path('~/base/python3'), 'pyenv')} " + \
        " ".join(shell.path(a) for a in ("install", "~/.venv", "~/.cache/clusterctl", "abc", "--online"))
    marked = drill.call(n, "signal", "r1.a2@n0", 19, "3", run_id="r 1", timeout=60)
    assert marked.command == f"{n.program_env}CLUSTERCTL_DRILL={shell.quote('r 1')} {boot(py, 'drill')} " \
                             f"{shell.join(['signal', 'r1.a2@n0', '19', '3'])}"
    assert marked.stdin is None
    assert drill.call(n, "left", "r1", run_id=None, timeout=60).command == \
        f"{n.program_env}{boot(py, 'drill')} left r1"
    env = {"NCCL_X": "a b"}
    assert netprobe.command(n, "allreduce", 0, 2, "10.0.0.5", 29500, env=env).command == \
        shell.exports(env) + " " + f"{boot(py, 'netprobe')} {shell.join(['allreduce', 0, 2, '10.0.0.5', 29500])}"
    assert portlisten.listen(n, 29500, 10.0, 2, "cc-listen-1").command == \
        f"{boot(py, 'portlisten')} {shell.join([29500, 10.0, 2, 'cc-listen-1'])}"


def test_the_preflight_probe_line_is_the_one_it_had():
    got = preflight.command("python_env,code_sync", "~/w x", "~/w x/runs", 29500, "", "10.0.0.1", "worker",
                            "~/v b/python", 5.0, ["--output", "out", "--exclude", "a'b"])
    assert got == "sh -s -- python_env,code_sync \"$HOME\"/'w x' \"$HOME\"/'w x/runs' 29500 '' 10.0.0.1 worker " \
                  "\"$HOME\"/'v b/python' 5 --output out --exclude 'a'\"'\"'b'"
    assert preflight.command("ssh", "/w", "/o", 1, "e", "m", "master", "py", 0, []) == "sh -s -- ssh /w /o 1 e m master py 0"
    assert "want() {" in preflight.HEADER


def test_the_preflight_probe_runs_nodeinfo_from_the_node_code_without_site():
    assert nodeinfo.probe_text() == f'{boot(chr(34) + "$py" + chr(34), "nodeinfo", "-S")} info "$pwd_arg" "$@" 2>&1\n'


# ------------------------------------------------------------------ replies


def result(stdout: str = "", code: int | None = 0, stderr: str = "", kind=None) -> NodeResult:
    return NodeResult("n0", code, stdout=stdout, stderr=stderr, kind=kind)


def test_an_answer_is_the_last_json_line_and_a_bad_one_is_an_error_not_a_raise():
    assert wire.read_answer(result("motd\n{\"a\": 1}\n\n")) == wire.Answer({"a": 1}, None, 0)
    for bad, why in (("", "no answer"), ("not json\n", "JSONDecodeError"), ("[1]\n", "not a JSON dict")):
        got = wire.read_answer(result(bad), program="ckptdir")
        assert got.doc is None and not got.ok and "unreadable ckptdir answer" in got.error and why in got.error
    failed = wire.read_answer(result("", 3, "boom\n"))
    assert failed.exit_code == 3 and failed.error.endswith("boom") and failed.doc is None
    lost = wire.read_answer(result("", None, "", ErrorKind.LOST))
    assert lost.error and lost.exit_code is None
    assert wire.read_answer(result("[1, 2]\n"), list).doc == [1, 2]


def test_a_json_answer_is_frozen():
    with pytest.raises(AttributeError):
        wire.Answer({}).error = "x"  # type: ignore[misc]


def test_the_typed_replies_of_the_clients():
    assert artifacts.prepare(node(), "r1").read(result('{"checkpoints": "/c"}\n')) == artifacts.Dirs({"checkpoints": "/c"})
    assert artifacts.held(node(), "/c", "/r").read(result("oops\n")).error.startswith("unreadable artifacts answer")
    assert nodeinfo.read_workdir(result("{\"code\": {}}\n")) == nodeinfo.Workdir({"code": {}})
    assert nodeinfo.read_workdir(result("", 1, "a\nno such dir\n")) == nodeinfo.Workdir(error="no such dir")
    assert pyenv.read(result("", 1, "error: no venv\n"), "cannot run") == pyenv.Report(error="no venv")
    assert netprobe.read(result("", 2, "refused\n")).error == f"{result('', 2).describe()}: refused"
    assert artifacts.read_poll(b'[{"name": "c"}]\nFRAMES') == ([{"name": "c"}], b"FRAMES")
    assert artifacts.read_poll(b"torn") == (None, b"")


def test_the_line_readers():
    assert relay.read_line("port 4242") == relay.Said("port", 4242)
    assert relay.read_line("done 10 3") == relay.Said("done", 10, 3)
    assert relay.read_line("done 10") == relay.Said("done", 10, 0)
    assert relay.read_line("link-failed no route") == relay.Said("link-failed", text="no route")
    assert relay.read_line("sent 5 abc") == relay.Said("sent", 5, text="abc")
    assert [relay.read_line(x) for x in ("", "port x", "done x", "Traceback (most recent call last):")] == [None] * 4
    assert relay.read_changed("changed 7 2\nrsync yes\n") == (7, True) and relay.read_changed("x") is None
    assert netprobe.listening_port("listening 4242") == 4242 and netprobe.listening_port("busy") is None
    assert portlisten.read_first("listening 77") == portlisten.Listening(pid=77)
    assert portlisten.read_first("busy 98 Address in use").busy
    assert portlisten.read_first("") == portlisten.Listening(error="no answer")
    assert wire.progress_of('clusterctl-progress: {"step": "x", "bytes": 3}') == ("x", 3)


# ------------------------------------------------------------------ the code placed on the nodes, once


def local_cluster(tmp_path, monkeypatch, n: int = 2):
    monkeypatch.setenv("HOME", str(tmp_path))
    nodes = "\n".join(f"  - {{name: n{i}, connection: local, gpus: 0}}" for i in range(n))
    return Cluster(parse_inventory(f"python: {json.dumps(sys.executable)}\nnodes:\n{nodes}\n"))


class Counting:
    """A connection that counts the commands run on it."""

    def __init__(self, conn):
        self.conn, self.lines = conn, []

    def __getattr__(self, name):
        return getattr(self.conn, name)

    def exec(self, command, *, stdin=None, keep_stdin=False):
        self.lines.append(command)
        return self.conn.exec(command, stdin=stdin, keep_stdin=keep_stdin)


def test_the_code_is_sent_where_it_is_missing_once_per_connection_and_again_after_it_went(tmp_path, monkeypatch):
    placed = tmp_path / probe.node_code_path().removeprefix("~/")
    with local_cluster(tmp_path, monkeypatch) as cluster:
        counted = {name: Counting(c) for name, c in cluster.connections.items()}
        cluster.connections.update(counted)
        assert form.place(cluster) == {}
        with tarfile.open(fileobj=io.BytesIO(probe.node_code()[1])) as tar:
            sent = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        assert {p.relative_to(placed).as_posix(): p.read_bytes() for p in placed.rglob("*") if p.is_file()} == sent
        assert placed.parent.stat().st_mode & 0o777 == 0o700
        # two local nodes share one home: the first sent it (or both raced to), each looked once
        assert all(c.lines[0] == form.check_command() for c in counted.values())
        assert sum(len(c.lines) for c in counted.values()) in (3, 4)
        before = {name: len(c.lines) for name, c in counted.items()}
        assert agent.run(cluster, agent.claims)["n0"].error is None  # placed: only the agent's own line
        assert {name: len(c.lines) - before[name] for name, c in counted.items()} == {"n0": 1, "n1": 1}
        assert list(placed.glob(f"{probe.PACKAGE}/__pycache__/node_agent.*.pyc"))  # compiled once, kept
        shutil.rmtree(placed)  # removed by hand under open connections
        got = agent.run(cluster, agent.claims, ["n0"])["n0"]
        assert got.error is None and (placed / probe.PACKAGE / probe.COMPLETE).is_file()  # placed again, asked again
        assert not list(placed.parent.glob(".in.*")) and not list(placed.glob(".in.*"))
    assert form.missing(NodeResult("n0", 97, stderr=f"{probe.MISSING} ~/x")) and not form.missing(NodeResult("n0", 97))


def test_a_nodes_cache_keeps_the_newest_versions(tmp_path, monkeypatch):
    cache = tmp_path / probe.CACHE.removeprefix("~/")
    cache.mkdir(parents=True)
    for i in range(form.KEEP + 4):  # older versions, oldest first
        old = cache / f"{i:020x}"
        old.mkdir()
        os.utime(old, (1_600_000_000 + i, 1_600_000_000 + i))
    with local_cluster(tmp_path, monkeypatch, n=1) as cluster:
        assert form.place(cluster) == {}
    kept = sorted(p.name for p in cache.iterdir())
    assert len(kept) == form.KEEP and probe.node_code()[0] in kept
    assert f"{0:020x}" not in kept and f"{form.KEEP + 3:020x}" in kept


def test_a_cut_upload_leaves_nothing_behind(tmp_path, monkeypatch):
    """Its last member marks a whole copy: a stream cut short is never taken for the code."""
    with local_cluster(tmp_path, monkeypatch, n=1) as cluster:
        r = wait(cluster.connections["n0"].exec(form.install_command(), stdin=probe.node_code()[1][:20000]), 30)
    assert r.exit_code == 1 and "could not write its node code" in r.stderr
    cache = tmp_path / probe.CACHE.removeprefix("~/")
    assert not list(cache.iterdir())


def test_preflight_places_the_code_only_where_its_probe_found_none_and_asks_no_more(tmp_path, monkeypatch):
    """The probe runs nodeinfo from the node code without a `test -f` first: a node without the
    code answers probe.MISSING, gets it and is asked again in the same round; a warm node costs
    the probe alone, and the commands after it on the same connection place nothing."""
    from orchestrator.checks.preflight import run_preflight

    placed = tmp_path / probe.node_code_path().removeprefix("~/")
    for run in ("cold", "warm"):
        with local_cluster(tmp_path, monkeypatch, n=1) as cluster:
            counted = Counting(cluster.connections["n0"])
            cluster.connections["n0"] = counted
            rep = run_preflight(cluster, cluster.inventory, ["python_env"])
            env = rep.nodes[0].results["python_env"]
            assert env.status != "fail" or probe.MISSING not in env.detail, env.detail
            assert (placed / probe.PACKAGE / probe.COMPLETE).is_file()
            probes = [line for line in counted.lines if line.startswith("sh -s")]
            assert len(probes) == (2 if run == "cold" else 1), counted.lines
            assert any(line == form.check_command() for line in counted.lines) == (run == "cold")
            n = len(counted.lines)
            assert agent.run(cluster, agent.claims)["n0"].error is None
            assert len(counted.lines) == n + 1  # known from the probe: no `test -f` before the agent


def test_a_probe_run_here_places_the_code_here_first(tmp_path, monkeypatch):
    """`launch --from-env` probes its own machine: the node code is placed under this HOME first,
    so its nodeinfo runs (before, a machine without this version answered MISSING)."""
    from orchestrator.checks.preflight import probe_locally

    monkeypatch.setenv("HOME", str(tmp_path))
    inv = parse_inventory(f"python: {json.dumps(sys.executable)}\nnodes:\n  - {{name: a, connection: local}}\n")
    text = probe_locally(inv, inv.nodes[0], ["python_env"])
    assert probe.MISSING not in text and '"python"' in text, text[-2000:]
    assert (tmp_path / probe.node_code_path().removeprefix("~/") / probe.PACKAGE / probe.COMPLETE).is_file()
    assert form.place_here() is None  # there now: nothing to do
