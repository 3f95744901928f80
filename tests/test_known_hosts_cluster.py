"""Host-key decisions on the test cluster: for each known_hosts file, clusterctl accepts or refuses
a real node exactly when OpenSSH's client does (StrictHostKeyChecking=yes and accept-new).

The node runs its usual sshd on port 22 (one ed25519 host key), a second one on port 2222 with
that key and an RSA key, and a third on port 2223 that also offers a host certificate. OpenSSH
prefers a certificate whenever one is offered, and then decides by other rules (a certificate
without a matching @cert-authority falls back to the plain key looked up without the port), so
the table uses the sshds without one; the certificate's own test shows what clusterctl does."""

import base64
import hashlib
import hmac
import os
import shutil
import subprocess
import time

import pytest
import yaml

from orchestrator.inventory import parse_inventory
from orchestrator.transport import Cluster
from tests.cluster.sshd import render_config

pytestmark = pytest.mark.cluster


def hashed(name: str) -> str:
    salt = os.urandom(20)
    digest = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    return f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"


def keygen(path, kind="ed25519"):
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", "", "-f", str(path)], check=True)
    return " ".join(path.with_name(path.name + ".pub").read_text().split()[:2])


def start_sshd(cluster, nd, port, extra):
    d = nd.dir / f"sshd{port}"
    cfg = d / "sshd_config"
    cfg.write_text(render_config(address=nd.host, port=port, host_key=d / "ed25519", pid_file=d / "sshd.pid",
                                 user=cluster.user, bin_dir=nd.bin_dir, clock_skew=0) + extra)
    sshd = nd.popen(["/usr/sbin/sshd", "-D", "-f", str(cfg), "-E", str(d / "sshd.log")], as_user=False)
    deadline = time.monotonic() + 15
    while not (d / "sshd.pid").exists():
        assert sshd.poll() is None and time.monotonic() < deadline, (d / "sshd.log").read_text()
        time.sleep(0.01)
    return sshd


@pytest.fixture(scope="module")
def node():
    """One test node with two more sshds: port 2222 offers its ed25519 key and an RSA key, port
    2223 its ed25519 key and a host certificate for it, signed by a test CA."""
    from tests.cluster import TestCluster, require_root

    require_root()
    with TestCluster(n=1, gpus=0, name_prefix="cckh") as cluster:
        nd = cluster.nodes[0]
        for port in (2222, 2223):
            (nd.dir / f"sshd{port}").mkdir()
            shutil.copy(nd.host_key, nd.dir / f"sshd{port}" / "ed25519")
            shutil.copy(nd.host_key.with_name(nd.host_key.name + ".pub"), nd.dir / f"sshd{port}" / "ed25519.pub")
        rsa = keygen(nd.dir / "sshd2222" / "rsa", "rsa")
        ca = keygen(nd.dir / "ca")
        subprocess.run(["ssh-keygen", "-q", "-s", str(nd.dir / "ca"), "-I", nd.name, "-h", "-n", nd.host,
                        str(nd.dir / "sshd2223" / "ed25519.pub")], check=True, capture_output=True)
        sshds = [start_sshd(cluster, nd, 2222, f"HostKey {nd.dir / 'sshd2222' / 'rsa'}\n"),
                 start_sshd(cluster, nd, 2223, f"HostCertificate {nd.dir / 'sshd2223' / 'ed25519-cert.pub'}\n")]
        try:
            keys = {"H": nd.host, "E": " ".join(nd.host_key.with_name(nd.host_key.name + ".pub").read_text().split()[:2]),
                    "R": rsa, "X": keygen(nd.dir / "other"), "CA": ca, "NET": nd.host.rsplit(".", 1)[0],
                    "H?": nd.host[:-1] + "?"}
            yield cluster, nd, keys
        finally:
            for sshd in sshds:
                sshd.terminate()
                sshd.wait(10)


# (case, port, known_hosts text or None for a missing file, why StrictHostKeyChecking=yes refuses:
#  None where it accepts)
CASES = [
    ("plain", 22, "{H} {E}\n", None),
    ("plain among other hosts", 22, "10.9.9.9 {X}\n{H},node9 {E}\nnode9 {X}\n", None),
    ("hashed", 22, "{HASH} {E}\n", None),
    ("hashed, another host", 22, "{HASH_OTHER} {E}\n", "unknown"),
    ("ported entry, port 22", 22, "[{H}]:22 {E}\n", "unknown"),
    ("ported entry", 2222, "[{H}]:2222 {E}\n", None),
    ("hashed ported entry", 2222, "{HASH_2222} {E}\n", None),
    ("bare entry, port 2222", 2222, "{H} {E}\n", None),  # ssh retries without the port
    ("bare entry revoked, port 2222", 2222, "{H} {E}\n@revoked {H} {E}\n", "unknown"),
    ("bare entry with a wrong key, port 2222", 2222, "{H} {X}\n", "unknown"),
    ("ported entry with a wrong key, bare entry right", 2222, "[{H}]:2222 {X}\n{H} {E}\n", "changed"),
    ("wildcard *", 22, "{NET}.* {E}\n", None),
    ("wildcard ?", 22, "{H?} {E}\n", None),
    ("wildcard, ported", 2222, "[{NET}.*]:2222 {E}\n", None),
    ("wildcard and negation of the host", 22, "{NET}.*,!{H} {E}\n", "unknown"),
    ("negation of another host", 22, "*,!10.9.9.9 {E}\n", None),
    ("CIDR is not a pattern", 22, "{NET}.0/24 {E}\n", "unknown"),
    ("revoked", 22, "{H} {E}\n@revoked {H} {E}\n", "revoked"),
    ("revoked by wildcard first", 22, "@revoked * {E}\n{H} {E}\n", "revoked"),
    ("revoked, indented", 22, "{H} {E}\n   @revoked {H} {E}\n", "revoked"),
    ("revoked for another host only", 22, "{H} {E}\n@revoked 10.9.9.9 {E}\n", None),
    ("revoked another key", 22, "{H} {E}\n@revoked {H} {X}\n", None),
    ("cert-authority, no host certificate", 22, "@cert-authority * {CA}\n", "ca"),
    ("cert-authority and the plain key", 22, "@cert-authority * {CA}\n{H} {E}\n", None),
    ("wrong key", 22, "{H} {X}\n", "changed"),
    ("wrong key, then the right one", 22, "{H} {X}\n{H} {E}\n", None),
    ("two key types, only rsa listed", 2222, "[{H}]:2222 {R}\n", None),
    ("two key types, both listed", 2222, "[{H}]:2222 {R}\n[{H}]:2222 {E}\n", None),
    ("two key types, wrong ed25519 and right rsa", 2222, "[{H}]:2222 {X}\n[{H}]:2222 {R}\n", "changed"),
    ("comments and blank lines", 22, "# nodes\n\n   \n\t# {H} {X}\n{H} {E} a comment\n", None),
    ("marker-only lines", 22, "@revoked\n@cert-authority\n@revoked {H}\n{H} {E}\n", None),
    ("unknown marker", 22, "@trusted {H} {E}\n", "unknown"),
    ("damaged line, then the key", 22, "{H} ssh-ed25519 !!notbase64!!\n{H}\n{H} {E}\n", None),
    ("empty file", 22, "", "unknown"),
    ("missing file", 22, None, "unknown"),
]


def fill(text, keys):
    subs = dict(keys, HASH=hashed(keys["H"]), HASH_OTHER=hashed("10.9.9.9"),
                HASH_2222=hashed(f"[{keys['H']}]:2222"))
    for k in sorted(subs, key=len, reverse=True):
        text = text.replace("{" + k + "}", subs[k])
    return text


def openssh_accepts(cluster, nd, port, known_hosts, strict):
    p = subprocess.run(
        ["ssh", "-F", "/dev/null", "-i", str(cluster.identity_file), "-o", "IdentitiesOnly=yes",
         "-o", "BatchMode=yes", "-o", f"StrictHostKeyChecking={strict}", "-o", "UpdateHostKeys=no",
         "-o", f"UserKnownHostsFile={known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null",
         "-o", "ConnectTimeout=5", "-p", str(port), f"{cluster.user}@{nd.host}", "true"],
        capture_output=True, text=True, timeout=30)
    assert p.returncode in (0, 255), p.stderr
    return p.returncode == 0, p.stderr


def clusterctl_accepts(cluster, nd, port, known_hosts, accept_new):
    inv = parse_inventory(yaml.safe_dump(cluster.inventory(
        ssh={**cluster.inventory()["ssh"], "port": port, "known_hosts": str(known_hosts)})), "<t>")
    with Cluster(inv, accept_new_host_keys=accept_new) as c:
        if nd.name in c.connections:
            assert c.run("true").all_ok
            return True, ""
        return False, c.unreachable[nd.name].error


@pytest.mark.parametrize("strict", ["yes", "accept-new"])
@pytest.mark.parametrize("case,port,text,refusal", CASES, ids=[c[0] for c in CASES])
def test_clusterctl_decides_like_openssh(node, tmp_path, case, port, text, refusal, strict):
    cluster, nd, keys = node
    new_key = refusal in ("unknown", "ca")  # accept-new records and accepts it
    if strict == "accept-new" and new_key:
        refusal = None
    accepted = refusal is None
    files = {}
    for who in ("ssh", "clusterctl"):
        files[who] = tmp_path / who / "known_hosts"
        files[who].parent.mkdir()
        if text is not None:
            files[who].write_text(fill(text, keys))
    by_ssh, ssh_err = openssh_accepts(cluster, nd, port, files["ssh"], strict)
    by_us, our_err = clusterctl_accepts(cluster, nd, port, files["clusterctl"], strict == "accept-new")
    assert by_ssh == accepted, f"OpenSSH: {ssh_err}"
    assert by_us == accepted, f"clusterctl: {our_err}"
    assert "Traceback" not in our_err
    if refusal == "revoked":  # every refusal is one paragraph that says why
        assert "REVOKED HOST KEY" in our_err and "@revoked" in our_err
    elif refusal == "changed":
        assert "HAS CHANGED" in our_err
    elif refusal == "ca":
        assert "not supported" in our_err and "line 1 names a @cert-authority" in our_err
    elif refusal == "unknown":
        assert "unknown host key" in our_err and "ssh-keyscan" in our_err
    if strict == "accept-new" and new_key:  # both recorded the key; it is trusted now
        for who in ("ssh", "clusterctl"):
            assert keys["E"].split()[1] in files[who].read_text()
        assert clusterctl_accepts(cluster, nd, port, files["clusterctl"], False)[0]
        assert openssh_accepts(cluster, nd, port, files["clusterctl"], "yes")[0]


def test_host_certificate_is_refused_by_name_where_openssh_accepts_it(node, tmp_path):
    """clusterctl does not verify host certificates (paramiko negotiates the plain key): a node
    known only through @cert-authority is refused with a message naming the line."""
    cluster, nd, keys = node
    kh = tmp_path / "known_hosts"
    kh.write_text(fill("# CA\n@cert-authority [{NET}.*]:2223 {CA}\n", keys))
    assert openssh_accepts(cluster, nd, 2223, kh, "yes")[0]
    ok, err = clusterctl_accepts(cluster, nd, 2223, kh, False)
    assert not ok
    assert f"{kh}; its line 2 names a @cert-authority" in err and "not supported" in err
    assert f"ssh-keyscan -p 2223 -t ssh-ed25519 {nd.host} >> {kh}" in err


def test_preflight_refuses_a_revoked_key_in_one_paragraph(node, tmp_path, capsys):
    """The reported case: a known_hosts listing the node's key and also @revoked-ing it."""
    from orchestrator.cli import main

    cluster, nd, keys = node
    kh = tmp_path / "known_hosts"
    kh.write_text(fill("{H} {E}\n@revoked {H} {E}\n", keys))
    inv = cluster.write_inventory(tmp_path / "nodes.yaml",
                                  ssh={**cluster.inventory()["ssh"], "known_hosts": str(kh)})
    rc = main(["preflight", "-i", str(inv), "--only", "ssh"])
    out, err = capsys.readouterr()
    assert rc != 0 and "preflight ok" not in out + err, (rc, out, err)
    assert "REVOKED HOST KEY" in out + err and "Traceback" not in out + err
