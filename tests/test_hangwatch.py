"""The hang watch (runs/judge/hangwatch.py): when it looks closer and what it concludes, driven by progress
records shaped as the nodes' streams bring them (node agent `snapshot_doc`, what=progress) and by
snapshots it takes through a stand-in for the node agents. `tick` is called directly; the pause
between a check's two snapshots is taken out."""

import json
import threading

import pytest

from orchestrator.runs.judge.hangsnap import Frame, RankSnap
from orchestrator.runs.judge.hangwatch import EDGE_S, HangWatch
from tests.conftest import wait_for

AR = ("gloo:all_reduce", "[[4]]")
LIB = (("MainThread", (Frame("distributed_c10d.py", 1, "all_reduce", lib=True),)),)
LOADER = (("MainThread", (Frame("train.py", 30, "slow_data_loader"),)),)


def rank_doc(rank, t, pgs, state="S", cpu=1.0, io=0):
    asked = state not in "TtZX"
    return {"rank": rank, "pid": 100 + rank, "state": state, "cpu_s": cpu, "tree_cpu_s": cpu, "io": io, "at": t,
            "answer": {"pgs": {k: list(v) for k, v in pgs.items()}, "steps": []} if asked else None,
            "error": None if asked else "not asked: the process is stopped"}


def feed(w, t, r0, r1):
    """One round of both nodes' records: r0, r1 = (pgs, state, cpu)."""
    w.clock["t"] = t  # the nodes' clocks: the watch's snapshots come after
    for rank, (pgs, state, cpu) in enumerate((r0, r1)):
        w.feed(f"n{rank + 1}", {"time": t, "ranks": [rank_doc(rank, t, pgs, state, cpu)]})


def full(rank, t, pgs, state="S", cpu=1.0, threads=LIB, hooked=True, entered=None):
    """A rank as the watch's own snapshot has it: stacks and the Flight Recorder (`entered`: when it
    entered its newest collective of each group, the entries' time_created)."""
    asked = state not in "TtZX" and hooked
    return RankSnap(f"n{rank + 1}", rank, 100 + rank, state, cpu_s=cpu, threads=threads if asked else (),
                    pgs={k: v[0] for k, v in pgs.items()} if asked else {},
                    names={(k, v[0]): AR for k, v in pgs.items()} if asked else {},
                    done={k: v[1] for k, v in pgs.items()} if asked else {}, tree_cpu_s=cpu, io=0, t=t, replied=asked,
                    entered_at=entered or {})


def watch(tmp_path, shots, gap=3.0, **kw):
    """A watch over ranks 0 (n1) and 1 (n2); shots(k, t) is what the k-th snapshot finds at node time
    t, `gap` s after the newest record or snapshot (a check's second, CONFIRM_S after its first at least)."""
    calls, found, said = [], [], []
    clock = {"t": 0.0}

    def take(k):
        calls.append(k)
        clock["t"] += gap
        snaps = shots(k, clock["t"])
        return snaps, sorted({s.node for s in snaps})

    kw.setdefault("timeout", 300.0)
    w = HangWatch(snap=take, world=[0, 1], ranks_of={0: "n1", 1: "n2"}, out_dir=tmp_path / "hangs",
                  on_hang=lambda v, d: found.append((v, d)), say=said.append, order=["n1", "n2"], armed=True, **kw)
    # no pause between a check's two snapshots when check() is called directly: the nodes' clock moves
    # on by what is left of it after a snapshot's `gap`
    w.stop.wait = lambda s: clock.__setitem__("t", clock["t"] + max(0.0, s - gap)) or False
    w.clock = clock
    return w, calls, found, said


def stopped_shots(k, t):
    return [full(0, t, {"0": (8, 7)}), full(1, t, {}, state="T")]


@pytest.mark.parametrize("gap, looks", [(3.0, [1]), (1.0, [1, 2])], ids=["held-3s-at-the-first-look", "a-second-look"])
def test_ranks_waiting_for_a_stopped_rank_are_named_at_the_first_record_that_shows_it(tmp_path, gap, looks):
    """The check's first snapshot 3 s after rank 0 was seen entering #8 already shows the hang held
    3 s: judged at once; 1 s after, it looks again (each `gap` later)."""
    w, calls, found, _ = watch(tmp_path, stopped_shots, gap=gap)
    feed(w, 100, ({"0": (7, 7)}, "S", 1.0), ({"0": (7, 7)}, "S", 1.0))
    w.tick()
    assert calls == []  # both moved: nothing to look at
    feed(w, 110, ({"0": (8, 7)}, "S", 1.1), ({}, "T", 1.1))  # rank 0 entered #8; rank 1 is stopped
    w.tick()
    assert calls == looks and len(found) == 1, w.standing()
    v, d = found[0]
    assert v.text.startswith("hang: rank 1 (n2, pid 101) is stopped (state T") and "never entered gloo:all_reduce #8" \
        in v.text, v.text
    assert v.nodes == ("n2",) and json.loads((d / "verdict.json").read_text())["culprits"][0]["node"] == "n2"
    assert "thread MainThread" in (d / "stacks.txt").read_text()


def test_the_second_look_comes_once_what_the_first_lacked_has_held(tmp_path):
    """The first snapshot 1 s after rank 0 was seen entering #8: the hang has held 1 s of CONFIRM_S,
    so the second look comes 2 s later (not 3) and is the verdict."""
    w, calls, found, _ = watch(tmp_path, stopped_shots, gap=1.0)
    waits, wait = [], w.stop.wait
    w.stop.wait = lambda s: waits.append(s) or wait(s)
    feed(w, 100, ({"0": (7, 7)}, "S", 1.0), ({"0": (7, 7)}, "S", 1.0))
    feed(w, 110, ({"0": (8, 7)}, "S", 1.1), ({}, "T", 1.1))
    w.tick()
    assert calls == [1, 2] and len(found) == 1 and waits == [pytest.approx(2.0)], (waits, w.standing())


def test_a_second_look_that_finds_the_ranks_moving_again_is_the_last(tmp_path):
    w, calls, found, said = watch(tmp_path, lambda k, t: [full(0, t, {"0": (8, 7)}), full(1, t, {}, state="T")]
                                  if k == 1 else [full(0, t, {"0": (9, 9)}), full(1, t, {"0": (9, 9)})], gap=1.0)
    feed(w, 100, ({"0": (7, 7)}, "S", 1.0), ({"0": (7, 7)}, "S", 1.0))
    feed(w, 110, ({"0": (8, 7)}, "S", 1.1), ({}, "T", 1.1))
    w.tick()
    assert calls == [1, 2] and found == [] and "not a hang" in said[-1], said


def test_a_rank_idle_while_the_others_wait_is_named_once_it_has_been_idle_long_enough(tmp_path):
    w, calls, found, _ = watch(tmp_path, lambda k, t: [full(0, t, {"0": (8, 7)}),
                                                      full(1, t, {"0": (7, 7)}, threads=LOADER)])
    feed(w, 100, ({"0": (7, 7)}, "S", 1.0), ({"0": (7, 7)}, "S", 1.0))
    feed(w, 110, ({"0": (8, 7)}, "S", 1.1), ({"0": (7, 7)}, "S", 1.0))
    w.tick()
    assert calls == []  # rank 0 just entered; rank 1 has been idle for 10 s: not yet told apart from a pause
    feed(w, 120, ({"0": (8, 7)}, "S", 1.1), ({"0": (7, 7)}, "S", 1.0))
    w.tick()
    [(v, _)] = found
    assert v.text == ("hang: rank 1 (n2, pid 101) never entered gloo:all_reduce #8 that rank 0 waits in; its stack: "
                      "train.py:30 slow_data_loader")
    assert v.details[-1].startswith("seen: rank 1 (n2) used 0% of a core and did no disk I/O for 2") and \
        v.details[-1].endswith("s while others waited for it")


def busy_shots(k, t):
    return [full(0, t, {"0": (8, 7)}), full(1, t, {"0": (7, 7)}, state="R", cpu=10.0 + t)]


def test_a_rank_busy_in_its_own_code_is_left_alone_until_the_busy_limit(tmp_path):
    w, calls, found, said = watch(tmp_path, busy_shots, busy_limit=1e9)
    feed(w, 100, ({"0": (7, 7)}, "S", 1.0), ({"0": (7, 7)}, "R", 0.0))
    feed(w, 110, ({"0": (8, 7)}, "S", 1.0), ({"0": (7, 7)}, "R", 9.0))
    feed(w, 120, ({"0": (8, 7)}, "S", 1.0), ({"0": (7, 7)}, "R", 18.0))
    for _ in range(3):
        w.tick()
    assert calls == [] and found == []
    assert any("rank 1 (n2) is busy in its own code (90% of a core)" in line for line in said), said
    w.busy_limit = 0.0  # the bound passed: named, busy
    w.tick()
    [(v, _)] = found
    assert v.text.startswith("hang: rank 1 (n2, pid 101) has been busy in its own code for ") and \
        "and never entered gloo:all_reduce #8 that rank 0 waits in" in v.text, v.text


def test_the_backstop_counts_progress_not_log_bytes(tmp_path):
    """Every rank idle in its own code, nobody inside a collective, for longer than the timeout: a
    log line just before (a chatty thread) does not put the look off; the look finds no hang."""
    w, calls, found, said = watch(tmp_path, lambda k, t: [full(0, t, {"0": (7, 7)}, threads=LOADER),
                                                         full(1, t, {"0": (7, 7)}, threads=LOADER)], timeout=30.0)
    w.backstop_at -= 60  # the watch has been running a minute
    feed(w, 100, ({"0": (7, 7)}, "S", 1.0), ({"0": (7, 7)}, "S", 1.0))
    feed(w, 140, ({"0": (7, 7)}, "S", 1.0), ({"0": (7, 7)}, "S", 1.0))
    w.heard()
    w.tick()
    assert calls == [1, 2] and found == []
    assert said[-1].startswith("no rank waits in a collective for another"), said
    w.tick()
    assert calls == [1, 2]  # not again before another timeout


def all_inside(tmp_path, down, **kw):
    w, calls, found, said = watch(tmp_path, lambda k, t: [full(0, t, {"0": (12, 11)}), full(1, t, {"0": (11, 10)})],
                                  probe=lambda: list(down), **kw)
    feed(w, 100, ({"0": (11, 11)}, "S", 1.0), ({"0": (10, 10)}, "S", 1.0))
    feed(w, 110, ({"0": (12, 11)}, "S", 1.0), ({"0": (11, 10)}, "S", 1.0))
    feed(w, 120, ({"0": (12, 11)}, "S", 1.0), ({"0": (11, 10)}, "S", 1.0))
    w.tick()
    return w, calls, found, said


def test_every_rank_inside_a_collective_names_the_broken_link_and_no_culprit(tmp_path):
    w, calls, found, said = all_inside(tmp_path, [("n1", "n2")])
    [(v, _)] = found
    assert v.text.startswith("hang: every rank waits inside a collective (rank 0 in gloo:all_reduce #12; rank 1 in "
                             "gloo:all_reduce #11) and the nodes n1 ↔ n2 cannot reach each other"), v.text
    assert v.culprits == () and v.links == (("n1", "n2"),) and v.nodes == ("n2",)  # the end that is not the master


def test_every_rank_inside_a_collective_with_every_link_up_is_left_to_the_backstop(tmp_path):
    w, calls, found, said = all_inside(tmp_path, [], timeout=60.0)
    assert calls == [1, 2] and found == [] and "left to the backstop" in said[-1]  # a slow collective, perhaps
    w.tick()
    assert calls == [1, 2]  # the same standing is not looked at twice
    w.backstop_at -= 60  # the hang timeout passed with no progress
    feed(w, 130, ({"0": (12, 11)}, "S", 1.0), ({"0": (11, 10)}, "S", 1.0))
    feed(w, 190, ({"0": (12, 11)}, "S", 1.0), ({"0": (11, 10)}, "S", 1.0))
    w.tick()
    [(v, _)] = found
    assert "and none came out" in v.text and v.nodes == (), v.text


def test_observe_tells_a_hang_once_until_a_rank_moves_again(tmp_path):
    w, calls, found, _ = watch(tmp_path, stopped_shots, observe=True)
    feed(w, 100, ({"0": (7, 7)}, "S", 1.0), ({"0": (7, 7)}, "S", 1.0))
    feed(w, 110, ({"0": (8, 7)}, "S", 1.0), ({}, "T", 1.0))
    w.tick()
    w.tick()
    assert len(found) == 1 and calls == [1]  # its first look held 3 s after rank 0 entered: told once
    feed(w, 120, ({"0": (9, 9)}, "S", 1.0), ({"0": (9, 9)}, "S", 1.0))  # SIGCONT: both moved on
    assert not w.quiet
    feed(w, 130, ({"0": (10, 9)}, "S", 1.0), ({}, "T", 1.0))
    w.tick()
    assert len(found) == 2


def test_no_rank_found_is_nothing_to_judge(tmp_path):
    w, calls, found, said = watch(tmp_path, lambda k, t: [])
    feed(w, 100, ({"0": (7, 7)}, "S", 1.0), ({"0": (7, 7)}, "S", 1.0))
    feed(w, 110, ({"0": (8, 7)}, "S", 1.0), ({}, "T", 1.0))
    w.tick()
    assert calls == [1, 2] and found == [] and "nothing to judge" in said[-1]


def test_nothing_is_watched_before_the_first_answer_or_line(tmp_path):
    w, calls, found, _ = watch(tmp_path, stopped_shots, timeout=0.001)
    w.armed = False
    w.tick()
    assert calls == []
    feed(w, 100, ({"0": (7, 7)}, "S", 1.0), ({"0": (7, 7)}, "S", 1.0))  # a hook answered: armed
    assert w.armed


@pytest.mark.slow
def test_the_watch_thread_finds_a_hang_and_stops_on_close(tmp_path):
    w, calls, found, _ = watch(tmp_path, stopped_shots)
    w.stop = threading.Event()  # the real pause
    w.start()
    try:
        feed(w, 100, ({"0": (7, 7)}, "S", 1.0), ({"0": (7, 7)}, "S", 1.0))
        feed(w, 110, ({"0": (8, 7)}, "S", 1.0), ({}, "T", 1.0))
        assert wait_for(lambda: found, timeout=60)
    finally:
        w.close()
    w.thread.join(10)
    assert not w.thread.is_alive()


def test_the_watch_never_runs_with_a_zero_timeout(tmp_path):
    w, calls, found, _ = watch(tmp_path, stopped_shots, timeout=0)
    w.start()
    assert w.thread is None


def test_a_run_whose_hooks_never_answer_is_judged_on_its_log_and_its_cpu(tmp_path):
    """No progress answer ever came (a job that is not Python, a PYTHONPATH replaced): its log's
    bytes stand in for progress, and an idle rank that does not answer is named at the backstop."""
    w, calls, found, said = watch(tmp_path, lambda k, t: [full(0, t, {}, hooked=False), full(1, t, {}, hooked=False)],
                                  timeout=30.0)
    w.clock["t"] = 100
    for node, rank in (("n1", 0), ("n2", 1)):  # the records come, and no hook answers in them
        w.feed(node, {"time": 100, "ranks": [dict(rank_doc(rank, 100, {}), answer=None, error="no hook answers in it")]})
    w.heard()
    w.tick()
    assert calls == []  # a line just now
    w.log_at -= 31
    w.armed_at -= 31
    w.backstop_at -= 31
    w.tick()
    [(v, _)] = found
    assert v.text.startswith("hang: rank 0 (n1, pid 100) did not answer (no hook; state S)"), v.text


def test_the_end_of_a_run_is_not_a_hang_ranks_leave_the_last_collective_one_by_one(tmp_path):
    """Rank 1's script ended (its hook's atexit ran) while rank 0 was last seen inside the final
    barrier, then rank 1's node's torchrun ended, and rank 0 is slow to exit (a loaded machine):
    never looked at as a hang, though the hang timeout (3 s) passed many times over."""
    w, calls, found, said = watch(tmp_path, lambda k, t: [full(0, t, {"0": (9, 8)})], timeout=3.0)
    w.backstop_at -= 60
    feed(w, 100, ({"0": (8, 8)}, "S", 1.0), ({"0": (8, 8)}, "S", 1.0))
    feed(w, 110, ({"0": (9, 8)}, "S", 1.1), ({"0": (9, 9)}, "S", 1.1))  # rank 0 entered the barrier late
    w.feed("n2", {"time": 120, "ranks": [dict(rank_doc(1, 120, {}), answer=None, exiting=True,
                                              error="not asked: it is exiting (its script ended)")]})
    w.feed("n1", {"time": 120, "ranks": [rank_doc(0, 120, {"0": (9, 8)}, cpu=1.1)]})
    assert w.standing().kind == "ending", w.standing()
    w.tick()
    w.ended("n2")
    w.feed("n1", {"time": 130, "ranks": [rank_doc(0, 130, {"0": (9, 8)}, cpu=1.1)]})
    w.feed("n1", {"time": 160, "ranks": [rank_doc(0, 160, {}, cpu=1.1)]})  # destroy_process_group: no group left
    w.tick()
    assert calls == [] and found == [], said
    assert w.silent_for(0.0) >= 3.0  # past the timeout: what keeps the backstop off is EDGE_S


def test_a_rank_whose_process_ended_while_the_others_wait_is_named_only_after_gone_s(tmp_path):
    """A process that ended without its node's torchrun ending: the run's end for GONE_S (the others
    leave within moments), then a hang: they wait inside a collective for a rank that is gone."""
    w, calls, found, said = watch(tmp_path, lambda k, t: [full(0, t, {"0": (9, 8)})])
    feed(w, 100, ({"0": (8, 8)}, "S", 1.0), ({"0": (8, 8)}, "S", 1.0))
    feed(w, 110, ({"0": (9, 8)}, "S", 1.1), ({"0": (8, 8)}, "S", 1.1))
    w.feed("n2", {"time": 115, "ranks": []})
    w.feed("n1", {"time": 115, "ranks": [rank_doc(0, 115, {"0": (9, 8)}, cpu=1.1)]})
    w.tick()
    assert calls == [] and w.standing().kind == "ending"
    w.feed("n2", {"time": 140, "ranks": []})
    w.feed("n1", {"time": 140, "ranks": [rank_doc(0, 140, {"0": (9, 8)}, cpu=1.1)]})
    w.tick()
    [(v, _)] = found
    assert v.text.startswith("hang: rank 1 (n2, pid ?) has no process left on its node"), v.text


def test_a_slow_start_before_the_first_collective_is_given_edge_s_by_the_backstop(tmp_path):
    """Hooks answer from the interpreter's start, long before the first collective (imports, the
    rendezvous: minutes on a loaded machine): no progress yet is no silence until EDGE_S."""
    w, calls, found, said = watch(tmp_path, lambda k, t: [full(0, t, {}), full(1, t, {})], timeout=3.0)
    w.backstop_at -= 600
    feed(w, 100, ({}, "S", 1.0), ({}, "S", 1.0))
    feed(w, 110, ({}, "S", 5.0), ({}, "S", 5.0))
    w.tick()
    assert calls == [] and w.silent_for(0.0) >= 3.0
    feed(w, 100 + EDGE_S, ({}, "S", 9.0), ({}, "S", 9.0))
    w.tick()
    assert calls == [1, 2] and found == []  # looked at, at last: nobody waits on anybody, not a hang


def test_before_the_first_progress_record_a_quiet_log_is_not_silence(tmp_path):
    """The first records come PERIOD_S after the stream starts: until then the watch knows nothing
    of the hooks, and a script quiet from its first line (collectives, no prints) is not looked at
    (the log's bytes stand in for progress only once records show no hook answers)."""
    w, calls, found, said = watch(tmp_path, lambda k, t: [full(0, t, {"0": (9, 9)}), full(1, t, {"0": (9, 9)})],
                                  timeout=3.0)
    w.heard()
    w.log_at -= 10
    w.armed_at -= 10
    w.backstop_at -= 10
    w.tick()
    assert calls == [], said


@pytest.mark.parametrize("entered, looks", [(106.5, [1]), (None, [1, 2]), (50.0, [1, 2])],
                         ids=["entered-4s-before", "no-entry-time", "entered-before-the-last-look-elsewhere"])
def test_the_flight_recorders_entry_time_counts_a_wait_from_when_the_rank_entered(tmp_path, entered, looks):
    """Rank 0 was first seen inside #8 at the record of t=110; its Flight Recorder (the check's first
    snapshot, 0.5 s later) says it entered #8 at t=106.5: it has waited 4 s, rank 1 has been stopped
    since, so the first look is the verdict. Without the entry time it looks again 3 s later; an
    entry time before t=100, when rank 0 was seen inside #7 still (a confused clock), is not believed."""
    def shots(k, t):
        return [full(0, t, {"0": (8, 7)}, entered={"0": entered} if entered else None), full(1, t, {}, state="T")]

    w, calls, found, _ = watch(tmp_path, shots, gap=0.5)
    feed(w, 100, ({"0": (7, 7)}, "S", 1.0), ({"0": (7, 7)}, "S", 1.0))
    feed(w, 110, ({"0": (8, 7)}, "S", 1.1), ({}, "T", 1.1))
    w.tick()
    assert calls == looks and len(found) == 1
    if entered == 106.5:
        assert w.standing().ranks[0].stalled_s == pytest.approx(4.0)


def test_a_rank_reads_when_it_entered_its_collectives_from_either_answer():
    """A snapshot's Flight Recorder entries and a progress answer's `entered` give the time (ns, the
    node's clock) each group's newest collective was entered; only the one it is inside counts."""
    fr = {"pg_status": {"0": {"last_enqueued_collective": 8, "last_completed_collective": 7}},
          "entries": [{"pg_id": 0, "collective_seq_id": 7, "time_created_ns": 101_000_000_000, "is_p2p": False,
                       "profiling_name": "gloo:all_reduce"},
                      {"pg_id": 0, "collective_seq_id": 8, "time_created_ns": 106_500_000_000, "is_p2p": False,
                       "profiling_name": "gloo:all_reduce"}]}
    snap = RankSnap.from_agent("n1", {"rank": 0, "pid": 9, "state": "S", "at": 110.0,
                                      "answer": {"stacks": [{"thread": "MainThread", "main": True, "frames": [
                                          {"file": "c10d.py", "line": 1, "func": "all_reduce", "lib": True}]}],
                                                 "fr": fr}})
    assert snap.entered_at == {"0": 106.5} and snap.inside == {"0": 8} and snap.inside_since == 106.5
    prog = RankSnap.from_agent("n1", {"rank": 0, "pid": 9, "state": "S", "at": 110.0, "answer": {
        "pgs": {"0": [8, 7]}, "steps": [], "entered": [["0", 7, 101_000_000_000], ["0", 8, 106_500_000_000]]}})
    assert prog.entered_at == {"0": 106.5}
    done = RankSnap.from_agent("n1", {"rank": 0, "pid": 9, "state": "S", "at": 110.0, "answer": {
        "pgs": {"0": [8, 8]}, "steps": [], "entered": [["0", 8, 106_500_000_000]]}})
    assert done.inside == {} and done.inside_since is None  # completed: not inside, whatever the time


def test_the_link_probe_asks_each_node_for_the_others_ssh_ports_ipv6_in_brackets_once(monkeypatch):
    """links_down (the probe): each node is asked to reach the others' address:port, an IPv6
    address bracketed once whether the inventory gave it bare or bracketed; a pair is down when
    either end cannot reach the other."""
    import yaml

    from orchestrator.inventory import parse_inventory
    from orchestrator.node import agent
    from orchestrator.runs.judge.hangsnap import links_down

    inv = parse_inventory(yaml.safe_dump({"nodes": [{"name": "n1", "host": "2001:db8::1"},
                                                    {"name": "n2", "host": "[2001:db8::2]", "ssh": {"port": 2222}},
                                                    {"name": "n3", "host": "10.0.0.3"}]}), "<t>")
    asked = {}

    def run(cluster, call, names):
        asked.update({n: sorted(call(inv.node(n))) for n in names})
        return {n: agent.Reach({t: "refused" if (n, t) == ("n3", "[2001:db8::2]:2222") else "ok" for t in asked[n]})
                for n in names}

    monkeypatch.setattr(agent, "run", run)
    monkeypatch.setattr(agent, "reach", lambda nd, targets: list(targets))
    assert links_down(object(), inv, ["n1", "n2", "n3"]) == [("n2", "n3")]
    assert asked["n1"] == ["10.0.0.3:22", "[2001:db8::2]:2222"]
    assert asked["n3"] == ["[2001:db8::1]:22", "[2001:db8::2]:2222"]
