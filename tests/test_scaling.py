"""The settings that grow with the cluster (runs/scaling.py): the rule's table, its growth, the
user's values over it, and `train --dry-run`, which shows them and starts nothing."""

import dataclasses
import json

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.runs import scaling
from orchestrator.runs.scaling import Scaled, derive, resolve

# nodes -> (collective timeout, fan-out, lost timeout, suspect after, probe timeout, snapshot wait,
# hang timeout, rendezvous timeout, stream stall, progress period), 8 ranks a node: the table in runs/scaling.py's
# docstring, the seeds' NCCL timeouts (1 node 1 h, 2-7 nodes 2 h, 8 and more 4 h) and torchrun's own
# rendezvous timeout (900 s) up to 64 nodes
TABLE = {
    1: (3600, 64, 30.0, 2.0, 1.0, 10.0, 300.0, 900, 30.0, 2.0),
    2: (7200, 64, 30.0, 2.0, 1.0, 10.0, 300.0, 900, 30.0, 2.0),
    8: (14400, 64, 30.0, 2.0, 1.0, 10.0, 300.0, 900, 30.0, 2.5),
    16: (14400, 64, 30.0, 2.0, 1.0, 10.0, 300.0, 900, 30.0, 5.0),
    17: (14400, 64, 30.0, 2.0, 1.0, 10.0, 300.0, 900, 30.0, 5.3),
    32: (14400, 64, 30.0, 2.0, 1.0, 10.0, 300.0, 900, 30.0, 10.0),
    64: (14400, 64, 30.0, 2.0, 1.0, 10.0, 300.0, 900, 30.0, 10.0),
    128: (14400, 128, 60.0, 3.0, 1.5, 15.0, 360.0, 1200, 60.0, 10.0),
    256: (14400, 256, 90.0, 4.0, 2.0, 20.0, 420.0, 1500, 90.0, 10.0),
    1024: (14400, 256, 150.0, 6.0, 3.0, 30.0, 540.0, 2100, 150.0, 10.0),
}


@pytest.mark.parametrize("nodes", sorted(TABLE))
def test_the_rule_at_each_size(nodes):
    assert dataclasses.astuple(derive(nodes, 8 * nodes)) == TABLE[nodes]


def test_every_setting_grows_with_the_cluster_and_never_shrinks():
    sizes = list(range(1, 1100, 7))
    rows = [derive(n, 8 * n) for n in sizes]
    for f in dataclasses.fields(Scaled):
        seen = [getattr(r, f.name) for r in rows]
        assert seen == sorted(seen), f.name
        assert seen[-1] > seen[0] or f.name == "collective_timeout" and seen[-1] == 14400, f.name


def test_the_progress_period_keeps_the_rank_answers_a_second_under_the_128_ranks_at_5_s():
    for ranks in (1, 2, 16, 51, 52, 64, 100, 128, 200, 256, 2048):
        p = derive(max(1, ranks // 8), ranks).progress_s
        assert 2.0 <= p <= 10.0
        assert ranks / p <= 128 / 5.0 + 0.5 or p == 10.0, (ranks, p)
    assert [derive(1, r).progress_s for r in (3, 51, 64, 128, 256)] == [2.0, 2.0, 2.5, 5.0, 10.0]


def test_more_ranks_a_node_wait_longer_for_their_snapshot():
    assert derive(64, 64 * 8).snapshot_wait == 10.0
    assert derive(64, 64 * 16).snapshot_wait == 20.0
    assert derive(256, 256 * 16).snapshot_wait == 40.0
    assert derive(4, 4).snapshot_wait == 10.0  # fewer ranks than GPUs: never below the base


def test_a_given_value_wins_and_is_said_to_be_given():
    values, source = resolve(256, 2048, {"fanout": 16, "lost_timeout": 20.0})
    assert (values.fanout, values.lost_timeout) == (16, 20.0)
    assert values.suspect_s == derive(256, 2048).suspect_s
    assert source["fanout"] == source["lost_timeout"] == "given" and source["suspect_s"] == "derived"
    with pytest.raises(ValueError, match="not a scaled setting: fanin"):
        resolve(8, 64, {"fanin": 3})


def write(tmp_path, n, **extra):
    nodes = [{"name": f"gpu{i:03d}", "host": f"10.0.{i // 250}.{i % 250 + 1}", "gpus": 8} for i in range(n)]
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump({"nodes": nodes, **extra}))
    return path


def test_dry_run_shows_the_derived_settings_and_starts_nothing(tmp_path, home, capsys):
    path = write(tmp_path, 256)
    assert main(["train", "-i", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "train --dry-run: nothing was started" in out
    assert "world size 2048 on 256 nodes: rank 0-7 → gpu000 (10.0.0.1)" in out
    assert "settings for 256 nodes and 2048 ranks" in out
    for line in ("  fan-out                   256  derived (set with --fanout)",
                 "  lost timeout             90 s  derived (set with --lost-timeout)",
                 "  suspect after             4 s  derived",
                 "  snapshot wait            20 s  derived",
                 "  collective timeout    14400 s  derived (set with inventory env NCCL_TIMEOUT)",
                 "  rendezvous timeout     1500 s  derived (set with --rendezvous-timeout, inventory env PET_RDZV_CONF)",
                 "  stream stall             90 s  derived"):
        assert line in out.splitlines(), out
    assert not (home / "runs").exists()  # no run recorded, no supervisor


def test_dry_run_keeps_the_flags_and_the_inventorys_values(tmp_path, home, capsys):
    path = write(tmp_path, 128, env={"NCCL_TIMEOUT": "600"}, train={"hang_timeout": 45})
    assert main(["train", "-i", str(path), "--dry-run", "--json", "--fanout", "8", "--lost-timeout", "12"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["dry_run"] is True
    s = doc["scaling"]
    assert (s["nodes"], s["ranks"]) == (128, 1024)
    assert s["values"] == {"collective_timeout": 600, "fanout": 8, "lost_timeout": 12.0, "suspect_s": 3.0,
                           "probe_s": 1.5, "snapshot_wait": 15.0, "hang_timeout": 45.0,
                           "rendezvous_timeout": 1200, "stream_stall": 60.0, "progress_s": 10.0}
    assert {k for k, v in s["source"].items() if v == "given"} == {"collective_timeout", "fanout", "lost_timeout",
                                                                   "hang_timeout"}
    # the flag over the inventory's train.hang_timeout
    assert main(["train", "-i", str(path), "--dry-run", "--json", "--hang-timeout", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["scaling"]["values"]["hang_timeout"] == 0


def test_spares_are_not_counted(tmp_path, home, capsys):
    path = write(tmp_path, 4)
    doc = yaml.safe_load(path.read_text())
    doc["nodes"][3]["spare"] = True
    path.write_text(yaml.safe_dump(doc))
    assert main(["train", "-i", str(path), "--dry-run", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["scaling"]
    assert (s["nodes"], s["ranks"]) == (3, 24)


def test_the_record_carries_what_the_run_uses():
    from orchestrator.runs.spec import RunSpec
    values, source = resolve(128, 1024, {"fanout": 8})
    spec = RunSpec(fanout=8, lost_timeout=values.lost_timeout, suspect_s=values.suspect_s, probe_s=values.probe_s,
                   snapshot_wait=values.snapshot_wait, hang_timeout=values.hang_timeout,
                   scaling={"nodes": 128, "ranks": 1024, "values": dataclasses.asdict(values), "source": source})
    doc = scaling.record_doc(spec)
    assert doc["values"]["fanout"] == 8 and doc["values"]["suspect_s"] == 3.0 and doc["source"]["fanout"] == "given"
    assert spec.cluster_options()["suspect_s"] == 3.0 and spec.cluster_options()["probe_s"] == 1.5
    assert RunSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec  # spec.json round trip


def test_the_rendezvous_timeout_comes_from_the_flag_else_the_inventorys_torchrun_conf(tmp_path, home, capsys):
    # PET_RDZV_CONF is torchrun's --rdzv-conf when the flag is not given: the inventory's timeout in it is
    # the user's, shown as given; a --rendezvous-timeout on the command line wins over it
    path = write(tmp_path, 128, train={"env": {"PET_RDZV_CONF": "timeout=1500,read_timeout=90"}})
    assert main(["train", "-i", str(path), "--dry-run", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["scaling"]
    assert s["values"]["rendezvous_timeout"] == 1500 and s["source"]["rendezvous_timeout"] == "given"
    assert main(["train", "-i", str(path), "--dry-run", "--json", "--rendezvous-timeout", "2000"]) == 0
    s = json.loads(capsys.readouterr().out)["scaling"]
    assert s["values"]["rendezvous_timeout"] == 2000 and s["source"]["rendezvous_timeout"] == "given"
    assert s["values"]["stream_stall"] == 60.0 and s["source"]["stream_stall"] == "derived"


def test_a_node_of_its_own_rendezvous_timeout_makes_everyones_the_longest(tmp_path, home, capsys):
    path = write(tmp_path, 4, env={"PET_RDZV_CONF": "timeout=700"})
    doc = yaml.safe_load(path.read_text())
    doc["nodes"][2]["env"] = {"PET_RDZV_CONF": "timeout=1300"}
    path.write_text(yaml.safe_dump(doc))
    assert main(["train", "-i", str(path), "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["scaling"]["values"]["rendezvous_timeout"] == 1300


@pytest.mark.parametrize("conf", ["timeout=soon", "timeout=0", "timeout", "timeout=60,,x=1"])
def test_a_rendezvous_conf_torchrun_would_refuse_is_an_inventory_error(tmp_path, home, capsys, conf):
    path = write(tmp_path, 2, env={"PET_RDZV_CONF": conf})
    assert main(["train", "-i", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "PET_RDZV_CONF" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["0", "-5", "soon", "86401"])
def test_a_bad_rendezvous_timeout_flag_exits_2(tmp_path, home, capsys, flag):
    path = write(tmp_path, 2)
    assert main(["train", "-i", str(path), "--dry-run", "--rendezvous-timeout", "30"]) == 0  # the flag exists
    capsys.readouterr()
    assert main(["train", "-i", str(path), "--dry-run", "--rendezvous-timeout", flag]) == 2
    assert "--rendezvous-timeout" in capsys.readouterr().err


def test_the_record_carries_the_rendezvous_timeout_stream_stall_and_progress_period():
    from orchestrator.runs.spec import RunSpec
    values, source = resolve(256, 2048, {"rendezvous_timeout": 777})
    small, _ = resolve(4, 32, {})
    spec = RunSpec(rendezvous_timeout=values.rendezvous_timeout, stream_stall=values.stream_stall,
                   progress_s=small.progress_s,
                   scaling={"nodes": 256, "ranks": 2048, "values": dataclasses.asdict(values), "source": source})
    doc = scaling.record_doc(spec)
    assert (doc["values"]["rendezvous_timeout"], doc["values"]["stream_stall"]) == (777, 90.0)
    assert doc["values"]["progress_s"] == 2.0 and values.progress_s == 10.0
    assert doc["source"]["rendezvous_timeout"] == "given" and doc["source"]["stream_stall"] == "derived"
    assert RunSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    # a spec recorded before these settings existed reads back with torchrun's own timeout and the old stall
    old = {k: v for k, v in spec.to_json().items() if k not in ("rendezvous_timeout", "stream_stall", "progress_s")}
    assert (RunSpec.from_json(old).rendezvous_timeout, RunSpec.from_json(old).stream_stall) == (900, 30.0)
    assert RunSpec.from_json(old).progress_s == 10.0  # the period every run had before it followed the ranks
