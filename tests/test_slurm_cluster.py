"""The SLURM path against a real SLURM: slurmctld + munged on the host, slurmd in each of two
test nodes (tests/cluster/slurm.py). Jobs are submitted with sbatch from node1 as the test
user, in a clean environment, so every SLURM_* variable a job sees was set by SLURM."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.cli import main
from tests.cluster import TestCluster, require_root
from tests.conftest import wait_for
from tests.cluster.slurm import Slurm
from tests.test_train_cluster import assert_job_gone

pytestmark = pytest.mark.cluster

REPO = str(Path(__file__).resolve().parent.parent)
JOB_TIMEOUT = 240


@pytest.fixture(scope="module")
def slurm():
    """One SLURM bring-up for the module: 2 nodes, 2 fake GPUs each (gres gpu:2)."""
    require_root()
    if not all(shutil.which(t) for t in ("slurmctld", "slurmd", "sbatch", "munged")):
        pytest.fail("slurm-wlm is not installed: run the tests through scripts/test, which installs it")
    with TestCluster(n=2, gpus=2, name_prefix="ccsl") as cluster, Slurm(cluster) as s:
        for nd in cluster.nodes:
            nd.run("mkdir -p ~/gpt_train")
        yield s


def chown(cluster, *paths):
    for p in paths:
        os.chown(p, cluster.pw.pw_uid, cluster.pw.pw_gid)


def trainer_inventory(cluster, path, max_steps, port):
    """The cluster's inventory (iface eth0 on every node: GLOO_SOCKET_IFNAME) with a tiny trainer run."""
    return cluster.write_inventory(
        path, master_port=port, env={"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"},
        train={"module": "trainer", "args": ["--preset", "nano", "--max-steps", str(max_steps), "--batch-size",
                                             "4", "--block-size", "64", "--log-every", "5", "--output-dir", "out"]})


def render(cluster, inv, job_name):
    """`clusterctl render slurm`, written into node1's home (where sbatch is run)."""
    script = cluster.nodes[0].home / f"{job_name}.sbatch"
    assert main(["render", "slurm", "-i", str(inv), "--gpus-per-node", "1", "--job-name", job_name,
                 "-o", str(script)]) == 0
    chown(cluster, script)
    return script


def job_output(cluster, job_name, job_id):
    path = cluster.nodes[0].home / f"{job_name}-{job_id}.out"
    return path.read_text() if path.exists() else f"(no {path.name})"


def test_rendered_sbatch_runs_the_trainer_on_two_nodes(slurm, tmp_path):
    cluster = slurm.cluster
    inv = trainer_inventory(cluster, tmp_path / "nodes.yaml", 10, 29610)
    script = render(cluster, inv, "trainjob")
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=1" in text
    assert "export GLOO_SOCKET_IFNAME=eth0" in text

    job = slurm.sbatch(script.name)
    info = slurm.wait_job(job, JOB_TIMEOUT)
    out = job_output(cluster, "trainjob", job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-4000:]
    assert info["NodeList"] == "node[1-2]" and info["NumNodes"] == "2"
    # launch --from-env on each node read SLURM's own variables: the node count, this node's
    # rank (SLURM_NODEID), the master from SLURM_JOB_NODELIST and the job id as the run id
    assert out.count("clusterctl launch --from-env (SLURM)") == 2, out[-4000:]
    assert "  this node      0 (node1), rank 0" in out and "  this node      1 (node2), rank 1" in out
    assert out.count(f"  master         node1:29610, run id {job}") == 2
    assert out.count("  nodes          2\n") == 2 and out.count("nvidia-smi sees 2") == 2
    # the trainer ran as one job of both ranks, pinned to eth0
    assert f"run id {job}\nworld size 2 |" in out
    assert "step 10 | loss" in out and "step 10 | val loss" in out
    assert "ckpt_00000010.pt" in cluster.nodes[0].run("ls ~/gpt_train/out").stdout
    assert_job_gone(cluster)


def trainer_ranks(cluster, node, job):
    """The node's trainer ranks of this job: torchrun's workers (LOCAL_RANK set) carrying the
    run id that launch gives them (the job id)."""
    found = []
    for p in cluster.processes(node):
        try:
            env = p.environ()
            if env.get("CLUSTERCTL_RUN_ID") == job and "LOCAL_RANK" in env:
                found.append(p)
        except Exception:  # noqa: BLE001 - the process ended between listing and reading
            continue
    return found


def test_scancel_leaves_no_process_on_any_node(slurm, tmp_path):
    cluster = slurm.cluster
    inv = trainer_inventory(cluster, tmp_path / "nodes.yaml", 100000, 29620)
    script = render(cluster, inv, "longjob")
    job = slurm.sbatch(script.name)
    for nd in cluster.nodes:
        wait_for(lambda: trainer_ranks(cluster, nd, job) or
                 (slurm.job(job)["JobState"] not in ("PENDING", "RUNNING") and
                  pytest.fail(f"job ended early:\n{job_output(cluster, 'longjob', job)[-3000:]}")),
                 JOB_TIMEOUT, f"the trainer rank on {nd.name}")
    assert all(cluster.processes(nd) for nd in cluster.nodes)
    slurm.client(["scancel", job])
    info = slurm.wait_job(job, 60)
    assert info["JobState"] == "CANCELLED"
    for nd in cluster.nodes:
        wait_for(lambda: not cluster.processes(nd), 30, f"no process of the job left on {nd.name}")


def ssh_setup_in_node1_home(cluster):
    """A user's own ~/.ssh on node1: the cluster's client key and the nodes' host keys by name."""
    ssh = cluster.nodes[0].home / ".ssh"
    shutil.copy(cluster.identity_file, ssh / "id_ed25519")
    known = []
    for nd in cluster.nodes:
        keytype, key = nd.host_key.with_name(nd.host_key.name + ".pub").read_text().split()[:2]
        known.append(f"{nd.name} {keytype} {key}")
    (ssh / "known_hosts").write_text("\n".join(known) + "\n")
    for p in (ssh / "id_ed25519", ssh / "known_hosts"):
        p.chmod(0o600)
        chown(cluster, p)


def test_inventory_from_slurm_inside_a_job_reaches_the_allocated_nodes(slurm):
    """Inside an sbatch job: from-slurm alone (the user's ~/.ssh) for exec, and with a site
    template (the venv's python) for preflight and top."""
    cluster = slurm.cluster
    ssh_setup_in_node1_home(cluster)
    py = cluster.python
    # a site inventory: the venv's python, the user's key, the cluster's known_hosts, nodes by address
    site = cluster.inventory()
    site["ssh"]["identity_file"] = "~/.ssh/id_ed25519"
    # the same code on every node (the job runs outside a git checkout: code_sync compares the
    # nodes with each other; an empty workdir would fail it)
    site["workdir"] = "~/site_run"
    for nd in cluster.nodes:
        nd.run("mkdir -p ~/site_run && echo 'print(1)' > ~/site_run/train.py")
    template = cluster.nodes[0].home / "site.yaml"
    template.write_text(yaml.safe_dump(site))
    chown(cluster, template)
    script = cluster.nodes[0].home / "fromslurm.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --gpus-per-node=2
#SBATCH --output=fromslurm-%j.out
set -eu
{py} -m orchestrator.cli inventory from-slurm -o inv.yaml
{py} -m orchestrator.cli exec -i inv.yaml -- hostname
{py} -m orchestrator.cli inventory from-slurm --template site.yaml -o site-inv.yaml
{py} -m orchestrator.cli preflight -i site-inv.yaml --skip python_env
{py} -m orchestrator.cli top -i site-inv.yaml --once --json > top.json
""")
    chown(cluster, script)
    job = slurm.sbatch(script.name)
    info = slurm.wait_job(job, JOB_TIMEOUT)
    out = (cluster.nodes[0].home / f"fromslurm-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out
    inv = yaml.safe_load((cluster.nodes[0].home / "inv.yaml").read_text())
    assert inv["nodes"] == [{"name": "node1", "host": "node1", "gpus": 2},
                            {"name": "node2", "host": "node2", "gpus": 2}]
    lines = out.splitlines()
    assert "node1 | node1" in lines and "node2 | node2" in lines, out
    # with the site's settings: preflight passes (python_env left out: the nodes' fake GPUs
    # beside a CPU torch fail it, as they should) and top sees both nodes' GPUs
    site = yaml.safe_load((cluster.nodes[0].home / "site-inv.yaml").read_text())
    assert [(n["name"], n["host"], n["gpus"]) for n in site["nodes"]] == \
        [(nd.name, nd.host, 2) for nd in cluster.nodes]
    assert "preflight: 2 nodes, master 10.213." in out and "check(s) failed" not in out, out
    top = json.loads((cluster.nodes[0].home / "top.json").read_text())
    assert [(n["name"], n["error"], len(n["gpus"])) for n in top["nodes"]] == [("node1", None, 2), ("node2", None, 2)]


# ------------------------------------------------------------------ render slurm with setup:

DDP_CHECK = """import sys, torch, torch.distributed as dist
import orchestrator
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"ddp-check rank {dist.get_rank()}/{dist.get_world_size()} sum {int(t.item())} "
      f"python {sys.executable} clusterctl {orchestrator.__file__}", flush=True)
dist.destroy_process_group()
"""


def test_render_with_setup_runs_in_the_setup_venv_where_the_nodes_have_nothing_else(slurm, tmp_path):
    """`setup: {clusterctl: true}`: setup builds the venv from a requirements file of torch alone,
    with clusterctl's node side added, and the rendered job runs `launch --from-env` and the ranks
    in that venv. The nodes' python3 has no clusterctl, no click and no torch, and the inventory
    sets no PYTHONPATH: a render that ran python3 (or a venv without clusterctl) fails the job."""
    cluster = slurm.cluster
    venv = "~/venvs/slurmsetup"
    for nd in cluster.nodes:
        r = nd.run("python3 -c 'import click'", check=False)
        assert r.returncode != 0 and "No module named 'click'" in r.stderr, r.stderr
        nd.run(f"cat > ~/gpt_train/ddp_check.py <<'EOF'\n{DDP_CHECK}EOF")
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("torch==2.13.0\n")
    raw = cluster.inventory(master_port=29630, setup={"requirements": str(reqs), "venv": venv, "clusterctl": True},
                            train={"script": "ddp_check.py"})
    del raw["python"]  # with setup: every node runs the venv's python
    for n in raw["nodes"]:
        n["gpus"] = 0  # a CPU torch: python_env passes on CPU nodes
    inv = tmp_path / "nodes.yaml"
    inv.write_text(yaml.safe_dump(raw, sort_keys=False))
    env = dict(os.environ, CLUSTERCTL_HOME=str(tmp_path / "home"))
    setup = subprocess.run([sys.executable, "-m", "orchestrator.cli", "setup", "-i", str(inv), "--json"],
                           capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert setup.returncode == 0, setup.stderr[-3000:] + setup.stdout[-3000:]
    doc = json.loads(setup.stdout)
    assert [n["action"] for n in doc["nodes"]] == ["created", "created"], doc

    script = cluster.nodes[0].home / "setupjob.sbatch"
    assert main(["render", "slurm", "-i", str(inv), "--gpus-per-node", "1", "--job-name", "setupjob",
                 "-o", str(script)]) == 0
    chown(cluster, script)
    text = script.read_text()
    assert "srun --kill-on-bad-exit=1 \"$HOME\"/venvs/slurmsetup/bin/python -m orchestrator.cli launch" in text
    job = slurm.sbatch(script.name)
    info = slurm.wait_job(job, JOB_TIMEOUT)
    out = job_output(cluster, "setupjob", job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-4000:]
    assert out.count("clusterctl launch --from-env (SLURM)") == 2, out[-4000:]
    home = cluster.pw.pw_dir  # the test user's home as the nodes see it
    ranks = sorted(ln for ln in out.splitlines() if "ddp-check rank" in ln)
    assert len(ranks) == 2 and all(" sum 3 " in ln for ln in ranks), out[-4000:]
    for ln in ranks:  # the ranks' python and the clusterctl they imported are the setup venv's
        assert f" python {home}/venvs/slurmsetup/bin/python " in ln, ln
        assert f" clusterctl {home}/venvs/slurmsetup" in ln and "/site-packages/orchestrator/" in ln, ln
    assert_job_gone(cluster)
