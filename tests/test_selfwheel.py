"""setup.clusterctl: clusterctl's node side as a wheel made here (orchestrator/pyenv/selfwheel.py),
what it declares, that `launch --from-env` needs nothing else, and how it joins the lock."""

import io
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from orchestrator.pyenv.resolve import Lock, Target, _build_lock
from orchestrator.pyenv.selfwheel import IMPORT_CHECK, NODE_PACKAGES, addition, node_wheel, package_files

REPO = Path(__file__).resolve().parent.parent


def test_the_node_wheel_is_the_package_with_only_the_node_side_requirements():
    name, data = node_wheel()
    assert node_wheel() == (name, data)  # the same code gives the same bytes: the lock's hash holds
    assert re.fullmatch(r"clusterctl-[0-9.]+\+g[0-9a-f]{12}-py3-none-any\.whl", name), name
    z = zipfile.ZipFile(io.BytesIO(data))
    names = z.namelist()
    for need in ("orchestrator/cli/launch.py", "orchestrator/remote/pyenv.py", "orchestrator/schemas/setup.json",
                 "orchestrator/platforms/fromenv.py"):
        assert need in names
    assert not any("__pycache__" in n or n.startswith("trainer/") for n in names)
    info = name.split("-py3")[0] + ".dist-info"
    meta = z.read(f"{info}/METADATA").decode()
    declared = [ln.split(": ", 1)[1] for ln in meta.splitlines() if ln.startswith("Requires-Dist: ")]
    assert [re.match(r"[A-Za-z0-9._-]+", r).group() for r in declared] == list(NODE_PACKAGES)
    assert "torch" not in meta and "fabric" not in meta and "uv" not in declared
    assert "clusterctl = orchestrator.cli:main" in z.read(f"{info}/entry_points.txt").decode()
    record = z.read(f"{info}/RECORD").decode().splitlines()
    assert len(record) == len(names) and f"{info}/RECORD,," in record
    edited = [(n, d + b"\n" if n == "orchestrator/cli/launch.py" else d) for n, d in package_files()]
    assert node_wheel(edited)[0] != name  # another checkout: another version, another lock hash


BLOCKED_RUN = r"""
import importlib.metadata as md, re, sys

def canon(n):
    return re.sub(r"[-_.]+", "-", n).lower()

keep, todo = set(), sys.argv[1].split(",")
while todo:  # the node packages and everything they require
    n = canon(todo.pop())
    if n in keep:
        continue
    keep.add(n)
    try:
        reqs = md.requires(n) or []
    except md.PackageNotFoundError:
        continue
    todo += [re.match(r"[A-Za-z0-9._-]+", r).group() for r in reqs if "extra ==" not in r]
blocked = {m for m, dists in md.packages_distributions().items()
           if m != "orchestrator" and not any(canon(d) in keep for d in dists)}

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the node side)", name=name)

sys.meta_path.insert(0, Block())
from orchestrator.cli import main
sys.exit(main(["launch", "--from-env", "--dry-run", "--", "train.py"]))
"""


def test_launch_from_env_imports_only_the_node_packages(tmp_path):
    """What the setup venv gets (NODE_PACKAGES and their requirements) is all `launch --from-env`
    imports: every other installed distribution (torch, fabric, rich, uv...) is blocked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "SKYPILOT_"))}
    env.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1", PYTHONPATH=str(REPO))
    env.pop("JOB_COMPLETION_INDEX", None)
    p = subprocess.run([sys.executable, "-c", BLOCKED_RUN, ",".join(NODE_PACKAGES)], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "-m torch.distributed.run --nnodes 1" in p.stdout and "train.py" in p.stdout


def test_the_node_wheel_joins_the_lock_and_travels_even_online(tmp_path):
    add = addition()
    (tmp_path / add.file).write_bytes(add.data)
    from tests.test_setup import make_wheel

    make_wheel(tmp_path, "click", "8.1.7")
    doc = _build_lock(tmp_path, "torch==2.13.0\n", Target("3.11", "x86_64", "2.36"), add)
    mine = next(w for w in doc["wheels"] if w["file"] == add.file)
    assert mine["local"] is True and mine["name"] == "clusterctl"
    assert IMPORT_CHECK in doc["imports"] and f"clusterctl=={mine['version']}" in doc["pins"]
    assert doc["requirements"][:1] == ["torch==2.13.0"] and "click>=8.1" in " ".join(doc["requirements"])
    assert doc["checks"][IMPORT_CHECK] == "clusterctl"  # imported again when the node side changes
    (tmp_path / "lock.json").write_text(json.dumps(doc))
    lock = Lock.load(tmp_path)
    assert list(lock.files(online=True)) == [add.file, "lock.json"]  # no index has it
    assert sorted(lock.files()) == sorted([add.file, "click-8.1.7-py3-none-any.whl", "lock.json"])
    assert mine["requires"] == ["click"]  # what it requires that the set holds
    assert lock.files()[add.file] == (f"wheels/{add.file}", mine["sha256"], mine["size"])


@pytest.mark.slow
def test_an_online_node_takes_the_wheel_made_here_from_its_cache(tmp_path):
    """--online: the node's index serves the locked files, but no index has the wheel made here;
    it came with the lock into the node's wheel cache and is installed from there, both checked by
    sha256."""
    from tests.test_setup import make_wheel, node

    index = tmp_path / "index"
    (index / "simple" / "ccalpha").mkdir(parents=True)
    served = make_wheel(index, "ccalpha", "1.0")
    (index / "simple" / "ccalpha" / "index.html").write_text(f'<a href="../../{served["file"]}">{served["file"]}</a>\n')
    root = tmp_path / "cache"
    (root / "wheels").mkdir(parents=True)
    (root / "wheelhouse" / ("1" * 16)).mkdir(parents=True)
    local = make_wheel(root / "wheels", "ccnodeside", "1.0+g0123456789ab") | {"local": True}
    doc = {"hash": "1" * 64, "python": "3.11", "pins": ["ccalpha==1.0", "ccnodeside==1.0+g0123456789ab"],
           "imports": ["ccalpha", "ccnodeside"], "wheels": [served, local]}
    (root / "wheelhouse" / ("1" * 16) / "lock.json").write_text(json.dumps(doc))
    env = dict(os.environ, UV_DEFAULT_INDEX=f"file://{index}/simple", PIP_INDEX_URL=f"file://{index}/simple")
    r = node("install", str(tmp_path / "venv"), str(root), "1" * 16, "--online", env=env)
    assert r.returncode == 0, r.stderr
    assert subprocess.run([tmp_path / "venv" / "bin" / "python", "-c", "import ccalpha, ccnodeside"]).returncode == 0
