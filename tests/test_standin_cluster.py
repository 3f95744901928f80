"""The light torchrun stand-in (tests/cluster/fakes/torchrun.py) keeps the launch contract the
control plane relies on, so bench/bench_scale.py measures the product and not the fake: launched
by the product's own `clusterctl train` through the inventory's `python:`, every rank writes its
first line with the `[default<L>]:` prefix, carries torchrun's environment and the run key, and a
killed rank fails its node (exit 1), which the controller names and tears every node down after.
"""

import os
import signal
import subprocess
import sys

import pytest

from tests.cluster.fakes import install_torchrun_standin
from tests.conftest import VANISHED, wait_for

pytestmark = pytest.mark.cluster

NPROC = 3


def run_envs(cluster, run_id):
    """{pid: environment} of every process on any node whose run key is one of this run's."""
    out = {}
    for p in cluster.processes():
        try:
            env = p.environ()
        except VANISHED:
            continue
        if env.get("CLUSTERCTL_RUN_KEY", "").split("@")[0] == run_id:
            out[p.pid] = env
    return out


def test_standin_launches_every_rank_and_fails_fast(make_cluster, home, tmp_path):
    cluster = make_cluster(2, gpus=NPROC, name_prefix="ccsi")
    for nd in cluster.nodes:
        nd.run("mkdir -p ~/gpt_train")
    python = install_torchrun_standin(cluster.base_dir / "standin", cluster.python)
    inv = cluster.write_inventory(tmp_path / "nodes.yaml", python=str(python), env={"CLUSTERCTL_STANDIN_TICK": "0.5"})
    env = dict(os.environ, CLUSTERCTL_HOME=str(home))
    fg = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", str(inv), "--skip-preflight"],
                          env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        run_dir = wait_for(lambda: next(iter((home / "runs").glob("*/run.json")), None) if (home / "runs").exists()
                             else None, 120, "the run record").parent
        run_id, world = run_dir.name, 2 * NPROC
        logs = [run_dir / "nodes" / f"{nd.name}.log" for nd in cluster.nodes]

        def copied():
            return "".join(p.read_text(errors="replace") for p in logs if p.exists())
        wait_for(lambda: all(f"rank {r} up" in copied() and f"rank {r} step 2" in copied() for r in range(world)),
                   120, "every rank's first line and two steps in the control copy of the logs")
        text = copied()
        for r in range(world):
            assert f"[default{r % NPROC}]:rank {r} up" in text
        ranks = {int(e["RANK"]): (pid, e) for pid, e in run_envs(cluster, run_id).items() if "RANK" in e}
        assert sorted(ranks) == list(range(world))
        for r, (pid, e) in ranks.items():
            assert (e["LOCAL_RANK"], e["WORLD_SIZE"], e["GROUP_RANK"]) == (str(r % NPROC), str(world), str(r // NPROC))
            assert e["MASTER_ADDR"] == cluster.nodes[0].host
            assert e["CLUSTERCTL_RUN_KEY"] == f"{run_id}@{cluster.nodes[r // NPROC].name}"
        os.kill(ranks[world - 1][0], signal.SIGKILL)
        out, _ = fg.communicate(timeout=120)
    finally:
        if fg.poll() is None:
            fg.kill()
    said = out.decode(errors="replace")
    assert fg.returncode == 1, said[-3000:]
    assert f"{cluster.nodes[1].name} (ranks {NPROC}-{world - 1}) failed first: exit code 1" in said, said[-3000:]
    wait_for(lambda: not run_envs(cluster, run_id), 30, "no process of the run left on any node")
