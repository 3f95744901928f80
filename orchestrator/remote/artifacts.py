"""A run's files on a node, for the control machine to copy: shipped on stdin, stdlib only, with
remote/common.py in front of it (probe.py `program`): the checkpoint names and marks, the tar
member rule and safe_name come from there.

A run keeps what must outlive a node under ~/.clusterctl/artifacts/RUN_ID/ on every node:
checkpoints/ (CLUSTERCTL_CHECKPOINT_DIR) and tensorboard/ (CLUSTERCTL_TENSORBOARD_DIR), each
level 0700 (0750 under share_with_group: common.py private_files, own_dir).

  prepare RUN_ID            create both directories; print {"checkpoints": ABS, "tensorboard": ABS,
                            "replicas": ABS} (replicas/SOURCE/: other nodes' checkpoints kept here)
  held DIR REPLICAS         the checkpoint list (see poll) of DIR and of each REPLICAS/SOURCE, as
                            {"own": [...], "replicas": {SOURCE: [...]}}
  prune DIR KEEP            remove all but the newest KEEP checkpoints in DIR
  send DIR NAME...          write an uncompressed tar of those checkpoints (and .sha256 files) to stdout
  receive DIR               read a tar from stdin; each top-level entry lands under its name
                            atomically (extracted beside it, then renamed over what was there)
  poll DIR TBDIR OFFSETS_HEX one process per node and poll; first one line, the completed
                            checkpoints in DIR as JSON, newest first ([] for DIR "-"):
                            [{"name", "step", "kind": "file"|"dir", "files": [[rel, size], ...]}]
                            a file counts once its .sha256 sits next to it (written before the
                            file is renamed into place), a directory once it has its final name;
                            a directory's entry adds "manifest": the names its MANIFEST.sha256 lists.
                            Then every file under TBDIR past the offset the control machine already
                            has ({rel: offset} as hex JSON), as frames: a JSON header line
                            {"rel", "offset", "size"} then `size` bytes
  (no command)              imported by the node agent's stream (agent_stream.py): `tail KEY OFFSET stream`
                            runs `stream_records` every SCAN_S s in its one process (records: see
                            `frame`; kinds FRAME_*), so no poll process is started while a run trains;
                            the same stream carries the ranks' progress for the straggler watch
                            (FRAME_PROGRESS, agent_stream.py Stream), so no snapshot process either
  pack RUN_ID REL KEY...    an uncompressed tar on stdout of the run's artifacts (REL: one relative
                            path inside them, - for all) as artifacts/..., and of each node-runs
                            directory KEY (RUN_ID@NODE, one per attempt) as node-runs/KEY/...;
                            regular files only, what is missing is left out
  tree SPEC                 an uncompressed tar on stdout of one path and everything under it:
                            files, directories (empty ones too) and symbolic links as links
                            (`cp`, `fetch RUN PATH`). SPEC is JSON, either {"path": P, "name": N}:
                            P (`~` is this user's home) sent as N; or {"path": P, "run": RUN_ID,
                            "workdir": W}: a relative P is looked for in the run's artifacts, then
                            in W, and sent as artifacts/REL, workdir/REL or home/REL after the
                            first of those that holds it (links in its parents resolved), one
                            outside all three refused. Exit TREE_MISSING when P does not exist,
                            TREE_OUTSIDE when it lies outside
"""
import json
import os
import shutil
import sys
import tarfile

from .common import (
    MANIFEST, NODE_RUNS, SIDECAR, checkpoint_kind, checkpoint_parts, checkpoint_step, extract_member,
    ARTIFACTS, private_files, run_dirs, safe_name, tar_member_ok,
)

BASE = ARTIFACTS
CHUNK = 1 << 20
SCAN_S = 2.0  # how often a node's stream looks for new checkpoints and TensorBoard bytes
# the kinds of record on a node's stream (orchestrator/node/artifacts.py `Frames` reads the same names)
FRAME_LOG, FRAME_TB, FRAME_CKPTS, FRAME_PROGRESS, FRAME_END = "log", "tb", "ckpts", "progress", "end"
FRAME_STOPPING = "stopping"  # a stop asked on the stream's stdin was taken (agent_stream.py Stream.listen)
FRAME_SNAPSHOT = "snapshot"  # a snapshot asked on the stream's stdin: every rank's (agent_stream.py Stream.listen)
FRAME_CLOCK = "clock"  # the node's clock when it read a clock request on the stream's stdin (same)
TREE_MISSING, TREE_OUTSIDE = 4, 5  # `tree`'s exit codes (the control side loads this file for them)


def prepare(run_id):
    print(json.dumps(run_dirs(run_id)))


def _files(root, rel=""):
    """[[rel, size]] of the regular files under root/rel, sorted."""
    out = []
    top = os.path.join(root, rel)
    if os.path.isfile(top):
        return [[rel, os.path.getsize(top)]]
    for d, dirs, names in os.walk(top):
        dirs.sort()
        for n in sorted(names):
            p = os.path.join(d, n)
            if os.path.isfile(p) and not os.path.islink(p):
                out.append([os.path.relpath(p, root), os.path.getsize(p)])
    return out


def _ckpts(d):
    found = []
    for name in os.listdir(d) if os.path.isdir(d) else []:
        kind = checkpoint_kind(d, name)
        if kind is None:
            continue
        files = [f for part in checkpoint_parts(name) for f in _files(d, part)]
        found.append({"name": name, "step": checkpoint_step(name), "kind": kind, "files": files})
        if kind == "dir":
            found[-1]["manifest"] = _manifest(os.path.join(d, name))
    found.sort(key=lambda c: c["step"], reverse=True)
    return found


def _manifest(path):
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return [line.rstrip("\n").split("  ", 1)[1] for line in f if "  " in line]
    except OSError:
        return []


def held(d, replicas):
    out = {"own": _ckpts(d), "replicas": {}}
    for src in sorted(os.listdir(replicas)) if os.path.isdir(replicas) else []:
        if safe_name(src) and os.path.isdir(os.path.join(replicas, src)):
            out["replicas"][src] = _ckpts(os.path.join(replicas, src))
    print(json.dumps(out))


def prune(d, keep):
    for c in _ckpts(d)[int(keep):]:
        path = os.path.join(d, c["name"])
        if c["kind"] == "dir":
            shutil.rmtree(path, ignore_errors=True)
        else:
            for p in reversed(checkpoint_parts(path)):  # the sidecar first: no longer complete
                if os.path.exists(p):
                    os.remove(p)
    print("ok")


def send(d, *names):
    background()
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|", bufsize=CHUNK) as tar:  # 1 MiB writes, not 10 KiB
        for name in names:
            if checkpoint_step(name) is None:
                sys.exit("not a checkpoint name: " + name)
            for rel in checkpoint_parts(name):
                if os.path.exists(os.path.join(d, rel)):
                    tar.add(os.path.join(d, rel), arcname=rel)


def background():
    """Copies run beside the training: lowest CPU priority, and idle I/O class where Linux has it."""
    try:
        os.nice(19)
        import ctypes

        # ioprio_set(IOPRIO_WHO_PROCESS, this process, IOPRIO_CLASS_IDLE << 13)
        nr = {"x86_64": 251, "aarch64": 30, "ppc64le": 273}.get(os.uname().machine)
        if nr is not None:
            ctypes.CDLL(None, use_errno=True).syscall(nr, 1, 0, 3 << 13)
    except (OSError, AttributeError):
        pass


def receive(d):
    os.makedirs(d, exist_ok=True)
    stage = os.path.join(d, ".receive.%d" % os.getpid())
    os.makedirs(stage)
    try:
        with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
            for member in tar:
                if not tar_member_ok(member, stage):
                    sys.exit("refusing tar member " + member.name)
                extract_member(tar, member, stage)
        for name in sorted(os.listdir(stage), key=lambda n: n.endswith(SIDECAR), reverse=True):
            # a checksum before its file: the trainer never sees a file without its .sha256
            dst = os.path.join(d, name)
            if os.path.isdir(dst) and not os.path.islink(dst):
                shutil.rmtree(dst)
            os.replace(os.path.join(stage, name), dst)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    print("ok")


def pack(run_id, rel, *keys):
    if not safe_name(run_id) or not all(safe_name(k) for k in keys):
        sys.exit("bad run id or key")
    parts = [] if rel == "-" else rel.split("/")
    if rel != "-" and (rel.startswith("/") or ".." in parts or not rel.strip("/")):
        sys.exit("bad path: " + rel)
    root = os.path.join(BASE, run_id)
    todo = []
    if os.path.exists(os.path.join(root, *parts)):
        todo += [(os.path.join(root, r), "artifacts/" + r) for r, _ in _files(root, "/".join(parts))]
    if rel == "-":
        for key in keys:
            d = os.path.join(NODE_RUNS, key)
            if os.path.isdir(d):
                todo += [(os.path.join(d, r), "node-runs/%s/%s" % (key, r)) for r, _ in _files(d)]
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
        for path, arcname in todo:
            try:
                tar.add(path, arcname=arcname, recursive=False)
            except OSError:
                continue  # gone since it was listed (a pruned checkpoint)


def _located(path, roots):
    """LABEL/REL of path under the first root that holds it (links in its parents resolved, the
    path itself never followed), or None."""
    where = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    for label, root in roots:
        root = os.path.realpath(os.path.expanduser(root))
        if where == root or where.startswith(root.rstrip("/") + "/"):
            rel = os.path.relpath(where, root)
            return label if rel == "." else label + "/" + rel
    return None


def _tree_source(s):
    """(path, name in the stream) for a `tree` SPEC; exits when there is none to send."""
    asked = s["path"]
    if "name" in s:
        tried, roots = [asked], None
    else:
        if not safe_name(s["run"]):
            sys.exit("bad run id")
        run_dir = os.path.join(BASE, s["run"])
        roots = [("artifacts", run_dir), ("workdir", s["workdir"]), ("home", "~")]
        tried = [asked] if asked.startswith(("/", "~")) else [os.path.join(run_dir, asked),
                                                               os.path.join(s["workdir"], asked)]
    found = [os.path.normpath(os.path.expanduser(p)) for p in tried if os.path.lexists(os.path.expanduser(p))]
    if not found:
        sys.stderr.write("no such file or directory: %s\n" % " or ".join(tried))
        sys.exit(TREE_MISSING)
    name = s["name"] if roots is None else _located(found[0], roots)
    if not name:
        sys.stderr.write("%s lies outside the run's artifacts, the workdir (%s) and the home directory\n"
                         % (found[0], s["workdir"]))
        sys.exit(TREE_OUTSIDE)
    return found[0], name


def tree(spec):
    path, name = _tree_source(json.loads(spec))
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|", bufsize=CHUNK) as tar:
        for p, arcname in _walk(path, name):
            tar.inodes.clear()  # each file whole, never a hard-link member (the reader takes none)
            try:
                tar.add(p, arcname=arcname, recursive=False)
            except OSError as e:
                sys.stderr.write("cannot read %s: %s\n" % (p, e.strerror or e))
                sys.exit(1)


def _walk(path, name):
    """(path, arcname) of path and, for a directory, everything under it in sorted order: files,
    directories and symbolic links (never followed); sockets, FIFOs and devices left out."""
    yield path, name
    if os.path.islink(path) or not os.path.isdir(path):
        return
    for d, dirs, files in os.walk(path):
        dirs.sort()
        rel = os.path.relpath(d, path)
        for n in sorted(dirs + files):
            p = os.path.join(d, n)
            if os.path.islink(p) or os.path.isdir(p) or os.path.isfile(p):
                yield p, name + "/" + (n if rel == "." else rel + "/" + n)


def frame(head, body):
    """One record: a JSON header line (`head` and "size") then `size` bytes of body."""
    return json.dumps(dict(head, size=len(body))).encode() + b"\n" + body


def new_bytes(d, have):
    """(rel, offset, bytes) of every file under d past the offset in `have` ({rel: offset}),
    which is moved on past what is returned."""
    for rel, size in _files(d) if os.path.isdir(d) else []:
        start = int(have.get(rel, 0))
        if size <= start:
            continue
        with open(os.path.join(d, rel), "rb") as f:
            f.seek(start)
            data = f.read(size - start)
        have[rel] = start + len(data)
        yield rel, start, data


def since(d, offsets_hex):
    have = json.loads(bytes.fromhex(offsets_hex).decode()) if offsets_hex != "-" else {}
    out = sys.stdout.buffer
    for rel, start, data in new_bytes(d, have):
        out.write(frame({"rel": rel, "offset": start}, data))
    out.flush()


def stream_records(d, tb, have, last):
    """What a node's stream owes since its last scan: the checkpoint list (as `poll` prints it)
    when it changed (`last` holds the one sent), then the TensorBoard frames past `have`."""
    out = []
    if d != "-":
        found = _ckpts(d)
        if found != last.get("ckpts"):
            last["ckpts"] = found
            out.append(frame({"t": FRAME_CKPTS}, json.dumps(found).encode()))
    for rel, start, data in new_bytes(tb, have):
        out.append(frame({"t": FRAME_TB, "rel": rel, "offset": start}, data))
    return out


def poll(d, tb, offsets_hex):
    sys.stdout.buffer.write(json.dumps(_ckpts(d) if d != "-" else []).encode() + b"\n")
    since(tb, offsets_hex)


def main(argv):
    private_files()
    cmd, args = argv[0], argv[1:]
    {"prepare": prepare, "held": held, "prune": prune, "send": send, "receive": receive, "poll": poll,
     "pack": pack, "tree": tree}[cmd](*args)
