"""remote/common.py: the node side's shared rules, written once, imported by every program of the
node code (one package: probe.node_code) and by the control side (probe.common)."""

import ast
import hashlib
import io
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from orchestrator import probe
from orchestrator.runs import policy
from orchestrator.runs.ckpt import given_home as checkpoints

REMOTE = Path(probe.__file__).resolve().parent / "remote"
# every module of the node code but common.py: a program (one with a `main`, started by the boot
# line) or a module of one (node_agent's agent_*.py, ckptdir's, nodeinfo's, relay's)
MODULES = sorted(p.stem for p in REMOTE.glob("*.py") if p.stem not in (probe.COMMON, "__init__"))


def _has_main(path: Path) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in ast.parse(path.read_text()).body)


PROGRAMS = [m for m in MODULES if _has_main(REMOTE / f"{m}.py")]


# ------------------------------------------------------------------ (a) written once


def _defined(path: Path) -> dict[str, int]:
    """Top-level names a file defines (functions, classes, assignments) -> line."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node.lineno
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out[n.id] = node.lineno
    return out


def _calls(node: ast.AST, *names: str) -> list[ast.Call]:
    """Calls under node of a function or method named one of `names` (`f(...)`, `x.f(...)`)."""
    return [c for c in ast.walk(node) if isinstance(c, ast.Call) and
            (c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", None)) in names]


def _own_rules(path: Path) -> list[str]:
    """What a program writes itself that common.py holds, function by function: a tar member
    rule (a member's name checked for "/" or "..", or TarFile.extract called directly), a sha256
    fed piece by piece (hashlib.sha256() with nothing in it: a file's or a stream's), an atomic
    write (a ".tmp" name renamed into place), a /proc scan of environments (/proc/PID/environ
    opened); and anywhere, a checkpoint name pattern (a regex of ckpt_ names)."""
    tree = ast.parse(path.read_text())
    found = [f"{path.name}:{c.lineno}: a checkpoint name pattern" for c in ast.walk(tree)
             if isinstance(c, ast.Constant) and isinstance(c.value, str) and "ckpt_" in c.value and "\\d" in c.value]
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        where = f"{path.name}:{fn.lineno} {fn.name}"
        text = {c.value for c in ast.walk(fn) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        names_checked = any(isinstance(a, ast.Attribute) and a.attr == "name" for a in ast.walk(fn))
        tar_calls = [c for c in _calls(fn, "extract", "extractall", "extractfile") if isinstance(c.func, ast.Attribute)]
        if any(c.func.attr != "extractfile" for c in tar_calls) or (tar_calls and names_checked and
                                                                    text & {"/", "..", "/../"}):
            found.append(f"{where}: a tar member rule")
        if any(not c.args and isinstance(c.func, ast.Attribute) and getattr(c.func.value, "id", "") == "hashlib"
               for c in _calls(fn, "sha256")):
            found.append(f"{where}: its own sha256")
        if ".tmp" in text and _calls(fn, "replace", "rename"):
            found.append(f"{where}: an atomic write")
        if any("/environ" in ast.unparse(c) for c in _calls(fn, "open")):
            found.append(f"{where}: a /proc environment scan")
    return found


def test_no_program_writes_a_shared_rule_again():
    """Each shipped program, and each module of one, uses common.py's tar member rule, sha256,
    atomic write, marker scan, checkpoint names and stop grace: neither a helper of the same name
    nor a rule of its own."""
    shared = set(_defined(REMOTE / "common.py"))
    shared.discard("__doc__")
    again, own = [], []
    for name in MODULES:
        path = REMOTE / f"{name}.py"
        again += [f"{path.name}:{line}: {n} (common.py has it)" for n, line in _defined(path).items() if n in shared]
        own += _own_rules(path)
    assert not again, "defined again in a shipped program:\n" + "\n".join(again)
    assert not own, "a shared rule written again in a shipped program:\n" + "\n".join(own)


def test_the_check_for_rules_written_again_is_not_vacuous(tmp_path):
    """The rules the test above looks for, written the old way, are found."""
    old = tmp_path / "old.py"
    old.write_text('''
import hashlib, os, tarfile
def receive(tar, root):
    for m in tar:
        if m.name.startswith("/") or not (m.isfile() or m.isdir()):
            raise SystemExit("refusing")
        tar.extract(m, root)
def digest(path):
    h = hashlib.sha256()
    h.update(open(path, "rb").read())
    return h.hexdigest()
def save(path, text):
    tmp = path + ".tmp"
    open(tmp, "w").write(text)
    os.replace(tmp, path)
def pids(marker):
    return [p for p in os.listdir("/proc") if marker in open(f"/proc/{p}/environ", "rb").read()]
def write_atomic(path, text):
    pass
NAME = re.compile(r"^ckpt_(\\d{8})(\\.pt)?$")
''')
    found = " ".join(_own_rules(old))
    for what in ("a tar member rule", "its own sha256", "an atomic write", "a /proc environment scan",
                 "a checkpoint name pattern"):
        assert what in found
    assert "write_atomic" in _defined(old) and "write_atomic" in _defined(REMOTE / "common.py")


def test_the_control_side_takes_the_node_sides_grace_and_names():
    c = probe.common()
    assert policy.MAX_GRACE == c.MAX_GRACE == 300.0
    assert policy.stop_grace(5, 10) == c.stop_grace(5, 10) == 20 and policy.stop_grace(5, 1000) == 300.0
    assert policy.stop_grace(400, 1000) == 400.0 and policy.stop_grace(5) == 5.0
    assert checkpoints.MANIFEST == c.MANIFEST
    assert [c.checkpoint_step(n) for n in ("ckpt_00000012.pt", "ckpt_00000012", "ckpt_00000012.pt.sha256",
                                           "ckpt_0000012.pt", "ckpt_00000012.tmp", "ckpt_0000001x")] == \
        [12, 12, None, None, None, None]
    assert checkpoints.step_of("ckpt_00000007") == 7
    with pytest.raises(ValueError):
        checkpoints.step_of("ckpt_7")


# ------------------------------------------------------------------ (b) the tar member rule


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname = kind, link
    return m


@pytest.mark.parametrize("member", [
    _member("../x"), _member("a/../../x"), _member("/etc/x"), _member(""),
    _member("root", tarfile.SYMTYPE, "/"), _member("up", tarfile.SYMTYPE, "../.."),
    _member("dev", tarfile.CHRTYPE), _member("disk", tarfile.BLKTYPE), _member("fifo", tarfile.FIFOTYPE),
    _member("hard", tarfile.LNKTYPE, "/etc/passwd"),
], ids=lambda m: f"{m.name or 'empty'}-{m.type.decode() if m.type else 'reg'}")
def test_the_member_rule_refuses(member, tmp_path):
    assert not probe.common().tar_member_ok(member, str(tmp_path))


def test_the_member_rule_accepts_files_and_directories(tmp_path):
    ok = probe.common().tar_member_ok
    assert ok(_member("ckpt_00000001.pt"), tmp_path) and ok(_member("ckpt_00000002/__0_0.distcp"), tmp_path)
    assert ok(_member("ckpt_00000002", tarfile.DIRTYPE), tmp_path) and ok(_member("a/./b..c"), tmp_path)


def test_a_code_stream_keeps_its_links_but_nothing_lands_through_one(tmp_path):
    """links=True (sync's relay): a symbolic link ships as it is, wherever it points, but no later
    member is written through a link to outside the directory."""
    c = probe.common()
    (tmp_path / "root").symlink_to("/")
    assert c.tar_member_ok(_member("data", tarfile.SYMTYPE, "/"), tmp_path, links=True)
    assert not c.tar_member_ok(_member("root/etc/x"), tmp_path, links=True)
    assert not c.tar_member_ok(_member("dev", tarfile.CHRTYPE), tmp_path, links=True)


def test_extraction_refuses_before_anything_lands(tmp_path):
    """artifacts.py `receive`, as shipped: a tar with a link to / is refused, nothing is written."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"x" * 10
        info = tarfile.TarInfo("ckpt_00000001.pt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        tar.addfile(_member("evil", tarfile.SYMTYPE, "/"))
    r = subprocess.run(probe.local_argv("artifacts", "receive", str(tmp_path / "d")), input=buf.getvalue(),
                       capture_output=True, timeout=60)
    assert r.returncode != 0 and b"refusing tar member evil" in r.stderr
    assert os.listdir(tmp_path / "d") == []


# ------------------------------------------------------------------ (c) the marker scan


def test_the_marker_scan_skips_a_process_that_ends_mid_scan(monkeypatch):
    c = probe.common()
    env = dict(os.environ, CLUSTERCTL_TEST_MARK="m1")
    stays = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    goes = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"], env=env)
    real = os.listdir
    try:
        deadline = time.time() + 10
        while not os.path.exists(f"/proc/{zombie.pid}") or \
                open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.time() < deadline, "the zombie never ended"
            time.sleep(0.01)

        def listing(path):
            names = real(path)
            if path == "/proc":  # listed, then gone before its environ is read
                goes.kill()
                goes.wait()
                names.append("999999999")  # and one that never was there
            return names

        monkeypatch.setattr(os, "listdir", listing)
        found = c.marked_pids("CLUSTERCTL_TEST_MARK", lambda v: v == "m1")
        monkeypatch.setattr(os, "listdir", real)
        assert found == [stays.pid]
        assert c.marked_pids("CLUSTERCTL_TEST_MARK", lambda v: v == "m2") == []
    finally:
        for p in (stays, goes, zombie):
            p.kill()
            p.wait()


def test_the_marker_scan_reads_a_forked_ranks_padded_environment():
    """A rank forked from the warm interpreter shows the zygote's whole exec-time block where
    /proc/PID/environ reads it: its own variables, then ~200 KB of NULs. The scan finds its marker
    and reads its variables there (searched for, not split into ~200,000 items: a scan of such
    processes every few seconds took a tenth of a core per node in the goodput bench): the scan's
    memory at its peak, a count and no clock, stays within a few copies of the block, where a
    split's list alone takes 8 bytes for each of its ~200,000 NULs."""
    import tracemalloc

    c = probe.common()
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
        "from orchestrator.remote.warm_fork import own_environ\n"
        "own_environ({'CLUSTERCTL_TEST_MARK': 'm3', 'RANK': '2', 'EMPTY': ''})\n"
        "print('ok', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, CLUSTERCTL_WARM_PAD0="x" * 100_000, CLUSTERCTL_WARM_PAD1="x" * 100_000,
                 CLUSTERCTL_TEST_MARK="m0"))
    try:
        assert child.stdout.readline() == "ok\n"
        block = Path(f"/proc/{child.pid}/environ").read_bytes()
        assert len(block) > 200_000 and block.endswith(b"\0" * 1000) and b"m0" not in block
        tracemalloc.start()
        try:
            assert c.marked_pids("CLUSTERCTL_TEST_MARK", lambda v: v == "m3") == [child.pid]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 * len(block), (peak, len(block))
        assert c.marked_pids("CLUSTERCTL_TEST_MARK", lambda v: v == "m0") == []
        assert c.proc_environ(child.pid, ("RANK", "EMPTY", "PATH")) == {"RANK": "2", "EMPTY": ""}
    finally:
        child.kill()
        child.wait()


def test_an_environment_is_read_up_to_its_end_not_through_a_forks_padding(monkeypatch):
    """A forked rank's /proc/PID/environ is ~200 KB: its variables, then NULs. The scan reads up to
    the first two NULs in a row, a chunk at a time, wherever the chunks split them; a plain block
    (one NUL at its end) is read whole."""
    import io

    c = probe.common()

    class Counted(io.RawIOBase):
        def __init__(self, data):
            self.data, self.pos, self.read_bytes = data, 0, 0

        def read(self, n=-1):
            got = self.data[self.pos:self.pos + n]
            self.pos += len(got)
            self.read_bytes += len(got)
            return got

    mine = b"A=1\0RANK=2\0CLUSTERCTL_RUN_KEY=r.a1@n\0"
    padded = Counted(mine + b"\0" * 200_000)
    assert c.environ_of(padded) == mine and padded.read_bytes == c.ENV_READ
    monkeypatch.setattr(c, "ENV_READ", 7)  # the two NULs split across reads, anywhere
    for cut in range(1, 8):
        monkeypatch.setattr(c, "ENV_READ", cut)
        assert c.environ_of(Counted(mine + b"\0" * 50)) == mine, cut
    plain = Counted(b"A=1\0B=\0")
    assert c.environ_of(plain) == b"A=1\0B=\0"
    assert c.env_values(c.environ_of(Counted(mine + b"\0" * 99)), "RANK") == ["2"]


def test_an_environment_block_is_searched_for_each_value_of_a_name():
    c = probe.common()
    block = b"A=1\0MARK=r@n\0B=x=y\0XA=2\0MARK=again\0" + b"\0" * 5000
    assert c.env_values(block, "MARK") == ["r@n", "again"]
    assert c.env_values(block, "B") == ["x=y"] and c.env_values(block, "A") == ["1"]
    assert c.env_values(block, "X") == [] and c.env_values(b"", "A") == [] and c.env_values(b"A=1", "A") == ["1"]


# ------------------------------------------------------------------ (d) every program runs as shipped


def _run(name: str, *args: str, cwd: Path, stdin: bytes = b"", flags=()) -> subprocess.CompletedProcess:
    """The program as a node runs it: the boot line, the node code, the program's name."""
    return subprocess.run(probe.local_argv(name, *args, flags=flags), input=stdin, cwd=cwd,
                          env=dict(os.environ, HOME=str(cwd)), capture_output=True, timeout=60)


def _cheapest(tmp_path: Path) -> dict[str, tuple[tuple[str, ...], bytes]]:
    """Each program's cheapest verb: its arguments and a piece of its answer."""
    return {
        "node_agent": (("live",), b"[]"),
        "artifacts": (("held", str(tmp_path / "none"), str(tmp_path / "none")), b'"own": []'),
        "ckptdir": (("look", str(tmp_path / "none"), str(tmp_path / ".pending"), "2", "0", "-"), b'"entries": {}'),
        "relay": (("changed", str(tmp_path / "wd")), b"changed 0 0"),
        "nodeinfo": (("info", "-"), b'"python"'),
        "pyenv": (("probe", str(tmp_path / "venv"), str(tmp_path)), b'"venv": "absent"'),
        "portlisten": (("0", "1", "0"), b"listening"),
        "netprobe": (("serve", "0", "0.2"), b"listening"),
        "drill": (("left", "no-such-run"), b'{"pids": []}'),
        "warm": (("check", "no-such-run", "n1"), b'{"serving": false, "importing": false}'),
    }


def test_every_shipped_program_runs_from_the_node_code(tmp_path):
    """Each program's cheapest verb, run from the node code as a node runs it."""
    cheapest = _cheapest(tmp_path)
    assert sorted(cheapest) == PROGRAMS, "a shipped program (a module with a main) without a check here"
    assert len(PROGRAMS) < len(MODULES) and "node_agent" in PROGRAMS and "agent_waiter" not in PROGRAMS
    for name, (args, want) in cheapest.items():
        r = _run(name, *args, cwd=tmp_path, flags=("-S",) if name == "nodeinfo" else ())
        assert r.returncode == 0 and want in r.stdout, (name, r.stdout[-500:], r.stderr[-2000:])


def test_a_programs_modules_are_compiled_once_even_where_bytecode_is_off(tmp_path):
    """The boot writes the package's bytecode beside it even where PYTHONDONTWRITEBYTECODE is set
    (the directory is clusterctl's), but only while it imports the program: a module of the
    package imported later, inside a verb, would be compiled again on every start on such a node.
    Each program's cheapest verb, and the agent's verbs whose modules are their own (status,
    claims, snapshot) and nodeinfo's info, run from a fresh copy of the code with bytecode off:
    every module of the package each one imported has its bytecode there. (tail's stream alone
    imports agent_stream.py and artifacts.py when it starts: tarfile costs every other verb
    milliseconds, a stream starts once per node and attempt.)"""
    _, data = probe.node_code()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(tmp_path / "code")
    cache = tmp_path / "code" / probe.PACKAGE / "__pycache__"
    runs = [(name, args, b"") for name, (args, _) in _cheapest(tmp_path).items()] + [
        ("node_agent", ("status", "none@n1"), b""), ("node_agent", ("claims",), b""),
        ("node_agent", ("snapshot", "none@n1", "1", "0"), b""), ("nodeinfo", ("info", str(tmp_path)), b"")]
    checked = set()
    for name, args, stdin in runs:
        argv = [sys.executable, *(("-S",) if name == "nodeinfo" else ()), "-X", "importtime", "-c", probe.BOOT,
                str(tmp_path / "code"), name, *args]
        r = subprocess.run(argv, input=stdin, cwd=tmp_path, capture_output=True, timeout=60,
                           env=dict(os.environ, HOME=str(tmp_path), PYTHONDONTWRITEBYTECODE="1"))
        assert r.returncode == 0, (name, args, r.stderr[-2000:])
        imported = set(re.findall(rf"\| +{probe.PACKAGE}\.(\w+)$", r.stderr.decode(), re.M))
        assert name in imported, (name, r.stderr[-500:])
        cached = {p.name.split(".")[0] for p in cache.glob("*.pyc")} if cache.is_dir() else set()
        assert imported <= cached, f"{name} {args[0]}: compiled on every start: {sorted(imported - cached)}"
        checked |= imported
    assert {"agent_tail", "agent_claims", "agent_snapshot", "pyfacts", "ckpt_capture", "relay_gate"} <= checked


def test_every_name_a_program_uses_is_defined_or_imported():
    """pyflakes over each module of the node code: what a module calls it defines or imports."""
    from pyflakes.api import check
    from pyflakes.reporter import Reporter

    for name in [*MODULES, probe.COMMON]:
        out = io.StringIO()
        check((REMOTE / f"{name}.py").read_text(), name, Reporter(out, out))
        undefined = [ln for ln in out.getvalue().splitlines() if "undefined name" in ln]
        assert not undefined, undefined


def test_the_node_code_holds_the_same_files_the_control_side_imports():
    """The nodes run the package the control side imports: the same files, byte for byte, the mark
    of a whole copy last, and the same sources always give the same tar and hash."""
    h, data = probe.node_code()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
        assert {(m.mtime, m.uid, m.uname) for m in tar.getmembers()} == {(1_577_836_800, 0, "")}
    assert members[-1] == (f"{probe.PACKAGE}/{probe.COMPLETE}", b"")
    assert dict(members[:-1]) == {f"{probe.PACKAGE}/{p.name}": p.read_bytes() for p in REMOTE.glob("*.py")}
    ni = probe.load_nodeinfo()
    assert Path(ni.__file__) == REMOTE / "nodeinfo.py" and ni.sha256_file is probe.common().sha256_file
    assert h == hashlib.sha256(data).hexdigest()[:20] and len(h) == 20
    assert probe.node_code_path() == f"{probe.CACHE}/{h}"


def test_missing_node_code_is_said_with_its_own_exit_code(tmp_path):
    """The boot line on a node without the code: exit probe.MISSING_EXIT and probe.MISSING on
    stderr, which node/form.py `missing` reads (and then places the code again)."""
    r = subprocess.run([sys.executable, "-S", "-c", probe.BOOT, str(tmp_path / "gone"), "nodeinfo", "info", "-"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == probe.MISSING_EXIT and r.stderr.startswith(probe.MISSING) and r.stdout == ""


def test_a_stop_signal_reaches_a_marked_relay(tmp_path):
    """relay.py `stop XFER` as shipped: its processes are found by CLUSTERCTL_XFER and ended."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               env=dict(os.environ, CLUSTERCTL_XFER="x1"))
    try:
        r = _run("relay", "stop", "x1", str(tmp_path), cwd=tmp_path, stdin=b"")
        assert r.returncode == 0 and b"stopped 1" in r.stdout, r.stderr
        assert sleeper.wait(10) == -signal.SIGTERM
    finally:
        sleeper.kill()
        sleeper.wait()
