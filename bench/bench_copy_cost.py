"""What one checkpoint copy and one artifact poll cost in CPU, part by part.

    sudo .venv/bin/python bench/bench_copy_cost.py [--mb 360] [--repeat 3]

Three measurements, each against the way it was done before, in the same run:

  cipher   one checkpoint of --mb MB copied from a test node to this machine the way the run's
           copier does (ArtifactCopier.fetch), with AES-GCM (offered first) and with paramiko's
           default aes128-ctr + hmac-sha2-256: this process's CPU and the node's sshd CPU
  unpack   the same tar fed in 32 KiB pieces (as SSH delivers it) to transfer/unpack.py's
           Unpacker, hashed as written, against the old way: written to a temporary tar, then
           tarfile.extractall, then the file read back to hash. No network: this process's CPU
  poll     the copier's poll of 2 nodes (checkpoint list and TensorBoard bytes in one process per
           node) against two processes per node, one per question: CPU of the whole machine

Medians of --repeat runs. No assertions: this prints figures.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from orchestrator.inventory import parse_inventory  # noqa: E402
from orchestrator.node import artifacts, wire  # noqa: E402
from orchestrator.runs.ckpt.given_home import ArtifactCopier  # noqa: E402
from orchestrator.transfer.files import sha256_file  # noqa: E402
from orchestrator.transfer.unpack import Unpacker  # noqa: E402
from orchestrator.transport import Cluster  # noqa: E402
from orchestrator.transport import ssh as ssh_transport  # noqa: E402
from tests.cluster import TestCluster  # noqa: E402

NAME = "ckpt_00000020.pt"


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_machine() -> float:
    v = list(map(int, open("/proc/stat").readline().split()[1:]))
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def sshd_cpu(cluster, node) -> float:
    total = 0.0
    for p in cluster.processes(node):
        try:
            if p.name().startswith("sshd"):
                total += sum(p.cpu_times()[:2])
        except Exception:  # noqa: BLE001 - the process ended between listing and reading
            continue
    return total


def med(xs):
    return statistics.median(xs)


def bench_cipher(cl, inv, home, tmp: Path, repeat: int) -> None:
    node = cl.nodes[0]
    dirs = {node.name: {"checkpoints": f"{home}/ck", "tensorboard": f"{home}/tb"}}
    default = ssh_transport.AEAD_CIPHERS
    for label, aead in (("aes128-gcm (ships)", default), ("aes128-ctr (paramiko's default)", ())):
        ssh_transport.AEAD_CIPHERS = aead  # what _transport moves to the front
        try:
            with Cluster(inv) as c:
                c.connect()
                cipher = c.connections[node.name].transport.remote_cipher
                ctl, sshd, wall = [], [], []
                for i in range(repeat):
                    cp = ArtifactCopier(c, tmp / f"{cipher}{i}", dirs, say=lambda _s: None)
                    s0, c0, w0 = sshd_cpu(cl, node), cpu_self(), time.monotonic()
                    cp.fetch(node.name, NAME, "file")
                    wall.append(time.monotonic() - w0)
                    ctl.append(cpu_self() - c0)
                    sshd.append(sshd_cpu(cl, node) - s0)
                    assert cp.store.has(NAME), "the copy did not complete"
                    shutil.rmtree(tmp / f"{cipher}{i}")
        finally:
            ssh_transport.AEAD_CIPHERS = default
        print(f"  {label:34s} negotiated {cipher}: controller CPU {med(ctl):.2f} s, "
              f"node sshd CPU {med(sshd):.2f} s, wall {med(wall):.2f} s")


def bench_unpack(mb: int, tmp: Path, repeat: int) -> None:
    data = os.urandom(mb * 1_000_000)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        info = tarfile.TarInfo(NAME)
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    del buf, data
    pieces = [raw[i:i + 32768] for i in range(0, len(raw), 32768)]
    got = {"stream": ([], []), "temp tar": ([], [])}
    for i in range(repeat):
        for way in got:
            d = tmp / f"unpack-{way.replace(' ', '')}-{i}"
            d.mkdir()
            c0, w0 = cpu_self(), time.monotonic()
            if way == "stream":
                u = Unpacker(d, checksums=True)
                for p in pieces:
                    u.feed(p)
                assert u.close() is None
            else:
                with open(d / "incoming.tar", "wb") as f:
                    for p in pieces:
                        f.write(p)
                with tarfile.open(d / "incoming.tar") as t:
                    t.extractall(d)
                sha256_file(d / NAME)
                (d / "incoming.tar").unlink()
            got[way][0].append(cpu_self() - c0)
            got[way][1].append(time.monotonic() - w0)
            shutil.rmtree(d)
            time.sleep(2)  # let writeback of the last one settle
    for way, (cpu, wall) in got.items():
        label = "streamed, hashed as written (ships)" if way == "stream" else "temp tar, extract, read back to hash"
        print(f"  {label:38s} CPU {med(cpu):.2f} s, wall {med(wall):.2f} s")


def bench_poll(cl, inv, repeat: int, polls: int = 30) -> None:
    names = [n.name for n in cl.nodes]
    with Cluster(inv) as c:
        c.connect()
        for label, calls in (("one process per node (ships)", 1), ("two processes per node (before)", 2)):
            per = []
            for _ in range(repeat):
                b0 = cpu_machine()
                for _ in range(polls):
                    for _ in range(calls):
                        wire.send(c, lambda n: artifacts.poll(n, "/nonexistent/ck", "/nonexistent/tb", {}),
                                  names, timeout=60)
                per.append((cpu_machine() - b0) / polls * 1000)
            print(f"  {label:34s} {med(per):.0f} ms of CPU per poll of {len(names)} nodes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=360, help="checkpoint size (preset tiny's is 360 MB)")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    with TestCluster(n=2, gpus=0, name_prefix="cccc") as cl, tempfile.TemporaryDirectory(dir="/root") as td:
        tmp = Path(td)
        node = cl.nodes[0]
        node.run(f"mkdir -p ~/ck && head -c {a.mb * 1_000_000} /dev/urandom > ~/ck/{NAME} && "
                 f"cd ~/ck && sha256sum {NAME} | cut -c1-64 > {NAME}.sha256")
        home = node.run("echo ~").stdout.strip()
        inv = parse_inventory(yaml.safe_dump(cl.inventory()), "<bench>")
        print(f"one {a.mb} MB checkpoint copied from a test node (ArtifactCopier.fetch), median of {a.repeat}:")
        bench_cipher(cl, inv, home, tmp, a.repeat)
        print(f"unpacking a {a.mb} MB tar fed in 32 KiB pieces, no network, median of {a.repeat}:")
        bench_unpack(a.mb, tmp, a.repeat)
        print(f"the copier's poll (checkpoints and TensorBoard), 30 polls, median of {a.repeat}:")
        bench_poll(cl, inv, a.repeat)


if __name__ == "__main__":
    main()
