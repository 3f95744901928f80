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
from orchestrator.platforms.fromenv import (LocalGpus, Platform, detect_gpus, detect_platform, local_checks, local_gpus,
                                            visible)
from orchestrator.gpus import Gpu
from orchestrator.inventory import load_inventory
from orchestrator.torchrun import node_env, torchrun_argv

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

def test_detect_gpus_runs_the_gpu_probe_with_a_fake_nvidia_smi_on_path(tmp_path):
    from tests.cluster.fakes import gpu_state, install_nvidia_smi

    install_nvidia_smi(tmp_path, gpu_state("n1", 2, processes=[(4242, "python", 30000, 1)]))
    local = detect_gpus({"PATH": f"{tmp_path}:/usr/bin:/bin"})
    assert local.tool == "nvidia-smi" and len(local.gpus) == 2 and local.error is None
    assert [len(g.processes) for g in local.gpus] == [0, 1] and local.gpus[1].processes[0].pid == 4242
    assert detect_gpus({"PATH": "/nonexistent"}) == LocalGpus(None)


def test_local_gpus_nvidia_rocm_and_broken():
    nv = local_gpus(sec("nvidia-gpus", read_gpu("transcribed_nvidia_h100x8_noheader_nounits.csv"))
                    + sec("nvidia-apps", read_gpu("transcribed_nvidia_h100x8_apps_noheader_nounits.csv"), rc=None))
    assert nv.tool == "nvidia-smi" and len(nv.gpus) == 8 and nv.gpus[0].busy
    rocm = local_gpus(sec("rocm-gpus", read_gpu("transcribed_rocm_mi300x_json.json")))
    assert rocm.tool == "rocm-smi" and len(rocm.gpus) == 2
    assert local_gpus("@@no-gpu-tool\n") == LocalGpus(None)
    broken = local_gpus(sec("nvidia-gpus", "Failed to initialize NVML", rc=9))
    assert broken.error == "Failed to initialize NVML"


def test_visible_devices_limit_the_gpus():
    gpus = tuple(Gpu(i, "g", uuid=f"GPU-{i}") for i in range(8))
    assert [g.index for g in visible(gpus, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})] == [0, 1, 2, 3]
    assert [g.index for g in visible(gpus, {"CUDA_VISIBLE_DEVICES": "GPU-7"})] == [7]
    assert visible(gpus, {}) == gpus


def sec(name, body, rc=0, arg=""):
    head = f"@@{name}" + (f" {arg}" if arg else "")
    return f"{head}\n{body.rstrip(chr(10))}\n" + (f"@@rc {rc}\n" if rc is not None else "")


def read_gpu(name):
    return (FIX / "gpus" / name).read_text()


def recorded(text):
    """A probe runner that answers with recorded output (what the node's tools printed)."""
    return lambda inventory, node, checks, env: text


def test_local_checks_read_the_probe_with_preflights_parsers():
    four = "".join(read_gpu("transcribed_nvidia_h100x8_noheader_nounits.csv").splitlines(keepends=True)[:2])
    text = (sec("nvidia-gpus", four) + sec("nvidia-apps", read_gpu("transcribed_nvidia_h100x8_apps_noheader_nounits.csv"), rc=None)
            + sec("proc", "python train.py", rc=None, arg="48211")
            + sec("ss", "LISTEN 0 128 0.0.0.0:29511 0.0.0.0:* users:((\"python\",pid=77,fd=3))")
            + sec("shm", "Filesystem 1024-blocks Used Available Capacity Mounted on\n"
                         "shm 65536 0 65536 0% /dev/shm") + "@@end\n")
    plat = Platform("x", 2, 0, "127.0.0.1", 29511, "r")
    local = local_gpus(text)
    got = {r.check: r for r in local_checks(plat, 4, local, {}, probe=recorded(text))}
    assert list(got) == ["gpu_count", "gpu_idle", "port_free", "iface", "shm"]  # no inventory: no output_dir
    assert got["gpu_count"].status == "fail" and "invalid device ordinal" in got["gpu_count"].remedy
    assert got["gpu_idle"].status == "fail" and "pid 48211" in got["gpu_idle"].detail
    assert got["port_free"].status == "fail" and "pid 77" in got["port_free"].detail
    assert got["iface"].status == "skip" and got["shm"].status == "fail"
    # CUDA_VISIBLE_DEVICES narrows what gpu_count counts: 1 visible GPU for 2 processes
    vis = {r.check: r for r in local_checks(plat, 2, local, {"CUDA_VISIBLE_DEVICES": "1"}, probe=recorded(text))}
    assert vis["gpu_count"].status == "fail" and "1 GPU " in vis["gpu_count"].detail
    # a worker does not check the port; a CPU node with no GPU tool is fine
    worker = Platform("x", 2, 1, "127.0.0.1", 29511, "r")
    cpu = {r.check: r for r in local_checks(worker, 1, LocalGpus(None), {}, probe=recorded("@@no-gpu-tool\n"))}
    assert cpu["gpu_count"].status == "ok" and cpu["port_free"].status == "skip"


def test_local_checks_run_the_probe_here(tmp_path):
    # the real probe on this machine: a free port, an existing iface, a writable output dir
    inv_path = tmp_path / "inv.yaml"
    inv_path.write_text(yaml.safe_dump({"workdir": str(tmp_path), "output_dir": "out",
                                        "nodes": [{"name": "a", "host": "127.0.0.1"}]}))
    inv = load_inventory(str(inv_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plat = Platform("x", 1, 0, "127.0.0.1", port, "r")
    got = {r.check: r for r in local_checks(plat, 1, LocalGpus(None), {"GLOO_SOCKET_IFNAME": "lo"}, inv)}
    assert got["port_free"].status == "ok" and got["iface"].status == "ok" and "lo up" in got["iface"].detail
    assert got["output_dir"].status == "ok" and str(tmp_path) in got["output_dir"].detail
    assert got["gpu_count"].status in ("ok", "warn", "fail")  # whatever this machine has
    assert not list(tmp_path.glob("**/.clusterctl-write-test*"))


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
        run_id="42", target=["-m", "trainer", "--preset", "small", "--epochs", "3", "--run-name", "it's mine"],
        rdzv="timeout=900"))
    exports = dict(shlex.split(ln[len("export "):])[0].split("=", 1) for ln in lines[:-1])
    assert exports == {**node_env(inv, inv.nodes[1]), "CLUSTERCTL_RUN_ID": "42"}
    for words in ("nodes          2", "this node      1", "GPUs per node  8", "total GPUs     16",
                  "collective 7200 s", "NCCL_BUFFSIZE 16 MiB, rendezvous 900 s",
                  "config         -m trainer --preset small"):
        assert words in err


def test_dry_run_without_inventory_uses_trainer_defaults_and_scaled_timeouts(platform_env, capsys):
    platform_env(WORLD_SIZE=8, RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=1)
    assert main(["launch", "--from-env", "--dry-run", "--master-port", "29999", "--nproc-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "export NCCL_TIMEOUT=14400" in out and "export NCCL_BUFFSIZE=33554432" in out  # 8 nodes: seed 004
    assert out.splitlines()[-1].endswith("--master-port 29999 --rdzv-id ctl-127.0.0.1-29999 --rdzv-conf timeout=900 "
                                         "-m trainer")


def test_the_rendezvous_timeout_follows_the_platforms_node_count_as_train_derives_it(platform_env, capsys):
    # every node of a 256-node SLURM job derives the same timeout train would (runs/scaling.py)
    platform_env(SLURM_JOB_ID="7", SLURM_NNODES=256, SLURM_NODEID=3, MASTER_ADDR="gpu000")
    assert main(["launch", "--from-env", "--dry-run", "--nproc-per-node", "8"]) == 0
    out, err = capsys.readouterr()
    argv = shlex.split(out.splitlines()[-1])
    assert argv[argv.index("--rdzv-conf") + 1] == "timeout=1500" and argv.count("--rdzv-conf") == 1
    assert "rendezvous 1500 s" in err


def test_the_jobs_own_rdzv_conf_wins_and_keeps_its_other_keys(platform_env, capsys):
    platform_env(WORLD_SIZE=256, RANK=0, MASTER_ADDR="m", PET_RDZV_CONF="read_timeout=90,timeout=60")
    assert main(["launch", "--from-env", "--dry-run", "--nproc-per-node", "1"]) == 0
    argv = shlex.split(capsys.readouterr().out.splitlines()[-1])
    assert argv[argv.index("--rdzv-conf") + 1] == "read_timeout=90,timeout=60" and argv.count("--rdzv-conf") == 1


def test_a_rdzv_conf_torchrun_would_refuse_exits_2_in_one_paragraph(platform_env, capsys):
    platform_env(WORLD_SIZE=2, RANK=0, MASTER_ADDR="m", PET_RDZV_CONF="timeout=soon")
    assert main(["launch", "--from-env", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "PET_RDZV_CONF='timeout=soon'" in err and "Nothing was started" in err and "Traceback" not in err


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
        port = s.getsockname()[1]
        platform_env(WORLD_SIZE=2, RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        assert main(["launch", "--from-env", "--", "x.py"]) == 1
    err = capsys.readouterr().err
    assert f"{port} already in use by pid {os.getpid()}" in err and "check FAIL" in err


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
