"""A straggler's node left out (--on-straggler replace) is stopped as a user's stop is, so the job
saves; once every node that stays in the run has ended, that save is over and the left-out node
is stopped as after a failure rather than waited for (a rank held to 15 % of a core took 3.6 s to
exit by itself; runs/attempt.py AttemptRunner.kill_left_out). Never a node holding rank 0, which
may still be writing the checkpoint. Pure: the real Book and AttemptRunner (tests/recordrun.py)."""

import time

import pytest

from tests.recordrun import end, running

pytestmark = pytest.mark.usefixtures("home")


def left_out(node, n=4, run_id="r-w"):
    run, book, runner = running(n, run_id=run_id)
    line = f"straggler: {node} rank 1 computes 6.0x the median"
    runner.straggler = (line, (node,))  # as on_straggler leaves it out
    runner.policy.failed(node, None, line)
    assert runner.stopper.asked.wait(5) and runner.stopper.calls == [(list(runner.statuses), False)]  # the save's stop
    runner.stopper.calls.clear()
    return runner


def stops_after(runner, ends, within=5.0):
    for i, name in enumerate(ends):
        end(runner, name, 0, 100.0 + i)
    deadline = time.monotonic() + within
    while not runner.stopper.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    return runner.stopper.calls


def test_the_left_out_node_is_killed_once_every_other_node_ended():
    runner = left_out("n2")
    assert stops_after(runner, ["n1", "n3"], within=0.3) == [] and not runner.out_killed  # n4 runs: its save may need n2
    assert stops_after(runner, ["n4"]) == [(["n2"], True)]  # as after a failure: killed unless writing a checkpoint
    end(runner, "n2", 137, 110.0)
    assert runner.stopper.calls == [(["n2"], True)]  # once


def test_a_left_out_node_holding_rank_0_is_waited_for():
    runner = left_out("n1")  # rank 0: the usual saver, maybe still writing when the others are gone
    assert stops_after(runner, ["n2", "n3", "n4"], within=0.5) == []  # (no stop is started at all: nothing to wait for)


def test_no_kill_without_a_straggler_or_after_a_users_stop():
    runner = running(3)[2]
    assert stops_after(runner, ["n1", "n2"], within=0.3) == [] and not runner.out_killed
    runner = running(3, stop_requests=1, run_id="r-w2")[2]
    runner.straggler = ("straggler: n2", ("n2",))
    assert stops_after(runner, ["n1", "n3"], within=0.3) == [] and not runner.out_killed
