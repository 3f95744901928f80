"""Real multi-host test cluster: network namespaces with sshd, for tests and benchmarks.

    with TestCluster(n=4, gpus=8) as cluster:
        cluster.nodes[0].run("hostname").stdout   # "node1\n"
"""

from .netns import DEFAULT_USER, TestCluster, TestNode, require_root

__all__ = ["DEFAULT_USER", "TestCluster", "TestNode", "require_root"]
