"""Values at the edge of what the inventory accepts: node ranges, host names and IP literals,
ports. Each refusal exits 2 with one sentence that names file:line, the key and the value; each
valid form next to it still loads."""

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.errors import EXIT_USAGE, InventoryError
from orchestrator.inventory import parse_hostfile, parse_inventory
from orchestrator.inventory.ansible import ansible_to_yaml

NODES = "nodes:\n  - {name: a, host: h1}\n"


def _err(text: str) -> InventoryError:
    with pytest.raises(InventoryError) as ei:
        parse_inventory(text, "bad.yaml")
    return ei.value


def _refused(text: str, line: int, *needles: str) -> str:
    """The first sentence of the refusal holds every needle; a range of bad hosts may add one
    indented line per further node, as any list of validation errors does."""
    e = _err(text)
    first, *more = str(e).split("\n")
    for needle in needles:
        assert needle in first, str(e)
    assert e.line == line and first.startswith(f"bad.yaml:{line}: "), str(e)
    assert e.exit_code == EXIT_USAGE and len(first) < 400 and first.isprintable(), str(e)
    assert all(m.startswith("  bad.yaml:") and m.isprintable() for m in more), str(e)
    return first


def host(value: str, key: str = "host") -> str:
    other = "" if key == "host" else ", host: h1"
    return f"nodes:\n  - {{name: a{other}, {key}: '{value}'}}\n"


def rng(name: str, host: str = "'{name}'", address: str | None = None) -> str:
    return f"nodes:\n  - name: {name}\n    host: {host}\n" + (f"    address: {address}\n" if address else "")


# ---------------------------------------------------------------- node ranges


@pytest.mark.parametrize("text,line,needles", [
    (rng("n[-1-3]"), 2, ["nodes[0].name 'n[-1-3]'", "'-1-3' holds a negative number"]),
    (rng("n[1--3]"), 2, ["nodes[0].name 'n[1--3]'", "negative number"]),
    # NodeSet itself reads these as n-3, n-2, ...
    (rng("n[-3--1]"), 2, ["'-3--1' holds a negative number"]),
    (rng("n[-1]"), 2, ["'-1' holds a negative number"]),
    (rng("n[1,-2]"), 2, ["'-2' holds a negative number"]),
    (rng("x[-5-5/5]"), 2, ["'-5-5/5' holds a negative number"]),
    (rng("n[5-2]"), 2, ["nodes[0].name 'n[5-2]'", "5-2 runs backwards", "2-5"]),
    (rng("n[08-02]"), 2, ["08-02 runs backwards", "02-08"]),
    (rng("n[1,5-2]"), 2, ["5-2 runs backwards"]),
    (rng("n[1-3/0]"), 2, ["the step in '1-3/0' is 0"]),
    (rng("n[1-2]-[3-1]"), 2, ["3-1 runs backwards"]),
    (rng("n[1-3]", host="10.0.0.[-1-1]"), 3, ["nodes[0].host '10.0.0.[-1-1]'", "negative number"]),
    (rng("n[1-3]", host="10.0.0.[5-3]"), 3, ["nodes[0].host '10.0.0.[5-3]'", "5-3 runs backwards"]),
    (rng("n[1-3]", address="10.0.0.[3-1]"), 4, ["nodes[0].address '10.0.0.[3-1]'", "runs backwards"]),
    (rng("n[x-y]"), 2, ["'x-y' is not a number or a range"]),
    (rng("'n[1,]'"), 2, ["is empty"]),
    # a range of hosts is checked host by host once expanded
    (rng("n[1-3]", host="10.0.0.[254-256]"), 3, ["nodes[2].host: '10.0.0.256'", "octet 256 is over 255"]),
    (rng("n[1-3]", host="10.0.0.[08-10]"), 3, ["nodes[0].host: '10.0.0.08'", "leading zero"]),
])
def test_bad_node_ranges_are_refused(text, line, needles):
    _refused(text, line, *needles)


def test_good_node_ranges_still_expand():
    inv = parse_inventory(rng("n[0-2]", host="10.0.0.[0-2]"))
    assert [(n.name, n.host) for n in inv.nodes] == [("n0", "10.0.0.0"), ("n1", "10.0.0.1"), ("n2", "10.0.0.2")]
    inv = parse_inventory(rng("gpu[01-08/2,10]", host="'{name}.cluster'"))
    assert [n.host for n in inv.nodes] == ["gpu01.cluster", "gpu03.cluster", "gpu05.cluster", "gpu07.cluster",
                                          "gpu10.cluster"]
    assert [n.name for n in parse_inventory(rng("n[3-3]")).nodes] == ["n3"]


def test_many_long_host_refusals_stay_one_short_paragraph():
    """Found by the fuzzer: ten host refusals that each say why made a 2,177-byte message."""
    text = "nodes:\n" + "".join(f"  - {{name: n{i}, host: '10.9.0.{i}10.9.0.{i}'}}\n" for i in range(40))
    msg = str(_err(text))
    assert len(msg) < 1800 and "more" in msg.splitlines()[-1], msg
    assert msg.count("\n") < 10 and all(line.isprintable() for line in msg.splitlines()), msg


def test_nodes_option_refuses_a_backwards_range(tmp_path, capsys):
    p = tmp_path / "inv.yaml"
    p.write_text(rng("n[1-3]").replace("host: '{name}'", "connection: local"))
    assert main(["inventory", "check", "-i", str(p), "--nodes", "n[3-1]"]) == EXIT_USAGE
    assert "3-1 runs backwards" in capsys.readouterr().err


# ---------------------------------------------------------------- hosts and addresses

LONG_NAME = ".".join(["a" * 63] * 3 + ["b" * 61])  # 253 characters
assert len(LONG_NAME) == 253


@pytest.mark.parametrize("key", ["host", "address"])
@pytest.mark.parametrize("value,needle", [
    # length: a name, a label
    (LONG_NAME + "c", "254 characters long, and a host name or address is at most 253"),
    ("x" * 300, "300 characters long"),
    ("a" * 64 + ".example", "is 64 characters, and a label is at most 63"),
    # characters
    ("h1 && reboot", "it holds ' '"),
    ("-oProxyCommand=x", "it holds '='"),
    ("h$x", "it holds '$'"),
    ("a/b", "it holds '/'"),
    ("*.example", "it holds '*'"),
    ("bücher.example", "xn-- form"),
    ("a..b", "empty label"),
    (".a", "empty label"),
    ("-a", "label '-a' starts or ends with '-'"),
    ("a-.example", "label 'a-' starts or ends with '-'"),
    ("user@h1", "write the user as ssh.user"),
    ("h1:22", "a port goes in ssh.port"),
    # brackets are for IPv6 only; IPv6 must be an address
    ("[1.2.3.4]", "brackets hold only an IPv6 address"),
    ("[h1", "brackets hold only an IPv6 address"),
    ("[::1", "brackets hold only an IPv6 address"),
    (":::", "is not an IPv6 address"),
    ("1::2::3", "is not an IPv6 address"),
    ("fe80::1%eth 0", "scope after '%'"),
    ("fe80::1%", "scope after '%'"),
    ("::ffff:010.0.0.1", "is not an IPv6 address"),
    # dotted quads: leading zeros, octets, and names inet_aton would read as an address
    ("010.0.0.1", "octet '010' has a leading zero, which some tools read as octal; write 10.0.0.1"),
    ("10.0.0.01", "octet '01' has a leading zero"),
    ("10.0.0.256", "octet 256 is over 255"),
    ("999.1.1.1", "octet 999 is over 255"),
    ("1.2.3", "not four decimal octets"),
    ("1.2.3.4.5", "not four decimal octets"),
    ("10.0.0.1.", "not four decimal octets"),
    ("123", "not four decimal octets"),
    ("0x7f.1", "not four decimal octets"),
    ("0x0a000001", "not four decimal octets"),
    # addresses that name no one host
    ("0.0.0.0", "is the unspecified address"),
    ("::", "is the unspecified address"),
    ("[::]", "is the unspecified address"),
    ("::ffff:0.0.0.0", "is the unspecified address"),
    ("255.255.255.255", "is the broadcast address"),
    ("224.0.0.1", "is a multicast address"),
    ("ff02::1%eth0", "is a multicast address"),
])
def test_bad_hosts_and_addresses_are_refused(key, value, needle):
    _refused(host(value, key), 2, f"nodes[0].{key}: ", "is not a valid host name or address", needle)


@pytest.mark.parametrize("value", [
    "h1", "gpu-01.cluster.local", "node_1", "_svc.example", "h1.", "GPU01", "a" * 63, LONG_NAME, "1a.example",
    "10.0.0.1", "192.168.1.100",
    "::1", "[::1]", "fe80::1%eth0", "[fe80::1%eth0]", "::ffff:10.0.0.1", "2001:db8::8a2e:370:7334",
])
@pytest.mark.parametrize("key", ["host", "address"])
def test_valid_hosts_and_addresses_still_load(key, value):
    n = parse_inventory(host(value, key)).nodes[0]
    assert getattr(n, key) == value


def test_hostfile_hosts_follow_the_same_rules():
    with pytest.raises(InventoryError, match=r"hf:2: '010\.0\.0\.2' is not a valid host name or address: octet"):
        parse_hostfile("10.0.0.1 slots=1\n010.0.0.2 slots=1\n", "hf")
    with pytest.raises(InventoryError, match="hf:1: .* label"):
        parse_hostfile("x" * 64 + ".example slots=1\n", "hf")
    assert [n["host"] for n in parse_hostfile("gpu-1 slots=8\n10.0.0.3\n::1\n")] == ["gpu-1", "10.0.0.3", "::1"]


def test_a_trailing_newline_is_not_a_name():
    """`$` in a pattern matches before a final newline, and YAML keeps one in "bob\\n"."""
    for text, needle in [
        ('ssh: {user: "bob\\n"}\n' + NODES, "ssh.user: 'bob\\n' is not a valid user name"),
        ('nodes:\n  - {name: "a\\n", host: h1}\n', "nodes[0].name: 'a\\n' is not a valid node name"),
        ('nodes:\n  - {name: a, host: "h1\\n"}\n', "nodes[0].host: 'h1\\n' is not a valid host"),
        ('nodes:\n  - {name: a, host: h1, iface: "eth0\\n"}\n', "nodes[0].iface"),
        ('env: {"A\\n": x}\n' + NODES, "environment variable name 'A\\n'"),
        ('train: {module: "m\\n"}\n' + NODES, "train.module"),
        ('setup: {requirements: r.txt, venv: ~/v, python_version: "3.11\\n"}\n' + NODES, "setup.python_version"),
    ]:
        assert needle in str(_err(text)), text


# ---------------------------------------------------------------- ports

PORT_AT = {  # where a port is written -> (text with PORT for the port, line, key)
    "master_port": ("master_port: PORT\n" + NODES, 1, "master_port"),
    "ssh.port": ("ssh: {port: PORT}\n" + NODES, 1, "ssh.port"),
    "node ssh.port": ("nodes:\n  - {name: a, host: h1}\n  - {name: b, host: h2, ssh: {port: PORT}}\n", 3,
                      "nodes[1].ssh.port"),
    "range ssh.port": ("nodes:\n  - name: n[1-2]\n    host: '{name}'\n    ssh:\n      port: PORT\n", 5,
                       "nodes[0].ssh.port"),
}


@pytest.mark.parametrize("where", list(PORT_AT))
@pytest.mark.parametrize("written,needle", [
    ("0x50", "'0x50' is not a port (YAML reads it as 80)"),
    ("0o777", "'0o777' is not a port"),
    ("0777", "'0777' is not a port (YAML reads it as 511)"),
    ("022", "'022' is not a port (YAML reads it as 18)"),
    ("0b101", "'0b101' is not a port (YAML reads it as 5)"),
    ("1_000", "'1_000' is not a port (YAML reads it as 1000)"),
    ("+22", "'+22' is not a port (YAML reads it as 22)"),
    ("1:30", "'1:30' is not a port (YAML reads it as 90)"),
    ("-22", "'-22' is not a port"),
    ("22.0", "'22.0' is not a port"),
    ("2.2e1", "'2.2e1' is not a port"),
    (".inf", "'.inf' is not a port"),
    ("true", "'true' is not a port"),
    ("no", "'no' is not a port"),
    ("ssh", "'ssh' is not a port"),
    ("0", "'0' is not a port: a port is a decimal number from 1 to 65535"),
    ("65536", "65536 is not a port"),
    ("99999", "99999 is not a port"),
    ("'22'", "'22' is quoted, so it is text and not a port"),
    ('" 22"', "' 22' is quoted"),
])
def test_ports_are_decimal_from_1_to_65535(where, written, needle):
    text, line, key = PORT_AT[where]
    _refused(text.replace("PORT", written), line, f"{key}: {needle}")


@pytest.mark.parametrize("where", list(PORT_AT))
@pytest.mark.parametrize("written", ["1", "22", "2222", "29500", "65535"])
def test_decimal_ports_still_load(where, written):
    text, _, _ = PORT_AT[where]
    inv = parse_inventory(text.replace("PORT", written))
    got = inv.master_port if where == "master_port" else inv.nodes[-1].ssh.port
    assert got == int(written)


def test_a_port_through_an_alias_or_merge_is_checked_where_it_is_written():
    _refused("env: {A: &p 0x16}\nmaster_port: *p\n" + NODES, 1, "master_port: '0x16' is not a port")
    _refused("train: {env: &s {port: 0x16}}\nnodes:\n  - {name: a, host: h1, ssh: {<<: *s}}\n", 1,
             "nodes[0].ssh.port: '0x16' is not a port")
    inv = parse_inventory("nodes:\n  - {name: a, host: h1, ssh: &s {port: 2222}}\n"
                          "  - {name: b, host: h2, ssh: {<<: *s, user: bob}}\n")
    assert [n.ssh.port for n in inv.nodes] == [2222, 2222]


def test_an_unset_ssh_port_is_still_the_default():
    assert parse_inventory("ssh: {port: null}\n" + NODES).nodes[0].ssh.port is None


# ---------------------------------------------------------------- ProxyJump hops


@pytest.mark.parametrize("value,needle", [
    ("jump:0x16", "'0x16' is not a port"),
    ("jump:+22", "'+22' is not a port"),
    ("jump:022", "'022' is not a port"),
    ("jump:0", "'0' is not a port"),
    ("jump:70000", "70000 is not a port"),
    ("jump:", "'' is not a port"),
    ("010.0.0.1", "octet '010' has a leading zero"),
    ("bob@10.0.0.256:22", "octet 256 is over 255"),
    ("a,,b", "a hop names no host"),
    ("j1,bob@-j2", "in hop 'bob@-j2'"),
    ("$(id)@jump", "'$(id)' is not a valid user name"),
    ("a@b@jump", "'a@b' is not a valid user name"),
    ("[::1]x", "after ']' comes ':port' or nothing"),
    ("[10.0.0.1]:22", "brackets hold only an IPv6 address"),
    ("j;ls", "it holds ';'"),
])
def test_bad_proxy_jumps_are_refused(value, needle):
    _refused(f"ssh: {{proxy_jump: '{value}'}}\n" + NODES, 1, "ssh.proxy_jump: ", "is not a valid ProxyJump", needle)


@pytest.mark.parametrize("value", ["bastion", "bob@bastion", "bob@bastion:2222", "10.0.0.1:22",
                                   "j1,bob@j2:2200,[fe80::1%eth0]:22", "[::1]", "none"])
def test_valid_proxy_jumps_still_load(value):
    assert parse_inventory(f"ssh: {{proxy_jump: '{value}'}}\n" + NODES).nodes[0].ssh.proxy_jump == value


# ---------------------------------------------------------------- Ansible ports


@pytest.mark.parametrize("port", ["+22", "0x16", "1_000", "022", "0", "70000", "twenty"])
def test_ansible_ports_are_decimal_too(port):
    with pytest.raises(InventoryError, match="gpu1: ansible_port .* is not a port"):
        ansible_to_yaml(f"[gpus]\ngpu1 ansible_host=10.0.0.1 ansible_port={port}\n", "hosts.ini")


def test_ansible_decimal_ports_still_import():
    text = ansible_to_yaml("[gpus]\ngpu1 ansible_host=10.0.0.1 ansible_port=2222\n", "hosts.ini")
    assert parse_inventory(text).nodes[0].ssh.port == 2222


# ---------------------------------------------------------------- through the CLI


@pytest.mark.parametrize("text,needle", [
    (rng("n[5-2]"), "5-2 runs backwards"),
    ("master_port: 0x50\n" + NODES, "master_port: '0x50' is not a port"),
    (host("010.0.0.1"), "nodes[0].host: '010.0.0.1'"),
])
def test_the_cli_exits_2_with_one_line(tmp_path, capsys, text, needle):
    p = tmp_path / "inv.yaml"
    p.write_text(text)
    assert main(["inventory", "check", "-i", str(p)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and f"{p}:" in err and "Traceback" not in err, err


@pytest.mark.parametrize("first,second", [
    ("n1", "n1."), ("gpu1.cluster", "GPU1.Cluster."), ("10.82.0.11", "::ffff:10.82.0.11"),
    ("10.82.0.11", "[::ffff:10.82.0.11]"), ("fe80::1%eth0", "fe80:0:0:0:0:0:0:1%eth0"),
    ("2001:db8::1", "[2001:0db8:0000::0001]"),
])
def test_one_host_spelled_two_ways_is_a_duplicate(first, second):
    doc = {"nodes": [{"name": "a", "host": first}, {"name": "b", "host": second}]}
    with pytest.raises(InventoryError) as e:
        parse_inventory(yaml.safe_dump(doc), "inv.yaml")
    assert f"duplicate host {second!r} (port 22) for node 'b': already used by node 'a' (written {first!r} " \
           "there); one node per host" in str(e.value)
    doc["nodes"][1]["ssh"] = {"port": 2222}  # another sshd on the same machine: two nodes
    assert len(parse_inventory(yaml.safe_dump(doc), "inv.yaml").nodes) == 2


@pytest.mark.parametrize("name,needle", [
    ("gpu[1-3]!gpu2", "'!' is a ClusterShell set operator"),
    ("gpu[1-3]&gpu[2-5]", "'&' is a ClusterShell set operator"),
    ("gpu[1-3]^gpu2", "'^' is a ClusterShell set operator"),
    ("n[ 1-3 ]", "it holds white space"),
    ("n[1 - 3]", "it holds white space"),
    ("[1-3]", "a bracket needs a name in front of it"),
    ("a[1-2],[3-4]", "a bracket needs a name in front of it"),
])
def test_ranges_that_nodeset_reads_but_an_inventory_refuses(name, needle):
    with pytest.raises(InventoryError) as e:
        parse_inventory(yaml.safe_dump({"nodes": [{"name": name, "host": "{name}.x"}]}), "inv.yaml")
    assert "nodes[0].name" in str(e.value) and needle in str(e.value), str(e.value)
