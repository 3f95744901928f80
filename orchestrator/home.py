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

import os
from pathlib import Path

from orchestrator.probe import common


def home() -> Path:
    return Path(os.environ.get("CLUSTERCTL_HOME") or os.path.expanduser("~/.clusterctl"))


def runs_dir() -> Path:
    return home() / "runs"


def set_umask(share_with_group: bool = False) -> int:
    """What this process creates from here on: 0700/0600, or 0750/0640 with share_with_group.
    Returns the umask it replaced."""
    return os.umask(common().umask_for(share_with_group))


def hand_down_umask(umask: int) -> str | None:
    """Name the user's umask in this process's environment (common.py USER_UMASK_ENV), unless a
    clusterctl process above did: a job this process starts on a `connection: local` node gets it
    back instead of clusterctl's. -> the variable's name when it was set here, else None."""
    name = common().USER_UMASK_ENV
    if name in os.environ:
        return None
    os.environ[name] = f"{umask:03o}"
    return name


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
