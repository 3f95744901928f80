"""The CLI surface: every registered command imports, helps, and user errors exit 2 without a traceback."""

import importlib
import subprocess
import sys

import pytest

from orchestrator.cli import LAZY_COMMANDS, main


@pytest.mark.parametrize("name", sorted(LAZY_COMMANDS))
def test_every_registered_command_exists_and_has_help(name, capsys):
    mod, attr = LAZY_COMMANDS[name].split(":")
    assert hasattr(importlib.import_module(mod), attr), f"{name}: {mod}:{attr} is missing"
    assert main([name, "--help"]) == 0
    assert "Usage:" in capsys.readouterr().out


def test_top_level_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in [*LAZY_COMMANDS, "exec", "inventory"]:
        assert f"  {name} " in out, name


def test_unknown_command_and_flag_are_usage_errors(capsys):
    assert main(["no-such-command"]) == 2
    assert main(["exec", "--fanout", "zero", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Error" in err


def test_console_script_runs_without_importing_torch():
    # `clusterctl exec` must stay light: no torch import on the control path
    code = ("import sys; from orchestrator.cli import main; rc = main(['exec', '--', 'true']); "
            "sys.exit(10 if 'torch' in sys.modules else rc)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
