"""An edit of setup's requirements costs what it changes, without a cluster: the node-side script
builds the next venv from uv's unpacked copies of the wheels the last one had and imports only
what a change reaches; resolving here starts from the file's previous lock when lines were only
added; and `clusterctl setup` on a local node ships only the wheel it lacks.
(On the test cluster: tests/test_setup_cluster.py; the figures: bench/bench_setup_incremental.py.)"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.probe import load
from orchestrator.pyenv.resolve import Addition, Target, resolve
from tests.test_setup import cache, make_wheel, node

# every module of these test wheels notes its import in $MARKS, so a test sees what was imported
MARK = "import os\nwith open(os.environ['MARKS'], 'a') as f:\n    f.write(__name__ + '\\n')\n"


def site(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*")) / "site-packages"


def install(tmp_path: Path, short: str, *flags: str) -> dict:
    env = dict(os.environ, UV_CACHE_DIR=str(tmp_path / "uv"), MARKS=str(tmp_path / "marks"))
    (tmp_path / "marks").write_text("")
    r = node("install", str(tmp_path / "venv"), str(tmp_path / "cache"), short, *flags, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1]) | {"marks": (tmp_path / "marks").read_text().split()}


def imports(venv: Path, *names: str) -> subprocess.CompletedProcess:
    return subprocess.run([venv / "bin" / "python", "-c", "import " + ", ".join(names)], capture_output=True,
                          env=dict(os.environ, MARKS=os.devnull))


def test_the_next_venv_links_the_unchanged_packages_and_imports_only_what_a_change_reaches(tmp_path):
    root, venv = tmp_path / "cache", tmp_path / "venv"
    needs = {"beta": ("alpha",)}  # beta requires alpha
    first, _ = cache(root, {"alpha": "1.0", "beta": "1.0", "gamma": "1.0"}, body=MARK, requires=needs)
    got = install(tmp_path, first)
    assert got["imported"] == ["alpha", "beta", "gamma"] and sorted(got["marks"]) == ["alpha", "beta", "gamma"]
    old_alpha = os.stat(site(venv) / "alpha" / "__init__.py")

    # one package added: the others are uv's unpacked copies, the very files the old venv has
    added, _ = cache(root, {"alpha": "1.0", "beta": "1.0", "gamma": "1.0", "delta": "1.0"}, body=MARK,
                     requires=needs)
    got = install(tmp_path, added)
    assert (got["added"], got["changed"], got["removed"]) == (["delta"], [], [])
    assert got["imported"] == ["delta"] and got["marks"] == ["delta"]
    assert os.stat(site(venv) / "alpha" / "__init__.py").st_ino == old_alpha.st_ino
    assert os.path.realpath(venv) != got["previous"] and imports(venv, "alpha", "delta").returncode == 0

    # another version of alpha: alpha and beta, which requires it, are imported; gamma and delta not
    changed, _ = cache(root, {"alpha": "2.0", "beta": "1.0", "gamma": "1.0", "delta": "1.0"}, body=MARK,
                       requires=needs)
    got = install(tmp_path, changed)
    assert (got["added"], got["changed"], got["removed"]) == ([], ["alpha"], [])
    assert got["imported"] == ["alpha", "beta"] and sorted(got["marks"]) == ["alpha", "beta"]
    versions = "import importlib.metadata as m; print(m.version('alpha'))"
    assert subprocess.run([venv / "bin" / "python", "-c", versions], capture_output=True,
                          text=True).stdout.strip() == "2.0"

    # delta removed: it is gone from the new venv, and nothing needed it
    removed, _ = cache(root, {"alpha": "2.0", "beta": "1.0", "gamma": "1.0"}, body=MARK, requires=needs)
    got = install(tmp_path, removed)
    assert (got["added"], got["changed"], got["removed"]) == ([], [], ["delta"]) and got["imported"] == []
    assert imports(venv, "delta").returncode != 0 and imports(venv, "alpha", "beta", "gamma").returncode == 0


def test_what_a_change_reaches_is_read_from_the_requirements_of_both_locks():
    changes = load("pyenv").changes
    py = __import__("platform").python_version()

    def lock(**wheels):
        return {"checks": {"top": "top", "side": "side"},
                "wheels": [{"name": n, "sha256": sha, "requires": req} for n, (sha, req) in wheels.items()]}

    old = lock(top=("t", ["mid"]), mid=("m", ["low"]), low=("l", []), side=("s", []), extra=("x", []))
    rec = {"python": py, "wheels": old["wheels"]}
    same = lock(top=("t", ["mid"]), mid=("m", ["low"]), low=("l", []), side=("s", []), extra=("x", []))
    assert changes(same, rec) == ([], [], [], [])
    deep = lock(top=("t", ["mid"]), mid=("m", ["low"]), low=("L", []), side=("s", []), extra=("x", []))
    assert changes(deep, rec) == ([], ["low"], [], ["top"])  # through mid
    gone = lock(top=("t", ["mid"]), mid=("m", []), side=("s", []), extra=("x", []))
    assert changes(gone, rec) == ([], [], ["low"], ["top"])  # top needed low
    assert changes(gone, rec, force=True)[3] == ["side", "top"]
    assert changes(same, None)[3] == ["side", "top"]  # a first venv imports everything
    assert changes(same, {**rec, "python": "2.7.0"})[3] == ["side", "top"]  # another interpreter
    assert changes(same, {"hash": "h", "requirements": []})[3] == ["side", "top"]  # a record without wheels


@pytest.mark.slow
def test_a_wheel_damaged_in_place_is_found_removed_and_shipped_again(tmp_path):
    """The index trusts a cached wheel whose size and time did not change; when the installer then
    fails (or with --force, before building), every wheel is checked and a damaged one removed,
    so the next setup ships it again."""
    root = tmp_path / "cache"
    short, _ = cache(root, {"alpha": "1.0"}, body=MARK)
    install(tmp_path, short)
    wheel = root / "wheels" / "alpha-1.0-py3-none-any.whl"
    good = wheel.read_bytes()
    env = dict(os.environ, UV_CACHE_DIR=str(tmp_path / "uv"), MARKS=str(tmp_path / "marks"))
    for flags in ((), ("--force",)):
        st = wheel.stat()
        wheel.write_bytes(b"\0" * st.st_size)  # damaged, its size and time kept
        os.utime(wheel, ns=(st.st_atime_ns, st.st_mtime_ns))
        probe = json.loads(node("probe", str(tmp_path / "venv"), str(root)).stdout)
        assert "wheels/alpha-1.0-py3-none-any.whl" in probe["cache"]  # trusted: not shipped
        r = node("install", str(tmp_path / "venv"), str(root), short, *flags, env=env)
        assert r.returncode == 1 and "did not match the lock's sha256 (a damaged copy, now removed)" in r.stderr
        assert not wheel.exists()
        probe = json.loads(node("probe", str(tmp_path / "venv"), str(root)).stdout)
        assert "wheels/alpha-1.0-py3-none-any.whl" not in probe["cache"] and probe["wheelhouses"] == []
        wheel.write_bytes(good)  # what the next setup ships
        assert install(tmp_path, short, "--shipped")["installed"] and imports(tmp_path / "venv", "alpha").returncode == 0


# ------------------------------------------------------------------ resolving here


@pytest.fixture
def index(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "alpha", "1.0")
    return wheels


def here() -> Target:
    import platform
    import sys

    return Target("%d.%d" % sys.version_info[:2], platform.machine(), None)


def versions(lock) -> dict[str, str]:
    return {w["name"]: w["version"] for w in lock.wheels}


def test_an_added_line_is_resolved_alone_and_every_previous_pin_stays(tmp_path, index):
    req, root = tmp_path / "req.txt", tmp_path / "home"
    req.write_text("--no-index\n--find-links wheels\nalpha\n")
    first = resolve(req, here(), root=root)
    assert versions(first) == {"alpha": "1.0"} and first.kept == 0
    make_wheel(index, "alpha", "2.0")  # newer, but the file already chose 1.0
    make_wheel(index, "beta", "1.0", requires=("alpha",))
    req.write_text("--no-index\n--find-links wheels\nalpha\n# and now\nbeta\n")
    added = resolve(req, here(), root=root)
    assert versions(added) == {"alpha": "1.0", "beta": "1.0"} and added.kept == 1 and not added.cached
    assert os.path.samefile(first.dir / "alpha-1.0-py3-none-any.whl", added.dir / "alpha-1.0-py3-none-any.whl")
    assert next(w for w in added.wheels if w["name"] == "beta")["requires"] == ["alpha"]
    assert versions(resolve(req, here(), root=root, refresh=True)) == {"alpha": "2.0", "beta": "1.0"}


@pytest.mark.slow
def test_an_added_line_that_conflicts_with_the_pins_resolves_the_whole_file(tmp_path, index):
    req, root = tmp_path / "req.txt", tmp_path / "home"
    req.write_text("--no-index\n--find-links wheels\nalpha\n")
    resolve(req, here(), root=root)
    make_wheel(index, "alpha", "2.0")
    make_wheel(index, "beta", "2.0", requires=("alpha>=2",))
    req.write_text("--no-index\n--find-links wheels\nalpha\nbeta==2.0\n")
    lock = resolve(req, here(), root=root)
    assert versions(lock) == {"alpha": "2.0", "beta": "2.0"} and lock.kept == 0
    req.write_text("--no-index\n--find-links wheels\nbeta==2.0\n")  # a line removed: the whole file again
    assert resolve(req, here(), root=root).kept == 0


def test_comments_or_a_new_node_side_alone_run_no_pip(tmp_path, index, monkeypatch):
    import orchestrator.pyenv.resolve as resolving

    req, root = tmp_path / "req.txt", tmp_path / "home"
    req.write_text("--no-index\n--find-links wheels\nalpha\n")
    side = tmp_path / "side"
    side.mkdir()
    one = make_wheel(side, "ccside", "1.0+g1")
    two = make_wheel(side, "ccside", "1.0+g2", body="x = 2")
    add = [Addition(w["file"], (side / w["file"]).read_bytes(), (), ("ccside",)) for w in (one, two)]
    first = resolve(req, here(), root=root, add=add[0])
    monkeypatch.setattr(resolving, "_pip", lambda *a: pytest.fail(f"pip ran: {a}"))
    req.write_text("# pinned by the team\n--no-index\n--find-links wheels\nalpha  # the model's\n")
    again = resolve(req, here(), root=root, add=add[0])
    assert again.hash == first.hash and again.kept == 2
    moved = resolve(req, here(), root=root, add=add[1])
    assert versions(moved) == {"alpha": "1.0", "ccside": "1.0+g2"} and moved.kept == 1
    assert [w["file"] for w in moved.wheels if w.get("local")] == [two["file"]]


@pytest.mark.slow
def test_setup_on_a_local_node_ships_only_the_added_wheel(tmp_path, monkeypatch, capsys):
    """The whole command: the second setup after adding one line ships that wheel (and the new
    lock), nothing else, and the venv gains it."""
    from orchestrator.cli import main

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "alpha", "1.0", body="x = 'a' * 100000")
    make_wheel(wheels, "beta", "1.0")
    (tmp_path / "req.txt").write_text("--no-index\n--find-links wheels\nalpha==1.0\n")
    inv = tmp_path / "nodes.yaml"
    inv.write_text("nodes: [{name: a, connection: local, gpus: 0}]\n"
                   f"setup: {{requirements: req.txt, venv: {tmp_path}/venv}}\n")
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HOME", str(tmp_path))
    main(["setup", "-i", str(inv), "--json"])
    first = json.loads(capsys.readouterr().out)["nodes"][0]
    assert first["action"] == "created" and first["wheels"] == ["alpha-1.0-py3-none-any.whl"], first
    (tmp_path / "req.txt").write_text("--no-index\n--find-links wheels\nalpha==1.0\nbeta==1.0\n")
    main(["setup", "-i", str(inv), "--json"])
    doc = json.loads(capsys.readouterr().out)
    second = doc["nodes"][0]
    assert second["action"] == "updated" and second["wheels"] == ["beta-1.0-py3-none-any.whl"], second
    assert second["bytes"] < first["bytes"] and "+beta" in second["detail"] and "imported beta" in second["detail"]
    assert "added lines only: 1 of 2 wheels kept" in doc["resolved"]
    assert subprocess.run([tmp_path / "venv" / "bin" / "python", "-c", "import alpha, beta"]).returncode == 0


def test_what_a_wheel_requires_counts_the_nodes_platform_and_the_extras_asked_for():
    from orchestrator.pyenv.wheels import requirement_graph

    def w(name, *reqs, extras=()):
        return {"name": name, "requires_dist": list(reqs), "extras": list(extras)}

    wheels = [w("tqdm", 'colorama; platform_system == "Windows"'),
              w("pygments", 'colorama>=0.4.6; extra == "windows-terminal"', extras=["windows-terminal"]),
              w("rich", "pygments<3,>=2.13.0", "markdown-it-py>=2.2.0"),
              w("fsspec", 'aiohttp!=4.0.0a0; extra == "http"', 'requests; extra == "http"', extras=["http", "s3"]),
              w("lightning", "fsspec[http]>=2022.5.0", "torch>=2.1.0", "tqdm", 'tomli; python_version < "3.11"'),
              w("aiohttp", 'brotli; platform_python_implementation == "CPython" and extra == "speedups"',
                extras=["speedups"]),
              w("colorama"), w("torch"), w("markdown-it-py"), w("requests"), w("brotli"), w("tomli")]
    asked = ["lightning==2.5.0", "rich", "aiohttp[speedups]  # fast"]
    graph = requirement_graph(wheels, asked, Target("3.11", "x86_64", "2.36").markers())
    assert graph["tqdm"] == [] and graph["pygments"] == []  # Windows only; an extra nobody asked for
    assert graph["rich"] == ["markdown-it-py", "pygments"]
    assert graph["lightning"] == ["fsspec", "torch", "tqdm"]  # tomli is for Python < 3.11
    assert graph["fsspec"] == ["aiohttp", "requests"]  # lightning asks for fsspec[http]
    assert graph["aiohttp"] == ["brotli"]  # the file asks for aiohttp[speedups]
