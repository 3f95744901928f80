"""A DeepSpeed user's script, unchanged, under `clusterctl train` on the real test cluster.

`clusterctl train -- ds_train.py --deepspeed_config ds.json` starts torchrun on each node;
deepspeed.initialize reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR from torchrun's environment.
Without a GPU, DeepSpeed picks its CPU accelerator and, without oneCCL's torch bindings, the gloo
backend (deepspeed/accelerator/cpu_accelerator.py), so ZeRO-2 runs on the CPU test nodes as is.

On CPU, DeepSpeed's communication backend JIT-builds one C++ op (deepspeed_shm_comm, for
single-node shared-memory all-reduce) when it starts: with ninja and a C++ compiler, into
TORCH_EXTENSIONS_DIR. The `shm_op_dir` fixture builds it once per venv as the test user; the
nodes load it from there instead of each compiling it into its own fresh home.

DeepSpeed is imported only by the processes this module starts, never by pytest itself.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "scripts" / "ds_train.py"
ZERO2 = HERE / "fixtures" / "deepspeed" / "ds_zero2.json"
VENV_BIN = str(Path(sys.executable).parent)  # the venv's bin: ninja, a deepspeed dependency, is there
NODE_PATH = f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin"
STEPS = 8
BUILD_SHM_OP = ("from deepspeed.accelerator import get_accelerator; "
                "get_accelerator().create_op_builder('ShareMemCommBuilder').load()")


def cli(*args, timeout):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())


@pytest.fixture
def two_nodes(make_cluster):
    assert importlib.util.find_spec("deepspeed"), \
        "deepspeed is missing from the venv: it is in the `test` extra (bash scripts/test installs it)"
    return make_cluster(2, gpus=0)


@pytest.fixture
def shm_op_dir(two_nodes):
    """A TORCH_EXTENSIONS_DIR in the venv, owned by the test user, holding DeepSpeed's CPU
    shm comm op built once (minutes on a loaded machine; a no-op check on later runs)."""
    pw = two_nodes.pw
    d = Path(sys.prefix) / "torch_extensions"
    d.mkdir(exist_ok=True)
    for p in (d, *d.rglob("*")):  # torch rewrites build.ninja and takes a lock file there on every load
        os.chown(p, pw.pw_uid, pw.pw_gid)
    r = subprocess.run(["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", "--",
                        sys.executable, "-c", BUILD_SHM_OP], capture_output=True, text=True, timeout=900, cwd="/",
                       env={"PATH": NODE_PATH, "HOME": "/", "TORCH_EXTENSIONS_DIR": str(d),
                            "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"building DeepSpeed's CPU shm op needs ninja and a C++ compiler:\n{r.stderr[-3000:]}"
    return d


def user_project(cluster, config: Path):
    """What a DeepSpeed user syncs to the workdir: the script and its ds.json side by side."""
    for n in cluster.nodes:
        n.run("mkdir -p ~/gpt_train")
        n.run("cat > ~/gpt_train/ds_train.py", input=SCRIPT.read_text())
        n.run("cat > ~/gpt_train/ds.json", input=config.read_text())


def losses(stdout: str) -> list[float]:
    """Rank 0's loss per step, in step order."""
    found = [(int(m.group(1)), float(m.group(2)))
             for m in re.finditer(r"^node1/r0 +\| ds step (\d+) loss ([0-9.]+)$", stdout, re.M)]
    assert [s for s, _ in found] == list(range(len(found))), found
    return [loss for _, loss in found]


@pytest.mark.timeout(900)  # the first run on a machine compiles the shm op: minutes on 2 loaded cores
def test_zero2_script_trains_across_two_nodes_with_falling_loss(two_nodes, shm_op_dir, tmp_path, home):
    cluster = two_nodes
    user_project(cluster, ZERO2)
    inv = str(cluster.write_inventory(tmp_path / "nodes.yaml", env={
        "PATH": NODE_PATH, "TORCH_EXTENSIONS_DIR": str(shm_op_dir), "OMP_NUM_THREADS": "1"}))
    r = cli("train", "-i", inv, "--skip-preflight", "--", "ds_train.py", "--deepspeed_config", "ds.json",
            "--steps", str(STEPS), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = losses(r.stdout)
    assert len(got) == STEPS, r.stdout[-3000:]
    assert all(b < a for a, b in zip(got, got[1:])), got
    assert got[-1] < 0.75 * got[0], got
    assert re.search(r"^node1/r0 +\| ds done: zero stage 2, world 2, backend gloo, device cpu$", r.stdout, re.M)
    # ZeRO-2 split the optimizer's fp32 state between the two nodes' ranks
    held = {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in re.finditer(
        r"^node\d/r\d +\| ds rank (\d) holds (\d+) of (\d+) optimizer parameters$", r.stdout, re.M)}
    assert set(held) == {0, 1}, r.stdout[-3000:]
    total = held[0][1]
    assert all(0 < h < total for h, _ in held.values()) and held[0][0] + held[1][0] >= total, held
    (run_dir,) = (home / "runs").iterdir()
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["state"] == "finished" and rec["exit_code"] == 0 and rec["world_size"] == 2
    wait_for(lambda: not cluster.processes(), 15, "the nodes clean after a finished run")
