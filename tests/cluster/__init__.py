"""Real multi-host test cluster: network namespaces with sshd, for tests and benchmarks.

    with TestCluster(n=4, gpus=8) as cluster:          # gpus: int or one per node
        cluster.nodes[0].run("hostname").stdout        # "node1\\n"
        cluster.write_inventory(tmp_path / "nodes.yaml")
        subprocess.run(cluster.ssh_argv(cluster.nodes[1], "nvidia-smi", "-L"))

Faults per node: stop_sshd/start_sshd, link_down/link_up, iptables(*args),
set_clock_skew(seconds), shape(rate, burst, latency)/unshape, set_gpus(n, processes=...).
cluster.processes(node=None) lists the test user's processes in a node's network namespace.
TestCluster(own_pids=True) gives each node its own PID namespace and /proc (bench/bench_scale.py).
Needs root; tests call require_root() (the cluster4/make_cluster fixtures do it for you).
"""

from tests.cluster.netns import DEFAULT_USER, TestCluster, require_root
from tests.cluster.node import TestNode

__all__ = ["DEFAULT_USER", "TestCluster", "TestNode", "require_root"]
