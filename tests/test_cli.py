"""The CLI surface: every registered command imports, helps, and user errors exit 2 without a traceback."""

import importlib
import os
import subprocess
import sys

import pytest

from orchestrator.cli import LAZY_COMMANDS, SHORT_HELP, main


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


@pytest.mark.parametrize("name", sorted(LAZY_COMMANDS))
def test_the_listed_short_help_is_the_commands_own_at_any_width(name):
    """`clusterctl --help` lists each lazy command from SHORT_HELP, without importing it: the same
    words, cut at the same width, as the command's own docstring gives."""
    import click

    assert SHORT_HELP.keys() == LAZY_COMMANDS.keys()
    mod, attr = LAZY_COMMANDS[name].split(":")
    cmd = getattr(importlib.import_module(mod), attr)
    for limit in (20, 45, 74, 120, 1000):
        assert click.Command(name, help=SHORT_HELP[name]).get_short_help_str(limit) == cmd.get_short_help_str(limit)


def test_top_level_help_imports_no_command():
    """`clusterctl --help` (often a user's first command) lists the commands without importing
    one of them (each imported costs its own modules: torch's tools for `plan`, rich's tables)."""
    code = ("import sys; from orchestrator.cli import LAZY_COMMANDS, main; rc = main(['--help']); "
            "mods = {v.split(':')[0] for v in LAZY_COMMANDS.values()}; "
            "print(sorted(m for m in mods if m in sys.modules), rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.splitlines()[-1] == "[] 0", r.stdout + r.stderr


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


def test_commands_that_never_connect_over_ssh_never_import_paramiko(tmp_path):
    # paramiko (with cryptography and invoke) is 0.2 s of every command's start: only SSH loads it
    code = ("import sys; from orchestrator.cli import main; import orchestrator.runs.supervisor; "
            "rcs = [main(['exec', '--', 'true']), main(['status', '--help']), main(['plan', '--help'])]; "
            "print('paramiko' in sys.modules, rcs)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CLUSTERCTL_HOME": str(tmp_path)})
    assert r.stdout.splitlines()[-1] == "False [0, 0, 0]", r.stdout + r.stderr
    from orchestrator.transport import SSHConnection  # the package still names it

    assert SSHConnection.__module__ == "orchestrator.transport.ssh"


def test_train_with_an_unknown_flag_is_a_usage_error_not_a_launch(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    assert main(["train", "--bogus"]) == 2
    assert main(["train", "--", "-m"]) == 2
    err = capsys.readouterr().err
    assert "no such option: --bogus" in err and "after `--`" in err and "-m needs a module" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing launched


def test_a_port_that_is_not_sshd_is_one_line_per_node_not_a_traceback(tmp_path):
    # something that accepts and hangs up (a proxy, another service): paramiko's transport
    # thread logs a traceback for it, which must not reach the user
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    inv = tmp_path / "nodes.yaml"
    inv.write_text("ssh: {connect_timeout: 3, known_hosts: %s}\nnodes:\n"
                   "  - {name: a, host: 127.0.0.1, ssh: {port: %d}}\n" % (tmp_path / "kh", port))
    try:
        r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "exec", "-i", str(inv), "--", "true"],
                           capture_output=True, text=True, timeout=60)
    finally:
        srv.close()
    assert r.returncode == 3, r.stderr  # the node never answered as sshd: unreachable
    assert "Traceback" not in r.stderr and "Exception" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("clusterctl: a: "), r.stderr


@pytest.mark.parametrize("flags, fold", [((), True), (("--no-fold",), False)])
def test_train_no_fold_prints_every_line_as_tail_does(monkeypatch, home, flags, fold):
    """train's foreground folds identical lines of many ranks like tail, and --no-fold turns it off
    (the supervisor and the follower are stood in for: only what train asks of them is checked)."""
    import orchestrator.cli.train as train

    asked = {}
    monkeypatch.setattr(train, "start_supervisor", lambda run: None)
    monkeypatch.setattr(train, "follow", lambda run, **kw: asked.update(kw) or 0)
    with pytest.raises(SystemExit) as e:
        train.train_command.main(["--skip-preflight", *flags, "--", "t.py"], standalone_mode=False)
    assert e.value.code == 0 and asked["fold"] is fold
