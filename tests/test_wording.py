"""The small things a new user tripped over (issue 22's "Found" list): a lost node's summary
without `exit code None`, no `ranks 1-1`, no doubled `supervisor: supervisor:`, a spare outside
preflight's rank map, `cpu: true` for a CPU node on purpose, `plan -i` reading the inventory's
preset and no jargon in its output, and the orchestrator/ files the README and the docs name."""

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.documents import documents

from orchestrator.checks import CheckResult, Ctx
from orchestrator.checks.gpu import parse_gpu_count
from orchestrator.checks.registry import CHECKS
from orchestrator.checks.report import NodeReport, PreflightReport
from orchestrator.cli import main
from orchestrator.errors import InventoryError
from orchestrator.inventory import parse_inventory
from orchestrator.runs.policy import root_cause
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.spec import FirstFailure, NodeStatus
from tests.probe_text import read_gpu, sec

ROOT = Path(__file__).resolve().parent.parent


def inv(nodes, **top):
    return parse_inventory(yaml.safe_dump({"master_port": 29500, "nodes": nodes, **top}), "<t>")


# ---------------------------------------------------------------- a failed run's summary
def test_a_lost_nodes_summary_says_lost_not_exit_code_none():
    ff = FirstFailure("node2", None, "no answer from the node for 15s (connection lost)")
    s = root_cause(ff, NodeStatus("node2", 1, "h2", first_rank=2, last_rank=3), b"")
    head = s.splitlines()[0]
    assert "None" not in head
    assert head.startswith("node2 (ranks 2-3) failed first: lost, no exit code — its connection went silent")
    assert "did not answer again before the lost timeout" in head


def test_a_node_of_one_rank_is_rank_n_not_ranks_n_n():
    st = NodeStatus("node2", 1, "h2", first_rank=1, last_rank=1)
    assert st.ranks == "1" and st.ranks_text == "rank 1"
    assert NodeStatus("n", 0, "h", first_rank=0, last_rank=7).ranks == "0-7"
    assert NodeStatus("n", 0, "h").ranks_text == "no ranks yet"
    s = root_cause(FirstFailure("node2", 137, "killed (SIGKILL)"), st, b"")
    assert s.startswith("node2 (rank 1) failed first: exit code 137")


# ---------------------------------------------------------------- the supervisor's log
def test_the_supervisors_log_lines_carry_one_prefix(tmp_path, capsys):
    from orchestrator.runs.logs.copier import LogCopier

    class Run:
        dir, record = tmp_path, RunRecord("r")

        def node_log(self, name):
            return tmp_path / f"{name}.log"

    copier = LogCopier(Run(), ["n1"])  # the default echo is the supervisor's
    copier.frames["n1"] = __import__("orchestrator.runs.logs.copier", fromlist=["Frames"]).Frames()
    copier.on_bytes("n1", "stdout", b"not json\n")
    copier.on_line("n1", "stderr", "the agent says hello")
    copier.close()
    out = capsys.readouterr().out
    assert "supervisor: n1: unreadable stream" in out and "supervisor: n1: the agent says hello" in out
    assert "supervisor: supervisor:" not in out


# ---------------------------------------------------------------- preflight's rank map
def spare_report():
    i = inv([{"name": f"node{k}", "host": f"10.0.0.{k}", "gpus": 2, "spare": k == 3} for k in (1, 2, 3)])
    nodes = []
    for n in i.nodes:
        rep = NodeReport(n)
        for c in CHECKS:
            rep.results[c] = CheckResult(c, "ok", "fine")
        nodes.append(rep)
    return PreflightReport(i, list(CHECKS), nodes, {n.name: 2 for n in i.nodes}, 1.0)


def test_a_spare_gets_no_rank_in_preflights_rank_map():
    text = spare_report().rank_map()
    assert text.startswith("world size 4 on 2 nodes: rank 0-1 → node1 (10.0.0.1), rank 2-3 → node2 (10.0.0.2)")
    assert "node3 (10.0.0.3)" not in text and "rank 4" not in text
    assert text.endswith("; spare node3 (no rank until a restart)")
    narrow = spare_report()._rank_map_text(40)  # wrapped, the same entries
    assert "world size 4 on 2 nodes:" in narrow and "rank 4" not in narrow and "spare node3" in narrow


# ---------------------------------------------------------------- cpu: true
H100X8 = sec("nvidia-gpus", read_gpu("transcribed_nvidia_h100x8_noheader_nounits.csv"))


def gpu_count_on(node_doc, **top):
    i = inv([node_doc], **top)
    return parse_gpu_count(H100X8, Ctx(node=i.nodes[0], inventory=i, is_master=True))


def test_gpus_0_on_a_gpu_node_warns_and_cpu_true_says_it_is_on_purpose():
    r = gpu_count_on({"name": "n1", "host": "10.0.0.1", "gpus": 0})
    assert r.status == "warn" and "cpu: true" in r.remedy
    r = gpu_count_on({"name": "n1", "host": "10.0.0.1", "cpu": True})
    assert r.status == "ok" and "CPU node by choice (cpu: true)" in r.detail
    r = gpu_count_on({"name": "n1", "host": "10.0.0.1"}, cpu=True)  # at the top: every node
    assert r.status == "ok"
    r = gpu_count_on({"name": "n1", "host": "10.0.0.1", "cpu": False}, cpu=True)  # the node's own wins
    assert r.status == "ok" and "8 GPUs" in r.detail and "CPU" not in r.detail


def test_cpu_true_makes_one_process_and_refuses_a_gpu_count():
    from orchestrator.torchrun import nprocs_for

    i = inv([{"name": "n1", "host": "10.0.0.1", "cpu": True}])
    assert i.nodes[0].gpus == 0 and nprocs_for(i, {"n1": 8}) == {"n1": 1}
    with pytest.raises(InventoryError, match=r"cpu: true and gpus: 4"):
        inv([{"name": "n1", "host": "10.0.0.1", "cpu": True, "gpus": 4}])


# ---------------------------------------------------------------- plan
def plan_doc(capsys, *args):
    assert main(["plan", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_i_takes_the_inventorys_preset(tmp_path, capsys):
    p = tmp_path / "inv.yaml"
    p.write_text(yaml.safe_dump({"nodes": [{"name": "a", "host": "10.0.0.1"}, {"name": "b", "host": "10.0.0.2"},
                                           {"name": "c", "host": "10.0.0.3", "spare": True}],
                                 "train": {"args": ["--preset", "nano", "--max-steps", "3"]}}))
    nano, tiny = plan_doc(capsys, "--preset", "nano"), plan_doc(capsys)
    assert nano["params"] != tiny["params"]
    got = plan_doc(capsys, "-i", str(p))
    assert got["params"] == nano["params"] and got["nodes"] == 2  # the spare sits out
    assert plan_doc(capsys, "-i", str(p), "--preset", "tiny")["params"] == tiny["params"]  # the flag wins
    p.write_text(yaml.safe_dump({"nodes": [{"name": "a", "host": "10.0.0.1"}], "train": {"args": ["--preset=nano"]}}))
    assert plan_doc(capsys, "-i", str(p))["params"] == nano["params"]


def test_plan_says_what_its_step_time_is_without_jargon(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "seed" not in out
    assert "assumed 1 s: --step-time or --measure-step for yours" in " ".join(out.split())


# ---------------------------------------------------------------- the README and the docs
_ORCHESTRATOR_PATH = re.compile(r"`(orchestrator/[\w/.-]+\.(?:yaml|json|py|sh))`")


def orchestrator_paths(text: str) -> set[str]:
    """The `orchestrator/...` files a document names in backticks."""
    return set(_ORCHESTRATOR_PATH.findall(text))


def test_the_readmes_orchestrator_paths_exist():
    paths = orchestrator_paths((ROOT / "README.md").read_text())
    assert "orchestrator/inventory/default_inventory.yaml" in paths
    assert [p for p in sorted(paths) if not (ROOT / p).exists()] == []


def test_the_docs_orchestrator_paths_exist():
    named = {(doc.relative_to(ROOT).as_posix(), p) for doc in documents() for p in orchestrator_paths(doc.read_text())}
    assert len({p for _, p in named}) > 25, "the docs' orchestrator/ paths were not found"
    assert {p for _, p in named} >= {"orchestrator/inventory/default_inventory.yaml", "orchestrator/schemas/train.json",
                                     "orchestrator/remote/node_agent.py"}
    missing = sorted(f"{doc}: {p}" for doc, p in named if not (ROOT / p).exists())
    assert not missing, "the docs name orchestrator/ files that do not exist (moved? say where):\n" + "\n".join(missing)


def test_orchestrator_path_check_is_not_vacuous():
    text = "see `orchestrator/schemas/train.json`, `orchestrator/remote/preflight.sh` and orchestrator/x.py"
    assert orchestrator_paths(text) == {"orchestrator/schemas/train.json", "orchestrator/remote/preflight.sh"}
