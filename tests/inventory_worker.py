"""Runs `clusterctl inventory check --json -i PATH` for one path per stdin line, in-process
(`orchestrator.cli.main`), in a process whose whole address space is capped at LIMIT_BYTES.

The fuzz tests start one worker and time each answer from the outside, so every case is
checked under the memory cap and a per-case timeout without paying interpreter start-up per
case. Each answer is one JSON line: {"rc": exit code, "out": stdout, "err": stderr}. A case
that needs more memory ends in MemoryError (exit 1, "internal error") or kills the worker;
one that runs too long gets no answer in time. Both fail the test.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import select
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

LIMIT_BYTES = 256 << 20


def serve() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nothing the code under test writes can corrupt the answers
    from orchestrator.cli import main

    proto.write("ready\n")
    for line in sys.stdin:
        path = line.rstrip("\n")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["inventory", "check", "--json", "-i", path])
        proto.write(json.dumps({"rc": rc, "out": out.getvalue(), "err": err.getvalue()}) + "\n")


class Worker:
    """The test side: starts `serve()` in a child process and times each answer."""

    def __init__(self, start_timeout: float = 120.0):
        env = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTERCTL_")}
        env["PYTHONPATH"] = str(REPO_ROOT)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.inventory_worker"], cwd=REPO_ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = self._answer(start_timeout)
        if first != "ready\n":
            self.close()
            raise RuntimeError(f"inventory worker did not start: {first!r}")

    def _answer(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline() if ready else None

    def check(self, path: str | os.PathLike, timeout: float) -> dict:
        """{"rc", "out", "err"} for one inventory; AssertionError when no answer comes within
        `timeout` seconds or the worker died (the worker is then restarted for the next case)."""
        path = os.fspath(path)
        assert "\n" not in path
        self.proc.stdin.write(path + "\n")
        self.proc.stdin.flush()
        line = self._answer(timeout)
        if not line:
            rc = self.proc.poll()
            self.close()
            self.__init__()
            raise AssertionError(f"no answer for {path} within {timeout}s" if rc is None
                                 else f"worker died (exit {rc}) on {path}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


if __name__ == "__main__":
    serve()
