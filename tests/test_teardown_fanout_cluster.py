"""A teardown reaches every node at once, past the fan-out cap.

Each node's `stop` returns only once its run ended there (remote/node_agent.py waits for the
exit code), so under a cap of k a teardown of N nodes took N/k rounds of the slowest node's end
(at 128 nodes and the default cap of 64, the second half of the nodes was stopped only as the
first half's ended). Here the cap is 1 and each node's stop lasts its full wait (a run directory
with no process and no exit code): every node's stop must have begun before any of them ended.
"""

import json

import pytest
import yaml

from orchestrator.inventory import parse_inventory
from orchestrator.runs.stopping import Stopper
from orchestrator.transport import Cluster

pytestmark = pytest.mark.cluster


def test_stop_goes_to_every_node_at_once_under_a_fanout_cap_of_one(make_cluster):
    cluster = make_cluster(3, name_prefix="ccst")
    inv = parse_inventory(yaml.safe_dump(cluster.inventory()), "test-inventory")
    key = "run-20261129-000000-fan0"
    dirs = {}
    for nd in cluster.nodes:  # a run that left nothing running and no exit code: its stop waits it out
        nd.run(f"mkdir -p ~/.clusterctl/node-runs/{key}@{nd.name} && echo '{{}}' > "
               f"~/.clusterctl/node-runs/{key}@{nd.name}/proc.json")
        dirs[nd.name] = nd.home / ".clusterctl" / "node-runs" / f"{key}@{nd.name}"
    with Cluster(inv, fanout=1) as c:
        left = Stopper(c, inv, key, book=None).stop(key, [n.name for n in inv.nodes], grace=0)
    assert left == []
    began = {name: json.loads((d / "stop").read_text())["at"] for name, d in dirs.items()}
    ended = {name: (d / "exit_code").stat().st_mtime for name, d in dirs.items()}
    assert all((d / "exit_code").read_text() == "137" for d in dirs.values())
    # serial stops (one in flight) would end the first before the next begins
    assert max(began.values()) < min(ended.values()), (began, ended)
