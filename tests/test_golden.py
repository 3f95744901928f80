"""Golden outputs: `status`, `runs`, `top`, the preflight table and the end of a run, rendered from
fixed records (fixed times, ids and homes) at COLUMNS=80 and 120 and compared byte for byte with
tests/fixtures/golden/NAME.WIDTH.txt. Every line must also fit its width, and a table's header
may never be cut to `…`.

When a change to a layout is meant, regenerate the files and read the diff before committing:

    CLUSTERCTL_GOLDEN_UPDATE=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_golden.py

The run directory's path is written as <HOME> (each test's CLUSTERCTL_HOME is a temporary one).
"""

import json
import os
import re
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.checks import CheckResult
from orchestrator.checks.registry import CHECKS
from orchestrator.checks.report import NodeReport, PreflightReport
from orchestrator.cli import main
from orchestrator.gpus.records import Gpu, GpuProcess
from orchestrator.inventory import parse_inventory
from orchestrator.runs.logs.rankfiles import RankFiles
from orchestrator.runs.spec import RunSpec
from orchestrator.runs.store import Run, write_json
from orchestrator.top import NodeGpus, table

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
WIDTHS = (80, 120)
T0 = 1795000000.0  # 2026-11-18 11:06:40 UTC: every time in the records is T0 + something


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TZ", "UTC")
    monkeypatch.delenv("NO_COLOR", raising=False)
    time.tzset()
    yield tmp_path / "home"
    monkeypatch.undo()
    time.tzset()


def check(name: str, width: int, text: str, home: Path | None = None) -> None:
    if home is not None:
        text = text.replace(str(home), "<HOME>")
    text = "\n".join(line.rstrip() for line in text.splitlines()) + "\n"
    # tables fit; clusterctl's own sentences are the terminal's to wrap
    wide = [line for line in text.splitlines() if len(line) > width and not line.startswith("clusterctl:")]
    assert not wide, f"{name} at {width} columns: lines wider than the screen:\n" + "\n".join(wide)
    path = GOLDEN / f"{name}.{width}.txt"
    if os.environ.get("CLUSTERCTL_GOLDEN_UPDATE"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"{path} is missing: CLUSTERCTL_GOLDEN_UPDATE=1 writes it"
    assert text == path.read_text(), f"{name} at {width} columns differs from {path} (CLUSTERCTL_GOLDEN_UPDATE=1 " \
                                     "rewrites it; read the diff)"


def cli(capsys, monkeypatch, width: int, *argv: str) -> str:
    monkeypatch.setenv("COLUMNS", str(width))
    capsys.readouterr()
    main(list(argv))
    cap = capsys.readouterr()
    return cap.out + cap.err


def headers_whole(text: str, *names: str) -> None:
    for n in names:
        assert n in text, f"header {n!r} was cut"


# ---------------------------------------------------------------- the records
def node(name, rank, first, state, pid, code=None, ended=None):
    d = {"name": name, "rank": rank, "host": f"10.0.0.{name[-1]}", "state": state, "nproc": 2,
         "first_rank": first, "last_rank": first + 1, "pid": pid}
    if code is not None:
        d.update(exit_code=code, ended=T0 + ended)
    return d


def restarted_run(home: Path) -> Run:
    """Attempt 2 of at most 3 running on node1, node5, node3, node4 after node2 was lost; two
    checkpoints copied home."""
    run = Run.create("train-20261118-082640-a1b2", RunSpec(max_restarts=2, args=("--max-steps", "100")))
    nodes = [node("node1", 0, 0, "running", 4101), node("node5", 1, 2, "running", 4105),
             node("node3", 2, 4, "running", 4103), node("node4", 3, 6, "running", 4104)]
    attempts = [{"attempt": 1, "key": f"{run.id}", "nodes": ["node1", "node2", "node3", "node4"], "launched": T0 + 5,
                 "verdict": "node lost", "bad_nodes": ["node2"], "failed_at": T0 + 71, "ended": T0 + 72},
                {"attempt": 2, "key": f"{run.id}.a2", "nodes": ["node1", "node5", "node3", "node4"],
                 "launched": T0 + 95, "checkpoint": "ckpt_00000040.pt"}]
    write_json(run.dir / "run.json", {"id": run.id, "state": "running", "created": T0, "started": T0 + 95,
                                      "nodes": nodes, "attempts": attempts, "world_size": 8})
    logs = {"node1": "[default0]:step 50 | loss 2.041 | 412 ms\n[default1]:[W1118 08:29:10.1 c10d] slow\n",
            "node5": "[default0]:data: 1000 batches of 8\n[default1]:resumed from ckpt_00000040.pt at step 40\n",
            "node3": "W1118 08:29:11.123000 4103 torch/distributed/elastic/agent/server/api.py:700] warn\n",
            "node4": ""}
    for name, text in logs.items():
        run.node_log(name).write_text(text)
    split_ranks(run, nodes)
    # when the steps arrived (runs/stepjournal.py) and the loss (the story): the goodput line
    (run.dir / "progress").mkdir()
    (run.dir / "progress" / "steps-a1.jsonl").write_text(f'{{"at": {T0 + 20}, "step": 0}}\n{{"at": {T0 + 64}, "step": 44}}\n')
    (run.dir / "progress" / "steps-a2.jsonl").write_text(f'{{"at": {T0 + 115}, "step": 40}}\n'
                                                         f'{{"at": {T0 + 195}, "step": 50}}\n')
    (run.dir / "story.jsonl").write_text(json.dumps({"at": T0 + 70, "text": "node2 lost: no answer for 8.0s (...)",
                                                     "lost": "node2", "silent_s": 8.0}) + "\n")
    ck = run.dir / "checkpoints"
    ck.mkdir()
    for step in (30, 40):
        (ck / f"ckpt_{step:08d}.pt").write_bytes(b"x")
        (ck / f"ckpt_{step:08d}.pt.sha256").write_text("00  ckpt\n")
    return run


def stopped_run(home: Path) -> Run:
    """Stopped by the user: torchrun left each node with 143 (SIGTERM), which is not a failure."""
    run = Run.create("bench-20261118-090000-c3d4", RunSpec())
    nodes = [node("node1", 0, 0, "failed", 5101, 143, 2300), node("node2", 1, 2, "failed", 5102, 143, 2301)]
    write_json(run.dir / "run.json", {
        "id": run.id, "state": "stopped", "created": T0 + 2000, "started": T0 + 2005, "ended": T0 + 2305,
        "exit_code": 130, "summary": "stopped on request", "teardown": "stop", "nodes": nodes, "world_size": 4,
        "attempts": [{"attempt": 1, "key": run.id, "nodes": ["node1", "node2"], "launched": T0 + 2005}]})
    run.node_log("node1").write_text("[default0]:step 12 | loss 3.3\n[default0]:saved checkpoint ckpt_00000012.pt\n")
    split_ranks(run, nodes)
    return run


def split_ranks(run: Run, nodes: list[dict]) -> None:
    """The per-rank files the supervisor writes from the node logs (runs/logs/rankfiles.py), where
    `status` reads each rank's step."""
    RankFiles(run.dir, {nd["name"]: run.node_log(nd["name"]) for nd in nodes},
              {nd["name"]: nd["first_rank"] for nd in nodes}).close()


@pytest.fixture
def alive(monkeypatch):
    monkeypatch.setattr(Run, "supervisor_alive", lambda self: True)
    monkeypatch.setattr(time, "time", lambda: T0 + 200)


@pytest.mark.parametrize("width", WIDTHS)
def test_status_of_a_restarted_run(home, alive, capsys, monkeypatch, width):
    run = restarted_run(home)
    out = cli(capsys, monkeypatch, width, "status", run.id)
    check("status_restarted", width, out, home)
    headers_whole(out, "node", "ranks", "state", "runtime", "last line")
    assert "attempt 2 of at most 3" in out and "ckpt_00000040.pt" in out
    assert "[default" not in out and "c10d" not in out  # the job's line, not torch's warnings


@pytest.mark.parametrize("width", WIDTHS)
def test_status_of_a_run_the_user_stopped(home, alive, capsys, monkeypatch, width):
    run = stopped_run(home)
    out = cli(capsys, monkeypatch, width, "status", run.id)
    check("status_stopped", width, out, home)
    assert "failed" not in out and out.count("stopped") >= 3


@pytest.mark.parametrize("width", WIDTHS)
def test_runs(home, alive, capsys, monkeypatch, width):
    restarted_run(home)
    stopped_run(home)
    r = Run.create("run-20261118-100000-e5f6", RunSpec())
    write_json(r.dir / "run.json", {"id": r.id, "state": "finished", "created": T0 + 5600, "exit_code": 0,
                                    "nodes": [node("local0", 0, 0, "finished", 1, 0, 5700)], "world_size": 1,
                                    "attempts": [{"attempt": 1}]})
    out = cli(capsys, monkeypatch, width, "runs")
    check("runs", width, out, home)
    headers_whole(out, "run", "state", "tries", "nodes", "world", "created", "exit")
    assert "<HOME>" in out.replace(str(home), "<HOME>")  # which control home these runs are in
    for line in out.splitlines():
        assert "…" not in line


def top_views() -> list[NodeGpus]:
    run = "train-20261118-082640-a1b2"
    h100 = tuple(Gpu(i, "NVIDIA H100 80GB HBM3", 97.0 - i, 61234 + i, 81559, 64.0 + i, 612.0 - i, f"GPU-{i}",
                     (GpuProcess(7100 + i, "python3", 61000, "/usr/bin/python3 -m trainer --preset gpt2-medium "
                                 "--grad-accum 8", run),)) for i in range(8))
    a100 = (Gpu(0, "NVIDIA A100-SXM4-40GB", 0.0, 3, 40960, 31.0, 55.0),
            Gpu(1, "NVIDIA A100-SXM4-40GB", 12.0, 1200, 40960, 35.0, 90.0, None,
                (GpuProcess(881, "jupyter-lab", 1190, None, None), GpuProcess(902, "python3", 10, None, None))))
    return [NodeGpus("gpu01", "10.0.0.11", h100, "nvidia-smi"), NodeGpus("gpu02", "10.0.0.12", a100, "nvidia-smi"),
            NodeGpus("cpu01", "10.0.0.13", (), None),
            NodeGpus("gpu03", "10.0.0.14", error="connect: timed out after 10s", reachable=False)]


@pytest.mark.parametrize("width", WIDTHS)
def test_top_one_row_per_gpu(width):
    from rich.console import Console

    con = Console(width=width, record=True, file=open(os.devnull, "w"), color_system=None)
    con.print(table(top_views(), "nodes.yaml: 4 nodes, 10 GPUs, 9 busy  (08:30:00)"))
    out = con.export_text()
    check("top", width, out)
    rows = [line for line in out.splitlines() if re.match(r"^(gpu0\d)?\s+\d\s", line)]
    assert len(rows) == 10 and all("%" in line and "W" in line for line in rows)  # one line per GPU
    assert len([line for line in out.splitlines() if line.startswith(" ")]) <= 12  # only errors wrap
    headers_whole(out, "node", "gpu", "name", "util", "mem MiB", "temp", "power", "process [run]")


def preflight_report() -> PreflightReport:
    inv = parse_inventory(yaml.safe_dump({"master_port": 29500, "nodes": [
        {"name": f"node{i}", "host": f"10.0.0.{i}", "gpus": 8, "spare": i == 6} for i in range(1, 7)]}), "<t>")
    nodes = []
    for n in inv.nodes:
        rep = NodeReport(n)
        for c in CHECKS:
            rep.results[c] = CheckResult(c, "ok", "fine")
        if n.name in ("node3", "node4"):
            rep.results["clock_skew"] = CheckResult("clock_skew", "fail", "+30.000s ±0.001s vs control",
                                                    f"sync the clock on {n.name}: `sudo timedatectl set-ntp true`")
        if n.name == "node5":
            rep.results["shm"] = CheckResult("shm", "warn", "/dev/shm 512 MiB (512 MiB free): below 1 GiB",
                                             "give the container more shared memory (docker --shm-size 8g)")
        nodes.append(rep)
    return PreflightReport(inv, list(CHECKS), nodes, {n.name: 8 for n in inv.nodes}, 2.4)


@pytest.mark.parametrize("width", WIDTHS)
def test_preflight_table(width):
    from rich.console import Console

    con = Console(width=width, record=True, file=open(os.devnull, "w"), color_system=None)
    preflight_report().render(con)
    out = con.export_text()
    check("preflight", width, out)
    assert "spare node6" in out and "world size 40 on 5 nodes" in " ".join(out.split())


@pytest.mark.parametrize("width", WIDTHS)
def test_end_summary(home, capsys, monkeypatch, width):
    from orchestrator.runs.logs.rankfiles import RankFiles

    run = Run.create("train-20261118-082640-a1b2", RunSpec())
    write_json(run.dir / "run.json", {
        "id": run.id, "state": "finished", "created": T0, "started": T0 + 5, "ended": T0 + 900, "exit_code": 0,
        "summary": "every node finished", "nodes": [node("node1", 0, 0, "finished", 1, 0, 900)]})
    run.node_log("node1").write_text("[default0]:step 100 | loss 1.9\n")
    RankFiles(run.dir, {"node1": run.node_log("node1")}, {"node1": 0}).close()
    (run.dir / "checkpoints").mkdir()
    (run.dir / "checkpoints" / "ckpt_00000100.pt").write_bytes(b"x")
    (run.dir / "checkpoints" / "ckpt_00000100.pt.sha256").write_text("00  x\n")
    (run.dir / "tensorboard" / "node1").mkdir(parents=True)
    (run.dir / "tensorboard" / "node1" / "events.out.tfevents.1").write_bytes(b"x")
    out = cli(capsys, monkeypatch, width, "tail", run.id, "--no-follow", "-n", "0")
    check("end_summary", width, out, home)
    assert f"tensorboard --logdir <HOME>/runs/{run.id}/tensorboard" in " ".join(out.replace(str(home), "<HOME>").split())
