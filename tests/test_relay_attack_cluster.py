"""sync's relay under attack from a third host on the cluster's network: a 4-node `sync` of 50 MB
completes within 2x its undisturbed time, measured in the same test, under a slow-loris client and
under a flood of 300 connections, and no byte of the attacker's lands on a node.

The attacker (node5, root in its own namespace) watches every target node's listening sockets
(/proc/PID/net/tcp*) every millisecond and attacks each new port at once: the loris connects and sends one
byte every 2 s, the flood opens 300 connections and sends a wrong token and a payload on each. The
relays listen only on the nodes' addresses and take their upstream only from the upstream node's
address, so each attacking connection is closed unread; behind that, the token gate reads every
connection at once."""

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.cluster

MB = 50
PAYLOAD = b"PWNED-BY-THE-ATTACKER"

ATTACKER = r"""
import os, select, signal, socket, sys, threading, time
mode, targets = sys.argv[1], [t.split("=") for t in sys.argv[2:]]
seen, held, hits = set(), [], [0]
payload = b"x" * 32 + b"\n" + PAYLOAD * 1000

def listening(pid):
    found = set()
    for name in ("tcp", "tcp6"):
        try:
            rows = open("/proc/%s/net/%s" % (pid, name)).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            w = row.split()
            if w[3] == "0A":
                found.add(int(w[1].rsplit(":", 1)[1], 16))
    return found - {22}

def connect(addr, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    s.connect_ex((addr, port))  # at once, in the watch loop: the port is open for milliseconds
    return s

def connected(s):
    select.select([], [s], [], 5)
    ok = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
    hits[0] += ok
    return ok

def loris(s):
    try:
        if connected(s):
            s.setblocking(True)
            while True:
                s.sendall(b"0")  # one byte of a 33-byte token every 2 s
                time.sleep(2)
    except OSError:
        pass

def flood(socks):
    for s in socks:
        try:
            if connected(s):
                s.send(payload)
        except OSError:
            pass
    held.extend(socks)

signal.signal(signal.SIGTERM, lambda *_: (print("hits", hits[0], flush=True), os._exit(0)))
print("ready", flush=True)
end = time.monotonic() + float(os.environ.get("ATTACK_S", "600"))
while time.monotonic() < end:
    for addr, pid in targets:
        for port in listening(pid):
            if (addr, port) not in seen:
                seen.add((addr, port))
                if mode == "loris":
                    threading.Thread(target=loris, args=(connect(addr, port),), daemon=True).start()
                else:
                    socks = [connect(addr, port) for _ in range(300)]
                    threading.Thread(target=flood, args=(socks,), daemon=True).start()
    time.sleep(0.001)
""".replace("PAYLOAD", repr(PAYLOAD))


def sync_seconds(cluster, tmp_path, src, workdir):
    inv = cluster.write_inventory(tmp_path / f"{workdir}.yaml", workdir=f"~/{workdir}",
                                  nodes=[{"name": n.name, "host": n.host, "gpus": 0} for n in cluster.nodes[:4]])
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "sync", "-i", str(inv), "--src", str(src),
                        "--method", "relay"], capture_output=True, text=True, timeout=600, env=os.environ.copy())
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    return took


def attacked(cluster, tmp_path, src, workdir, mode):
    attacker = cluster.nodes[4]
    targets = [f"{n.host}={n.anchor.pid}" for n in cluster.nodes[:4]]
    p = attacker.popen([sys.executable, "-c", ATTACKER, mode, *targets], as_user=False,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"ready", p.stderr.read()
        took = sync_seconds(cluster, tmp_path, src, workdir)
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=10)
    return took, int(out.split()[-1])  # and how many of its connections the relays' ports took


def test_sync_completes_under_a_slow_loris_and_a_flood_within_twice_its_time(make_cluster, tmp_path):
    cluster = make_cluster(5, gpus=0)
    for up, n in zip(cluster.nodes[:3], cluster.nodes[1:4]):
        # each relay's upstream gets through on its SYN's first retransmission (1 s later): its port
        # is then open long enough for the attacker, which only watches /proc, to be first every
        # time (on the bare bridge it was often too late). Every sync below pays the same second.
        n.iptables("-A", "INPUT", "-p", "tcp", "--syn", "-s", up.host, "!", "--dport", "22", "-m", "statistic",
                   "--mode", "nth", "--every", "2", "--packet", "0", "-j", "DROP")
    src = tmp_path / "src"
    (src / "data").mkdir(parents=True)
    (src / "train.py").write_text("print('train')\n")
    for i in range(5):
        (src / "data" / f"shard{i}.bin").write_bytes(os.urandom(MB // 5 << 20))
    quiet = [sync_seconds(cluster, tmp_path, src, "wd_quiet1")]
    loris, loris_hits = attacked(cluster, tmp_path, src, "wd_loris", "loris")
    flood, flood_hits = attacked(cluster, tmp_path, src, "wd_flood", "flood")
    quiet.append(sync_seconds(cluster, tmp_path, src, "wd_quiet2"))
    undisturbed = max(quiet)
    print(f"sync of {MB} MB to 4 nodes: undisturbed {quiet[0]:.2f}s and {quiet[1]:.2f}s, slow-loris {loris:.2f}s "
          f"({loris_hits} connections), flood {flood:.2f}s ({flood_hits} connections)")
    assert loris_hits >= 2 and flood_hits >= 600, "the attacker never reached a relay: the test proves nothing"
    assert loris <= 2 * undisturbed, (loris, quiet)
    assert flood <= 2 * undisturbed, (flood, quiet)
    want = subprocess.run(["sha256sum", *sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())],
                          cwd=src, capture_output=True, text=True, check=True).stdout
    for n in cluster.nodes[:4]:
        for wd in ("wd_loris", "wd_flood"):
            got = n.run(f"cd ~/{wd} && sha256sum data/shard0.bin data/shard1.bin data/shard2.bin data/shard3.bin "
                        "data/shard4.bin train.py").stdout
            assert got == want, (n.name, wd)
        landed = n.run(f"grep -rl {PAYLOAD.decode()} ~/wd_loris ~/wd_flood || true").stdout.strip()
        assert not landed, (n.name, landed)
