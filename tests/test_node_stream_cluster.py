"""One stream per node while a run trains, on the real test cluster: the log copy stays byte for
byte the node's log with checkpoint and TensorBoard records between its bytes and across dropped
connections, checkpoints are copied and replicated as the stream reports them, and no
`artifacts.py poll` process is started on a node before its run ended."""

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.test_resilience_cluster import running
from tests.test_train_cluster import cli, wait_clean, rec_of

pytestmark = pytest.mark.cluster

JOB = str(Path(__file__).parent / "scripts" / "stream_job.py")
# the inventory's python on every node: each call logged (node clock, arguments), then the real one
WRAPPER = '#!/bin/sh\necho "$(date +%s.%N) $*" >> "$HOME/python-calls.log"\nexec {python} "$@"\n'


def logged_python(cluster):
    for n in cluster.nodes:
        path = n.home / "python-logged"
        path.write_text(WRAPPER.format(python=cluster.python))
        path.chmod(0o755)
        n.run("mkdir -p ~/gpt_train && : > ~/python-calls.log")
    return "~/python-logged"


def calls(node):
    """(node time, arguments) of every python started on the node."""
    text = (node.home / "python-calls.log").read_text()  # a `-c CODE` call spans lines (the boot's, say)
    return [(float(m.group(1)), m.group(2)) for m in re.finditer(r"^(\d+\.\d+) (.*?)(?=^\d+\.\d+ |\Z)", text,
                                                                  re.M | re.S)]


def test_the_log_copy_stays_the_nodes_log_with_artifacts_on_the_stream_and_connections_cut(
        make_cluster, tmp_path, home):
    cluster = make_cluster(2, gpus=0)
    inv = str(cluster.write_inventory(tmp_path / "nodes.yaml", python=logged_python(cluster),
                                      train={"checkpoint_replica": True}))
    r = cli("train", "-i", inv, "--skip-preflight", "--detach", "--", JOB, "--steps", "100", "--sleep", "0.15")
    assert r.returncode == 0, r.stderr
    run_id = r.stdout.strip()
    run_dir = home / "runs" / run_id
    wait_for(lambda: running(run_dir), 120, "running")
    # a checkpoint came over the stream and was copied while the run trains
    wait_for(lambda: (run_dir / "checkpoints" / "ckpt_00000010.pt").exists(), 120, "a checkpoint copied")
    for n in cluster.nodes:  # both streams cut (the kernel resets them both ways), twice over
        subprocess.run(["ss", "-K", "dst", n.host, "dport", "=", "22"], check=True, capture_output=True)
    wait_for(lambda: (run_dir / "checkpoints" / "ckpt_00000030.pt").exists(), 120, "a later checkpoint")
    for n in cluster.nodes:
        subprocess.run(["ss", "-K", "dst", n.host, "dport", "=", "22"], check=True, capture_output=True)
    rec = wait_for(lambda: (lambda d: d if d.get("state") in ("finished", "failed") else None)(rec_of(run_dir)),
                   180, "the run to end")
    assert rec["state"] == "finished" and rec["exit_code"] == 0, rec.get("summary")
    assert "reconnected" in (run_dir / "supervisor.log").read_text()
    for rank, n in enumerate(cluster.nodes):
        node_run = n.home / ".clusterctl" / "node-runs" / f"{run_id}@{n.name}"
        copy = (run_dir / "nodes" / f"{n.name}.log").read_bytes()
        assert copy == (node_run / "log").read_bytes()  # byte for byte, every byte once
        assert copy.count(b"rank %d step 99 " % rank) == 1
        art = n.home / ".clusterctl" / "artifacts" / run_id
        tb = f"run/events.{rank}"
        assert (run_dir / "tensorboard" / tb).read_bytes() == (art / "tensorboard" / tb).read_bytes()  # one directory
        # the stream did the looking: python started as `poll` only once the run had ended there
        ended = float((node_run / "ended").read_text())
        started = calls(n)
        assert any(" node_agent tail " in args and " stream " in args for _, args in started), started
        early = [(at, args) for at, args in started if " artifacts poll " in args and at < ended]
        assert not early, early
    art1 = cluster.nodes[0].home / ".clusterctl" / "artifacts" / run_id
    for name in ("ckpt_00000100.pt", "ckpt_00000100.pt.sha256"):
        assert (run_dir / "checkpoints" / name).read_bytes() == (art1 / "checkpoints" / name).read_bytes()
    # node1's newest checkpoint went node to node to its replica holder, node2
    replica = cluster.nodes[1].home / ".clusterctl" / "artifacts" / run_id / "replicas" / "node1"
    wait_for(lambda: (replica / "ckpt_00000100.pt").exists() or (replica / "ckpt_00000090.pt").exists(), 10,
             "node1's checkpoint replicated on node2")
    # the replica's relays and the sessions close a moment after the run ends (longer when the
    # suite's other worker trains on the same cores)
    wait_clean(cluster, 60, "every node clean")
