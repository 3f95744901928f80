"""The node agent's framed stream (`tail KEY OFFSET stream ...`): Stream, the sink that writes the
log's bytes, the node's new checkpoints and TensorBoard bytes, every rank's progress and last the
run's status as artifacts.py's frames; and the door back: a stop, a snapshot or the node's clock
asked on its stdin. A stream lives as long as the run: what it uses is imported here at its start.
"""
import json
import os
import time

from . import artifacts
from .agent_base import threading_start
from .agent_snapshot import snapshot_doc
from .agent_stop import ask
from .agent_tail import Plain

PROGRESS_WAIT_S = 5.0  # how long the stream's progress request waits for the ranks' answers


class Stream(Plain):
    """`tail KEY OFFSET stream CKPTDIR|- TBDIR OFFSETS_HEX [PROGRESS_S]`: one stream for everything
    the control machine takes from a running node. Records (artifacts.py `frame`): the log's bytes
    by offset, the complete checkpoints in CKPTDIR whenever they change, TensorBoard bytes past
    OFFSETS_HEX (artifacts.py `since`'s frames), looked for every SCAN_S s in this one process,
    with PROGRESS_S every rank's progress (`snapshot_doc`, asked every PROGRESS_S s), and last the
    run's status, by artifacts.py's rules (the ones its `poll` applies).

    Its stdin, held open by the control machine, takes requests, a JSON line each:
    {"stop": GRACE, "peer_failed": BOOL}, carried out as the `stop` verb would (agent_stop.py
    `ask`) and answered with a FRAME_STOPPING record; {"snapshot": N, "wait": S}, every rank's
    stacks as the `snapshot` verb takes them (`snapshot_doc`, on a thread of its own), answered
    with a FRAME_SNAPSHOT record holding the document and "ask": N; {"clock": N}, answered with a
    FRAME_CLOCK record of this node's clock when the line was read. So stopping a run or looking
    at a hang costs the node no SSH session and no interpreter's start (one costs 1-1.5 s on a
    node whose cores train). At EOF (a control machine that sends none) it listens no more."""

    def __init__(self, run_id, ckpt_dir, tb_dir, offsets_hex, progress_s="0"):
        super().__init__("stream")
        self.art = artifacts
        self.ckpt_dir, self.tb_dir, self.last = ckpt_dir, tb_dir, {}
        self.have = json.loads(bytes.fromhex(offsets_hex).decode()) if offsets_hex != "-" else {}
        self.next_scan = 0.0
        self.run_id, self.progress_s = run_id, float(progress_s)
        self.next_ask = time.time() + self.progress_s  # the ranks' hooks are made as they start: not at once
        self.asking = None  # the thread asking the ranks now
        self.answers = []  # its finished documents, for the main thread to write (list ops are atomic)
        self.taken = []  # stop requests taken from stdin, to be answered by the main thread (the only writer)
        self.snaps = []  # (document, frame kind): snapshots and clock readings asked on stdin, to be written
        threading_start(self.listen)

    def log(self, pos, chunk):
        self.out.write(self.art.frame({"t": self.art.FRAME_LOG, "offset": pos}, chunk))
        self.out.flush()
        self.tick()  # a log that never pauses still gets its checkpoints seen
        return pos + len(chunk)

    def listen(self):
        """Requests from stdin, until EOF: a stop carried out, then noted for its answer; a snapshot
        taken on a thread of its own; the clock read at once. Read from fd 0 itself: a thread
        blocked in sys.stdin's reader holds its lock, which the interpreter's exit then cannot take.
        """
        buf = b""
        while True:
            try:
                chunk = os.read(0, 4096)
            except OSError:  # no stdin at all
                return
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    req = json.loads(line)
                    if "clock" in req:
                        self.snaps.append(({"clock": req["clock"], "time": time.time()}, self.art.FRAME_CLOCK))
                        continue
                    if "snapshot" in req:
                        threading_start(self.snapshot, int(req["snapshot"]), float(req.get("wait", 10.0)))
                        continue
                    ask(self.run_id, float(req["stop"]), bool(req.get("peer_failed")))
                    self.taken.append({"stop": req["stop"]})
                except (OSError, ValueError, KeyError, TypeError) as e:  # said on the stream, which goes on
                    self.taken.append({"error": f"{type(e).__name__}: {e}"})

    def snapshot(self, request, wait):
        try:
            doc = snapshot_doc(self.run_id, request, wait, "stacks")
        except Exception as e:  # noqa: BLE001 - said in the answer; the control machine asks over SSH then
            doc = {"ranks": [], "time": time.time(), "error": f"{type(e).__name__}: {e}"}
        doc["ask"] = request
        self.snaps.append((doc, self.art.FRAME_SNAPSHOT))

    def tick(self, now=False):
        while self.taken:
            self.out.write(self.art.frame({"t": self.art.FRAME_STOPPING}, json.dumps(self.taken.pop(0)).encode()))
            self.out.flush()
        while self.snaps:
            doc, kind = self.snaps.pop(0)
            self.out.write(self.art.frame({"t": kind}, json.dumps(doc).encode()))
            self.out.flush()
        self.progress()
        if not now and time.time() < self.next_scan:
            return
        self.next_scan = time.time() + self.art.SCAN_S
        for rec in self.art.stream_records(self.ckpt_dir, self.tb_dir, self.have, self.last):
            self.out.write(rec)
        self.out.flush()

    def progress(self):
        """Write the progress answers that came in; every PROGRESS_S s, ask again on a thread of
        its own (a hook waited for must not hold up the log), never two requests at once."""
        if self.progress_s <= 0:
            return
        while self.answers:
            doc = self.answers.pop(0)
            self.out.write(self.art.frame({"t": self.art.FRAME_PROGRESS}, json.dumps(doc).encode()))
            self.out.flush()
        if (self.asking is not None and self.asking.is_alive()) or time.time() < self.next_ask:
            return
        self.next_ask = time.time() + self.progress_s
        self.asking = threading_start(self.ask, time.time_ns() // 1_000_000)  # unique on the node, as elsewhere

    def ask(self, request):
        try:
            doc = snapshot_doc(self.run_id, request, PROGRESS_WAIT_S, "progress")
        except Exception as e:  # noqa: BLE001 - said in the record; the stream goes on
            doc = {"ranks": [], "time": time.time(), "error": f"{type(e).__name__}: {e}"}
        self.answers.append(doc)

    def end(self, doc):
        self.tick(now=True)  # what the run wrote last
        self.out.write(self.art.frame({"t": self.art.FRAME_END}, json.dumps(doc).encode()))
        self.out.flush()
