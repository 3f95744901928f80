"""The inventory loader's limits: no file or YAML document hangs, exhausts or misleads it.

Time and memory bounds are enforced from outside: each check runs in a worker process capped
at 256 MiB of address space (tests/inventory_worker.py) and must answer within a timeout.
"""

import os
import resource
import subprocess
import sys

import pytest

from orchestrator.errors import EXIT_USAGE, InventoryError
from orchestrator.inventory import load_inventory, parse_inventory
from orchestrator.inventory.read import MAX_BYTES, MAX_DEPTH
from tests.inventory_worker import LIMIT_BYTES, REPO_ROOT, Worker

NODES = "nodes:\n  - {name: a, host: h1}\n"


def alias_bomb(depth: int, width: int = 9) -> str:
    """`a0: &a0 [lol]`, then `aN: &aN [*aN-1 x width]`: 805 bytes expand to width**depth values."""
    lines = ["a0: &a0 [lol]"]
    lines += [f"a{n}: &a{n} [" + ", ".join([f"*a{n - 1}"] * width) + "]" for n in range(1, depth + 1)]
    return "\n".join(lines) + f"\nmaster_port: *a{depth}\n" + NODES


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def _err(text: str) -> InventoryError:
    with pytest.raises(InventoryError) as ei:
        parse_inventory(text, "bad.yaml")
    return ei.value


@pytest.mark.parametrize("depth", [7, 8, 9])
def test_alias_bomb_is_refused_fast_and_short(worker, tmp_path, depth):
    p = tmp_path / "bomb.yaml"
    p.write_text(alias_bomb(depth))
    r = worker.check(p, timeout=1.0)
    assert r["rc"] == EXIT_USAGE
    assert len(r["err"].encode()) < 1024, r["err"]
    assert f"{p}:" in r["err"] and "expands the document past 200,000 values" in r["err"]


def test_fifo_is_refused_without_blocking(worker, tmp_path):
    fifo = tmp_path / "inv.fifo"
    os.mkfifo(fifo)
    r = worker.check(fifo, timeout=2.0)  # an open() that blocks on the FIFO never answers
    assert r["rc"] == EXIT_USAGE and f"{fifo}: this is a FIFO (named pipe)" in r["err"], r


def _cap_memory():
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))


@pytest.mark.parametrize("kind,needle", [
    ("fifo", "a FIFO (named pipe), not a file"),
    ("bomb", "expands the document past"),
    ("deep", "nested more than"),
    ("latin1", "is not UTF-8"),
])
def test_the_real_cli_process_exits_2_with_one_line(tmp_path, kind, needle):
    """A fresh `python -m orchestrator.cli` under the 256 MiB cap (the timeout covers start-up)."""
    p = tmp_path / "inv.yaml"
    if kind == "fifo":
        os.mkfifo(p)
    else:
        p.write_bytes({"bomb": alias_bomb(9).encode(), "deep": b"x: " + b"[" * 100_000 + b"\n",
                       "latin1": b"workdir: caf\xe9\n"}[kind])
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "inventory", "check", "-i", str(p)],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, preexec_fn=_cap_memory)
    assert r.returncode == EXIT_USAGE, r.stderr
    assert needle in r.stderr and r.stderr.count("\n") == 1 and r.stderr.startswith(f"clusterctl: error: {p}")


@pytest.mark.parametrize("make,needle", [
    (lambda d: d, "this is a directory, not a file"),
    (lambda d: "/dev/zero", "this is a character device"),
    (lambda d: _symlink_loop(d), "symlink loop"),
    (lambda d: _sparse(d, MAX_BYTES + 1), "1 MiB"),
])
def test_non_regular_and_oversized_files_are_refused(tmp_path, make, needle):
    with pytest.raises(InventoryError, match=needle) as ei:
        load_inventory(make(tmp_path))
    assert ei.value.exit_code == EXIT_USAGE


def _symlink_loop(d):
    os.symlink(d / "b", d / "a")
    os.symlink(d / "a", d / "b")
    return d / "a"


def _sparse(d, size):
    p = d / "big.yaml"
    with open(p, "wb") as f:
        f.truncate(size)
    return p


def test_cli_directory_and_symlink_loop_exit_2(worker, tmp_path):
    for path in (tmp_path, _symlink_loop(tmp_path)):
        r = worker.check(path, timeout=2.0)
        assert r["rc"] == EXIT_USAGE and "Traceback" not in r["err"] and r["err"].count("\n") == 1, r


def test_non_utf8_names_the_line_and_column(tmp_path):
    p = tmp_path / "inv.yaml"
    p.write_bytes(b"master_port: 29500\nworkdir: caf\xe9\n" + NODES.encode())
    with pytest.raises(InventoryError) as ei:
        load_inventory(p)
    assert ei.value.line == 2 and "byte 0xe9 at column 13 is not UTF-8" in str(ei.value)


@pytest.mark.parametrize("text,line,needle", [
    # YAML booleans, floats and dates are not ports, GPU counts or paths
    ("master_port: true\n" + NODES, 1, "master_port: 'true' is not a port"),
    ("nodes:\n  - {name: a, host: h1, gpus: true}\n", 2, "nodes[0].gpus"),
    ("nodes:\n  - {name: a, host: h1, gpus: 2.0}\n", 2, "nodes[0].gpus"),
    ("workdir: 2024-01-01\n" + NODES, 1, "workdir: Input should be a valid string (got '2024-01-01')"),
    ("workdir: 2024-13-45\n" + NODES, 1, "reads as a date but is not one"),
    ("python: 3.10\n" + NODES, 1, "quote it if you mean the text"),
    ("nodes: [{name: 007, host: h1}]\n", 1, "nodes[0].name"),
    ("checks: {require_gpu_idle: 1}\n" + NODES, 1, "checks.require_gpu_idle"),
    ("train: {nproc_per_node: 0}\n" + NODES, 1, "train.nproc_per_node"),
    ("env: {NCCL_IB_DISABLE: true}\n" + NODES, 1, "is a YAML boolean"),
    ("train: {args: [--flag, on]}\n" + NODES, 1, "quote booleans"),
    ("ssh: {connect_timeout: .nan}\n" + NODES, 1, "ssh.connect_timeout"),
    ("master_port: " + "9" * 5000 + "\n" + NODES, 1, "is too long"),
    # tags
    ("workdir: !!binary aGVsbG8=\n" + NODES, 1, "YAML tag '!!binary' is not allowed"),
    ("python: !!python/name:os.system\n" + NODES, 1, "'!!python/name:os.system'"),
    ("env: !!set {A}\n" + NODES, 1, "'!!set'"),
    ("workdir: !!str 5\n" + NODES, 1, "'!!str'"),
    ("workdir: !local x\n" + NODES, 1, "'!local'"),
    # keys
    ("? [a, b]\n: 1\n" + NODES, 1, "a key must be a plain string"),
    ("env: {1: x}\n" + NODES, 1, "key '1' is not a string"),
    (NODES + "true: x\n", 3, "key 'true' is not a string"),
    ("env: {A: '1', A: '2'}\n" + NODES, 1, "duplicate key 'A'"),
    ("x: &k a\n*k : 1\n" + NODES, 2, "an alias (*k) cannot be a key"),
    # aliases
    ("master_port: *nope\n" + NODES, 1, "alias *nope refers to no complete anchor"),
    ("env: &e {A: *e}\n" + NODES, 1, "alias *e refers to no complete anchor"),
    # nesting: the top mapping and `train` are two levels, so MAX_DEPTH - 1 lists are one too many
    ("train: {args: " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "}\n" + NODES, 1,
     f"nested more than {MAX_DEPTH} levels deep"),
    ("\n\nx: " + "[" * 10_000 + "\n", 3, f"nested more than {MAX_DEPTH} levels deep"),
    # characters
    ("workdir: a\x01b\n" + NODES, 1, "control character U+0001 at column 11"),
    ("workdir: \"a\\x01b\"\n" + NODES, 1, "holds U+0001"),
    ("nodes:\n  - {name: a, host: h1, workdir: \"/\u202ecod.exe\"}\n", 2, "U+202E (RIGHT-TO-LEFT OVERRIDE)"),
    ("", 1, "the inventory is empty"),
    ("# nothing but a comment\n", 1, "the inventory is empty"),
    (NODES + "---\n" + NODES, 3, "expected a single document"),
])
def test_refusals_name_the_line(text, line, needle):
    e = _err(text)
    assert needle in str(e), str(e)
    assert e.line == line and str(e).startswith(f"bad.yaml:{line}: "), str(e)
    assert e.exit_code == EXIT_USAGE and "\n\n" not in str(e) and len(str(e)) < 1024


def test_depth_at_the_limit_is_only_a_type_error():
    e = _err("train: {args: " + "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2) + "}\n" + NODES)
    assert "train.args" in str(e) and "nested" not in str(e)


def test_long_values_are_cut_and_escaped_in_messages():
    e = _err("nodes:\n  - {name: \"" + "x" * 5000 + "\\x1b[31m\", host: h1}\n")
    assert len(str(e)) < 300 and "..." in str(e) and "\x1b" not in str(e)


def test_many_errors_are_capped():
    text = "nodes:\n" + "".join(f"  - {{name: 'bad {i}', host: h{i}}}\n" for i in range(50))
    e = _err(text)
    assert str(e).count("\n") == 10 and "and 40 more" in str(e)


def test_env_and_args_numbers_are_the_text_as_written():
    inv = parse_inventory("env: {A: 010, B: 1.10, C: 0x1F, D: '7'}\ntrain: {args: [--lr, 0.0010, --n, 08]}\n"
                          + NODES)
    assert inv.env == {"A": "010", "B": "1.10", "C": "0x1F", "D": "7"}
    assert inv.train.args == ["--lr", "0.0010", "--n", "08"]


def test_merge_keys_and_modest_aliases_still_work():
    inv = parse_inventory("ssh: &s {user: train, port: 2222}\n"
                          "env: &e {A: '1'}\n"
                          "nodes:\n"
                          "  - {name: a, host: h1, env: *e}\n"
                          "  - {name: b, host: h2, ssh: {<<: *s, port: 2200}, env: {<<: *e, B: x}}\n")
    a, b = inv.nodes
    assert a.env == {"A": "1"} and b.env == {"A": "1", "B": "x"}
    assert (a.ssh.port, b.ssh.port, b.ssh.user) == (2222, 2200, "train")


def test_node_count_limit():
    text = "nodes:\n" + "".join(f"  - {{name: n{i}, host: h{i}}}\n" for i in range(4097))
    e = _err(text)
    assert "nodes: List should have at most 4096 items" in str(e)


def test_a_key_with_a_control_character_is_quoted_in_the_message():
    """Found by the inventory fuzzer: `ssh: {"i<TAB>dentity_file": x}` printed the tab raw in the key
    path, so the message was not one printable paragraph."""
    with pytest.raises(InventoryError) as e:
        parse_inventory('nodes:\n  - {name: a, host: 10.0.0.1}\nssh:\n  "i\\tdentity_file": x\n', "inv.yaml")
    msg = str(e.value)
    assert msg.isprintable() and "ssh.'i\\tdentity_file'" in msg, repr(msg)


def test_a_libyaml_that_caps_nesting_itself_gives_the_same_refusal(monkeypatch):
    """CI's libyaml stops `[[[[…` in its scanner ("exceeded maximum nesting depth") before the
    event walk counts level 33; this machine's does not. Both must say the same thing."""
    import yaml

    from orchestrator.inventory import read

    def capped(text, Loader):
        mark = yaml.Mark("bad.yaml", 0, 2, 1003, None, None)
        raise yaml.scanner.ScannerError(None, None, "exceeded maximum nesting depth", mark,
                                        None)
        yield  # a generator, like yaml.parse

    monkeypatch.setattr(read.yaml, "parse", capped)
    e = _err("\n\nx: " + "[" * 2000 + "\n")
    assert f"nested more than {MAX_DEPTH} levels deep" in str(e) and ":3:" in str(e), str(e)


def scalar_bomb(value_bytes: int, copies: int) -> str:
    """One long scalar anchored under env, aliased `copies` times: a small file that expands to
    value_bytes x copies of text (the models would hold every copy, a node's command line too)."""
    head = f"nodes:\n  - {{name: n1, connection: local}}\nenv:\n  A: &a {'x' * value_bytes}\n"
    return head + "".join(f"  K{i}: *a\n" for i in range(copies))


@pytest.mark.parametrize("value_bytes,copies,needle", [
    (500_000, 1_000, "a value of 500,000 bytes"),
    (500_000, 10_000, "a value of 500,000 bytes"),
    (100_000, 1_000, "alias *a expands the document past 4 MiB of text"),
    (1_000, 10_000, "alias *a expands the document past 4 MiB of text"),
])
def test_a_long_scalar_aliased_many_times_is_refused_by_its_length(worker, tmp_path, value_bytes, copies, needle):
    p = tmp_path / "bomb.yaml"
    p.write_text(scalar_bomb(value_bytes, copies))
    r = worker.check(p, timeout=2.0)  # the worker runs under its 256 MiB cap
    assert r["rc"] == EXIT_USAGE, r
    assert needle in r["err"] and r["err"].startswith(f"clusterctl: error: {p}:"), r["err"]
    assert len(r["err"].encode()) < 1024, r["err"]


@pytest.mark.parametrize("command", [["inventory", "check"], ["train", "--skip-preflight"]])
def test_a_scalar_alias_bomb_ends_train_with_exit_2_in_a_small_process(tmp_path, command):
    """The bomb of the issue (0.5 MB aliased 10,000 times: ~5 GB expanded) in a fresh process: exit 2,
    and the process never grew past 100 MB (its peak RSS as the kernel counts it)."""
    p = tmp_path / "inv.yaml"
    p.write_text(scalar_bomb(500_000, 10_000))
    # a fresh parent whose only child is the CLI: its RUSAGE_CHILDREN peak is the CLI's own
    measure = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print('peak-kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
               "sys.exit(r.returncode)")
    r = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "orchestrator.cli", *command, "-i", str(p)],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, CLUSTERCTL_HOME=str(tmp_path / "home")))
    assert r.returncode == EXIT_USAGE, r.stderr
    assert "a value of 500,000 bytes" in r.stderr and "Traceback" not in r.stderr
    peak_kib = int(r.stderr.split("peak-kib ")[1].split()[0])
    assert peak_kib < 100 * 1024, f"the CLI's peak RSS was {peak_kib} KiB"
