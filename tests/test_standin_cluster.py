"""The light torchrun stand-in (tests/cluster/fakes/torchrun.py) keeps the launch contract the
control plane relies on, so bench/bench_scale.py measures the product and not the fake: launched
by the product's own `clusterctl train` through the inventory's `python:`, every rank writes its
first line with the `[default<L>]:` prefix, carries torchrun's environment and the run key, and a
killed rank fails its node (exit 1), which the controller names and tears every node down after.
"""

import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.cluster.fakes import install_torchrun_standin
from tests.conftest import run_envs, wait_for

pytestmark = pytest.mark.cluster

NPROC = 3


LOW_OPEN_FILES = 256


def standin_run(make_cluster, home, tmp_path, n, gpus, prefix, env, **popen):
    """A cluster of n stand-in nodes and `clusterctl train` started on it in the foreground:
    (cluster, the foreground process)."""
    cluster = make_cluster(n, gpus=gpus, name_prefix=prefix)
    for nd in cluster.nodes:
        nd.run("mkdir -p ~/gpt_train")
    python = install_torchrun_standin(cluster.base_dir / "standin", cluster.python)
    inv = cluster.write_inventory(tmp_path / "nodes.yaml", python=str(python), env=env)
    fg = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", "-i", str(inv), "--skip-preflight"],
                          env=dict(os.environ, CLUSTERCTL_HOME=str(home)), stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)
    return cluster, fg


def the_run_dir(home):
    return wait_for(lambda: next(iter((home / "runs").glob("*/run.json")), None) if (home / "runs").exists()
                    else None, 120, "the run record").parent


@contextlib.contextmanager
def cleaned_up(fg):
    """Yields a list for the processes the test suspends: on the way out each is resumed, and the
    foreground train, if still running, killed."""
    stopped = []
    try:
        yield stopped
    finally:
        for proc in stopped:
            with contextlib.suppress(psutil.Error):
                proc.resume()
        if fg.poll() is None:
            fg.kill()


def control_copy(run_dir, cluster) -> str:
    """Every node's log as the controller copied it so far."""
    logs = [run_dir / "nodes" / f"{nd.name}.log" for nd in cluster.nodes]
    return "".join(p.read_text(errors="replace") for p in logs if p.exists())


def low_open_files():
    """In the foreground train's child: a soft limit on open files below what a large cluster needs."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW_OPEN_FILES, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def test_standin_launches_every_rank_and_fails_fast(make_cluster, home, tmp_path):
    cluster, fg = standin_run(make_cluster, home, tmp_path, 2, NPROC, "ccsi",
                              {"CLUSTERCTL_STANDIN_TICK": "0.5", "CLUSTERCTL_STANDIN_BURST": "40"},
                              preexec_fn=low_open_files)
    env = dict(os.environ, CLUSTERCTL_HOME=str(home))
    with cleaned_up(fg):
        run_dir = the_run_dir(home)
        run_id, world = run_dir.name, 2 * NPROC

        def copied():
            return control_copy(run_dir, cluster)
        wait_for(lambda: all(f"rank {r} up" in copied() and f"rank {r} step 2" in copied() for r in range(world)),
                 120, "every rank's first line and two steps in the control copy of the logs")
        text = copied()
        for r in range(world):
            assert f"[default{r % NPROC}]:rank {r} up" in text
        ranks = {int(e["RANK"]): (pid, e) for pid, e in run_envs(cluster, run_id).items() if "RANK" in e}
        assert sorted(ranks) == list(range(world))
        for r, (pid, e) in ranks.items():
            assert (e["LOCAL_RANK"], e["WORLD_SIZE"], e["GROUP_RANK"]) == (str(r % NPROC), str(world), str(r // NPROC))
            assert e["MASTER_ADDR"] == cluster.nodes[0].host
            assert e["CLUSTERCTL_RUN_KEY"] == f"{run_id}@{cluster.nodes[r // NPROC].name}"
        # the supervisor raised the soft limit on open files it inherited (256) to the hard one
        sup = psutil.Process(json.loads((run_dir / "run.json").read_text())["supervisor_pid"])
        soft, hard = sup.rlimit(psutil.RLIMIT_NOFILE)
        assert soft == hard != LOW_OPEN_FILES, (soft, hard)
        # the settings that grow with the cluster, as this run uses them, in the record and `status --json`
        status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", run_id, "--json"], env=env,
                                capture_output=True, text=True, timeout=120)
        scaled = json.loads(status.stdout)["scaling"]
        assert (scaled["nodes"], scaled["ranks"]) == (2, world)
        assert scaled["values"]["fanout"] == 64 and scaled["values"]["lost_timeout"] == 30.0
        assert scaled["values"]["snapshot_wait"] == 10.0 and scaled["values"]["collective_timeout"] == 7200
        assert set(scaled["source"].values()) == {"derived"}
        # bench_scale's log bursts: SIGUSR1 to a stand-in, 40 distinct lines from each of its ranks;
        # SIGUSR2, 40 lines the same from every rank (the foreground folds each into one)
        standins = [pid for pid, e in run_envs(cluster, run_id).items() if "RANK" not in e
                    and any("torchrun_standin" in a for a in psutil.Process(pid).cmdline())]
        assert len(standins) == 2
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            for pid in standins:
                os.kill(pid, sig)
            kind = "distinct" if sig == signal.SIGUSR1 else "same"
            wait_for(lambda: all(f"rank {r} burst {kind} done" in copied() for r in range(world)), 60,
                     f"every rank's {kind} burst in the control copy")
        text = copied()
        assert all(f"[default{r % NPROC}]:rank {r} line {i}\n" in text for r in range(world) for i in (0, 39))
        assert all(text.count(f"[default{lo}]:line {i} of every rank\n") == 2 for lo in range(NPROC) for i in (0, 39))
        os.kill(ranks[world - 1][0], signal.SIGKILL)
        out, _ = fg.communicate(timeout=120)
    said = out.decode(errors="replace")
    assert fg.returncode == 1, said[-3000:]
    assert f"{cluster.nodes[1].name} (ranks {NPROC}-{world - 1}) failed first: exit code 1" in said, said[-3000:]
    # one line for every rank's, or (when the second node's stream reached the controller more than
    # FOLD_WINDOW_S after the first's, as on CI's two loaded cores) one line for each node's ranks;
    # the fold across nodes by their arrival times is tests/test_screen.py's
    folded = sorted(ln.split(" | ")[0].rsplit("/", 1)[1] for ln in said.splitlines()
                    if ln.endswith("| line 7 of every rank"))
    assert folded in ([f"r[0-{world - 1}]"], [f"r[0-{NPROC - 1}]", f"r[{NPROC}-{world - 1}]"]), folded
    wait_for(lambda: not run_envs(cluster, run_id), 30, "no process of the run left on any node")
    # the teardown reached the node still running through its open log stream, not a `stop` command
    sup_log = (run_dir / "supervisor.log").read_text()
    taken = re.search(rf"stop of {re.escape(run_id)}: taken on the log stream of (\d+) of (\d+) nodes(.*)", sup_log)
    assert taken and int(taken.group(1)) >= 1 and cluster.nodes[0].name not in taken.group(3), sup_log[-3000:]
    stop_file = cluster.nodes[0].home / ".clusterctl" / "node-runs" / f"{run_id}@{cluster.nodes[0].name}" / "stop"
    assert json.loads(stop_file.read_text())["peer_failed"] is True


def test_a_quiet_stream_is_not_restarted_while_the_attempt_stops(make_cluster, home, tmp_path):
    """During a teardown a node's log stream going quiet is the node ending (at 128 nodes on
    one machine, every node's stream was quiet for over STREAM_STALL_S while they all stopped,
    and 59 streams were restarted in the middle of it). Here one surviving node's stream process
    is frozen (SIGSTOP) just before another node's rank is killed, and thawed once it has been
    silent longer than the stall limit, the teardown going on meanwhile: the story must tell no
    restarted stream, and that node's end and log must still arrive through the same stream."""
    from orchestrator.runs.judge.straggler import PERIOD_S
    from orchestrator.runs.logs.streams import STREAM_STALL_S
    stall_s = max(STREAM_STALL_S, 3 * PERIOD_S)  # runs/logs/streams.py _Copy: the silence that restarts a stream
    cluster, fg = standin_run(make_cluster, home, tmp_path, 3, 2, "ccsq", {"CLUSTERCTL_STANDIN_TICK": "1"})
    quiet = cluster.nodes[1]  # frozen; the rank killed is on cluster.nodes[2]
    with cleaned_up(fg) as stopped:
        run_dir = the_run_dir(home)
        run_id = run_dir.name
        story = run_dir / "story.jsonl"
        log = run_dir / "nodes" / f"{quiet.name}.log"
        wait_for(lambda: log.exists() and "step 2" in log.read_text(errors="replace"), 120,
                 f"{quiet.name}'s ranks stepping in the control copy")

        def stream_proc():
            return next((p for p in cluster.processes(quiet)
                         if "tail" in (cmd := p.cmdline()) and f"{run_id}@{quiet.name}" in cmd), None)
        frozen = wait_for(stream_proc, 30, f"{quiet.name}'s log stream process")
        ranks = {int(e["RANK"]): pid for pid, e in run_envs(cluster, run_id).items() if "RANK" in e}
        frozen.suspend()
        stopped.append(frozen)
        quiet_from = time.monotonic()
        os.kill(ranks[5], signal.SIGKILL)  # the last rank, on the last node
        wait_for(lambda: story.exists() and "stopping every node" in story.read_text(), 60, "the teardown's start in the story")
        # the silence has to outlast the stall limit while the attempt is stopping
        wait_for(lambda: time.monotonic() - quiet_from > stall_s + 10, stall_s + 30,
                 "the frozen stream's silence to pass the stall limit", interval=1)
        frozen.resume()
        out, _ = fg.communicate(timeout=120)
    said = out.decode(errors="replace")
    assert fg.returncode == 1, said[-3000:]
    events = [json.loads(line) for line in story.read_text().splitlines() if line.strip()]
    restarted = [e["text"] for e in events if e.get("event") == "stream_restarted"]
    assert restarted == [], restarted
    rec = json.loads((run_dir / "run.json").read_text())
    node = next(n for n in rec["nodes"] if n["name"] == quiet.name)
    assert node["exit_code"] is not None and node["state"] == "failed", node  # its end, by its own stream
    assert "[default1]:rank 3 up" in log.read_text(errors="replace")
    wait_for(lambda: not run_envs(cluster, run_id), 30, "no process of the run left on any node")


def test_a_stopped_standin_rank_stalls_every_rank_and_is_named_at_default_settings(make_cluster, home, tmp_path):
    """The stand-in's collectives and hook answers (what lets bench_scale time a hang verdict among
    2,048 ranks): a rank stopped with SIGSTOP keeps every rank of both nodes inside the same
    collective (no step line after it), the ranks answer the hang watch's requests, and the watch,
    at default settings, names the stopped rank by its /proc state, no other."""
    cluster, fg = standin_run(make_cluster, home, tmp_path, 2, NPROC, "ccsh", {"CLUSTERCTL_STANDIN_TICK": "0.5"})
    with cleaned_up(fg) as stopped:
        run_dir = the_run_dir(home)
        run_id, world = run_dir.name, 2 * NPROC

        def copied():
            return control_copy(run_dir, cluster)
        wait_for(lambda: all(f"rank {r} step 3\n" in copied() for r in range(world)), 120,
                 "three collectives of every rank in the control copy")
        ranks = {int(e["RANK"]): pid for pid, e in run_envs(cluster, run_id).items() if "RANK" in e}
        victim = psutil.Process(ranks[4])
        victim.suspend()
        stopped.append(victim)
        # the default backstop is 300 s of silence: a verdict within 90 s is the watch's, from the answers
        verdict = wait_for(lambda: next(iter(run_dir.glob("hangs/*/verdict.json")), None), 90,
                           "the hang watch's verdict")
        doc = json.loads(verdict.read_text())
        newest = {}  # every rank's newest step once the verdict is in: the same collective for all
        for m in re.finditer(r":rank (\d+) step (\d+)$", copied(), re.M):
            newest[int(m[1])] = max(newest.get(int(m[1]), 0), int(m[2]))
        out, _ = fg.communicate(timeout=120)
    said = out.decode(errors="replace")
    assert [c["rank"] for c in doc["culprits"]] == [4], (doc, said[-3000:])
    assert "stopped" in doc["culprits"][0]["why"] and doc["culprits"][0]["node"] == cluster.nodes[1].name, doc
    assert doc["collective"] and "all_reduce" in doc["collective"], doc
    assert sorted(newest) == list(range(world)) and len(set(newest.values())) == 1, newest  # the stall held every rank at the same collective
    assert fg.returncode != 0 and "rank 4" in said, said[-3000:]
    wait_for(lambda: not run_envs(cluster, run_id), 30, "no process of the run left on any node")
