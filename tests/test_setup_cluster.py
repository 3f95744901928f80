"""`clusterctl setup` on 4 test nodes that cannot reach any package registry (network namespaces on
a bridge with no default route): from nothing to the same venv (the trainer's requirements, torch
2.13.0) on every node and preflight's python_env ok; a second run that skips every node; one small
package added, which is all that crosses the link and all that is unpacked, and removed again; an
unsatisfiable requirement that stops here and leaves every venv working; a node that cannot build
that is named while the others switch, its own venv untouched; a wheel lost from a node's cache
shipped again.

The tests share one cluster and one CLUSTERCTL_HOME, so the requirements are resolved once and
the later cases reuse the venvs the first one built: they run in file order."""

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from tests.cluster import TestCluster, require_root

REPO = Path(__file__).resolve().parent.parent
REQS = REPO / "trainer" / "requirements.txt"
SCHEMA = json.loads((REPO / "orchestrator" / "schemas" / "setup.json").read_text())
VENV = "~/venvs/train"
PYPI = ("151.101.0.223", 443)
BUILT: dict[str, list] = {}  # what the first case built, for the later ones to compare with  # one of pypi.org's addresses: no DNS needed to prove there is no route

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cl():
    require_root()
    with TestCluster(n=4, gpus=0, name_prefix="ccsu") as cluster:
        yield cluster
        # ~50,000 files a node (venvs, uv's cache): rm -rf on all four at once beats the
        # teardown's one-by-one removal
        rms = [nd.popen("rm -rf ~/venvs ~/.cache") for nd in cluster.nodes]
        for p in rms:
            p.wait(300)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("setup")


def inventory(cl, work: Path, requirements: Path, name: str = "nodes.yaml") -> Path:
    raw = cl.inventory(setup={"requirements": str(requirements), "venv": VENV})
    del raw["python"]  # with setup: every node runs the venv's python
    path = work / name
    import yaml

    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def clusterctl(work: Path, *args: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, CLUSTERCTL_HOME=str(work / "home"))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=REPO)
    return p, time.monotonic() - t0


def venv_state(cl) -> list[tuple[str, str]]:
    """Per node: the hash its venv records, and torch's version as that venv's python imports it
    (the four imports at once)."""
    cmd = f"cat {VENV}/.clusterctl-setup.json && {VENV}/bin/python -c 'import torch; print(torch.__version__)'"
    procs = [nd.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for nd in cl.nodes]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        rec, _, torch = stdout.rpartition("}")
        out.append((json.loads(rec + "}")["hash"], torch.strip()))
    return out


def test_the_nodes_cannot_reach_any_registry(cl):
    for nd in cl.nodes:
        assert nd.run("ip route show default").stdout.strip() == "", f"{nd.name} has a default route"
        code = f"import socket; socket.create_connection({PYPI!r}, timeout=3)"
        r = nd.run(f"{sys.executable} -c {shlex.quote(code)}", check=False, timeout=30)
        assert r.returncode != 0 and ("unreachable" in r.stderr or "timed out" in r.stderr), r.stderr


def test_setup_from_nothing_builds_the_same_venv_everywhere(cl, work):
    path = inventory(cl, work, REQS)
    p, took = clusterctl(work, "setup", "-i", str(path), "--json")
    shown = json.loads(p.stdout or "{}")
    print(f"first setup (resolve, ship, 4 installs): {took:.1f}s; "
          + json.dumps({k: v for k, v in shown.items() if k not in ("notes", "nodes")})
          + "".join(f"\n  {n['name']}: {n['detail']}" for n in shown.get("nodes", [])))
    assert p.returncode == 0, p.stderr + p.stdout
    doc = json.loads(p.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert [(n["name"], n["action"], n["ok"]) for n in doc["nodes"]] == \
        [(nd.name, "created", True) for nd in cl.nodes], doc
    assert doc["python_env"] == "ok" and doc["packages"] >= 6
    assert doc["bytes_sent"] <= 1.2 * doc["wheel_bytes"] + 50e6  # relayed: left this machine once (+ uv)
    BUILT["state"] = venv_state(cl)
    assert BUILT["state"] == [(doc["hash"], "2.13.0+cpu")] * 4
    dists = {nd.run(f"{VENV}/bin/python -c 'import importlib.metadata as m; "
                    "print(sorted(d.name.lower() + \"==\" + d.version for d in m.distributions()))'").stdout
             for nd in cl.nodes}
    assert len(dists) == 1 and "numpy==2.4.6" in dists.pop()
    pf, _ = clusterctl(work, "preflight", "-i", str(path), "--only", "python_env")
    assert pf.returncode == 0, pf.stdout + pf.stderr


def test_a_second_run_skips_every_node(cl, work):
    path = work / "nodes.yaml"
    p, took = clusterctl(work, "setup", "-i", str(path), "--json")
    print(f"second setup (every node unchanged): {took:.2f}s")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert [n["action"] for n in doc["nodes"]] == ["unchanged"] * 4
    assert doc["bytes_sent"] == 0 and doc["resolved"] == "cached"


def each_node(cl, cmd: str) -> list[str]:
    procs = [nd.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for nd in cl.nodes]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        out.append(stdout)
    return out


TORCH = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
DISTS = f"{VENV}/bin/python -c 'import importlib.metadata as m; print(sorted(d.name.lower() + \"==\" + d.version " \
        "for d in m.distributions()))'"
# the wheels in a node's cache and one file of the venv's torch, by inode: a file received or
# unpacked again is a new inode
INODES = f"shopt -s nullglob; stat -c '%i %n' ~/.cache/clusterctl/wheels/*.whl {VENV}/lib/python3*/site-packages/torch/__init__.py"


def test_one_added_package_is_the_only_wheel_shipped_and_the_only_one_unpacked(cl, work):
    """colorama (25 kB, no requirements) added to the trainer's file: every node is sent that wheel
    (and the new lock) and nothing else, keeps every other package's files (the very inodes: uv's
    unpacked copies, linked), and gains colorama; removed again, nothing is shipped and it is gone."""
    req = work / "edited-requirements.txt"
    req.write_text(REQS.read_text())
    path = inventory(cl, work, req, "edited.yaml")
    p, unchanged = clusterctl(work, "setup", "-i", str(path), "--json")
    assert p.returncode == 0 and {n["action"] for n in json.loads(p.stdout)["nodes"]} == {"unchanged"}, p.stdout
    dists, inodes = each_node(cl, DISTS), each_node(cl, INODES)

    req.write_text(REQS.read_text() + "colorama==0.4.6\n")
    p, added = clusterctl(work, "setup", "-i", str(path), "--json")
    print(f"unchanged setup {unchanged:.1f}s, one package added {added:.1f}s ({added / unchanged:.1f}x)\n{p.stderr}")
    assert p.returncode == 0, p.stderr + p.stdout
    doc = json.loads(p.stdout)
    assert doc["bytes_sent"] < 200_000, doc["bytes_sent"]  # the wheel and the lock, once (relayed), not 300 MB
    assert all(f"/wheels/{TORCH}" in before for before in inodes), inodes  # the cache held it already
    jsonschema.validate(doc, SCHEMA)
    assert [(n["action"], n["wheels"]) for n in doc["nodes"]] == \
        [("updated", ["colorama-0.4.6-py2.py3-none-any.whl"])] * 4, doc["nodes"]
    assert all("+colorama; imported colorama" in n["detail"] for n in doc["nodes"]), doc["nodes"]
    assert "added lines only" in doc["resolved"] and doc["python_env"] == "ok"
    for before, after in zip(inodes, each_node(cl, INODES)):
        assert set(before.splitlines()) < set(after.splitlines())  # nothing received or unpacked again
        assert [ln for ln in after.splitlines() if ln not in before] == \
            [ln for ln in after.splitlines() if "colorama-0.4.6" in ln]
    grown = [json.loads(d.replace("'", '"')) for d in each_node(cl, DISTS)]
    assert grown == [sorted(json.loads(d.replace("'", '"')) + ["colorama==0.4.6"]) for d in dists]
    assert all(o.strip() == "ok" for o in each_node(cl, f"{VENV}/bin/python -c 'import colorama; print(\"ok\")'"))

    req.write_text(REQS.read_text())
    p, _ = clusterctl(work, "setup", "-i", str(path), "--json")
    doc = json.loads(p.stdout)
    assert p.returncode == 0 and [(n["action"], n["wheels"]) for n in doc["nodes"]] == [("updated", [])] * 4, doc
    assert all("-colorama" in n["detail"] for n in doc["nodes"]) and doc["bytes_sent"] < 200_000
    assert each_node(cl, DISTS) == dists and venv_state(cl) == BUILT["state"]


def test_an_unsatisfiable_requirement_stops_here_and_changes_nothing(cl, work):
    bad = work / "bad-requirements.txt"
    bad.write_text(REQS.read_text().replace("torch==2.13.0", "torch==9.9.9"))
    p, _ = clusterctl(work, "setup", "-i", str(inventory(cl, work, bad, "bad.yaml")))
    assert p.returncode == 2, p.stderr
    assert "torch==9.9.9" in p.stderr and "Nothing was changed on the nodes" in p.stderr
    assert "Traceback" not in p.stderr
    assert venv_state(cl) == BUILT["state"]


def test_a_node_that_cannot_build_is_named_and_keeps_its_venv(cl, work):
    """--force rebuilds node3 and node4: node3 cannot write its venvs' directory; node4's
    wheel cache lost a wheel, so it is shipped that one again."""
    node3, node4 = cl.nodes[2], cl.nodes[3]
    node3.run(f"chmod 555 {VENV}.d")
    node4.run("rm ~/.cache/clusterctl/wheels/numpy-*.whl")
    dirs = node3.run(f"ls {VENV}.d").stdout.split()  # the current venv and the one before it
    try:
        p, took = clusterctl(work, "setup", "-i", str(work / "nodes.yaml"), "--force", "--nodes", "node[3-4]")
    finally:
        node3.run(f"chmod 755 {VENV}.d")
    print(f"forced rebuild on 2 nodes, one failing: {took:.1f}s\n{p.stderr}")
    assert p.returncode == 1, p.stderr
    lines = {ln.split(":")[0].strip(): ln for ln in p.stderr.splitlines() if ln.startswith("  node")}
    assert "failed" in lines["node3"] and "Permission denied" in lines["node3"], p.stderr
    assert "updated" in lines["node4"] and set(lines) == {"node3", "node4"}, p.stderr
    assert venv_state(cl) == BUILT["state"]  # the same hash and torch everywhere
    assert node3.run(f"ls {VENV}.d").stdout.split() == dirs  # nothing left of the failed build
    assert node3.run(f"readlink {VENV}").stdout.strip()[len("train.d/"):] in dirs
    assert len(node4.run(f"ls {VENV}.d").stdout.split()) == 2  # the new one and the previous one
    assert node4.run("ls ~/.cache/clusterctl/wheels/numpy-*.whl").returncode == 0
