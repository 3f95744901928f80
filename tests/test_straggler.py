"""Stragglers (runs/judge/straggler.py): the rule on recorded-shape numbers, the watch's naming and
recovery, the rank's side (the hook's progress answer through the node agent as shipped) and the
trainer's compute clock, which leaves the waits out."""

import json
import os
import statistics
import sys
import time

import pytest
import torch

from orchestrator.runs.judge.straggler import (CONFIRM, KEEP, SUSTAIN_S, Slow, StragglerWatch, describe, judge, merge,
                                               sustained)
from tests.conftest import wait_for
from tests.test_hang import HOOK
from tests.test_node_agent import agent, rundir  # noqa: F401 - fixture
from trainer.progress import StepClock

NODES = {0: "n1", 1: "n2", 2: "n3", 3: "n4"}


def healthy(steps=60, base=0.185):
    # every rank within +-10 % of the others, with a rank that is a little slower throughout
    return {r: [base * (1 + 0.1 * ((s * 7 + r * 3) % 5 - 2) / 2) * (1.08 if r == 3 else 1) for s in range(steps)]
            for r in range(4)}


def test_a_rank_computing_persistently_slower_is_named_with_its_node_and_by_how_much():
    samples = healthy()
    samples[2] = [0.480] * 60
    [s] = judge(samples, NODES, window=50, factor=1.3)
    assert (s.rank, s.node, s.steps) == (2, "n3", 50) and s.compute_s == pytest.approx(0.48)
    assert describe([s]) == f"straggler: n3 rank 2 computes {s.ratio:.1f}x the median ({s.compute_s * 1e3:.0f} ms " \
                            f"vs {s.median_s * 1e3:.0f} ms over the last 50 steps)"
    assert s.ratio > 2.3


def test_a_healthy_run_with_jitter_names_nobody():
    assert judge(healthy(), NODES, window=50, factor=1.3) == []
    noisy = healthy()
    noisy[1][-10:] = [1.0] * 10  # a burst of ten slow steps (an evaluation, a checkpoint) is not persistent
    assert judge(noisy, NODES, window=50, factor=1.3) == []
    tiny = {r: [0.0005 * (3 if r == 0 else 1)] * 60 for r in range(4)}  # 3x, but 1 ms: jitter, not a straggler
    assert judge(tiny, NODES, window=50, factor=1.3) == []


def test_nothing_is_judged_before_every_rank_has_a_window_or_with_one_rank():
    samples = healthy(steps=40)
    samples[2] = [0.48] * 40
    assert judge(samples, NODES, window=50) == []
    assert judge({0: [0.1] * 60}, NODES, window=50) == []
    assert judge({0: [0.1] * 60, 1: [0.5] * 60}, NODES, window=50, factor=0) == []  # 0: off


def test_two_ranks_on_one_node_are_named_once_with_the_worst():
    a, b = Slow(4, "n3", 0.40, 0.2, 50), Slow(5, "n3", 0.50, 0.2, 50)
    assert describe([a, b]) == "straggler: n3 ranks 4,5 compute 2.5x the median (500 ms vs 200 ms over the last 50 steps)"


def test_snapshots_merge_by_step_and_keep_the_newest():
    into = {}
    merge(into, [{"rank": 1, "answer": {"steps": [[1, 0.1], [2, 0.2]]}}, {"rank": 0, "error": "no hook"}], keep=3)
    merge(into, [{"rank": 1, "answer": {"steps": [[2, 0.2], [3, 0.3, 7.5], [4, 0.4, 7.9]]}}], keep=3)
    assert into == {1: {2: (0.2, None), 3: (0.3, 7.5), 4: (0.4, 7.9)}}  # when told, where the rank said


def watch(told, acted, window=5):
    return StragglerWatch(snap=lambda: [], node_of=NODES, tell=told.append, window=window, factor=1.3,
                          on_straggler=lambda new, cur: acted.append(([s.rank for s in new], cur)))


def docs(compute: dict[int, float], first: int, n: int):
    return [{"rank": r, "answer": {"steps": [[s, c] for s in range(first, first + n)]}} for r, c in compute.items()]


def test_the_watch_names_a_straggler_once_confirmed_and_says_when_it_recovered():
    told, acted = [], []
    w = watch(told, acted)
    slow = {0: 0.1, 1: 0.1, 2: 0.3, 3: 0.1}
    w.check(docs(slow, 0, 5))
    assert told == [] and acted == []  # slow once: not yet persistent
    for k in range(1, CONFIRM):
        w.check(docs(slow, 5 * k, 5))
    assert told == ["straggler: n3 rank 2 computes 3.0x the median (300 ms vs 100 ms over the last 5 steps)"]
    assert acted == [([2], told[0])] and w.current == told[0]
    w.check(docs(slow, 100, 5))
    assert len(told) == 1  # named once
    even = {r: 0.1 for r in range(4)}
    for k in range(CONFIRM):
        w.check(docs(even, 200 + 5 * k, 5))
    assert told[-1] == "straggler: n3 rank 2 no longer computes slower than the median"
    assert acted[-1] == ([], None) and w.current is None


def test_a_shorter_period_asks_for_as_many_checks_as_span_the_same_persistence():
    """At a 5 s progress period (runs/scaling.py progress_s: 128 ranks) a rank slow on
    checks alone is named after 5 in a row (20-25 s), not 3 (10-15 s): a shorter period makes
    verdicts that the history proves (`sustained`) sooner, not glimpses more credulous."""
    from orchestrator.runs.judge.straggler import PERIOD_S

    told, acted = [], []
    w = StragglerWatch(snap=lambda: [], node_of=NODES, tell=told.append, window=5, factor=1.3, period=PERIOD_S / 2,
                       on_straggler=lambda new, cur: acted.append(([s.rank for s in new], cur)))
    assert (w.confirm, watch([], []).confirm) == (5, CONFIRM)
    slow = {0: 0.1, 1: 0.1, 2: 0.3, 3: 0.1}
    for k in range(4):  # overlapping windows: each check sees a few new steps (no disjoint history to prove it)
        w.check([{"rank": r, "answer": {"steps": [[s, c] for s in range(k, k + 5)]}} for r, c in slow.items()])
    assert told == []
    w.check([{"rank": r, "answer": {"steps": [[s, c] for s in range(4, 9)]}} for r, c in slow.items()])
    assert told == ["straggler: n3 rank 2 computes 3.0x the median (300 ms vs 100 ms over the last 5 steps)"]


def test_nobody_is_judged_while_the_warm_interpreters_import_nor_by_the_steps_they_slowed():
    """The run's warm interpreters import torch on the cores the ranks compute on (the goodput
    bench's fault-free run named node5 rank 4 at 1.9x while eight of them imported on 2 cores):
    the watch holds while any imports, then judges only steps the ranks made after. A rank's answer
    carries its newest steps, the slowed ones too: its first answer after the hold sets a floor."""
    told, acted, busy = [], [], ["n2", "n3"]
    w = StragglerWatch(snap=lambda: [], node_of=NODES, tell=told.append, window=5, factor=1.3, say=told.append,
                       on_straggler=lambda new, cur: acted.append(([s.rank for s in new], cur)), warming=lambda: busy)
    hist = {r: [] for r in range(4)}

    def answers(rank2: float) -> list:  # 5 steps more, every rank's newest 40 in its answer
        for r in range(4):
            hist[r] += [[len(hist[r]) + i, rank2 if r == 2 else 0.1] for i in range(5)]
        return [{"rank": r, "answer": {"steps": h[-40:]}} for r, h in hist.items()]

    for _ in range(2 * CONFIRM):  # rank 2 three times slower while they import: held, nobody named
        w.check(answers(0.3))
    assert [t for t in told if t.startswith("straggler:")] == [] and acted == []
    assert told == ["straggler watch: held while the run's warm interpreters import torch on n[2-3] (their import "
                    "takes the cores the ranks compute on)"]
    busy.clear()
    for _ in range(2 * CONFIRM):  # ready: each answer still carries the slowed steps, which no longer count
        w.check(answers(0.1))
    assert [t for t in told if t.startswith("straggler:")] == [] and acted == [], told
    assert told[1] == "straggler watch: the warm interpreters are ready; the ranks are judged again from their steps after"
    # the first answer since set each rank's floor (its newest step then): only later steps are kept
    assert all(w.hold.floor[r] == 2 * CONFIRM * 5 + 4 and min(w.steps[r]) == w.hold.floor[r] + 1 for r in range(4))
    for _ in range(CONFIRM):  # a rank that slows after the hold is named as ever
        w.check(answers(0.3))
    assert told[-1] == "straggler: n3 rank 2 computes 3.0x the median (300 ms vs 100 ms over the last 5 steps)", told


def throttled(steps: int, slow_from: int = 0, slow_s: float = 0.047, fast_s: float = 0.016):
    """Every rank at fast_s a step (+-5 %), rank 2 at slow_s from step `slow_from` (the goodput
    bench's straggler: 47 ms against 16 ms)."""
    return {r: [(slow_s if r == 2 and s >= slow_from else fast_s) * (1 + 0.05 * ((s + r) % 3 - 1))
                for s in range(steps)] for r in range(4)}


def test_a_straggler_proven_by_its_history_is_named_in_one_check():
    told, acted = [], []
    w = watch(told, acted, window=50)
    samples = throttled(300)  # 6 windows of 47 ms steps: 14 s of the rank's compute, every window slow
    assert [s.rank for s in sustained(samples, NODES, window=50)] == [2]
    w.check([{"rank": r, "answer": {"steps": [[s, v[s]] for s in range(300)]}} for r, v in samples.items()])
    assert told == ["straggler: n3 rank 2 computes 2.9x the median (47 ms vs 16 ms over the last 50 steps)"]
    assert acted == [([2], told[0])] and w.rounds == 1


def test_a_history_too_short_or_with_a_healthy_window_between_proves_nothing():
    need = int(SUSTAIN_S / 0.047 / 50) + 1  # windows of 47 ms steps that reach SUSTAIN_S
    assert CONFIRM <= need <= KEEP
    short = throttled(50 * (need - 1))  # every window slow, but under SUSTAIN_S of compute
    assert judge(short, NODES, window=50) and sustained(short, NODES, window=50) == []
    recent = throttled(50 * KEEP, slow_from=50 * (KEEP - need + 1))  # slow only since one window too few
    assert sustained(recent, NODES, window=50) == []
    gap = throttled(50 * KEEP)
    gap[2][-100:-50] = [0.016] * 50  # the window before the newest: as fast as the others
    assert sustained(gap, NODES, window=50) == []
    # 1.8x (under SEVERE), 5.4 s of compute in all the windows kept: under SUSTAIN_S
    fast = throttled(50 * KEEP, slow_s=0.018, fast_s=0.01)
    assert judge(fast, NODES, window=50) and sustained(fast, NODES, window=50) == []
    told, acted = [], []
    w = watch(told, acted, window=50)
    for k in range(CONFIRM):  # the checks in a row still name it
        assert told == []
        w.check([{"rank": r, "answer": {"steps": [[1000 * k + s, v[s]] for s in range(len(v))]}}
                 for r, v in fast.items()])
    assert told == ["straggler: n3 rank 2 computes 1.8x the median (18 ms vs 10 ms over the last 50 steps)"]


def test_the_span_is_read_on_the_ranks_clock_where_its_steps_say_when():
    """The goodput bench's straggler: 45 ms of compute in steps of 105 ms (it waits in the
    all-reduce too). 200 steps: 9 s of compute, under SUSTAIN_S, but 21 s of the rank's clock."""
    samples = throttled(200, slow_s=0.045, fast_s=0.013)
    clock = {r: [1000.0 + 0.105 * s for s in range(200)] for r in samples}
    assert sustained(samples, NODES, window=50) == []  # by compute alone: not yet
    assert [s.rank for s in sustained(samples, NODES, window=50, at=clock)] == [2]
    fast = {r: [1000.0 + 0.02 * s for s in range(200)] for r in samples}  # 4 s on its clock: not yet either
    assert sustained(samples, NODES, window=50, at=fast) == []
    told, acted = [], []
    w = watch(told, acted, window=50)
    w.check([{"rank": r, "answer": {"steps": [[s, v[s], clock[r][s]] for s in range(200)]}} for r, v in samples.items()])
    assert told and told[0].startswith("straggler: n3 rank 2 computes 3.")
    assert w.steps[2][199] == (samples[2][199], pytest.approx(1000.0 + 0.105 * 199))


def bench_straggler(slow_steps: int, slow_s: float = 0.045, fast_s: float = 0.013, before: int = 300):
    """The goodput bench's straggler `slow_steps` steps into its throttle, as one check sees it:
    `before` healthy steps of about 48 ms each, then steps of 105 ms (45 ms of compute), the
    rank's clock saying when each was told."""
    samples = throttled(before + slow_steps, slow_from=before, slow_s=slow_s, fast_s=fast_s)
    clock = [1000.0 + 0.048 * min(s, before) + 0.105 * max(0, s - before) for s in range(before + slow_steps)]
    return [{"rank": r, "answer": {"steps": [[s, v[s], clock[s]] for s in range(len(v))]}} for r, v in samples.items()]


def test_a_rank_at_twice_the_median_is_named_after_seconds_not_a_whole_window_history():
    """SEVERE: 3.5x the median in each of its newest short windows (window / 5 steps) spanning
    SEVERE_S on its clock names it in one check: at 105 ms a step, 40 steps (4.2 s) in, where the
    windows of 50 steps need 150 (16 s). Short of SEVERE_S of such steps, nothing yet."""
    from orchestrator.runs.judge.straggler import SEVERE_S

    need = int(SEVERE_S / 0.105) + 2  # steps whose told times span SEVERE_S, and a whole short window
    for steps, named in ((need - 10, False), (need + 9, True)):
        told, acted = [], []
        w = watch(told, acted, window=50)
        w.check(bench_straggler(steps))
        assert bool(told) == named, (steps, told)
    assert told[0].startswith("straggler: n3 rank 2 computes ") and acted == [([2], told[0])]


def test_a_rank_under_twice_the_median_or_slow_in_bursts_waits_for_the_longer_proof():
    """1.8x over the same seconds is not SEVERE: it waits for SUSTAIN_S of windows of 50 steps (or
    the checks in a row). A rank 4x slower in bursts of 10 steps (an evaluation, a checkpoint) with
    healthy steps between is slow in no three short windows back to back."""
    told, acted = [], []
    w = watch(told, acted, window=50)
    w.check(bench_straggler(60, slow_s=0.0234))
    assert told == []
    bursts = throttled(300)
    for r in range(4):
        bursts[r] = [0.016] * 300
    for start in range(100, 300, 20):
        bursts[1][start:start + 10] = [0.064] * 10
    clock = [1000.0 + 0.048 * s for s in range(300)]
    w.check([{"rank": r, "answer": {"steps": [[s, v[s], clock[s]] for s in range(300)]}} for r, v in bursts.items()])
    assert told == []


def test_the_hook_says_when_each_step_was_told(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # not a rank: the hook only defines its functions
    hook = {"__name__": "hook_under_test", "__file__": "/nonexistent/sitecustomize.py"}
    exec(compile(HOOK, "sitecustomize.py", "exec"), hook)
    t0 = time.monotonic()
    hook["clusterctl_step"](7, 0.25)
    step, compute, at = hook["_steps"][-1]
    assert (step, compute) == (7, 0.25) and t0 - 0.01 <= at <= time.monotonic() + 0.01


def test_the_watch_names_nobody_on_a_healthy_run():
    told, acted = [], []
    w = watch(told, acted, window=50)
    samples = healthy(steps=300)
    for k in range(6):
        w.check([{"rank": r, "answer": {"steps": [[s, v[s]] for s in range(50 * k, 50 * k + 50)]}}
                 for r, v in samples.items()])
    assert told == [] and acted == []


def by_node(rank_docs):
    """A progress snapshot's ranks as each node's stream sends them: node -> its document."""
    out = {}
    for d in rank_docs:
        out.setdefault(NODES[d["rank"]], {"ranks": [], "time": 0.0})["ranks"].append(d)
    return out


def test_a_streamed_watch_judges_what_the_nodes_streams_fed_and_asks_nobody():
    told, acted, asked, said = [], [], [], []
    w = StragglerWatch(snap=lambda: asked.append(1) or [], node_of=NODES, tell=told.append, window=5, factor=1.3,
                       on_straggler=lambda new, cur: acted.append(([s.rank for s in new], cur)), say=said.append,
                       streamed=True)
    slow = {0: 0.1, 1: 0.1, 2: 0.3, 3: 0.1}
    w.feed("n1", {"ranks": [{"rank": 0, "answer": {"steps": [[99, 5.0]]}}]})  # replaced by n1's newer one
    for k in range(CONFIRM):
        for node, doc in by_node(docs(slow, 5 * k, 5)).items():
            w.feed(node, doc)
        w.round()
    assert told == ["straggler: n3 rank 2 computes 3.0x the median (300 ms vs 100 ms over the last 5 steps)"]
    assert acted == [([2], told[0])] and w.steps[0] == {s: (0.1, None) for s in range(5 * CONFIRM)}
    rounds = w.rounds
    w.round()  # nothing fed since: not judged again
    assert w.rounds == rounds and len(told) == 1
    w.feed("n2", {"ranks": [], "time": 0.0, "error": "OSError: no such run"})
    w.round()
    assert said[-1] == "n2: no progress: OSError: no such run"
    w.period = 0.01
    w.start()
    source = lambda: [x for x in said if x.startswith("straggler watch: progress")]  # noqa: E731
    assert wait_for(source, 10, "the source said") == ["straggler watch: progress from the nodes' log streams "
                                                       "every 0.01 s"]
    w.close()
    assert asked == []


def test_a_streamed_watch_judges_once_every_nodes_stream_fed_not_a_period_later():
    """The streams ask their ranks at one period from about one start: the round that judges
    their documents starts when the last of them is in, not up to a period later (a period of
    60 s here: a round of the watch's own would come after 90)."""
    told, said = [], []
    w = StragglerWatch(snap=lambda: [], node_of=NODES, tell=told.append, window=5, factor=1.3, period=60.0,
                       on_straggler=lambda new, cur: None, say=said.append, streamed=True)
    w.start()
    try:
        slow = {0: 0.1, 1: 0.1, 2: 0.3, 3: 0.1}
        for k in range(CONFIRM):
            fed = sorted(by_node(docs(slow, 5 * k, 5)).items())
            for node, doc in fed[:-1]:
                w.feed(node, doc)
            time.sleep(0.2)
            assert w.rounds == k  # one node's stream not in yet: no round
            w.feed(*fed[-1])
            wait_for(lambda: w.rounds == k + 1, 10, f"round {k + 1} once every node fed")
        assert told == ["straggler: n3 rank 2 computes 3.0x the median (300 ms vs 100 ms over the last 5 steps)"]
    finally:
        w.close()
    assert w.thread is not None and (w.thread.join(10) or not w.thread.is_alive())  # close wakes it


def test_a_watch_without_streams_asks_every_node_each_round():
    told, asked, said = [], [], []
    slow = {0: 0.1, 1: 0.1, 2: 0.3, 3: 0.1}
    w = StragglerWatch(snap=lambda: asked.append(1) or docs(slow, 5 * len(asked), 5), node_of=NODES,
                       tell=told.append, window=5, factor=1.3, on_straggler=lambda new, cur: None, say=said.append)
    w.feed("n1", {"ranks": [{"rank": 0, "answer": {"steps": [[s, 9.0] for s in range(100, 105)]}}]})  # not read
    for _ in range(CONFIRM):
        w.round()
    assert len(asked) == CONFIRM and told[0].startswith("straggler: n3 rank 2 computes 3.0x")
    w.period = 0.01
    w.start()
    source = lambda: [x for x in said if x.startswith("straggler watch: progress")]  # noqa: E731
    assert wait_for(source, 10, "the source said") == ["straggler watch: progress asked of every node every 0.01 s"]
    assert wait_for(lambda: len(asked) > CONFIRM, 10, "a round of the watch's own to ask")
    w.close()


RANK = """
import os, sys, time
import sitecustomize
for step in range(1, 8):
    sitecustomize.clusterctl_step(step, step / 100)
print("ready", flush=True)
time.sleep(120)
"""
LAUNCH = ("import os, subprocess, sys; subprocess.run([sys.executable, '-c', os.environ['CHILD']], "
          "env=dict(os.environ, RANK='0', LOCAL_RANK='0'))")


def test_a_rank_answers_a_progress_request_with_its_newest_steps_and_no_stacks(agent):  # noqa: F811
    spec = {"argv": [sys.executable, "-c", LAUNCH], "cwd": str(agent.home), "env": {"CHILD": RANK}, "hook": HOOK}
    r = agent("start", "sp1@n1", json.dumps(spec).encode().hex())
    assert r.returncode == 0, r.stderr
    d = rundir(agent, "sp1@n1")
    try:
        assert wait_for(lambda: b"ready" in (d / "log").read_bytes(), timeout=60), (d / "log").read_bytes()
        doc = json.loads(agent("snapshot", "sp1@n1", 7, 20, "progress").stdout)
        [rank] = doc["ranks"]
        assert rank["rank"] == 0 and "error" not in rank, rank
        steps = rank["answer"]["steps"]
        assert [st[:2] for st in steps] == [[s, s / 100] for s in range(1, 8)]
        assert all(a[2] <= b[2] for a, b in zip(steps, steps[1:]))  # when each was told, the rank's clock
        assert "stacks" not in rank["answer"] and "fr" not in rank["answer"]
        assert not list((d / "hook").glob("*.json"))
    finally:
        agent("stop", "sp1@n1", 1)



def test_a_rank_stopped_when_asked_answers_its_progress_once_it_runs_again(agent):  # noqa: F811
    """A rank throttled by stops (the drill's straggler) is asked for its progress all the same; it
    answers when it runs again within the wait (for its stacks it is not asked: test_hang.py)."""
    import signal
    import threading

    spec = {"argv": [sys.executable, "-c", LAUNCH], "cwd": str(agent.home), "env": {"CHILD": RANK}, "hook": HOOK}
    r = agent("start", "sp2@n1", json.dumps(spec).encode().hex())
    assert r.returncode == 0, r.stderr
    d = rundir(agent, "sp2@n1")
    try:
        assert wait_for(lambda: b"ready" in (d / "log").read_bytes(), timeout=60), (d / "log").read_bytes()
        pid = json.loads(agent("snapshot", "sp2@n1", 1, 20, "progress").stdout)["ranks"][0]["pid"]
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T", 10, "the stop")
        later = threading.Timer(1.0, os.kill, (pid, signal.SIGCONT))
        later.start()
        try:
            doc = json.loads(agent("snapshot", "sp2@n1", 2, 20, "progress").stdout)
        finally:
            later.join()
            os.kill(pid, signal.SIGCONT)
        [rank] = doc["ranks"]
        assert "error" not in rank, rank
        assert [st[:2] for st in rank["answer"]["steps"]] == [[s, s / 100] for s in range(1, 8)]
    finally:
        agent("stop", "sp2@n1", 1)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Wait(torch.autograd.Function):
    """At the input, so its backward runs after every parameter's gradient: where DDP waits for the
    gradients' all-reduce. It moves the fake clock by `wait` s."""

    clock, wait = None, 0.0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        Wait.clock.now += Wait.wait
        return g


class Timed(torch.nn.Linear):
    def forward(self, x):
        Wait.clock.now += 0.05  # this rank's own compute
        return super().forward(x)


def test_the_trainers_compute_clock_leaves_out_the_wait_for_the_other_ranks(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(time, "perf_counter", fake)
    Wait.clock = fake
    model = Timed(4, 4)
    told = []
    clock = StepClock(model, torch.device("cpu"), sink=lambda step, s: told.append((step, round(s, 6))))
    for step, wait in ((1, 0.0), (2, 0.7)):
        Wait.wait = wait
        clock.start()
        x = torch.ones(2, 4, requires_grad=True)
        model(Wait.apply(x)).sum().backward()
        clock.backward_done()
        fake.now += 0.01  # the optimizer
        clock.end(step)
    assert told == [(1, 0.06), (2, 0.06)]  # 0.7 s waited in step 2 is not compute


def test_ranks_reporting_no_compute_at_all_are_judged_without_dividing_by_zero():
    told, acted = [], []
    w = watch(told, acted)
    said = []
    w.say = said.append
    w.check(docs({0: 0.0, 1: 0.0}, 0, 5))
    assert said == []  # said once every rank is judged: two of four have a window
    w.check(docs({r: 0.0 for r in NODES}, 5, 5))
    assert told == [] and said == ["straggler watch: 4 ranks judged over their last 5 steps: median compute 0.0 ms "
                                   "per step, the slowest rank 0 at 1.00x"]


# ------------------------------------------------------------ any script: the Flight Recorder's entry times
def entries(compute: dict[int, float], n: int, first: int = 1, skew: dict[int, float] | None = None,
            comm: float = 0.002, start: float = 1_000.0):
    """A synchronous job's collectives as each rank's Flight Recorder has them: rank r computes
    compute[r] s, then enters collective k; nobody leaves k before the last rank entered it. Each
    rank's clock is off by skew[r] s. -> the docs a progress snapshot gives ([[pg, seq, ns]])."""
    skew = skew or {}
    t = {r: start for r in compute}
    out = {r: [] for r in compute}
    for k in range(first, first + n):
        for r, c in compute.items():
            t[r] += c
            out[r].append(["0", k, int((t[r] + skew.get(r, 0.0)) * 1e9)])
        done = max(t.values()) + comm
        t = {r: done for r in t}
    return [{"rank": r, "answer": {"steps": [], "entered": e}} for r, e in out.items()]


def test_a_script_reporting_no_compute_is_judged_from_when_its_ranks_enter_each_collective():
    from orchestrator.runs.judge.straggler import fr_compute, merge_entered

    into = {}
    merge_entered(into, entries({0: 0.1, 1: 0.1, 2: 0.26, 3: 0.1}, 60), {}, NODES, keep=1000)
    samples = fr_compute(into)
    assert len(samples[2]) == 59
    assert [s.rank for s in judge(samples, NODES, window=50, unit="collectives")] == [2]
    [s] = judge(samples, NODES, window=50, unit="collectives")
    assert describe([s]).endswith("over the last 50 collectives)") and 2.4 < s.ratio < 2.7, describe([s])
    # the waits are left out: a fast rank computes its own 100 ms (+ the collective's 2 ms), not the 260
    assert abs(statistics.median(samples[0]) - 0.102) < 1e-3


def test_the_nodes_clock_offsets_are_taken_off_before_ranks_are_compared():
    """Rank 2's node runs 0.5 s ahead: uncorrected, it looks like it enters every collective last
    by far; with the measured offset it is as fast as the others."""
    from orchestrator.runs.judge.straggler import fr_compute, merge_entered

    even = {r: 0.1 for r in range(4)}
    raw, fixed = {}, {}
    docs_ = entries(even, 60, skew={2: 0.5})
    merge_entered(raw, docs_, {}, NODES, keep=1000)
    merge_entered(fixed, docs_, {NODES[2]: 0.5}, NODES, keep=1000)
    assert [s.rank for s in judge(fr_compute(raw), NODES, window=50)] == [2]
    assert judge(fr_compute(fixed), NODES, window=50) == []


def test_the_watch_judges_a_script_without_compute_per_collective_and_measures_the_clocks_again_only_when_due():
    told, acted, measured = [], [], []
    w = watch(told, acted, window=20)
    w.offsets = lambda: measured.append(1) or {"n1": (0.004, 0.01), "n3": (0.3, 0.01)}
    slow = {0: 0.1, 1: 0.1, 2: 0.3, 3: 0.1}
    for k in range(CONFIRM):
        w.check(entries(slow, 30, first=1 + 30 * k, skew={2: 0.3}))  # n3 runs 0.3 s ahead
    assert told == ["straggler: n3 rank 2 computes 3.0x the median (302 ms vs 102 ms over the last 20 collectives)"]
    assert measured == [1]  # once per OFFSETS_S, not every check
    assert w.clock[1] == {"n1": 0.0, "n3": 0.3}  # within its uncertainty: not taken off
    # a healthy script with jitter: nobody
    told2 = []
    w2 = watch(told2, [], window=50)
    w2.offsets = dict
    samples = healthy(steps=300, base=0.1)
    for k in range(5):
        w2.check(entries({r: statistics.median(v[50 * k:50 * k + 50]) for r, v in samples.items()}, 60,
                         first=1 + 60 * k))
    assert told2 == []


def test_collectives_entered_while_the_warm_interpreters_imported_are_not_judged():
    told, acted, busy = [], [], ["n1"]
    w = watch(told, acted, window=20)
    w.offsets, w.warming = dict, lambda: busy
    slow = {0: 0.1, 1: 0.1, 2: 0.3, 3: 0.1}
    for k in range(CONFIRM):
        w.check(entries(slow, 30, first=1 + 30 * k, start=time.time() - 60))
    assert w.entered == {} and [t for t in told if t.startswith("straggler:")] == []
    busy.clear()
    w.check(entries(slow, 30, first=91, start=time.time() - 30))  # entered before the hold ended: dropped
    assert w.hold.released is not None and all(not e for e in w.entered.values())
    w.check(entries(slow, 30, first=121, start=time.time() + 1))  # after: judged
    assert all(len(e) == 30 for e in w.entered.values()) and len(w.entered) == 4


@pytest.mark.slow
def test_a_rank_reporting_no_compute_answers_with_its_flight_recorder_entry_times(tmp_path):
    """The hook's `_entered` over a real gloo process group (one rank): its newest collectives,
    with their sequence numbers and creation times, no stack traces."""
    (tmp_path / "sitecustomize.py").write_text(HOOK)
    code = f"""
import importlib.util, os, sys, time
import torch, torch.distributed as dist
spec = importlib.util.spec_from_file_location("hook", {str(tmp_path / "sitecustomize.py")!r})
sitecustomize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sitecustomize)
store = dist.HashStore()
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
t0 = time.time_ns()
for _ in range(3):
    dist.all_reduce(torch.ones(4))
import json
print(json.dumps([t0, sitecustomize._entered()]))
dist.destroy_process_group()  # not left to the exit: gloo's worker may still free a tensor then
"""
    import subprocess

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TORCH_FR_BUFFER_SIZE": "100"})
    assert r.returncode == 0, r.stderr[-2000:]
    t0, got = json.loads(r.stdout.strip().splitlines()[-1])
    assert [e[1] for e in got] == [1, 2, 3] and all(e[0] == "0" for e in got), got
    assert all(t0 <= e[2] <= time.time_ns() for e in got)
