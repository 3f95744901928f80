"""The `clusterctl` command line: thin, `main(argv) -> int`, one exception -> exit code map.

Subcommands live in the modules named for what a user does; this file only
wires them up (lazily, so `clusterctl exec` never imports torch).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

import click

from orchestrator import __version__
from orchestrator.cli.jsonout import emit, error_doc, wants_json
from orchestrator.cli.options import ClusterOptions, cluster_options
from orchestrator.errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    ClusterctlError,
    exit_codes_text,
)
from orchestrator.home import hand_down_umask, set_umask
from orchestrator.transport import quiet_paramiko

# name -> "module:attribute" of a click command, imported only when used.
LAZY_COMMANDS = {
    "preflight": "orchestrator.cli.preflight:preflight_command",
    "sync": "orchestrator.cli.sync:sync_command",
    "setup": "orchestrator.cli.setup:setup_command",
    "train": "orchestrator.cli.train:train_command",
    "tail": "orchestrator.cli.runs:tail_command",
    "status": "orchestrator.cli.status:status_command",
    "stack": "orchestrator.cli.stack:stack_command",
    "runs": "orchestrator.cli.status:runs_command",
    "queue": "orchestrator.cli.queue:queue_command",
    "stop": "orchestrator.cli.stop:stop_command",
    "plan": "orchestrator.cli.plan:plan_command",
    "netbench": "orchestrator.cli.netbench:netbench_command",
    "render": "orchestrator.cli.render:render_command",
    "launch": "orchestrator.cli.launch:launch_command",
    "top": "orchestrator.cli.top:top_command",
    "watch": "orchestrator.cli.watch:watch_command",
    "fetch": "orchestrator.cli.fetch:fetch_command",
    "cp": "orchestrator.cli.cp:cp_command",
    "health": "orchestrator.cli.health:health_command",
    "metrics": "orchestrator.cli.metrics:metrics_group",
    "report": "orchestrator.cli.report:report_command",
    "goodput": "orchestrator.cli.goodput:goodput_command",
    "drill": "orchestrator.cli.drill:drill_command",
}

HELP = """clusterctl: preflight, launch and watch torchrun jobs on a few bare-metal GPU nodes over SSH.

\b
Exit codes, the same for every command:
""" + exit_codes_text()


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(LAZY_COMMANDS))

    def get_command(self, ctx, name):
        cmd = super().get_command(ctx, name)
        if cmd is not None or name not in LAZY_COMMANDS:
            return cmd
        mod, attr = LAZY_COMMANDS[name].split(":")
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:  # a real missing dependency inside the module: let it surface
                raise
            return None  # not built in this checkout; tests/test_cli.py makes sure none is missing
        return getattr(module, attr)


@click.group(cls=LazyGroup, help=HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="clusterctl")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
def cli(debug):
    pass


@cli.command("exec", context_settings={"ignore_unknown_options": True})
@cluster_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of prefixed lines.")
@click.option("-b", "--gather", is_flag=True,
              help="Gather identical output under one header naming its nodes as a range, like "
                   "`clush -b` (stderr lines marked 'stderr: ').")
@click.option("--timeout", type=click.FloatRange(0.1), default=None,
              help="Seconds each node's command may run (default: no limit).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_command(opts: ClusterOptions, as_json: bool, gather: bool, timeout: float | None,
                 command: tuple[str, ...]):
    """Run COMMAND on every node in parallel, like pdsh: `clusterctl exec -- nvidia-smi -L`.

    The words are joined with spaces and run by each node's shell, as ssh does,
    so `clusterctl exec -- 'nvidia-smi -L | wc -l'` pipes on the node. Output is
    prefixed with the node name; the exit code is the worst node's."""
    from orchestrator.cli.exec import run_exec

    sys.exit(run_exec(opts, " ".join(command), as_json=as_json, timeout=timeout, gather=gather))


@cli.group("inventory")
def inventory_group():
    """Check an inventory, or import one from an Ansible inventory, a DeepSpeed/MPI hostfile or a
    SLURM allocation."""


@inventory_group.command("check")
@cluster_options
@click.option("--json", "as_json", is_flag=True)
def inventory_check(opts: ClusterOptions, as_json: bool):
    """Validate the inventory and print the resolved nodes (no connection is made)."""
    from rich.console import Console
    from rich.table import Table

    inv = opts.load()
    ranks = {n.name: r for r, n in enumerate(n for n in inv.nodes if not n.spare)}  # spares: none until a restart
    if as_json:
        click.echo(json.dumps({"source": inv.source, "master_port": inv.master_port, "nodes": [
            {"name": n.name, "rank": ranks.get(n.name), "spare": n.spare, "host": n.host, "address": n.address,
             "gpus": n.gpus, "iface": n.iface, "connection": n.connection, "user": n.ssh.user, "port": n.ssh.port,
             "python": n.python, "workdir": n.workdir, "env": n.env} for n in inv.nodes]}, indent=2))
        return
    spares = len(inv.nodes) - len(ranks)
    t = Table(title=f"{inv.source}: {len(ranks)} nodes" + (f" + {spares} spare{'s' if spares > 1 else ''}" if spares else "")
              + f", master {next((n for n in inv.nodes if not n.spare), inv.master).address}:{inv.master_port}")
    for col in ("rank", "name", "host", "gpus", "iface", "connection", "user", "workdir"):
        t.add_column(col)
    for n in inv.nodes:
        t.add_row(str(ranks[n.name]) if n.name in ranks else "spare", n.name, n.host,
                  "?" if n.gpus is None else str(n.gpus), n.iface or "-",
                  n.connection, n.ssh.user or "(ssh config/current)", n.workdir)
    Console().print(t)


@inventory_group.command("import-hostfile")
@click.argument("hostfile", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write here instead of stdout.")
@click.option("--user", help="ssh.user for every node.")
@click.option("--iface", help="Network interface for every node (sets NCCL/GLOO_SOCKET_IFNAME).")
@click.option("--master-port", type=click.IntRange(1, 65535), default=29500, show_default=True)
def import_hostfile(hostfile, output, user, iface, master_port):
    """Convert a DeepSpeed/MPI hostfile (`worker-1 slots=4`) into an inventory."""
    from pathlib import Path

    from orchestrator.inventory import hostfile_to_yaml

    text = hostfile_to_yaml(Path(hostfile).read_text(), hostfile, user=user, master_port=master_port,
                            iface=iface)
    if output:
        Path(output).write_text(text)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text, nl=False)


@inventory_group.command("import-ansible")
@click.argument("ansible_inventory", type=click.Path(exists=True, dir_okay=False))
@click.option("--group", default="all", show_default=True, help="Only the hosts of this group (and its children).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write here instead of stdout.")
@click.option("--master-port", type=click.IntRange(1, 65535), default=29500, show_default=True)
def import_ansible(ansible_inventory, group, output, master_port):
    """Convert an Ansible inventory (INI or YAML) into an inventory: ansible_host, ansible_user,
    ansible_port, ansible_ssh_private_key_file and ansible_python_interpreter, group vars included."""
    from pathlib import Path

    from orchestrator.inventory.ansible import ansible_to_yaml
    from orchestrator.inventory.read import decode_inventory, read_inventory_bytes

    text = decode_inventory(read_inventory_bytes(ansible_inventory), ansible_inventory)
    text = ansible_to_yaml(text, ansible_inventory, group=group, master_port=master_port)
    if output:
        Path(output).write_text(text)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text, nl=False)


@inventory_group.command("from-slurm")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write here instead of stdout.")
@click.option("--template", type=click.Path(dir_okay=False),
              help="Take every setting but the node list from this inventory (ssh, workdir, python, env, "
                   "train; per-node settings of the nodes it names).")
@click.option("--user", help="ssh.user for every node.")
@click.option("--iface", help="Network interface for every node (sets NCCL/GLOO_SOCKET_IFNAME).")
@click.option("--master-port", type=click.IntRange(1, 65535), default=None,
              help="Rendezvous port (default: the template's, else 29500).")
def from_slurm(output, template, user, iface, master_port):
    """Inside salloc/sbatch: an inventory of the allocated nodes and their GPUs."""
    import os
    from pathlib import Path

    from orchestrator.platforms.slurm import inventory_yaml, read_allocation

    text = inventory_yaml(read_allocation(os.environ), template, user=user, iface=iface,
                          master_port=master_port)
    if output:
        Path(output).write_text(text)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text, nl=False)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or bool(__import__("os").environ.get("CLUSTERCTL_DEBUG"))
    quiet_paramiko(debug)

    def fail(message: str, code: int, kind: str) -> int:
        """The paragraph on stderr; with --json also the error object on stdout (cli/jsonout.py)."""
        click.echo(message, err=True)
        if as_json:
            emit(error_doc(message.removeprefix("clusterctl: error: "), code, kind))
        return code

    as_json = wants_json(argv)
    umask = set_umask()  # what a command writes is the user's alone until a run's inventory says otherwise
    handed = hand_down_umask(umask)
    try:
        rv = cli.main(args=argv, prog_name="clusterctl", standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_FAILED)
    except click.exceptions.Abort:
        return fail("Interrupted.", EXIT_INTERRUPTED, "interrupted")
    except click.ClickException as e:
        code = EXIT_USAGE if isinstance(e, click.UsageError) else e.exit_code
        if not as_json:
            e.show()
            return code
        return fail(f"clusterctl: error: {e.format_message()}", code, "usage")
    except ClusterctlError as e:
        if debug:
            traceback.print_exc()
        return fail(f"clusterctl: error: {e}", e.exit_code, type(e).__name__)
    except KeyboardInterrupt:
        return fail("Interrupted.", EXIT_INTERRUPTED, "interrupted")
    except Exception as e:  # noqa: BLE001 - the one place that turns bugs into a clear line
        if debug:
            traceback.print_exc()
            return EXIT_FAILED
        return fail(f"clusterctl: internal error: {type(e).__name__}: {e}\n"
                    f"This is a bug; rerun with --debug for the traceback.", EXIT_FAILED, "internal")
    finally:
        os.umask(umask)  # a caller in the same process (a test) keeps its own
        if handed:
            os.environ.pop(handed, None)


if __name__ == "__main__":
    sys.exit(main())
