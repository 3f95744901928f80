"""`clusterctl goodput [RUN]`: where a run's wall time went, productive or lost and to what (the
ledger of orchestrator/runs/goodput.py), per attempt and in total, and its ETA while it runs."""

from __future__ import annotations

import json
import time

import click

from orchestrator.cli import tables
from orchestrator.cli.runs import complete_run_ids
from orchestrator.runs.goodput import CATEGORIES, Ledger, of_run
from orchestrator.runs.store import Run

SHORT = {"startup": "startup", "checkpoint": "ckpt", "detection": "detect", "restore": "restore",
         "recompute": "redo", "hang": "hang", "straggler": "slow", "other": "other"}


def _clock(t: float | None) -> str:
    return "-" if t is None else time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 10) % 10}"


def attempts_table(lg: Ledger):
    """One row per attempt: its wall time, productive time and each cause of badput the run has."""
    from rich.table import Table

    shown = [c for c in CATEGORIES if lg.badput[c] >= 0.05]
    t = Table(box=None, pad_edge=False, padding=(0, 1), header_style="bold")
    t.add_column("attempt", no_wrap=True)
    for name in ("wall", "productive", *(SHORT[c] for c in shown)):
        t.add_column(name, no_wrap=True, justify="right")
    for sh in lg.shares:
        t.add_row(str(sh.attempt), tables.dur(sh.wall_s), tables.dur(sh.productive_s),
                  *(tables.dur(sh.badput[c]) if sh.badput[c] >= 0.05 else "-" for c in shown))
    return t


def fault_lines(lg: Ledger) -> list[str]:
    """Per fault: when it happened, by what evidence, when it was declared, and the steps redone."""
    out = []
    for i, sh in enumerate(lg.shares):
        f = sh.fault
        if f is None:
            continue
        line = (f"attempt {sh.attempt}: {f.kind} at {_clock(f.at)} ({f.evidence}), declared {_clock(f.declared)}, "
                f"{tables.dur(f.declared - f.at)} later")
        nxt = next((n for n in lg.shares[i + 1:] if n.launched), None)
        if sh.reached_step is not None and nxt is not None and nxt.start_step is not None:
            redo = max(0, sh.reached_step - nxt.start_step)
            line += (f"; step {sh.reached_step} reached, attempt {nxt.attempt} started at {nxt.start_step}: "
                     f"{redo} step{'s' if redo != 1 else ''} redone")
        out.append(line)
    return out


@click.command("goodput")
@click.argument("run_id", required=False, shell_complete=complete_run_ids)
@click.option("--json", "as_json", is_flag=True)
def goodput_command(run_id, as_json):
    """Where a run's wall time went (the latest run by default): productive time, and badput by
    cause (startup, checkpoint stalls, fault detection, restore, recompute, hangs, stragglers,
    other), per attempt and in total, with the goodput ratio and, while the run goes on toward
    a known last step, its ETA."""
    from rich.console import Console

    run = Run.find(run_id)
    lg = of_run(run)
    if as_json:
        click.echo(json.dumps(lg.to_json(), indent=2))
        return
    console = Console()
    n = len([s for s in lg.shares if s.attempt])
    console.print(f"{run.id}: {lg.state}, {n} attempt{'s' if n != 1 else ''}"
                  + (f", until now ({_clock(lg.end)})" if lg.live else ""), highlight=False, markup=False)
    line = tables.goodput_line(lg)
    console.print(line or "nothing launched yet: no goodput", highlight=False, markup=False)
    if lg.shares and any(s.launched for s in lg.shares):
        console.print(attempts_table(lg))
    for text in fault_lines(lg) + [f"note: {x}" for x in lg.notes]:
        console.print(text, highlight=False, markup=False)
    if lg.step_s is not None and not lg.live:
        console.print(f"pace: {lg.step_s:.3f} s/step (the last attempt's median)", highlight=False, markup=False)


__all__ = ["goodput_command"]
