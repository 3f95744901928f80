"""The check registry, the shm / output_dir / python_env-accelerator / gpu_count rules and the
report's rendering: pure, from recorded outputs (tests/fixtures/preflight), no cluster."""

import io
import json
import re
from pathlib import Path

import yaml
from rich.console import Console

from orchestrator.checks import Ctx, sections
from orchestrator.checks.gpu import parse_gpu_count
from orchestrator.checks.output_dir import parse_output_dir
from orchestrator.checks.python import compare_python_env
from orchestrator.checks.registry import CHECKS, REGISTRY, fast_checks, probe_script
from orchestrator.checks.report import NodeReport, PreflightReport, nodeset
from orchestrator.checks.shm import parse_shm
from orchestrator.checks import fail, ok, warn
from orchestrator.inventory import parse_inventory
from orchestrator.checks.preflight import FAST_CHECKS
from tests.probe_text import read, read_gpu, sec

FIX = Path(__file__).parent / "fixtures" / "preflight"


INV = parse_inventory(yaml.safe_dump({
    "master_port": 29500,
    "nodes": [{"name": "m", "host": "10.0.0.1", "gpus": 8}, {"name": "w1", "host": "10.0.0.2"},
              {"name": "w2", "host": "10.0.0.3", "gpus": 0}]}), "<t>")
M, W1, W2 = INV.nodes


def ctx(node=M):
    return Ctx(node=node, inventory=INV, is_master=node.rank == 0)


# ------------------------------------------------------------------ the registry

def test_registry_drives_names_fast_subset_and_one_probe_script():
    assert CHECKS[:2] == ("ssh", "ping") and {"shm", "output_dir"} <= set(CHECKS)
    assert FAST_CHECKS == fast_checks() and {"ssh", "gpu_count", "output_dir", "shm"} <= set(FAST_CHECKS)
    assert "python_env" not in FAST_CHECKS
    script = probe_script(["gpu_count", "gpu_idle", "python_env", "code_sync", "clock_skew"]).decode()
    # the GPU snippet is read by three checks and the python one by two: each runs once
    assert script.count("--query-gpu=") == 1 and script.count(' nodeinfo info "$pwd_arg"') == 1
    assert script.index('echo "@@time"') < script.index("@@nvidia-gpus")  # the clock first
    assert script.rstrip().endswith('echo "@@end"')
    # a check that is not asked for adds nothing to what the node runs
    small = probe_script(["shm"]).decode()
    assert "nvidia-smi" not in small and "@@shm" in small and "@@output-dir" not in small
    for c in REGISTRY:
        assert c.summary and c.remedy and (c.probes or c.name in ("ssh", "ping"))
        assert (c.parse is None) != (c.compare is None) or not c.probes


def test_master_only_snippets_are_gated_by_role():
    script = probe_script(["port_free"]).decode()
    assert 'if want port_free && [ "$role" = master ]; then' in script


# ------------------------------------------------------------------ shm

def shm_text(name):
    return sec("shm", read(name))


def test_shm_docker_default_fails_small_warns_big_is_ok():
    r = parse_shm(shm_text("df_shm_64m.txt"), ctx())
    assert r.status == "fail" and "64 MiB" in r.detail and "--shm-size" in r.remedy and "remount" in r.remedy
    r = parse_shm(shm_text("df_shm_512m.txt"), ctx())
    assert r.status == "warn" and "512 MiB" in r.detail
    r = parse_shm(shm_text("df_shm_host.txt"), ctx())
    assert r.status == "ok" and "GiB" in r.detail
    missing = parse_shm(sec("shm", "df: /dev/shm: No such file or directory", rc=1), ctx())
    assert missing.status == "warn" and "No such file" in missing.detail
    full = read("df_shm_host.txt").replace(" 24684084       0% ", " 40000       99% ")
    assert parse_shm(sec("shm", full), ctx()).status == "fail"


# ------------------------------------------------------------------ output_dir

def test_output_dir_write_verdicts():
    out = "/home/u/gpt_train/runs"
    okay = parse_output_dir(sec("output-dir", out, arg=out), ctx())
    assert okay.status == "ok" and "fsynced" in okay.detail
    created = parse_output_dir(sec("output-dir", "/home/u/gpt_train", arg=out), ctx())
    assert created.status == "ok" and "where it will be created" in created.detail
    denied = parse_output_dir(sec("output-dir", out + "\n" + read("dd_permission_denied.txt"), rc=1, arg=out), ctx())
    assert denied.status == "fail" and "Permission denied" in denied.detail and "output_dir" in denied.remedy
    ro = parse_output_dir(sec("output-dir", "/data/runs\n" + read("dd_read_only_fs.txt"), rc=1, arg="/data/runs"),
                          ctx())
    assert ro.status == "fail" and "Read-only file system" in ro.detail and "read-write" in ro.remedy
    hung = parse_output_dir(sec("output-dir", out, rc=124, arg=out), ctx())
    assert hung.status == "fail" and "hung" in hung.detail


# ------------------------------------------------------------------ python_env knows the GPUs

def info(torch="2.13.0", cuda=None, hip=None, nccl=None, rccl=None):
    return sec("python", json.dumps({"python": "3.11.7", "torch": torch, "cuda": cuda, "hip": hip, "nccl": nccl,
                                     "rccl": rccl, "code": None}))


NVIDIA = sec("nvidia-gpus", read_gpu("transcribed_nvidia_h100x8_noheader_nounits.csv"))
AMD = sec("rocm-gpus", read_gpu("rocm_json_rx7900xt_marimo9237.json"))


def env_verdict(text, node=M):
    return compare_python_env({node.name: text}, {node.name: ctx(node)})[node.name]


def test_cpu_torch_on_nvidia_gpus_fails_with_the_cuda_index():
    r = env_verdict(NVIDIA + info(torch="2.13.0+cpu"))
    assert r.status == "fail" and "CPU-only build" in r.detail and "8 NVIDIA GPUs" in r.detail
    assert "https://download.pytorch.org/whl/cu12x" in r.remedy and "torch==2.13.0" in r.remedy
    assert "gpus: 0" in r.remedy
    assert env_verdict(NVIDIA + info(cuda="12.6", nccl="2.26.2")).status == "ok"
    no_nccl = env_verdict(NVIDIA + info(cuda="12.6"))
    assert no_nccl.status == "warn" and "NCCL" in no_nccl.detail
    rocm_on_nvidia = env_verdict(NVIDIA + info(hip="6.3", rccl="bundled"))
    assert rocm_on_nvidia.status == "fail" and "ROCm build" in rocm_on_nvidia.detail


def test_amd_gpus_need_a_rocm_build_with_rccl():
    r = env_verdict(AMD + info(cuda="12.6", nccl="2.26.2"))
    assert r.status == "fail" and "torch.version.hip is None" in r.detail
    assert "https://download.pytorch.org/whl/rocm6.x" in r.remedy
    assert env_verdict(AMD + info(hip="6.3.42131", rccl="bundled")).status == "ok"
    assert env_verdict(AMD + info(hip="6.3.42131")).status == "warn"


def test_cpu_nodes_are_fine_with_a_cpu_torch():
    assert env_verdict("@@no-gpu-tool\n" + info()).status == "ok"
    assert env_verdict(NVIDIA + info(), W2).status == "ok"  # gpus: 0 -> one CPU process by choice


# ------------------------------------------------------------------ gpu_count follows the nproc rule

def test_gpu_count_wording_follows_the_processes_per_node_rule():
    cpu = parse_gpu_count(NVIDIA, ctx(W2))
    assert cpu.status == "warn" and "one CPU process" in cpu.detail and "8 GPUs" in cpu.detail
    assert "only 0" not in cpu.detail
    assert "8 processes" in parse_gpu_count(NVIDIA, ctx(W1)).detail  # unset: the GPUs found
    two = Ctx(node=M.__class__(**{**M.__dict__, "gpus": 2}), inventory=INV, is_master=True)
    fewer = parse_gpu_count(NVIDIA, two)
    assert fewer.status == "warn" and "6 GPUs stay idle" in fewer.detail
    assert "invalid device ordinal" not in (fewer.remedy or "") and "fine" in fewer.remedy
    one = "".join(read_gpu("transcribed_nvidia_h100x8_noheader_nounits.csv").splitlines(keepends=True)[:1])
    more = parse_gpu_count(sec("nvidia-gpus", one), ctx(M))
    assert more.status == "fail" and "8 processes on 1 GPU fail" in more.remedy


# ------------------------------------------------------------------ the report fits the terminal

def test_nodeset_folds_ranges():
    assert nodeset(["n3", "n5", "n6", "n7", "n8"]) == "n[3,5-8]"
    assert nodeset(["node1"]) == "node1"
    assert nodeset(["gpu01", "gpu02", "gpu10", "login"]) == "gpu[01-02,10],login"


def report_32():
    inv = parse_inventory(yaml.safe_dump({"master_port": 29500, "nodes": [
        {"name": f"node{i}", "host": f"10.1.0.{i}", "gpus": 8} for i in range(1, 33)]}), "<t>")
    nodes = []
    for n in inv.nodes:
        rep = NodeReport(n)
        for c in CHECKS:
            rep.results[c] = ok(c, "fine")
        i = n.rank + 1
        if i in (3, 5, 6, 7, 8):
            rep.results["clock_skew"] = fail("clock_skew", "+30.000s ±0.001s vs control",
                                             f"sync the clock on {n.name}: `sudo timedatectl set-ntp true`")
        if i == 12:
            rep.results["shm"] = warn("shm", "/dev/shm 512 MiB (512 MiB free): below 1 GiB", "--shm-size")
        nodes.append(rep)
    return PreflightReport(inv, list(CHECKS), nodes, {n.name: 8 for n in inv.nodes}, 1.5)


def rendered(report, width=80):
    buf = io.StringIO()
    report.render(Console(file=buf, width=width, color_system=None))
    return buf.getvalue()


def test_32_nodes_render_within_80_columns_grouped():
    out = rendered(report_32())
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= 80, out
    assert "…" not in out  # no column cut to "s… p…"
    for c in CHECKS:  # every check has a column somewhere (the matrix folds into two tables)
        assert all(part in out for part in c.split("_")), c
    # nodes with the same statuses share a row; the same failure on five nodes is one line
    assert re.search(r"^\s*node\[1-2,4,9-11,13-32\]\s", out, re.M), out
    fails = [ln for ln in lines if "clock_skew:" in ln]
    assert len(fails) == 1 and "node[3,5-8] clock_skew: +30.000s" in fails[0]
    assert "sync the clock on node[3,5-8]" in out
    # the rank map of 32 nodes wraps between nodes instead of one 1,000-character line
    rank_lines = [ln for ln in lines if "→ node" in ln and "rank" in ln]
    assert len(rank_lines) > 5 and "rank 248-255 → node32 (10.1.0.32)" in out
    assert "5 check(s) failed on 5 node(s)" in out


def test_a_small_report_keeps_the_one_line_rank_map():
    r = report_32()
    small = PreflightReport(r.inventory.select(["node1", "node2"]), r.checks, r.nodes[:2], r.gpus_found, 0.1)
    out = rendered(small, width=140)
    assert small.rank_map() in out and "preflight ok" in out
    assert sections("@@a\n@@end\n")[-1].name == "end"


def test_only_control_checks_run_without_a_probe(capsys):
    """`--only ssh` (or ping) sends no probe to the nodes and still reports."""
    from orchestrator.cli import main

    assert main(["preflight", "--only", "ssh", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [[c["check"] for c in n["checks"]] for n in doc["nodes"]] == [["ssh"], ["ssh"]]


def test_a_probe_that_did_not_finish_is_unanswered_and_asked_again():
    from types import SimpleNamespace

    from orchestrator.checks import retry
    from orchestrator.checks.preflight import _Probes, _verdicts

    probes = _Probes(INV, ["gpu_count", "shm"], 3.0)
    probes.texts = {"m": "@@no-gpu-tool\n@@end\n", "w1": "@@no-gpu-tool\n", "w2": "@@no-gpu-tool\n@@end\n"}
    probes.errors = {"w1": "timed out after 60s"}
    reports = {n.name: NodeReport(n) for n in INV.nodes}
    _verdicts(SimpleNamespace(connections={n.name: None for n in INV.nodes}), list(INV.nodes), reports, probes, {})
    w1 = reports["w1"].results
    assert w1["gpu_count"].status == "fail" and "did not finish" in w1["gpu_count"].detail
    assert w1["gpu_count"].unanswered and w1["shm"].unanswered
    # m (8 GPUs in the inventory, no GPU tool) fails for good: only w1 is asked again
    assert reports["m"].results["gpu_count"].status == "fail"
    assert retry.ask_again({k: r.results for k, r in reports.items()}) == ["w1"]


# ------------------------------------------------------------------ code_sync against this machine's copy

def _code(files: dict[str, str] | None, kind="tree"):
    """The @@python section a node prints, its code listing from `files` (path -> hash)."""
    if files is None:
        code = {"kind": "missing", "digest": None, "files": 0, "head": None, "dirty": None}
    else:
        code = {"kind": kind, "digest": "d" + str(sorted(files.items())), "files": len(files), "head": None,
                "dirty": None, "hashes": files}
    return sec("python", json.dumps({"python": "3.11.7", "torch": "2.13.0", "code": code}))


def _control(files):
    return {"kind": "git", "digest": "d" + str(sorted(files.items())), "files": len(files), "hashes": files,
            "source": "/home/me/proj"}


def test_code_sync_names_the_files_that_differ_from_this_machines_copy():
    from orchestrator.checks.python import compare_code_sync

    here = {f"f{i}.py": f"f{i:016x}" for i in range(6)}
    node = dict(here, **{"f0.py": "fchanged00000000"})
    for i in range(1, 6):
        del node[f"f{i}.py"]
    node["stray.py"] = "f1111111111111111"
    c = {n.name: ctx(n) for n in INV.nodes}
    out = compare_code_sync({"m": _code(here), "w1": _code(node)}, c, "m", _control(here))
    assert out["m"].status == "ok" and "6 files" in out["m"].detail
    r = out["w1"]
    assert r.status == "fail" and "/home/me/proj" in r.detail, r
    assert "changed: f0.py" in r.detail and "missing: f1.py, f2.py, f3.py and 2 more" in r.detail, r.detail
    assert "not in this machine's copy: stray.py" in r.detail, r.detail
    assert r.remedy == "`clusterctl sync -i <inventory>` pushes it"
    # compared only with each other, the same node set passes: the control copy is what decides
    alone = compare_code_sync({"m": _code(node), "w1": _code(node)}, c, "m")
    assert {x.status for x in alone.values()} == {"ok"}


def test_code_sync_fails_an_empty_or_missing_workdir():
    from orchestrator.checks.python import compare_code_sync

    c = {n.name: ctx(n) for n in INV.nodes}
    here = {"train.py": "f0123456789abcdef", "lib.py": "f0123456789abcdee"}
    out = compare_code_sync({"m": _code({}), "w1": _code(None)}, c, "m", _control(here))
    assert out["m"].status == "fail" and "holds no code: 2 files to ship from this machine's /home/me/proj" \
        in out["m"].detail, out["m"]
    assert out["w1"].status == "fail" and "does not exist" in out["w1"].detail
    # no copy here to compare with: an empty workdir still fails when code is required (the
    # preflight and sync commands), and passes for a job that brings its own script (train's)
    empty = {"m": _code({}), "w1": _code({})}
    assert {r.status for r in compare_code_sync(empty, c, "m", required=True).values()} == {"fail"}
    assert {r.status for r in compare_code_sync(empty, c, "m").values()} == {"ok"}


def test_output_shared_writes_nothing_and_names_the_directory(tmp_path):
    """The probe names the nearest existing directory (inode, device, machine) and the path
    below it: two homes differ, the same directory matches, and nothing is created."""
    from orchestrator.checks.output_shared import _id
    from orchestrator.checks.preflight import probe_locally

    def name(out):
        inv = parse_inventory(yaml.safe_dump({"workdir": str(tmp_path / "wd"), "output_dir": str(out),
                                              "nodes": [{"name": "a", "connection": "local"}]}), "<t>")
        return _id(probe_locally(inv, inv.nodes[0], ["output_shared"]))

    (tmp_path / "wd").mkdir()
    a, b = name(tmp_path / "wd" / "runs"), name(tmp_path / "wd" / "runs")
    assert a and a == b and a.endswith(" runs/"), a
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wd"] and not list((tmp_path / "wd").iterdir())
    (tmp_path / "other").mkdir()
    assert name(tmp_path / "other" / "runs") != a


# ------------------------------------------------------------------ remedies fit the environment

SETUP_INV = parse_inventory(yaml.safe_dump({
    "nodes": [{"name": "m", "host": "10.0.0.1", "gpus": 8}, {"name": "w1", "host": "10.0.0.2", "gpus": 8}],
    "setup": {"requirements": "reqs/train.txt", "venv": "~/venvs/train"}}), "nodes.yaml")


def test_with_setup_the_fix_for_a_wrong_torch_is_the_requirements_file_and_setup():
    """A setup-built venv has no pip (uv builds it), and setup would undo a hand install: every
    python_env remedy names the requirements file and `clusterctl setup -i INV` instead."""
    m, w1 = SETUP_INV.nodes
    c = {n.name: Ctx(node=n, inventory=SETUP_INV, is_master=n.rank == 0) for n in SETUP_INV.nodes}

    def verdict(text, node=m):
        return compare_python_env({node.name: text}, {node.name: c[node.name]})[node.name]

    cpu = verdict(NVIDIA + info(torch="2.13.0+cpu"))
    assert cpu.status == "fail" and "CPU-only build" in cpu.detail
    assert "pip" not in cpu.remedy, cpu.remedy
    assert "reqs/train.txt" in cpu.remedy and "`clusterctl setup -i nodes.yaml`" in cpu.remedy
    assert "--extra-index-url https://download.pytorch.org/whl/cu12x" in cpu.remedy
    assert "torch==2.13.0+cu126" in cpu.remedy and "gpus: 0" in cpu.remedy
    rocm = compare_python_env({"m": AMD + info(cuda="12.6", nccl="2.26.2")}, {"m": c["m"]})["m"]
    assert "pip" not in rocm.remedy and "whl/rocm6.x" in rocm.remedy and "clusterctl setup" in rocm.remedy
    no_nccl = verdict(NVIDIA + info(cuda="12.6"))
    assert no_nccl.status == "warn" and "reqs/train.txt" in no_nccl.remedy and "clusterctl setup" in no_nccl.remedy
    no_torch = verdict("@@no-gpu-tool\n" + info(torch=None))
    assert no_torch.status == "fail" and "pip" not in no_torch.remedy
    assert no_torch.remedy.startswith("add torch in reqs/train.txt, then run `clusterctl setup -i nodes.yaml`")
    both = compare_python_env({"m": "@@no-gpu-tool\n" + info(), "w1": "@@no-gpu-tool\n" + info(torch="2.12.0")}, c)
    assert both["w1"].status == "fail" and both["w1"].remedy.startswith("run `clusterctl setup -i nodes.yaml`")
    # without setup: the node's own pip, as before
    assert "-m pip install torch==2.13.0 --index-url" in env_verdict(NVIDIA + info(torch="2.13.0+cpu")).remedy
