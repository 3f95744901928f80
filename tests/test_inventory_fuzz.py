"""Property: whatever the inventory file holds, `clusterctl inventory check` exits 0 only for a
valid inventory, and otherwise exits 2 with one paragraph naming file:line -- within 2 s and
256 MiB.

Inventories are mutations of inventory.example.yaml (held here as a tree, written out by a small
emitter of our own so the test controls every token): deleted keys, wrong types, YAML booleans,
huge and negative numbers, unicode, tags, anchors and aliases, duplicate keys, deep nesting, and
byte-level damage. Each mutation knows whether it keeps the document valid; that, not the code
under test, decides which exit code is right. A mutation whose effect is unknown (a random
byte flip) only has to end in 0 or in a proper exit-2 paragraph.

Values at the edge are generated too: node ranges (valid ones, and negative or backwards ones),
host names and addresses (IPv4 with leading zeros or octets over 255, IPv6 literals, 253/63
character limits, user@host), and ports written as YAML 1.1 reads them (`0x50`, `0777`, `1_000`,
`+22`) in every place a port goes.

Every case runs through the real CLI entry point (`orchestrator.cli.main`) in one worker process
whose whole address space is capped at 256 MiB (RLIMIT_AS) and which must answer each case
within 2 s (tests/inventory_worker.py); interpreter start-up is paid once, not per case.

Each run draws a fresh seed and prints it (`INVENTORY_FUZZ_SEED=N`), and a failure repeats it;
set INVENTORY_FUZZ_SEED=N (with the same INVENTORY_FUZZ_CASES) to replay that run.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import os
import random
import re

import pytest
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

from tests.inventory_worker import REPO_ROOT, Worker

CASES = int(os.environ.get("INVENTORY_FUZZ_CASES", "1000"))
CASE_TIMEOUT_S = 2.0
SEED = int(os.environ.get("INVENTORY_FUZZ_SEED") or random.SystemRandom().randrange(1 << 32))
REPLAY = f"inventory fuzz seed: replay with INVENTORY_FUZZ_SEED={SEED} INVENTORY_FUZZ_CASES={CASES}"


# ---------------------------------------------------------------- a YAML tree we emit ourselves


class Plain:
    """A plain scalar, written as is: `true`, `010`, `2024-01-01`."""

    def __init__(self, text):
        self.text, self.anchor, self.tag = text, None, None


class Str:
    """A double-quoted string (JSON escapes are YAML escapes)."""

    def __init__(self, text, raw_escape=None):
        self.text, self.anchor, self.tag, self.raw_escape = text, None, None, raw_escape


class Seq:
    def __init__(self, items, flow=True):
        self.items, self.flow, self.anchor, self.tag = items, flow, None, None


class Map:
    def __init__(self, pairs, flow=False):
        self.pairs, self.flow, self.anchor, self.tag = pairs, flow, None, None

    def get(self, key):
        return next((v for k, v in self.pairs if k == key), None)

    def keys(self):
        return [k for k, _ in self.pairs]


class Alias:
    def __init__(self, target):
        self.target = target  # the anchored node, or a name that no anchor has


class Raw:
    """Text emitted verbatim as a value (aliases bombs, complex keys)."""

    def __init__(self, text):
        self.text, self.anchor, self.tag = text, None, None


def _props(n) -> str:
    out = ""
    if getattr(n, "tag", None):
        out += n.tag + " "
    if getattr(n, "anchor", None):
        out += "&" + n.anchor + " "
    return out


def flow(n) -> str:
    if isinstance(n, Alias):
        return "*" + (n.target.anchor if not isinstance(n.target, str) else n.target)
    if isinstance(n, Plain) or isinstance(n, Raw):
        return _props(n) + n.text
    if isinstance(n, Str):
        body = json.dumps(n.text, ensure_ascii=False)
        if n.raw_escape:
            body = body[:-1] + n.raw_escape + '"'
        return _props(n) + body
    if isinstance(n, Seq):
        return _props(n) + "[" + ", ".join(flow(i) for i in n.items) + "]"
    return _props(n) + "{" + ", ".join(f"{k}: {flow(v)}" for k, v in n.pairs) + "}"


def block(m: Map, indent: int = 0) -> list[str]:
    pad, out = " " * indent, []
    for k, v in m.pairs:
        if isinstance(v, Map) and not v.flow and v.pairs:
            out.append(f"{pad}{k}: {_props(v)}".rstrip())
            out += block(v, indent + 2)
        elif isinstance(v, Seq) and not v.flow and v.items:
            out.append(f"{pad}{k}: {_props(v)}".rstrip())
            out += [f"{pad}  - {flow(i)}" for i in v.items]
        else:
            out.append(f"{pad}{k}: {flow(v)}")
    return out


def emit(doc: Map) -> str:
    return "# fuzzed from inventory.example.yaml\n" + "\n".join(block(doc)) + "\n"


def base() -> Map:
    """inventory.example.yaml as a tree (test_base_is_the_example keeps the two in step)."""
    return Map([
        ("ssh", Map([("user", Str("train")), ("port", Plain("22")), ("identity_file", Plain("~/.ssh/id_ed25519")),
                     ("known_hosts", Plain("~/.ssh/known_hosts")), ("connect_timeout", Plain("10"))])),
        ("master_port", Plain("29500")),
        ("workdir", Plain("~/gpt_train")),
        ("python", Plain("python3")),
        ("env", Map([("NCCL_IB_DISABLE", Str("1"))])),
        ("nodes", Seq([
            Map([("name", Plain("node1")), ("host", Plain("192.168.1.100")), ("gpus", Plain("8")),
                 ("iface", Plain("eth0"))], flow=True),
            Map([("name", Plain("node2")), ("host", Plain("192.168.1.101")), ("gpus", Plain("8")),
                 ("iface", Plain("eth0")), ("env", Map([("NCCL_DEBUG", Plain("INFO"))], flow=True))], flow=True),
        ], flow=False)),
        ("train", Map([("module", Plain("trainer")),
                       ("args", Seq([Plain("--preset"), Plain("tiny"), Plain("--precision"), Plain("fp16"),
                                     Plain("--grad-accum"), Str("8")])),
                       ("env", Map([], flow=True)), ("nproc_per_node", Plain("auto"))])),
        ("checks", Map([("clock_skew_warn", Plain("1.0")), ("clock_skew_fail", Plain("5.0")),
                        ("disk_min_gb", Plain("10"))])),
    ])


# ---------------------------------------------------------------- the schema, as this test knows it

# kind -> (values that keep the document valid, values that make it invalid). Written from the
# inventory reference (docs/inventory.md), not from the models.
HUGE = "9" * 30
LONG_HOST = ".".join(["a" * 63] * 3 + ["b" * 61])  # 253 characters, the longest name
GOOD_HOSTS = ["h1", "gpu-01.cluster.local", "node_1", "h1.", "a" * 63 + ".x", LONG_HOST, "10.0.0.1",
              '"::1"', '"[::1]"', '"fe80::1%eth0"', '"[fe80::1%eth0]"', '"::ffff:10.0.0.1"']
BAD_HOSTS = ["010.0.0.1", "10.0.0.01", "10.0.0.256", "1.2.3", "1.2.3.4.5", "0x7f.1", "a..b", "a-", "-a",
             '"user@h1"', '"h1:22"', '"[10.0.0.1]"', '":::"', '"' + "a" * 64 + '.x"', '"' + LONG_HOST + 'c"',
             '"bücher.example"', '"h1 && reboot"', '"-oProxyCommand=x"', '""',
             "0.0.0.0", "255.255.255.255", '"::"', '"[::]"', "224.0.0.1", '"ff02::1%eth0"', '"::ffff:0.0.0.0"']
# Ports YAML 1.1 reads as numbers although they are not written in decimal (0x50 is 80).
YAML_NUMBER_PORTS = ["0x50", "0777", "022", "0b101", "1_000", "+22", "1:30", "0o777"]
VALUES = {
    "port": (["1", "22", "80", "2222", "29500", "65535"],
             ["true", "false", "yes", "no", "on", "off", "0", "-1", "65536", "1.5", HUGE, "-" + HUGE,
              '"22"', '" 22"', "[22]", "{p: 22}", "2024-01-01", "9" * 5000, "22.0", "-22", ".inf"]
             + YAML_NUMBER_PORTS),
    "gpus": (["0", "1", "8", "1024"], ["true", "yes", "-1", "1025", "2.0", HUGE, '"8"', "[8]", "null"]),
    "timeout": (["1", "10", "0.5", "600"], ["0", "-1", "601", ".inf", ".nan", "true", '"10"', "1e400", "[]"]),
    "nonneg": (["0", "1.0", "10", "1000000", HUGE], ["-1", "-0.5", ".nan", "true", '"1"', "null", "[]"]),
    "path": (["~/gpt_train", "/opt/x", '"/srv/ünïcode dir"', '"~/a b"', "python3"],
             ["123", "true", "2024-01-01", "1.5", '"~root/x"', '""', '"a\\nb"', "[a]", "{a: b}"]),
    "name": (None, ['"a;b"', "007", "true", '""', '"ü"', "null", "[a]", '"' + "x" * 300 + '"']),
    "host": (GOOD_HOSTS, BAD_HOSTS + ["1", "true", "null", "[h]"]),
    "user": (["train", "ubuntu", "a_b-c"], ['"$(id)"', "123", "true", "[u]"]),
    "iface": (["eth0", "ib0", "enp1s0f0"], ['"eth0;ls"', "0", "true", "[eth0]"]),
    "bool": (["true", "false"], ["1", "0", '"true"', "null", "[]"]),
    "nproc": (["1", "8", "auto"], ["true", "all", "0", "-1", "[]"]),
    "module": (["trainer", "pkg.mod"], ['"os;rm"', "1", "true", "[m]"]),
}
NULLABLE = {"node.gpus", "node.iface", "node.address", "train.module"}  # and every ssh key
FIELDS = {  # where -> key -> kind
    "top": {"master_port": "port", "workdir": "path", "python": "path"},
    "ssh": {"user": "user", "port": "port", "identity_file": "path", "known_hosts": "path",
            "connect_timeout": "timeout"},
    "node": {"name": "name", "host": "host", "address": "host", "gpus": "gpus", "iface": "iface"},
    "train": {"module": "module", "nproc_per_node": "nproc"},
    "checks": {"clock_skew_warn": "nonneg", "clock_skew_fail": "nonneg", "disk_min_gb": "nonneg",
               "require_gpu_idle": "bool"},
}
OPTIONAL = {"top": ["ssh", "master_port", "workdir", "python", "env", "train", "checks"],
            "ssh": list(FIELDS["ssh"]), "node": ["gpus", "iface", "env", "address", "ssh"],
            "train": ["module", "args", "env", "nproc_per_node"], "checks": list(FIELDS["checks"])}
ENV_KEY = st.from_regex(r"\A[A-Z_][A-Z0-9_]{0,12}\Z")
PRINTABLE = st.text(st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")), max_size=20)


def mappings(doc: Map) -> dict[str, list[Map]]:
    """The mappings of each kind present in the document (a node's own `ssh:` is an ssh one)."""
    out = {"top": [doc], "ssh": [], "node": [], "train": [], "checks": [], "env": []}
    for key in ("ssh", "train", "checks", "env"):
        if isinstance(doc.get(key), Map):
            out[key].append(doc.get(key))
    nodes = doc.get("nodes")
    for n in (nodes.items if isinstance(nodes, Seq) else []):
        if isinstance(n, Map):
            out["node"].append(n)
            for key, kind in (("env", "env"), ("ssh", "ssh")):
                if isinstance(n.get(key), Map):
                    out[kind].append(n.get(key))
    if out["train"] and isinstance(out["train"][0].get("env"), Map):
        out["env"].append(out["train"][0].get("env"))
    return out


def fields(doc: Map) -> list[tuple[str, Map, str]]:
    return [(where, m, key) for where, ms in mappings(doc).items() if where in FIELDS
            for m in ms for key in FIELDS[where] if key in m.keys()]


def set_value(m: Map, key, value) -> None:
    m.pairs = [(k, value if k == key else v) for k, v in m.pairs]


def parse_value(text: str):
    return Str(json.loads(text)) if text.startswith('"') else Plain(text)


def text_of(n) -> str | None:
    n = n.target if isinstance(n, Alias) else n
    return n.text if isinstance(n, (Plain, Str)) else None


# A node range as this test writes it: PREFIX[LO-HI] or PREFIX[LO-HI/STEP], LO and HI the same width.
RANGE = re.compile(r"\A(?P<pre>[^\[]*)\[(?P<lo>\d+)-(?P<hi>\d+)(?:/(?P<step>\d+))?\](?P<post>.*)\Z")


def expand_range(text: str) -> list[str]:
    """The names a range this test wrote stands for, in order (the test's own reading, not NodeSet's)."""
    m = RANGE.match(text)
    if not m:
        return [text]
    width = len(m["lo"]) if m["lo"].startswith("0") else 0
    return [f"{m['pre']}{i:0{width}d}{m['post']}" for i in range(int(m["lo"]), int(m["hi"]) + 1, int(m["step"] or 1))]


def node_hosts(doc: Map, skip: Map | None = None) -> set[str]:
    """Every host the nodes use, lower-cased, ranges and {name} templates expanded."""
    out = set()
    for n in mappings(doc)["node"]:
        if n is skip:
            continue
        names, host = expand_range(text_of(n.get("name")) or ""), text_of(n.get("host"))
        if host is not None:
            hosts = [host.replace("{name}", x) for x in names] if "{name}" in host else expand_range(host)
            out |= {h.lower() for h in hosts}
    return out


def is_range_entry(m: Map) -> bool:
    return RANGE.match(text_of(m.get("name")) or "") is not None


# ---------------------------------------------------------------- mutations that keep it valid


def keep_valid(draw, doc: Map) -> None:
    op = draw(st.sampled_from(["delete", "value", "env", "add_nodes", "style", "reorder", "delete_node",
                               "add_range", "node_port", "address"]))
    ms = mappings(doc)
    if op == "delete":
        where = draw(st.sampled_from([w for w in OPTIONAL if ms.get(w)]))
        m = draw(st.sampled_from(ms[where]))
        keys = [k for k in m.keys() if k in OPTIONAL[where]]
        if keys:
            key = draw(st.sampled_from(keys))
            m.pairs = [(k, v) for k, v in m.pairs if k != key]
    elif op == "value":
        # a range entry's host stays a range; another node's host is never reused
        choices = [(w, m, k) for w, m, k in fields(doc) if VALUES[FIELDS[w][k]][0]
                   and not (k == "host" and is_range_entry(m))]
        if choices:
            where, m, key = draw(st.sampled_from(choices))
            values = VALUES[FIELDS[where][key]][0]
            if key == "host":
                taken = node_hosts(doc, skip=m)
                values = [v for v in values if text_of(parse_value(v)).lower() not in taken]
            if values:
                set_value(m, key, parse_value(draw(st.sampled_from(values))))
    elif op == "env" and ms["env"]:
        m = draw(st.sampled_from(ms["env"]))
        key = draw(ENV_KEY.filter(lambda k: k not in m.keys()))
        value = draw(st.one_of(PRINTABLE.map(Str), st.sampled_from(["010", "1.10", "0x1F", "1_000", "12", ".inf",
                                                                    "-3", "INFO", "a b"]).map(Plain)))
        m.pairs.append((key, value))
    elif op == "add_nodes" and isinstance(doc.get("nodes"), Seq):
        items = doc.get("nodes").items
        taken = {str(getattr(m.get("name"), "text", "")) for m in items if isinstance(m, Map)}
        i = len(items)
        for _ in range(draw(st.integers(1, 40))):
            while f"extra{i}" in taken:  # names and hosts stay unique, also after delete_node
                i += 1
            taken.add(f"extra{i}")
            items.append(Map([("name", Plain(f"extra{i}")), ("host", Plain(f"10.9.{i // 200}.{i % 200}")),
                              ("gpus", Plain(str(draw(st.integers(0, 1024)))))], flow=True))
    elif op == "style":
        m = draw(st.sampled_from([m for ms_ in ms.values() for m in ms_]))
        m.flow = not m.flow
    elif op == "reorder":
        m = draw(st.sampled_from([m for ms_ in ms.values() for m in ms_]))
        m.pairs = draw(st.permutations(m.pairs))
    elif op == "delete_node" and isinstance(doc.get("nodes"), Seq) and len(doc.get("nodes").items) > 1:
        doc.get("nodes").items.pop(draw(st.integers(0, len(doc.get("nodes").items) - 1)))
    elif op == "add_range" and isinstance(doc.get("nodes"), Seq):
        items = doc.get("nodes").items
        k = len(items)
        while any((text_of(m.get("name")) or "").startswith(f"r{k}n") for m in items if isinstance(m, Map)):
            k += 1
        lo = draw(st.integers(0, 250))
        hi = lo + draw(st.integers(0, 5))
        pad = draw(st.booleans()) and len(str(hi)) == len(str(lo))
        lo_s, hi_s = (f"{lo:03d}", f"{hi:03d}") if pad else (str(lo), str(hi))
        step = draw(st.sampled_from(["", "", "/2"]))
        name = f"r{k}n[{lo_s}-{hi_s}{step}]"
        n = len(expand_range(name))
        host = draw(st.sampled_from(["{name}.cluster", f"10.8.{k % 256}.[{lo}-{lo + n - 1}]"]))
        entry = Map([("name", Str(name)), ("host", Str(host)), ("gpus", Plain(str(draw(st.integers(0, 8)))))],
                    flow=True)
        if draw(st.booleans()):
            entry.pairs.append(("address", Str(f"192.168.{k % 256}.[{lo}-{lo + n - 1}]")))
        items.append(entry)
    elif op == "node_port" and ms["node"]:
        node = draw(st.sampled_from(ms["node"]))
        port = Plain(draw(st.sampled_from(VALUES["port"][0])))
        if isinstance(node.get("ssh"), Map):
            node.get("ssh").pairs = [(k, v) for k, v in node.get("ssh").pairs if k != "port"] + [("port", port)]
        else:
            node.pairs = [(k, v) for k, v in node.pairs if k != "ssh"] + [("ssh", Map([("port", port)], flow=True))]
    elif op == "address" and ms["node"]:
        node = draw(st.sampled_from(ms["node"]))
        if not is_range_entry(node):
            node.pairs = [(k, v) for k, v in node.pairs if k != "address"]
            node.pairs.append(("address", parse_value(draw(st.sampled_from(GOOD_HOSTS)))))


def share_env(doc: Map) -> None:
    """The first node's env gets an anchor and the second node uses it through an alias. Run
    after the other valid mutations, which could delete the anchored mapping."""
    nodes = mappings(doc)["node"]
    if len(nodes) < 2:
        return
    env = nodes[0].get("env")
    if not isinstance(env, Map):
        env = Map([("SHARED", Str("1"))], flow=True)
        nodes[0].pairs.append(("env", env))
    env.anchor = "e0"
    nodes[1].pairs = [(k, v) for k, v in nodes[1].pairs if k != "env"] + [("env", Alias(env))]


# ---------------------------------------------------------------- mutations that make it invalid


def make_invalid(draw, doc: Map) -> str:
    """Apply one mutation that no valid inventory survives; returns its name."""
    ms = mappings(doc)
    all_maps = [m for ms_ in ms.values() for m in ms_]
    op = draw(st.sampled_from(["wrong_value", "delete_required", "unknown_key", "duplicate_key", "tag",
                               "deep", "alias_bomb", "complex_key", "non_string_key", "undefined_alias",
                               "control_escape", "format_char", "bad_env", "empty_nodes", "two_documents",
                               *["bad_range", "bad_port", "bad_host", "same_host"] * 3]))  # the edges, drawn more often
    if op == "wrong_value":
        where, m, key = draw(st.sampled_from(fields(doc)))
        kind = FIELDS[where][key]
        bad = [v for v in VALUES[kind][1] if not (v == "null" and (f"{where}.{key}" in NULLABLE or where == "ssh"))]
        value = draw(st.sampled_from(bad))
        set_value(m, key, Raw(value) if value.startswith(("[", "{")) else parse_value(value))
    elif op == "delete_required":
        what = draw(st.sampled_from(["nodes", "name", "host"]))
        if what == "nodes":
            doc.pairs = [(k, v) for k, v in doc.pairs if k != "nodes"]
        else:
            node = draw(st.sampled_from(ms["node"]))
            node.pairs = [(k, v) for k, v in node.pairs if k != what]
    elif op == "unknown_key":
        m = draw(st.sampled_from(all_maps))
        if m in ms["env"]:  # any identifier is a valid env key; a key with '-' is not
            m.pairs.append(("BAD-KEY", Str("1")))
        else:
            m.pairs.append((draw(st.sampled_from(["master_prot", "gpu", "hosts", "x", "Nodes"])), Plain("1")))
    elif op == "duplicate_key":
        m = draw(st.sampled_from([m for m in all_maps if m.pairs]))
        k, v = draw(st.sampled_from(m.pairs))
        m.pairs.insert(draw(st.integers(0, len(m.pairs))), (k, copy.deepcopy(v)))
    elif op == "tag":
        where, m, key = draw(st.sampled_from(fields(doc)))
        node = m.get(key)
        node.tag = draw(st.sampled_from(["!!binary", "!!python/object:os.system", "!!str", "!!int", "!!timestamp",
                                         "!local", "!", "!!set", "!<tag:yaml.org,2002:str>"]))
    elif op == "deep":
        where, m, key = draw(st.sampled_from(fields(doc) + [("top", doc, "env")]))
        d = draw(st.integers(1, 300))
        set_value(m, key, Raw("[" * d + "1" + "]" * d))
    elif op == "alias_bomb":
        depth, width = draw(st.integers(3, 12)), draw(st.integers(2, 12))
        doc.pairs.insert(0, ("a0", Raw("&a0 [lol]")))
        for n in range(1, depth + 1):
            doc.pairs.insert(n, (f"a{n}", Raw(f"&a{n} [" + ", ".join([f"*a{n - 1}"] * width) + "]")))
        target = draw(st.sampled_from(["master_port", "env", "workdir"]))
        doc.pairs = [(k, v) for k, v in doc.pairs if k != target] + [(target, Raw(f"*a{depth}"))]
    elif op == "complex_key":
        m = draw(st.sampled_from([m for m in all_maps]))
        m.flow = True
        m.pairs.append((draw(st.sampled_from(["[a, b]", "{a: b}", "? [x]"])), Plain("1")))
    elif op == "non_string_key":
        m = draw(st.sampled_from(all_maps))
        m.pairs.append((draw(st.sampled_from(["1", "true", "null", "1.5", "2024-01-01", "~"])), Str("x")))
    elif op == "undefined_alias":
        where, m, key = draw(st.sampled_from(fields(doc)))
        set_value(m, key, Alias("nowhere"))
    elif op == "control_escape":
        where, m, key = draw(st.sampled_from([f for f in fields(doc) if FIELDS[f[0]][f[2]] in ("path", "user")]
                                             or fields(doc)))
        esc = draw(st.sampled_from(["\\x01", "\\x1b", "\\0", "\\x7f", "\\e", "\\a", "\\b", "\\x85"]))
        set_value(m, key, Str("a", raw_escape=esc))
    elif op == "format_char":
        targets = ms["env"] + ms["top"]
        m = draw(st.sampled_from(targets))
        ch = draw(st.sampled_from(["\u202e", "\u200b", "\u2066", "\ufeff", "\u00ad"]))
        if m in ms["env"]:
            m.pairs.append(("ZZ_VALUE", Str("x" + ch)))
        else:
            m.pairs = [(k, v) for k, v in m.pairs if k != "workdir"] + [("workdir", Str("/x" + ch))]
    elif op == "bad_env":
        m = draw(st.sampled_from(ms["env"] or [doc]))
        if m is doc:
            doc.pairs = [(k, v) for k, v in doc.pairs if k != "env"] + [("env", Raw("[A, B]"))]
        else:
            m.pairs.append(("ZZ_BAD", Raw(draw(st.sampled_from(["true", "no", "null", "~", "[1]", "{a: 1}", ""])))))
    elif op == "empty_nodes":
        doc.pairs = [(k, v) for k, v in doc.pairs if k != "nodes"] + [("nodes", Raw("[]"))]
    elif op == "two_documents":
        return "two_documents"
    elif op == "bad_range":
        name, host = draw(st.sampled_from([
            ("n[-1-3]", "{name}.x"), ("n[-1]", "{name}.x"), ("n[1,-2]", "{name}.x"), ("n[-3--1]", "{name}.x"),
            ("x[-5-5/5]", "{name}.x"), ("n[1--3]", "{name}.x"), ("n[5-2]", "{name}.x"), ("n[08-02]", "{name}.x"),
            ("n[1-3/0]", "{name}.x"), ("n[1,3-2]", "{name}.x"), ("n[]", "{name}.x"), ("n[1-3]", "10.7.0.[-1-1]"),
            ("n[1-3]", "10.7.0.[3-1]"), ("n[1-3]", "10.7.0.[254-256]"), ("n[1-3]", "10.7.0.[08-10]"),
            ("n[1-3]", "010.7.0.[1-3]"), ("gpu[1-3]!gpu2", "{name}.x"), ("gpu[1-3]&gpu[2-5]", "{name}.x"),
            ("gpu[1-3]^gpu2", "{name}.x"), ("n[ 1-3 ]", "{name}.x"), ("n[1 - 3]", "{name}.x"), ("[1-3]", "{name}.x"),
            ("n[1-3]", "10.7.0.[ 1-3]")]))
        doc.get("nodes").items.append(Map([("name", Str(name)), ("host", Str(host))], flow=True))
    elif op == "bad_port":
        port = parse_value(draw(st.sampled_from(YAML_NUMBER_PORTS + ["0", "65536", "-22", '" 22"', "22.0", "true"])))
        where = draw(st.sampled_from(["master_port", "ssh", "node"]))
        if where == "master_port":
            doc.pairs = [(k, v) for k, v in doc.pairs if k != "master_port"] + [("master_port", port)]
        else:
            m = doc if where == "ssh" else draw(st.sampled_from(ms["node"]))
            if not isinstance(m.get("ssh"), Map):
                m.pairs = [(k, v) for k, v in m.pairs if k != "ssh"] + [("ssh", Map([], flow=True))]
            ssh = m.get("ssh")
            ssh.pairs = [(k, v) for k, v in ssh.pairs if k != "port"] + [("port", port)]
    elif op == "bad_host":
        node = draw(st.sampled_from(ms["node"]))
        key = draw(st.sampled_from(["host", "address"]))
        node.pairs = [(k, v) for k, v in node.pairs if k != key] + [(key, parse_value(draw(st.sampled_from(BAD_HOSTS))))]
    elif op == "same_host":  # another node on the same host and port, spelled another way
        node = draw(st.sampled_from(ms["node"]))
        twin = copy.deepcopy(node)
        twin.pairs = [(k, v) for k, v in twin.pairs if k not in ("name", "host")] + \
            [("name", Str("twin9")), ("host", Str(other_spelling(text_of(node.get("host")) or "127.0.0.1")))]
        doc.get("nodes").items.append(twin)
    return op


def other_spelling(host: str) -> str:
    """The same host written another way: an IPv4 address IPv4-mapped, IPv6 in its long form (or an
    IPv4-mapped one as IPv4), a name in capitals with a trailing dot."""
    bare = host[1:-1] if host.startswith("[") else host
    addr, pct, scope = bare.partition("%")
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return host.upper().rstrip(".") + "."
    if ip.version == 4:
        return f"::ffff:{ip}"
    return str(ip.ipv4_mapped) if ip.ipv4_mapped else ip.exploded + (pct + scope if pct else "")


# ---------------------------------------------------------------- byte-level damage


def damage(draw, data: bytes) -> tuple[bytes, bool | None]:
    """(bytes, valid?) where None means the damage may or may not leave a valid inventory."""
    op = draw(st.sampled_from(["bad_utf8", "control", "empty", "flip", "delete", "insert", "truncate", "repeat"]))
    pos = draw(st.integers(0, len(data)))
    if op == "bad_utf8":
        return data[:pos] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xe9x", b"\xf8\x88\x80\x80\x80"])) \
            + data[pos:], False
    if op == "control":
        ch = draw(st.sampled_from([0, 1, 7, 8, 11, 12, 14, 27, 31, 127]))
        return data[:pos] + bytes([ch]) + data[pos:], False
    if op == "empty":
        return draw(st.sampled_from([b"", b"\n", b"# nothing\n", b"---\n", b"~\n", b"   \n\n"])), False
    if op == "flip" and data:
        i = min(pos, len(data) - 1)
        return data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1:], None
    if op == "delete":
        return data[:pos] + data[pos + draw(st.integers(1, 40)):], None
    if op == "insert":
        return data[:pos] + draw(st.binary(min_size=1, max_size=8)) + data[pos:], None
    if op == "truncate":
        return data[:pos], None
    return data[:pos] + data[pos:pos + 200] * draw(st.integers(2, 50)) + data[pos:], None


# ---------------------------------------------------------------- what a valid one must print


def expected(doc: Map) -> dict:
    """Values `inventory check --json` must report for a valid document."""
    def text(n):
        n = n.target if isinstance(n, Alias) else n
        return n.text

    def env_of(m):
        m = m.target if isinstance(m, Alias) else m
        return {k: text(v) for k, v in m.pairs} if isinstance(m, Map) else {}

    top_env = env_of(doc.get("env")) if doc.get("env") is not None else {}
    nodes = []
    for n in doc.get("nodes").items:
        gpus = n.get("gpus")
        for name in expand_range(text(n.get("name"))):
            nodes.append({"name": name, "gpus": None if gpus is None else int(text(gpus), 0),
                          "env": {**top_env, **(env_of(n.get("env")) if n.get("env") is not None else {})}})
    port = doc.get("master_port")
    return {"master_port": 29500 if port is None else int(text(port)), "nodes": nodes}


# ---------------------------------------------------------------- the property


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


@pytest.fixture(scope="module")
def fuzz_seed():
    """This run's seed: drawn once by conftest.py (so every xdist worker shares it), which prints it
    on the terminal at the session's start; a failure's message carries REPLAY too."""
    return SEED


PARAGRAPH = re.compile(r"\Aclusterctl: error: (?P<path>[^\n]*?):(?P<line>\d+): [^\n]+\n(  [^\n]+\n)*\Z")


@seed(SEED)
@settings(max_examples=CASES, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@pytest.mark.slow
@given(data=st.data())
def test_any_inventory_is_valid_or_one_paragraph_exit_2(fuzz_seed, worker, tmp_path_factory, data):
    try:
        check_one(worker, tmp_path_factory, data)
    except AssertionError as e:  # the seed in the message itself, not only in the report around it
        e.args = (f"{e.args[0] if e.args else ''}\n{REPLAY}",)
        raise
    except Exception as e:
        e.add_note(REPLAY)
        raise


def check_one(worker, tmp_path_factory, data):
    draw = data.draw
    doc = base()
    for _ in range(draw(st.integers(0, 3))):
        keep_valid(draw, doc)
    if draw(st.integers(0, 5)) == 0:
        share_env(doc)
    valid: bool | None = True
    mode = draw(st.sampled_from(["valid", "invalid", "invalid", "bytes"]))
    text_suffix = ""
    if mode == "invalid":
        op = make_invalid(draw, doc)
        event(f"invalid: {op}")
        if op == "two_documents":
            text_suffix = "---\n" + emit(base())
        valid = False
    raw = (emit(doc) + text_suffix).encode()
    if mode == "bytes":
        raw, valid = damage(draw, raw)
        event(f"bytes: {'invalid' if valid is False else 'unknown'}")
    elif mode == "valid":
        event("valid")

    path = tmp_path_factory.mktemp("fuzz", numbered=True) / "inv.yaml"
    path.write_bytes(raw)
    r = worker.check(path, timeout=CASE_TIMEOUT_S)
    shown = raw.decode("utf-8", "replace")
    assert "Traceback" not in r["err"] and "internal error" not in r["err"], shown + "\n" + r["err"]
    if valid is True:
        assert r["rc"] == 0, f"valid inventory refused:\n{shown}\n{r['err']}"
        got = json.loads(r["out"])
        want = expected(doc)
        assert got["master_port"] == want["master_port"], shown
        assert [{k: n[k] for k in ("name", "gpus", "env")} for n in got["nodes"]] == want["nodes"], shown
        return
    if valid is False:
        assert r["rc"] == 2, f"invalid inventory accepted (exit {r['rc']}):\n{shown}\n{r['out'][:500]}"
    assert r["rc"] in (0, 2), r
    if r["rc"] == 2:
        m = PARAGRAPH.match(r["err"])
        assert m and m["path"] == str(path), f"not one paragraph naming file:line:\n{r['err']!r}\n{shown}"
        assert len(r["err"]) < 2048, r["err"]
        assert all(line.isprintable() for line in r["err"].splitlines()), repr(r["err"])


def test_base_is_the_example():
    """The tree the fuzzer mutates is inventory.example.yaml."""
    from orchestrator.inventory import load_inventory, parse_inventory

    def view(inv):
        return ([(n.name, n.host, n.gpus, n.iface, n.env, n.ssh) for n in inv.nodes],
                inv.master_port, inv.workdir, inv.python, inv.env, inv.train, inv.checks)

    assert view(parse_inventory(emit(base()), "fuzz")) == view(load_inventory(REPO_ROOT / "inventory.example.yaml"))
