"""transfer/synced.py: where each node's workdir was last pushed from, and which nodes share it."""

from orchestrator.inventory import parse_inventory
from orchestrator.transfer import synced


def nodes(tmp_path):
    inv = parse_inventory(f"""
workdir: {tmp_path}/w
nodes:
  - {{name: a, host: 10.0.0.1}}
  - {{name: b, host: 10.0.0.2, ssh: {{user: u, port: 2222}}}}
  - {{name: c, connection: local}}
""")
    return {n.name: n for n in inv.nodes}


def test_nodes_synced_from_one_directory_share_it_and_others_do_not(tmp_path, home):
    n = nodes(tmp_path)
    src, other = tmp_path / "src", tmp_path / "other"
    src.mkdir(), other.mkdir()
    assert synced.source_of([n["a"], n["b"]]) is None  # never synced
    synced.record([n["a"], n["b"]], str(src), ["data/"], [], "d1")
    assert synced.source_of([n["a"], n["b"]]) == {"src": str(src), "include": ["data/"], "exclude": [], "digest": "d1"}
    assert synced.source_of([n["a"], n["b"], n["c"]]) is None  # c never was
    synced.record([n["c"]], str(other), ["data/"], [], "d1")
    assert synced.source_of([n["a"], n["c"]]) is None  # from different places
    synced.record([n["c"]], str(src), [], [], "d1")
    assert synced.source_of([n["a"], n["c"]]) is None  # the same place, another selection
    assert synced.key(n["b"]) == f"u@10.0.0.2:2222 {tmp_path}/w" and synced.key(n["c"]) == f"local {tmp_path}/w"
    src.rmdir()
    assert synced.source_of([n["a"], n["b"]]) is None  # gone from this machine: nothing to compare with
