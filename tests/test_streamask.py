"""StreamAsks: a stop or a snapshot asked through the attempt's open log streams, and what is left to
the `stop` and `snapshot` commands (runs/logs/streamask.py). The node side's answers are
tests/test_node_stream.py's; a whole teardown through the streams, tests/test_standin_cluster.py's;
a hang's snapshots through them, tests/test_hang_fast_cluster.py's."""

import json
import threading
import time

import pytest

from orchestrator.node.artifacts import FRAME_CLOCK, FRAME_SNAPSHOT, FRAME_STOPPING
from orchestrator.runs.logs import streamask
from orchestrator.runs.logs.streamask import StreamAsks, snapshot_nodes


class Stream:
    """A node's stream as the control side holds it: send() writes its stdin; `answer` replies."""

    def __init__(self, stops, name, answer=True, open_=True):
        self.stops, self.name, self.answer, self.open, self.sent = stops, name, answer, open_, []

    def send(self, data):
        if not self.open:
            return False
        self.sent.append(json.loads(data))
        assert data.endswith(b"\n") and data.count(b"\n") == 1
        req = self.sent[-1]
        if "clock" in req:
            if self.answer is True:  # a node 2.5 s ahead of this machine
                self.stops.answered(self.name, FRAME_CLOCK, {"clock": req["clock"], "time": time.time() + 2.5})
            return True
        if "snapshot" in req:
            return self.snapshot(req)
        if self.answer is True:
            threading.Timer(0.01, self.stops.answered, (self.name, FRAME_STOPPING, {"stop": req["stop"]})).start()
        elif self.answer == "error":
            self.stops.answered(self.name, FRAME_STOPPING, {"error": "OSError: no room"})
        return True

    def snapshot(self, req):
        doc = {"ranks": [{"pid": 7, "rank": 0}], "time": 1.0, "ask": req["snapshot"]}
        if self.answer is True:  # at once, from inside send: the asker holds its lock then
            self.stops.answered(self.name, FRAME_SNAPSHOT, doc)
        elif self.answer == "error":
            self.stops.answered(self.name, FRAME_SNAPSHOT, {"ranks": [], "error": "OSError: gone", "ask": req["snapshot"]})
        elif self.answer == "late":
            threading.Timer(0.3, self.stops.answered, (self.name, FRAME_SNAPSHOT, doc)).start()
        elif self.answer == "other":  # an answer to another request (an earlier one, come late)
            self.stops.answered(self.name, FRAME_SNAPSHOT, dict(doc, ask=req["snapshot"] - 1))
        return True


def test_the_nodes_that_answered_are_the_ones_taken_and_the_rest_are_left_for_the_stop_command():
    stops = StreamAsks()
    procs = {"a": Stream(stops, "a"), "b": Stream(stops, "b", answer=False), "c": Stream(stops, "c", open_=False),
             "e": Stream(stops, "e", answer="error")}
    for name, p in procs.items():
        stops.attach(name, p)
    taken = stops.ask(["a", "b", "c", "d", "e"], 5.0, True, wait=0.5)
    assert taken == {"a"}  # b never answered, c's stdin is closed, d has no stream, e could not take it
    assert procs["a"].sent == [{"stop": 5.0, "peer_failed": True}] == procs["b"].sent
    assert procs["c"].sent == []


@pytest.mark.parametrize("what", ["stop", "snapshot"])
def test_a_stream_that_ends_is_not_waited_for(what):
    asks = StreamAsks()
    quiet = Stream(asks, "q", answer=False)
    asks.attach("q", quiet)
    threading.Timer(0.05, asks.detach, ("q", quiet)).start()
    done = threading.Event()
    ask = (lambda: asks.ask(["q"], 1.0, False, wait=600)) if what == "stop" else \
        (lambda: asks.snapshot(["q"], 1, 1.0, limit=600))
    threading.Thread(target=lambda: (ask(), done.set()), daemon=True).start()
    assert done.wait(60), f"the {what} waited for a stream that had ended"


def test_a_restarted_streams_old_end_does_not_detach_the_new_one_and_answers_count_per_request():
    stops = StreamAsks()
    old, new = Stream(stops, "n"), Stream(stops, "n")
    stops.attach("n", old)
    stops.attach("n", new)  # started again (a stall, a reconnect)
    stops.detach("n", old)
    assert stops.ask(["n"], 3.0, False, wait=5) == {"n"} and new.sent and not old.sent
    # a second request (a kill) is taken only on its own answer, not the first one's
    new.answer = False
    assert stops.ask(["n"], 0.0, False, wait=0.2) == set()
    assert [r["stop"] for r in new.sent] == [3.0, 0.0]


def test_a_snapshot_is_the_answers_of_its_own_request_within_the_limit_and_none_is_kept_after():
    asks = StreamAsks()
    procs = {n: Stream(asks, n, answer=a) for n, a in
             (("a", True), ("b", "late"), ("c", "other"), ("e", "error"), ("q", False))}
    procs["s"] = Stream(asks, "s", open_=False)
    for name, p in procs.items():
        asks.attach(name, p)
    got = asks.snapshot(["a", "b", "c", "e", "q", "s", "x"], 42, 3.0, limit=1.0)
    assert set(got) == {"a", "b", "e"}  # b late but within the limit; c answered another request
    assert got["a"]["ranks"] == [{"pid": 7, "rank": 0}] and got["e"]["error"]
    assert procs["a"].sent == [{"snapshot": 42, "wait": 3.0}] and procs["s"].sent == []
    assert asks.snaps == {}  # nothing waits now: an answer coming later is not kept
    asks.answered("q", FRAME_SNAPSHOT, {"ranks": [], "ask": 42})
    assert asks.snaps == {}


def test_snapshot_nodes_asks_the_verb_only_of_the_nodes_whose_stream_did_not_answer(monkeypatch):
    from orchestrator.node import agent

    asked = []

    def verb(cluster, call, names):
        asked.append(sorted(names))
        return {n: agent.Snapshot(({"pid": 9, "rank": 1},), 2.0) for n in names}

    monkeypatch.setattr(agent, "run", verb)
    monkeypatch.setattr(streamask, "SNAP_MARGIN_S", 0.5)
    asks = StreamAsks()
    for name, answer in (("a", True), ("e", "error"), ("q", False)):
        asks.attach(name, Stream(asks, name, answer=answer))
    got = snapshot_nodes(object(), asks, ["a", "e", "q", "x"], "run-1.a1", 0.1)
    assert asked == [["e", "q", "x"]]  # an error from the stream is asked again by the verb
    assert got["a"].ranks == ({"pid": 7, "rank": 0},) and got["a"].time == 1.0 and got["a"].error is None
    assert all(got[n].ranks == ({"pid": 9, "rank": 1},) for n in ("e", "q", "x"))


def test_clock_offsets_are_read_on_the_streams_and_by_date_only_where_a_stream_did_not_answer(monkeypatch):
    from orchestrator.runs.judge import stragglersnap
    from orchestrator.transport import NodeResult

    asked = []

    class Cluster:
        def run(self, command, nodes, timeout):  # `date` over SSH: the way without a stream
            asked.extend(nodes)
            return {n: NodeResult(n, 0, f"{time.time() - 1.0:.6f}\n", "") for n in nodes}

    monkeypatch.setattr(stragglersnap, "CLOCK_S", 0.3)
    asks = StreamAsks()
    a, q = Stream(asks, "a"), Stream(asks, "q", answer=False)
    asks.attach("a", a)
    asks.attach("q", q)
    t0 = time.monotonic()
    got = stragglersnap.clock_offsets(Cluster(), ["a", "q"], asks=asks)
    assert time.monotonic() - t0 < 3 * 0.3 + 0.25  # q's stream, silent the first time, was not waited for again
    assert sorted(asked) == ["q"] * 3  # three tries each way
    assert (len(a.sent), len(q.sent)) == (3, 1)
    assert got["a"][0] == pytest.approx(2.5, abs=0.2) and got["a"][1] < 0.2, got
    assert got["q"][0] == pytest.approx(-1.0, abs=0.2), got
    assert asks.clocks == {}
