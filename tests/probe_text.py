"""Probe output for parser tests: recorded tool outputs wrapped in the probe's `@@section` lines."""

from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"


def read(name):
    """A recorded output from tests/fixtures/preflight."""
    return (FIXTURES / "preflight" / name).read_text()


def read_gpu(name):
    """A GPU tool's output from tests/fixtures/gpus (recorded, or transcribed_*)."""
    return (FIXTURES / "gpus" / name).read_text()


def sec(name, body, rc=0, arg=""):
    """Wrap a tool's output as the probe prints it."""
    head = f"@@{name}" + (f" {arg}" if arg else "")
    return f"{head}\n{body.rstrip(chr(10))}\n" + (f"@@rc {rc}\n" if rc is not None else "")
