"""Where clusterctl keeps its state on the control machine: ~/.clusterctl, or $CLUSTERCTL_HOME.

runs/ holds the run records (orchestrator/runs/store.py), wheelhouse/ the environments `setup`
resolved (orchestrator/pyenv/resolve.py).
"""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("CLUSTERCTL_HOME") or os.path.expanduser("~/.clusterctl"))


def runs_dir() -> Path:
    return home() / "runs"
