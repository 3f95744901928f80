"""The typed pieces: RunSpec defaults and old records, node/run states, the failure policy, the
transport's one Proc shape and its typed errors (over real local subprocesses)."""

import dataclasses
import json
import sys

import pytest

from orchestrator import errors
from orchestrator.inventory import parse_inventory
from orchestrator.runs.policy import CAUSE_WINDOW, FailurePolicy, earliest_failure, log_tail
from orchestrator.runs.spec import DEFAULTS, FirstFailure, NodeState, NodeStatus, RunSpec, RunState
from orchestrator.runs.store import Run, write_json
from orchestrator.transport import (
    DEFAULT_FANOUT,
    DEFAULT_LOST_TIMEOUT,
    Cluster,
    ErrorKind,
    LocalConnection,
    NodeResult,
    first_line,
    stream,
)
from tests.conftest import write_record


pytestmark = pytest.mark.usefixtures("home")  # every test gets its own CLUSTERCTL_HOME


def local_inv(n=2):
    nodes = "\n".join(f"  - {{name: n{i}, connection: local, gpus: 0}}" for i in range(n))
    return parse_inventory(f"nodes:\n{nodes}\n")


# ------------------------------------------------------------------ run state


def test_run_spec_defaults_are_the_transports_and_the_train_flags():
    assert DEFAULTS.fanout == DEFAULT_FANOUT and DEFAULTS.lost_timeout == DEFAULT_LOST_TIMEOUT
    assert (DEFAULTS.grace, DEFAULTS.nproc_per_node, DEFAULTS.nodes, DEFAULTS.args) == (5.0, "auto", (), ())
    from orchestrator.cli.train import train_command

    flags = {p.name: p.default for p in train_command.params}
    assert flags["grace"] == DEFAULTS.grace and flags["lost_timeout"] == DEFAULTS.lost_timeout
    assert flags["fanout"] == DEFAULTS.fanout and flags["nproc_per_node"] == DEFAULTS.nproc_per_node
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULTS.grace = 1.0


def test_run_spec_round_trips_and_an_old_record_takes_the_defaults(home):
    spec = RunSpec(inventory="/x/nodes.yaml", nodes=("a", "b"), args=("-m", "trainer"), grace=20.0,
                   nproc_per_node=2, connect_timeout=3.0)
    run = Run.create("r-1", spec)
    assert run.spec == spec
    assert json.loads((run.dir / "spec.json").read_text())["nodes"] == ["a", "b"]
    # what an older clusterctl wrote: fewer keys, a null, and a key this one does not know
    write_json(run.dir / "spec.json", {"inventory": None, "args": ["t.py"], "grace": None, "retired": 1})
    assert run.spec == RunSpec(args=("t.py",))
    (run.dir / "spec.json").unlink()
    assert run.spec == RunSpec()


def test_states_are_readable_strings_in_the_record(home):
    assert [s.value for s in NodeState] == ["pending", "running", "finished", "failed", "lost", "unreachable",
                                            "gone"]
    assert {s for s in RunState if s.terminal} == {RunState.FINISHED, RunState.FAILED, RunState.STOPPED}
    st = NodeStatus("n1", 0, "10.0.0.1", state=NodeState.LOST, error="no answer")
    doc = json.loads(json.dumps(st.to_json()))
    assert doc == {"name": "n1", "rank": 0, "host": "10.0.0.1", "state": "lost", "error": "no answer"}
    assert NodeStatus.from_json(doc) == st
    assert NodeStatus.from_json({"name": "n2", "state": "something new"}).state is NodeState.PENDING
    assert f"{NodeState.RUNNING}" == "running"
    run = Run.create("r-2", RunSpec())
    assert run.record.state is RunState.STARTING and not run.terminal
    write_record(run, state=RunState.FAILED, nodes=[st.to_json()])
    assert json.loads((run.dir / "run.json").read_text())["state"] == "failed"
    assert run.terminal and run.record.nodes == [st]


def test_the_first_failure_is_the_root_cause_and_stops_once():
    calls = []
    p = FailurePolicy(calls.append)
    p.failed("node2", 1, "the training script failed", ended=100.0)
    p.failed("node3", None, "lost")
    assert [c.node for c in calls] == ["node2"] and p.first.node == "node2"
    # seen within CAUSE_WINDOW but ended earlier on its own clock: it died first
    p.failed("node1", 137, "killed", ended=99.0)
    assert p.first.node == "node1" and len(calls) == 1
    assert CAUSE_WINDOW > 0


def test_the_node_whose_rank_failed_first_is_the_root_cause_though_a_peer_node_ended_first():
    """node3's rank 5 fails; node4's ranks fail only after its sockets close, but node4's torchrun
    ends first (node3's still stops rank 4). The ranks' own exits decide, on the nodes' clocks."""
    node3 = NodeStatus("node3", 1, "", exit_code=1, node_ended=100.40, rank_failed=100.00)
    node4 = NodeStatus("node4", 2, "", exit_code=1, node_ended=100.30, rank_failed=100.15)
    seen_first = FirstFailure("node4", 1, "the training script failed", ended=node4.failed_at)
    assert earliest_failure(seen_first, [node4, node3]).node == "node3"
    p = FailurePolicy(lambda ff: None)
    p.failed("node4", 1, "the training script failed", ended=node4.failed_at)
    p.failed("node3", 1, "the training script failed", ended=node3.failed_at)
    assert p.first.node == "node3"
    # a node without its ranks' notes (an older agent, torchrun itself failed): torchrun's end
    old = NodeStatus("node2", 0, "", exit_code=1, node_ended=99.0)
    assert old.failed_at == 99.0 and earliest_failure(seen_first, [node3, old]).node == "node2"
    assert NodeStatus.from_json(json.loads(json.dumps(node3.to_json()))) == node3


def test_failures_after_a_stop_request_are_not_blamed(tmp_path):
    p = FailurePolicy(lambda ff: pytest.fail("a stop is not a failure"))
    p.stop_requests = 1
    p.failed("node1", 143, "killed by SIGTERM")
    r = p.result(lambda n: NodeStatus(n, 0, ""), lambda n: tmp_path / n)
    assert (r.state, r.exit_code, r.first_failure) == (RunState.STOPPED, errors.EXIT_INTERRUPTED, None)
    assert FailurePolicy(print).result(None, None).to_json() == {
        "state": "finished", "exit_code": 0, "summary": "every node finished"}


def test_a_failed_run_result_carries_the_first_failure_and_the_log_tail(tmp_path):
    (tmp_path / "node2.log").write_bytes(b"x" * 300_000 + b"\nlast words\n")
    assert log_tail(tmp_path / "node2.log").endswith(b"last words\n")
    assert len(log_tail(tmp_path / "node2.log")) == 1 << 18 and log_tail(tmp_path / "missing") == b""
    p = FailurePolicy(lambda ff: None)
    p.failed("node2", None, "no answer from the node for 5s (connection lost)")
    r = p.result(lambda n: NodeStatus(n, 1, "", first_rank=2, last_rank=3), lambda n: tmp_path / f"{n}.log")
    assert r.state is RunState.FAILED and r.exit_code == 255  # a lost node has no exit code
    assert r.summary.startswith("node2 (ranks 2-3) failed first") and r.summary.endswith("last words")
    assert r.to_json()["first_failure"]["node"] == "node2"
    assert isinstance(r.first_failure, FirstFailure)


def test_every_error_is_in_one_hierarchy_with_its_exit_code():
    e = errors.LaunchError("cannot reach every node", errors.EXIT_UNREACHABLE)
    assert isinstance(e, errors.ClusterctlError) and e.exit_code == 3
    assert errors.LaunchError("preflight failed").exit_code == errors.EXIT_FAILED
    lost = errors.ConnectionLost("n1", "no answer")
    assert isinstance(lost, errors.ConnectError) and lost.exit_code == 3 and lost.message == "no answer"
    assert str(lost) == "n1: no answer"


# ------------------------------------------------------------------ the transport


def test_a_local_proc_offers_a_list_of_fds_until_each_stream_ends():
    conn = LocalConnection(local_inv(1).nodes[0])
    p = conn.exec("echo hi")
    assert isinstance(p.fds(), list) and len(p.fds()) == 2
    res = stream([p], timeout=10)["n0"]
    assert res.ok and res.stdout == "hi\n"
    assert p.fds() == [] and p.lost_reason() is None


def test_a_timed_out_command_has_a_typed_kind_and_error():
    with Cluster(local_inv(2)) as c:
        r = c.run(lambda n: "sleep 30" if n.rank else "true", timeout=0.5)
    res = r["n1"]
    assert res.kind is ErrorKind.TIMEOUT and res.exit_code is None and res.reachable
    e = res.exception()
    assert isinstance(e, errors.CommandTimeout) and e.result is res and e.timeout == 0.5
    with pytest.raises(errors.CommandTimeout):
        res.check()
    assert r["n0"].kind is None and r["n0"].exception() is None and r["n0"].check() is r["n0"]
    with pytest.raises(errors.ClusterFailure) as fail:
        r.check()
    assert fail.value.result is r and "n1" in str(fail.value)


def test_result_kinds_map_to_typed_errors():
    assert isinstance(NodeResult("a", None, error="refused", kind=ErrorKind.CONNECT).exception(),
                      errors.ConnectError)
    lost = NodeResult("a", None, error="no answer", kind=ErrorKind.LOST)
    assert isinstance(lost.exception(), errors.ConnectionLost) and not lost.reachable
    failed = NodeResult("a", 2, stderr="boom\n").exception()
    assert type(failed) is errors.CommandFailed and "exit code 2" in str(failed) and "boom" in str(failed)


def test_stop_is_its_own_kind():
    import threading

    stop = threading.Event()
    stop.set()
    with Cluster(local_inv(1)) as c:
        r = c.run("sleep 30", stop=stop, timeout=20)
    assert r["n0"].kind is ErrorKind.STOPPED and r["n0"].error == "stopped"


def test_first_line_leaves_the_proc_running_and_types_its_failures():
    conn = LocalConnection(local_inv(1).nodes[0])
    p = conn.exec("echo ready 42; exec sleep 30")
    try:
        assert first_line(p, 10) == "ready 42"
        assert p.exit_code() is None  # still running
    finally:
        p.kill()
        p.close()
    with pytest.raises(errors.CommandFailed) as ended:
        first_line(conn.exec("echo oops >&2; exit 4"), 10)
    assert ended.value.result.exit_code == 4 and "oops" in str(ended.value)
    with pytest.raises(errors.CommandTimeout) as silent:
        first_line(conn.exec("sleep 30"), 0.3)
    assert silent.value.result.kind is ErrorKind.TIMEOUT


def test_bytes_arrive_raw_and_lines_whole_to_their_sinks():
    chunks, lines = [], []
    with Cluster(local_inv(1)) as c:
        r = c.run(f"{sys.executable} -c \"import os; os.write(1, b'a\\\\r\\\\nb'); os.write(2, b'e\\\\n')\"",
                  on_bytes=lambda n, s, d: chunks.append((s, d)), on_line=lambda n, s, ln: lines.append((s, ln)),
                  capture=False)
    assert r["n0"].ok and r["n0"].stdout == ""  # capture=False: the sinks got it all
    assert b"".join(d for s, d in chunks if s == "stdout") == b"a\r\nb"
    assert sorted(lines) == [("stderr", "e"), ("stdout", "a"), ("stdout", "b")]
