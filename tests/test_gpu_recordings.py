"""The GPU parsers on tool outputs recorded on real machines (tests/fixtures/gpus, sources in its
README), and the test cluster's fake nvidia-smi / rocm-smi replaying them."""

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.gpus import (attach_processes, count_nvidia_smi_list, parse_amd_smi_static_json,
                               parse_nvidia_smi_apps_csv, parse_nvidia_smi_csv, parse_nvidia_smi_list,
                               parse_rocm_smi_csv, parse_rocm_smi_json)
from tests.cluster.fakes import (NVIDIA_RECORDING, gpu_state, install_nvidia_smi, install_rocm_smi,
                                 read_query_gpu, rocm_state)

FIX = Path(__file__).parent / "fixtures" / "gpus"
MIB = 2**20
H100, H200, L40S = "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA L40S"
MASKED = "GPU-00000000-0000-0000-0000-000000000000"

# file -> the GPUs it shows: (index, name, util %, mem used MiB, mem total MiB, temp C, power W)
GPUS = {
    "nvidia_query_gpu_h100_590_idle.csv": [(0, H100, 0.0, 0, 81559, 41.0, 69.85)],
    "nvidia_query_gpu_h100_590_load.csv": [(0, H100, 100.0, 19818, 81559, 59.0, 631.95)],
    # MIG enabled: the driver does not report utilisation for the whole GPU
    "nvidia_query_gpu_h100_mig_590_load.csv": [(0, H100, None, 11125, 81559, 53.0, 433.78)],
    "nvidia_query_gpu_h200_590_load.csv": [(0, H200, 100.0, 32362, 143771, 52.0, 627.4)],
    "nvidia_query_gpu_l40s_595_idle.csv": [(0, L40S, 100.0, 0, 46068, 63.0, 144.97)],
    "nvidia_query_gpu_rtx4080super_595_load.csv": [(0, "NVIDIA GeForce RTX 4080 SUPER", 7.0, 1474, 16376, 46.0,
                                                    84.24)],
    # noheader, other fields: numbered by row
    "nvidia_query_name_driver_mem_cc_l40sx4_dellai.csv": [(i, L40S, None, None, 46068, None, None)
                                                          for i in range(4)],
    "rocm_json_rx7900xt_marimo9237.json": [(0, "Radeon RX 7900 XT", 0.0, 27856896 // MIB, 21458059264 // MIB,
                                            None, None)],
    "rocm_csv_rx7900xt_marimo9237.csv": [(0, "Radeon RX 7900 XT", 0.0, 27856896 // MIB, 21458059264 // MIB,
                                          None, None)],
    "rocm_csv_rx6800_raphael_localai7761.csv": [
        (0, "Navi 21 [Radeon RX 6800/6800 XT / 6900 XT]", None, 692142080 // MIB, 17163091968 // MIB, None, None),
        (1, "Raphael", None, 26079232 // MIB, 67108864 // MIB, None, None)],
    "rocm_csv_productname_mi100x2_easybuild3978.csv": [(i, "Arcturus GL-XL [AMD Instinct MI100]", None, None, None,
                                                        None, None) for i in range(2)],
    "rocm_json_productname_mi250_rsmi159.json": [(0, "AMD INSTINCT MI200 (MCM) OAM LC MBA HPE C2", None, None, None,
                                                  None, None)],
    # meminfo alone names no product
    "rocm_json_meminfo_ramalama239.json": [(0, "", None, 27136000 // MIB, 8573157376 // MIB, None, None),
                                           (1, "", None, 371126272 // MIB, 536870912 // MIB, None, None)],
    # amd-smi static: no readings, VRAM in its "MB" (MiB)
    "amd_smi_static_mi300x8_dellai.json": [(i, "AMD Instinct MI300X", None, None, 196592, None, None)
                                           for i in range(8)],
}

# file -> (index, name, uuid) per GPU; MIG instances are not GPUs
LISTS = {
    "nvidia_L_h100_590.txt": [(0, H100, MASKED)],
    "nvidia_L_h100_mig_590.txt": [(0, H100, MASKED)],
    "nvidia_L_h200_590.txt": [(0, H200, MASKED)],
    "nvidia_L_a100x4_mig_telegraf5812.txt": [
        (0, "NVIDIA A100-SXM4-80GB", "GPU-513536b6-7d19-9063-b049-1e69664bb298"),
        (1, "NVIDIA A100-SXM4-80GB", "GPU-d8594bd4-0fc3-8595-e355-7c98138f3b95"),
        (2, "NVIDIA A100-SXM4-80GB", "GPU-5e375e7e-b41f-155b-dcdc-534524c356fc"),
        (3, "NVIDIA A100-SXM4-80GB", "GPU-69ec2344-ebac-b028-f88f-452abb3d7f11")],
}

# file -> (gpu uuid, pid, name, used MiB) per compute process
APPS = {
    "nvidia_compute_apps_h100_590_idle.csv": [],
    "nvidia_compute_apps_h100_590_load.csv": [(MASKED, 11327, "/root/tools/memhog", 2566),
                                              (MASKED, 11328, "/root/tools/memhog", 1542),
                                              (MASKED, 11345, "./gpu_burn", 15690)],
    "nvidia_compute_apps_h100_mig_590_load.csv": [(MASKED, 21180, "/root/tools/memhog", 2296),
                                                  (MASKED, 21181, "/root/tools/memhog", 1272),
                                                  (MASKED, 21198, "./gpu_burn", 7484)],
    "nvidia_compute_apps_rtx4080super_595_load.csv": [(MASKED, 2165, "/usr/bin/kwin_wayland", 25),
                                                      (MASKED, 5022, "ffmpeg", 503),
                                                      (MASKED, 5021, "ffmpeg", 360)],
}


def read(name):
    return (FIX / name).read_text()


def parse(name):
    text = read(name)
    if name.startswith("amd_smi_static"):
        return parse_amd_smi_static_json(text)
    if name.startswith("rocm_"):
        return parse_rocm_smi_json(text) if name.endswith(".json") else parse_rocm_smi_csv(text)
    if name == "nvidia_query_name_driver_mem_cc_l40sx4_dellai.csv":
        return parse_nvidia_smi_csv(text, ("name", "driver_version", "memory.total", "compute_cap"))
    return parse_nvidia_smi_csv(text)


def test_every_recording_is_checked_and_named_in_the_readme():
    files = {p.name for p in FIX.iterdir() if p.is_file() and p.name != "README.md"
             and not p.name.startswith("transcribed_")}  # health/ is tests/test_gpu_health.py's
    assert files == set(GPUS) | set(LISTS) | set(APPS)
    readme = read("README.md")
    assert [f for f in sorted(files) if f"| {f} |" not in readme] == []
    assert len(files) >= 12


@pytest.mark.parametrize("name", sorted(GPUS))
def test_gpus_as_recorded(name):
    got = [(g.index, g.name, g.util, g.mem_used_mib, g.mem_total_mib, g.temp_c, g.power_w) for g in parse(name)]
    assert got == GPUS[name]


@pytest.mark.parametrize("name", sorted(LISTS))
def test_list_gpus_as_recorded(name):
    assert [(g.index, g.name, g.uuid) for g in parse_nvidia_smi_list(read(name))] == LISTS[name]
    assert count_nvidia_smi_list(read(name)) == len(LISTS[name])


@pytest.mark.parametrize("name", sorted(APPS))
def test_compute_apps_as_recorded(name):
    got = [(uuid, p.pid, p.name, p.used_mib) for uuid, p in parse_nvidia_smi_apps_csv(read(name))]
    assert got == APPS[name]


def test_compute_apps_land_on_the_gpu_of_the_same_capture():
    (gpu,) = attach_processes(parse("nvidia_query_gpu_h100_590_load.csv"),
                              parse_nvidia_smi_apps_csv(read("nvidia_compute_apps_h100_590_load.csv")))
    assert [p.pid for p in gpu.processes] == [11327, 11328, 11345] and gpu.busy


def test_rocm_json_and_csv_of_one_card_agree():
    assert parse("rocm_json_rx7900xt_marimo9237.json") == parse("rocm_csv_rx7900xt_marimo9237.csv")


def test_amd_smi_pre_rocm7_bare_list_shape():
    # before ROCm 7 `amd-smi static --json` printed the list without the {"gpu_data": ...} wrapper
    entries = json.loads(read("amd_smi_static_mi300x8_dellai.json"))["gpu_data"]
    assert parse_amd_smi_static_json(json.dumps(entries)) == parse("amd_smi_static_mi300x8_dellai.json")


# ------------------------------------------------------------------ the fakes replay them

def run_fake(tmp_path, *argv):
    return subprocess.run([str(tmp_path / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=30)


def test_fake_nvidia_smi_prints_the_recorded_columns(tmp_path):
    install_nvidia_smi(tmp_path, gpu_state("nodeX", 3))
    fields, rows = read_query_gpu(NVIDIA_RECORDING)
    recorded = dict(zip((f"{f} [{u}]" if u else f for f, u in fields), rows[0]))
    asked = ["name", "memory.total", "power.draw", "pstate", "clocks.max.sm", "utilization.gpu"]
    out = run_fake(tmp_path, "nvidia-smi", "--query-gpu=" + ",".join(asked), "--format=csv").stdout.splitlines()
    heads = [h for h in recorded if h.split(" [")[0] in asked]
    assert out[0] == ", ".join(sorted(heads, key=lambda h: asked.index(h.split(" [")[0])))
    assert out[1:] == [", ".join(recorded[h] for h in out[0].split(", "))] * 3
    bad = run_fake(tmp_path, "nvidia-smi", "--query-gpu=no.such.field", "--format=csv")
    assert bad.returncode == 2 and 'Field "no.such.field" is not a valid field to query.' in bad.stdout


def test_fake_nvidia_smi_answers_the_argv_clusterctl_sends(tmp_path):
    from orchestrator.gpus import NVIDIA_APPS_ARGV, NVIDIA_GPU_ARGV
    install_nvidia_smi(tmp_path, gpu_state("nodeX", 2, processes=[(4242, "python", 30000, 1)]))
    gpus = parse_nvidia_smi_csv(run_fake(tmp_path, *NVIDIA_GPU_ARGV).stdout)
    gpus = attach_processes(gpus, parse_nvidia_smi_apps_csv(run_fake(tmp_path, *NVIDIA_APPS_ARGV).stdout))
    assert [(g.name, g.mem_used_mib, g.mem_total_mib, g.temp_c, g.power_w) for g in gpus] == \
        [(H100, 0, 81559, 41.0, 69.85), (H100, 30000, 81559, 41.0, 69.85)]
    assert [len(g.processes) for g in gpus] == [0, 1]
    listed = parse_nvidia_smi_list(run_fake(tmp_path, "nvidia-smi", "-L").stdout)
    assert [(g.index, g.uuid) for g in listed] == [(g.index, g.uuid) for g in gpus]


def test_fake_rocm_smi_replays_the_recorded_card(tmp_path):
    from orchestrator.gpus import ROCM_GPU_ARGV, ROCM_PIDS_ARGV, parse_rocm_smi_pids_json
    install_rocm_smi(tmp_path, rocm_state(2, processes=[(77, "python3", 1024)]))
    gpus = parse_rocm_smi_json(run_fake(tmp_path, *ROCM_GPU_ARGV).stdout)
    (card,) = parse("rocm_json_rx7900xt_marimo9237.json")
    assert gpus == [replace(card, index=0), replace(card, index=1)]
    (proc,) = parse_rocm_smi_pids_json(run_fake(tmp_path, *ROCM_PIDS_ARGV).stdout)
    assert (proc.pid, proc.name, proc.used_mib) == (77, "python3", 1024)


@pytest.mark.cluster
def test_top_on_an_amd_node_shows_the_recorded_radeon(cluster4, tmp_path, capsys):
    node = cluster4.nodes[3]
    path = tmp_path / "nodes.yaml"
    cluster4.write_inventory(path)
    node.set_gpus(2, vendor="amd")
    try:
        rc = main(["top", "-i", str(path), "--once", "--json"])
        doc = json.loads(capsys.readouterr().out)
    finally:
        node.set_gpus(2)
    assert rc == 0
    amd = {n["name"]: n for n in doc["nodes"]}[node.name]
    assert amd["tool"] == "rocm-smi" and amd["error"] is None
    assert [(g["name"], g["mem_total_mib"]) for g in amd["gpus"]] == [("Radeon RX 7900 XT", 20464)] * 2

