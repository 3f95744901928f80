"""Every bench under bench/ imports: a bench reaching for a name another module moved or renamed
fails here, in the fast tier, not when someone next runs it (bench_goodput.py imported two private
names of bench_recovery.py that had moved to bench/harness.py, and would not start)."""

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py")))
def test_the_bench_imports(name, monkeypatch):
    """Imported as `python bench/NAME.py` would (bench/ first on the path); the bench's additions to
    sys.path and its own modules (bench/*.py) are taken away after, so no later test in this worker
    imports a bench's module (bench/harness.py) for one of its own. Libraries the bench imported
    stay: a C extension cannot be unloaded."""
    path, modules = list(sys.path), set(sys.modules)
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py"])
    try:
        importlib.import_module(name)
    finally:
        sys.path[:] = path
        for added in set(sys.modules) - modules:
            if Path(getattr(sys.modules[added], "__file__", None) or "/").parent == BENCH:
                del sys.modules[added]
