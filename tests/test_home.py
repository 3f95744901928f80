"""orchestrator/home.py: the control machine's state directory, and the one lock its shared state
files (quarantine.json, node-faults.jsonl) are changed under."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.home import locked
from orchestrator.inventory import parse_inventory
from orchestrator.runs import nodefaults, quarantine

ROOT = Path(__file__).resolve().parent.parent
N2 = parse_inventory("nodes:\n  - {name: n2, host: 10.0.0.2}\n").nodes[0]

HOLD = """
import sys
from pathlib import Path
from orchestrator.home import locked
with locked(Path(sys.argv[1])) as p:
    print(p, flush=True)
    sys.stdin.readline()
"""


def test_locked_makes_the_directory_and_hands_back_the_path(tmp_path):
    target = tmp_path / "not" / "yet" / "state.json"
    with locked(target) as p:
        assert p == target and (tmp_path / "not" / "yet" / "state.lock").is_file()
    with locked(target):  # released at the block's end: taken again at once
        pass


@pytest.mark.parametrize("change", ["quarantine", "nodefaults"])
def test_each_state_file_waits_for_the_same_lock_another_process_holds(home, change):
    path = quarantine.path() if change == "quarantine" else nodefaults.path()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == str(path)  # held
        if change == "quarantine":
            writer = threading.Thread(target=quarantine.add, args=([N2], {"n2": "why"}, None))
        else:
            fault = nodefaults.Fault("n2", "10.0.0.2", "lost", "run-a", 1, time.time())
            writer = threading.Thread(target=nodefaults.record, args=([fault],))
        writer.start()
        writer.join(0.5)
        assert writer.is_alive()  # it waits for the other process's lock
        holder.stdin.write("\n")
        holder.stdin.flush()
        writer.join(60)
        assert not writer.is_alive()
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(10)
    if change == "quarantine":
        assert list(quarantine.of([N2])) == ["n2"]
    else:
        assert len(nodefaults.load()) == 1
