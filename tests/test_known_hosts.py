"""known_hosts matching and the host-key decision, on real key objects and files (no server:
tests/test_known_hosts_cluster.py compares the same decisions with OpenSSH's on a real node)."""

import base64

import paramiko
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from orchestrator.errors import HostKeyError
from orchestrator.transport import known_hosts
from orchestrator.transport.known_hosts import _HostKeyPolicy, host_entries, known_host_keys


def pub(kind="ed25519"):
    key = ed25519.Ed25519PrivateKey.generate() if kind == "ed25519" else \
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                         serialization.PublicFormat.OpenSSH).decode()


def pkey(line):
    kind, b64 = line.split()[:2]
    return paramiko.PKey.from_type_string(kind, base64.b64decode(b64))


def decide(kh, name, key, accept_new=False, port=22):
    """None when accepted, else the exception the policy raises."""
    try:
        _HostKeyPolicy("n1", port, host_entries(kh, name), accept_new).missing_host_key(None, name, pkey(key))
    except (HostKeyError, paramiko.BadHostKeyException) as e:
        return e
    return None


def test_names_match_like_openssh(tmp_path):
    a, b, c = pub(), pub(), pub()
    kh = tmp_path / "known_hosts"
    kh.write_text(f"GPU-Node1 {a}\n10.0.0.0/8,node2 {b}\n,node3 {c}\n")
    assert [k.get_base64() for k in known_host_keys(kh, "gpu-node1")] == [a.split()[1]]  # no case
    assert known_host_keys(kh, "10.1.2.3") == []  # `/` is no CIDR block in known_hosts
    assert [k.get_base64() for k in known_host_keys(kh, "node2")] == [b.split()[1]]
    assert known_host_keys(kh, "other") == []  # an empty pattern matches no host
    assert [k.get_base64() for k in known_host_keys(kh, "node3")] == [c.split()[1]]


def test_the_file_is_parsed_once_per_change_and_each_host_gets_its_own_keys(tmp_path):
    keys = [pub() for _ in range(256)]
    kh = tmp_path / "known_hosts"
    kh.write_text("".join(f"10.0.{i // 200}.{i % 200} {k}\n" for i, k in enumerate(keys)))
    parsed = known_hosts._load(kh)
    for i in range(0, 256, 17):
        e = host_entries(kh, f"10.0.{i // 200}.{i % 200}")
        assert [paramiko.PKey.from_type_string("ssh-ed25519", b).get_base64() for b in e.keys] == \
            [keys[i].split()[1]]
    assert known_hosts._load(kh) is parsed  # not parsed again
    with open(kh, "a") as f:
        f.write(f"10.9.9.9 {keys[0]}\n")
    assert known_hosts._load(kh) is not parsed  # a changed file is read again
    assert len(host_entries(kh, "10.9.9.9").keys) == 1


def test_revoked_wins_over_a_listed_key_and_names_the_line(tmp_path):
    a = pub()
    kh = tmp_path / "known_hosts"
    kh.write_text(f"node1 {a}\n# old key\n@revoked * {a}\n")
    e = decide(kh, "node1", a)
    assert isinstance(e, HostKeyError) and "REVOKED HOST KEY" in str(e) and f"{kh} line 3" in str(e)
    assert isinstance(decide(kh, "node1", a, accept_new=True), HostKeyError)  # accept-new too
    assert "node1" not in kh.read_text().splitlines()[-1]  # and nothing was appended


def test_changed_key_of_any_type_is_a_changed_key(tmp_path):
    a, b, r = pub(), pub(), pub("rsa")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"node1 {b}\nnode2 {r}\nnode3 {b}\nnode3 {a}\n")
    assert isinstance(decide(kh, "node1", a, accept_new=True), paramiko.BadHostKeyException)
    assert isinstance(decide(kh, "node2", a), paramiko.BadHostKeyException)  # ssh: "changed" too
    assert decide(kh, "node3", a) is None  # another line of the same type lists it


def test_ported_name_falls_back_to_the_bare_host_only_when_new(tmp_path):
    a, b = pub(), pub()
    kh = tmp_path / "known_hosts"
    kh.write_text(f"node1 {a}\n[node2]:2222 {b}\nnode2 {a}\n")
    assert decide(kh, "[node1]:2222", a, port=2222) is None
    assert isinstance(decide(kh, "[node2]:2222", a, port=2222), paramiko.BadHostKeyException)
    e = decide(kh, "[node3]:2222", a, port=2222)
    assert "ssh-keyscan -p 2222 -t ssh-ed25519 node3" in str(e)


def test_unknown_key_remedy_cert_authority_and_accept_new(tmp_path):
    a, ca = pub(), pub()
    kh = tmp_path / "sub" / "known_hosts"
    kh.parent.mkdir()
    kh.write_text(f"# CA for the cluster\n@cert-authority *.cluster {ca}\n")
    e = decide(kh, "gpu1.cluster", a)
    assert "line 2 names a @cert-authority" in str(e) and "not supported" in str(e)
    assert f"ssh-keyscan -t ssh-ed25519 gpu1.cluster >> {kh}" in str(e)
    e = decide(kh, "gpu1", a)
    assert "unknown host key for gpu1" in str(e) and "cert-authority" not in str(e)
    assert decide(kh, "gpu1", a, accept_new=True) is None
    assert kh.read_text().splitlines()[-1] == f"gpu1 {a}"
    assert decide(kh, "gpu1", a) is None  # recorded, so known from now on


def test_handshake_uses_a_key_type_the_file_lists(tmp_path):
    r, a = pub("rsa"), pub()
    kh = tmp_path / "known_hosts"
    kh.write_text(f"node1 {r}\nnode2 {r}\nnode2 {a}\nnode3 ssh-foo AAAA\n")
    disabled = host_entries(kh, "node1").disabled_algorithms()["keys"]
    assert "ssh-ed25519" in disabled and "rsa-sha2-512" not in disabled and "rsa-sha2-256" not in disabled
    disabled = host_entries(kh, "node2").disabled_algorithms()["keys"]
    assert "ssh-ed25519" not in disabled and "rsa-sha2-256" not in disabled
    assert "ecdsa-sha2-nistp256" in disabled
    assert host_entries(kh, "node3").disabled_algorithms() == {}  # nothing known: no restriction
    assert host_entries(tmp_path / "missing", "node1").disabled_algorithms() == {}


@pytest.mark.parametrize("line", ["@revoked", "@cert-authority node1", "@bogus node1 {a}", "|1|bad|hash {a}",
                                  "node1", "node1 ssh-ed25519", "   # node1 {a}"])
def test_lines_openssh_skips_are_skipped(tmp_path, line):
    a, b = pub(), pub()
    kh = tmp_path / "known_hosts"
    kh.write_text(line.format(a=a) + f"\nnode1 {b}\n")
    assert [k.get_base64() for k in known_host_keys(kh, "node1")] == [b.split()[1]]
