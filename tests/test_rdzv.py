"""torchrun's rendezvous timeout on the launch's command line (torchrun.py `rdzv_conf`,
runs/launch.py Launcher): `--rdzv-conf timeout=N` with the run's value, once, the inventory's other
PET_RDZV_CONF keys carried over, read back by torch's own parser; and the log stream's stall limit
the run's spec carries to the log streams (runs/logs/streams.py)."""

import tempfile

import pytest
from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
from torch.distributed.run import config_from_args, get_args_parser

from orchestrator.inventory import parse_inventory
from orchestrator.runs.launch import Launcher
from orchestrator.runs.logs.copier import LogCopier
from orchestrator.runs.spec import NodeStatus, RunSpec
from orchestrator.runs.store import Run, new_run_id
from orchestrator.runs.logs.streams import _Copy
from orchestrator.torchrun import RDZV_TIMEOUT_S, parse_rdzv_conf, rdzv_conf, rdzv_timeout_given, torchrun_argv

pytestmark = pytest.mark.usefixtures("home")


@pytest.mark.parametrize("text", ["", "  ", "timeout=900", " timeout = 900 , read_timeout=60", "a=b=c"])
def test_the_conf_is_read_as_torch_reads_it(text):
    assert parse_rdzv_conf(text) == _parse_rendezvous_config(text)


@pytest.mark.parametrize("text", ["timeout", "timeout=", "=5", "timeout=60,,x=1"])
def test_a_conf_torch_refuses_is_refused(text):
    with pytest.raises(ValueError):
        _parse_rendezvous_config(text)
    with pytest.raises(ValueError):
        parse_rdzv_conf(text)


def test_the_timeout_is_set_and_the_users_other_keys_kept():
    assert rdzv_conf({}, 900) == "timeout=900"
    assert rdzv_conf({"PET_RDZV_CONF": "read_timeout=60,timeout=1500"}, 900) == "read_timeout=60,timeout=900"
    assert rdzv_timeout_given({"PET_RDZV_CONF": "read_timeout=60,timeout=1500"}) == 1500
    assert rdzv_timeout_given({"PET_RDZV_CONF": "read_timeout=60"}) is None and rdzv_timeout_given({}) is None


def parse_as_torchrun(argv, monkeypatch, env=None):
    """torchrun's own reading of our command line (python -m torch.distributed.run left off),
    with the node's environment (PET_* variables are its flags' defaults)."""
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    # torchrun makes its --log-dir as it reads the flags: {rundir}/ is put in as the node's waiter
    # does (remote/agent_waiter.py), here a temporary run directory (left as is, it made a
    # "{rundir}/torchrun" directory in the working directory, the repository's root)
    with tempfile.TemporaryDirectory() as d:
        args = [d + a[len("{rundir}"):] if a.startswith("{rundir}/") else a for a in argv[3:]]
        config, _, _ = config_from_args(get_args_parser().parse_args(args))
    return config.rdzv_configs


def test_the_command_line_carries_the_timeout_torchrun_reads(monkeypatch):
    argv = torchrun_argv(python="python3", nnodes=2, nproc=1, node_rank=1, master_addr="10.0.0.1", master_port=29500,
                         run_id="r1", target=["train.py"], rdzv="timeout=1200")
    assert argv.count("--rdzv-conf") == 1 and argv[argv.index("--rdzv-conf") + 1] == "timeout=1200"
    assert parse_as_torchrun(argv, monkeypatch)["timeout"] == "1200"
    # without it the command line is as before: torchrun's own default, RDZV_TIMEOUT_S
    plain = torchrun_argv(python="python3", nnodes=2, nproc=1, node_rank=1, master_addr="10.0.0.1", master_port=29500,
                          run_id="r1", target=["train.py"])
    assert "--rdzv-conf" not in plain and parse_as_torchrun(plain, monkeypatch)["timeout"] == RDZV_TIMEOUT_S == 900


INV = """nodes:
  - {name: n0, host: 10.0.0.1, gpus: 0}
  - {name: n1, host: 10.0.0.2, gpus: 0, env: {PET_RDZV_CONF: "read_timeout=75,timeout=50"}}
"""


def start_argv(spec: RunSpec, node: str):
    inv = parse_inventory(INV)
    statuses = {n.name: NodeStatus(n.name, i, n.host, nproc=1) for i, n in enumerate(inv.nodes)}
    got = Launcher(None, inv, "run-1", spec, statuses).start_spec(inv.node(node))
    return got.argv, got.env


def test_each_node_is_started_with_the_runs_rendezvous_timeout(monkeypatch):
    argv, env = start_argv(RunSpec(rendezvous_timeout=1200), "n0")
    assert argv.count("--rdzv-conf") == 1 and argv[argv.index("--rdzv-conf") + 1] == "timeout=1200"
    assert parse_as_torchrun(argv, monkeypatch, env)["timeout"] == "1200"


def test_a_nodes_own_torchrun_conf_is_merged_not_doubled(monkeypatch):
    # n1's environment carries PET_RDZV_CONF: torchrun would take the flag whole and drop the
    # variable, so its read_timeout is carried into the flag; the timeout is the run's (train
    # resolved it from the flag, else the inventory's own PET_RDZV_CONF: tests/test_scaling.py)
    argv, env = start_argv(RunSpec(rendezvous_timeout=1300), "n1")
    assert env["PET_RDZV_CONF"] == "read_timeout=75,timeout=50"
    assert argv.count("--rdzv-conf") == 1
    conf = parse_as_torchrun(argv, monkeypatch, env)
    assert (conf["timeout"], conf["read_timeout"]) == ("1300", "75")


def test_a_spec_recorded_before_the_setting_starts_with_torchruns_own_timeout(monkeypatch):
    argv, env = start_argv(RunSpec.from_json({}), "n0")
    assert parse_as_torchrun(argv, monkeypatch, env)["timeout"] == "900"


@pytest.mark.parametrize("stall_s, progress_s, want", [(30.0, 10.0, 30.0), (90.0, 10.0, 90.0), (30.0, 20.0, 60.0),
                                                       (90.0, 0.0, None)])
def test_a_streams_stall_limit_is_the_runs(stall_s, progress_s, want):
    run = Run.create(new_run_id("stall"), RunSpec())
    copier = LogCopier(run, ["n0"], progress=(lambda node, doc: None) if progress_s else None, progress_s=progress_s)
    try:
        nodes = parse_inventory("nodes:\n  - {name: n0, connection: local}\n").nodes
        copy = _Copy(None, run, list(nodes), lambda res, status: None, copier, print, None, run.id, None, stall_s)
        assert copy.stall_s == want  # at least three progress periods; none for a stream not asked for progress
    finally:
        copier.close()
