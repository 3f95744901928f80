"""Where clusterctl keeps its state on the control machine: ~/.clusterctl, or $CLUSTERCTL_HOME.

runs/ holds the run records (orchestrator/runs/store.py), wheelhouse/ the environments `setup`
resolved (orchestrator/pyenv/resolve.py).

Who may read it: what clusterctl writes is the user's alone, directories 0700 and files 0600,
or with the inventory's `share_with_group: true` also readable by the user's group, 0750 and
0640. A process says so once, with its umask (`set_umask`): the CLI at its start, `train` once
it has read the inventory, the supervisor from its run's recorded inventory. The nodes follow
the same rule (remote/common.py `private_files`, whose constants these are).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

from orchestrator.probe import common


def home() -> Path:
    return Path(os.environ.get("CLUSTERCTL_HOME") or os.path.expanduser("~/.clusterctl"))


@contextlib.contextmanager
def locked(path: Path) -> Iterator[Path]:
    """Hold the exclusive lock of the state file `path` (its sibling NAME.lock, made with its
    directory when missing) until the block ends: processes that read, change and write the file
    under it (runs ending at once, a `clusterctl health --release`) never lose each other's
    changes. The lock is a file of its own so that the state file can be replaced by a rename
    while it is held. -> `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield path


def runs_dir() -> Path:
    return home() / "runs"


def set_umask(share_with_group: bool = False) -> int:
    """What this process creates from here on: 0700/0600, or 0750/0640 with share_with_group.
    Returns the umask it replaced."""
    return os.umask(common().umask_for(share_with_group))


USER_UMASK_ENV = "CLUSTERCTL_USER_UMASK"  # the user's umask (octal), as the clusterctl command found it


def hand_down_umask(umask: int) -> str | None:
    """Name the user's umask in this process's environment, unless a clusterctl process above did
    (the supervisor inherits it from `train`): a command run on a `connection: local` node starts
    with it, as an SSH session starts with the node's (`user_umask`). -> the variable's name when
    it was set here, else None."""
    if USER_UMASK_ENV in os.environ:
        return None
    os.environ[USER_UMASK_ENV] = f"{umask:03o}"
    return USER_UMASK_ENV


def users_env() -> dict[str, str]:
    """This process's environment without what clusterctl hands down to itself: what a command
    the user gave (a local node's, --notify's) starts with."""
    return {k: v for k, v in os.environ.items() if k != USER_UMASK_ENV}


def user_umask() -> int:
    """The user's umask as hand_down_umask named it; -1 (leave the umask as it is) when none was."""
    given = os.environ.get(USER_UMASK_ENV, "")
    return int(given, 8) & 0o777 if given and set(given) <= set("01234567") else -1


def own_runs_dir() -> Path:
    """runs/, made when missing, with the mode this process's umask gives (common.py `own_dir`): a
    runs/ an older clusterctl left 0755 is tightened, or opened to the group under
    share_with_group. The home above it is made the same way when missing; one that exists is
    the user's (CLUSTERCTL_HOME may name any directory) and only gains the group's search bit
    (g+x, no listing) when the group is to read the runs."""
    top = home()
    if not top.is_dir():
        common().own_dir(str(top))
    elif not common().current_umask() & 0o010 and top.stat().st_uid == os.getuid():
        top.chmod(top.stat().st_mode | 0o010)
    return Path(common().own_dir(str(runs_dir())))
