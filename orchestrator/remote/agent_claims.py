"""The node agent's claims: `claim`, `release` and `claims` over ~/.clusterctl/claims/NODE, one run
at a time on a node, held by every attempt of it and stale once they ended (claim_stale).
"""
import json
import os
import sys
import time

from .agent_base import BASE, read, run_pids
from .common import ARTIFACTS, safe_name, split_key, write_atomic

CLAIMS = os.path.expanduser("~/.clusterctl/claims")
CLAIM_START_S = 900  # a claim whose run started nothing on the node is held this long after it was taken or
# renewed (preflight, restore, a spare's preparation), unless the controller releases it first


def node_name_ok(name):
    if not safe_name(name):
        sys.exit("bad node name")
    return os.path.join(CLAIMS, name)


def family(key):
    """match(k) for the run keys of `key`'s run on its node: RUN@NODE and every attempt RUN.aK@NODE."""
    run, _, node = key.rpartition("@")

    def match(k):
        r, what, at = split_key(k)
        return at == node and r == run and what != "warm"  # the warm interpreter holds no claim up

    return match


def claim_stale(doc):
    """A claim is stale once no process of its run (any attempt) is left on this node, and either
    every attempt that ran here ended after the claim was last renewed (the controller renews it
    as each attempt begins, so one ended before the next starts is still held), or nothing ran
    here within CLAIM_START_S of the renewal (a node claimed and then lost or left out, whose
    release never reached it)."""
    key = doc.get("key", "")
    if not key or "/" in key:
        return False
    mine = family(key)
    if run_pids(key, mine):
        return False
    renewed = max(float(doc.get("since") or 0), float(doc.get("renewed") or 0))
    ran = [os.path.join(BASE, k) for k in (os.listdir(BASE) if os.path.isdir(BASE) else ()) if mine(k)]
    ends = [ended_at(d) for d in ran]
    if ends and all(e is not None for e in ends) and max(ends) >= renewed:
        return True
    return time.time() - renewed > CLAIM_START_S


def ended_at(d):
    """When the run in directory d ended, by this node's clock (the waiter's `ended`, else when its
    exit code was written: a file's mtime is the file server's clock on a shared home); None
    while it has no exit code."""
    try:
        written = os.path.getmtime(os.path.join(d, "exit_code"))
    except OSError:
        return None
    try:
        return float(read(os.path.join(d, "ended"), "") or written)
    except ValueError:
        return written


def _locked_claim(path):
    """Hold the node's claim lock; yields the claim held now ({} when none or unreadable)."""
    import contextlib
    import fcntl

    @contextlib.contextmanager
    def held():
        with open(path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                doc = json.loads(read(path, "") or "{}")
            except ValueError:
                doc = {}
            yield doc

    return held()


def claim(node, key, who, extra=None):
    """Take the node for run KEY, or renew the run's own claim (a new attempt begins here). Check
    and write happen under an exclusive lock on the node, so of two claims at once exactly one
    wins; a stale claim is replaced. `extra(ok)`: more of the answer's fields, asked for once the
    claim is decided and its lock let go (node_agent.py `claim ... live dirs`)."""
    path = node_name_ok(node)
    os.makedirs(CLAIMS, mode=0o700, exist_ok=True)
    with _locked_claim(path) as held:
        if held and held.get("key") != key and not claim_stale(held):
            doc = {"ok": False, **held}
        else:
            if held.get("key") != key:
                held = {"run": key.split("@")[0], "key": key, "who": who, "since": time.time()}
            else:
                held["renewed"] = time.time()
            write_atomic(path, json.dumps(held))
            doc = {"ok": True, **held}
    print(json.dumps({**doc, **(extra(doc["ok"]) if extra is not None else {})}))


def release(node, key, dirs=False):
    """Drop the node's claim if run KEY holds it. With `dirs`, the run's artifact directories
    (common.py run_dirs, made by its claim) are removed too where they are empty: a launch refused
    on another node leaves nothing of itself here; a directory holding anything stays."""
    path = node_name_ok(node)
    released = False
    if os.path.isdir(CLAIMS):
        with _locked_claim(path) as held:
            if held.get("key") == key:
                os.unlink(path)
                released = True
    run = key.rpartition("@")[0]
    if dirs and released and safe_name(run):
        top = os.path.join(ARTIFACTS, run)
        for d in [os.path.join(top, sub) for sub in ("checkpoints", "tensorboard", "replicas")] + [top]:
            try:
                os.rmdir(d)  # only an empty directory: a checkpoint or a log in it keeps it
            except OSError:
                pass
    print(json.dumps({"released": released}))


def claims():
    out = {}
    for name in sorted(os.listdir(CLAIMS)) if os.path.isdir(CLAIMS) else []:
        if name.endswith(".lock") or name.startswith(".") or ".tmp" in name:
            continue
        try:
            doc = json.loads(read(os.path.join(CLAIMS, name), "") or "{}")
        except ValueError:
            continue
        if doc:
            out[name] = dict(doc, stale=claim_stale(doc))
    print(json.dumps(out))
