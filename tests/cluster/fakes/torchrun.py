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
  collective of every rank (`Collectives`: node 0 says `go K` to every stand-in over the rendezvous's
  sockets, each enters its ranks that are not stopped and reports once all of them have, node 0 says
  `done K` once every node has), after which one distinct line per live rank, `[default<L>]:rank R
  step K`, is written by the stand-in on the ranks' behalf (a rank is `sleep`, which cannot). So a
  rank stopped (SIGSTOP) or a node cut stalls every rank inside collective K, as a real job's
  all-reduce does;
- the snapshot hook's answers (orchestrator/remote/hook/sitecustomize.py), given by the stand-in for
  each rank (`HookAnswers`): a FIFO per rank pid in CLUSTERCTL_HOOK_DIR, a progress request answered
  with the rank's process group 0 [entered, completed] and when it entered its newest collectives, a
  full request with one Python stack (inside `all_reduce` while it waits) and a Flight Recorder of
  its newest collectives (`gloo:all_reduce`). A stopped rank answers nothing until it runs again,
  as a real rank's hook cannot: the hang watch names it by its /proc state;
- on SIGUSR1 (SIGUSR2), CLUSTERCTL_STANDIN_BURST lines (default 1000) from every live rank written
  at once, distinct (`rank R line I`) or the same text from every rank (`line I of every rank`),
  then each rank's `rank R burst distinct|same done`: bench_scale's log throughput;
- exit codes and signals as torchrun's elastic agent: a rank that fails (non-zero, or killed) has
  the others sent SIGTERM (SIGKILL after 30 s) and the stand-in exits 1; SIGTERM/SIGINT/SIGHUP to
  the stand-in ends the ranks the same way and exits 1.

Not kept: the TARGET is not run (no Python in a rank: the stacks are the stand-in's, one frame, and
no output is handed to the waiter), the collective carries no data, a rank does not notice a dead
peer (the others wait in the collective forever; only the control plane's teardown ends the other
nodes), no TORCHELASTIC_ERROR_FILE is written, and a rank's failure time is not noted (the waiter
sees no hand-over: so the run's summary names the node that failed first, not the rank).
"""
import argparse
import json
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
ENTRIES_KEPT = 64  # the newest collectives a rank's answers carry (the hook's FR_ENTRIES)


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


def stopped(pid):
    """The rank's process is stopped (SIGSTOP: state T) or gone: it enters no collective and
    answers no request."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "TtZX"
    except (OSError, IndexError):
        return True


class Collectives:
    """One all-reduce of every rank per tick, over the rendezvous's sockets (node 0 leads).

    Node 0 sends `go K`; each stand-in enters its ranks that are not stopped into collective K
    (noting when) and, once all of its live ranks have, sends `in K`; node 0 sends `done K` once
    every node has; then every rank has completed K and its step line is written. A rank stopped
    keeps its node from reporting, so every rank of every node waits in K until it runs again."""

    def __init__(self, a, socks, live):
        self.lead, self.nnodes, self.live = a.node_rank == 0, a.nnodes, live
        self.peers = socks[1:] if self.lead else socks  # node 0's: the other nodes'; others': node 0's
        for s in self.peers:
            s.settimeout(5.0)  # a send to a node that stopped reading fails (the node is dropped), never blocks
        self.bufs = {s.fileno(): b"" for s in self.peers}
        self.entered = {pid: [] for pid in live}  # pid -> [(K, time entered ns)], newest last
        self.go = self.completed = 0
        self.reported = 0  # the newest K this node said it entered
        self.joined = {}  # node 0: K -> how many nodes entered it

    def fds(self):
        return [s.fileno() for s in self.peers]

    def tick(self):
        """Node 0, each tick: the next collective, once the last one completed."""
        if self.lead and self.go == self.completed:
            self.send(self.peers, f"go {self.go + 1}")
            self.on_go(self.go + 1)

    def send(self, socks, text):
        for s in list(socks):
            try:
                s.sendall(text.encode() + b"\n")
            except OSError:
                self.drop(s)

    def drop(self, s):
        if s in self.peers:  # a node gone: its collective never completes, as gloo's would not
            self.peers.remove(s)
            self.bufs.pop(s.fileno(), None)

    def readable(self, fd):
        s = next((p for p in self.peers if p.fileno() == fd), None)
        if s is None:
            return
        try:
            data = s.recv(65536)
        except OSError:
            data = b""
        if not data:
            self.drop(s)
            return
        lines = (self.bufs[fd] + data).split(b"\n")
        self.bufs[fd] = lines.pop()
        for line in lines:
            word, _, k = line.decode(errors="replace").partition(" ")
            step = {"go": self.on_go, "in": self.on_in, "done": self.on_done}.get(word)
            if step is not None and k.isdigit():  # anything else is not a stand-in's: ignored
                step(int(k))

    def on_go(self, k):
        self.go = max(self.go, k)
        self.enter()

    def enter(self):
        """Ranks not stopped enter the collective node 0 started; the node reports once all have."""
        if self.go <= self.completed:
            return
        now = time.time_ns()
        for pid in self.live:
            got = self.entered.setdefault(pid, [])
            if (not got or got[-1][0] < self.go) and not stopped(pid):
                got.append((self.go, now))
                del got[:-ENTRIES_KEPT]
        if self.reported < self.go and all(self.entered[pid] and self.entered[pid][-1][0] == self.go
                                           for pid in self.live):
            self.reported = self.go
            if self.lead:
                self.on_in(self.go)
            else:
                self.send(self.peers, f"in {self.go}")

    def on_in(self, k):
        self.joined[k] = self.joined.get(k, 0) + 1
        if self.joined[k] == self.nnodes:
            del self.joined[k]
            self.send(self.peers, f"done {k}")
            self.on_done(k)

    def on_done(self, k):
        self.completed = max(self.completed, k)
        os.write(1, b"".join(f"[default{lo}]:rank {r} step {k}\n".encode() for lo, r in self.live.values()))

    def status(self, pid):
        """[entered, completed] in process group 0, as the hook's _pg_status; {} before the first."""
        got = self.entered.get(pid) or []
        if not got:
            return {}
        return {"0": [got[-1][0], min(self.completed, got[-1][0])]}


class HookAnswers:
    """The snapshot hook's FIFO and answers for each rank (see the module's docstring)."""

    def __init__(self, live, coll):
        self.dir, self.coll, self.fifos, self.queued = os.environ.get("CLUSTERCTL_HOOK_DIR"), coll, {}, {}
        if not self.dir or not os.path.isdir(self.dir):
            return
        for pid in live:
            path = os.path.join(self.dir, f"{pid}.fifo")
            try:
                os.mkfifo(path, 0o600)
                rfd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                wfd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # held: no end of file between askers
            except OSError:
                continue
            self.fifos[rfd] = (pid, path, wfd)

    def fds(self):
        return list(self.fifos)

    def readable(self, fd):
        pid = self.fifos[fd][0]
        try:
            got = os.read(fd, 4096).decode(errors="replace").split()
        except BlockingIOError:
            return
        self.queued.setdefault(pid, []).extend(got)
        self.answer()

    def answer(self):
        """Answers what a rank was asked, unless it is stopped: it answers once it runs again."""
        for pid, requests in list(self.queued.items()):
            if stopped(pid):
                continue
            del self.queued[pid]
            for request in requests:
                if request.isdigit() or (request[:1] == "p" and request[1:].isdigit()):
                    self.write(pid, request)

    def write(self, pid, request):
        local, rank = self.coll.live.get(pid, (None, None))
        got = self.coll.entered.get(pid) or []
        doc = {"pid": pid, "rank": str(rank), "request": request, "time": time.time()}
        if request[0] == "p":
            doc.update(steps=[], pgs=self.coll.status(pid), entered=[["0", k, t] for k, t in got])
        else:
            inside = bool(got) and got[-1][0] > self.coll.completed
            frames = [{"file": "standin_rank.py", "line": 7, "code": "dist.all_reduce(x)", "func": "train_step",
                       "lib": False}]  # its own code, then, while it waits, torch's (library code)
            if inside:
                frames.append({"file": "torch/distributed/distributed_c10d.py", "line": 2809, "code": "work.wait()",
                               "func": "all_reduce", "lib": True})
            status = {"0": {"last_enqueued_collective": got[-1][0] if got else -1,
                            "last_completed_collective": min(self.coll.completed, got[-1][0]) if got else -1}}
            entries = [{"pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": k, "p2p_seq_id": 0,
                        "profiling_name": "gloo:all_reduce", "is_p2p": False, "input_sizes": [[1]],
                        "state": "completed" if k <= self.coll.completed else "started", "time_created_ns": t,
                        "frames": []} for k, t in got]
            doc.update(local_rank=str(local), step=None, stacks=[{"thread": "MainThread", "main": True,
                                                                   "frames": frames}],
                       fr={"pg_status": status, "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                                                      "ranks": "all"}}, "entries": entries})
        path = os.path.join(self.dir, f"{pid}.{request}.json")
        try:
            with open(path + ".tmp", "w") as f:
                json.dump(doc, f)
            os.replace(path + ".tmp", path)
        except OSError:
            pass

    def gone(self, pid):
        """The rank ended (pid None: every rank, the stand-in ends): its FIFO and what it was asked go."""
        if pid is None:
            self.queued.clear()
        else:
            self.queued.pop(pid, None)
        for fd, (p, path, wfd) in list(self.fifos.items()):
            if p == pid or pid is None:
                for x in (fd, wfd):
                    os.close(x)
                del self.fifos[fd]
                try:
                    os.unlink(path)
                except OSError:
                    pass


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
    coll = Collectives(a, keep, live)
    hook = HookAnswers(live, coll)
    next_tick = time.monotonic() + tick
    poller, polled = select.poll(), set()  # not select.select: node 0 of 256 nodes holds fds past FD_SETSIZE (1024)
    while True:
        while live:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            local, rank = live.pop(pid)
            hook.gone(pid)
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
            coll.tick()
            next_tick += tick * (1 + int((time.monotonic() - next_tick) // tick))
        coll.enter()  # a rank stopped at `go` that runs again enters now
        hook.answer()
        wait = next_tick - time.monotonic() if tick > 0 else None
        wait = min(wait, 0.5) if wait is not None else 0.5  # a stopped rank's resumption seen within 0.5 s
        want = {wake_r, *coll.fds(), *hook.fds()}  # the poller follows the fds as ranks come and go
        for fd in want - polled:
            poller.register(fd, select.POLLIN)
        for fd in polled - want:
            poller.unregister(fd)
        polled = want
        for fd, _ in poller.poll(max(0.0, wait) * 1000):
            if fd in hook.fifos:
                hook.readable(fd)
            elif fd != wake_r:
                coll.readable(fd)
        try:
            os.read(wake_r, 512)
        except BlockingIOError:
            pass
    hook.gone(None)
    if not stop:
        return 0
    end_ranks(live)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
