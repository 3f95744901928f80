"""transport/engine.py open_all: a round's commands opened at once, in order, and none left running
unowned when one open raises."""

import threading

import pytest

from orchestrator.transport.engine import open_all


class Opened:
    def __init__(self, item):
        self.item, self.killed, self.closed = item, False, False

    def kill(self):
        self.killed = True

    def close(self):
        self.closed = True


@pytest.mark.parametrize("at_once", [1, 4])
def test_the_opened_procs_come_back_in_the_order_given_without_the_ones_that_could_not_open(at_once):
    got = open_all(list(range(10)), lambda i: None if i % 3 == 0 else Opened(i), at_once=at_once)
    assert [p.item for p in got] == [1, 2, 4, 5, 7, 8]
    assert not any(p.killed or p.closed for p in got)


def test_no_more_than_at_once_opens_run_together():
    lock, now, most = threading.Lock(), [0], [0]
    gate = threading.Barrier(3, timeout=10)  # three opens must be in flight together at some point

    def one(i):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        if i < 3:
            gate.wait()
        with lock:
            now[0] -= 1
        return Opened(i)
    assert len(open_all(list(range(12)), one, at_once=3)) == 12
    assert most[0] == 3


@pytest.mark.parametrize("at_once", [1, 4])
def test_an_open_that_raises_leaves_no_command_it_did_not_hand_back_running(at_once):
    made = []

    def one(i):
        if i == 2:
            raise RuntimeError("the channel broke")
        made.append(Opened(i))
        return made[-1]
    with pytest.raises(RuntimeError, match="the channel broke"):
        open_all(list(range(6)), one, at_once=at_once)
    assert made and all(p.killed and p.closed for p in made)
    if at_once == 1:
        assert [p.item for p in made] == [0, 1]  # one after the other: nothing opened after the error
