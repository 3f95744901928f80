"""`render slurm|k8s`: golden files, the Kubernetes schema (offline), quoting, and the rendered
sbatch script run under a fake srun/scontrol, locally and on the test cluster, launching the run."""

import json
import os
import shlex
import socket
import stat
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from orchestrator.cli import main
from orchestrator.inventory import load_inventory
from orchestrator.platforms.render import common_env, render_k8s, render_k8s_objects, render_slurm
from orchestrator.torchrun import node_env

FIX = Path(__file__).parent / "fixtures" / "render"
INV = FIX / "inventory.yaml"
K8S_ARGS = ["--image", "ghcr.io/acme/train:1.0", "--namespace", "ml", "--name", "gpt2-small"]


def rendered(argv, capsys):
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def golden(name, text):
    path = FIX / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; rerun with UPDATE_GOLDEN=1 if that is intended"


def test_slurm_golden(capsys):
    golden("slurm.sbatch", rendered(["render", "slurm", "-i", str(INV)], capsys))


def test_slurm_golden_with_script_args(capsys):
    text = rendered(["render", "slurm", "-i", str(INV), "--job-name", "gpt2", "--partition", "h100",
                     "--time", "24:00:00", "--", "train.py", "--lr", "3e-4", "--note", "a b"], capsys)
    golden("slurm_script_args.sbatch", text)


def test_k8s_golden(capsys):
    golden("k8s.yaml", rendered(["render", "k8s", "-i", str(INV), *K8S_ARGS], capsys))


def test_output_file(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    assert main(["render", "slurm", "-i", str(INV), "-o", str(out)]) == 0
    assert out.read_text() == (FIX / "slurm.sbatch").read_text()


def test_slurm_script_is_valid_bash_and_carries_trains_env():
    inv = load_inventory(str(INV))
    text = render_slurm(inv)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    lines = text.splitlines()
    sbatch = [i for i, ln in enumerate(lines) if ln.startswith("#SBATCH")]
    first_cmd = next(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))
    assert max(sbatch) < first_cmd  # sbatch stops reading #SBATCH at the first command
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --gpus-per-node=8" in lines
    assert "#SBATCH --ntasks-per-node=1" in lines
    # the exports are exactly what train gives each node (node_env)
    env = dict(ln[len("export "):].split("=", 1) for ln in lines
               if ln.startswith("export ") and not ln.startswith("export MASTER"))
    assert {k: v.strip("'") for k, v in env.items()} == node_env(inv, inv.nodes[0]) == node_env(inv, inv.nodes[1])
    assert lines[-1].startswith("srun --kill-on-bad-exit=1 /opt/venv/bin/python -m orchestrator.cli launch "
                                "--from-env --nproc-per-node 8 -- -m trainer --preset small")


def test_every_value_is_quoted(tmp_path):
    nasty = "$(touch PWNED); echo 'x' `id` \"q\" \\ end"
    inv_path = tmp_path / "inv.yaml"
    inv_path.write_text(yaml.safe_dump({
        "workdir": "/srv/my runs/$(x)", "python": "/opt/py env/bin/python",
        "env": {"NASTY": nasty}, "nodes": [{"name": "a", "host": "h1", "gpus": 1}],
        "train": {"script": "t.py", "args": [nasty]}}))
    inv = load_inventory(str(inv_path))
    text = render_slurm(inv)
    # replace the scheduler calls and srun by printers, then run the script for real
    fake = text.replace("srun --kill-on-bad-exit=1 ", "printf '%s\\n' ").replace(
        'scontrol show hostnames "$SLURM_JOB_NODELIST"', "echo h1")
    fake = fake.replace("cd '/srv/my runs/$(x)'", "pwd >/dev/null")
    assert "cd '/srv/my runs/$(x)'" in text
    out = subprocess.run(["bash", "-c", fake + '\nprintf "%s\\n" "$NASTY"'], capture_output=True, text=True,
                         cwd=tmp_path, env={"PATH": os.environ["PATH"], "SLURM_JOB_NODELIST": "h1"})
    assert out.returncode == 0, out.stderr
    words = out.stdout.splitlines()
    assert words[:3] == ["/opt/py env/bin/python", "-m", "orchestrator.cli"]
    assert words[-2] == nasty and words[-1] == nasty
    assert not (tmp_path / "PWNED").exists()


def test_sbatch_header_values_are_checked(capsys):
    assert main(["render", "slurm", "-i", str(INV), "--job-name", "a b"]) == 2
    assert "#SBATCH" in capsys.readouterr().err


def trainer_args(text):
    """The trainer's arguments in a rendered sbatch script or Kubernetes manifest."""
    if text.startswith("#!"):
        return shlex.split(text.splitlines()[-1].split(" -- ", 1)[1])
    return k8s_docs(text)[1]["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("cmd", [["slurm"], ["k8s", "--image", "img"]])
def test_unknown_flags_before_the_script_are_refused(cmd, capsys):
    """A mistyped option is an error (exit 2), not an argument for the trainer."""
    assert main(["render", *cmd, "-i", str(INV), "--partiton", "gpu"]) == 2
    out, err = capsys.readouterr()
    assert "No such option '--partiton'" in err and out == ""
    # after `--`, or after the script's name, every word is the trainer's, flags included
    text = rendered(["render", *cmd, "-i", str(INV), "--", "train.py", "--partiton", "gpu"], capsys)
    assert trainer_args(text) == ["train.py", "--partiton", "gpu"]
    text = rendered(["render", *cmd, "-i", str(INV), "train.py", "--lr", "3e-4"], capsys)
    assert trainer_args(text) == ["train.py", "--lr", "3e-4"]


def test_uneven_gpus_need_an_explicit_count(tmp_path, capsys):
    p = tmp_path / "inv.yaml"
    p.write_text("nodes:\n- {name: a, host: h1, gpus: 8}\n- {name: b, host: h2, gpus: 4}\n")
    assert main(["render", "slurm", "-i", str(p)]) == 2
    assert "--gpus-per-node" in capsys.readouterr().err
    assert main(["render", "slurm", "-i", str(p), "--gpus-per-node", "4"]) == 0
    assert "#SBATCH --gpus-per-node=4" in capsys.readouterr().out


def test_per_node_settings_are_dropped_with_a_warning(tmp_path, capsys):
    p = tmp_path / "inv.yaml"
    p.write_text("nodes:\n- {name: a, host: h1, gpus: 2, iface: eth0}\n- {name: b, host: h2, gpus: 2, iface: ens5}\n")
    inv = load_inventory(str(p))
    env, dropped = common_env(inv)
    assert dropped == ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"] and "NCCL_TIMEOUT" in env
    assert main(["render", "k8s", "-i", str(p), "--image", "img"]) == 0
    assert "GLOO_SOCKET_IFNAME" in capsys.readouterr().err


# ------------------------------------------------------------------ Kubernetes

def k8s_docs(text):
    return [d for d in yaml.safe_load_all(text) if d is not None]


@pytest.mark.parametrize("version", ["1.30.0", kubernetes_validate.latest_version()])
def test_k8s_validates_against_the_job_and_service_schema(version):
    for doc in k8s_docs((FIX / "k8s.yaml").read_text()):
        kubernetes_validate.validate(doc, version, strict=True)


def test_schema_check_is_not_vacuous():
    service, job = render_k8s_objects(load_inventory(str(INV)), image="img")
    job["spec"]["parallelism"] = "2"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, "1.30.0", strict=True)
    job["spec"]["parallelism"] = 2
    job["spec"]["template"]["spec"]["containers"][0]["enviroment"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, "1.30.0", strict=True)


def test_k8s_semantics():
    inv = load_inventory(str(INV))
    service, job = k8s_docs(render_k8s(inv, ["train.py", "--lr", "1"], image="img:1", name="gpt2",
                                       namespace="ml"))
    # what kubectl apply --dry-run=client checks before sending: kind, apiVersion, a valid name
    assert (service["apiVersion"], service["kind"], job["apiVersion"], job["kind"]) == \
        ("v1", "Service", "batch/v1", "Job")
    assert service["metadata"]["name"] == job["metadata"]["name"] == "gpt2"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"] == 2
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": "gpt2"}  # the label the Job controller puts on its pods
    (c,) = pod["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["MASTER_ADDR"] == "gpt2-0.gpt2" and env["WORLD_SIZE"] == "2" and env["MASTER_PORT"] == "29511"
    assert "RANK" not in env  # the node rank is JOB_COMPLETION_INDEX, set by Kubernetes
    assert {k: v for k, v in env.items() if k in node_env(inv, inv.nodes[0])} == node_env(inv, inv.nodes[0])
    assert c["command"] == ["clusterctl", "launch", "--from-env", "--nproc-per-node", "8", "--"]
    assert c["args"] == ["train.py", "--lr", "1"]
    assert c["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert "workingDir" not in c  # ~/gpt_train means nothing in an image


@pytest.mark.parametrize("args", [["--name", "GPT2"], ["--name", "2gpt"], ["--name", "a" * 62],
                                  ["--namespace", "Bad_NS"], ["--image", "bad image"]])
def test_k8s_rejects_names_kubectl_would(args, capsys):
    argv = ["render", "k8s", "-i", str(INV), "--image", "img", *args]
    assert main(argv) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_k8s_cpu_nodes_request_no_gpus(tmp_path):
    p = tmp_path / "inv.yaml"
    p.write_text("nodes:\n- {name: a, host: h1, gpus: 0}\n- {name: b, host: h2, gpus: 0}\n"
                 "train: {nproc_per_node: 2}\n")
    _, job = render_k8s_objects(load_inventory(str(p)), image="img")
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert "resources" not in c and "--nproc-per-node" in c["command"]
    assert "--gpus-per-node" not in render_slurm(load_inventory(str(p)))


# ------------------------------------------------------------------ the rendered script, run

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_slurm_bin(tmp_path):
    """srun and scontrol on PATH, both Python scripts run by this interpreter."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    for name, src in (("srun", "fake_srun.py"), ("scontrol", "fake_scontrol.py")):
        f = bin_dir / name
        f.write_text(f"#!{sys.executable}\n" + (FIX / src).read_text())
        f.chmod(f.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir


def run_sbatch(script, tmp_path, home, nodes, nodelist, job_id="4242"):
    bin_dir = fake_slurm_bin(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    cfg = tmp_path / "srun.json"
    cfg.write_text(json.dumps({"logs": str(logs), "nodes": nodes}))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home), "SLURM_JOB_ID": job_id,
           "SLURM_NNODES": str(len(nodes)), "SLURM_JOB_NUM_NODES": str(len(nodes)),
           "SLURM_JOB_NODELIST": nodelist, "FAKE_SRUN_CONFIG": str(cfg), "CLUSTERCTL_TEST_EXTRA": "carried"}
    proc = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    task_logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.iterdir()))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{task_logs}"
    return task_logs


def check_results(results_dir, world, hosts=None, run_id="4242"):
    got = [json.loads((results_dir / f"rank{r}.json").read_text()) for r in range(world)]
    assert [g["world"] for g in got] == [world] * world
    assert all(g["sum"] == world for g in got)
    assert all(g["grad"] == got[0]["grad"] for g in got)  # one DDP job, gradients averaged
    assert {g["run_id"] for g in got} == {run_id}
    if hosts:
        assert [g["host"] for g in got] == hosts
    return got


@pytest.mark.slow
def test_sbatch_under_fake_srun_locally_runs_the_job(tmp_path):
    """No root needed: two 'nodes' on this machine, gloo over lo, 2 processes each."""
    home = tmp_path / "home"
    work = home / "run"
    work.mkdir(parents=True)
    (work / "ddp_check.py").write_text((FIX / "ddp_check.py").read_text())
    inv_path = tmp_path / "inv.yaml"
    inv_path.write_text(yaml.safe_dump({
        "master_port": free_port(), "workdir": "~/run", "python": sys.executable,
        "env": {"OMP_NUM_THREADS": "1"},
        "nodes": [{"name": "l0", "connection": "local", "gpus": 0, "iface": "lo"},
                  {"name": "l1", "connection": "local", "gpus": 0, "iface": "lo"}],
        "train": {"script": "ddp_check.py", "args": ["results"], "nproc_per_node": 2}}))
    script = tmp_path / "job.sbatch"
    assert main(["render", "slurm", "-i", str(inv_path), "-o", str(script)]) == 0
    logs = run_sbatch(script, tmp_path, home, [None, None], "localhost,localhost")
    got = check_results(work / "results", 4)
    assert [g["group_rank"] for g in got] == ["0", "0", "1", "1"]  # node rank = SLURM_NODEID
    assert all(g["dist_timeout"] == "7200" and g["gloo_iface"] == "lo" and g["extra"] == "carried" for g in got)
    assert "clusterctl launch --from-env (SLURM)" in logs and "total GPUs     4" in logs


@pytest.mark.cluster
@pytest.mark.slow
def test_sbatch_under_fake_srun_on_the_test_cluster(cluster4, tmp_path):
    """srun over ssh into two namespaces, each a node with 2 fake GPUs; gloo over eth0."""
    nodes = cluster4.nodes[:2]
    for nd in nodes:
        work = nd.home / "gpt_train"
        subprocess.run(["rm", "-rf", str(work / "results")], check=True)
        work.mkdir(exist_ok=True)
        (work / "ddp_check.py").write_text((FIX / "ddp_check.py").read_text())
        for p in (work, work / "ddp_check.py"):
            os.chown(p, cluster4.pw.pw_uid, cluster4.pw.pw_gid)
    inv = cluster4.inventory(master_port=29640, train={"script": "ddp_check.py", "args": ["results"]},
                             env={"OMP_NUM_THREADS": "1"})
    inv["nodes"] = inv["nodes"][:2]
    inv_path = tmp_path / "inv.yaml"
    inv_path.write_text(yaml.safe_dump(inv))
    script = tmp_path / "job.sbatch"
    assert main(["render", "slurm", "-i", str(inv_path), "-o", str(script)]) == 0
    assert "#SBATCH --gpus-per-node=2" in script.read_text()
    home = tmp_path / "home"
    (home / "gpt_train").mkdir(parents=True)
    logs = run_sbatch(script, tmp_path, home, [cluster4.ssh_argv(nd) for nd in nodes], "node[1-2]")
    got = [json.loads(p.read_text()) for nd in nodes for p in sorted((nd.home / "gpt_train/results").glob("*.json"))]
    assert sorted(g["rank"] for g in got) == [0, 1, 2, 3]
    got.sort(key=lambda g: g["rank"])
    assert [g["host"] for g in got] == ["node1", "node1", "node2", "node2"]
    assert all(g["world"] == 4 and g["sum"] == 4 and g["grad"] == got[0]["grad"] for g in got)
    assert all(g["run_id"] == "4242" and g["gloo_iface"] == "eth0" and g["dist_timeout"] == "7200" for g in got)
    assert "nvidia-smi sees 2" in logs


# ------------------------------------------------------------------ Kubernetes, --checkpoint-pvc

PVC_ARGS = [*K8S_ARGS, "--checkpoint-pvc", "gpt2-checkpoints", "--max-restarts", "2"]


def test_k8s_checkpoint_pvc_golden(capsys):
    golden("k8s_checkpoint_pvc.yaml", rendered(["render", "k8s", "-i", str(INV), *PVC_ARGS], capsys))


@pytest.mark.parametrize("version", ["1.30.0", kubernetes_validate.latest_version()])
def test_k8s_checkpoint_pvc_validates_against_the_schema(version):
    docs = k8s_docs((FIX / "k8s_checkpoint_pvc.yaml").read_text())
    assert "podFailurePolicy" in docs[1]["spec"]  # the new fields are the ones checked
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_k8s_checkpoint_pvc_semantics():
    """The claim is mounted where CLUSTERCTL_CHECKPOINT_DIR points, the bundled trainer's rendered
    args parse to `resume == auto`, and every failure but a usage error or a disruption retries
    the whole Job within 2 x nodes x restarts pod failures."""
    from trainer.config import parse_args
    inv = load_inventory(str(INV))
    _, job = render_k8s_objects(inv, ["-m", "trainer", "--preset", "small"], image="img", name="gpt2",
                                checkpoint_pvc="ckpt", max_restarts=2)
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == env["CLUSTERCTL_CHECKPOINT_DIR"]]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mount["name"]]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    assert mount["subPath"] == "gpt2"  # one directory per Job name on the claim
    assert c["args"][-2:] == ["--resume", "auto"] and parse_args(c["args"][2:]).resume == "auto"
    spec = job["spec"]
    assert spec["backoffLimit"] == 2 * 2 * 2 and pod["restartPolicy"] == "Never"
    rules = spec["podFailurePolicy"]["rules"]
    failjob_codes = [v for r in rules if r["action"] == "FailJob" and "onExitCodes" in r
                     for v in r["onExitCodes"]["values"]]
    assert failjob_codes == [2]  # 1 is what torchrun returns on the peers of a lost pod: retried
    assert {"type": "DisruptionTarget", "status": "True"} in rules[1]["onPodConditions"]
    assert all(r.get("onExitCodes", {}).get("containerName", "trainer") == c["name"] for r in rules)


def test_k8s_without_a_claim_does_not_retry():
    _, job = render_k8s_objects(load_inventory(str(INV)), image="img")
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert job["spec"]["backoffLimit"] == 0 and "podFailurePolicy" not in job["spec"]
    assert "--resume" not in c["args"] and "CLUSTERCTL_CHECKPOINT_DIR" not in {e["name"] for e in c["env"]}


@pytest.mark.parametrize("script_args,want", [
    (["-m", "trainer", "--resume", "auto"], ["-m", "trainer", "--resume", "auto"]),
    (["-m", "trainer", "--resume=auto", "--lr", "1"], ["-m", "trainer", "--resume=auto", "--lr", "1"]),
    (["train.py", "--lr", "1"], ["train.py", "--lr", "1"]),  # another script reads CLUSTERCTL_CHECKPOINT_DIR itself
])
def test_k8s_checkpoint_pvc_resume_args(script_args, want, capsys):
    text = rendered(["render", "k8s", "-i", str(INV), "--image", "img", "--checkpoint-pvc", "c", "--",
                     *script_args], capsys)
    assert trainer_args(text) == want


@pytest.mark.parametrize("args,says", [
    (["--checkpoint-pvc", "c", "--", "-m", "trainer", "--resume", "none"], "--resume 'none'"),
    (["--checkpoint-pvc", "c", "--", "-m", "trainer", "--resume=/x/step_10.pt"], "--resume '/x/step_10.pt'"),
    (["--checkpoint-pvc", "Bad_Claim"], "PersistentVolumeClaim"),
    (["--max-restarts", "2"], "needs --checkpoint-pvc"),
])
def test_k8s_checkpoint_pvc_refusals(args, says, capsys):
    assert main(["render", "k8s", "-i", str(INV), "--image", "img", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


# ------------------------------------------------------------------ setup: the venv runs the job

def setup_inventory(tmp_path, venv="~/venvs/train", clusterctl=True):
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump({
        "nodes": [{"name": "a", "host": "10.0.0.1", "gpus": 2}, {"name": "b", "host": "10.0.0.2", "gpus": 2}],
        "setup": {"requirements": "reqs.txt", "venv": venv, "clusterctl": clusterctl}}))
    return path


def fake_python(home: Path, venv: str) -> None:
    """A venv python that prints its argv, one per line."""
    py = home / venv / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    py.chmod(0o755)


def test_renders_run_launch_with_the_setup_venvs_python(tmp_path, capsys):
    """With `setup:` the nodes' only Python is the venv setup builds (clusterctl in it with
    `clusterctl: true`): the sbatch script and the pods run `launch --from-env` with its python,
    `~/` being each node's (or pod's) home."""
    inv = setup_inventory(tmp_path)
    text = rendered(["render", "slurm", "-i", str(inv)], capsys)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    srun = text.splitlines()[-1]
    assert srun == ('srun --kill-on-bad-exit=1 "$HOME"/venvs/train/bin/python -m orchestrator.cli launch '
                    "--from-env --nproc-per-node 2 -- -m trainer"), srun
    home = tmp_path / "home"
    fake_python(home, "venvs/train")
    argv = subprocess.run(["bash", "-c", srun.replace("srun --kill-on-bad-exit=1 ", "", 1)], capture_output=True,
                          text=True, env={"HOME": str(home), "PATH": os.environ["PATH"]}, check=True).stdout
    assert argv.splitlines()[:4] == ["-m", "orchestrator.cli", "launch", "--from-env"]

    job = render_k8s_objects(load_inventory(str(inv)), image="img:1")[1]
    container = job["spec"]["template"]["spec"]["containers"][0]
    cmd = container["command"]
    assert cmd[:2] == ["/bin/sh", "-c"] and container["args"] == ["-m", "trainer"]
    argv = subprocess.run([*cmd, *container["args"]], capture_output=True, text=True, check=True,
                          env={"HOME": str(home), "PATH": os.environ["PATH"]}).stdout.splitlines()
    assert argv == ["-m", "orchestrator.cli", "launch", "--from-env", "--nproc-per-node", "2", "--", "-m", "trainer"]
    kubernetes_validate.validate(job, "1.30.0", strict=True)
    absolute = render_k8s_objects(load_inventory(str(setup_inventory(tmp_path, venv="/opt/train"))), image="img:1")
    assert absolute[1]["spec"]["template"]["spec"]["containers"][0]["command"] == \
        ["/opt/train/bin/python", "-m", "orchestrator.cli", "launch", "--from-env", "--nproc-per-node", "2", "--"]


@pytest.mark.parametrize("target", ["slurm", "k8s"])
def test_a_setup_venv_without_clusterctl_is_refused_with_the_fix(tmp_path, capsys, target):
    inv = setup_inventory(tmp_path, clusterctl=False)
    code = main(["render", target, "-i", str(inv), *(["--image", "img:1"] if target == "k8s" else [])])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "add `clusterctl: true` to setup:" in err and f"`clusterctl setup -i {inv}`" in err, err
