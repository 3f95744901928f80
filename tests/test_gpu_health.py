"""gpu_health: its parsers on tool outputs recorded on real machines (tests/fixtures/gpus/health,
sources in tests/fixtures/gpus/README.md), its rules, its verdict, and its probe run here against
the test cluster's fake nvidia-smi and dmesg (the kernel log's window kept in the node's mark)."""

import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.checks import Ctx
from orchestrator.checks.gpu_health import (LOOKBACK_S, SAME_WINDOW_S, amd_findings, dcgm_findings,
                                            nvidia_findings, nvlink_findings, parse_gpu_health, probe_options,
                                            xid_findings)
from orchestrator.checks.registry import probe_script
from orchestrator.gpus.health import (parse_amd_ecc, parse_dcgm_diag, parse_nvidia_query, parse_nvlink_status,
                                      tree)
from orchestrator.gpus.kernel import log_time, parse_xids, pci_key
from orchestrator.inventory import parse_inventory
from tests.cluster.fakes import fake_bus_id, gpu_state, install_nvidia_smi, xid_message

FIX = Path(__file__).parent / "fixtures" / "gpus"
HEALTH = FIX / "health"
H100 = "NVIDIA H100 80GB HBM3"
SLOW = ("HW Slowdown", "HW Power Brake Slowdown")

# file -> (attached GPUs, per GPU: (bus id, name, persistence, utilization, PCIe gen, gen max,
# width, width max, volatile uncorrectable ECC, remap pending, remap failed, HW slowdowns))
NVIDIA = {
    "nvidia_q_h100_590_idle.txt": (1, [("00000000:00:09.0", H100, True, 0, 5, 5, 16, 16, 0, False, False, ())]),
    "nvidia_q_h100_590_load.txt": (1, [("00000000:00:09.0", H100, True, 100, 5, 5, 16, 16, 0, False, False, ())]),
    "nvidia_q_h100_mig_590_load.txt": (1, [("00000000:00:09.0", H100, True, None, 5, 5, 16, 16, 0, None, None,
                                            ())]),
    "nvidia_q_rtx4080super_595_idle.txt": (1, [("00000000:01:00.0", "NVIDIA GeForce RTX 4080 SUPER", False, 0, 1, 4,
                                                16, 16, None, None, None, ())]),
    "nvidia_q_rtx4080super_595_load.txt": (1, [("00000000:01:00.0", "NVIDIA GeForce RTX 4080 SUPER", False, 7, 4, 4,
                                                16, 16, None, None, None, ())]),
    "nvidia_q_a10_535_gpud.txt": (1, [("00000000:07:00.0", "NVIDIA A10", True, 0, 4, 4, 16, 16, 0, True, False, ())]),
    "nvidia_q_h100x8_535_161_gpud.txt": (8, [(f"00000000:{b}:00.0", H100, True, 0, 5, 5, 16, 16, 0, False, False,
                                              SLOW) for b in ("19", "3B", "4C", "5D", "9B", "BB", "CB", "DB")]),
    "nvidia_q_titanv_560_gpud.txt": (1, [("00000000:01:00.0", "NVIDIA TITAN V", False, 0, 1, 3, 16, 16, None, None,
                                          None, ())]),
    "nvidia_q_h100x8_535_183_cut_gpud.txt": (8, [("00000000:53:00.0", H100, True, None, 5, 5, 16, 16, None, None,
                                                  None, ())]),
    "nvidia_q_d_ecc_perf_h100_535_gke.txt": (1, [("00000000:04:00.0", "", None, None, None, None, None, None, 0,
                                                  None, None, ())]),
    "transcribed_nvidia_q_h100_dram_uncorrectable.txt": (1, [("00000000:00:09.0", H100, True, 0, 5, 5, 16, 16, 2,
                                                              False, False, ())]),
}
# file -> [(severity, GPU, the start of what it says)] from nvidia_findings
NVIDIA_FINDINGS = {
    "nvidia_q_rtx4080super_595_idle.txt": [("warn", 0, "persistence mode off")],  # gen 1 of 4, but idle
    "nvidia_q_rtx4080super_595_load.txt": [("warn", 0, "persistence mode off")],
    "nvidia_q_titanv_560_gpud.txt": [("warn", 0, "persistence mode off")],
    "nvidia_q_a10_535_gpud.txt": [("fail", 0, "row remapping pending (4 uncorrectable row(s))")],
    "nvidia_q_h100x8_535_161_gpud.txt": [("fail", i, "hardware slowdown active (HW Slowdown, HW Power Brake "
                                          "Slowdown)") for i in range(8)],
    "transcribed_nvidia_q_h100_dram_uncorrectable.txt": [("fail", 0, "2 uncorrectable ECC error(s) since the driver "
                                                          "loaded")],
}
# file -> per GPU: (index, links, inactive links, all inactive)
NVLINK = {
    "nvlink_h100_590.txt": [(0, 18, [], False)],
    "nvlink_h100_mig_590.txt": [(0, 0, [], False)],
    "nvlink_rtx2080super_595.txt": [(0, 0, [], True)],
    "nvlink_l40s_595.txt": [(0, 0, [], False)],
    "nvlink_a100x8_gpud.txt": [(i, 12, [], False) for i in range(8)],
    "nvlink_a10_gpud.txt": [],
    "nvlink_a6000x3_siboehm.txt": [(0, 4, [], False), (1, 4, [], False), (2, 0, [], True)],
    "nvlink_v100_inactive_azhpc73.txt": [(3, 6, [3, 5], False)],
}
NVLINK_FINDINGS = {
    "nvlink_a6000x3_siboehm.txt": [("warn", 2, "no active NVLink while GPU(s) 0, 1 have some")],
    "nvlink_v100_inactive_azhpc73.txt": [("warn", 3, "NVLink link(s) 3, 5 inactive (4 of 6 up)")],
}
# file -> Xids: (code, PCI, ISO time or None, process)
DBE_AT = "2024-11-15T12:02:03.470068+00:00"
XIDS = {
    "dmesg_iso_gpud.log": [(48, "0000:19:00", DBE_AT, None), (63, "0000:19:00", "2024-11-15T12:02:03.498753+00:00",
                                                              None),
                           (94, "0000:19:00", "2024-11-15T12:02:03.506595+00:00", None)]
                          + [(94, "0000:19:00", t, "python3.10") for t in (
                              "2024-11-15T12:02:03.521616+00:00", "2024-11-15T12:02:03.552642+00:00",
                              "2024-11-15T12:02:03.561522+00:00", "2024-11-15T12:02:03.570101+00:00",
                              "2024-11-15T12:02:03.578496+00:00", "2024-11-15T12:02:03.587265+00:00",
                              "2024-11-15T12:02:03.630019+00:00", "2024-11-15T12:02:03.638794+00:00")],
    "dmesg_T_xid119_gpud.log": [(119, "0000:9b:00", None, p) for p in ("nvidia-smi", "nvidia-smi", "nvidia-smi",
                                                                         "cache_mgr_main", "gpud")],
    "journalctl_short_iso_gpud.log": [],
    "dmesg_denied_gke.txt": [],
}
# file -> ([(test, status, GPUs, how its first note starts)], error)
DCGM = {
    "dcgm_diag_r2_h100_gke.txt": ([(n, "pass", None, "") for n in (
        "Denylist", "NVML Library", "CUDA Main Library", "Permissions and OS Blocks")]
        + [("Persistence Mode", "pass", None, "Persistence mode for GPU 0 is disabled. Enable persistence mode by")]
        + [(n, "pass", None, "") for n in ("Environment Variables", "Page Retirement/Row Remap", "Graphics Processes",
                                            "Inforom", "PCIe", "GPU Memory")], None),
    "dcgm_diag_r3_error_gke.txt": ([], "Error: Unable to complete diagnostic for entities *,cpu:*. Return: (-30) : "
                                       "DCGM GPU Diagnostic returned an error"),
    "dcgm_diag_pcie_fail_dcgm49.txt": ([("PCIe", "fail", None, "GPU 0GPU 0's NvLink link 0 is currently down Run a "
                                         "field diagnostic on the GPU., GPU 0GPU 0's NvLink link 1 is")], None),
}
DCGM_FINDINGS = {
    "dcgm_diag_r2_h100_gke.txt": [],
    "dcgm_diag_r3_error_gke.txt": [("warn", None, "dcgmi diag did not run: Error: Unable to complete diagnostic")],
    "dcgm_diag_pcie_fail_dcgm49.txt": [("fail", None, "dcgmi diag: PCIe failed: GPU 0GPU 0's NvLink link 0 is "
                                        "currently down")],
}
ZERO7 = {b: 0 for b in ("UMC", "SDMA", "GFX", "MMHUB", "PCIE_BIF", "HDP", "XGMI_WAFL")}
# file -> per GPU: (index, uncorrectable, deferred, correctable)
AMD = {
    "amd_smi_metric_ecc_block_amdsmi.txt": [(0, ZERO7, ZERO7, ZERO7)],
    "amd_smi_metric_ecc_amdsmi.txt": [(0, *[{"TOTAL": 0, "UMC": 0, "SDMA": 0}] * 3)],
    "amd_smi_metric_k_umc_mi300x_dme368.txt": [(None, {"UMC": 0}, {"UMC": 0}, {"UMC": 2})],
    "transcribed_amd_smi_metric_ecc_sdma_uncorrectable.txt": [(0, {"TOTAL": 3, "UMC": 0, "SDMA": 3},
                                                               {"TOTAL": 0, "UMC": 0, "SDMA": 0},
                                                               {"TOTAL": 0, "UMC": 0, "SDMA": 0})],
}
AMD_FINDINGS = {"transcribed_amd_smi_metric_ecc_sdma_uncorrectable.txt": [("fail", 0, "3 uncorrectable ECC error(s) "
                                                                           "(SDMA 3)")]}


def read(name):
    return (HEALTH / name).read_text()


def said(findings):
    return [(f.severity, f.gpu, f.what) for f in findings]


def starts(findings, expected):
    got = said(findings)
    return len(got) == len(expected) and all(
        (s, g) == (es, eg) and w.startswith(ew) for (s, g, w), (es, eg, ew) in zip(got, expected))


def test_every_health_recording_is_checked_and_named_in_the_readme():
    files = {p.name for p in HEALTH.iterdir()}
    assert files == set(NVIDIA) | set(NVLINK) | set(XIDS) | set(DCGM) | set(AMD)
    readme = (FIX / "README.md").read_text()
    recorded = sorted(f for f in files if not f.startswith("transcribed_"))
    assert [f for f in recorded if f"| {f} |" not in readme] == []
    assert [f for f in files - set(recorded) if f"- {f}:" not in readme] == []
    assert len(recorded) >= 12


# ------------------------------------------------------------------ nvidia-smi -q

@pytest.mark.parametrize("name", sorted(NVIDIA))
def test_nvidia_query_as_recorded(name):
    attached, gpus = parse_nvidia_query(read(name))
    got = [(g.bus_id, g.name, g.persistence, g.utilization, g.pcie_gen, g.pcie_gen_max, g.pcie_width,
            g.pcie_width_max, g.ecc_volatile_uncorrectable, g.remap_pending, g.remap_failed, g.slowdowns)
           for g in gpus]
    assert (attached, got) == NVIDIA[name]
    assert [g.index for g in gpus] == list(range(len(gpus))) and not any(g.recovery for g in gpus)


@pytest.mark.parametrize("name", sorted(NVIDIA))
def test_nvidia_rules_on_each_recording(name):
    found = [f for g in parse_nvidia_query(read(name))[1] for f in nvidia_findings(g)]
    assert starts(found, NVIDIA_FINDINGS.get(name, [])), said(found)


def test_pcie_generation_warns_only_when_busy_and_width_always():
    (idle,) = parse_nvidia_query(read("nvidia_q_rtx4080super_595_idle.txt"))[1]
    busy = idle.__class__(**{**idle.__dict__, "utilization": 40, "persistence": True})
    assert said(nvidia_findings(busy)) == [("warn", 0, "PCIe gen 1 of 4 while busy (40 %)")]
    narrow = idle.__class__(**{**idle.__dict__, "pcie_width": 8, "persistence": True})
    assert said(nvidia_findings(narrow)) == [("warn", 0, "PCIe link x8 of x16")]


def test_recovery_actions_and_reset_status_fail():
    q = read("nvidia_q_h100_590_idle.txt")
    asked = q.replace("GPU Recovery Action                                : None",
                      "GPU Recovery Action                                : Node Reboot")
    (g,) = parse_nvidia_query(asked)[1]
    assert g.recovery == "Node Reboot" and [(f.severity, f.remedy) for f in nvidia_findings(g)] == [
        ("fail", "reboot the node")]
    a10 = read("nvidia_q_a10_535_gpud.txt").replace("Reset Required                    : No",
                                                     "Reset Required                    : Yes")
    (g,) = parse_nvidia_query(a10)[1]
    assert g.recovery == "GPU Reset" and nvidia_findings(g)[0].what.endswith("GPU Reset")


def test_every_uncorrectable_counter_and_pending_page_retirement():
    """Readings no recording has, made by changing one recorded value: the pre-Ampere layout counts
    Volatile > Double Bit > Total, Hopper's adds the SRAM counters, a pending page retirement fails."""
    titan = read("nvidia_q_titanv_560_gpud.txt")
    i = titan.index("            Double Bit")
    dbe = titan[:i] + titan[i:].replace("                Total                     : N/A",
                                        "                Total                     : 3", 1)
    dbe = dbe.replace("Pending Page Blacklist            : N/A", "Pending Page Blacklist            : Yes")
    (g,) = parse_nvidia_query(dbe)[1]
    assert (g.ecc_volatile_uncorrectable, g.retired_pending) == (3, True)
    assert [f.what for f in nvidia_findings(g)][:2] == [
        "3 uncorrectable ECC error(s) since the driver loaded",
        "page retirement pending: the bad pages stay in use until a reset"]
    h100 = read("transcribed_nvidia_q_h100_dram_uncorrectable.txt").replace(
        "SRAM Uncorrectable Parity                  : 0", "SRAM Uncorrectable Parity                  : 1", 1)
    assert parse_nvidia_query(h100)[1][0].ecc_volatile_uncorrectable == 3  # 2 DRAM + 1 SRAM, volatile only


def test_tree_keeps_values_with_colons_and_sections():
    entries = dict(tree(read("nvidia_q_a10_535_gpud.txt").splitlines()[:30]))
    assert entries[("Timestamp",)] == "Wed Sep 25 10:40:24 2024"
    assert entries[("GPU 00000000:07:00.0",)] is None  # a block header, not "GPU 00000000" = "07:00.0"
    assert entries[("GPU 00000000:07:00.0", "MIG Mode", "Current")] == "N/A"


# ------------------------------------------------------------------ nvidia-smi nvlink --status

@pytest.mark.parametrize("name", sorted(NVLINK))
def test_nvlink_status_as_recorded(name):
    got = [(g.index, len(g.links), g.inactive, g.all_inactive) for g in parse_nvlink_status(read(name))]
    assert got == NVLINK[name]
    assert starts(nvlink_findings(parse_nvlink_status(read(name))), NVLINK_FINDINGS.get(name, []))


# ------------------------------------------------------------------ kernel log

@pytest.mark.parametrize("name", sorted(XIDS))
def test_xids_as_recorded(name):
    got = [(x.code, x.pci, x.time, x.process) for x in parse_xids(read(name))]
    want = [(c, p, None if t is None else log_time(t), proc) for c, p, t, proc in XIDS[name]]
    assert got == want


def test_xid_lines_of_older_drivers():
    # the forms leptonai/gpud's Xid parser lists (components/accelerator/nvidia/xid): no pid and
    # name, and no "PCI:" before the address
    text = ("NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.\n"
            "[...] NVRM: Xid (0000:03:00): 14, Channel 00000001\n")
    assert [(x.code, x.pci, x.message, x.process) for x in parse_xids(text)] == [
        (79, "0000:01:00", "GPU has fallen off the bus.", None), (14, "0000:03:00", "Channel 00000001", None)]
    assert said(xid_findings(parse_xids(text)[:1], 0, {"0000:01:00": 0})) == [
        ("fail", 0, "Xid 79 (GPU has fallen off the bus): GPU has fallen off the bus.")]


def test_log_times_carry_their_zone():
    assert log_time("2025-01-02T15:20:12+0800 a800 kernel:") == log_time("2025-01-02T07:20:12+00:00")
    assert log_time("kern  :warn  : 2025-01-21T02:21:33,498559+00:00 ") == 1737426093.498559
    assert log_time("[Sun Feb 23 16:24:18 2025] ") is None and log_time("[ 12.5] ") is None
    assert pci_key("00000000:9B:00.0") == pci_key("PCI:0000:9b:00") == "0000:9b:00"


def test_xids_since_the_last_check_fail_app_ones_warn_older_ones_go():
    xids = parse_xids(read("dmesg_iso_gpud.log"))
    at = log_time(DBE_AT)
    assert starts(xid_findings(xids, at - 1, {"0000:19:00": 2}), [
        ("fail", 2, "Xid 48 (double-bit ECC error) at 2024-11-15 12:02:03 UTC: An uncorrectable double bit error"),
        ("fail", 2, "Xid 63 (ECC page retirement or row remapping recorded)"),
        ("fail", 2, "Xid 94 (contained ECC error) (9 times)")])
    assert xid_findings(xids, at + 60, {}) == []  # logged before the last check: reported then
    # no GPU of this node has that address: said by address
    assert said(xid_findings(xids[:1], 0, {}))[0][1:] == (None, "PCI 0000:19:00: Xid 48 (double-bit ECC error) at "
                                                          "2024-11-15 12:02:03 UTC: An uncorrectable double bit "
                                                          "error (DBE) has been detected on GPU in the framebuffer "
                                                          "at physAddr 0x12bac1c3e0 partition 2, subpartition 1.")
    app = parse_xids(read("dmesg_iso_gpud.log").replace("): 48,", "): 31,"))[:1]
    assert [f.severity for f in xid_findings(app, 0, {})] == ["warn"]
    # -T stamps carry no zone: such a line counts as new
    assert starts(xid_findings(parse_xids(read("dmesg_T_xid119_gpud.log")), time.time(), {"0000:9b:00": 4}),
                  [("fail", 4, "Xid 119 (GSP RPC timeout) (5 times): Timeout after 6s")])


# ------------------------------------------------------------------ dcgmi diag, amd-smi

@pytest.mark.parametrize("name", sorted(DCGM))
def test_dcgm_diag_as_recorded(name):
    tests, error = parse_dcgm_diag(read(name))
    got = [(t.name, t.status, t.gpus, t.warnings[0][:len(n)] if t.warnings else "") for t, (*_, n) in
           zip(tests, DCGM[name][0])]
    assert (got, error) == DCGM[name] and len(tests) == len(DCGM[name][0])
    assert starts(dcgm_findings(tests, error), DCGM_FINDINGS[name])


def test_dcgm_per_gpu_rows():
    table = read("dcgm_diag_r2_h100_gke.txt").replace(
        "| GPU Memory                | Pass - All                                     |",
        "| GPU Memory                | Pass - GPU: 1                                  |\n"
        "|                           | Fail - GPU: 0                                  |")
    tests, _ = parse_dcgm_diag(table)
    assert [(t.name, t.status, t.gpus) for t in tests[-2:]] == [("GPU Memory", "pass", (1,)),
                                                                 ("GPU Memory", "fail", (0,))]
    assert said(dcgm_findings(tests, None)) == [("fail", None, "dcgmi diag: GPU Memory failed on GPU 0")]


@pytest.mark.parametrize("name", sorted(AMD))
def test_amd_ecc_as_recorded(name):
    got = [(e.index, e.uncorrectable, e.deferred, e.correctable) for e in parse_amd_ecc(read(name))]
    assert got == AMD[name]
    assert starts([f for e in parse_amd_ecc(read(name)) for f in amd_findings(e)], AMD_FINDINGS.get(name, []))


# ------------------------------------------------------------------ the verdict

INV = parse_inventory(yaml.safe_dump({"nodes": [{"name": "g", "host": "10.0.0.1", "gpus": 8},
                                                {"name": "c", "host": "10.0.0.2", "gpus": 0}],
                                      "checks": {"gpu_diag": True}}), "<t>")


def probe(**sections):
    """A probe's output: each section (name -> (arg, body, rc)) in order."""
    out = []
    for name, (arg, body, rc) in sections.items():
        out += [f"@@{name.replace('_', '-')}{' ' + arg if arg else ''}", body.rstrip("\n")] + (
            [f"@@rc {rc}"] if rc is not None else [])
    return "\n".join(out) + "\n@@end\n"


PLAIN = parse_inventory(yaml.safe_dump({"nodes": [{"name": "g", "host": "10.0.0.1", "gpus": 2}]}), "<t>")


def health(text, node=0, inv=INV):
    return parse_gpu_health(text, Ctx(node=inv.nodes[node], inventory=inv))


def test_verdict_names_gpu_reason_and_remedy():
    text = probe(nvidia_health=("", read("nvidia_q_a10_535_gpud.txt"), 0),
                 nvlink=("", read("nvlink_a10_gpud.txt"), 0),
                 kernel_log=("dmesg 0", read("dmesg_iso_gpud.log").replace("0000:19:00", "0000:07:00"), 0))
    r = health(text)
    assert r.status == "fail" and r.detail.startswith("GPU 0: row remapping pending (4 uncorrectable row(s))")
    assert "GPU 0: Xid 48 (double-bit ECC error)" in r.detail and "dcgmi diag not run: no dcgmi" in r.detail
    assert r.remedy.startswith("on g: reset GPU 0 with nothing running on it (`sudo nvidia-smi -r -i 0`)")


def test_healthy_warned_cut_and_broken_nvidia():
    clean = dict(nvlink=("", read("nvlink_h100_590.txt"), 0), kernel_log=("dmesg 0", "", 0),
                 dcgm_diag=("", read("dcgm_diag_r2_h100_gke.txt"), 0))
    r = health(probe(nvidia_health=("", read("nvidia_q_h100_590_idle.txt"), 0), **clean))
    assert (r.status, r.detail) == ("ok", "GPUs healthy")
    r = health(probe(nvidia_health=("", read("nvidia_q_rtx4080super_595_idle.txt"), 0), **clean))
    assert (r.status, r.detail) == ("warn", "GPU 0: persistence mode off")
    r = health(probe(nvidia_health=("", read("nvidia_q_h100x8_535_183_cut_gpud.txt"), 0), **clean))
    assert r.status == "warn" and "described 1 of the 8 GPUs" in r.detail
    broken = "Unable to determine the device handle for GPU0000:9B:00.0: Unknown Error\n"
    r = health(probe(nvidia_health=("", broken, 15), **clean))
    assert r.status == "fail" and "Unknown Error" in r.detail
    r = health(probe(nvidia_health=("", read("nvidia_q_h100_590_idle.txt"), 0), nvlink=clean["nvlink"],
                     kernel_log=clean["kernel_log"], dcgm_diag=("", "", 124)))
    assert r.status == "warn" and "did not finish in 40 s" in r.detail


def test_unreadable_kernel_log_is_a_note_and_amd_and_cpu_nodes():
    text = probe(nvidia_health=("", read("nvidia_q_h100_590_idle.txt"), 0),
                 kernel_log=("dmesg 0", read("dmesg_denied_gke.txt"), 1))
    r = health(text.replace("@@end", "@@kernel-log journalctl 0\n-- No entries --\n@@rc 1\n@@end"))
    assert r.status == "ok" and "Xids not checked: the kernel log is not readable by this account (dmesg: dmesg: " \
        "read kernel buffer failed: Operation not permitted; journalctl: -- No entries --)" in r.detail
    r = health(probe(amd_health=("", read("transcribed_amd_smi_metric_ecc_sdma_uncorrectable.txt"), 0),
                     kernel_log=("journalctl 0", read("journalctl_short_iso_gpud.log"), 0)))
    assert (r.status, r.detail) == ("fail", "GPU 0: 3 uncorrectable ECC error(s) (SDMA 3)")
    assert health(probe(amd_no_amd_smi=("", "", None))).status == "skip"
    assert health("@@no-gpu-tool\n@@end\n").detail == "no GPU tool on the node"
    assert health(probe(nvidia_health=("", read("nvidia_q_a10_535_gpud.txt"), 0)), node=1).detail == \
        "CPU node (gpus: 0)"


def test_gpu_diag_rides_along_only_when_asked():
    assert probe_options(INV, ["gpu_health", "shm"]) == ["gpu_health", "shm", "gpu_diag"]
    assert probe_options(INV, ["shm"]) == ["shm"]
    assert probe_options(PLAIN, ["gpu_health"]) == ["gpu_health"]


# ------------------------------------------------------------------ the probe, run here

def run_probe(tmp_path, home, **state):
    """gpu_health's probe script as a node runs it, with the fake nvidia-smi and dmesg first on
    PATH and a journalctl that finds no journal."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    install_nvidia_smi(bin_dir, gpu_state("nodeX", 2, **state))
    (bin_dir / "journalctl").write_text("#!/bin/sh\necho 'No journal files were found.'\n")
    (bin_dir / "journalctl").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home)}
    p = subprocess.run(["sh", "-s", "--", "gpu_health", "wd", "out", "1", "", "m", "master", "python3", "0"],
                       input=probe_script(["gpu_health"]), capture_output=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.decode()


def test_probe_fake_remap_xid_and_the_mark(tmp_path):
    home = tmp_path / "home"
    now = time.time()
    state = dict(health={1: {"Remapped Rows/Pending": "Yes"}}, kernel_log=[(now - 5, xid_message(0))])
    r = health(run_probe(tmp_path, home, **state), inv=PLAIN)
    assert r.status == "fail" and r.detail.startswith("GPU 1: row remapping pending: the bad rows stay in use until "
                                                      "a reset; GPU 0: Xid 48 (double-bit ECC error)")
    since, opened, last = map(int, (home / ".clusterctl" / "gpu-health.mark").read_text().split())
    assert opened == last and abs(since - (last - LOOKBACK_S)) <= 1 and abs(last - now) < 30
    # a second round of the same preflight (within SAME_WINDOW_S): the same window, the same Xid
    assert "Xid 48" in health(run_probe(tmp_path, home, **state), inv=PLAIN).detail
    # a later preflight: only what was logged since the check before
    (home / ".clusterctl" / "gpu-health.mark").write_text(f"{since} {last - SAME_WINDOW_S - 10} {last}\n")
    r = health(run_probe(tmp_path, home, kernel_log=[(now - 5, xid_message(0))]), inv=PLAIN)
    assert (r.status, r.detail) == ("ok", "GPUs healthy")
    assert (home / ".clusterctl" / "gpu-health.mark").read_text().split()[0] == str(last)


def test_probe_first_check_looks_back_a_day_and_denied_keeps_the_mark(tmp_path):
    home = tmp_path / "home"
    old = [(time.time() - LOOKBACK_S - 60, xid_message(1, code=63))]
    assert health(run_probe(tmp_path, home, kernel_log=old), inv=PLAIN).status == "ok"
    mark = home / ".clusterctl" / "gpu-health.mark"
    mark.unlink()
    r = health(run_probe(tmp_path, home, dmesg_denied=True, nvlink_down={0: [2, 7]}), inv=PLAIN)
    assert r.status == "warn" and r.detail.startswith("GPU 0: NVLink link(s) 2, 7 inactive (16 of 18 up)")
    assert "Xids not checked" in r.detail and "Operation not permitted" in r.detail and not mark.exists()
    assert fake_bus_id(1) == "00000000:28:00.0" and xid_message(1).startswith("NVRM: Xid (PCI:0000:28:00): 48,")
