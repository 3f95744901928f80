"""Exception types and the one map from exception to exit code.

Errors carry data (invoke's `Failure(result)` style): a check or a command
failure keeps the result it came from, so the CLI can print it and tests can
inspect it.  Every exception a user can cause derives from `ClusterctlError`
and renders as one clear paragraph; anything else is a bug and shows a
traceback only with `--debug`.
"""

from __future__ import annotations

import textwrap
from typing import Collection

# The exit codes of every command; `clusterctl --help` prints EXIT_CODES.
EXIT_OK = 0
EXIT_FAILED = 1  # a check failed, a node's command failed, the job failed
EXIT_USAGE = 2  # bad flag, bad inventory, bad input file
EXIT_UNREACHABLE = 3  # could not connect to / authenticate with a node
EXIT_INTERRUPTED = 130  # Ctrl-C

EXIT_CODES = (
    (EXIT_OK, "ok"),
    (EXIT_FAILED, "a check, command or job failed; train returns the first failed node's exit code, "
                  "exec the worst node's (124 for a command past --timeout)"),
    (EXIT_USAGE, "bad flag or inventory, a setup requirement that nothing satisfies, or more processes "
                 "per node than it has GPUs (without --force)"),
    (EXIT_UNREACHABLE, "a node could not be reached or authenticated (whatever the other nodes did)"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
)


def exit_codes_text(width: int = 78) -> str:
    """EXIT_CODES as help text: one entry per code, wrapped to `width`."""
    return "\n".join(textwrap.fill(meaning, width, initial_indent=f"{code:>3}  ", subsequent_indent=" " * 5)
                     for code, meaning in EXIT_CODES)


def with_unreachable(unreachable: Collection[str], code: int) -> int:
    """The exit code of a command that did what it could on the nodes it reached: any node it
    could not reach makes it EXIT_UNREACHABLE, whatever happened on the others; else `code`."""
    return EXIT_UNREACHABLE if unreachable else code


class ClusterctlError(Exception):
    """Base for errors a user can cause. `str(e)` is the paragraph shown."""

    exit_code = EXIT_FAILED


class UsageError(ClusterctlError):
    exit_code = EXIT_USAGE


class InventoryError(UsageError):
    """Bad inventory: carries where (file:line) and what key."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 key: str | None = None):
        self.path, self.line, self.key = path, line, key
        where = ""
        if path:
            where = f"{path}:{line}: " if line else f"{path}: "
        super().__init__(where + message)


class ConnectError(ClusterctlError):
    """A node could not be reached or authenticated. Carries the node name and the message
    without it, so a per-node result can show the message under the node's own name."""

    exit_code = EXIT_UNREACHABLE

    def __init__(self, node: str, message: str):
        self.node, self.message = node, message
        super().__init__(f"{node}: {message}")

    @property
    def brief(self) -> str:
        """Why, in a few words (a run record's pending stop keeps this)."""
        return self.message.split(". ")[0][:200]

    @property
    def refused(self) -> bool:
        """The node answered and refused us (its host key, our key): not a node that is down."""
        return isinstance(self, (HostKeyError, AuthRefused))


class UnreachableError(ClusterctlError):
    """Nodes could not be reached, so the command did nothing. Carries {node: reason}."""

    exit_code = EXIT_UNREACHABLE

    def __init__(self, reasons: dict[str, str], consequence: str = "nothing was run"):
        self.reasons = dict(reasons)
        why = "; ".join(f"{node}: {reason}" for node, reason in self.reasons.items())
        super().__init__(f"cannot reach {', '.join(self.reasons)}, {consequence}. {why}")


class HostKeyError(ConnectError):
    """Unknown, changed or revoked host key. The message holds the exact remedy; `verdict`
    ("unknown", "changed", "revoked") and `fingerprint` (the key the node presented) say it short."""

    def __init__(self, node: str, message: str, *, verdict: str = "unknown", fingerprint: str = ""):
        self.verdict, self.fingerprint = verdict, fingerprint
        super().__init__(node, message)

    @property
    def brief(self) -> str:
        return f"host key {self.verdict}" + (f" (it presented {self.fingerprint})" if self.fingerprint else "")


class AuthRefused(ConnectError):
    """The node answered and refused every key offered: retrying soon cannot help."""

    @property
    def brief(self) -> str:
        return "authentication refused"


class ConnectionLost(ConnectError):
    """A node's connection went away after it was open (link down, host frozen or rebooted)."""


class CommandFailed(ClusterctlError):
    """A command ended without success on one node; carries its NodeResult."""

    def __init__(self, result, message: str | None = None):
        self.result = result
        tail = (result.stderr or result.stdout or "").strip()[-500:]
        super().__init__(message or f"{result.node}: {result.describe()}" + (f": {tail}" if tail else ""))


class CommandTimeout(CommandFailed):
    """A command did not finish (or did not say what was waited for) within `timeout` seconds."""

    def __init__(self, result, timeout: float, message: str | None = None):
        self.timeout = timeout
        super().__init__(result, message)


class ClusterFailure(ClusterctlError):
    """Some nodes failed; wraps the whole ClusterResult instead of replacing it."""

    def __init__(self, result, message: str | None = None):
        self.result = result
        failed = ", ".join(sorted(result.failed)) or "none"
        super().__init__(message or f"failed on: {failed}")


class LaunchError(ClusterctlError):
    """`train` could not launch the run (unreachable node, failed preflight, busy node, a node
    that would not start torchrun). `exit_code` is the run's: 1 failed, 2 a usage error (more processes than GPUs), 3 unreachable, 130 stopped."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED):
        super().__init__(message)
        self.exit_code = exit_code
