"""A failed connect is named as OpenSSH names it: pure, from what ssh and paramiko said for each
fault on the test cluster (tests/fixtures/ssh_errors, recorded by its record.py)."""

import base64
import errno
import json
import socket
from pathlib import Path

import paramiko
import pytest

from orchestrator.errors import AuthRefused, HostKeyError
from orchestrator.transport.faults import Fault, explain
from orchestrator.transport.ssh import _classified

FIX = Path(__file__).parent / "fixtures" / "ssh_errors"
CASES = sorted(p.stem for p in FIX.glob("*.json"))

# what ssh printed last -> the fault it names: its own words, read from the recording
SSH_SAYS = [("No route to host", Fault.NO_ROUTE), ("Connection refused", Fault.REFUSED),
            ("Connection timed out", Fault.TIMED_OUT), ("Could not resolve hostname", Fault.UNRESOLVED),
            ("Permission denied", Fault.AUTH), ("REMOTE HOST IDENTIFICATION HAS CHANGED", Fault.HOST_KEY_CHANGED),
            ("Host key verification failed", Fault.HOST_KEY_UNKNOWN)]


def key(line: str) -> paramiko.PKey:
    kind, b64 = line.split()[:2]
    return paramiko.PKey.from_type_string(kind, base64.b64decode(b64))


def load(name):
    return json.loads((FIX / f"{name}.json").read_text())


def raised(doc: dict) -> BaseException:
    """The exception paramiko raised, made again from its recording."""
    kind = doc["type"]
    if kind.endswith("NoValidConnectionsError"):
        return paramiko.ssh_exception.NoValidConnectionsError(
            {tuple(e["addr"]): OSError(e["errno"], e["strerror"]) for e in doc["errors"]})
    if kind.endswith("BadHostKeyException"):
        got, expected = (key(doc[k]) for k in ("got", "expected"))
        return paramiko.BadHostKeyException(doc["hostname"], got, expected)
    if kind.endswith("AuthenticationException"):
        return paramiko.AuthenticationException(doc["str"])
    if kind == "socket.gaierror":
        return socket.gaierror(doc["errno"], doc["strerror"])
    if kind == "builtins.TimeoutError":
        return TimeoutError(doc["str"])
    raise AssertionError(f"no way to raise {kind} again")


def ssh_fault(stderr: str) -> Fault:
    """The fault ssh named: the first of SSH_SAYS in its output (a changed key's banner comes
    before its closing 'Host key verification failed')."""
    return next(f for words, f in SSH_SAYS if words in stderr)


def test_every_fault_asked_for_was_recorded():
    assert set(CASES) >= {"link_down", "port_closed", "firewall_drop", "host_key_changed", "host_key_unknown",
                          "auth_failed", "mistyped_address", "unresolvable"}, CASES


@pytest.mark.parametrize("case", [c for c in CASES if not load(c)["paramiko"]["type"].startswith("orchestrator.")])
def test_paramikos_exception_is_named_as_ssh_named_the_same_fault(case):
    doc = load(case)
    want = ssh_fault(doc["ssh"]["stderr"])
    fault, text = explain(raised(doc["paramiko"]), doc["host"], doc["port"], doc["user"], 5)
    assert fault is want, (case, doc["ssh"]["stderr"], text)
    assert want.value in text, text
    if want in (Fault.NO_ROUTE, Fault.REFUSED, Fault.TIMED_OUT):
        # ssh's own line, word for word: "ssh: connect to host H port 22: No route to host"
        line = doc["ssh"]["stderr"].strip().splitlines()[-1].removeprefix("ssh: ")
        assert text.startswith(line), (line, text)
    assert "connection refused" not in text.lower() or want is Fault.REFUSED, text


class At:
    """Where a connect went (ssh.py reads the failed hop's host, port and user)."""

    def __init__(self, doc):
        self.host, self.port, self.user = doc["host"], doc["port"], doc["user"]


def test_a_cut_link_is_no_route_not_a_refusal():
    """The issue's case: the link cut, or an address nobody holds: ssh says No route to host, and
    so does the error the transport raises (it said "connection refused ... is sshd running?")."""
    for case in ("link_down", "mistyped_address"):
        doc = load(case)
        assert "No route to host" in doc["ssh"]["stderr"], doc["ssh"]["stderr"]
        e = _classified("n2", raised(doc["paramiko"]), At(doc), 5)
        assert e.message.startswith(f"connect to host {doc['host']} port 22: No route to host"), e.message
        assert "refused" not in e.message and "sshd" not in e.message, e.message


def test_refusals_are_typed_so_retries_back_off():
    changed, auth, down = (load(c) for c in ("host_key_changed", "auth_failed", "link_down"))
    Conn = At(changed)
    e = _classified("n2", raised(changed["paramiko"]), Conn, 5)
    assert isinstance(e, HostKeyError) and e.refused and e.brief.startswith("host key changed"), e
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in str(e) and f"ssh-keygen -R {changed['host']}" in str(e)
    e = _classified("n2", raised(auth["paramiko"]), Conn, 5)
    assert isinstance(e, AuthRefused) and e.refused and "Permission denied" in str(e)
    e = _classified("n2", raised(down["paramiko"]), Conn, 5)
    assert not e.refused and e.brief.startswith(f"connect to host {Conn.host} port 22: No route to host"), e.brief


def test_the_unknown_host_key_names_as_ssh_does():
    """clusterctl's own host-key policy raises it (paramiko never sees the key as unknown)."""
    doc = load("host_key_unknown")
    assert ssh_fault(doc["ssh"]["stderr"]) is Fault.HOST_KEY_UNKNOWN
    assert doc["paramiko"]["verdict"] == "unknown"
    from orchestrator.transport.known_hosts import HostEntries, _HostKeyPolicy

    presented = key(load("host_key_changed")["paramiko"]["got"])
    with pytest.raises(HostKeyError) as e:
        _HostKeyPolicy("n2", 22, HostEntries(Path("/nonexistent/known_hosts"), doc["host"]), False).missing_host_key(
            None, doc["host"], presented)
    assert str(e.value).startswith(f"n2: {Fault.HOST_KEY_UNKNOWN.value}"), e.value


def test_errnos_paramiko_does_not_fold_are_named_too():
    """paramiko re-raises a connect error other than refused or unrouted as the OSError itself."""
    fault, text = explain(OSError(errno.ENETUNREACH, "Network is unreachable"), "10.9.0.1", 22, "u", 5)
    assert fault is Fault.NET_UNREACHABLE and text.startswith("connect to host 10.9.0.1 port 22: Network is unreachable")
