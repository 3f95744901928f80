"""`launch --from-env`: platform variables -> one torchrun command, the checklist and checks, and
two test-cluster nodes forming one gloo job from each platform's variables."""

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.errors import UsageError
from orchestrator.platforms.fromenv import LocalGpus, Platform, detect_gpus, detect_platform, local_checks, visible
from orchestrator.gpus import Gpu, GpuProcess
from orchestrator.inventory import load_inventory
from orchestrator.runs.torchrun import node_env, torchrun_argv

FIX = Path(__file__).parent / "fixtures"
PLATFORM_VARS = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "CLUSTERCTL_RUN_ID", "JOB_COMPLETION_INDEX")


def no_scontrol(nodelist):
    raise AssertionError("scontrol must not run when MASTER_ADDR is set")


# ------------------------------------------------------------------ detection

def test_generic_seed_004_platform():
    p = detect_platform({"WORLD_SIZE": "8", "RANK": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29501"})
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port) == (8, 3, "10.0.0.1", 29501)
    assert p.source == "WORLD_SIZE/RANK/MASTER_ADDR" and p.run_id  # same on every node: from master addr:port
    assert p.run_id == detect_platform({"WORLD_SIZE": "8", "RANK": "0", "MASTER_ADDR": "10.0.0.1",
                                        "MASTER_PORT": "29501"}).run_id


def test_slurm_head_from_scontrol_and_job_id():
    seen = []

    def hostnames(nodelist):
        seen.append(nodelist)
        return ["gpu-a07", "gpu-a08"]

    p = detect_platform({"SLURM_JOB_ID": "991", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
                         "SLURM_JOB_NODELIST": "gpu-a[07-08]"}, hostnames=hostnames, default_port=29511)
    assert seen == ["gpu-a[07-08]"]
    assert p == Platform("SLURM", 2, 1, "gpu-a07", 29511, "991")


def test_slurm_beats_generic_and_master_addr_beats_scontrol():
    p = detect_platform({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "2", "MASTER_ADDR": "h0",
                         "WORLD_SIZE": "4", "RANK": "2"}, hostnames=no_scontrol)
    assert (p.source, p.nnodes, p.node_rank, p.master_addr, p.run_id) == ("SLURM", 4, 2, "h0", "7")


def test_kubeflow_pet_vars_and_its_own_world_size_is_ignored():
    p = detect_platform({"PET_NNODES": "4", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-master-0",
                         "PET_MASTER_PORT": "23456", "WORLD_SIZE": "32", "RANK": "9", "MASTER_PORT": "1"})
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port) == (4, 1, "job-master-0", 23456)


def test_indexed_job_rank_from_completion_index():
    p = detect_platform({"JOB_COMPLETION_INDEX": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "gpt2-0.gpt2",
                         "CLUSTERCTL_RUN_ID": "gpt2"})
    assert (p.source, p.nnodes, p.node_rank, p.master_addr, p.run_id) == \
        ("Kubernetes Indexed Job", 4, 3, "gpt2-0.gpt2", "gpt2")


def test_skypilot():
    p = detect_platform({"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "1",
                         "SKYPILOT_NODE_IPS": "10.1.0.4\n10.1.0.5\n", "SKYPILOT_TASK_ID": "sky-42"})
    assert (p.nnodes, p.node_rank, p.master_addr, p.run_id) == (2, 1, "10.1.0.4", "sky-42")


def test_flags_beat_every_variable():
    p = detect_platform({"WORLD_SIZE": "8", "RANK": "3", "MASTER_ADDR": "a"}, nnodes=2, node_rank=1,
                        master_addr="b", master_port=1234)
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port) == (2, 1, "b", 1234)


@pytest.mark.parametrize("env,words", [
    ({}, "no platform variables"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "master address"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "m"}, "rank"),
    ({"WORLD_SIZE": "two", "RANK": "0", "MASTER_ADDR": "m"}, "WORLD_SIZE='two' is not a whole number"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "m"}, "not below the node count 2"),
    ({"WORLD_SIZE": "0", "RANK": "0", "MASTER_ADDR": "m"}, "at least 1"),
    ({"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "MASTER_ADDR": "m", "WORLD_SIZE": "16"},
     "SLURM says 2 nodes but WORLD_SIZE=16"),
    ({"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "MASTER_ADDR": "m"}, "SLURM_NODEID"),
    ({"JOB_COMPLETION_INDEX": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "RANK": "0"},
     "this is node 1 but RANK=0"),
    ({"JOB_COMPLETION_INDEX": "1", "MASTER_ADDR": "m"}, "WORLD_SIZE"),
    ({"PET_NNODES": "1:4", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "m"}, "elastic range"),
    ({"SKYPILOT_NUM_NODES": "3", "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "a\nb"}, "lists 2 hosts"),
])
def test_missing_or_contradictory_variables_say_which(env, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        detect_platform(env, hostnames=no_scontrol)


# ------------------------------------------------------------------ GPUs and checks

def fake_tools(outputs):
    def run(argv):
        out, rc = outputs[argv[0] + " " + argv[1].split("=")[0]]
        return subprocess.CompletedProcess(argv, rc, out, "")
    return run


def test_detect_gpus_nvidia_rocm_none_and_broken():
    gpus_csv = (FIX / "gpus" / "transcribed_nvidia_h100x8_noheader_nounits.csv").read_text()
    apps_csv = (FIX / "gpus" / "transcribed_nvidia_h100x8_apps_noheader_nounits.csv").read_text()
    nv = detect_gpus(run=fake_tools({"nvidia-smi --query-gpu": (gpus_csv, 0),
                                     "nvidia-smi --query-compute-apps": (apps_csv, 0)}),
                     which=lambda t: t == "nvidia-smi")
    assert nv.tool == "nvidia-smi" and len(nv.gpus) == 8 and nv.gpus[0].busy
    mi300x = (FIX / "gpus/transcribed_rocm_mi300x_json.json").read_text()
    rocm = detect_gpus(run=fake_tools({"rocm-smi --showid": (mi300x, 0)}),
                       which=lambda t: t == "rocm-smi")
    assert rocm.tool == "rocm-smi" and len(rocm.gpus) == 2
    assert detect_gpus(which=lambda t: None) == LocalGpus(None)
    broken = detect_gpus(run=fake_tools({"nvidia-smi --query-gpu": ("Failed to initialize NVML", 9)}),
                         which=lambda t: t == "nvidia-smi")
    assert broken.error == "Failed to initialize NVML"


def test_visible_devices_limit_the_gpus():
    gpus = tuple(Gpu(i, "g", uuid=f"GPU-{i}") for i in range(8))
    assert [g.index for g in visible(gpus, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})] == [0, 1, 2, 3]
    assert [g.index for g in visible(gpus, {"CUDA_VISIBLE_DEVICES": "GPU-7"})] == [7]
    assert visible(gpus, {}) == gpus


def test_checks_gpu_count_busy_and_port():
    plat = Platform("x", 2, 0, "127.0.0.1", 0, "r")
    gpus = (Gpu(0, "g"), Gpu(1, "g", processes=(GpuProcess(77, "python"),)))
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        plat = Platform("x", 2, 0, "127.0.0.1", s.getsockname()[1], "r")
        checks = {c.name.split()[0]: c for c in local_checks(plat, 4, LocalGpus("nvidia-smi", gpus), gpus, {})}
    assert not checks["gpu"].ok and "invalid device ordinal" in checks["gpu"].detail
    assert not checks["gpus"].ok and "pid 77" in checks["gpus"].detail
    assert not checks["port"].ok
    ok = local_checks(Platform("x", 2, 1, "localhost", 1, "r"), 1, LocalGpus(None), (), {"GLOO_SOCKET_IFNAME": "lo"})
    assert all(c.ok for c in ok)


# ------------------------------------------------------------------ the command

@pytest.fixture
def platform_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("SLURM_", "PET_", "SKYPILOT_")) or k in PLATFORM_VARS or k.startswith(("NCCL_", "GLOO_")):
            monkeypatch.delenv(k)
    # a CPU node whatever this machine has
    monkeypatch.setattr("orchestrator.platforms.fromenv.detect_gpus", lambda: LocalGpus(None))

    def set_(**kw):
        for k, v in kw.items():
            monkeypatch.setenv(k, str(v))
    return set_


def test_dry_run_prints_the_same_command_train_would(platform_env, capsys):
    platform_env(SLURM_JOB_ID="42", SLURM_NNODES=2, SLURM_NODEID=1, MASTER_ADDR="worker-0", MASTER_PORT=29511)
    inv = load_inventory(str(FIX / "render" / "inventory.yaml"))
    assert main(["launch", "--from-env", "--dry-run", "-i", str(FIX / "render" / "inventory.yaml")]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[-1] == shlex.join(torchrun_argv(
        python=sys.executable, nnodes=2, nproc=8, node_rank=1, master_addr="worker-0", master_port=29511,
        run_id="42", target=["-m", "trainer", "--preset", "small", "--epochs", "3", "--run-name", "it's mine"]))
    exports = dict(shlex.split(ln[len("export "):])[0].split("=", 1) for ln in lines[:-1])
    assert exports == {**node_env(inv, inv.nodes[1]), "CLUSTERCTL_RUN_ID": "42"}
    for words in ("nodes          2", "this node      1", "GPUs per node  8", "total GPUs     16",
                  "collective 7200 s", "NCCL_BUFFSIZE 16 MiB", "config         -m trainer --preset small"):
        assert words in err


def test_dry_run_without_inventory_uses_trainer_defaults_and_scaled_timeouts(platform_env, capsys):
    platform_env(WORLD_SIZE=8, RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=1)
    assert main(["launch", "--from-env", "--dry-run", "--master-port", "29999", "--nproc-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "export NCCL_TIMEOUT=14400" in out and "export NCCL_BUFFSIZE=33554432" in out  # 8 nodes: seed 004
    assert out.splitlines()[-1].endswith("--master-port 29999 --rdzv-id ctl-127.0.0.1-29999 -m trainer")


def test_exported_env_wins_over_defaults(platform_env, capsys):
    platform_env(WORLD_SIZE=2, RANK=1, MASTER_ADDR="m", NCCL_TIMEOUT=99)
    assert main(["launch", "--from-env", "--dry-run", "--", "x.py"]) == 0
    assert "NCCL_TIMEOUT" not in capsys.readouterr().out  # already set: not changed


def test_usage_errors_exit_2(platform_env, capsys):
    assert main(["launch", "--dry-run"]) == 2
    assert "--from-env" in capsys.readouterr().err
    assert main(["launch", "--from-env"]) == 2
    err = capsys.readouterr().err
    assert "no platform variables" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_failed_check_exits_1_before_exec(platform_env, capsys):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        platform_env(WORLD_SIZE=2, RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=s.getsockname()[1])
        assert main(["launch", "--from-env", "--", "x.py"]) == 1
    assert "in use on the master" in capsys.readouterr().err


# ------------------------------------------------------------------ two test-cluster nodes

PLATFORMS = {
    "generic": lambda i, n, m, port: {"WORLD_SIZE": n, "RANK": i, "MASTER_ADDR": m, "MASTER_PORT": port},
    "indexed-job": lambda i, n, m, port: {"JOB_COMPLETION_INDEX": i, "WORLD_SIZE": n, "MASTER_ADDR": m,
                                          "MASTER_PORT": port, "CLUSTERCTL_RUN_ID": "job-x"},
    "kubeflow": lambda i, n, m, port: {"PET_NNODES": n, "PET_NODE_RANK": i, "PET_MASTER_ADDR": m,
                                       "PET_MASTER_PORT": port, "WORLD_SIZE": n * 2, "RANK": i},
    "skypilot": lambda i, n, m, port: {"SKYPILOT_NUM_NODES": n, "SKYPILOT_NODE_RANK": i,
                                       "SKYPILOT_NODE_IPS": "\n".join(m_ips), "MASTER_PORT": port},
}
m_ips: list[str] = []


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("platform", sorted(PLATFORMS))
def test_two_cluster_nodes_form_one_job_from_platform_vars(cluster4, tmp_path, platform):
    nodes = cluster4.nodes[2:4]  # render's cluster test uses node1/node2
    m_ips[:] = [nd.host for nd in nodes]
    port = 29650 + sorted(PLATFORMS).index(platform)
    inv = cluster4.inventory(env={"OMP_NUM_THREADS": "1"})
    inv["nodes"] = inv["nodes"][2:4]
    for nd in nodes:
        work = nd.home / "gpt_train"
        subprocess.run(["rm", "-rf", str(work / "results")], check=True)
        work.mkdir(exist_ok=True)
        (work / "ddp_check.py").write_text((FIX / "render" / "ddp_check.py").read_text())
        (work / "inv.yaml").write_text(yaml.safe_dump(inv))  # the image would ship it
        for p in (work, work / "ddp_check.py", work / "inv.yaml"):
            os.chown(p, cluster4.pw.pw_uid, cluster4.pw.pw_gid)
    procs = []
    for i, nd in enumerate(nodes):
        env = {k: str(v) for k, v in PLATFORMS[platform](i, 2, nodes[0].host, port).items()}
        # the inventory only for generic (env + iface from it); the others pin the iface by flag
        extra = ["-i", "inv.yaml"] if platform == "generic" else ["--iface", "eth0"]
        cmd = ("cd ~/gpt_train && exec env " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
               + " " + shlex.join([cluster4.python, "-m", "orchestrator.cli", "launch", "--from-env", *extra,
                                   "--", "ddp_check.py", "results"]))
        procs.append(nd.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    got = sorted((json.loads(f.read_text()) for nd in nodes for f in (nd.home / "gpt_train/results").glob("*.json")),
                 key=lambda g: g["rank"])
    assert [g["rank"] for g in got] == [0, 1, 2, 3]
    assert [g["host"] for g in got] == [nodes[0].name] * 2 + [nodes[1].name] * 2
    assert all(g["world"] == 4 and g["sum"] == 4 and g["grad"] == got[0]["grad"] for g in got)
    assert len({g["run_id"] for g in got}) == 1 and all(g["gloo_iface"] == "eth0" for g in got)
    assert "GPUs per node  2 (nvidia-smi sees 2" in outs[0] and "total GPUs     4" in outs[0]
