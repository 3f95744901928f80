"""ProxyJump hops with a bracketed IPv6 host and a port (`[fe80::1%eth0]:22`): parsed by one rule
(inventory/hosts.py split_hop) for the inventory's ssh.proxy_jump and for an ssh_config's ProxyJump
(fabric would read `[::1]:22` as a host name), used to connect, and refused with exit 2 in one
sentence where it cannot be used (a link-local address without its interface). Once this ended in
a Python traceback (`int(':1]:22')`)."""

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.errors import EXIT_UNREACHABLE, EXIT_USAGE
from orchestrator.inventory.hosts import split_hop, unbracket


@pytest.mark.parametrize("hop, want", [
    ("[fe80::1%eth0]:22", (None, "[fe80::1%eth0]", "22")),
    ("bob@[::1]:2222", ("bob", "[::1]", "2222")),
    ("[::1]", (None, "[::1]", None)),
    ("j@bastion:2200", ("j", "bastion", "2200")),
    ("bastion", (None, "bastion", None)),
])
def test_a_hop_splits_into_user_host_and_port(hop, want):
    assert split_hop(hop) == want
    assert unbracket(want[1]) == want[1].strip("[]")


def inventory(tmp_path, **ssh):
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump({"ssh": {"connect_timeout": 2, **ssh},
                                    "nodes": [{"name": "n1", "host": "192.0.2.10"}]}))
    return str(path)


def one_paragraph(err: str) -> str:
    assert "Traceback" not in err and "internal error" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_a_link_local_hop_without_its_interface_is_refused_in_one_sentence(tmp_path, capsys):
    assert main(["exec", "-i", inventory(tmp_path, proxy_jump="[fe80::1]:22"), "--", "true"]) == EXIT_USAGE
    err = one_paragraph(capsys.readouterr().err)
    assert "nodes.yaml:6: ssh.proxy_jump: '[fe80::1]:22'" in err and "as in [fe80::1%eth0]" in err


def test_an_ssh_config_proxyjump_is_parsed_here_or_refused_with_exit_2(tmp_path, capsys):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host 192.0.2.10\n  ProxyJump [fe80::1]:22\n")
    assert main(["exec", "-i", inventory(tmp_path, config_file=str(cfg)), "--", "true"]) == EXIT_USAGE
    err = one_paragraph(capsys.readouterr().err)
    assert "n1: the ssh config's ProxyJump cannot be used: '[fe80::1]:22'" in err


@pytest.mark.parametrize("where", ["inventory", "ssh_config"])
def test_a_bracketed_ipv6_hop_with_a_port_is_used(tmp_path, capsys, where):
    """Nothing listens on [::1]:9 (discard): the connect is refused there, and the message names
    that hop, not the node behind it."""
    if where == "inventory":
        inv = inventory(tmp_path, proxy_jump="[::1]:9")
    else:
        cfg = tmp_path / "ssh_config"
        cfg.write_text("Host 192.0.2.10\n  ProxyJump [::1]:9\n")
        inv = inventory(tmp_path, config_file=str(cfg))
    assert main(["exec", "-i", inv, "--", "true"]) == EXIT_UNREACHABLE
    err = one_paragraph(capsys.readouterr().err)
    assert "connect to host ::1 port 9: Connection refused" in err, err
