"""The relay listens only on the address the other nodes use for its node, and takes its upstream
only from that upstream's address: a connection from anywhere else is closed before a byte of it
is read, even one that knows the token. Locally, on loopback addresses (all of 127/8 is this
machine's): 127.0.0.2 plays the node, 127.0.0.3 its upstream, 127.0.0.1 anyone else."""

import socket

import psutil

from orchestrator.transfer.archive import TarStream
from orchestrator.transfer.files import select_files
from tests.test_relay import _finish, _relay, data_tree


def connect(port, to="127.0.0.2", frm="127.0.0.1"):
    s = socket.create_connection((to, port), timeout=10, source_address=(frm, 0))
    return s


def listening_on(pid, port) -> set:
    """The addresses the relay (or a child of it) listens on at this port. Asked of the kernel,
    not by connecting: another test's server may hold the same port number on 127.0.0.1."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    return {c.laddr.ip for p in procs for c in p.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def closed_unheard(s) -> bool:
    """The relay closed this connection (EOF or reset) without answering."""
    try:
        return s.recv(10) == b""
    except ConnectionResetError:
        return True


def test_relay_listens_on_the_peers_address_and_takes_only_its_upstream(tmp_path):
    src = data_tree(tmp_path / "src", mb=1)
    files = select_files(str(src), ["data"])
    p = _relay(tmp_path, "--idle", "20", "--listen", "127.0.0.2")
    port = int(p.stdout.readline().split()[1])
    assert listening_on(p.pid, port) == {"127.0.0.2"}, "the relay listens where the peers do not look"
    p.stdin.write(b"token goodtoken\nlast\nsource tcp 127.0.0.3\n")
    p.stdin.flush()
    with connect(port) as stranger:  # the right token, from the wrong address
        stranger.sendall(b"goodtoken\n")
        assert closed_unheard(stranger)
    stream = TarStream(str(src), files)
    with connect(port, frm="127.0.0.3") as up:
        up.sendall(b"goodtoken\n")
        for chunk in stream:
            up.sendall(chunk)
    p.stdin.write(f"sha256 {stream.sha256}\n".encode())
    out, err = _finish(p)
    assert p.returncode == 0, err
    assert out.decode().splitlines()[-1] == f"done {stream.bytes} {len(files)}"
    assert (tmp_path / "wd/data/shakespeare/train1.bin").read_bytes() == \
        (src / "data/shakespeare/train1.bin").read_bytes()


def test_relay_whose_address_is_not_its_own_listens_everywhere_and_says_so(tmp_path):
    p = _relay(tmp_path, "--idle", "5", "--listen", "192.0.2.7")  # TEST-NET-1: on no interface here
    port = int(p.stdout.readline().split()[1])
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    p.stdin.write(b"token t\nlast\nsource stdin\n\0\0\0\0sha256 0\n")
    _, err = _finish(p)
    assert "192.0.2.7 is not one address of this node; listening on every address" in err.decode()
