"""The hang rule (runs/judge/hangrule.py): what each rank is, from its observations on its node's clock,
and the Standing they make. Observations are built as the nodes' progress records and the
watch's snapshots give them (runs/judge/hangsnap.py RankSnap)."""

import pytest

from orchestrator.runs.judge.hangrule import GONE_S, IDLE_S, Tracker, gone
from orchestrator.runs.judge.hangsnap import RankSnap


def obs(rank, t, pgs=None, state="S", cpu=1.0, io=0, step=None):
    """Rank `rank` at node time t: pgs {pg: (entered, completed)}; a stopped or ended rank's hook
    is not asked, so it says nothing of its collectives."""
    asked = state not in "TtZX"
    pgs = pgs or {}
    return RankSnap(f"n{rank + 1}", rank, 100 + rank, state, cpu_s=cpu, pgs={k: v[0] for k, v in pgs.items()} if asked
                    else {}, done={k: v[1] for k, v in pgs.items()} if asked else {}, tree_cpu_s=cpu, io=io, t=t,
                    step=step, replied=asked)


def tracker(*rounds, world=(0, 1)):
    t = Tracker(world)
    for i, snaps in enumerate(rounds):
        for s in snaps:
            t.add(s, now=float(i))
    return t


def kinds(t):
    return {r: s.kind for r, s in t.standing().ranks.items()}


def test_ranks_waiting_for_a_stopped_rank_are_worth_a_look_at_once_and_stuck_once_they_wait():
    before = [obs(0, 100, {"0": (7, 7)}), obs(1, 100, {"0": (7, 7)})]
    entered = [obs(0, 110, {"0": (8, 7)}), obs(1, 110, state="T")]
    t = tracker(before, entered)
    st = t.standing()
    assert kinds(t) == {0: "moving", 1: "stopped"} and st.kind == "moving" and st.early
    t.add(obs(0, 114, {"0": (8, 7)}), 2.0)  # still inside #8 four seconds on
    st = t.standing()
    assert kinds(t) == {0: "waiting", 1: "stopped"} and st.kind == "stuck"


def test_a_rank_idle_while_others_wait_is_stuck_only_after_idle_s():
    t = tracker([obs(0, 100, {"0": (7, 7)}), obs(1, 100, {"0": (7, 7)}, cpu=5.0)],
                [obs(0, 110, {"0": (8, 7)}), obs(1, 110, {"0": (7, 7)}, cpu=5.0)],
                [obs(0, 100 + IDLE_S - 1, {"0": (8, 7)}), obs(1, 100 + IDLE_S - 1, {"0": (7, 7)}, cpu=5.0)])
    assert kinds(t) == {0: "waiting", 1: "quiet"} and t.standing().kind == "quiet"  # no sign yet either way
    t.add(obs(1, 100 + IDLE_S + 1, {"0": (7, 7)}, cpu=5.01), 3.0)
    st = t.standing()
    assert kinds(t) == {0: "waiting", 1: "idle"} and st.kind == "stuck"
    assert st.ranks[1].doing(0) == f"used 0% of a core and did no disk I/O for {IDLE_S + 1:.0f}s"


@pytest.mark.parametrize("cpu, io, state, kind", [
    (9.0, 0, "R", "busy"),  # computing alone: 90 % of a core
    (1.0, 50 << 20, "D", "busy"),  # writing a checkpoint: in D state, but its disk bytes move
    (1.0, 0, "D", "dstate"),  # in D state and nothing moves
    # asleep, while the watch's own snapshots had its hook write its answers (every thread's stack:
    # ~100 KB each for a Lightning rank): that is no work of the rank's
    (0.0, 300 << 10, "S", "idle"),
])
def test_a_rank_that_works_is_busy_and_one_that_does_not_is_stuck(cpu, io, state, kind):
    t = tracker([obs(0, 100, {"0": (7, 7)}), obs(1, 100, {"0": (7, 7)}, cpu=0.0)],
                [obs(0, 105, {"0": (8, 7)}), obs(1, 105, {"0": (7, 7)}, cpu=cpu / 2, io=io // 2, state=state)],
                [obs(0, 110, {"0": (8, 7)}), obs(1, 110, {"0": (7, 7)}, cpu=cpu / 2 + cpu / 4, io=3 * io // 4,
                                                  state=state)],
                [obs(0, 125, {"0": (8, 7)}), obs(1, 125, {"0": (7, 7)}, cpu=cpu * 1.25, io=io, state=state)])
    st = t.standing()
    assert kinds(t) == {0: "waiting", 1: kind}
    assert st.kind == ("busy" if kind == "busy" else "stuck")


def test_a_busy_rank_says_how_long_and_how_busy():
    t = tracker([obs(0, 100, {"0": (7, 7)}), obs(1, 100, {"0": (7, 7)}, cpu=0.0)],
                [obs(0, 110, {"0": (8, 7)}), obs(1, 110, {"0": (7, 7)}, cpu=9.8)])
    t.add(obs(0, 114, {"0": (8, 7)}), 30.0)
    t.add(obs(1, 114, {"0": (7, 7)}, cpu=13.72), 612.0)
    busy = t.standing().ranks[1]
    assert busy.kind == "busy" and busy.doing(612.0) == "has been busy in its own code for 612s (98% of a core)"


def test_nobody_waiting_on_anybody_is_no_hang_however_long():
    t = tracker([obs(r, 100, {"0": (7, 7)}) for r in (0, 1)], [obs(r, 400, {"0": (7, 7)}) for r in (0, 1)])
    assert kinds(t) == {0: "idle", 1: "idle"} and t.standing().kind == "nobody waits"


def test_every_rank_inside_a_collective_is_all_wait():
    t = tracker([obs(0, 100, {"0": (11, 11)}), obs(1, 100, {"0": (10, 10)})],
                [obs(0, 110, {"0": (12, 11)}), obs(1, 110, {"0": (11, 10)})],
                [obs(0, 120, {"0": (12, 11)}), obs(1, 120, {"0": (11, 10)})])
    assert kinds(t) == {0: "waiting", 1: "waiting"} and t.standing().kind == "all wait"


def test_a_newer_step_is_progress_and_a_log_line_is_not_an_observation():
    t = tracker([obs(0, 100, {"0": (7, 7)}, step=4), obs(1, 100, {"0": (8, 7)})])
    assert t.add(obs(0, 110, {"0": (7, 7)}, step=5), 1.0)  # a step told, no collective: progress
    assert not t.add(obs(1, 110, {"0": (8, 7)}), 1.0)
    assert kinds(t) == {0: "moving", 1: "waiting"} and t.last_progress() == 1.0


def test_a_rank_its_node_reports_no_more_has_left_and_is_gone_only_after_gone_s():
    t = tracker([obs(0, 100, {"0": (7, 7)}), obs(1, 100, {"0": (7, 7)})],
                [obs(0, 110, {"0": (8, 7)}), *gone("n2", [1], 110)])
    st = t.standing()
    assert kinds(t) == {0: "moving", 1: "left"} and not st.early  # torchrun ends a node whose rank ended
    t.add(obs(0, 114, {"0": (8, 7)}), 2.0)
    assert t.standing().kind == "ending"  # the others leave the last collective within moments
    t.add(gone("n2", [1], 110 + GONE_S)[0], 3.0)
    t.add(obs(0, 110 + GONE_S, {"0": (8, 7)}), 3.0)
    st = t.standing()
    assert kinds(t) == {0: "waiting", 1: "gone"} and st.kind == "stuck" and st.ranks[1].node == "n2"


def test_a_rank_whose_script_ended_or_whose_node_ended_is_never_waited_for():
    from dataclasses import replace
    t = tracker([obs(0, 100, {"0": (7, 7)}), obs(1, 100, {"0": (7, 7)})],
                [obs(0, 110, {"0": (8, 7)}), replace(obs(1, 110, state="S"), exiting=True, replied=False)],
                [obs(0, 200, {"0": (8, 7)}), replace(obs(1, 200, state="S", cpu=1.0), exiting=True, replied=False)])
    assert kinds(t) == {0: "waiting", 1: "left"} and t.standing().kind == "ending"
    t.end([1])
    assert kinds(t) == {0: "waiting", 1: "ended"} and t.standing().kind == "ending"
    fresh = Tracker([0, 1])
    fresh.end([1])  # a node that ended before any record of it came
    assert fresh.state(1).kind == "ended"


def test_a_rank_never_seen_keeps_the_standing_undecided():
    t = tracker([obs(0, 100, {"0": (8, 7)})], [obs(0, 110, {"0": (8, 7)})])
    assert t.standing().kind == "quiet"
