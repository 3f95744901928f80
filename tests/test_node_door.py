"""orchestrator/node/: the one command form and the one reading of a node's answer.

The command lines are held to what each caller built by hand before the door (the strings below
are those builders' f-strings, kept here as the wire's record), so moving them changed no byte a
node receives, except where noted."""

import json
import shlex

import pytest

from orchestrator import shell
from orchestrator.inventory import parse_inventory
from orchestrator.node import (artifacts, ckptdir, drill, form, netprobe, nodeinfo, portlisten, preflight, pyenv, relay,
                               wire)
from orchestrator.probe import program
from orchestrator.transport import NodeResult
from orchestrator.transport.base import ErrorKind


def node(share: bool = False, python: str = "~/venv/bin/python"):
    inv = parse_inventory(f"python: {json.dumps(python)}\nworkdir: ~/w x\nshare_with_group: {str(share).lower()}\n"
                          "nodes:\n  - {name: n0, host: 10.0.0.5, gpus: 0}\n")
    return inv.node("n0")


def src(name: str) -> str:
    return program(name).decode()


# ------------------------------------------------------------------ the form, byte for byte


def test_a_program_on_stdin_with_every_argument_one_word():
    n = node(share=True)
    e = artifacts.command(n, "prune", "/d i r", 3)
    assert e.command == f"{n.program_env}\"$HOME\"/venv/bin/python - prune '/d i r' 3"
    assert e.stdin == program("artifacts")
    assert n.program_env  # the share_with_group assignment went in front
    hostile = artifacts.tree(n, {"path": "a'b;$(rm -rf ~)"})
    assert shlex.split(hostile.command)[-1] == json.dumps({"path": "a'b;$(rm -rf ~)"})


def test_the_loader_form_puts_the_program_length_prefixed_before_the_callers_data():
    n = node()
    e = ckptdir.command(n, "look", "/ck", "/p", 2.0, 1.0, "-")
    assert e.command == f"\"$HOME\"/venv/bin/python -c {shell.quote(form.LOADER)} look /ck /p 2.0 1.0 -"
    body = program("ckptdir")
    assert e.stdin == str(len(body)).encode() + b"\n" + body
    assert b"".join(e.then([b"DATA"])) == e.stdin + b"DATA"
    call = ckptdir.call(n, "digest", "/d", data=b"[1]")
    assert call.stdin == e.stdin + b"[1]" and call.timeout == ckptdir.TIMEOUT


def test_the_relay_and_nodeinfo_lines_are_the_ones_sync_and_the_pair_built():
    n = node(share=True)
    got = relay.end(n, "ab12", "recv", "~/dst", idle=120.0, connect=5.0, listen=n.address).command
    assert got == (f"{n.program_env}CLUSTERCTL_XFER=ab12 {shell.path(n.python)} -c {shell.quote(src('relay'))} "
                   f"recv ab12 {shell.path('~/dst')} --idle 120 --connect-timeout 5 --listen {shell.quote(n.address)}")
    assert relay.stop(n, "ab12", "~/dst", python="/opt/py").command == \
        f"{shell.path('/opt/py')} -c {shell.quote(src('relay'))} stop ab12 {shell.path('~/dst')}"
    assert relay.changed(n, n.workdir).command == \
        f"{shell.path(n.python)} -c {shell.quote(src('relay'))} changed {shell.path(n.workdir)}"
    outputs = ["--output", "~/w x/runs"]
    assert nodeinfo.prune(n, outputs).command == (
        f"{shell.path(n.python)} -c {shell.quote(src('nodeinfo'))} prune "
        f"{shell.path(n.workdir)} {shell.join(outputs)}").rstrip()
    assert nodeinfo.prune(n, []).command == (
        f"{shell.path(n.python)} -c {shell.quote(src('nodeinfo'))} prune {shell.path(n.workdir)} ").rstrip()
    assert nodeinfo.workdir(n, "select", outputs, "--include", "*.py", timeout=5).command == (
        f"{shell.path(n.python)} -S -c {shell.quote(src('nodeinfo'))} select "
        f"{shell.path(n.workdir)} {shell.join([*outputs, '--include', '*.py'])}")
    assert nodeinfo.send(n, "ab12", "~/w x", idle=120.0, connect=5.0).command == (
        f"CLUSTERCTL_XFER=ab12 {shell.path(n.python)} -c {shell.quote(src('nodeinfo'))} send "
        f"{shell.path('~/w x')} --idle 120 --connect-timeout 5")


def test_setup_drill_netbench_and_the_listener_lines():
    n = node(share=True)
    assert pyenv.command(n, "~/base/python3", "install", "~/.venv", "~/.cache/clusterctl", "abc", "--online").command \
        == f"{shell.path('~/base/python3')} -c {shell.quote(src('pyenv'))} " + \
        " ".join(shell.path(a) for a in ("install", "~/.venv", "~/.cache/clusterctl", "abc", "--online"))
    marked = drill.call(n, "signal", "r1.a2@n0", 19, "3", run_id="r 1", timeout=60)
    assert marked.command == f"{n.program_env}CLUSTERCTL_DRILL={shell.quote('r 1')} {shell.path(n.python)} - " \
                             f"{shell.join(['signal', 'r1.a2@n0', '19', '3'])}"
    assert marked.stdin == program("drill")
    assert drill.call(n, "left", "r1", run_id=None, timeout=60).command == \
        f"{n.program_env}{shell.path(n.python)} - left r1"
    env = {"NCCL_X": "a b"}
    assert netprobe.command(n, "allreduce", 0, 2, "10.0.0.5", 29500, env=env).command == \
        shell.exports(env) + " " + f"{shell.path(n.python)} - {shell.join(['allreduce', 0, 2, '10.0.0.5', 29500])}"
    assert portlisten.listen(n, 29500, 10.0, 2, "cc-listen-1").command == \
        f"{shell.path(n.python)} - {shell.join([29500, 10.0, 2, 'cc-listen-1'])}"


def test_the_preflight_probe_line_is_the_one_it_had():
    got = preflight.command("python_env,code_sync", "~/w x", "~/w x/runs", 29500, "", "10.0.0.1", "worker",
                            "~/v b/python", 5.0, ["--output", "out", "--exclude", "a'b"])
    assert got == "sh -s -- python_env,code_sync \"$HOME\"/'w x' \"$HOME\"/'w x/runs' 29500 '' 10.0.0.1 worker " \
                  "\"$HOME\"/'v b/python' 5 --output out --exclude 'a'\"'\"'b'"
    assert preflight.command("ssh", "/w", "/o", 1, "e", "m", "master", "py", 0, []) == "sh -s -- ssh /w /o 1 e m master py 0"
    assert "want() {" in preflight.HEADER


def test_the_preflight_heredoc_is_the_one_it_had_and_refuses_a_program_holding_its_end():
    text = src("nodeinfo")
    assert nodeinfo.probe_text() == '"$py" -S - info "$pwd_arg" "$@" 2>&1 <<\'PYEOF\'\n' + text + "PYEOF\n"
    with pytest.raises(ValueError, match="heredoc end"):
        form.heredoc("nodeinfo", '"$py"', end=text.splitlines()[3])


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
