"""The ping check's ICMP echo, IPv4 and IPv6, on the control machine's loopback (real sockets,
real `ping`)."""

import shutil
import socket

import pytest

from orchestrator.checks.ping import _open_socket, _ping_processes, ping_all, ping_result


def test_ipv6_and_ipv4_hosts_answer_in_one_call():
    rtts = ping_all(["::1", "[::1]", "127.0.0.1", "localhost"])
    assert all(rtt is not None and rtt >= 0 for rtt in rtts.values()), rtts
    r = ping_result("::1", rtts["::1"], ssh_ok=True)
    assert r.status == "ok" and r.detail.endswith(" ms")


def test_no_reply_and_no_name_are_none():
    # 100::/64 is the IPv6 discard prefix: nothing answers there
    rtts = ping_all(["100::1", "no-such-host.invalid", "::1"], timeout=0.5)
    assert rtts["100::1"] is None and rtts["no-such-host.invalid"] is None
    assert rtts["::1"] is not None
    assert ping_result("100::1", None, ssh_ok=True).status == "warn"


def test_each_family_gets_its_own_icmp_socket():
    for family in (socket.AF_INET, socket.AF_INET6):
        opened = _open_socket(family)
        if opened is None:
            pytest.skip("no ICMP socket here (not root and ping_group_range excludes us)")
        sock, _ = opened
        assert sock.family == family
        sock.close()


@pytest.mark.skipif(shutil.which("ping") is None, reason="no ping command on this machine")
def test_ping_command_fallback_handles_ipv6():
    rtts = _ping_processes(["::1", "[::1]", "127.0.0.1", "100::1"], timeout=1.0)
    assert rtts["::1"] is not None and rtts["[::1]"] is not None and rtts["127.0.0.1"] is not None
    assert rtts["100::1"] is None
