"""The tests' process scans (tests/conftest.py scan, ended, pid_ended) skip a process that ends
between the listing and the read instead of raising psutil's NoSuchProcess from the test."""

import subprocess
import sys

import psutil

from tests.conftest import VANISHED, ended, pid_ended, scan, wait_for


class Vanishing:
    """A listed process that is gone when it is read."""

    pid = 999999

    def __init__(self, error):
        self.error = error

    def cmdline(self):
        raise self.error

    def is_running(self):
        raise self.error


def test_a_process_that_ended_after_the_listing_is_left_out():
    here = psutil.Process()
    errors = [psutil.NoSuchProcess(999999), psutil.ZombieProcess(999999), psutil.AccessDenied(999999)]
    assert all(isinstance(e, VANISHED) for e in errors)
    found = scan([Vanishing(errors[0]), here, Vanishing(errors[1]), Vanishing(errors[2])])
    assert found == [(here, " ".join(here.cmdline()))]
    assert scan([here], lambda p: p.pid) == [(here, here.pid)]
    assert all(ended(Vanishing(e)) for e in errors[:2])


def test_ended_sees_a_zombie_and_a_reaped_process():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    proc = psutil.Process(p.pid)
    assert not ended(psutil.Process())
    try:  # exited, not reaped yet: a zombie
        wait_for(lambda: proc.status() == psutil.STATUS_ZOMBIE, 10, "the child to exit")
        assert ended(proc) and pid_ended(p.pid)
    finally:
        p.wait(10)
    assert ended(proc) and pid_ended(p.pid) and scan([proc]) == []
