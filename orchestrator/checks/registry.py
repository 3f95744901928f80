"""The checks, registered once. This tuple is the column order of `clusterctl preflight`, its
--only/--skip names and JSON keys; the probe script, train's fast subset and `launch
--from-env`'s local checks are all queries of it. A new check is a module with a `Check` (see
orchestrator/checks/__init__.py) and one line here."""

from __future__ import annotations

from orchestrator.checks import Check
from orchestrator.checks.control import PING, SSH
from orchestrator.checks.firewall import FIREWALL
from orchestrator.checks.gpu import GPU_COUNT, GPU_IDLE
from orchestrator.checks.gpu_health import GPU_HEALTH
from orchestrator.checks.net import IFACE, PORT_FREE, PORT_REACHABLE
from orchestrator.checks.output_dir import OUTPUT_DIR
from orchestrator.checks.output_shared import OUTPUT_SHARED
from orchestrator.checks.python import CODE_SYNC, PYTHON_ENV
from orchestrator.checks.shm import SHM
from orchestrator.checks.system import CLOCK_SKEW, DISK
from orchestrator.node import preflight as preflight_probe

REGISTRY: tuple[Check, ...] = (
    SSH, PING, GPU_COUNT, GPU_IDLE, GPU_HEALTH, PORT_FREE, PORT_REACHABLE, FIREWALL, CLOCK_SKEW, CODE_SYNC,
    PYTHON_ENV, IFACE, DISK, SHM, OUTPUT_DIR, OUTPUT_SHARED)

CHECKS: tuple[str, ...] = tuple(c.name for c in REGISTRY)
BY_NAME: dict[str, Check] = {c.name: c for c in REGISTRY}
assert len(BY_NAME) == len(REGISTRY), "two checks with one name"

# Checks a node can run on its own, from a probe run locally: `launch --from-env` in a pod.
# (python_env and code_sync compare nodes; port_reachable needs the master's listener.)
LOCAL_CHECKS: tuple[str, ...] = ("gpu_count", "gpu_idle", "port_free", "iface", "shm", "output_dir")


def fast_checks() -> list[str]:
    """What `clusterctl train` checks before it launches anything."""
    return [c.name for c in REGISTRY if c.fast]


def ordered(names) -> list[str]:
    """names in column order, unknown ones dropped."""
    wanted = set(names)
    return [c for c in CHECKS if c in wanted]


_HEADER = preflight_probe.HEADER
_scripts: dict[tuple[str, ...], bytes] = {}


def probe_script(names) -> bytes:
    """The one script a node runs for these checks: the header (arguments, `want`, `has`), each
    needed snippet once (a snippet several checks read runs when any of them is asked for), then
    @@end. Per node it is `sh -s -- CHECKS WORKDIR ...` (orchestrator/remote/preflight.sh)."""
    key = tuple(ordered(names))
    if key not in _scripts:
        users: dict[str, list[str]] = {}
        probes = {}
        for name in key:
            for p in BY_NAME[name].probes:
                probes.setdefault(p.name, p)
                users.setdefault(p.name, []).append(name)
        parts = [_HEADER]
        for p in sorted(probes.values(), key=lambda p: not p.first):
            checks = users[p.name]
            roles = {BY_NAME[c].nodes for c in checks}
            role = {"master": ' && [ "$role" = master ]', "workers": ' && [ "$role" != master ]'}.get(
                roles.pop()) if len(roles) == 1 else ""
            parts.append(f"# {p.name}: {', '.join(checks)}\nif want {' '.join(checks)}{role or ''}; then\n"
                         f"{p.text.rstrip()}\nfi\n")
        parts.append('echo "@@end"\n')
        _scripts[key] = "".join(parts).encode()
    return _scripts[key]
