"""--resume-args / train.resume_args: what a launch that starts from a restored checkpoint adds to
the job's own arguments, how it is read and recorded. The restart that uses it on the real test
cluster is in test_restarts_cluster.py (the replica test: the trainer resumes only through it)."""

import json
import subprocess
import sys

import pytest

from orchestrator.errors import InventoryError
from orchestrator.inventory import parse_inventory
from orchestrator.runs.launch import Launcher
from orchestrator.runs.spec import NodeStatus, RunSpec
from orchestrator.runs.store import Run

pytestmark = pytest.mark.usefixtures("home")

INV = "nodes:\n  - {name: n0, connection: local, gpus: 0}\n"


def target(resume_args=(), args=("train.py", "--lr", "1")):
    inv = parse_inventory(INV)
    spec = RunSpec(args=args, resume_args=("--init_from=resume",))
    return Launcher(None, inv, "run-1", spec, {"n0": NodeStatus("n0", 0, "127.0.0.1")}, resume_args).target


def test_the_args_follow_the_jobs_own_only_when_the_launch_starts_from_a_checkpoint():
    assert target() == ["train.py", "--lr", "1"]
    assert target(["--init_from=resume"]) == ["train.py", "--lr", "1", "--init_from=resume"]
    # the inventory's train section as the job: its args first, the resume args last
    inv_job = target(["--resume", "auto"], args=())
    assert inv_job[:2] == ["-m", "trainer"] and inv_job[-2:] == ["--resume", "auto"]


def test_the_inventory_takes_a_list_and_refuses_a_string_with_an_example():
    inv = parse_inventory(INV + "train:\n  resume_args: ['--init_from=resume', --lr, 0.5]\n")
    assert inv.train.resume_args == ["--init_from=resume", "--lr", "0.5"]
    assert parse_inventory(INV).train.resume_args == []
    with pytest.raises(InventoryError, match="resume_args.*list of strings"):
        parse_inventory(INV + "train:\n  resume_args: --init_from=resume\n")


def test_the_spec_keeps_them_and_an_older_record_has_none(home):
    run = Run.create("r-1", RunSpec(args=("t.py",), resume_args=("--resume", "a b")))
    assert run.spec.resume_args == ("--resume", "a b")
    assert json.loads((run.dir / "spec.json").read_text())["resume_args"] == ["--resume", "a b"]
    (run.dir / "spec.json").write_text('{"args": ["t.py"]}')
    assert run.spec.resume_args == ()


def test_the_flag_is_split_as_a_shell_would_and_bad_quoting_exits_2(tmp_path, home):
    inv = tmp_path / "nodes.yaml"
    inv.write_text(INV)
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", "-i", str(inv), "--resume-args",
                        "--note 'unclosed", "--", "t.py"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--resume-args" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (home / "runs").exists() or not list((home / "runs").iterdir())  # nothing was started
    from orchestrator.cli.train import _split_args

    assert _split_args("--init_from=resume --note 'two words'", "--resume-args") == \
        ["--init_from=resume", "--note", "two words"]
