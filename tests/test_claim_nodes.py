"""A run claims its nodes all or none (runs/launch.py claim_nodes, runs/claims.py Claims.renew): the
real node agent over `connection: local` nodes (one machine, each node its own claim file), HOME a
temporary directory."""

import os
import sys
import threading

import pytest

from orchestrator.inventory import parse_inventory
from orchestrator.node import agent, artifacts
from orchestrator.errors import LaunchError
from orchestrator.runs.launch import ClaimFailed, NodeBusy, check_free, claim_nodes, claim_round, refusal
from orchestrator.transport import Cluster

A, B = "run-20261129-101010-aaaa", "run-20261129-101010-bbbb"


def inv_of(n: int, python: str = sys.executable):
    nodes = "\n".join(f"  - {{name: n{i}, connection: local, gpus: 0}}" for i in range(n))
    return parse_inventory(f"python: {python}\nnodes:\n{nodes}\n")


@pytest.fixture
def six(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "ctl"))  # no run of this machine is left_over
    with Cluster(inv_of(6)) as cluster:
        yield cluster


def holders(cluster) -> dict[str, str]:
    """node -> the run holding its claim ('' when none)."""
    got = agent.run(cluster, agent.claims, ["n0"])["n0"]  # one machine: every node's claim file is here
    return {n.name: (got.held[n.name].run if n.name in got.held else "") for n in cluster.nodes}


def counting(monkeypatch) -> list[int]:
    """The number of nodes each round of the agent's commands went to, in order."""
    rounds: list[int] = []
    real = agent.run

    def run(cluster, call, nodes=None, **kw):
        got = real(cluster, call, nodes, **kw)
        rounds.append(len(got))
        return got

    monkeypatch.setattr(agent, "run", run)
    return rounds


def test_every_node_is_claimed_in_two_rounds_the_first_node_alone(six, monkeypatch):
    rounds = counting(monkeypatch)
    claim_nodes(six, six.inventory, A, "ann@ctl")
    assert rounds == [1, 5]  # not one round trip per node
    assert holders(six) == {f"n{i}": A for i in range(6)}
    got = claim_nodes(six, six.inventory, A, "ann@ctl", live=True, dirs=True)  # the run's own claim is renewed
    assert holders(six) == {f"n{i}": A for i in range(6)}
    assert {n: (c.ok, c.live) for n, c in got.items()} == {f"n{i}": (True, agent.Live()) for i in range(6)}
    # the run's artifact directories, made by the claim's own command (artifacts.py `prepare`'s answer)
    home = os.environ["HOME"]
    want = {k: f"{home}/.clusterctl/artifacts/{A}/{k}" for k in ("checkpoints", "tensorboard", "replicas")}
    assert {n: dict(c.dirs.dirs) for n, c in got.items()} == {f"n{i}": want for i in range(6)}
    assert all(os.path.isdir(d) and os.stat(d).st_mode & 0o777 == 0o700 for d in want.values())
    prepared = agent.run(six, lambda n: artifacts.prepare(n, A), ["n0"])["n0"]
    assert dict(prepared.dirs) == want  # the same as the program's own verb


@pytest.mark.parametrize("held", ["n0", "n4"])
def test_a_node_held_by_another_run_refuses_the_launch_and_leaves_nothing_claimed(six, held):
    claim_nodes(six, six.inventory.select([held]), B, "bob@ctl")
    with pytest.raises(NodeBusy) as e:
        claim_nodes(six, six.inventory, A, "ann@ctl")
    assert e.value.node == held and e.value.holder.run == B and e.value.maybe_held == ()
    assert f"{held} is running {B} (claimed by bob@ctl" in str(e.value)
    assert holders(six) == {f"n{i}": (B if f"n{i}" == held else "") for i in range(6)}


def test_a_refused_launch_leaves_no_directory_of_itself_and_a_used_one_stays(six):
    """The claim's command makes the run's artifact directories; a launch refused on a later node
    takes them away again with its claims, where empty (a checkpoint kept there stays)."""
    top = os.path.join(os.environ["HOME"], ".clusterctl", "artifacts")
    claim_nodes(six, six.inventory.select(["n4"]), B, "bob@ctl")
    with pytest.raises(NodeBusy):
        claim_nodes(six, six.inventory, A, "ann@ctl", dirs=True)
    assert not os.path.exists(os.path.join(top, A)), os.listdir(os.path.join(top, A))
    assert holders(six)["n0"] == ""
    got = claim_nodes(six, six.inventory.select(["n0"]), A, "ann@ctl", dirs=True)
    with open(os.path.join(got["n0"].dirs.dirs["checkpoints"], "ckpt.pt"), "w") as f:
        f.write("weights")
    assert agent.run(six, lambda n: agent.release(n, A, dirs=True), ["n0"])["n0"].released
    assert os.listdir(os.path.join(top, A)) == ["checkpoints"]  # the empty ones went, the used one stayed


def test_a_claim_asked_to_make_directories_for_an_unsafe_run_id_takes_nothing(six):
    got = agent.run(six, lambda n: agent.claim(n, "..", "ann@ctl", dirs=True), ["n0"])["n0"]
    assert got.error is not None and "bad run id" in got.error, got
    assert holders(six)["n0"] == ""


@pytest.mark.slow
def test_of_two_launches_at_once_on_the_same_nodes_exactly_one_takes_them_all(six):
    for trial in range(8):
        won: dict[str, bool] = {}

        def launch(run):
            try:
                claim_nodes(six, six.inventory, run, run)
                won[run] = True
            except NodeBusy:
                won[run] = False

        threads = [threading.Thread(target=launch, args=(r,)) for r in (A, B)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(won.values()) == [False, True], (trial, won)
        winner = A if won[A] else B
        assert holders(six) == {f"n{i}": winner for i in range(6)}, trial  # the loser took nothing
        agent.run(six, lambda n: agent.release(n, winner))


def test_a_later_attempt_renews_each_node_on_its_own_in_one_round(six, monkeypatch):
    claim_nodes(six, six.inventory.select(["n2"]), B, "bob@ctl")
    rounds = counting(monkeypatch)
    got = claim_round(six, [f"n{i}" for i in range(6)], A, "ann@ctl")
    assert rounds == [6]
    refused = {n: refusal(six, six.inventory, n, g) for n, g in got.items() if not g.ok}
    assert list(refused) == ["n2"] and isinstance(refused["n2"], NodeBusy)
    again = claim_round(six, ["n1", "n2"], A, "ann@ctl", dirs=True)
    assert again["n1"].dirs.dirs["checkpoints"].endswith(f"/artifacts/{A}/checkpoints")
    assert again["n2"].dirs is None  # refused: nothing of the run is made there
    assert holders(six) == {f"n{i}": (B if i == 2 else A) for i in range(6)}  # each node is its own


def test_a_node_whose_agent_does_not_run_is_named_and_nothing_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "ctl"))
    bad = parse_inventory(f"python: {sys.executable}\nnodes:\n  - {{name: n0, connection: local, gpus: 0}}\n"
                          f"  - {{name: n1, connection: local, gpus: 0, python: {tmp_path / 'no-python'}}}\n"
                          "  - {name: n2, connection: local, gpus: 0}\n")
    with Cluster(bad) as cluster:
        with pytest.raises(ClaimFailed) as e:
            claim_nodes(cluster, bad, A, "ann@ctl")
        assert "n1: cannot run the node agent with" in str(e.value) and e.value.maybe_held == ()
        assert holders(cluster) == {"n0": "", "n1": "", "n2": ""}


def test_a_run_that_holds_no_claim_is_found_as_the_nodes_are_claimed_with_no_round_of_its_own(six, tmp_path,
                                                                                              monkeypatch):
    """A run started with --force holds no claim: the launch's check_free refuses the nodes it runs on,
    from what the claim's own command found there (one round fewer at every launch)."""
    spec = agent.StartSpec([sys.executable, "-c", "import time; time.sleep(60)"], str(tmp_path), {})
    forced = agent.run(six, lambda n: agent.start(n, B, spec), ["n3"])["n3"]
    assert forced.error is None
    try:
        rounds = counting(monkeypatch)
        found = {n: c.live for n, c in claim_nodes(six, six.inventory, A, "ann@ctl", live=True).items()}
        with pytest.raises(LaunchError) as e:
            check_free(six, six.inventory, False, found)
        assert rounds == [1, 5]  # the claims' two rounds; check_free asked nothing more
        assert str(e.value).startswith(f"n3 is running {B}") and "--force to share the node" in str(e.value)
        with pytest.raises(LaunchError):  # asked by itself, it finds the same
            check_free(six, six.inventory, False)
        assert rounds[2:] == [6]
        check_free(six, six.inventory, True, found)  # forced: shared
    finally:
        agent.run(six, lambda n: agent.stop(n, B, 1.0), ["n3"])
