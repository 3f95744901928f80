"""The node agent's one client (orchestrator/node/agent.py): the real agent run locally through it,
over `connection: local` nodes (its program on stdin, HOME a temporary directory), and its readers
on recorded answers."""

import json
import os
import re
import shlex
import sys

import pytest

from orchestrator import probe
from orchestrator.inventory import parse_inventory
from orchestrator.node import agent
from orchestrator.node.agent import (AgentStatus, Claim, Claimed, Claims, Live, Released, RunKey, Started,
                                     StartSpec, StopResult, StreamFrom)
from orchestrator.transport import Cluster, ErrorKind, NodeResult, wait
from tests.conftest import wait_for

RUN = "run-20261124-101428-e58f"
BOOT = ["-c", probe.BOOT, probe.node_code_path().replace("~", "$HOME", 1), "node_agent"]  # every verb's line starts so


def local_inv(python: str, n: int = 2):
    nodes = "\n".join(f"  - {{name: n{i}, connection: local, gpus: 0}}" for i in range(n))
    return parse_inventory(f"python: {json.dumps(python)}\nnodes:\n{nodes}\n")


@pytest.fixture
def nodes(tmp_path, monkeypatch):
    """Two local nodes whose python sits under a path a shell would split and expand (so every
    command line must quote it), the agent's home in tmp_path."""
    monkeypatch.setenv("HOME", str(tmp_path))
    odd = tmp_path / "py dir $(touch PWNED) 'q';x"
    odd.mkdir()
    (odd / "python").symlink_to(sys.executable)
    with Cluster(local_inv(str(odd / "python"))) as cluster:
        yield cluster
    assert not list(tmp_path.rglob("PWNED")), "a command line let the shell expand the python path"


def node_dir(key: str):
    return os.path.join(os.environ["HOME"], ".clusterctl", "node-runs", key)


# ------------------------------------------------------------------ the real agent, locally


def test_claims_claim_and_release_through_the_client(nodes):
    assert agent.run(nodes, agent.claims) == {"n0": Claims(), "n1": Claims()}
    who = "ann@ctl; it's $(me)"  # stored as given: it reached the agent as one argument
    got = agent.run(nodes, lambda n: agent.claim(n, RUN, who), ["n0"])["n0"]
    assert got.ok and got.error is None
    assert (got.claim.run, got.claim.key, got.claim.who) == (RUN, f"{RUN}@n0", who)
    refused = agent.run(nodes, lambda n: agent.claim(n, "run-20261124-111111-abcd", "bob@ctl"), ["n0"])["n0"]
    assert not refused.ok and refused.error is None and refused.claim.run == RUN and refused.claim.who == who
    held = agent.run(nodes, agent.claims)
    assert held["n0"].held["n0"] == Claim(RUN, f"{RUN}@n0", who, got.claim.since, stale=False)
    assert held["n1"].held.keys() == {"n0"}  # two local nodes share one machine: its claims, by node
    assert agent.run(nodes, lambda n: agent.release(n, "run-20261124-111111-abcd")) == \
        {"n0": Released(False), "n1": Released(False)}
    assert agent.run(nodes, lambda n: agent.release(n, RUN), ["n0"]) == {"n0": Released(True)}
    assert agent.run(nodes, agent.claims)["n0"] == Claims()


def test_live_status_and_stop_of_a_run_that_is_not_there(nodes):
    assert agent.run(nodes, agent.live) == {"n0": Live(), "n1": Live()}
    st = agent.run(nodes, lambda n: agent.status(n, RUN))
    assert st["n0"] == AgentStatus() and st["n1"] == AgentStatus()
    assert agent.run(nodes, lambda n: agent.stop(n, RUN, 1.0)) == {"n0": StopResult(True, 0), "n1": StopResult(True, 0)}


def test_a_call_over_one_connection(nodes):
    conn, node = nodes.connections["n1"], nodes.inventory.node("n1")
    assert agent.claim(node, RUN, "x@y").over(conn).ok
    assert agent.release(node, RUN).over(conn) == Released(True)


def test_a_python_that_does_not_run_gives_replies_that_say_why(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with Cluster(local_inv(str(tmp_path / "no-python"), n=1)) as cluster:
        st = agent.run(cluster, lambda n: agent.status(n, RUN))["n0"]
        stopped = agent.run(cluster, lambda n: agent.stop(n, RUN, 1.0))["n0"]
        claimed = agent.run(cluster, lambda n: agent.claim(n, RUN, "x@y"))["n0"]
        live = agent.run(cluster, agent.live)["n0"]
    assert "exit code 127" in st.error and st.exit_code is None and not st.exists
    assert stopped.reached and stopped.left is None and "exit code 127" in stopped.error  # it ran, and failed
    assert not claimed.ok and "exit code 127" in claimed.error
    assert live.keys == () and "exit code 127" in live.error


JOB = """
import time
print("up", flush=True)
time.sleep(60)
"""


def test_start_live_status_stop_and_tail_of_a_job(nodes, tmp_path):
    """A job that is not torchrun: the agent starts any argv, so every verb of a run is met."""
    key = f"{RUN}.a2"
    spec = StartSpec([sys.executable, "-c", JOB], str(tmp_path), {"JOB_TOKEN": "t'o k$en"})
    try:
        started = agent.run(nodes, lambda n: agent.start(n, key, spec), ["n0"])["n0"]
        assert isinstance(started.pid, int) and started.error is None and started.not_started is None
        wait_for(lambda: agent.run(nodes, lambda n: agent.status(n, key), ["n0"])["n0"].last_line == "up", 20,
                 "the job's first line")
        assert agent.run(nodes, agent.live) == {"n0": Live((RunKey(f"{key}@n0", RUN, 2, "n0"),)), "n1": Live()}
        other = "run-20261124-111111-abcd"  # a launch's claim says the same in its one command
        claimed = agent.run(nodes, lambda n: agent.claim(n, other, "bob@ctl", live=True))
        assert {n: (c.ok, c.live) for n, c in claimed.items()} == \
            {"n0": (True, Live((RunKey(f"{key}@n0", RUN, 2, "n0"),))), "n1": (True, Live())}
        agent.run(nodes, lambda n: agent.release(n, other))
        st = agent.run(nodes, lambda n: agent.status(n, key), ["n0"])["n0"]
        assert st.exists and st.pid == started.pid and st.alive >= 1 and st.exit_code is None and st.error is None
        spec_on_node = json.load(open(os.path.join(node_dir(f"{key}@n0"), "spec.json")))
        assert spec_on_node["env"] == {"JOB_TOKEN": "t'o k$en"}  # off the command line, byte for byte
    finally:
        stopped = agent.run(nodes, lambda n: agent.stop(n, key, 2.0), ["n0"])["n0"]
    assert stopped == StopResult(True, 0)
    st = agent.run(nodes, lambda n: agent.status(n, key), ["n0"])["n0"]
    assert st.exit_code is not None and st.alive == 0 and st.stop_requested and st.last_line == "up"
    tail = agent.tail(nodes.inventory.node("n0"), key, 0)
    res = wait(tail.start(nodes.connections["n0"]), 30)
    assert res.stdout == "up\n"
    ends = [s for line in res.stderr.splitlines() if (s := agent.end_status(line)) is not None]
    assert ends == [st]


# ------------------------------------------------------------------ command lines


def test_every_argument_is_one_word_on_the_command_line():
    node = local_inv("~/venv/bin/python").node("n0")
    call = agent.claim(node, RUN, "a b'c;$(x)")
    assert call.command.startswith('"$HOME"/')
    assert shlex.split(call.command)[1:] == [*BOOT, "claim", "n0", f"{RUN}@n0", "a b'c;$(x)"]
    assert call.stdin is None
    assert shlex.split(agent.claim(node, RUN, "x@y", live=True).command)[-1] == "live"
    assert shlex.split(agent.claim(node, RUN, "x@y", live=True, dirs=True).command)[-2:] == ["live", "dirs"]
    stop = agent.stop(node, f"{RUN}.a3", 5.0, peer_failed=True)
    assert shlex.split(stop.command)[1:] == [*BOOT, "stop", f"{RUN}.a3@n0", "5.0", "peer-failed"]
    assert stop.timeout == 35.0


def test_start_sends_the_spec_on_stdin_not_on_the_command_line():
    node = local_inv("python3").node("n1")
    spec = StartSpec(["torchrun", "x.py"], "~/w", {"TOKEN": "secret"}, {"rank_lines.py": "print()"})
    call = agent.start(node, RUN, spec)
    assert "secret" not in call.command and shlex.split(call.command)[1:] == [*BOOT, "start", f"{RUN}@n1", "-"]
    doc = json.loads(call.stdin)
    assert doc == {"argv": ["torchrun", "x.py"], "cwd": "~/w", "files": {"rank_lines.py": "print()"},
                   "env": {"TOKEN": "secret"}}


def test_tail_streams_the_log_alone_or_framed_with_the_artifacts():
    node = local_inv("python3").node("n0")
    plain = agent.tail(node, RUN, 123)
    assert shlex.split(plain.command)[1:] == [*BOOT, "tail", f"{RUN}@n0", "123", "status"]
    assert plain.stdin is None
    framed = agent.tail(node, RUN, 0, StreamFrom(None, "/tb", {"a/events": 7}))
    args = shlex.split(framed.command)[1 + len(BOOT):]
    assert args[:5] == ["tail", f"{RUN}@n0", "0", "stream", "-"] and args[5] == "/tb"
    assert json.loads(bytes.fromhex(args[6])) == {"a/events": 7}
    assert framed.stdin is None
    assert shlex.split(agent.tail(node, RUN, 0, StreamFrom("/ck", "/tb")).command)[1 + len(BOOT) + 4] == "/ck"


# ------------------------------------------------------------------ readers, on recorded answers


def ok(stdout: str, node: str = "n0") -> NodeResult:
    return NodeResult(node, 0, stdout=stdout)


# `status r1@n1` after the job above ended (recorded)
STATUS = ('{"exists": true, "pid": 4242, "started": 1764000000.5, "exit_code": 143, "alive": 0, "log_size": 3, '
          '"last_line": "up", "error_file": null, "ended": 1764000003.25, "save_seconds": 1.5, '
          '"stop_requested": true, "rank_failed": 1764000002.125}\n')


def test_status_reads_every_field_and_writes_them_back_as_the_agent_printed_them():
    st = agent.read_status(ok(STATUS))
    assert st == AgentStatus(True, 4242, 1764000000.5, 143, 0, 3, "up", None, 1764000003.25, 1.5, True,
                             rank_failed=1764000002.125)
    assert st.as_json() == json.loads(STATUS)
    assert AgentStatus(error="down").as_json() == {"error": "down"}


@pytest.mark.parametrize("res, why", [
    (NodeResult("n0", None, error="cannot connect: refused", kind=ErrorKind.CONNECT), "cannot connect: refused"),
    (NodeResult("n0", 1, stderr="Traceback ...\nSystemExit: bad run id\n"), "exit code 1 Traceback"),
    (ok("Welcome to the node!\n"), "Welcome to the node!"),
    (ok('["not", "a", "status"]\n'), "not a JSON dict"),
    (ok('{"exit_code": "soon"}\n'), "soon"),
    (ok(""), "unreadable"),
])
def test_a_status_that_cannot_be_had_says_why(res, why):
    st = agent.read_status(res)
    assert why in st.error and st.exit_code is None and not st.exists


def test_a_login_banner_before_the_answer_is_skipped():
    assert agent.read_status(ok("motd: be nice\n" + STATUS + "\n")).pid == 4242


def test_the_tail_status_line_and_the_stream_end_record():
    line = agent.STATUS_MARK + STATUS.strip()
    assert agent.end_status(line) == agent.read_status(ok(STATUS))
    assert agent.end_status("[default0]: clusterctl-status is a word") is None
    with pytest.raises(ValueError):
        agent.end_status(agent.STATUS_MARK + "{cut")
    assert AgentStatus.from_json(b'{"exit_code": 0}') == AgentStatus(exit_code=0)
    with pytest.raises(ValueError):
        AgentStatus.from_json(b"[]")


def test_the_status_mark_is_the_node_agents():
    text = (probe.REMOTE / "agent_tail.py").read_text()
    assert re.search(r'^STATUS_MARK = "(.*?)"', text, re.M).group(1) == agent.STATUS_MARK


def test_stop_results():
    assert agent.read_stop(ok('{"left": 2}\n')) == StopResult(True, 2)
    timed_out = agent.read_stop(NodeResult("n0", None, error="timed out after 35s", kind=ErrorKind.TIMEOUT))
    assert timed_out.reached and timed_out.left is None and "timed out" in timed_out.error
    lost = agent.read_stop(NodeResult("n0", None, error="connection lost", kind=ErrorKind.LOST))
    assert not lost.reached and lost.error == "connection lost"
    assert agent.read_stop(ok('{"gone": 1}\n')).error.startswith("unreadable")


CLAIM = '{"run": "%s", "key": "%s@n0", "who": "ann@ctl", "since": 1764000000.0}' % (RUN, RUN)


def test_claim_replies():
    mine = Claim(RUN, f"{RUN}@n0", "ann@ctl", 1764000000.0)
    assert agent.read_claimed(ok('{"ok": true, ' + CLAIM[1:] + "\n")) == Claimed(True, mine)
    assert agent.read_claimed(ok('{"ok": false, ' + CLAIM[1:] + "\n")) == Claimed(False, mine)
    assert agent.read_claimed(NodeResult("n0", 2, stderr="bad node name\n")).error == "exit code 2 bad node name"
    asked = '{"ok": true, "live": ["%s@n0", "%s@n1"], ' % (RUN, RUN) + CLAIM[1:] + "\n"
    assert agent.read_claimed(ok(asked), "n0") == Claimed(True, mine, live=Live((RunKey(f"{RUN}@n0", RUN, 1, "n0"),)))
    assert agent.read_claimed(ok(asked)).live is None  # not asked with live
    assert agent.read_claimed(ok('{"ok": true, "live": 3}\n'), "n0").error.startswith("unreadable")
    held = agent.read_claims(ok('{"n0": %s, "n1": %s}\n' % (CLAIM[:-1] + ', "stale": true}', CLAIM)))
    assert held == Claims({"n0": Claim(RUN, f"{RUN}@n0", "ann@ctl", 1764000000.0, True), "n1": mine})
    assert agent.read_claims(ok('{"n0": "x"}\n')).error.startswith("unreadable")
    assert agent.read_released(ok('{"released": true}\n')) == Released(True)
    assert agent.read_released(ok('{"released": false}\n')) == Released(False)


def test_live_keeps_the_nodes_own_keys_and_reads_them():
    keys = [f"{RUN}@n0", f"{RUN}.a3@n0", f"{RUN}@n1", "odd@n0"]
    got = agent.read_live("n0", ok(json.dumps(keys) + "\n"))
    assert got == Live((RunKey(f"{RUN}@n0", RUN, 1, "n0"), RunKey(f"{RUN}.a3@n0", RUN, 3, "n0"),
                        RunKey("odd@n0", "odd", 1, "n0")))
    assert got.keys[1].attempt_key == f"{RUN}.a3"
    assert agent.read_live("n0", ok('{"a": 1}\n')).error.startswith("unreadable")


@pytest.mark.parametrize("key, want", [
    (f"{RUN}@node1", (RUN, 1, "node1")),
    (f"{RUN}.a3@node1", (RUN, 3, "node1")),
    ("exp.a2-20261124-101428-e58f.a2@n@x", None),
    ("no-at-sign", None),
])
def test_a_run_key_reads_as_run_attempt_and_node(key, want):
    got = RunKey.parse(key)
    assert (got and (got.run, got.attempt, got.node)) == want


def test_start_replies():
    started = agent.read_started(ok('{"pid": 4242, "pgid": 4242, "waiter": 4241, "started": 1.0}\n'))
    assert started == Started(4242)
    assert agent.read_started(ok('{"pid": null, "error": "No such file"}\n')) == Started(None, "No such file")
    assert agent.read_started(NodeResult("n0", 1, stderr="the run did not start: boom\n")).error == \
        "exit code 1 the run did not start: boom"
