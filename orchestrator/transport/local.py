"""`connection: local`: commands run on the control machine as subprocesses."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import threading
import time

from orchestrator.home import user_umask, users_env
from orchestrator.transport.base import Connection, Proc


def _nonblock(fd: int) -> None:
    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)


class _LocalProc(Proc):
    def __init__(self, node: str, popen: subprocess.Popen):
        self.node, self.p, self.started = node, popen, time.monotonic()
        self._open = {popen.stdout.fileno(): "out", popen.stderr.fileno(): "err"}
        for fd in self._open:
            _nonblock(fd)

    def fds(self) -> list[int]:
        return list(self._open)  # a pipe at EOF stays readable forever: it is no longer offered

    def read(self):
        chunks = {"out": b"", "err": b""}
        for fd, which in list(self._open.items()):
            while True:
                try:
                    data = os.read(fd, 1 << 20)
                except BlockingIOError:
                    break
                if not data:
                    del self._open[fd]
                    break
                chunks[which] += data
        return chunks["out"], chunks["err"]

    def done(self):
        return not self._open and self.p.poll() is not None

    def exit_code(self):
        rc = self.p.poll()
        if rc is None:
            return None
        return 128 - rc if rc < 0 else rc  # killed by signal N -> 128+N, like a shell

    def lost_reason(self) -> str | None:
        return None  # a local subprocess has no link to lose

    def kill(self):
        # the command's own process group (start_new_session): the shell and everything it
        # started, except what left the group on purpose (the node agent's detached run)
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def send(self, data):
        try:
            self.p.stdin.write(data)
            self.p.stdin.flush()
            return True
        except (OSError, ValueError, AttributeError):  # it ended (a broken pipe), or its stdin was never kept
            return False

    def close(self):
        for f in (self.p.stdout, self.p.stderr, self.p.stdin):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self._open.clear()
        if self.p.poll() is None:
            self.kill()
        try:
            self.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class LocalConnection(Connection):
    """`connection: local`: run on the control machine, no SSH (Ansible's local)."""

    def open(self):
        pass

    def exec(self, command, *, stdin=None, keep_stdin=False):
        p = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE if stdin is not None or keep_stdin
                             else subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True,  # cwd: where clusterctl runs
                             env=users_env(), umask=user_umask())  # the user's, not clusterctl's, as an SSH session gets
        if keep_stdin:
            if stdin:
                p.stdin.write(stdin)
                p.stdin.flush()
        elif stdin is not None:
            chunks = [stdin] if isinstance(stdin, (bytes, bytearray, memoryview)) else stdin

            def feed():  # bytes, or an iterable of byte chunks (a stream); then EOF
                try:
                    for chunk in chunks:
                        p.stdin.write(chunk)
                        p.stdin.flush()
                except Exception:  # noqa: BLE001 - the command exited, or the producer failed
                    pass
                finally:
                    try:
                        p.stdin.close()
                    except OSError:
                        pass
            threading.Thread(target=feed, daemon=True).start()
        return _LocalProc(self.node.name, p)

    def close(self):
        pass
