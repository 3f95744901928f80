"""A light stand-in for `python -m torch.distributed.run` (stdlib only; runs on a test node).

Lets the control plane be measured at hundreds of nodes x 8 ranks on one machine, where a real
torchrun per node (~250 MB, ~1.5 s of CPU, a Python process per rank) does not fit. It keeps torchrun's launch contract as the node agent and the controller see
it, and nothing else:

- the same argv (--nnodes --nproc-per-node --node-rank --master-addr --master-port --rdzv-id
  --rdzv-conf --log-dir TARGET...) and a static rendezvous (waiting --rdzv-conf's timeout=N, else
  CLUSTERCTL_STANDIN_RDZV_TIMEOUT, else torchrun's 900 s): node 0 listens on the master port (the launcher
  waits for it), every other node connects, and no rank starts before all nnodes have joined;
- one process per rank, each with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
  GROUP_RANK, MASTER_ADDR, TORCHELASTIC_*, ... and everything it inherited, the run key included)
  visible in /proc/PID/environ, dying with the stand-in (PR_SET_PDEATHSIG) as clusterctl's hook
  makes a real rank do;
- each rank writes its first line itself, `[default<LOCAL_RANK>]:rank R up`, the prefix the node
  agent's waiter gives a real rank's lines; then, every CLUSTERCTL_STANDIN_TICK seconds (default 1, 0: never), one
  distinct line per live rank, `[default<L>]:rank R step K`, written by the stand-in on the ranks'
  behalf (a rank is `sleep`, which cannot);
- on SIGUSR1 (SIGUSR2), CLUSTERCTL_STANDIN_BURST lines (default 1000) from every live rank written
  at once, distinct (`rank R line I`) or the same text from every rank (`line I of every rank`),
  then each rank's `rank R burst distinct|same done`: bench_scale's log throughput;
- exit codes and signals as torchrun's elastic agent: a rank that fails (non-zero, or killed) has
  the others sent SIGTERM (SIGKILL after 30 s) and the stand-in exits 1; SIGTERM/SIGINT/SIGHUP to
  the stand-in ends the ranks the same way and exits 1.

Not kept: the TARGET is not run (no Python in a rank, so no snapshot hook answers, no stacks, and
no output handed to the waiter), no collectives (a rank does not notice a dead peer; only
the control plane's teardown ends the other nodes), no TORCHELASTIC_ERROR_FILE is written, and a
rank's failure time is not noted (the waiter sees no hand-over: so the run's summary names the
node that failed first, not the rank).
"""
import argparse
import os
import select
import signal
import socket
import subprocess
import sys
import time

RDZV_TIMEOUT_S = float(os.environ.get("CLUSTERCTL_STANDIN_RDZV_TIMEOUT", "900"))
TERM_GRACE_S = 30.0  # torchrun's own wait between SIGTERM and SIGKILL of its workers
RANK_SH = 'printf "%s\\n" "$1"; exec sleep 2147483647'


def parse(argv):
    ap = argparse.ArgumentParser(prog="torchrun-standin", allow_abbrev=False)
    ap.add_argument("--nnodes", type=int, required=True)
    ap.add_argument("--nproc-per-node", "--nproc_per_node", type=int, required=True)
    ap.add_argument("--node-rank", "--node_rank", type=int, required=True)
    ap.add_argument("--master-addr", "--master_addr", required=True)
    ap.add_argument("--master-port", "--master_port", type=int, required=True)
    ap.add_argument("--rdzv-id", "--rdzv_id", default="none")
    ap.add_argument("--rdzv-conf", "--rdzv_conf", default="")  # key=value,...: its timeout bounds the rendezvous
    ap.add_argument("--log-dir", "--log_dir", default=None)
    ap.add_argument("-m", "--module", action="store_true")  # TARGET is a module: `-m trainer` (not run either)
    ap.add_argument("target", nargs=argparse.REMAINDER)
    return ap.parse_args(argv)


def rendezvous(a):
    """Block until every node joined: node 0 serves (and keeps its listening socket, as the TCPStore
    lives as long as torchrun), the others connect, retrying until the rendezvous timeout."""
    conf = dict(kv.split("=", 1) for kv in a.rdzv_conf.split(",") if "=" in kv)
    deadline = time.monotonic() + float(conf.get("timeout", RDZV_TIMEOUT_S))
    if a.node_rank == 0:
        srv = socket.create_server((a.master_addr, a.master_port), backlog=max(128, a.nnodes))
        peers = []
        while len(peers) < a.nnodes - 1:
            srv.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                sys.exit(f"torchrun-standin: rendezvous timed out: {len(peers) + 1} of {a.nnodes} nodes joined")
            peers.append(conn)
        for conn in peers:
            conn.sendall(b"go\n")
        return [srv, *peers]
    while True:
        try:
            conn = socket.create_connection((a.master_addr, a.master_port), timeout=5)
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            if conn.recv(3) == b"go\n":
                return [conn]
            conn.close()
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"torchrun-standin: rendezvous with {a.master_addr}:{a.master_port} timed out")
        time.sleep(0.2)


def die_with_parent():
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(s, signal.SIG_DFL)


def rank_env(a, local):
    rank = a.node_rank * a.nproc_per_node + local
    world = a.nnodes * a.nproc_per_node
    env = dict(os.environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(local), GROUP_RANK=str(a.node_rank), ROLE_RANK=str(rank),
               ROLE_NAME="default", LOCAL_WORLD_SIZE=str(a.nproc_per_node), WORLD_SIZE=str(world),
               GROUP_WORLD_SIZE=str(a.nnodes), ROLE_WORLD_SIZE=str(world), MASTER_ADDR=a.master_addr,
               MASTER_PORT=str(a.master_port), TORCHELASTIC_RUN_ID=a.rdzv_id, TORCHELASTIC_RESTART_COUNT="0",
               TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_USE_AGENT_STORE="True")
    env.setdefault("OMP_NUM_THREADS", "1")
    return rank, env


def start_ranks(a):
    ranks = {}
    for local in range(a.nproc_per_node):
        rank, env = rank_env(a, local)
        p = subprocess.Popen(["/bin/sh", "-c", RANK_SH, "rank", f"[default{local}]:rank {rank} up"], env=env,
                             stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        ranks[p.pid] = (local, rank)
    return ranks


def end_ranks(live):
    for pid in live:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + TERM_GRACE_S
    while live and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            live.pop(pid, None)
        else:
            time.sleep(0.02)
    for pid in live:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def write_all(data):
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


def burst(kind, per, live):
    """`per` lines from every live rank, interleaved line by line as ranks writing at once are,
    then each rank's `done` line (see the module's docstring)."""
    ranks = sorted(live.values(), key=lambda lr: lr[1])
    buf = []
    for i in range(per):
        buf += [f"[default{lo}]:rank {r} line {i}\n" if kind == "distinct" else f"[default{lo}]:line {i} of every rank\n"
                for lo, r in ranks]
        if len(buf) >= 8192:
            write_all("".join(buf).encode())
            buf.clear()
    write_all("".join(buf + [f"[default{lo}]:rank {r} burst {kind} done\n" for lo, r in ranks]).encode())


def main(argv):
    a = parse(argv)
    tick = float(os.environ.get("CLUSTERCTL_STANDIN_TICK", "1"))
    keep = rendezvous(a)  # noqa: F841 - the store's sockets live as long as the stand-in
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    stop = []
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda signum, frame: stop.append(signum))
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    bursts, per = [], int(os.environ.get("CLUSTERCTL_STANDIN_BURST", "1000"))
    signal.signal(signal.SIGUSR1, lambda signum, frame: bursts.append("distinct"))
    signal.signal(signal.SIGUSR2, lambda signum, frame: bursts.append("same"))
    live = start_ranks(a)
    step, next_tick = 0, time.monotonic() + tick
    while True:
        while live:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            local, rank = live.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            if code != 0:
                sys.stderr.write(f"torchrun-standin: failed (exitcode: {code}) local_rank: {local} (pid: {pid}) "
                                 f"rank {rank}\n")
                stop.append(0)
        if stop or not live:
            break
        while bursts:
            burst(bursts.pop(0), per, live)
        if tick > 0 and time.monotonic() >= next_tick:
            step += 1
            os.write(1, b"".join(f"[default{lo}]:rank {r} step {step}\n".encode() for lo, r in live.values()))
            next_tick += tick * (1 + int((time.monotonic() - next_tick) // tick))
        wait = next_tick - time.monotonic() if tick > 0 else None
        select.select([wake_r], [], [], max(0.0, wait) if wait is not None else None)
        try:
            os.read(wake_r, 512)
        except BlockingIOError:
            pass
    if not stop:
        return 0
    end_ranks(live)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
