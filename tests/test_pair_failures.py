"""A node-to-node copy that fails says which end failed first, and no line either end prints can
break the control side (transfer/pair.py): pure, no cluster."""

import yaml

from orchestrator.inventory import parse_inventory
from orchestrator.transfer.pair import CodePair
from orchestrator.transport import ErrorKind, NodeResult

INV = parse_inventory(yaml.safe_dump({"nodes": [{"name": "n1", "host": "10.0.0.1"},
                                                {"name": "n5", "host": "10.0.0.5"}]}), "<t>")


def pair():
    return CodePair(None, INV.node("n1"), INV.node("n5"), ["train.py"])


def test_any_line_from_the_sender_is_read_without_breaking_the_copy():
    """A blank line (the donor cut mid-copy printed one) once crashed the supervisor with
    `ValueError: not enough values to unpack` and ended the run as an internal error."""
    p = pair()
    for stream in ("stdout", "stderr"):
        for line in ("", "   ", "sent", "sent x y", "sent 12", "Traceback (most recent call last):"):
            p.on_send_line("n1", stream, line)
    assert p.sent is None
    p.on_send_line("n1", "stderr", "sent 12 abc")  # only stdout says what was sent
    assert p.sent is None
    p.on_send_line("n1", "stdout", "sent 12 abc")
    assert p.sent == (12, "abc")


def test_a_receiver_cut_before_it_listened_is_named_not_the_senders_protocol_complaint():
    """The spare cut during the code copy: its receiver never said where to send, so the donor's
    stdin ended without `to HOST PORT TOKEN`; the spare is what failed."""
    p = pair()
    sender = NodeResult("n1", 1, stderr="protocol error: expected 'to HOST PORT TOKEN'\n")
    lost = NodeResult("n5", None, error="no answer from the node for 2.5s (connection lost)", kind=ErrorKind.LOST)
    detail = p.failure(sender, lost)
    assert detail == "receiving on n5: no answer from the node for 2.5s (connection lost)", detail
    assert "protocol error" not in detail


def test_the_end_that_went_away_is_named_whichever_it_was():
    p = pair()
    p.port = 40000  # the receiver listened; then the donor went away mid-stream
    gone = NodeResult("n1", None, error="no answer from the node for 2.5s (connection lost)", kind=ErrorKind.LOST)
    waiting = NodeResult("n5", 1, stderr="relay: nothing from the sender for 60s\n")
    assert p.failure(gone, waiting).startswith("sending from n1: no answer from the node")
    # both ran to an end: the sender's own failure first, as before
    assert p.failure(NodeResult("n1", 2, stderr="relay: disk full\n"), waiting) == "sending from n1: disk full"
