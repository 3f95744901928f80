"""gpu_health on the real test cluster: one node's GPU 1 reports a pending row remap, another's
kernel log a new Xid 48 on its GPU 0 (the fake nvidia-smi and dmesg replay recorded answers with
those per-node overrides). Preflight fails with exit code 1 naming both nodes, the GPU and the
reason; the third node, and the whole cluster once repaired, passes gpu_health."""

import json
import time

import pytest

from orchestrator.cli import main
from tests.cluster.fakes import xid_message

pytestmark = pytest.mark.cluster


def results(doc):
    return {n["name"]: {c["check"]: c for c in n["checks"]} for n in doc["nodes"]}


def test_row_remap_and_new_xid_fail_by_node_and_gpu_healthy_passes(make_cluster, tmp_path, capsys):
    cl = make_cluster(3, gpus=2)
    path = cl.write_inventory(tmp_path / "nodes.yaml")
    healthy, remapped, xid = cl.nodes
    remapped.set_gpus(2, health={1: {"Remapped Rows/Pending": "Yes", "Remapped Rows/Uncorrectable Error": "1"}})
    xid.set_gpus(2, kernel_log=[(time.time() - 5, xid_message(0, code=48))])

    rc = main(["preflight", "-i", str(path), "--only", "gpu_health", "--json"])
    got = results(json.loads(capsys.readouterr().out))
    assert rc == 1
    assert got[healthy.name]["gpu_health"]["status"] == "ok"
    bad = got[remapped.name]["gpu_health"]
    assert bad["status"] == "fail" and bad["detail"].startswith("GPU 1: row remapping pending (1 uncorrectable row(s))")
    assert "sudo nvidia-smi -r -i 1" in bad["remedy"]
    bad = got[xid.name]["gpu_health"]
    assert bad["status"] == "fail" and bad["detail"].startswith("GPU 0: Xid 48 (double-bit ECC error) at ")

    # the table names both nodes with their GPU and reason (a second round within the same
    # window still sees the Xid: the node's mark keeps it for SAME_WINDOW_S)
    rc = main(["preflight", "-i", str(path), "--only", "gpu_health"])
    table = capsys.readouterr().out
    assert rc == 1
    assert remapped.name in table and "GPU 1: row remapping pending" in table
    assert xid.name in table and "GPU 0: Xid 48 (double-bit ECC error)" in table
    assert healthy.name in table

    # repaired (the GPU reset, the log clean): every node passes
    remapped.set_gpus(2)
    xid.set_gpus(2)
    rc = main(["preflight", "-i", str(path), "--only", "gpu_health", "--json"])
    got = results(json.loads(capsys.readouterr().out))
    assert rc == 0 and {n: r["gpu_health"]["status"] for n, r in got.items()} == dict.fromkeys(got, "ok")
    assert all(r["gpu_health"]["detail"] == "GPUs healthy" for r in got.values())
