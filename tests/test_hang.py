"""The hang verdict (runs/judge/hang.py) from snapshots recorded on real runs, the watch's decisions, and
the node side (the hook in a rank and the agent's `snapshot`) run as shipped.

tests/fixtures/hangs/*.json are runs/RUN/hangs/1/snapshots.json of three runs of
tests/scripts/hang_ddp.py on two `connection: local` nodes (gloo on CPU, torch 2.13, --hang-timeout
10): rank 1 blocked in slow_data_loader (loader), SIGSTOPped (stop), and calling broadcast where
rank 0 calls all_reduce (skip). Each holds every request the watch made, by request number.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.runs.judge.hang import HangVerdict, analyze, link_ends, with_links
from orchestrator.runs.judge.hangrule import Tracker
from orchestrator.runs.judge.hangsnap import Frame, RankSnap, stacks_text
from tests.conftest import wait_for
from tests.test_node_agent import agent, rundir  # noqa: F401 - fixture

FIXTURES = Path(__file__).parent / "fixtures" / "hangs"
HOOK = (Path(__file__).parent.parent / "orchestrator" / "remote" / "hook" / "sitecustomize.py").read_text()


def recorded(name: str, request: str) -> list[RankSnap]:
    doc = json.loads((FIXTURES / f"{name}.json").read_text())[request]
    return [RankSnap.from_agent(node, r) for node, ranks in sorted(doc.items()) for r in ranks]


def last(name: str) -> str:
    return max(json.loads((FIXTURES / f"{name}.json").read_text()), key=int)


def test_a_rank_in_its_data_loader_is_named_with_the_collective_the_others_wait_in():
    v = analyze(recorded("loader", last("loader")), [0, 1], {0: "local0", 1: "local1"})
    assert v.text.startswith("hang: rank 1 (local1, pid ")
    assert "never entered gloo:all_reduce #11 that rank 0 waits in; its stack: hang_ddp.py:30 slow_data_loader" \
        in v.text
    assert v.nodes == ("local1",) and not v.mismatch and v.collective == "gloo:all_reduce #11"
    assert "stacks: rank 0 at hang_ddp.py:52 <module>; rank 1 at hang_ddp.py:30 slow_data_loader" in v.details


def test_a_stopped_rank_is_named_as_stopped():
    v = analyze(recorded("stop", last("stop")), [0, 1], {0: "local0", 1: "local1"})
    assert "rank 1 (local1, pid " in v.text
    assert "is stopped (state T: SIGSTOP, or a debugger holds it): it never entered gloo:all_reduce #11 that " \
           "rank 0 waits in" in v.text
    assert v.nodes == ("local1",)


def test_two_ranks_in_different_collectives_are_a_mismatch_and_no_node_is_blamed():
    v = analyze(recorded("skip", last("skip")), [0, 1], {0: "local0", 1: "local1"})
    assert v.text == "hang: collective mismatch at #11: rank 0 (local0) in gloo:all_reduce; rank 1 (local1) in " \
                     "gloo:broadcast"
    assert v.mismatch and v.nodes == ()  # the script's own bug: a restart elsewhere hangs again


@pytest.mark.slow
def test_a_mismatch_names_the_collective_most_ranks_entered_whatever_the_hash_seed():
    """The verdict's collective was taken from a set of names, whose order changes with
    PYTHONHASHSEED: the cluster test read gloo:broadcast (the odd rank's) about half the time."""
    code = ("import json,sys; sys.path.insert(0, '.'); from tests.test_hang import recorded, last; "
            "from orchestrator.runs.judge.hang import analyze, RankSnap; import dataclasses; "
            "s = recorded('skip', last('skip')); s = s + [dataclasses.replace(s[0], rank=2, node='local2')]; "
            "print(analyze(s, [0, 1, 2]).collective)")
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout.strip() for seed in range(6)}
    assert seen == {"gloo:all_reduce #11"}, seen


def test_a_rank_too_slow_to_answer_the_first_snapshot_is_not_progress():
    # recorded: rank 1 answered request 1 after the agent's wait; taking its first answer as the
    # baseline would see its collectives appear as progress
    t = Tracker([0, 1])
    moved = [t.add(s, float(k)) for k in ("1", "2", "3", "4") for s in recorded("loader", k)]
    assert not any(moved)


def snap(node, rank, pgs, names=None, where=("train.py", 10, "step", False), state="S", error=None, answered=True,
         done=None):
    frames = (Frame(where[0], where[1], where[2], lib=where[3]),)
    return RankSnap(node, rank, 100 + rank, state, "", 1.0, error, (("MainThread", frames),) if answered else (),
                    pgs if answered else {}, names or {}, done=(done or {}) if answered else {})


AR = ("gloo:all_reduce", "[[4]]")


def test_four_ranks_three_waiting_name_the_one_behind_and_the_waiters_as_a_range():
    lib = ("distributed_c10d.py", 3252, "all_reduce", True)
    snaps = [snap(f"n{r + 1}", r, {"0": 41}, {("0", 41): AR}, where=lib) for r in (0, 2, 3)]
    snaps.append(snap("n2", 1, {"0": 40}, {("0", 40): AR}, where=("hang.py", 3, "slow_data_loader", False)))
    v = analyze(snaps, range(4))
    assert v.text == ("hang: rank 1 (n2, pid 101) never entered gloo:all_reduce #41 that ranks 0,2-3 wait in; "
                      "its stack: hang.py:3 slow_data_loader")
    assert v.culprits[0].node == "n2" and v.nodes == ("n2",)


def test_a_rank_behind_in_a_subgroup_is_found_there():
    lib = ("distributed_c10d.py", 1, "all_reduce", True)
    snaps = [snap("n1", 0, {"0": 5, "1": 9}, {("1", 9): AR}, where=lib),
             snap("n2", 1, {"0": 5, "1": 8}, {("1", 8): AR}, where=("t.py", 7, "own", False)),
             snap("n3", 2, {"0": 5}, {}, where=lib)]
    v = analyze(snaps, range(3))
    assert "rank 1 (n2, pid 101) never entered gloo:all_reduce #9 of process group 1 that rank 0 waits in" in v.text


def test_every_rank_waiting_in_the_same_collective_asks_about_links_and_names_them():
    lib = ("distributed_c10d.py", 1, "all_reduce", True)
    snaps = [snap(f"n{r + 1}", r, {"0": 318}, {("0", 318): AR}, where=lib) for r in range(4)]
    v = analyze(snaps, range(4))
    assert not v.culprits and v.collective == "gloo:all_reduce #318"
    assert "every rank entered gloo:all_reduce #318 and none came out" in v.text
    linked = with_links(v, [("n2", "n3")])
    assert "the nodes n2 ↔ n3 cannot reach each other" in linked.text and linked.links == (("n2", "n3"),)
    assert with_links(v, []) is v


def test_ranks_all_in_their_own_code_are_not_a_collective_hang():
    snaps = [snap(f"n{r + 1}", r, {}, where=("io.py", 5, "read_shard", False)) for r in range(2)]
    v = analyze(snaps, range(2))
    assert v.text == "hang: no rank made progress for the hang timeout and none is in a collective"
    assert v.details == ("stacks: every rank at io.py:5 read_shard",)


def test_a_rank_without_a_process_and_one_in_d_state_are_named():
    snaps = [snap("n1", 0, {"0": 3}, {("0", 3): AR}),
             snap("n2", 1, {}, state="D", error="no answer within 10s", answered=False)]
    v = analyze(snaps, range(3), {2: "n3"})
    assert "rank 1 (n2, pid 101) is in uninterruptible sleep (state D)" in v.text
    assert "rank 2 (n3, pid ?) has no process left on its node" in v.text
    assert set(v.nodes) == {"n2", "n3"}


def test_a_rank_in_its_own_code_is_inside_no_collective_whatever_gloos_counter_says():
    # gloo's "last completed" left one behind for good ([3, 2] after three all_reduces returned):
    # the stacks say the rank computes in its own code, so it waits in nothing
    lib = ("distributed_c10d.py", 3252, "all_reduce", True)
    own = snap("n1", 0, {"0": 3}, {("0", 3): AR}, where=("train.py", 9, "evaluate", False), done={"0": 2})
    waiting = snap("n2", 1, {"0": 4}, {("0", 4): AR}, where=lib, done={"0": 3})
    assert own.inside == {} and waiting.inside == {"0": 4}
    assert snap("n1", 0, {"0": 3}, where=lib, done={"0": 2}).inside == {"0": 3}
    v = analyze([own, waiting], range(2))
    assert v.text.startswith("hang: rank 0 (n1, pid 100) never entered gloo:all_reduce #4 that rank 1 waits in"), v.text


def test_a_busy_rank_whose_hook_did_not_answer_is_still_named_busy():
    # a rank spinning in Python lends its hook the GIL in 5 ms slices: on a loaded node the answer
    # can miss the wait, and py-spy's stack stands in; what the watch saw it do is still said first
    lib = ("distributed_c10d.py", 3252, "all_reduce", True)
    spun = dataclasses.replace(snap("n2", 1, {}, where=("hang_ddp.py", 53, "spin", False), state="R",
                                    error="no hook answers in it"), from_outside=True)  # py-spy's stack
    v = analyze([snap("n1", 0, {"0": 7}, {("0", 7): AR}, where=lib), spun], range(2),
                busy={1: "has been busy in its own code for 25s (98% of a core)"})
    assert v.text == ("hang: rank 1 (n2, pid 101) has been busy in its own code for 25s (98% of a core) and did "
                      "not answer (no hook answers in it; state R); its stack (py-spy): hang_ddp.py:53 spin: it "
                      "never entered gloo:all_reduce #7 that rank 0 waits in"), v.text


def test_stacks_text_prints_identical_stacks_once_under_their_ranks():
    snaps = [snap("n1", r, {"0": 2}, {("0", 2): AR}) for r in range(3)] + [snap("n2", 3, {"0": 1})]
    text = stacks_text(snaps)
    assert text.count("---- ") == 2
    assert "---- ranks 0-2 (n1 r0 pid 100, n1 r1 pid 101, n1 r2 pid 102)" in text
    assert "collectives entered: pg 0 #2 gloo:all_reduce" in text


def test_a_verdict_serialises_what_the_record_and_json_report():
    v = HangVerdict("hang: x", ("d",), collective="gloo:all_reduce #1")
    assert v.to_json() == {"text": "hang: x", "details": ["d"], "collective": "gloo:all_reduce #1",
                           "mismatch": False, "deadlock": False, "links": [], "avoid": [], "culprits": []}


# ------------------------------------------------------------------ the node side, as shipped

RANK = """
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for _ in range(3):
    dist.all_reduce(torch.ones(2))
print("ready", flush=True)
def stuck_here():
    while True:
        time.sleep(0.05)
stuck_here()
"""
LAUNCH = ("import os, subprocess, sys; subprocess.run([sys.executable, '-c', os.environ['CHILD']], "
          "env=dict(os.environ, RANK='0', LOCAL_RANK='0'))")


# the rank's Python under a shell script that carries its RANK too (a user's `run.sh` wrapper)
LAUNCH_SH = ("import os, subprocess, sys; subprocess.run(['/bin/sh', '-c', '\"$0\" -c \"$CHILD\"; true', "
             "sys.executable], env=dict(os.environ, RANK='0', LOCAL_RANK='0'))")


@pytest.mark.slow
@pytest.mark.parametrize("launch", [LAUNCH, LAUNCH_SH], ids=["python", "under-a-shell"])
def test_a_rank_answers_the_agents_snapshot_with_its_stack_and_flight_recorder(agent, launch):
    spec = {"argv": [sys.executable, "-c", launch], "cwd": str(agent.home), "env": {"CHILD": RANK},
            "hook": HOOK}
    r = agent("start", "h1@n1", json.dumps(spec).encode().hex())
    assert r.returncode == 0, r.stderr
    d = rundir(agent, "h1@n1")
    try:
        assert wait_for(lambda: b"ready" in (d / "log").read_bytes(), timeout=60), (d / "log").read_bytes()
        assert (d / "py" / "sitecustomize.py").read_text() == HOOK
        doc = json.loads(agent("snapshot", "h1@n1", 1, 20).stdout)
        [rank] = doc["ranks"]
        assert rank["rank"] == 0 and rank["state"] in "RS" and "error" not in rank, rank
        s = RankSnap.from_agent("n1", rank)
        assert s.where.endswith(" stuck_here") and s.pgs == {"0": 3}
        assert s.names[("0", 3)][0] == "gloo:all_reduce"
        assert 0 <= rank["at"] - s.entered_at["0"] < 120  # when it entered #3, on this clock (Flight Recorder)
        assert not list((d / "hook").glob("*.json"))  # answers are taken away once read
        # the progress answer, every few seconds on the node's stream: each process group's newest
        # collective entered and completed (the hang watch's "inside a collective"), and the rank's
        # CPU and disk I/O with the moment they were read
        # torch 2.13's gloo writes the process group's "last completed" from each of its two worker
        # threads without ordering them: on a loaded machine the slower thread's older number can be
        # the last written, and stays (read [3, 2] for 30 s after all three all_reduces returned, in
        # CI and here under six busy loops; [3, 1] once). NCCL writes it from its one watchdog thread.
        prog = json.loads(agent("snapshot", "h1@n1", 4, 20, "progress").stdout)["ranks"][0]
        assert "stacks" not in prog["answer"], prog
        [[entered, completed]] = prog["answer"]["pgs"].values()
        assert entered == 3 and 1 <= completed <= 3 and list(prog["answer"]["pgs"]) == ["0"], prog
        assert prog["tree_cpu_s"] >= prog["cpu_s"] > 0 and isinstance(prog["io"], int) and prog["at"] > 0, prog
        p = RankSnap.from_agent("n1", prog)
        assert p.replied and p.pgs == {"0": 3} and p.done == {"0": completed} and p.t == prog["at"]
        assert p.inside == ({} if completed == 3 else {"0": 3})
        os.kill(rank["pid"], signal.SIGSTOP)
        try:
            stopped = json.loads(agent("snapshot", "h1@n1", 2, 5).stdout)["ranks"][0]
            assert stopped["state"] == "T" and stopped["error"] == "not asked: the process is stopped"
            # the second source: py-spy (a test dependency, next to this python) reads its stack from
            # outside without waking it; it still counts as not answered, and is named as stopped
            s = RankSnap.from_agent("n1", stopped)
            assert s.from_outside and not s.answered and s.where.endswith(" stuck_here"), stopped.get("pyspy")
            v = analyze([s], [0], {0: "n1"})
            assert "is stopped (state T: SIGSTOP, or a debugger holds it); its stack (py-spy): " in v.text, v.text
            assert "stuck_here" in v.text and "read from outside by py-spy:" in stacks_text([s])
            assert json.loads(agent("snapshot", "h1@n1", 3, 5).stdout)["ranks"][0]["state"] == "T"  # not woken
            # the progress request (the stream's, every few seconds) asks a stopped rank too (a rank
            # throttled by stops answers when it runs), but does not wait out its whole wait for one
            # that stays stopped: the hang watch hears of the stop at once (STOPPED_WAIT_S)
            prog = json.loads(agent("snapshot", "h1@n1", 5, 600, "progress", timeout=60).stdout)["ranks"][0]
            assert prog["state"] == "T" and prog["error"] == "not answered: the process is stopped", prog
        finally:
            os.kill(rank["pid"], signal.SIGCONT)
    finally:
        agent("stop", "h1@n1", 1)


LIGHT = """
import importlib.util, json, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for _ in range(3):
    dist.all_reduce(torch.ones(2))
spec = importlib.util.spec_from_file_location("the_hook", sys.argv[1])
hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook)
fr = hook._flight_recorder()
print(json.dumps({"fr": fr, "inductor": "torch._inductor" in sys.modules}))
"""


@pytest.mark.slow
def test_the_hooks_flight_recorder_read_does_not_load_torchs_compiler_into_the_rank(tmp_path):
    """torch's first Flight Recorder dump with stack traces imports torch._inductor into the rank
    (about 800 modules, 1.2-2.6 s of its CPU on torch 2.13: the hang watch's first snapshot waited
    that long for every waiting rank). The hook reads the entries without them."""
    hook = Path(__file__).parent.parent / "orchestrator" / "remote" / "hook" / "sitecustomize.py"
    r = subprocess.run([sys.executable, "-c", LIGHT, str(hook)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TORCH_FR_BUFFER_SIZE="2000"))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.splitlines()[-1])
    assert [e["profiling_name"] for e in doc["fr"]["entries"]] == ["gloo:all_reduce"] * 3, doc
    assert doc["fr"]["pg_status"]["0"]["last_enqueued_collective"] == 3, doc
    assert doc["inductor"] is False


# a rank whose script ended and whose exit takes long (a finalizer that waits: a loaded machine's
# slow teardown): the hook's atexit ran, so the agent reports it exiting, not a rank to wait for
EXITING = """
import time
class Slow:
    def __del__(self):
        time.sleep(30)
keep = Slow()
print("ready", flush=True)
"""


def test_a_rank_whose_script_ended_is_reported_exiting_not_as_one_that_does_not_answer(agent):
    spec = {"argv": [sys.executable, "-c", LAUNCH], "cwd": str(agent.home), "env": {"CHILD": EXITING},
            "hook": HOOK}
    assert agent("start", "h2@n1", json.dumps(spec).encode().hex()).returncode == 0
    d = rundir(agent, "h2@n1")
    try:
        assert wait_for(lambda: b"ready" in (d / "log").read_bytes(), timeout=60), (d / "log").read_bytes()
        assert wait_for(lambda: list((d / "hook").glob("*.exiting")), timeout=30, what="the hook's exit mark")
        [rank] = json.loads(agent("snapshot", "h2@n1", 1, 5, "progress").stdout)["ranks"]
        assert rank["exiting"] is True and rank["error"] == "not asked: it is exiting (its script ended)", rank
        s = RankSnap.from_agent("n1", rank)
        assert s.exiting and not s.replied
        t = Tracker([0])
        t.add(s, 0.0)
        assert t.state(0).kind == "left" and t.standing().kind == "nobody waits"
    finally:
        agent("stop", "h2@n1", 1)


def test_the_hook_stays_out_of_processes_that_are_not_ranks_and_runs_the_sitecustomize_it_shadows(tmp_path):
    hook, other, fifos = tmp_path / "py", tmp_path / "other", tmp_path / "hook"
    for p in (hook, other, fifos):
        p.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    (other / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_RAN'] = '1'\n")
    import subprocess

    code = "import os, sys; print(os.environ.get('SHADOWED_RAN'), sorted(os.listdir(sys.argv[1])))"
    env = dict(os.environ, PYTHONPATH=f"{hook}{os.pathsep}{other}", CLUSTERCTL_HOOK_DIR=str(fifos))
    env.pop("RANK", None)
    out = subprocess.run([sys.executable, "-c", code, str(fifos)], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["1", "[]"], out.stderr  # no RANK: no FIFO, and the shadowed one ran
    out = subprocess.run([sys.executable, "-c", code, str(fifos)], env=dict(env, RANK="3"), capture_output=True,
                         text=True)
    assert out.stdout.strip().startswith("1 ['") and ".fifo" in out.stdout, out.stderr


def test_two_ranks_waiting_for_each_other_in_two_groups_are_a_deadlock_and_no_node_is_blamed():
    """Ranks 0 and 1 share groups 1 and 2: rank 0 waits in group 1's #6, which rank 1 never
    entered; rank 1 in group 2's #6, which rank 0 never entered; ranks 2-3 wait for both in the
    default group. Without the cycle the verdict named ranks 0 and 1 as merely behind."""
    lib = ("distributed_c10d.py", 1, "all_reduce", True)
    snaps = [snap("n1", 0, {"0": 9, "1": 6, "2": 5}, {("0", 9): AR, ("1", 6): AR, ("2", 5): AR}, where=lib),
             snap("n2", 1, {"0": 9, "1": 5, "2": 6}, {("0", 9): AR, ("1", 5): AR, ("2", 6): AR}, where=lib),
             snap("n3", 2, {"0": 10}, {("0", 10): AR}, where=lib),
             snap("n4", 3, {"0": 10}, {("0", 10): AR}, where=lib)]
    v = analyze(snaps, range(4))
    assert v.text == ("hang: deadlock: rank 0 (n1) waits in gloo:all_reduce #6 of process group 1, which rank 1 (n2) "
                      "never entered; rank 1 (n2) waits in gloo:all_reduce #6 of process group 2, which rank 0 (n1) "
                      "never entered")
    assert v.deadlock and not v.mismatch and v.nodes == ()  # the script's own bug: it deadlocks again elsewhere
    assert v.details[0] == ("so: rank 0 (n1, pid 100) never entered gloo:all_reduce #10 that ranks 2-3 wait in; its "
                            "stack: distributed_c10d.py:1 all_reduce; rank 1 (n2, pid 101) never entered "
                            "gloo:all_reduce #10 that ranks 2-3 wait in; its stack: distributed_c10d.py:1 all_reduce")
    assert v.to_json()["deadlock"] is True


def test_a_rank_behind_with_nobody_waiting_on_the_waiters_is_no_deadlock():
    lib = ("distributed_c10d.py", 1, "all_reduce", True)
    snaps = [snap("n1", 0, {"0": 9, "1": 6}, {("1", 6): AR}, where=lib),
             snap("n2", 1, {"0": 9, "1": 5}, {("1", 5): AR}, where=("t.py", 7, "own", False))]
    v = analyze(snaps, range(2))
    assert not v.deadlock and v.text.startswith("hang: rank 1 (n2, pid 101) never entered gloo:all_reduce #6")
    assert v.nodes == ("n2",)


BC = ("gloo:broadcast", "[[1]]")
LIB = ("distributed_c10d.py", 1, "wait", True)


def partitioned():
    """n2 and n3 cut from each other mid-step: ranks 0,2-3 entered broadcast #12, rank 1 is still
    inside all_reduce #11 (entered, not completed), as the Flight Recorder has it."""
    snaps = [snap(f"n{r + 1}", r, {"0": 12}, {("0", 12): BC}, where=LIB, done={"0": 11}) for r in (0, 2, 3)]
    snaps.append(snap("n2", 1, {"0": 11}, {("0", 11): AR}, where=LIB, done={"0": 10}))
    return snaps


def test_a_rank_waiting_inside_an_earlier_collective_did_not_stay_away_from_the_later_one():
    v = analyze(partitioned(), range(4))
    assert not v.culprits and "never entered" not in v.text, v.text
    assert v.text == ("hang: every rank waits inside a collective (ranks 0,2-3 in gloo:broadcast #12; rank 1 in "
                      "gloo:all_reduce #11) and none came out: the ranks cannot reach each other (a link between "
                      "nodes, or a firewall)")
    linked = with_links(v, [("n2", "n3")], ["n1", "n2", "n3", "n4"])
    assert linked.text.startswith("hang: every rank waits inside a collective (ranks 0,2-3 in gloo:broadcast #12; "
                                  "rank 1 in gloo:all_reduce #11) and the nodes n2 ↔ n3 cannot reach each other")
    # no node is blamed: a restart leaves out one end of the link, for this run
    assert linked.culprits == () and linked.avoid == ("n3",) and linked.nodes == ("n3",)
    assert linked.details[-1] == ("no node is to blame; --on-hang restart goes on without n3 (one end of each "
                                  "broken link, for this run only)")
    assert linked.to_json()["avoid"] == ["n3"]


def test_a_rank_that_never_reached_the_first_collective_is_named():
    waiting = [snap(f"n{r + 1}", r, {"0": 1}, {("0", 1): ("gloo:barrier", "[[0]]")}, where=LIB, done={"0": -1})
               for r in (0, 2, 3)]
    early = snap("n2", 1, {}, where=("train.py", 7, "download", False))  # its hook answered; no collective yet
    v = analyze([*waiting, early], range(4))
    assert v.text == ("hang: rank 1 (n2, pid 101) never entered gloo:barrier #1 that ranks 0,2-3 wait in; its stack: "
                      "train.py:7 download")
    assert v.nodes == ("n2",)


def test_a_rank_busy_past_the_limit_is_named_busy():
    snaps = [snap(f"n{r + 1}", r, {"0": 41}, {("0", 41): AR}, where=LIB, done={"0": 40}) for r in (1, 2)]
    snaps.append(snap("n1", 0, {"0": 40}, {("0", 40): AR}, where=("eval.py", 9, "evaluate", False), done={"0": 40}))
    v = analyze(snaps, range(3), busy={0: "has been busy in its own code for 612s (98% of a core)"})
    assert v.text == ("hang: rank 0 (n1, pid 100) has been busy in its own code for 612s (98% of a core) and never "
                      "entered gloo:all_reduce #41 that ranks 1-2 wait in; its stack: eval.py:9 evaluate")


@pytest.mark.parametrize("down, ends", [
    ([("n2", "n3")], ("n3",)),  # of two workers, the later in rank order
    ([("n1", "n2")], ("n2",)),  # never the master when the other end will do
    ([("n1", "n3"), ("n3", "n2"), ("n4", "n3")], ("n3",)),  # the node in every broken pair
    ([("n2", "n3"), ("n1", "n4")], ("n3", "n4")),
])
def test_a_restart_leaves_out_the_fewest_ends_of_the_broken_links(down, ends):
    assert link_ends(down, ["n1", "n2", "n3", "n4"]) == ends
