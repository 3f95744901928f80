"""The relay's accept (remote/relay_gate.py accept_upstream, relay.py recv's, the code the nodes run) under hostile
clients: a slow-loris that trickles bytes, a flood of idle connections, wrong tokens. The real
upstream is let in all the same, and nobody else is. Before, the relay read each connection's
token in turn with up to 10 s per read: one trickling client held it until its idle deadline
(issue 23: a 4-node sync failed after 4 min 22 s)."""

import socket
import threading
import time

import pytest

from orchestrator.probe import load

relay = load("relay_gate")  # relay.py recv's port and token gate
TOKEN = "a" * 32


def listener():
    return socket.create_server(("127.0.0.1", 0), backlog=relay.LISTEN_BACKLOG)


def accept_in_thread(lsock, idle):
    out = {}

    def run():
        try:
            out["conn"] = relay.accept_upstream(lsock, TOKEN, idle)
        except relay.Failed as e:
            out["error"] = str(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_slow_loris_and_a_flood_do_not_keep_the_real_upstream_out():
    lsock = listener()
    port = lsock.getsockname()[1]
    t, out = accept_in_thread(lsock, idle=20)
    stop = threading.Event()

    def loris():  # one byte a second: the 33-byte token would take 33 s, past the idle deadline
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        for b in (TOKEN + "\n").encode():
            if stop.wait(1.0):
                break
            try:
                s.send(bytes([b]))
            except OSError:
                break
        s.close()

    threading.Thread(target=loris, daemon=True).start()
    time.sleep(0.3)
    flood = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(300)]
    wrong = socket.create_connection(("127.0.0.1", port), timeout=5)
    wrong.sendall(b"b" * 32 + b"\n")
    wrong.settimeout(10)
    real = socket.create_connection(("127.0.0.1", port), timeout=5)
    real.sendall(TOKEN.encode() + b"\nstream")
    try:
        t.join(30)
        assert "conn" in out, out
        assert out["conn"].recv(6) == b"stream"  # the real one, its stream right behind the token
        assert wrong.recv(1) == b""  # refused
    finally:
        stop.set()
        for s in flood + [wrong, real]:
            s.close()
        if "conn" in out:
            out["conn"].close()
        lsock.close()


def test_a_connection_that_never_finishes_its_token_is_dropped(monkeypatch):
    monkeypatch.setattr(relay, "TOKEN_S", 0.5)
    lsock = listener()
    port = lsock.getsockname()[1]
    t, out = accept_in_thread(lsock, idle=10)
    half = socket.create_connection(("127.0.0.1", port), timeout=5)
    half.sendall(TOKEN[:10].encode())
    half.settimeout(10)
    try:
        assert half.recv(1) == b""  # closed by the relay once its TOKEN_S ran out
        real = socket.create_connection(("127.0.0.1", port), timeout=5)
        real.sendall(TOKEN.encode() + b"\n")
        t.join(10)
        assert "conn" in out, out
        real.close()
        out["conn"].close()
    finally:
        half.close()
        lsock.close()


def test_no_upstream_within_idle_fails_with_the_reason():
    lsock = listener()
    t, out = accept_in_thread(lsock, idle=0.5)
    t.join(10)
    lsock.close()
    assert out == {"error": "no upstream node connected within 0.5s"}


@pytest.mark.parametrize("extra", [0, 1])
def test_more_pending_connections_than_slots_drop_the_oldest(monkeypatch, extra):
    monkeypatch.setattr(relay, "MAX_PENDING", 4)
    lsock = listener()
    port = lsock.getsockname()[1]
    t, out = accept_in_thread(lsock, idle=10)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4 + extra)]
    real = socket.create_connection(("127.0.0.1", port), timeout=5)
    real.sendall(TOKEN.encode() + b"\n")
    try:
        t.join(10)
        assert "conn" in out, out
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""  # the oldest made room for the newer ones
    finally:
        for s in idle + [real]:
            s.close()
        if "conn" in out:
            out["conn"].close()
        lsock.close()
