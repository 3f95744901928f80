"""Copy files from one node's disk to another node's, node to node: no byte crosses this machine.
`copy` moves checkpoints (relay.py `send`); `copy_code` a workdir's code to a spare (nodeinfo's
`send` of the files a donor's `select` listed).

Both ends run orchestrator/remote/relay.py over their own SSH channels. The receiving node's
`recv` binds an ephemeral port and reports it; the control machine hands the sending node's
`send` the receiver's address, port and a one-time token on its stdin; the sender streams a tar
of the checkpoints over TCP and prints the stream's sha256, which the control machine announces
to the receiver, which installs the files only when its own digest matches. No key is placed on a
node; every wait has a timeout; a failed copy leaves no process or staging directory behind.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass

from orchestrator.inventory import Node
from orchestrator.node import form, nodeinfo
from orchestrator.node import relay as door
from orchestrator.transfer.chain import CONNECT_TIMEOUT, START_TIMEOUT
from orchestrator.transport import Cluster, ErrorKind, NodeResult

IDLE_TIMEOUT = 60.0  # either end gives up after this long without data or a protocol line


@dataclass(frozen=True)
class PairResult:
    ok: bool
    bytes: int
    detail: str  # what failed, in words ("" when ok)


def _why(r: NodeResult | None, what: str) -> str:
    if r is None:
        return f"{what}: did not finish"
    err = [ln.removeprefix("relay: ") for ln in r.stderr.splitlines() if ln.strip()]
    return f"{what}: " + (err[-1] if err else r.describe())


class Pair:
    """One copy of checkpoints `names` from src:src_dir to dst:dst_dir (src may be dst)."""

    def __init__(self, cluster: Cluster, src: Node, src_dir: str, names: list[str], dst: Node, dst_dir: str,
                 timeout: float = 600.0):
        self.cluster, self.src, self.src_dir, self.names = cluster, src, src_dir, names
        self.dst, self.dst_dir, self.timeout = dst, dst_dir, timeout
        self.xfer, self.token = secrets.token_hex(8), secrets.token_hex(16)
        self.cond = threading.Condition()
        self.port: int | None = None
        self.sent: tuple[int, str] | None = None  # (bytes, sha256) the sender reported
        self.recv_exited = self.send_exited = False
        self.recv_result: NodeResult | None = None
        self.stopped: set[str] = set()  # the ends whose relay processes were ended already

    def _set(self, **kw) -> None:
        with self.cond:
            for k, v in kw.items():
                setattr(self, k, v)
            self.cond.notify_all()

    def _wait(self, pred, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(pred, timeout)

    # ------------------------------------------------------------ the two ends' stdin
    def recv_feed(self, _node: Node):
        yield f"token {self.token}\nlast\nsource tcp {self.src.address}\n".encode()
        if self._wait(lambda: self.sent is not None or self.send_exited, self.timeout) and self.sent:
            yield f"sha256 {self.sent[1]}\n".encode()

    def send_feed(self, _node: Node):
        if self._wait(lambda: self.port is not None or self.recv_exited, START_TIMEOUT) and self.port:
            yield f"to {self.dst.address} {self.port} {self.token}\n".encode()

    def on_recv_line(self, _name: str, stream: str, line: str) -> None:
        said = door.read_line(line) if stream == "stdout" else None
        if said is not None and said.word == "port":
            self._set(port=said.n)

    def on_send_line(self, _name: str, stream: str, line: str) -> None:
        said = door.read_line(line) if stream == "stdout" else None  # any line may come: a traceback's
        if said is not None and said.word == "sent":
            self._set(sent=(said.n, said.text))

    # ------------------------------------------------------------ running it
    def command(self, node: Node, mode: str, where: str, *names: str) -> str:
        return door.end(node, self.xfer, mode, where, *names, idle=IDLE_TIMEOUT, connect=CONNECT_TIMEOUT).command

    def send_command(self, _node: Node) -> str:
        return self.command(self.src, "send", self.src_dir, *self.names)

    def _receive(self) -> None:
        try:
            res = self.cluster.run(lambda _n: door.end(self.dst, self.xfer, "recv", self.dst_dir, idle=IDLE_TIMEOUT,
                                                       connect=CONNECT_TIMEOUT, listen=self.dst.address).command,
                                   stdin=self.recv_feed,
                                   nodes=[self.dst.name], timeout=self.timeout, on_line=self.on_recv_line)
            self.recv_result = res[self.dst.name]
        finally:
            self._set(recv_exited=True)
        # a receiver that failed (its node lost mid-copy: the sender's TCP then stalls until its idle
        # timeout) ends the sender at once: the copy fails in seconds, not after IDLE_TIMEOUT
        if (self.recv_result is None or not self.recv_result.ok) and not self.send_exited:
            self.stop(self.src)

    def run(self) -> PairResult:
        form.place(self.cluster, [self.src.name, self.dst.name])
        receiver = threading.Thread(target=self._receive, daemon=True, name=f"replica-recv-{self.dst.name}")
        receiver.start()
        try:
            sent = self.cluster.run(self.send_command, stdin=self.send_feed, nodes=[self.src.name], timeout=self.timeout,
                                    on_line=self.on_send_line)[self.src.name]
        finally:
            self._set(send_exited=True)
        if not sent.ok:  # the receiver would wait out its idle timeout for a sender that is gone
            self.stop()
        receiver.join(self.timeout + 30)
        r = self.recv_result
        if sent.ok and r is not None and r.ok and self.sent:
            return PairResult(True, self.sent[0], "")
        if r is None or not r.ok:
            self.stop()
        return PairResult(False, self.sent[0] if self.sent else 0, self.failure(sent, r))

    def failure(self, sent: NodeResult, r: NodeResult | None) -> str:
        """What failed, by the end that failed first: a node that went away (its connection lost
        or never made) before the other end's complaint about it; a receiver that never listened
        (the sender was then never told where to send, and says only that) before the sender."""
        gone = (ErrorKind.LOST, ErrorKind.CONNECT)
        if r is not None and not r.ok and (r.kind in gone or (self.port is None and sent.kind not in gone)):
            return _why(r, f"receiving on {self.dst.name}")
        if not sent.ok:
            return _why(sent, f"sending from {self.src.name}")
        return _why(r, f"receiving on {self.dst.name}")

    def stop(self, *nodes: Node) -> None:
        """End this copy's relay processes (found by its id) on `nodes` (both ends by default) and
        remove its staging directory; an end already stopped is not asked again."""
        with self.cond:
            ends = {n.name: n for n in (nodes or (self.src, self.dst)) if n.name not in self.stopped}
            self.stopped |= set(ends)
        if ends:
            self.cluster.run(lambda n: door.stop(ends[n.name], self.xfer, self.dst_dir).command, nodes=list(ends),
                             timeout=30)


class CodePair(Pair):
    """The files `files` (relative paths) of src:src_dir into dst:dst_dir, a workdir's code by
    default: the sender is nodeinfo's `send`, which takes the file list on stdin after the
    receiver's address."""

    def __init__(self, cluster: Cluster, src: Node, dst: Node, files: list[str], timeout: float = 600.0,
                 src_dir: str | None = None, dst_dir: str | None = None):
        super().__init__(cluster, src, src_dir or src.workdir, [], dst, dst_dir or dst.workdir, timeout)
        self.manifest = "\0".join(files).encode("utf-8", "surrogateescape")

    def send_feed(self, node: Node):
        for line in super().send_feed(node):
            yield line + self.manifest

    def send_command(self, _node: Node) -> str:
        return nodeinfo.send(self.src, self.xfer, self.src_dir, idle=IDLE_TIMEOUT, connect=CONNECT_TIMEOUT).command


def copy(cluster: Cluster, src: Node, src_dir: str, names: list[str], dst: Node, dst_dir: str,
         timeout: float = 600.0) -> PairResult:
    return Pair(cluster, src, src_dir, names, dst, dst_dir, timeout).run()


def copy_code(cluster: Cluster, src: Node, dst: Node, files: list[str], timeout: float = 600.0) -> PairResult:
    """src's workdir files `files` into dst's workdir (installed only when the stream's sha256
    matches; nothing else in dst's workdir changes)."""
    return CodePair(cluster, src, dst, files, timeout).run()


def copy_files(cluster: Cluster, src: Node, src_dir: str, dst: Node, dst_dir: str, files: list[str],
               timeout: float = 600.0) -> PairResult:
    """The regular files `files` (paths relative to src_dir) into dst_dir on dst, at the same
    relative paths, node to node, installed only when the stream's sha256 matches (runs/ckpt/jobdir_replicas.py:
    a snapshot's part to its replica holder, or to a node it is restored on)."""
    return CodePair(cluster, src, dst, files, timeout, src_dir=src_dir, dst_dir=dst_dir).run()
