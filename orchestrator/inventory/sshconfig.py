"""The address other nodes use to reach a node whose inventory `host` is an ssh_config alias.

SSH resolves `Host gpu-a` / `HostName 10.0.0.5` on the control machine only; the nodes
never see that file, so a worker told `MASTER_ADDR=gpu-a` cannot resolve it. The master
address is therefore the ssh_config `HostName` of the host (the file paramiko and fabric
read: the inventory's `ssh.config_file`, else ~/.ssh/config), or the host itself.
"""

from __future__ import annotations

import os

DEFAULT_CONFIG = "~/.ssh/config"


def config_hostname(host: str, config_file: str | None = None) -> str:
    """`HostName` of `host` in the ssh config (tokens like %h expanded), else `host`.
    A missing or unreadable config file leaves the host as it is: connecting reports it."""
    path = os.path.expanduser(config_file or DEFAULT_CONFIG)
    if not os.path.exists(path):  # most control machines: no config, and no need of paramiko (0.2 s to import)
        return host
    import paramiko

    try:
        config = paramiko.SSHConfig.from_path(path)
        return config.lookup(host).get("hostname") or host
    except (OSError, paramiko.ssh_exception.ConfigParseError, UnicodeDecodeError):
        return host
