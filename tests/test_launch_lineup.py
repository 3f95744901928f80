"""The first attempt's nodes (runs/launch.py): a node quarantined or unreachable when the run
starts gives its place to a spare, or with --min-nodes is left out; with neither, one paragraph
saying what ssh said and what to do. Pure: the cluster's connect results and the record are fakes."""

import pytest
import yaml

from orchestrator.errors import EXIT_FAILED, EXIT_UNREACHABLE, LaunchError
from orchestrator.inventory import parse_inventory
from orchestrator.runs import quarantine
from orchestrator.runs.launch import first_lineup, stand_ins
from orchestrator.transport import ErrorKind, NodeResult

NO_ROUTE = "connect to host 10.0.0.2 port 22: No route to host (the host is down, its link is cut, or the address is wrong)"


def inv(n=3, spares=1):
    nodes = [{"name": f"n{i}", "host": f"10.0.0.{i}", "spare": i > n} for i in range(1, n + spares + 1)]
    return parse_inventory(yaml.safe_dump({"nodes": nodes}), "<t>")


class Cluster:
    def __init__(self, inventory, down=()):
        self.unreachable = {n: NodeResult(n, None, error=NO_ROUTE.replace("10.0.0.2", f"10.0.0.{n[1:]}"),
                                          kind=ErrorKind.CONNECT) for n in down}
        self.connections = {nd.name: object() for nd in inventory.nodes if nd.name not in down}


class Book:
    def __init__(self):
        self.told, self.left_out = [], {}

    def tell(self, text):
        self.told.append(text)

    def leave_out(self, why):
        self.left_out.update(why)


def test_stand_ins_put_the_next_spare_in_each_unusable_nodes_place_in_rank_order():
    assert stand_ins(["n1", "n2"], ["n3", "n4"], {"n1": "sick"}) == (["n3", "n2"], {}, {"n1": "n3"})
    nodes, short, instead = stand_ins(["n1", "n2"], ["n3"], {"n1": "sick", "n2": "down"})
    assert nodes == ["n3"] and short == {"n2": "down"} and instead == {"n1": "n3"}


def test_a_node_down_at_launch_gives_its_place_to_the_spare_and_spends_no_restart():
    i, book = inv(), Book()
    assert first_lineup(i, Cluster(i, down=["n2"]), {}, None, book) == ["n1", "n4", "n3"]
    assert book.left_out == {"n2": f"unreachable at launch: {NO_ROUTE}"}
    assert book.told == [f"n2 is unreachable ({NO_ROUTE}); n4 takes its place; nothing was launched, so no restart "
                         "is spent"]


def test_with_min_nodes_the_run_starts_without_it():
    i, book = inv(spares=0), Book()
    assert first_lineup(i, Cluster(i, down=["n2"]), {}, 2, book) == ["n1", "n3"]
    assert "left out (--min-nodes 2)" in book.told[0]


def test_without_a_spare_one_paragraph_with_sshs_words_and_what_to_do():
    i = inv(spares=1)
    with pytest.raises(LaunchError) as e:
        first_lineup(i, Cluster(i, down=["n2", "n4"]), {}, None, Book())
    text = str(e.value)
    assert e.value.exit_code == EXIT_UNREACHABLE and "\n" not in text
    assert text.startswith("cannot reach n2, nothing was started. n2: connect to host 10.0.0.2 port 22: No route")
    assert "Spare n4 cannot be reached either (connect to host 10.0.0.4 port 22: No route to host" in text
    assert text.endswith("or start without it with --min-nodes 2."), text


def test_every_node_down_says_so_without_offering_to_shrink():
    i = inv(n=2, spares=0)
    with pytest.raises(LaunchError) as e:
        first_lineup(i, Cluster(i, down=["n1", "n2"]), {}, None, Book())
    assert str(e.value).startswith("cannot reach n1, n2, nothing was started.") and "--min-nodes" not in str(e.value)
    assert str(e.value).endswith("Check the addresses and the links: `ssh` to each says the same.")


def test_a_quarantined_node_without_a_spare_keeps_its_own_remedy():
    i = inv(spares=0)
    held = {"n1": quarantine.Entry("n1", "10.0.0.1", "gpu_health: GPU 0: Xid 48", 0.0)}
    with pytest.raises(LaunchError) as e:
        first_lineup(i, Cluster(i), held, None, Book())
    assert e.value.exit_code == EXIT_FAILED and "quarantined since" in str(e.value)
    assert "clusterctl health --release n1" in str(e.value)
