"""The rank hook (remote/hook/sitecustomize.py) answers every request written to its FIFO, also
two written at once: the straggler watch asks every rank for its steps every 5-10 s, and a stack
asked by `clusterctl stack` or `watch` at that moment used to be read in the same read, glued to
it, and neither was answered ("no answer within 10s")."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HOOK = Path(__file__).parent.parent / "orchestrator" / "remote" / "hook"


def test_two_requests_written_at_once_are_both_answered(tmp_path):
    fifos = tmp_path / "hook"
    fifos.mkdir()
    env = dict(os.environ, PYTHONPATH=str(HOOK), CLUSTERCTL_HOOK_DIR=str(fifos), RANK="0")
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        fifo = fifos / f"{p.pid}.fifo"
        deadline = time.time() + 20
        while not fifo.exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # the hook's thread is waiting in open() for a writer
        a = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # two askers, both before the hook reads
        b = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.write(a, b"p111\n")
        os.write(b, b"222\n")
        os.close(a)
        os.close(b)
        answers = [fifos / f"{p.pid}.p111.json", fifos / f"{p.pid}.222.json"]
        while not all(x.exists() for x in answers) and time.time() < deadline + 10:
            time.sleep(0.05)
        assert [x.exists() for x in answers] == [True, True], sorted(os.listdir(fifos))
        assert json.loads(answers[1].read_text())["stacks"][0]["thread"] == "MainThread"
        assert "steps" in json.loads(answers[0].read_text())
    finally:
        p.kill()
        p.wait()
