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

# name -> its one-line help, the first sentence of its docstring: `clusterctl --help` lists the
# commands from here and imports none of them (tests/test_cli.py holds each equal to the command's
# own short help at several widths)
SHORT_HELP = {
    "cp": ("Copy a file or a tree off a node (`cp node1:out/ckpt.pt .`) or onto nodes (`cp data/ "
           "'node[1-4]:data/'`), through each node's SSH connection: no sftp or scp needed, any "
           "bytes, directories (empty ones too) and symbolic links (as links) kept."),
    "drill": ("Run the job and inject faults into it, one after another: kill a worker rank, stop a "
              "rank (a hang), freeze one node's part of the run (a lost node), throttle a rank (a "
              "straggler)."),
    "fetch": ("Copy a run's files from every node it used: its artifacts (checkpoints/, "
              "tensorboard/) into NODE/artifacts/ and each attempt's node-side log, spec and exit "
              "code into NODE/node-runs/."),
    "goodput": ("Where a run's wall time went (the latest run by default): productive time, and "
                "badput by cause (startup, checkpoint stalls, fault detection, restore, recompute, "
                "hangs, stragglers, other), per attempt and in total, with the goodput ratio and, "
                "while the run goes on toward a known last step, its ETA."),
    "health": ("Every node's GPU health now, its faults across runs, and which nodes are "
               "quarantined."),
    "launch": ("In a pod or batch step: read the platform's variables, check this node, exec "
               "torchrun."),
    "metrics": ("Prometheus metrics of the runs recorded on this machine, and the nodes' exporters "
                "as targets."),
    "netbench": "Measure master<->worker TCP throughput and latency (and optionally an all-reduce).",
    "plan": ("Plan a data-parallel GPT-2 run's gradient sync: bytes, seconds, comm share, a "
             "recommendation."),
    "preflight": ("Check every node before a run: SSH, ping, GPUs, ports, firewall, clocks, code, "
                  "Python, iface, disk, /dev/shm and the output directory."),
    "queue": ("Runs of this control machine not ended yet, oldest first: queued ones (train --queue)"
              " with what they wait for, in the order they will start when their nodes are free."),
    "render": "Write the run `train` would start as a SLURM batch script or Kubernetes manifests.",
    "report": ("One HTML file of a run (the latest when RUN is left out): its timeline of attempts, "
               "faults, verdicts and restarts, the loss and step-rate curves from its TensorBoard "
               "files, its nodes and ranks, and how it ended."),
    "runs": ("The runs recorded on this control machine, oldest first; with --cluster, every run "
             "holding a node of the inventory: run id, who started it (user@control-host), since "
             "when, its nodes."),
    "setup": ("Build the inventory's `setup:` venv, identical on every node, with no index on the "
              "nodes."),
    "stack": "Every rank's Python stack and collectives now (the latest run by default).",
    "status": ("Per node: state, pid, exit code, runtime and last line of a run (the latest by "
               "default)."),
    "stop": "Stop a run on every node: SIGTERM (the trainer checkpoints), then SIGKILL.",
    "sync": ("Push this checkout (or --src, or the inventory's sync.src) to every node's workdir "
             "(.gitignore aware; never the inventory, its key files, nor what git does not track in "
             "lightning_logs/, wandb/, runs/, outputs/, multirun/), then check code_sync against it."),
    "tail": "Re-attach to a run (the latest by default); Ctrl-C detaches, the run goes on.",
    "top": ("Every GPU of every node, live: utilisation, memory, temperature, power and the process "
            "on it (with its clusterctl run id)."),
    "train": "Preflight, then torchrun on every node in rank order; stream every rank's log.",
    "watch": ("A run live (the latest by default): per node (or --ranks, per rank) its state, step, "
              "step time, tokens/s, when last heard, and stall, hang and straggler flags."),
}

HELP = """clusterctl: preflight, launch and watch torchrun jobs on a few bare-metal GPU nodes over SSH.

\b
Exit codes, the same for every command:
""" + exit_codes_text()


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(LAZY_COMMANDS))

    def format_commands(self, ctx, formatter):
        """click's list of the commands, their short help for the lazy ones from SHORT_HELP (so
        `clusterctl --help` imports none of them), cut to the width as click cuts it."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(n) for n in names)
        rows = []
        for name in names:
            if name in LAZY_COMMANDS and name not in self.commands:
                rows.append((name, click.Command(name, help=SHORT_HELP[name]).get_short_help_str(limit)))
            elif (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

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
