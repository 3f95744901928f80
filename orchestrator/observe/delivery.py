"""Events delivered as they happen, never in the run's way: `train --webhook URL`, `--notify CMD
--notify-on EVENTS`, `--heartbeat SECONDS`.

The Book's sink (events.py `Watcher`) runs in whatever thread wrote the record; all it does here is
put each event on every outbox's bounded queue (`put_nowait`: a full queue drops the event and
counts it). Each outbox has its own thread: a webhook POSTs the event's JSON, signed
(`X-Clusterctl-Signature: sha256=HEX`, HMAC-SHA256 of the body with the secret), and retries with
backoff; the notify command gets the JSON on stdin and in CLUSTERCTL_EVENT_JSON. A dead or slow
endpoint delays only its own queue. When the run ends, the supervisor gives the outboxes CLOSE_S
to send what is queued (the end's event with it), then says what was not delivered.

The settings are resolved when `train` starts (flags over the inventory's train section, the secret
from CLUSTERCTL_WEBHOOK_SECRET else train.webhook_secret) and kept in runs/RUN/events.json (0600),
so a supervisor that adopts the run later signs with the same secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import queue
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Callable

from orchestrator import __version__
from orchestrator.home import home
from orchestrator.observe.events import END, KINDS, Watcher, dumps, event, parse_kinds
from orchestrator.observe.runview import RunView, newest_checkpoint
from orchestrator.runs import notify, quarantine
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.store import Run, read_json, write_json

CONFIG = "events.json"
SECRET_ENV = "CLUSTERCTL_WEBHOOK_SECRET"
SIGNATURE = "X-Clusterctl-Signature"
QUEUE_MAX = 1000  # events waiting per outbox; more are dropped (and counted)
POST_TIMEOUT = 5.0  # one POST
TRIES = 5  # per event, waiting 1, 2, 4, 8 s between
CLOSE_S = 15.0  # after the run's end: how long the outboxes may take to send what is queued
TICK_S = 1.0  # how often the dispatcher looks for a new checkpoint copy, quarantine entry, heartbeat
DEFAULT_HEARTBEAT = 300.0  # with a webhook and no --heartbeat


@dataclass(frozen=True)
class EventConfig:
    notify_on: frozenset[str] | None = None  # None: --notify runs once, at the end (runs/notify.py)
    webhooks: tuple[str, ...] = ()
    secret: str | None = None
    heartbeat: float = 0.0

    @classmethod
    def resolve(cls, train, notify_on: str | None, webhooks: tuple[str, ...], heartbeat: float | None,
                environ: dict[str, str]) -> "EventConfig":
        """Flags over the inventory's train section (`train`); ValueError for an unknown event."""
        on = notify_on if notify_on is not None else train.notify_on
        hooks = tuple(webhooks) or ((train.webhook,) if train.webhook else ())
        beat = heartbeat if heartbeat is not None else train.heartbeat
        return cls(parse_kinds(on) if on is not None else None, hooks,
                   environ.get(SECRET_ENV) or train.webhook_secret,
                   float(beat) if beat is not None else (DEFAULT_HEARTBEAT if hooks else 0.0))

    def to_json(self) -> dict:
        return {"notify_on": sorted(self.notify_on) if self.notify_on is not None else None,
                "webhooks": list(self.webhooks), "secret": self.secret, "heartbeat": self.heartbeat}

    @classmethod
    def from_json(cls, doc: dict) -> "EventConfig":
        on = doc.get("notify_on")
        return cls(frozenset(k for k in on if k in KINDS) if on is not None else None,
                   tuple(doc.get("webhooks") or ()), doc.get("secret"), float(doc.get("heartbeat") or 0))


def save_config(run: Run, config: EventConfig) -> None:
    if config.notify_on is not None or config.webhooks or config.heartbeat:
        write_json(run.dir / CONFIG, config.to_json(), mode=0o600)  # the secret: the user's alone


def load_config(run: Run) -> EventConfig | None:
    doc = read_json(run.dir / CONFIG)
    return EventConfig.from_json(doc) if doc else None


def sign(body: bytes, secret: str) -> str:
    """The signature header's value: sha256=HEX, HMAC-SHA256 of the body's bytes."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(body: bytes, header: str | None, secret: str) -> bool:
    """What a receiver checks (in constant time): the header is the body's signature with `secret`."""
    return header is not None and hmac.compare_digest(header, sign(body, secret))


class Outbox:
    """One destination: a bounded queue and the thread that delivers from it, in order."""

    def __init__(self, name: str, deliver: Callable[[dict], None], wants: Callable[[str], bool]):
        self.name, self.deliver, self.wants = name, deliver, wants
        self.q: queue.Queue = queue.Queue(maxsize=QUEUE_MAX)
        self.dropped = 0
        self.sent = 0
        self.thread = threading.Thread(target=self._loop, daemon=True, name=f"events-{name[:20]}")
        self.thread.start()

    def put(self, doc: dict | None) -> None:
        try:
            self.q.put_nowait(doc)
        except queue.Full:
            self.dropped += 1

    def _loop(self) -> None:
        while (doc := self.q.get()) is not None:
            self.deliver(doc)
            self.sent += 1

    def close(self, deadline: float) -> int:
        """Send what is queued until `deadline` (monotonic); -> the events not delivered."""
        try:
            self.q.put(None, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        self.thread.join(max(0.0, deadline - time.monotonic()))
        return self.q.qsize() + self.dropped + (1 if self.thread.is_alive() else 0)


class Webhook:
    """POSTs each event to `url`, signed when there is a secret; retried with backoff on a network
    error, a timeout, 408, 429 or a 5xx; any other answer is final."""

    def __init__(self, url: str, secret: str | None, say: Callable[[str], None]):
        self.url, self.secret, self.say = url, secret, say

    def post(self, doc: dict) -> str | None:
        """One try: None when the endpoint took it (2xx), else why not ("retry: ..." when worth another)."""
        body = dumps(doc)
        headers = {"Content-Type": "application/json", "User-Agent": f"clusterctl/{__version__}",
                   "X-Clusterctl-Event": doc["event"], "X-Clusterctl-Delivery": str(uuid.uuid4())}
        if self.secret:
            headers[SIGNATURE] = sign(body, self.secret)
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=POST_TIMEOUT) as resp:
                resp.read(1 << 16)
            return None
        except urllib.error.HTTPError as e:
            return f"{'retry: ' if e.code in (408, 429) or e.code >= 500 else ''}HTTP {e.code}"
        except (urllib.error.URLError, OSError, ValueError) as e:
            return f"retry: {getattr(e, 'reason', e)}"

    def __call__(self, doc: dict) -> None:
        for k in range(TRIES):
            why = self.post(doc)
            if why is None:
                return
            if not why.startswith("retry: ") or k == TRIES - 1:
                break
            time.sleep(2 ** k)
        self.say(f"webhook {self.url}: event {doc['event']} #{doc['seq']} not delivered ({why.removeprefix('retry: ')})")


class NotifyCommand:
    """Runs the run's --notify command for an event: its JSON on stdin and in CLUSTERCTL_EVENT_JSON,
    the kind in CLUSTERCTL_EVENT, and the variables the end's notification always had."""

    def __init__(self, run: Run, command: str, say: Callable[[str], None]):
        self.run, self.command, self.say = run, command, say

    def __call__(self, doc: dict) -> None:
        body = dumps(doc)
        env = {**notify.notify_env(self.run.record), "CLUSTERCTL_EVENT": doc["event"],
               "CLUSTERCTL_EVENT_JSON": body.decode()}
        try:
            notify.run_command(self.run, self.command, env, body + b"\n", self.say)
        except Exception as e:  # noqa: BLE001 - a notification never changes the run
            self.say(f"notify: failed: {type(e).__name__}: {e}")


class Dispatcher:
    """The run's events, from the Book's sink and from its own looks, out to every outbox."""

    def __init__(self, run: Run, config: EventConfig, rec: RunRecord, say: Callable[[str], None]):
        self.run, self.config, self.say, self.rec = run, config, say, rec
        self.watcher = Watcher(rec)
        self.lock = threading.Lock()
        self.seq = 0
        self.outboxes = [Outbox(url, Webhook(url, config.secret, say), lambda k: True) for url in config.webhooks]
        command = notify.notify_command(run)
        self.notifies = config.notify_on is not None and bool(command)
        if self.notifies:
            on = config.notify_on
            self.outboxes.append(Outbox("notify", NotifyCommand(run, command, say), lambda k: k in on))
        if config.webhooks and not config.secret:
            say(f"events: no webhook secret ({SECRET_ENV} or train.webhook_secret): events are sent unsigned")
        ck = newest_checkpoint(run.dir)
        self.checkpoint = ck.name if ck else None
        self.quarantine_sig: tuple[int, int] | None = None
        self.held = {e.node for e in quarantine.load().values() if e.run == run.id}
        self.view = RunView(run.dir)
        self.beat_at = time.monotonic()
        self.stop = threading.Event()
        self.ticker = threading.Thread(target=self._tick, daemon=True, name="events-tick")
        self.ticker.start()

    def sink(self, rec: RunRecord, line: dict | None) -> None:
        """Book.sink: never blocks, never raises into the run."""
        self.rec = rec
        try:
            for doc in self.watcher.sink(rec, line):
                self.emit(doc)
        except Exception as e:  # noqa: BLE001 - an event is never worth the run
            self.say(f"events: {type(e).__name__}: {e}")

    def emit(self, doc: dict) -> None:
        with self.lock:
            self.seq += 1
            doc["seq"] = self.seq
            for ob in self.outboxes:
                if ob.wants(doc["event"]):
                    ob.put(doc)

    def _tick(self) -> None:
        while not self.stop.wait(TICK_S):
            try:
                self.look()
            except Exception as e:  # noqa: BLE001
                self.say(f"events: {type(e).__name__}: {e}")

    def look(self) -> None:
        """What no record write says: a new checkpoint copy, a quarantine entry, the heartbeat."""
        rec = self.rec
        ck = newest_checkpoint(self.run.dir)
        if ck is not None and ck.name != self.checkpoint:
            self.checkpoint = ck.name
            self.emit(event("checkpoint_copied", rec, f"checkpoint {ck.name} copied to the control machine",
                            name=ck.name, step=ck.step))
        self._quarantined(rec)
        beat = self.config.heartbeat
        if beat > 0 and not rec.state.terminal and time.monotonic() - self.beat_at >= beat:
            self.beat_at = time.monotonic()
            facts = self.view.refresh(time.time())
            lead = facts.lead if facts is not None else None
            self.emit(event("heartbeat", rec, f"still {rec.state.value}" + (f" at step {lead.step}" if lead else ""),
                            step=lead.step if lead else None, step_s=lead.step_s if lead else None,
                            tokens_s=lead.tokens_s if lead else None))

    def _quarantined(self, rec: RunRecord) -> None:
        try:
            st = os.stat(home() / "quarantine.json")
        except OSError:
            return
        if (st.st_mtime_ns, st.st_size) == self.quarantine_sig:
            return
        self.quarantine_sig = (st.st_mtime_ns, st.st_size)
        for e in quarantine.load().values():
            if e.run == self.run.id and e.node not in self.held:
                self.held.add(e.node)
                self.emit(event("quarantined", rec, f"{e.node} quarantined: {e.reason}", node=e.node,
                                reason=e.reason))

    def close(self, seconds: float = CLOSE_S) -> None:
        """The run is over: a last look, then CLOSE_S for the outboxes to send what is queued."""
        self.stop.set()
        self.ticker.join(TICK_S * 2)
        self.look()
        deadline = time.monotonic() + seconds
        for ob in self.outboxes:
            left = ob.close(deadline)
            if left:
                self.say(f"events: {left} event(s) to {ob.name} not delivered before the supervisor ended")


def start(run: Run, rec: RunRecord, say: Callable[[str], None]) -> Dispatcher | None:
    """The run's dispatcher, when its events go anywhere (None: only the end's --notify, if any)."""
    config = load_config(run)
    if config is None or not (config.webhooks or config.notify_on is not None):
        return None
    return Dispatcher(run, config, rec, say)


def end_event(run: Run) -> bytes | None:
    """The end's event for the --notify command run once at the end (no --notify-on); None when the
    record cannot be read."""
    try:
        rec = run.record
    except Exception:  # noqa: BLE001 - the notification goes out without it
        return None
    kind = rec.state.value if rec.state.value in END else "failed"
    doc = event(kind, rec, f"run {rec.state.value}" + (f": {rec.summary}" if rec.summary else ""),
                exit_code=rec.exit_code, summary=rec.summary, attempts=len(rec.attempts), error=rec.error)
    doc["seq"] = 0
    return dumps(doc) + b"\n"
