"""The run's story on screen: what clusterctl tells (record.py Book.tell, story), the folding of
stopped ranks' tracebacks (runs/logs/screen.py Screen), which nodes are quiet, and how a restart's node
change reads."""

import json

from orchestrator.runs.controller import _changes
from orchestrator.runs.logs.follow import Follower, NodeLog, quiet_nodes
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.record import Book, story
from orchestrator.runs.logs.screen import Screen
from orchestrator.runs.store import Run

# rank 2's lines as torchrun's tee wrote them when clusterctl stopped it (recorded on the test
# cluster: a peer's node was cut, the teardown SIGTERMed this one)
STOPPED = """[default0]:step 40 | loss 2.1
[default0]:[rank2]: Traceback (most recent call last):
[default0]:[rank2]:   File "/home/ccnode/gpt_train/trainer/__main__.py", line 4, in <module>
[default0]:[rank2]:     main()
[default0]:[rank2]:   File "/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
[default0]:[rank2]:     work.wait()
[default0]:[rank2]:     ^^^^^^^^^^^
[default0]:[rank2]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection closed by peer
W1124 20:13:59.129000 4242 torch/distributed/elastic/multiprocessing/api.py:900] Sending process 17 closing signal SIGTERM
saved checkpoint ckpt_00000040.pt
"""


class Lines:
    def __init__(self):
        self.out = []

    def many(self, lines):
        self.out.extend((label, text) for label, text, _ in lines)

    def widen(self, label):
        pass


def follow(tmp_path, text, quiet, final=True):
    log = tmp_path / "node3.log"
    log.write_text(text)
    lines = Lines()
    f = Follower([NodeLog("node3", log, 2)], lines)
    f.quiet = quiet
    f.poll(final=final)
    f.close()
    return lines.out


def test_a_stopped_ranks_traceback_folds_to_one_line_and_its_other_lines_pass(tmp_path):
    out = follow(tmp_path, STOPPED, {"node3"})
    assert out[0] == ("node3/r2", "step 40 | loss 2.1")
    assert out[1][0] == "node3/r2"
    assert out[1][1] == f"[clusterctl: 8 lines of a stopped rank's traceback folded; {tmp_path / 'node3.log'} has them]"
    assert out[2] == ("node3", "saved checkpoint ckpt_00000040.pt")  # not a traceback: told as it is
    assert len(out) == 3


def test_the_node_that_failed_first_keeps_its_traceback_on_screen(tmp_path):
    out = follow(tmp_path, STOPPED, set())
    assert len(out) == len(STOPPED.splitlines())
    assert ("node3/r2", "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection "
                        "closed by peer") in out  # torch's [rank2]: is the label's


def test_json_consumers_get_every_line(tmp_path):
    log = tmp_path / "node3.log"
    log.write_text(STOPPED)
    got = []
    f = Follower([NodeLog("node3", log, 2)], Lines(), sink=lambda label, stream, text, key: got.append(text))
    f.quiet = {"node3"}
    f.poll(final=True)
    assert len(got) == len(STOPPED.splitlines())


def test_a_block_is_told_once_it_has_been_idle(tmp_path):
    screen = Screen("the node logs")
    screen.quiet = {"n1"}
    got = []
    screen.line("n1", 0, "n1/r0", "Traceback (most recent call last):", now=0.0)
    screen.tick(1.5)  # the traceback is complete (idle), its fold still arriving
    screen.flush(10.0, got.extend)
    assert got == []
    screen.tick(4.0)
    screen.flush(10.0, got.extend)
    assert got == [("n1/r0", "[clusterctl: 1 line of a stopped rank's traceback folded; the node logs has them]",
                    "n1")]


def test_quiet_nodes_follow_the_teardown_and_a_clean_finish():
    nodes = [{"name": "n1", "state": "running"}, {"name": "n2", "state": "failed"}, {"name": "n3", "state": "running"}]
    assert quiet_nodes(RunRecord.from_json({"nodes": nodes})) == set()
    assert quiet_nodes(RunRecord.from_json({"nodes": nodes, "teardown": "n2 failed"})) == {"n1", "n3"}
    assert quiet_nodes(RunRecord.from_json({"nodes": nodes, "teardown": "stop"})) == {"n1", "n2", "n3"}
    done = [{"name": "n1", "state": "finished"}, {"name": "n2", "state": "running"}]
    assert quiet_nodes(RunRecord.from_json({"nodes": done})) == {"n1", "n2"}  # torchrun's shutdown noise after a success


def test_the_story_is_appended_and_read_back_by_offset(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    run = Run("r1")
    run.dir.mkdir(parents=True)
    (run.dir / "run.json").write_text(json.dumps({"id": "r1", "state": "running"}))
    book = Book(run)
    book.tell("node2: silent for 4.0s (connection lost); reconnecting, lost after 30s")
    lines, at = story(run)
    assert lines == ["node2: silent for 4.0s (connection lost); reconnecting, lost after 30s"]
    book.tell("node2 lost: no answer for 30.2s (timed out)")
    more, at2 = story(run, at)
    assert more == ["node2 lost: no answer for 30.2s (timed out)"] and at2 > at
    assert story(run, at2) == ([], at2)
    assert "supervisor: node2 lost" in capsys.readouterr().out  # the supervisor's log has it too


def test_a_restarts_node_change_reads_as_places_taken():
    assert _changes(["n1", "n2", "n3"], ["n1", "n5", "n3"]) == " (n5 in n2's place)"
    assert _changes(["n1", "n2", "n3"], ["n1", "n3"]) == " (without n2)"
    assert _changes(["n1", "n2"], ["n1", "n2"]) == ""


def test_a_progress_bars_updates_show_the_last_on_screen_and_all_in_json(tmp_path):
    bar = "[default0]:  6%|▌         | 7/120\r 13%|█▎        | 16/120\r 20%|██        | 24/120\n"
    out = follow(tmp_path, bar, set())
    assert out == [("node3/r2", " 20%|██        | 24/120")]


def test_the_script_error_named_is_the_workers_not_torchruns_wrapper():
    from orchestrator.runs.restart import Outcome, classify

    log = ("[default1]:[rank1]: ValueError: Can't find a valid checkpoint at out/checkpoint-120\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    v = classify([Outcome("n1", "finished", 0), Outcome("n2", "failed", 1, log)], "n2")
    assert v.cause == "script error"
    assert v.detail == "n2: ValueError: Can't find a valid checkpoint at out/checkpoint-120"
