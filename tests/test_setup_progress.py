"""`clusterctl setup` says what each node is doing while it installs (remote/pyenv.py prints each
step as it starts, transfer/progress.py turns those lines into steps, RichEvents shows one line per
node: the step, its bytes, its time so far). Run on a local node with a wheel whose import takes
2 s: each step must reach the screen while the node's command still runs, not with its end."""

import io
import time

import pytest

from orchestrator.inventory import load_inventory
from orchestrator.pyenv import requirements_path
from orchestrator.pyenv.nodes import setup_nodes
from orchestrator.transfer.progress import RichEvents, SyncEvents, progress_of
from orchestrator.transport import Cluster
from tests.test_setup import make_wheel


class Recorded(SyncEvents):
    def __init__(self):
        self.steps = []

    def step(self, node, what, nbytes):
        self.steps.append((time.monotonic(), node, what, nbytes))


@pytest.mark.slow
def test_each_install_step_is_told_as_it_starts_with_its_bytes(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    size = make_wheel(wheels, "slowpkg", "1.0", body="import time\ntime.sleep(2)\n")["size"]
    (tmp_path / "req.txt").write_text("--no-index\n--find-links wheels\nslowpkg==1.0\n")
    (tmp_path / "nodes.yaml").write_text("nodes: [{name: a, connection: local, gpus: 0}]\n"
                                         f"setup: {{requirements: req.txt, venv: {tmp_path}/venv}}\n")
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HOME", str(tmp_path))
    inv = load_inventory(str(tmp_path / "nodes.yaml"))
    events = Recorded()
    with Cluster(inv) as cluster:
        cluster.connect()
        report = setup_nodes(cluster, inv, requirements_path(inv), events=events)
    ended = time.monotonic()
    assert [r.action for r in report.results] == ["created"], report.results
    said = [(node, what, nbytes) for _, node, what, nbytes in events.steps]
    assert said[0] == ("a", "verifying the wheels", size) or said[0][1] == "creating the venv", said
    whats = [w for _, w, _ in said]
    assert whats[-4:] == ["creating the venv", "installing the wheels", "importing slowpkg", "done"], said
    assert ("a", "installing the wheels", size) in said
    importing = next(t for t, _, w, _ in events.steps if w == "importing slowpkg")
    assert ended - importing >= 1.5  # told while the 2 s import ran, not when the command returned


def test_progress_lines_are_read_back_and_shown_one_line_per_node_in_80_columns():
    from rich.console import Console

    assert progress_of('clusterctl-progress: {"step": "installing the wheels", "bytes": 277000000}') == \
        ("installing the wheels", 277000000)
    assert progress_of("error: importing alpha failed") is None and progress_of("clusterctl-progress: {bad") is None
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system=None)
    events = RichEvents(console)
    events.node_line("node1", "stderr", 'clusterctl-progress: {"step": "installing the wheels", "bytes": 277000000}')
    events.node_line("node2", "stderr", 'clusterctl-progress: {"step": "importing torch", "bytes": null}')
    events.node_line("node3", "stdout", 'clusterctl-progress: {"step": "not a step on stdout", "bytes": null}')
    events.node_line("node4", "stderr", 'clusterctl-progress: {"step": "done", "bytes": null}')
    console.print(events.progress.get_renderable())
    lines = [ln.rstrip() for ln in out.getvalue().splitlines() if ln.strip()]
    assert len(lines) == 3 and all(len(ln) <= 80 for ln in lines), lines
    assert lines[0].startswith("node1 installing the wheels") and "277.0 MB" in lines[0] and "0:00:0" in lines[0]
    assert "/?" not in lines[0] and "?" not in lines[1]  # no rate nor total for a step
    assert lines[1].startswith("node2 importing torch")
    assert lines[2].startswith("node4 installed") and lines[2].endswith("ok")
