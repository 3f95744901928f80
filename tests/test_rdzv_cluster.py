"""torchrun on real test nodes takes the run's rendezvous timeout: every node's torchrun carries
`--rdzv-conf` once, the inventory's other PET_RDZV_CONF keys and --rendezvous-timeout's value in
it (its command line read from /proc, the process found by the run's key), and the run finishes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import run_envs, wait_for

pytestmark = [pytest.mark.cluster]

SCRIPT = Path(__file__).parent / "scripts" / "scale_ranks.py"


def test_every_nodes_torchrun_takes_the_runs_rendezvous_timeout(make_cluster, home, tmp_path):
    cluster = make_cluster(2, gpus=1, name_prefix="ccrz")
    for nd in cluster.nodes:
        nd.run("mkdir -p ~/gpt_train")
    inv = cluster.write_inventory(tmp_path / "nodes.yaml", env={"PET_RDZV_CONF": "read_timeout=77"})
    env = dict(os.environ, CLUSTERCTL_HOME=str(home))
    fg = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", str(inv), "--skip-preflight",
                           "--rendezvous-timeout", "123", "--", str(SCRIPT), "--steps", "40", "--tick", "0.5"],
                          env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        run_dir = wait_for(lambda: next(iter((home / "runs").glob("*/run.json")), None) if (home / "runs").exists()
                           else None, 120, "the run record").parent
        run_id = run_dir.name

        def torchruns():
            found = {}
            for pid, e in run_envs(cluster, run_id).items():
                try:
                    cmd = psutil.Process(pid).cmdline()
                except psutil.Error:
                    continue
                if cmd[1:3] == ["-m", "torch.distributed.run"]:
                    found[e["CLUSTERCTL_RUN_KEY"]] = cmd
            return found if len(found) == 2 else None
        cmds = wait_for(torchruns, 120, "both nodes' torchrun")
        out, _ = fg.communicate(timeout=300)
    finally:
        if fg.poll() is None:
            fg.kill()
    said = out.decode(errors="replace")
    assert fg.returncode == 0, said[-3000:]
    for key, cmd in cmds.items():
        assert cmd.count("--rdzv-conf") == 1, (key, cmd)
        assert cmd[cmd.index("--rdzv-conf") + 1] == "read_timeout=77,timeout=123", (key, cmd)
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["scaling"]["values"]["rendezvous_timeout"] == 123 and rec["scaling"]["source"]["rendezvous_timeout"] == "given"
    wait_for(lambda: not run_envs(cluster, run_id), 30, "no process of the run left on any node")
