"""Preflight parsers from recorded tool outputs (tests/fixtures/preflight): pure, no cluster."""

from pathlib import Path

import pytest
import yaml

from orchestrator.checks import Ctx, sections
from orchestrator.checks.registry import CHECKS
from orchestrator.checks.firewall import (parse_firewall, parse_firewalld, parse_iptables_save, parse_nft,
                                          parse_ufw)
from orchestrator.checks.gpu import parse_gpu_count, parse_gpu_idle
from orchestrator.checks.net import (attribute_port_reachable, parse_iface, parse_port_free, parse_port_reachable,
                                     parse_proc_net_tcp, parse_ss)
from orchestrator.checks.ping import ping_result
from orchestrator.checks.python import compare_code_sync, compare_python_env
from orchestrator.checks.system import parse_clock_skew, parse_disk, parse_timedatectl, skew
from orchestrator.errors import UsageError
from orchestrator.inventory import parse_inventory
from orchestrator.checks.preflight import select_checks
from tests.probe_text import read, read_gpu, sec

FIX = Path(__file__).parent / "fixtures" / "preflight"


INV = parse_inventory(yaml.safe_dump({
    "master_port": 29500, "checks": {"disk_min_gb": 10, "clock_skew_warn": 1, "clock_skew_fail": 5},
    "nodes": [{"name": "m", "host": "10.0.0.1", "gpus": 8, "iface": "eth0"},
              {"name": "w1", "host": "10.0.0.2", "gpus": 8, "iface": "eth0"},
              {"name": "w2", "host": "10.0.0.3", "gpus": 0, "iface": "lo"}]}), "<t>")
M, W1, W2 = INV.nodes


def ctx(node=M, **kw):
    return Ctx(node=node, inventory=INV, is_master=node.rank == 0, **kw)


def test_sections_split_and_rc():
    s = sections("junk\n@@a x y\n1\n2\n@@rc 3\n@@b\n@@end\n")
    assert [(x.name, x.arg, x.body, x.rc) for x in s] == [("a", "x y", "1\n2", 3), ("b", "", "", None),
                                                         ("end", "", "", None)]


# ------------------------------------------------------------------ gpus

def test_gpu_count_h100x8_ok_and_fewer_fails():
    text = sec("nvidia-gpus", read_gpu("transcribed_nvidia_h100x8_noheader_nounits.csv"))
    assert parse_gpu_count(text, ctx()).status == "ok"
    one = "\n".join(read_gpu("transcribed_nvidia_h100x8_noheader_nounits.csv").splitlines()[:1])
    r = parse_gpu_count(sec("nvidia-gpus", one), ctx())
    assert r.status == "fail" and "inventory says 8" in r.detail and "gpus: 1" in r.remedy
    assert "invalid device ordinal" in r.remedy


def test_gpu_count_not_supported_fields_still_count():
    r = parse_gpu_count(sec("nvidia-gpus", read_gpu("transcribed_nvidia_mig_not_supported.csv")), ctx())
    assert "A100" in r.detail


def test_gpu_count_rocm_json():
    r = parse_gpu_count(sec("rocm-gpus", read_gpu("rocm_json_rx7900xt_marimo9237.json")), ctx())
    assert "via rocm-smi" in r.detail


def test_gpu_count_no_tool_and_cpu_node():
    assert parse_gpu_count("@@no-gpu-tool\n", ctx(M)).status == "fail"
    assert parse_gpu_count("@@no-gpu-tool\n", ctx(W2)).status == "ok"


def test_gpu_count_driver_mismatch():
    r = parse_gpu_count(sec("nvidia-gpus", read("nvidia_smi_driver_mismatch.txt"), rc=18), ctx())
    assert r.status == "fail" and "Driver/library version mismatch" in r.detail


def test_gpu_idle_names_pid_and_command():
    text = (sec("nvidia-gpus", read_gpu("transcribed_nvidia_h100x8_noheader_nounits.csv"))
            + sec("nvidia-apps", read_gpu("transcribed_nvidia_h100x8_apps_noheader_nounits.csv"), rc=None)
            + sec("proc", "python train.py --resume", rc=None, arg="48211"))
    r = parse_gpu_idle(text, ctx())
    assert r.status == "fail" and "pid 48211 (python train.py --resume" in r.detail and "kill 48211" in r.remedy
    idle_gpus = "".join(ln + "\n" for ln in read_gpu("transcribed_nvidia_h100x8_noheader_nounits.csv").splitlines()[4:])
    idle = sec("nvidia-gpus", idle_gpus) + "@@nvidia-apps\n\n"
    assert parse_gpu_idle(idle, ctx()).status == "ok"
    # the probe skips the process query when no GPU has memory in use
    r = parse_gpu_idle(sec("nvidia-gpus", idle_gpus), ctx())
    assert r.status == "ok" and "no GPU memory in use on 4 GPU(s)" in r.detail


def test_gpu_idle_memory_held_by_a_process_nvidia_smi_cannot_list():
    # in a container nvidia-smi lists no other container's processes; memory.used still shows them
    text = sec("nvidia-gpus", read_gpu("transcribed_nvidia_h100x8_noheader_nounits.csv")) + "@@nvidia-apps\n\n"
    r = parse_gpu_idle(text, ctx())
    assert r.status == "warn" and "GPU 0 71234 MiB" in r.detail and "GPU 3 71240 MiB" in r.detail
    assert "another container" in r.detail and "GPU 4" not in r.detail
    # a display server's few hundred MiB is no reason to warn
    desktop = "0, GPU-x, NVIDIA GeForce RTX 4090, 3, 412, 24564, 41, 27.53\n"
    assert parse_gpu_idle(sec("nvidia-gpus", desktop) + "@@nvidia-apps\n\n", ctx()).status == "ok"


# ------------------------------------------------------------------ ports

def test_ss_with_process_and_port_free():
    listeners = parse_ss(read("ss_Hltnp_root.txt"))
    py = [x for x in listeners if x.port == 29511]
    assert py and py[0].command == "python" and py[0].pid
    c = Ctx(node=M, inventory=INV.__class__(**{**INV.__dict__, "master_port": 29511}), is_master=True)
    r = parse_port_free(sec("ss", read("ss_Hltnp_root.txt")), c)
    assert r.status == "fail" and f"pid {py[0].pid} (python)" in r.detail
    own = Ctx(node=M, inventory=c.inventory, is_master=True, own_pids=frozenset([py[0].pid]))
    assert parse_port_free(sec("ss", read("ss_Hltnp_root.txt")), own).status == "ok"
    assert parse_port_free(sec("ss", read("ss_Hltnp_root.txt")), ctx(W1)).status == "skip"


def test_proc_net_tcp_fallback():
    rows = parse_proc_net_tcp(read("proc_net_tcp.txt"))
    assert any(x.port == 29511 and x.address == "0.0.0.0" for x in rows)
    c = Ctx(node=M, inventory=INV.__class__(**{**INV.__dict__, "master_port": 29511}), is_master=True)
    text = sec("proc-net-tcp", read("proc_net_tcp.txt"), rc=None) + sec("sockowner", "python -m x", rc=None,
                                                                       arg="77 " + str(_inode_of(29511)))
    r = parse_port_free(text, c)
    assert r.status == "fail" and "pid 77 (python -m x)" in r.detail


def _inode_of(port):
    for line in read("proc_net_tcp.txt").splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == port:
            return int(f[9])


def test_port_reachable_verdicts_and_attribution():
    ok_ = parse_port_reachable(sec("connect", "", arg="10.0.0.1 29500"), ctx(W1))
    drop = parse_port_reachable(sec("connect", "", rc=124, arg="10.0.0.1 29500"), ctx(W1))
    refused = parse_port_reachable(sec("connect", "bash: connect: Connection refused", rc=1,
                                       arg="10.0.0.1 29500"), ctx(W2))
    assert ok_.status == "ok" and drop.status == "fail" and "timed out" in drop.detail
    assert "refused" in refused.detail
    m, ws = attribute_port_reachable({"w1": drop, "w2": drop}, "m", 29500)
    assert m.status == "fail" and {w.status for w in ws.values()} == {"warn"}
    m, ws = attribute_port_reachable({"w1": ok_, "w2": refused}, "m", 29500)
    assert m.status == "ok" and ws["w2"].status == "fail"
    m, ws = attribute_port_reachable({"w1": ok_}, "m", 29500, "master_port 29500 is taken")
    assert m.status == "skip" and ws["w1"].status == "skip"


def test_what_a_probe_could_not_answer_is_marked_and_a_finding_that_holds_is_not():
    c = Ctx(node=M, inventory=INV, is_master=True)
    failed_ss = parse_port_free(sec("ss", "Cannot open netlink socket: Too many open files", rc=1), c)
    no_listing = parse_port_free("@@python\n{}\n@@end\n", c)
    assert failed_ss.status == no_listing.status == "warn" and failed_ss.unanswered and no_listing.unanswered
    assert "ss exited 1: Cannot open netlink socket" in failed_ss.detail
    busy = parse_port_free(sec("ss", 'LISTEN 0 128 0.0.0.0:29500 0.0.0.0:* users:(("python",pid=7,fd=3))'), c)
    assert busy.status == "fail" and not busy.unanswered
    at = "10.0.0.1 29500"
    drop = parse_port_reachable(sec("connect", "", rc=124, arg=at), ctx(W1))
    refused = parse_port_reachable(sec("connect", "bash: connect: Connection refused", rc=1, arg=at), ctx(W1))
    no_route = parse_port_reachable(sec("connect", "bash: connect: No route to host", rc=1, arg=at), ctx(W1))
    assert refused.unanswered and not drop.unanswered and not no_route.unanswered
    # the workers' warnings when the master is to blame keep the mark; the master's verdict,
    # drawn from theirs, has none (asking the master's probe again would not change it)
    m, ws = attribute_port_reachable({"w1": refused, "w2": refused}, "m", 29500)
    assert m.status == "fail" and not m.unanswered and all(w.status == "warn" and w.unanswered for w in ws.values())
    wrong = parse_gpu_count("@@no-gpu-tool\n", ctx(W1))  # 8 GPUs in the inventory, no GPU tool
    assert wrong.status == "fail" and not wrong.unanswered


def test_retry_asks_again_only_nodes_with_unanswered_results_within_its_budget():
    from orchestrator.checks import fail, ok, warn
    from orchestrator.checks import retry

    results = {"m": {"port_free": warn("port_free", "could not list", unanswered=True)},
               "w1": {"gpu_count": fail("gpu_count", "2 GPUs, inventory says 8")},
               "w2": {"port_reachable": fail("port_reachable", "refused", unanswered=True),
                      "shm": ok("shm", "fine")}}
    assert retry.ask_again(results) == ["m", "w2"]
    assert retry.ask_again({"w1": results["w1"]}) == []
    assert retry.round_timeout(0, 60) == retry.BUDGET_S - retry.PAUSE_S
    assert retry.round_timeout(0, 3) == 3
    assert retry.round_timeout(retry.BUDGET_S - retry.MIN_ROUND_S, 60) is None
    r = results["m"]["port_free"]
    assert retry.still_unanswered(r, 1) == r and "(the same on 3 tries)" in retry.still_unanswered(r, 3).detail
    assert retry.still_unanswered(results["w1"]["gpu_count"], 3) == results["w1"]["gpu_count"]


# ------------------------------------------------------------------ firewall

def test_iptables_drop_rule_warns_with_fix():
    f = parse_iptables_save(read("iptables_save_drop_29500.txt"), 29500)
    assert f.default_drop and f.blocks_port
    r = parse_firewall(sec("iptables", read("iptables_save_drop_29500.txt")), ctx())
    assert r.status == "warn" and "29500" in r.detail and "iptables -D INPUT" in r.remedy


def test_nft_rulesets():
    f = parse_nft(read("nft_iptables_nft_drop_29500.txt"), 29500)
    assert f.blocks_port
    g = parse_nft(read("nft_policy_drop_accepts_29500.txt"), 29500)
    assert g.default_drop and g.allows_port and not g.blocks_port
    r = parse_firewall(sec("nft", read("nft_policy_drop_accepts_29500.txt")), ctx())
    assert r.status == "warn" and "ephemeral" in r.detail


def test_not_root_is_skip_not_fail():
    text = sec("iptables", read("iptables_save_not_root.txt"), rc=1) + sec("nft", "Operation not permitted", rc=1)
    assert parse_firewall(text, ctx()).status == "skip"
    assert parse_firewall("", ctx()).status == "ok"


def test_ufw():
    assert parse_firewall(sec("ufw", read("ufw_inactive.txt")), ctx()).status == "ok"
    r = parse_firewall(sec("ufw", read("ufw_active_deny.txt")), ctx())
    assert r.status == "warn" and "ufw allow" in r.remedy
    f = parse_ufw(read("ufw_active_allow_29500.txt"), 29500)
    assert f.allows_port and f.allows_all
    assert parse_firewall(sec("ufw", read("ufw_active_allow_29500.txt")), ctx()).status == "ok"
    assert parse_firewall(sec("ufw", read("ufw_not_root.txt"), rc=1), ctx()).status == "skip"


def test_ufw_without_root_is_read_from_its_config():
    # as a user without sudo, the probe reads /etc/ufw/ufw.conf instead of running ufw
    not_root = sec("iptables", read("iptables_save_not_root.txt"), rc=4)
    on = parse_firewall(sec("ufw-conf", "ENABLED=yes") + not_root, ctx())
    assert on.status == "skip" and on.detail.startswith("ufw enabled (its rules need root to read); ")
    off = parse_firewall(sec("ufw-conf", "ENABLED=no") + not_root, ctx())
    assert off.status == "ok" and "ufw disabled" in off.detail
    missing = parse_firewall(sec("ufw-conf", "grep: /etc/ufw/ufw.conf: No such file or directory", rc=2)
                             + not_root, ctx())
    assert missing.status == "skip" and "ufw enabled" not in missing.detail


def test_firewalld():
    f = parse_firewalld(read("firewalld_state_running.txt"), read("firewalld_list_all_public.txt"), 29500)
    assert f.active and f.default_drop and not f.allows_port
    g = parse_firewalld("running", read("firewalld_list_all_port_29500.txt"), 29500)
    assert g.allows_port
    assert not parse_firewalld(read("firewalld_state_not_running.txt"), "", 29500).active
    text = sec("firewalld-state", "running") + sec("firewalld", read("firewalld_list_all_public.txt"))
    assert parse_firewall(text, ctx()).status == "warn"


# ------------------------------------------------------------------ iface

def test_iface_ok_missing_down_and_wrong_route():
    lo = read("ip_j_addr_lo.json")
    c = ctx(W2)
    route = sec("ip-route", read("ip_j_route_get_lo.json"), arg="127.0.0.1")
    assert parse_iface(sec("ip-addr", lo) + route, c).status == "ok"
    r = parse_iface(sec("ip-addr", read("ip_j_addr_missing.txt"), rc=1), c)
    assert r.status == "fail" and "does not exist" in r.detail
    down = lo.replace('"UP",', "").replace('"LOWER_UP"', '"X"').replace('"UNKNOWN"', '"DOWN"')
    assert parse_iface(sec("ip-addr", down), c).status == "fail"
    wrong = route.replace('"dev":"lo"', '"dev":"eth1"')
    r = parse_iface(sec("ip-addr", lo) + wrong, c)
    assert r.status == "fail" and "NCCL_SOCKET_IFNAME=eth1" in r.remedy
    assert parse_iface("", ctx(Ctx.__dataclass_fields__ and M.__class__(**{**M.__dict__, "iface": None}))).status == "skip"


# ------------------------------------------------------------------ clock, disk, env, code

def test_clock_skew_midpoint_and_thresholds():
    assert skew(110.0, 100.0, 102.0) == (9.0, 1.0)
    text = sec("time", "1000.000000000", rc=None)
    assert parse_clock_skew(text, ctx(t_send=999.9, t_recv=1000.1)).status == "ok"
    assert parse_clock_skew(text, ctx(t_send=997.9, t_recv=998.1)).status == "warn"
    r = parse_clock_skew(text, ctx(t_send=989.9, t_recv=990.1))
    assert r.status == "fail" and r.detail.startswith("+10.000s")
    # a slow round trip cannot prove a skew: 1.5 s off with ±1 s uncertainty is not a warning
    assert parse_clock_skew(text, ctx(t_send=997.5, t_recv=999.5)).status == "ok"
    synced = text + sec("timedatectl", read("timedatectl_show_synced.txt"))
    assert "NTP synchronised" in parse_clock_skew(synced, ctx(t_send=999.9, t_recv=1000.1)).detail
    unsynced = text + sec("timedatectl", read("timedatectl_show_unsynced.txt"))
    assert parse_clock_skew(unsynced, ctx(t_send=999.9, t_recv=1000.1)).status == "warn"
    assert parse_timedatectl(read("timedatectl_no_systemd.txt")) == {}


def test_disk():
    df = ("workdir /home/u/w\noutput /data/out\nFilesystem 1024-blocks Used Available Capacity Mounted on\n"
          "/dev/sda1 100000000 1 52428800 1% /\n/dev/sdb1 100000000 1 1048576 1% /data\n")
    r = parse_disk(sec("df", df), ctx())
    assert r.status == "warn" and "output" in r.detail and "1.0 GB" in r.detail


def _info(torch="2.13.0", cuda="12.4", nccl="2.21.5", digest="abc", kind="tree"):
    import json
    return sec("python", json.dumps({"python": "3.11.7", "torch": torch, "cuda": cuda, "hip": None, "nccl": nccl,
                                     "code": {"kind": kind, "digest": digest, "files": 3, "head": None}}))


def test_python_env_mismatch_fails_the_odd_node_only():
    c = {n.name: ctx(n) for n in INV.nodes}
    out = compare_python_env({"m": _info(), "w1": _info(torch="2.0.0"), "w2": _info()}, c, "m")
    assert out["m"].status == "ok" and out["w2"].status == "ok"
    assert out["w1"].status == "fail" and "torch 2.0.0 (others 2.13.0)" in out["w1"].detail
    broken = compare_python_env({"m": _info(), "w1": sec("python", "sh: 1: python3: not found", rc=127)}, c, "m")
    assert broken["w1"].status == "fail" and "not found" in broken["w1"].detail


def test_code_sync_against_majority_and_control():
    c = {n.name: ctx(n) for n in INV.nodes}
    out = compare_code_sync({"m": _info(), "w1": _info(digest="zzz"), "w2": _info()}, c, "m")
    assert [out[k].status for k in ("m", "w1", "w2")] == ["ok", "fail", "ok"]
    out = compare_code_sync({"m": _info(), "w1": _info()}, c, "m", {"kind": "git", "digest": "new"})
    assert {r.status for r in out.values()} == {"fail"}
    out = compare_code_sync({"m": _info(kind="missing", digest=None)}, c, "m")
    assert out["m"].status == "fail" and "sync" in out["m"].remedy


def test_ping_verdicts():
    assert ping_result("h", 0.001, True).status == "ok"
    assert ping_result("h", None, True).status == "warn"
    assert ping_result("h", None, False).status == "fail"


def test_select_checks():
    assert select_checks(None, None) == list(CHECKS)
    assert select_checks("disk,ssh", None) == ["ssh", "disk"]
    assert select_checks(None, "ping,firewall") == [c for c in CHECKS if c not in ("ping", "firewall")]
    with pytest.raises(UsageError):
        select_checks("ssh,nope", None)
