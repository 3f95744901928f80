"""The fan-out engine over `connection: local` nodes (no root, no SSH needed)."""

import json
import subprocess
import sys
import threading

import pytest

from orchestrator import shell
from orchestrator.cli import main
from orchestrator.inventory import parse_inventory
from orchestrator.transport import Cluster, ClusterResult, NodeResult


def local_inv(n=3):
    nodes = "\n".join(f"  - {{name: n{i}, connection: local, gpus: 0}}" for i in range(n))
    return parse_inventory(f"nodes:\n{nodes}\n")


def test_run_collects_per_node_results_and_exit_codes():
    with Cluster(local_inv(3)) as c:
        r = c.run(lambda node: f"echo out-{node.name}; echo err-{node.name} >&2; exit {node.rank}")
    assert list(r) == ["n0", "n1", "n2"]
    assert r["n1"].stdout == "out-n1\n" and r["n1"].stderr == "err-n1\n"
    assert [x.exit_code for x in r.values()] == [0, 1, 2]
    assert list(r.ok) == ["n0"] and list(r.failed) == ["n1", "n2"]
    assert r.worst_exit_code == 2


def test_lines_are_never_torn_or_merged_under_bursts():
    # every node writes 20k lines in odd-sized chunks with no newline alignment, on both streams
    script = (
        "import sys,os\n"
        "name=sys.argv[1]\n"
        "buf=''.join(f'{name} line {i} ' + 'x'*(i%37) + '\\n' for i in range(20000))\n"
        "i=0\n"
        "while i < len(buf):\n"
        "    os.write(1, buf[i:i+997].encode()); os.write(2, buf[i:i+13].encode()[:0]); i+=997\n"
        "os.write(2, b'tail-without-newline')\n"
    )
    seen = {}
    lock = threading.Lock()

    def on_line(node, stream, line):
        with lock:
            seen.setdefault((node, stream), []).append(line)

    with Cluster(local_inv(4)) as c:
        r = c.run(lambda n: f"{sys.executable} -c {shell.quote(script)} {n.name}", on_line=on_line,
                  capture=False)
    assert r.all_ok, r
    for i in range(4):
        lines = seen[(f"n{i}", "stdout")]
        assert len(lines) == 20000
        assert all(ln == f"n{i} line {k} " + "x" * (k % 37) for k, ln in enumerate(lines))
        assert seen[(f"n{i}", "stderr")] == ["tail-without-newline"]


def test_timeout_kills_and_reports_the_node_others_finish():
    with Cluster(local_inv(2)) as c:
        r = c.run(lambda n: "sleep 30" if n.rank == 1 else "echo fine", timeout=1.0)
    assert r["n0"].ok
    assert r["n1"].exit_code is None and "timed out after 1s" in r["n1"].error
    assert r.worst_exit_code == 255


def test_fanout_caps_concurrency(tmp_path):
    # each command counts the live markers of its peers while it runs
    live, out = tmp_path / "live", tmp_path / "out"
    live.mkdir(), out.mkdir()
    cmd = f"touch {live}/$$; sleep 0.3; ls {live} | wc -l > {out}/$$; rm {live}/$$"
    with Cluster(local_inv(6), fanout=2) as c:
        r = c.run(cmd)
    assert r.all_ok
    counts = [int(p.read_text()) for p in out.iterdir()]
    assert len(counts) == 6
    assert max(counts) <= 2


def test_stdin_is_delivered():
    with Cluster(local_inv(2)) as c:
        r = c.run("cat | tr a-z A-Z", stdin=lambda n: f"hello {n.name}\n".encode())
    assert r["n1"].stdout == "HELLO N1\n"


def test_stop_event_ends_everything():
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    with Cluster(local_inv(2)) as c:
        r = c.run("sleep 30", stop=stop, timeout=20)
    assert all(x.error == "stopped" for x in r.values())


def test_killed_by_signal_reports_128_plus_n():
    with Cluster(local_inv(1)) as c:
        r = c.run("kill -9 $$")
    assert r["n0"].exit_code == 137


def test_cluster_result_views():
    r = ClusterResult(a=NodeResult("a", 0), b=NodeResult("b", None, error="refused"), c=NodeResult("c", 3))
    assert list(r.ok) == ["a"] and set(r.failed) == {"b", "c"}
    assert r.worst_exit_code == 255 and not r.all_ok


@pytest.mark.parametrize("value", ["plain", "with space", "it's", "$(reboot)", "`id`", "a;b", "-n", "\\", "\"q\""])
def test_quote_round_trips_through_a_real_shell(value):
    out = subprocess.run(["/bin/sh", "-c", "printf %s " + shell.quote(value)], capture_output=True, text=True)
    assert out.stdout == value
    env = subprocess.run(["/bin/sh", "-c", shell.exports({"V": value}) + ' printf %s "$V"'],
                         capture_output=True, text=True)
    assert env.stdout == value


def test_path_keeps_tilde_as_home_and_quotes_the_rest(tmp_path):
    home = str(tmp_path)
    for p, want in [("~", home), ("~/a b/$(x)", home + "/a b/$(x)"), ("/abs/it's", "/abs/it's")]:
        out = subprocess.run(["/bin/sh", "-c", "printf %s " + shell.path(p)], capture_output=True, text=True,
                             env={"HOME": home, "PATH": "/usr/bin:/bin"})
        assert out.stdout == want


def test_exec_cli_prefixes_and_returns_worst_code(capsys, tmp_path):
    inv = tmp_path / "i.yaml"
    inv.write_text("nodes:\n  - {name: alpha, connection: local}\n  - {name: b, connection: local}\n")
    rc = main(["exec", "-i", str(inv), "--", "echo", "hi;", "test", "$0", "=", "/bin/sh", "||", "exit", "4"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert sorted(out.splitlines()) == ["alpha | hi", "b     | hi"]
    rc = main(["exec", "-i", str(inv), "--json", "--", "exit 5"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 5 and doc["exit_code"] == 5 and not doc["ok"]
    assert [n["node"] for n in doc["nodes"]] == ["alpha", "b"]


# ------------------------------------------------------------------ known_hosts


def _pubkey():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def test_known_host_keys_finds_plain_ported_and_hashed_entries_only(tmp_path):
    import paramiko

    from orchestrator.transport import known_host_keys

    a, b, c, d = (_pubkey() for _ in range(4))
    hashed = paramiko.HostKeys.hash_host("10.0.0.3")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"# comment\n\nnode1,10.0.0.1 {a}\n[10.0.0.2]:2222 {b}\n{hashed} {c}\n"
                  f"10.0.0.4 ssh-ed25519 !!notbase64!!\n10.0.0.4 {d}\nshort line\n")
    b64 = lambda keys: [k.get_base64() for k in keys]  # noqa: E731
    assert b64(known_host_keys(kh, "10.0.0.1")) == [a.split()[1]]
    assert b64(known_host_keys(kh, "node1")) == [a.split()[1]]
    assert b64(known_host_keys(kh, "[10.0.0.2]:2222")) == [b.split()[1]]
    assert known_host_keys(kh, "10.0.0.2") == []  # port 22 is another host to ssh
    assert b64(known_host_keys(kh, "10.0.0.3")) == [c.split()[1]]
    assert b64(known_host_keys(kh, "10.0.0.4")) == [d.split()[1]]  # the damaged line is skipped
    assert known_host_keys(kh, "10.0.0.9") == []
    assert known_host_keys(tmp_path / "missing", "10.0.0.1") == []
    # a changed file is read again (accept-new appends while a command runs)
    e = _pubkey()
    with open(kh, "a") as f:
        f.write(f"10.0.0.9 {e}\n")
    assert b64(known_host_keys(kh, "10.0.0.9")) == [e.split()[1]]
