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
    monkeypatch.syspath_prepend(str(BENCH))  # as `python bench/NAME.py` runs it
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py"])
    importlib.import_module(name)
