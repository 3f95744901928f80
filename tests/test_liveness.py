"""transport/liveness.py: a silent node is lost on evidence (other nodes answered since its ping,
its kernel answers no TCP handshake), never on a busy node's or a busy control machine's silence.
A cut link on the test cluster: test_lost_evidence_cluster.py."""

import socket
import time

import pytest

from orchestrator.transport.liveness import PROBE_S, SUSPECT_S, Heard, evidence, peer_address, probe


@pytest.fixture
def unanswering():
    """A listening address whose accept queue is full: Linux drops the next SYN, as a cut link does."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    held = []
    addr = srv.getsockname()
    for _ in range(8):  # fill the queue (never accepted)
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(addr)
        held.append(c)
    time.sleep(0.2)
    yield addr
    for c in held:
        c.close()
    srv.close()


@pytest.fixture
def answering():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    yield srv.getsockname()
    srv.close()


def refused_address():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    addr = s.getsockname()
    s.close()  # nothing listens there now: the kernel answers with a reset
    return addr


def test_a_kernel_that_answers_or_refuses_is_not_evidence(answering):
    assert probe(answering) is None
    assert probe(refused_address()) is None


def test_no_handshake_is_evidence(unanswering):
    assert probe(unanswering, timeout=0.5) == "no TCP handshake within 0.5s"


def test_lost_needs_both_facts(unanswering, answering):
    heard = Heard()
    sent = time.monotonic()
    heard.mark("n2", sent + 0.1)  # the suspect itself answering earlier pings counts for nothing
    assert evidence("n2", unanswering, heard, sent) is None  # nobody else answered since
    heard.mark("n1", sent - 1)
    assert evidence("n2", unanswering, heard, sent) is None  # answered before the ping went out
    heard.mark("n1", sent + 0.5)
    assert evidence("n2", answering, heard, sent) is None  # its kernel answers: busy, not gone
    assert evidence("n2", None, heard, sent) is None  # behind a gateway: no address to probe
    assert evidence("n2", unanswering, None, sent) is None  # the rule is off
    why = evidence("n2", unanswering, heard, sent)
    assert why is not None and why.startswith("no answer for ")
    assert f"its SSH port 127.0.0.1:{unanswering[1]} does not answer (no TCP handshake within 1s) while n1 does" in why


def test_many_answering_nodes_are_named_briefly(unanswering):
    heard = Heard()
    sent = time.monotonic()
    for k in range(1, 7):
        heard.mark(f"n{k}", sent + 1)
    why = evidence("n9", unanswering, heard, sent)
    assert why.endswith("while n1, n2, n3 and 3 more do"), why


def test_the_peer_address_of_a_direct_socket_and_of_none(answering):
    class Gateway:
        sock = object()  # a ProxyJump channel, a ProxyCommand

    assert peer_address(Gateway()) is None
    with socket.create_connection(answering) as c:
        class Direct:
            sock = c

        assert peer_address(Direct()) == answering


def test_a_clusters_own_probe_timeout_is_the_one_evidence_waits(unanswering):
    """A larger cluster's suspects get a longer handshake probe (runs/scaling.py), carried by its Heard."""
    heard = Heard(suspect_s=4.0, probe_s=0.5)
    sent = time.monotonic()
    heard.mark("n1", sent + 0.5)
    why = evidence("n2", unanswering, heard, sent)
    assert why is not None and "(no TCP handshake within 0.5s)" in why, why
    assert Heard().suspect_s == SUSPECT_S and Heard().probe_s == PROBE_S
