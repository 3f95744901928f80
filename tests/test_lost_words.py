"""A lost node is told in one set of words (runs/logs/streams.py reconnect, runs/attempt.py node_ended):
the failure recorded after "node2 lost: no answer for 5.3s (...)" is that, not the first
silence's "no answer from the node for 2.5s". Pure: the connection is a fake that never answers."""

import time

import yaml

from orchestrator.errors import ConnectError
from orchestrator.inventory import parse_inventory
from orchestrator.runs.logs.streams import _Copy
from orchestrator.transport import ErrorKind, NodeResult

INV = parse_inventory(yaml.safe_dump({"nodes": [{"name": "node2", "host": "10.0.0.2"}]}), "<t>")
DOWN = "connect to host 10.0.0.2 port 22: No route to host (the host is down, its link is cut, or the address is wrong)"


class Silent:
    """A connection whose node stopped answering a moment ago; every reopen fails."""

    def __init__(self):
        self.last_heard = time.monotonic() - 0.2
        self.alive = False
        self.lost_reason = "no answer from the node for 2.5s (connection lost)"

    def reopen(self, timeout=None):
        raise ConnectError("node2", DOWN)


class Cluster:
    lost_timeout = 0.3
    connections = {"node2": Silent()}


def test_a_node_found_lost_ends_with_the_words_its_loss_was_told_in():
    told = []
    copy = _Copy(Cluster(), None, list(INV.nodes), lambda res, st: None, None, told.append, None, "r@node2")
    copy.tell = lambda text, **about: told.append(text)  # Book.tell takes the event data too
    copy.recover(NodeResult("node2", None, error=Cluster.connections["node2"].lost_reason, kind=ErrorKind.LOST))
    final = copy.events.get_nowait()
    lost = [t for t in told if t.startswith("node2 lost: ")]
    assert len(lost) == 1 and final.kind is ErrorKind.LOST and f"node2 lost: {final.error}" == lost[0], (final, told)
    assert lost[0].endswith(f"({DOWN})"), told  # the node's name once, in front
