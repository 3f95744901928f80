"""A rank's exit waits, at most SETTLE_S, while another of its threads is still running: gloo's
worker thread frees a finished collective's tensors (taking the GIL) after the collective's
wait() returned, and a rank that exits at once (`sys.exit(3)` mid-run) used to reach Python's
finalization first, the worker then ending in std::terminate: exit code 3 reported as SIGABRT
(bench/bench_exit_abort.py measures that race on real torchrun ranks). Here a Python thread
that runs on past the main thread's exit stands in for the worker: it finishes, and the rank's
exit code is its own."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

HOOK = Path(__file__).parent.parent / "orchestrator" / "remote" / "hook"

RANK = textwrap.dedent("""
    import atexit, sys, threading, time
    distributed = sys.argv[1] != "0"
    if distributed:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://" + sys.argv[2] + ".pg", rank=0, world_size=1)

    def work():  # runnable for 0.2 s after the main thread is done, then leaves its mark
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            pass
        open(sys.argv[2], "w").write("done")

    start = lambda: threading.Thread(target=work, daemon=True).start()
    if sys.argv[1] == "atexit":  # the script's own exit handler starts it
        atexit.register(start)
    else:
        start()
    sys.exit(3)
""")


def run_rank(tmp_path, mode: str):
    """mode: "1" torch.distributed initialised, "0" not, "atexit" initialised and the thread
    started by the script's own atexit handler."""
    fifos = tmp_path / "hook"
    fifos.mkdir(exist_ok=True)
    mark = tmp_path / f"mark-{mode}"
    env = dict(os.environ, PYTHONPATH=str(HOOK), CLUSTERCTL_HOOK_DIR=str(fifos), RANK="0")
    p = subprocess.run([sys.executable, "-c", RANK, mode, str(mark)], env=env,
                       capture_output=True, text=True, timeout=120)
    return p, mark


def test_a_ranks_exit_waits_for_its_running_thread_and_keeps_its_exit_code(tmp_path):
    p, mark = run_rank(tmp_path, "1")
    assert p.returncode == 3, p.stderr
    assert mark.exists(), "the rank ended while its other thread was still running"


def test_the_wait_comes_after_the_scripts_own_exit_handlers(tmp_path):
    """The hook registers its wait before the script runs, so atexit runs it last: a thread the
    script's handler starts (a checkpoint flush, a logger) is waited for too."""
    p, mark = run_rank(tmp_path, "atexit")
    assert p.returncode == 3, p.stderr
    assert mark.exists(), "the wait ran before the script's exit handler started its thread"


def test_a_process_without_a_process_group_exits_at_once(tmp_path):
    p, mark = run_rank(tmp_path, "0")
    assert p.returncode == 3, p.stderr
    assert not mark.exists(), "the exit waited though torch.distributed was never initialised"


def test_runnable_counts_a_running_thread_and_not_a_waiting_one(tmp_path):
    code = textwrap.dedent("""
        import sitecustomize as hook, threading, time
        me = str(threading.get_native_id())
        stop = threading.Event()
        waiting = threading.Thread(target=stop.wait, daemon=True)
        waiting.start()
        time.sleep(0.1)
        idle = hook._runnable(me)
        def spin():
            while not stop.is_set():
                pass
        threading.Thread(target=spin, daemon=True).start()
        busy = 0
        for _ in range(50):  # the spinner runs while this thread reads /proc or sleeps
            busy = max(busy, hook._runnable(me))
            time.sleep(0.002)
        stop.set()
        print(idle, busy)
    """)
    env = dict(os.environ, PYTHONPATH=str(HOOK))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1"], out.stdout
