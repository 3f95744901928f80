"""StreamStops: a stop asked through the attempt's open log streams, and what is left to the `stop`
command (runs/logs/streamstop.py). The node side's answer is tests/test_node_stream.py's; a whole
teardown through the streams, tests/test_standin_cluster.py's."""

import json
import threading

from orchestrator.runs.logs.streamstop import StreamStops


class Stream:
    """A node's stream as the control side holds it: send() writes its stdin; `answer` replies."""

    def __init__(self, stops, name, answer=True, open_=True):
        self.stops, self.name, self.answer, self.open, self.sent = stops, name, answer, open_, []

    def send(self, data):
        if not self.open:
            return False
        self.sent.append(json.loads(data))
        assert data.endswith(b"\n") and data.count(b"\n") == 1
        if self.answer is True:
            threading.Timer(0.01, self.stops.answered, (self.name, {"stop": self.sent[-1]["stop"]})).start()
        elif self.answer == "error":
            self.stops.answered(self.name, {"error": "OSError: no room"})
        return True


def test_the_nodes_that_answered_are_the_ones_taken_and_the_rest_are_left_for_the_stop_command():
    stops = StreamStops()
    procs = {"a": Stream(stops, "a"), "b": Stream(stops, "b", answer=False), "c": Stream(stops, "c", open_=False),
             "e": Stream(stops, "e", answer="error")}
    for name, p in procs.items():
        stops.attach(name, p)
    taken = stops.ask(["a", "b", "c", "d", "e"], 5.0, True, wait=0.5)
    assert taken == {"a"}  # b never answered, c's stdin is closed, d has no stream, e could not take it
    assert procs["a"].sent == [{"stop": 5.0, "peer_failed": True}] == procs["b"].sent
    assert procs["c"].sent == []


def test_a_stream_that_ends_is_not_waited_for():
    stops = StreamStops()
    quiet = Stream(stops, "q", answer=False)
    stops.attach("q", quiet)
    threading.Timer(0.05, stops.detach, ("q", quiet)).start()
    done = threading.Event()
    threading.Thread(target=lambda: (stops.ask(["q"], 1.0, False, wait=600), done.set()), daemon=True).start()
    assert done.wait(60), "ask waited for a stream that had ended"


def test_a_restarted_streams_old_end_does_not_detach_the_new_one_and_answers_count_per_request():
    stops = StreamStops()
    old, new = Stream(stops, "n"), Stream(stops, "n")
    stops.attach("n", old)
    stops.attach("n", new)  # started again (a stall, a reconnect)
    stops.detach("n", old)
    assert stops.ask(["n"], 3.0, False, wait=5) == {"n"} and new.sent and not old.sent
    # a second request (a kill) is taken only on its own answer, not the first one's
    new.answer = False
    assert stops.ask(["n"], 0.0, False, wait=0.2) == set()
    assert [r["stop"] for r in new.sent] == [3.0, 0.0]
