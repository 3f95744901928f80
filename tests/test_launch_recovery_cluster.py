"""The launch is part of the recovery (runs/controller.py, runs/claims.py), on the real test
cluster: a node down when the run starts, or cut while it launches, is replaced by the spare
(nothing launched: no restart spent), and no claim of the run is left on it once it is back."""

import json
import re
import subprocess
import sys
import time

import pytest

from orchestrator.runs.store import Run
from orchestrator.transfer import pair
from tests.conftest import wait_for
from tests.test_train_cluster import DDP, cli, prepare, rec_of

pytestmark = pytest.mark.cluster

ONE_PARAGRAPH = re.compile(r"\n\s*\n")


def with_spare(cluster, tmp_path, name="nodes.yaml"):
    nodes = cluster.inventory()["nodes"]
    nodes[-1]["spare"] = True
    return prepare(cluster, tmp_path, nodes=nodes) if name == "nodes.yaml" else \
        str(cluster.write_inventory(tmp_path / name, nodes=nodes))


def claims_on(node) -> list[str]:
    return node.run("cat ~/.clusterctl/claims/* 2>/dev/null || true").stdout.split("}")[:-1]


def cluster_claims(inv) -> list[dict]:
    """`runs --cluster --json`: every run holding a claim or a process on the inventory's nodes."""
    r = cli("runs", "--cluster", "-i", inv, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def start_train(inv, *flags, steps=40, restart_steps=None):
    again = ("--restart-steps", str(restart_steps)) if restart_steps is not None else ()
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", inv, "--lost-timeout", "5",
                             *flags, "--", DDP, "--steps", str(steps), "--sleep", "0.1", *again],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def the_run(home):
    return wait_for(lambda: next((p for p in (home / "runs").glob("*") if (p / "run.json").exists()), None)
                    if (home / "runs").exists() else None, 60, "the run directory")


def test_a_node_down_at_launch_is_replaced_by_the_spare_and_without_one_the_run_says_why(
        make_cluster, tmp_path, home):
    cluster = make_cluster(4, gpus=0)
    n1, n2, n3, n4 = cluster.nodes
    inv = with_spare(cluster, tmp_path)
    n2.link_down()
    try:
        t0 = time.monotonic()
        r = cli("train", "-i", inv, "--", DDP, "--steps", "5")  # --max-restarts 0: none is needed
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stderr[-3000:]
        run_dir = the_run(home)
        rec = rec_of(run_dir)
        assert rec["state"] == "finished" and [a["nodes"] for a in rec["attempts"]] == [["node1", "node4", "node3"]]
        assert rec["attempts"][0]["prepared"] == ["node4"]  # the spare was brought to the run's code first
        assert rec["left_out_why"]["node2"].startswith("unreachable at launch: connect to host "), rec["left_out_why"]
        said = [ln for ln in r.stderr.splitlines() if ln.startswith("clusterctl: node2 is unreachable")]
        assert said and "No route to host" in said[0] and "node4 takes its place" in said[0] \
            and "no restart is spent" in said[0], r.stderr[-3000:]
        assert "connection refused" not in r.stderr.lower()
        print(f"node down at launch: finished on the spare in {took:.1f}s")

        # no spare: one paragraph, exit 3, what ssh says, and what to do
        no_spare = str(cluster.write_inventory(tmp_path / "three.yaml", nodes=cluster.inventory()["nodes"][:3]))
        r = cli("train", "-i", no_spare, "--", DDP, "--steps", "5")
        assert r.returncode == 3, r.stderr
        err = r.stderr[r.stderr.index("failed: "):r.stderr.index("clusterctl: logs:")].strip()
        assert not ONE_PARAGRAPH.search(err) and "Traceback" not in r.stderr, r.stderr
        assert "cannot reach node2, nothing was started" in err and "No route to host" in err, err
        assert "--min-nodes 2" in err and "spare: true" in err, err
    finally:
        n2.link_up()
    assert not claims_on(n2) and not cluster_claims(inv)


@pytest.mark.parametrize("when", ["launching", "3s-after-train"])
def test_a_node_cut_as_the_run_launches_is_replaced_by_the_spare_and_holds_no_claim_once_back(
        make_cluster, tmp_path, home, when):
    """Cut when the record says `launching` (its torchrun not started yet), or 3 s after `train`
    began (wherever that lands: preflight, claim, launch or the first steps): the run is launched
    again on the spare and finishes; node2, back, holds no claim of it and takes a new run."""
    cluster = make_cluster(4, gpus=0)
    n1, n2, n3, n4 = cluster.nodes
    inv = with_spare(cluster, tmp_path)
    proc = start_train(inv, "--max-restarts", "1")
    try:
        if when == "launching":
            run_dir = the_run(home)
            wait_for(lambda: rec_of(run_dir).get("state") == "launching" or proc.poll() is not None, 120,
                     "the launch")
        else:
            time.sleep(3)
        n2.link_down()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        n2.link_up()
    run_dir = the_run(home)
    rec = rec_of(run_dir)
    assert proc.returncode == 0 and rec["state"] == "finished", err[-3000:]
    attempts = rec["attempts"]
    assert attempts[-1]["nodes"] == ["node1", "node4", "node3"] and attempts[-1]["verdict"] == "finished", attempts
    if when == "3s-after-train" and len(attempts) == 1:
        # the cut landed before the first attempt's nodes were chosen (preflight, or the connections
        # the launch opens): node2 was never in the run, the spare took its place from the start
        assert "node2 is unreachable" in err and "node4 takes its place" in err, err[-3000:]
        assert "no restart is spent" in err, err[-3000:]
    else:
        assert attempts[0]["nodes"] == ["node1", "node2", "node3"] and attempts[0]["verdict"] == "node lost", attempts
    if when == "launching":
        assert not attempts[0].get("launched"), attempts[0]  # lost during the launch: no restart spent
        assert "attempt 1 never launched, so no restart is spent" in err, err[-3000:]
    print(f"cut {when}: attempt 1 on {attempts[0]['nodes']}, "
          f"{'launched' if attempts[0].get('launched') else 'never launched'}; {attempts[0].get('detail')}")
    # the supervisor waits for node2 to answer, then stops what of the run may be there and drops its claim
    wait_for(lambda: not claims_on(n2), 60, "node2's claim dropped once it answered again")
    assert not cluster_claims(inv)
    r = cli("train", "-i", inv, "--skip-preflight", "--", DDP, "--steps", "2")  # node2 is free again
    assert r.returncode == 0, r.stderr[-3000:]


# ------------------------------------------------------------------ the spare cut while it is prepared

HOLD_LOCK = ("import fcntl, os, time; os.makedirs(os.path.expanduser('~/.clusterctl/claims'), 0o700, exist_ok=True); "
             "f = open(os.path.expanduser('~/.clusterctl/claims/node4.lock'), 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
             "print('held', flush=True); time.sleep(600)")


def agent_verb_on(cluster, node, verb):
    """A node agent `VERB` running on the node (`python -c BOOT CODE node_agent VERB ...`), by its
    command line."""
    from tests.conftest import scan

    return [p for p, cmd in scan(cluster.processes(node)) if f" node_agent {verb} " in f"{cmd} "]


def copying_to(cluster, node):
    """The code copy's receiving end is running on the node (its relay carries CLUSTERCTL_XFER)."""
    from tests.conftest import scan

    return [p for p, env in scan(cluster.processes(node), lambda p: p.environ()) if "CLUSTERCTL_XFER" in env]


def sync_big_code(cluster, tmp_path, inv, mb):
    """The run's code on the ranked nodes only, with one large file: its copy to a spare takes time."""
    src = tmp_path / "code"
    src.mkdir()
    (src / "train_helpers.py").write_text("VALUE = 1\n")
    (src / "weights.bin").write_bytes(bytes(range(256)) * (mb << 12))
    r = cli("sync", "-i", inv, "--src", str(src), "--nodes", "node1,node2,node3", timeout=300)
    assert r.returncode == 0, r.stderr


def run_with_n2_cut(cluster, home, inv, before_cut=None, after_cut=None):
    """Start a run (max 1 restart), cut node2 once every node has trained a few steps; -> the
    process, its run directory. The first attempt would run 60 s (it is cut long before), the restart 2 s."""
    n2 = cluster.nodes[1]
    before = {p.name for p in (home / "runs").glob("*")} if (home / "runs").exists() else set()
    proc = start_train(inv, "--max-restarts", "1", steps=600, restart_steps=20)
    run_dir = wait_for(lambda: next((p for p in (home / "runs").glob("*") if p.name not in before
                                     and (p / "run.json").exists()), None) if (home / "runs").exists() else None,
                       60, "the run directory")
    wait_for(lambda: b"step 5 " in ((run_dir / "nodes" / "node2.log").read_bytes()
                                    if (run_dir / "nodes" / "node2.log").exists() else b"")
             or proc.poll() is not None, 180, "steps on node2")
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    if before_cut:
        before_cut()
    n2.link_down()
    if after_cut:
        after_cut(run_dir)
    return proc, run_dir


@pytest.mark.parametrize("where", ["claim", "code-copy"])
def test_the_spare_cut_while_it_is_prepared_ends_the_run_with_a_verdict_and_keeps_no_claim(
        make_cluster, tmp_path, home, where):
    """node2 cut mid-run; the spare node4, entering attempt 2, is cut too: at its claim (held on
    its lock, so the claim lands there after the supervisor gave up on it), or while the run's
    code is copied to it. The run ends with a verdict (no spare left), not an internal error;
    once both links are back no claim of it is left, and the next run's restart onto node4
    finishes."""
    cluster = make_cluster(4, gpus=0)
    n1, n2, n3, n4 = cluster.nodes
    inv = with_spare(cluster, tmp_path)
    holder = None
    if where == "claim":
        holder = n4.popen(["python3", "-c", HOLD_LOCK], stdout=subprocess.PIPE)
        assert holder.stdout.readline().strip() == b"held"

        def cut_spare(run_dir):
            wait_for(lambda: agent_verb_on(cluster, n4, "claim"), 120, "the supervisor's claim on node4, held")
            n4.link_down()
            holder.kill()  # the claim goes through on node4 now, its supervisor cut off from it
            holder.wait(10)
    else:
        sync_big_code(cluster, tmp_path, inv, 48)
        n4.shape(rate="24mbit", burst="64kb", latency="400ms")  # 48 MB take ~16 s

        def cut_spare(run_dir):
            wait_for(lambda: copying_to(cluster, n4), 120, "the code copy to node4")
            time.sleep(2)  # bytes flowing
            n4.link_down()
    try:
        proc, run_dir = run_with_n2_cut(cluster, home, inv, after_cut=cut_spare)
        out, err = proc.communicate(timeout=300)
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
        n2.link_up()
        n4.unshape()
        n4.link_up()
    rec = rec_of(run_dir)
    assert rec["state"] == "failed" and proc.returncode in (1, 3), (proc.returncode, err[-3000:])
    assert "internal error" not in (rec.get("error") or "") and "Traceback" not in (run_dir / "supervisor.log"
                                                                                   ).read_text(), err[-3000:]
    a2 = rec["attempts"][1]
    assert a2["nodes"] == ["node1", "node4", "node3"] and a2["bad_nodes"] == ["node4"], a2
    assert "protocol error" not in json.dumps(rec), a2
    assert "not enough nodes for another attempt" in err, err[-3000:]
    print(f"spare cut at its {where}: attempt 2 {a2['verdict']}: {a2['detail'][:300]}")
    if where == "code-copy":
        # the copy ends as its receiver's node is lost (its sender stopped then), not after the sender's
        # TCP stalled for the relay's idle timeout: node4 was silent 120.8 s when it was named that way
        [lost] = [e for e in map(json.loads, (run_dir / "story.jsonl").read_text().splitlines())
                  if e.get("lost") == "node4"]
        assert lost["silent_s"] < pair.IDLE_TIMEOUT, lost
    # the supervisor waits for the nodes to answer again, then drops the run's claims there
    wait_for(lambda: not claims_on(n4) and not claims_on(n2), 90, "the run's claims dropped once the nodes answered")
    assert run_dir.name not in {d["run"] for d in cluster_claims(inv)}

    proc, run2 = run_with_n2_cut(cluster, home, inv)
    out, err = proc.communicate(timeout=300)
    n2.link_up()
    rec2 = rec_of(run2)
    assert proc.returncode == 0 and rec2["state"] == "finished", err[-3000:]
    assert rec2["attempts"][-1]["nodes"] == ["node1", "node4", "node3"], rec2["attempts"]
    # the story tells node2's loss in one set of words: the failure that follows is that loss
    # (it said "lost: no answer for 5.3s" and then "failed first (no answer from the node for 2.5s ...)")
    lost = re.search(r"^clusterctl: node2 lost: (no answer for [\d.]+s .*)$", err, re.M)
    assert lost and f"clusterctl: node2 failed first ({lost[1]}); stopping every node" in err, err[-3000:]


def test_stop_of_an_ended_run_clears_the_claim_it_left_and_says_what_it_cleared(make_cluster, tmp_path, home):
    """The claim an ended run left on a node (the node did not answer when the run ended, and
    came back after its supervisor had given up): `stop RUN` drops it and says so; with the node
    cut off, it exits 3 naming it."""
    cluster = make_cluster(3, gpus=0)
    n1, n2, n3 = cluster.nodes
    inv = with_spare(cluster, tmp_path)
    n2.link_down()  # the spare node3 runs in its place
    try:
        r = cli("train", "-i", inv, "--skip-preflight", "--", DDP, "--steps", "2")
    finally:
        n2.link_up()
    assert r.returncode == 0, r.stderr[-3000:]
    run_id = the_run(home).name
    assert rec_of(home / "runs" / run_id)["attempts"][0]["nodes"] == ["node1", "node3"]
    left = {"run": run_id, "key": f"{run_id}@node3", "who": "someone@control", "since": time.time()}
    n3.run("mkdir -p ~/.clusterctl/claims && chmod 700 ~/.clusterctl/claims && cat > ~/.clusterctl/claims/node3",
           input=json.dumps(left))
    assert [(d["run"], d["nodes"]) for d in cluster_claims(inv)] == [(run_id, ["node3"])]

    n3.link_down()
    try:
        st = cli("stop", run_id)
        assert st.returncode == 3 and "cannot reach node3" in st.stderr, st.stderr
        assert f"clusterctl stop {run_id}` again once it answers" in st.stderr, st.stderr
    finally:
        n3.link_up()
    st = cli("stop", run_id)
    assert st.returncode == 0, st.stderr
    assert f"run {run_id} had already finished; cleared what was left of it: node3: its claim" in st.stderr, st.stderr
    assert not claims_on(n3) and not cluster_claims(inv)
    st = cli("stop", run_id)
    assert st.returncode == 0 and "no process of it is left on its nodes, and no claim" in st.stderr, st.stderr


def test_a_stop_of_a_job_that_saves_on_sigterm_records_its_own_exit_not_a_kill(make_cluster, tmp_path, home):
    """Each rank saves for 5.5 s of a 10 s grace and exits 0: every node's torchrun ends on its
    own with 0. The workers had half the grace before torchrun was signalled (exit 1) and then
    killed at the grace's end (137), although every rank saved and ended well. (The save is longer
    than half the grace, so the old rule fails it; 4.5 s are left for the ranks' and torchrun's own
    exit, which took more than the 2.5 s an 8 s grace left on a loaded 2-core machine.)"""
    from pathlib import Path

    cluster = make_cluster(2, gpus=0)
    inv = prepare(cluster, tmp_path)
    saver = str(Path(__file__).parent / "scripts" / "save_on_sigterm.py")
    r = cli("train", "-i", inv, "--skip-preflight", "--detach", "--grace", "10", "--", saver, "--save", "5.5")
    assert r.returncode == 0, r.stderr
    run_dir = home / "runs" / r.stdout.strip()
    wait_for(lambda: all(b"step 5" in ((run_dir / "nodes" / f"{n}.log").read_bytes()
                                       if (run_dir / "nodes" / f"{n}.log").exists() else b"")
                         for n in ("node1", "node2")), 120, "steps on both nodes")
    st = cli("stop", run_dir.name)
    assert st.returncode == 0, st.stderr
    rec = rec_of(run_dir)
    assert rec["state"] == "stopped", rec.get("summary")
    for n in rec["nodes"]:
        log = (run_dir / "nodes" / f"{n['name']}.log").read_text()
        assert "saved at step" in log, log[-2000:]
        assert n["exit_code"] == 0, (n["name"], n["exit_code"], log[-2000:])
    status = cli("status", run_dir.name)
    assert " 137 " not in status.stdout, status.stdout


def test_a_claim_an_ended_run_of_this_machine_left_does_not_refuse_the_next_train(make_cluster, tmp_path, home):
    """Run 1 ended, its supervisor gone, but its claim is still on node3 (claimed for a restart,
    the node came back after the supervisor had given up on it): the next `train` on node3 drops
    it, says so, and runs."""
    cluster = make_cluster(3, gpus=0)
    n1, n2, n3 = cluster.nodes
    inv = with_spare(cluster, tmp_path)
    r = cli("train", "-i", inv, "--skip-preflight", "--", DDP, "--steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    first = the_run(home).name
    wait_for(lambda: not Run(first).supervisor_alive(), 60, "run 1's supervisor to end")
    left = {"run": first, "key": f"{first}@node3", "who": "someone@control", "since": time.time()}
    n3.run("mkdir -p ~/.clusterctl/claims && chmod 700 ~/.clusterctl/claims && cat > ~/.clusterctl/claims/node3",
           input=json.dumps(left))
    other = str(cluster.write_inventory(tmp_path / "other.yaml", nodes=[cluster.inventory()["nodes"][i] for i in (0, 2)]))
    r = cli("train", "-i", other, "--skip-preflight", "--", DDP, "--steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"node3: dropped the claim run {first} left there (it ended" in r.stderr, r.stderr[-3000:]
