"""The pure parts of `clusterctl fetch`: which node-side directories a run has, and PATH checks."""

import pytest

from orchestrator.errors import UsageError
from orchestrator.runs.fetch import check_path, run_keys
from orchestrator.runs.runrecord import RunRecord


def test_a_restarted_run_fetches_every_attempts_directory_of_every_node_it_used():
    rec = {"id": "r1", "nodes": [{"name": "n1"}, {"name": "n3"}],
           "attempts": [{"attempt": 1, "key": "r1", "nodes": ["n1", "n2"]},
                        {"attempt": 2, "key": "r1.a2", "nodes": ["n1", "n3"]}]}
    assert run_keys(RunRecord.from_json(rec)) == {"n1": ["r1@n1", "r1.a2@n1"], "n2": ["r1@n2"], "n3": ["r1.a2@n3"]}


def test_a_run_without_attempts_has_one_directory_per_node():
    assert run_keys(RunRecord.from_json({"id": "r1", "nodes": [{"name": "a"}, {"name": "b"}]})) == {"a": ["r1@a"], "b": ["r1@b"]}


@pytest.mark.parametrize("path,want", [(None, None), ("", None), (".", None), ("checkpoints", "checkpoints"),
                                       ("tensorboard/sub/", "tensorboard/sub"), ("./checkpoints", "checkpoints"),
                                       ("out-shakespeare-char", "out-shakespeare-char"), ("~/data/", "~/data"),
                                       ("/home/u/gpt_train/out", "/home/u/gpt_train/out")])
def test_paths_are_normalised_and_whether_they_lie_inside_is_the_nodes_to_say(path, want):
    assert check_path(path) == want


@pytest.mark.parametrize("path", ["..", "checkpoints/../../x", "~/../other", "/home/u/../../etc"])
def test_paths_that_climb_out_are_refused_here(path):
    with pytest.raises(UsageError, match="without `..`"):
        check_path(path)
