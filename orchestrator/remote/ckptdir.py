"""A job's own checkpoint directory on a node (`train --checkpoint-dir DIR`), for the control machine
to copy and restore: a program of the node code, stdlib only. This module holds the verbs' table
and prepare, send, restore, setaside and digest; an entry's files and completeness are
ckpt_entries.py's, look and forget ckpt_capture.py's, the snapshots kept on the nodes
ckpt_replicas.py's.

Whatever the job writes under DIR counts, any names and shapes (nanoGPT's ckpt.pt, a Trainer's
checkpoint-500/, DeepSpeed's global_step500/ and `latest`, a torch DCP directory). The unit is a
top-level entry of DIR. An entry is complete on this node when its writer has closed it: no process
of this user holds a file under it open for writing (/proc/PID/fdinfo's access mode) and nothing
under it changed while that was looked at (inotify over DIR's tree, and each file's inode, size,
mtime and ctime before and after); a directory also once nothing under it changed for SETTLE_S, or
at once when it was renamed into place after its files were written (its own ctime is newer than
everything under it). No mark from the script is needed. Regular files are carried; links, empty
directories and special files are not.

A complete version is captured at once into PENDING (beside the run's artifacts, out of the job's
reach): each changed file copied under the same watch and voided when the job writes it meanwhile,
so a file rewritten every second is taken between two saves and never torn, and the control side
then reads the capture at its own pace.

  prepare PATH              create PATH (with the user's own umask: it is the job's directory) and
                            print its absolute path
  look PATH PENDING SETTLE_S WAIT_S KEY
                            sample DIR (for up to WAIT_S while an entry is being written) and capture
                            each complete entry's changed files into PENDING. KEY: the attempt's run
                            key on this node (- for none): nothing is taken once a rank of it failed
                            or one of its processes ended (a writer killed mid-save leaves a torn
                            file that looks closed). Prints {"path": ABS, "entries": {NAME: {"files":
                            [[rel, size, mtime_ns]], "complete": bool, "writing": [rel]}}, "torn":
                            [rel], "guard": why nothing was taken or ""}; a complete entry's files
                            are in PENDING as listed (same size and mtime)
  forget PENDING            remove a look's captures
  send PATH                 stdin after the program: one JSON line [[rel, size, mtime_ns], ...]; an
                            uncompressed tar of those files on stdout. A file whose size or mtime
                            differs from the line, before or after it is read, ends the program with
                            CHANGED
  restore PATH ASIDE        stdin after the program: a tar of a checkpoint's entries. Unpacked
                            beside PATH first; then each entry of PATH that the checkpoint has is
                            replaced by it, and every other entry (a half-written checkpoint, files
                            the checkpoint never had) is moved into ASIDE, kept, out of the job's
                            way. Prints {"files": [[rel, size, mtime_ns]] (as written),
                            "aside": [NAME, ...]}
  setaside PATH ASIDE       every entry of PATH moved into ASIDE (a name ASIDE has already gets a
                            .N suffix): a run's checkpoints start from an empty DIR. Prints
                            {"path": ABS ASIDE, "aside": [NAME, ...] (moved now), "files": [[rel,
                            size, mtime_ns]] (all of ASIDE's, rel to it)}
  digest PATH               stdin after the program: JSON [[rel, size, mtime_ns]]. Prints {"files":
                            {rel: sha256}, "why": ""}, or "why" a file is missing or has changed

With train.copy_checkpoints false and train.checkpoint_replica true the snapshots stay on the nodes
(runs/ckpt/jobdir_replicas.py): each node freezes its part of a snapshot beside its run's artifacts, a
neighbour holds a replica, and a restore puts the parts together on every node:

  freeze PENDING ROOT NAME  stdin after the program: one JSON line {"files": [[rel, size, mtime_ns]],
                            "prev": {rel: [size, mtime_ns, SNAP, sha256]}}. Links those captures of
                            a look into ROOT/NAME/ (a file as it was in ROOT/SNAP, same size and
                            mtime, is linked from there), renamed into place once whole; exits
                            CHANGED when one is not as listed. Prints {rel: sha256}
  link ROOT NAME SNAP       stdin: a JSON list of rel: hard-links ROOT/SNAP/rel into ROOT/NAME/rel
                            where it exists (a replica's unchanged files). Prints the rels linked
  check ROOT NAME           stdin: JSON {rel: sha256}. Prints {"ok": bool, "why": str}: every file
                            of ROOT/NAME is there with its sha256
  keep ROOT NAMES           NAMES: JSON list. Removes every ROOT/*/snap-* not named (old snapshots)
  place PATH ASIDE STAGED   stdin: JSON {"files": {rel: sha256}, "from": {rel: ABS}}: the files
                            named in "from" (parts this node holds) are copied into STAGED beside
                            those other nodes sent there; every file is checked against its
                            sha256; then STAGED's entries go into PATH as `restore` does. Prints
                            what `restore` prints
"""
import json
import os
import shutil
import sys
import tarfile

from .ckpt_capture import PENDING, forget, look  # noqa: F401 - PENDING: the control side's, read here
from .ckpt_entries import CHANGED, CHUNK, STAGE, abs_path, as_listed, listing, move_aside, rel_ok, swap_in
from .ckpt_replicas import check, freeze, keep, link, place
from .common import extract_member, private_files, sha256_file, tar_member_ok, user_umask


def prepare(path):
    if user_umask() is not None:
        os.umask(user_umask())  # the job's directory: the user's umask, as if the job had made it
    path = abs_path(path)
    os.makedirs(path, exist_ok=True)
    print(json.dumps({"path": path}))


def send(path):
    root = abs_path(path)
    want = json.loads(sys.stdin.buffer.readline())
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|", bufsize=CHUNK) as tar:
        for rel, size, mtime_ns in want:
            p = os.path.join(root, rel)
            if ".." in rel.split("/") or rel.startswith("/") or not as_listed(p, size, mtime_ns):
                sys.stderr.write("changed: %s\n" % rel)
                sys.exit(CHANGED)
            tar.add(p, arcname=rel, recursive=False)
            if not as_listed(p, size, mtime_ns):
                sys.stderr.write("changed while read: %s\n" % rel)
                sys.exit(CHANGED)


def restore(path, aside):
    root = abs_path(path)
    os.makedirs(root, exist_ok=True)
    stage = os.path.join(root, "%s.%d" % (STAGE, os.getpid()))
    os.makedirs(stage)
    try:
        with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
            for member in tar:
                if not tar_member_ok(member, stage) or member.isdir():
                    sys.exit("refusing tar member " + member.name)
                extract_member(tar, member, stage)
        print(json.dumps(swap_in(root, stage, aside)))
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def setaside(path, aside):
    root, aside = abs_path(path), abs_path(aside)
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    moved = [move_aside(root, name, aside) for name in names if not name.startswith(STAGE)]
    print(json.dumps({"path": aside, "aside": moved, "files": listing(aside)}))


def digest(path):
    root, out = abs_path(path), {}
    for rel, size, mtime_ns in json.loads(sys.stdin.buffer.read()):
        p = os.path.join(root, rel)
        if not rel_ok(rel) or not as_listed(p, size, mtime_ns) or not os.path.isfile(p):
            print(json.dumps({"files": {}, "why": "%s is missing or has changed since it was set aside" % rel}))
            return
        out[rel] = sha256_file(p)
    print(json.dumps({"files": out, "why": ""}))


def main(argv):
    private_files()
    verbs = {"prepare": (prepare, 1), "look": (look, 5), "forget": (forget, 1), "send": (send, 1),
             "restore": (restore, 2), "freeze": (freeze, 3), "link": (link, 3), "check": (check, 2), "keep": (keep, 2),
             "place": (place, 3), "setaside": (setaside, 2), "digest": (digest, 1)}
    if not argv or argv[0] not in verbs or len(argv) - 1 != verbs[argv[0]][1]:
        sys.exit("usage: ckptdir.py prepare PATH | look PATH PENDING SETTLE_S WAIT_S KEY | forget PENDING | "
                 "send PATH | restore PATH ASIDE | freeze PENDING ROOT NAME | link ROOT NAME SNAP | check ROOT NAME | "
                 "keep ROOT NAMES | place PATH ASIDE STAGED | setaside PATH ASIDE | digest PATH")
    verbs[argv[0]][0](*argv[1:])
