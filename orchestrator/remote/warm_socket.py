"""The warm interpreter's socket (warm.py): bound in its directory (a socket path is short), from
the interpreter's start where none serves the run on the node yet, marked IMPORTING until the
imports end (a rank that asks meanwhile waits: warm_client.py)."""
import os
import socket
import time

from .warm_client import mark_of

STALE_S = 60.0  # a run's directory untouched this long, nobody listening, no live importer: a dead one's


def bound(path):
    """(a socket listening as `path`, bound from its directory (a socket path is short), the
    inode of its name); a stale one of that name is replaced."""
    here, name = os.path.split(path)
    back = os.open(".", os.O_RDONLY)
    try:
        os.chdir(here)
        if os.path.exists(name):
            os.unlink(name)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(name)
        os.chmod(name, 0o600)
        listener.listen(64)
        ino = os.stat(name).st_ino
    finally:
        os.fchdir(back)
        os.close(back)
    return listener, ino


def answers(path):
    """A warm interpreter listens on `path` now."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(2)
        here, name = os.path.split(path)
        fd = os.open(here, os.O_RDONLY)
        try:
            s.connect(f"/proc/self/fd/{fd}/{name}")
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        s.close()


def early_socket(path):
    """Where no warm interpreter serves the run here yet, the socket listens before the imports,
    marked IMPORTING (this pid): a rank that asks meanwhile waits for them to end (warm_client.py
    IMPORT_WAIT_S) rather than import torch again beside them: (the socket, its name's inode).
    Where one serves (this one is an adopting supervisor's), it goes on serving until this one has
    imported: None."""
    if answers(path):
        return None
    mark = mark_of(path)
    tmp = "%s.%d" % (mark, os.getpid())
    with open(tmp, "w") as f:
        f.write("%d\n" % os.getpid())
    os.replace(tmp, mark)
    return bound(path)


def imported(path):
    """The imports ended: the IMPORTING mark taken away, if it is still this one's."""
    try:
        with open(mark_of(path)) as f:
            if f.read().strip() == str(os.getpid()):
                os.unlink(mark_of(path))
    except OSError:
        pass


def gone(early, path):
    """No warm interpreter after all: the early socket closed (its askers start cold) and its name
    taken away, if still its own."""
    if early is not None:
        listener, ino = early
        try:
            if os.stat(path).st_ino == ino:
                os.unlink(path)
        except OSError:
            pass
        listener.close()
    return None



def sweep(base, now=None):
    """What warm interpreters that died without cleaning up (killed while importing, say) left under
    `base` (one directory per run): removed where the directory is untouched for STALE_S, nobody
    listens on its socket and its IMPORTING mark names no live process (one starting binds its
    socket within moments of making its directory). -> the names of the directories removed."""
    now = time.time() if now is None else now
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    out = []
    for d in names:
        here = os.path.join(base, d)
        path = os.path.join(here, "sock")
        try:
            if now - os.stat(here).st_mtime < STALE_S:
                continue
        except OSError:
            continue
        if _importer_alive(path) or answers(path):
            continue
        for f in (path, mark_of(path)):
            try:
                os.unlink(f)
            except OSError:
                pass
        try:
            os.rmdir(here)
            out.append(d)
        except OSError:
            pass
    return out


def _importer_alive(path):
    """The IMPORTING mark beside `path` names a process that is alive."""
    try:
        with open(mark_of(path)) as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
        return True
    except PermissionError:
        return True
    except (OSError, ValueError):
        return False
