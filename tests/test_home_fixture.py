"""The `home` fixture's clean-up (tests/conftest.py): what a failed test left running under its
CLUSTERCTL_HOME is ended, and nothing else."""

import os
import subprocess
import sys

import psutil

from tests.conftest import kill_home_processes, wait_for


def test_every_process_of_a_tests_home_is_killed_and_no_other(tmp_path):
    """A failed test's foreground `train` left running adopted its run again once the supervisor
    was killed, and reached the next test's nodes: it is killed with the rest of its home's
    processes, a child it started included; a process of another home is left alone."""
    home, other = tmp_path / "cchome", tmp_path / "other"
    spawner = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
               "time.sleep(300)']); time.sleep(300)")
    mine = subprocess.Popen([sys.executable, "-c", spawner], env=dict(os.environ, CLUSTERCTL_HOME=str(home)))
    theirs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                              env=dict(os.environ, CLUSTERCTL_HOME=str(other)))
    try:
        child = wait_for(lambda: psutil.Process(mine.pid).children(), 30, "the foreground's child")[0]
        kill_home_processes(home)
        mine.wait(10)  # its status was reaped by the clean-up's wait: gone is what counts
        assert not psutil.pid_exists(mine.pid)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE  # killed (not yet reaped)
        assert theirs.poll() is None
    finally:
        for p in (mine, theirs):
            p.kill()
            p.wait(10)
