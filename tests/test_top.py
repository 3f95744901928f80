"""GPU parsers on the transcribed layouts (the recorded ones: test_gpu_recordings.py), the top
probe's parser, and `top --once --json` on the test cluster (fake nvidia-smi per node)."""

import json
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.gpus import (attach_processes, count_nvidia_smi_list, number, parse_nvidia_smi_apps_csv,
                               parse_nvidia_smi_csv, parse_rocm_smi_json, parse_rocm_smi_pids_json)
from orchestrator.top import parse_probe

FIX = Path(__file__).parent / "fixtures" / "gpus"


def read(name):
    return (FIX / name).read_text()


@pytest.mark.parametrize("text,value", [("69.88 W", 69.88), ("[N/A]", None), ("[Not Supported]", None),
                                        ("N/A", None), ("", None), ("97 %", 97.0), (42, 42.0)])
def test_number_tolerates_missing_readings(text, value):
    assert number(text) == value


def test_nvidia_noheader_nounits_h100x8_with_apps():
    gpus = parse_nvidia_smi_csv(read("transcribed_nvidia_h100x8_noheader_nounits.csv"))
    assert [g.index for g in gpus] == list(range(8))
    g0 = gpus[0]
    assert (g0.name, g0.util, g0.mem_used_mib, g0.mem_total_mib, g0.temp_c, g0.power_w) == \
        ("NVIDIA H100 80GB HBM3", 97.0, 71234, 81559, 64.0, 612.37)
    apps = parse_nvidia_smi_apps_csv(read("transcribed_nvidia_h100x8_apps_noheader_nounits.csv"))
    gpus = attach_processes(gpus, apps)
    assert [len(g.processes) for g in gpus] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert gpus[3].processes[0].pid == 48214 and gpus[3].processes[0].used_mib == 71216
    assert not gpus[4].busy and gpus[0].busy


def test_nvidia_not_supported_memory_on_mig():
    (g,) = parse_nvidia_smi_csv(read("transcribed_nvidia_mig_not_supported.csv"))
    assert g.mem_used_mib is None and g.util is None and g.mem_total_mib == 40960


def test_nvidia_wrong_field_count_is_an_error():
    with pytest.raises(ValueError):
        parse_nvidia_smi_csv("0, GPU-x, NVIDIA H100\n")


def test_nvidia_list_gpus_count():
    text = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-a)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-b)\n"
    assert count_nvidia_smi_list(text) == 2


def test_rocm_json_instinct_uses_junction_and_socket_power():
    gpus = parse_rocm_smi_json(read("transcribed_rocm_mi300x_json.json"))
    assert [g.index for g in gpus] == [0, 1]
    g = gpus[0]
    assert g.name == "AMD Instinct MI300X" and g.util == 97.0
    assert g.temp_c == 71.0  # edge is N/A on MI300X
    assert g.power_w == 688.0
    assert g.mem_total_mib == 205822885888 // 2**20 and g.mem_used_mib == 161061273600 // 2**20


def test_rocm_pids():
    procs = parse_rocm_smi_pids_json(read("transcribed_rocm_pids.json"))
    assert [(p.pid, p.name) for p in procs] == [(48211, "python3"), (48390, "python3")]
    assert procs[0].used_mib == 153600


def test_parse_probe_nvidia_with_proc_env():
    text = ("@@nvidia-gpus\n" + read("transcribed_nvidia_h100x8_noheader_nounits.csv") + "@@rc 0\n@@nvidia-apps\n"
            + read("transcribed_nvidia_h100x8_apps_noheader_nounits.csv")
            + "@@proc 48211\npython -m trainer --preset small \nCLUSTERCTL_RUN_ID=r-20250101\n"
            + "@@proc 48212\n\n@@end\n")
    tool, gpus, loose, err = parse_probe(text)
    assert (tool, err, loose) == ("nvidia-smi", None, [])
    p = gpus[0].processes[0]
    assert p.command == "python -m trainer --preset small" and p.run_id == "r-20250101"
    assert gpus[1].processes[0].command is None  # another user's process: /proc not readable


def test_parse_probe_no_tool_failure_and_truncation():
    assert parse_probe("@@no-gpu-tool\n@@end\n") == (None, [], [], None)
    tool, gpus, _, err = parse_probe("@@nvidia-gpus\nFailed to initialize NVML: Driver/library version "
                                     "mismatch\n@@rc 9\n@@nvidia-apps\n@@end\n")
    assert tool == "nvidia-smi" and not gpus and "mismatch" in err
    assert parse_probe("@@nvidia-gpus\n0, x")[3].startswith("the GPU probe stopped")


def test_parse_probe_rocm():
    text = ("@@rocm-gpus\n" + read("transcribed_rocm_mi300x_json.json") + "@@rc 0\n@@rocm-pids\n"
            + read("transcribed_rocm_pids.json")
            + "@@proc 48211\npython3 train.py\nCLUSTERCTL_RUN_ID=abc\n@@end\n")
    tool, gpus, loose, err = parse_probe(text)
    assert tool == "rocm-smi" and len(gpus) == 2 and err is None
    assert loose[0].run_id == "abc" and loose[0].command == "python3 train.py"


def test_json_needs_once(capsys):
    assert main(["top", "--json"]) == 2


# ------------------------------------------------------------------ on the test cluster

@pytest.mark.cluster
def test_top_once_json_reports_each_nodes_fake_gpus(cluster4, tmp_path, capsys):
    n1, n2, n3 = cluster4.nodes[:3]
    inv = cluster4.inventory()
    # a node nobody can reach: connection refused at once
    inv["nodes"].append({"name": "ghost", "host": "127.0.0.1", "ssh": {"port": 1}})
    import yaml
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    sleeper = n2.popen("CLUSTERCTL_RUN_ID=run-top-1 exec sleep 120")
    try:
        n2.set_gpus(2, processes=[(sleeper.pid, "sleep", 1234, 1)], utilization=87, temperature=71)
        n3.set_gpus(0)
        rc = main(["top", "-i", str(path), "--once", "--json"])
        doc = json.loads(capsys.readouterr().out)
    finally:
        sleeper.kill()
        sleeper.wait()
        n2.set_gpus(2)
        n3.set_gpus(2)
    assert rc == 3  # the ghost
    nodes = {n["name"]: n for n in doc["nodes"]}
    assert list(nodes) == [nd.name for nd in cluster4.nodes] + ["ghost"]
    g = nodes["node1"]["gpus"]
    assert [x["index"] for x in g] == [0, 1] and nodes["node1"]["error"] is None
    assert g[0]["name"] == "NVIDIA H100 80GB HBM3" and g[0]["mem_total_mib"] == 81559
    assert set(g[0]) >= {"index", "name", "util", "mem_used_mib", "mem_total_mib", "temp_c", "power_w",
                         "processes"}
    b = nodes["node2"]["gpus"]
    assert b[1]["util"] == 87 and b[1]["temp_c"] == 71 and b[1]["mem_used_mib"] == 1234
    (proc,) = b[1]["processes"]
    assert proc["pid"] == sleeper.pid and proc["run_id"] == "run-top-1" and proc["command"].startswith("sleep")
    assert b[0]["processes"] == []
    assert nodes["node3"]["gpus"] == [] and nodes["node3"]["error"] is None and nodes["node3"]["tool"] is None
    assert nodes["ghost"]["gpus"] == [] and nodes["ghost"]["error"]


@pytest.mark.cluster
def test_top_reuses_one_connection_per_node_across_refreshes(cluster4, tmp_path):
    from orchestrator.top import collect
    from orchestrator.transport import Cluster
    from orchestrator.inventory import load_inventory

    inv = load_inventory(str(cluster4.write_inventory(tmp_path / "nodes.yaml")))
    with Cluster(inv) as cluster:
        for _ in range(3):
            views = collect(cluster)
            assert all(len(v.gpus) == 2 and v.error is None for v in views)
        assert cluster.handshakes == len(inv.nodes)
