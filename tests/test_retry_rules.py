"""Retry rules by failure class, stated once (runs/policy.py RETRY_RULES): each class as classify
and the run loop name it, whether it is retried, the docs' table against the code, and
--restart-on-exit-codes / train.restart_on_exit_codes at the edge."""

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.runs.controller import Controller
from orchestrator.runs.judge.hang import Culprit, HangVerdict
from orchestrator.runs.policy import RETRY_RULES, exit_code_retried, hang_retried
from orchestrator.runs.restart import Outcome, classify
from orchestrator.runs.spec import RunResult, RunSpec, RunState
from tests.test_restart_policy import PEER_DIED, SCRIPT_ERROR, TORCHRUN_KILLED

# the table a user reads, on the docs page about failures and restarts
RETRY_PAGE = Path(__file__).resolve().parent.parent / "docs" / "runs" / "restarts.md"
RULE = {r.cause: r for r in RETRY_RULES}


def exited(code: int) -> str:
    return ("[default0]:step 3 | loss 4.1\nRoot Cause (first observed failure):\n[0]:\n  rank      : 2 (local_rank: 0)\n"
            f"  exitcode  : {code} (pid: 4242)\n  error_file: <N/A>\n====\n")


def test_a_lost_node_is_retried_without_it():
    v = classify([Outcome("n1", "failed", 1, PEER_DIED), Outcome("n2", "lost", None)], "n2")
    assert (v.cause, v.retry, v.bad_nodes) == ("node lost", True, ("n2",)) and RULE[v.cause].retried == "yes"


def test_a_worker_killed_by_the_oom_killer_is_retried_on_the_same_nodes():
    v = classify([Outcome("n3", "failed", 1, TORCHRUN_KILLED)], "n3")
    assert (v.cause, v.retry, v.bad_nodes) == ("killed by signal", True, ()) and "OOM killer" in v.detail
    assert RULE[v.cause].retried == "yes"


def test_a_peers_collective_error_is_retried():
    v = classify([Outcome("n1", "failed", 1, PEER_DIED)], "n1")
    assert (v.cause, v.retry) == ("peer failure", True) and RULE[v.cause].retried == "yes"


def test_the_scripts_own_exit_code_is_retried_only_when_listed():
    outs = [Outcome("n3", "failed", 1, exited(3))]
    assert classify(outs, "n3").cause == "script error" and not classify(outs, "n3").retry
    assert not classify(outs, "n3", exit_codes=(4, 42)).retry
    v = classify(outs, "n3", exit_codes=(3,))
    assert (v.cause, v.retry, v.bad_nodes) == ("exit code", True, ())
    assert v.detail == "n3: a worker exited with 3 (--restart-on-exit-codes)"
    assert RULE[v.cause].retried == "when listed"
    err = [Outcome("n3", "failed", 1, SCRIPT_ERROR)]  # an exception exiting 1 is still the script's, unless 1 is listed
    assert not classify(err, "n3").retry and classify(err, "n3", exit_codes=(1,)).cause == "exit code"


def test_a_signal_listed_by_its_shell_code_matches_torchruns_negative_code():
    assert exit_code_retried(-15, [143]) and not exit_code_retried(-15, [15]) and exit_code_retried(42, (42,))
    assert not exit_code_retried(None, [1])


def loop(**spec) -> Controller:
    c = Controller.__new__(Controller)
    c.spec = RunSpec(**spec)
    return c


FAILED = RunResult(RunState.FAILED, 1, "x")


def test_a_hang_is_not_retried_unless_its_culprits_node_can_be_left_out():
    hang = HangVerdict("hang: rank 1 (n2, pid 7) never entered ...", culprits=(Culprit(1, "n2", 7, "..."),))
    mismatch = HangVerdict("hang: collective mismatch at #4: ...", culprits=(Culprit(1, "n2", 7, "..."),), mismatch=True)
    runner = SimpleNamespace(hang=hang, straggler=None)
    assert not loop(on_hang="fail").verdict(runner, FAILED).retry  # the default: a deterministic hang hangs again
    v = loop(on_hang="restart").verdict(runner, FAILED)
    assert (v.cause, v.retry, v.bad_nodes) == ("hang", True, ("n2",))
    v = loop(on_hang="restart").verdict(SimpleNamespace(hang=mismatch, straggler=None), FAILED)
    assert (v.cause, v.retry, v.bad_nodes) == ("hang", False, ())
    assert hang_retried("restart", ("n2",)) and not hang_retried("observe", ("n2",)) and not hang_retried("restart", ())


def test_a_broken_link_is_retried_without_one_end_of_it_and_blames_no_node():
    link = HangVerdict("hang: every rank entered gloo:all_reduce #9 and the nodes n2 ↔ n3 cannot reach each other",
                       links=(("n2", "n3"),), avoid=("n3",))
    v = loop(on_hang="restart").verdict(SimpleNamespace(hang=link, straggler=None), FAILED)
    assert (v.cause, v.retry, v.bad_nodes) == ("hang", True, ("n3",)) and link.culprits == ()
    assert not loop(on_hang="fail").verdict(SimpleNamespace(hang=link, straggler=None), FAILED).retry


def test_a_straggler_replaced_is_retried_without_its_node():
    runner = SimpleNamespace(hang=None, straggler=("straggler: n3 rank 2 computes 2.6x the median (...)", ("n3",)))
    v = loop(on_straggler="replace").verdict(runner, FAILED)
    assert (v.cause, v.retry, v.bad_nodes) == ("straggler", True, ("n3",)) and v.detail.startswith("n3 rank 2")


def docs_table() -> list[tuple[str, str]]:
    text = RETRY_PAGE.read_text()
    start = text.index("| failure class | retried | how |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells[0].strip("`"), cells[1]))
    return rows


def test_the_docs_table_is_the_one_in_the_code():
    assert docs_table() == [(r.cause, r.retried) for r in RETRY_RULES]


def train(*args, inv=None):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", *(["-i", inv] if inv else []), *args,
                           "--", "x.py"], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("bad", ["0", "3,abc", "256", ","])
def test_a_bad_restart_on_exit_codes_flag_is_one_paragraph_and_exit_2(bad):
    r = train("--restart-on-exit-codes", bad)
    assert r.returncode == 2 and "--restart-on-exit-codes" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_bad_restart_on_exit_codes_in_the_inventory_names_the_line(tmp_path):
    inv = tmp_path / "nodes.yaml"
    inv.write_text("nodes:\n  - name: a\n    connection: local\ntrain:\n  restart_on_exit_codes: [3, 0]\n")
    r = train(inv=str(inv))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert re.search(r"nodes\.yaml:5.*restart_on_exit_codes", r.stderr, re.S), r.stderr
