"""Prometheus metrics of every run recorded in a control home: `clusterctl metrics serve`.

A custom collector (prometheus_client's pattern for an exporter that reports another system's
state): each scrape asks the home's RunViews for what changed (runview.py) and builds the metric
families from their facts. Names follow the Prometheus conventions: a `clusterctl_` prefix, base
units (`_seconds`, `_time_seconds` for Unix times), `_total` for counters, and a HELP for each.

Labels: `run_id` on every series, `node` on a node's, `node` and `rank` on a rank's. A state is a
label with one series per possible value (1 for the current one, 0 for the others), as
kube-state-metrics does, so `clusterctl_run_state{state="running"} == 1` selects the live runs.

The families come from SOURCES, one function each from a run's facts to its families' samples;
a new figure of a run is one more source there (the goodput ledger's is `_goodput`: the ratio,
the wall, productive and per-cause badput seconds, `cause` a label, and the ETA).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from orchestrator.observe.runview import Home, RunFacts
from orchestrator.runs import nodefaults, quarantine
from orchestrator.runs.spec import NodeState, RunState

RUN, NODE, RANK = ("run_id",), ("run_id", "node"), ("run_id", "node", "rank")


@dataclass(frozen=True)
class Family:
    """One metric: its name (without `_total` for a counter), kind, help and label names."""

    name: str
    kind: str  # "gauge" | "counter"
    help: str
    labels: tuple[str, ...] = RUN


FAMILIES = {f.name: f for f in (
    Family("clusterctl_run_state", "gauge", "The run's state: 1 for the current one (state label), 0 for the others.",
           ("run_id", "state")),
    Family("clusterctl_run_attempt", "gauge", "The run's current attempt (1 for the first launch)."),
    Family("clusterctl_run_restarts", "counter", "Attempts begun after the first: the run's relaunches."),
    Family("clusterctl_run_lost_nodes", "counter", "Nodes the run lost (no answer for --lost-timeout)."),
    Family("clusterctl_run_hangs", "counter", "Attempts the hang watch found hung."),
    Family("clusterctl_run_stragglers", "gauge", "Ranks the straggler watch names now."),
    Family("clusterctl_run_step", "gauge", "The newest training step any rank logged."),
    Family("clusterctl_run_step_seconds", "gauge", "Seconds per step of the rank with the newest step (the log's own "
                                                   "figure, else how fast its step number moved)."),
    Family("clusterctl_run_tokens_per_second", "gauge", "Tokens per second, where the log says (tok/s, tokens/s)."),
    Family("clusterctl_run_world_size", "gauge", "Processes in the current attempt."),
    Family("clusterctl_run_nodes", "gauge", "Nodes in the current attempt."),
    Family("clusterctl_run_start_time_seconds", "gauge", "When the run was created (Unix time)."),
    Family("clusterctl_run_end_time_seconds", "gauge", "When the run ended (Unix time); absent while it runs."),
    Family("clusterctl_run_exit_code", "gauge", "The run's exit code; absent while it runs."),
    Family("clusterctl_run_last_checkpoint_time_seconds", "gauge",
           "When the newest checkpoint copy on the control machine was complete (Unix time)."),
    Family("clusterctl_run_last_checkpoint_step", "gauge", "The step of the newest checkpoint copy, where its name says."),
    Family("clusterctl_run_checkpoint_age_seconds", "gauge", "Seconds since the newest checkpoint copy was complete."),
    Family("clusterctl_node_state", "gauge", "A node of the current attempt: 1 for its state (state label), 0 for "
                                             "the others.", ("run_id", "node", "state")),
    Family("clusterctl_node_info", "gauge", "A node of the current attempt: its host and ranks (always 1).",
           ("run_id", "node", "host", "ranks")),
    Family("clusterctl_node_left_out", "gauge", "A node the run no longer uses (lost, failed preflight, quarantined): 1.",
           NODE),
    Family("clusterctl_rank_step", "gauge", "The newest step this rank logged.", RANK),
    Family("clusterctl_rank_step_seconds", "gauge", "This rank's seconds per step.", RANK),
    Family("clusterctl_rank_tokens_per_second", "gauge", "This rank's tokens per second, where its log says.", RANK),
    Family("clusterctl_rank_last_log_time_seconds", "gauge", "When this rank last wrote a line (Unix time).", RANK),
    Family("clusterctl_rank_hang", "gauge", "1: the current attempt's hang verdict names this rank.", RANK),
    Family("clusterctl_rank_straggler_ratio", "gauge", "This rank's compute per step over the median, while the "
                                                       "straggler watch names it.", RANK),
    Family("clusterctl_run_goodput_ratio", "gauge", "Productive seconds over the run's wall seconds so far (the "
                                                   "goodput ledger, `clusterctl goodput`)."),
    Family("clusterctl_run_wall_seconds", "gauge", "The run's wall time so far, from train (or its first attempt, "
                                                   "after a queue) to its end or now."),
    Family("clusterctl_run_productive_seconds", "gauge", "Of the wall time, the seconds the job computed steps it kept."),
    Family("clusterctl_run_badput_seconds", "gauge", "Of the wall time, the seconds lost, by cause: startup, checkpoint, "
                                                     "detection, restore, recompute, hang, straggler, other.",
           ("run_id", "cause")),
    Family("clusterctl_run_eta_seconds", "gauge", "Seconds to the job's last step at its current pace; absent when "
                                                  "the run has ended or its last step is not known."),
    Family("clusterctl_node_faults", "counter", "Faults attributed to this node across runs (runs/nodefaults.py), by "
                                                "kind: lost, killed, hung, straggled, health.", ("node", "host", "kind")),
    Family("clusterctl_node_quarantined", "gauge", "1: no launch or restart from this machine uses the node "
                                                   "(`clusterctl health --release` lets it back).", ("node", "host")),
    Family("clusterctl_exporter_runs", "gauge", "Run records the exporter reads.", ()),
    Family("clusterctl_exporter_read_bytes", "counter", "Bytes of run records and rank logs the exporter has read.", ()),
)}

Sample = tuple[str, tuple[str, ...], float]  # family name, label values, value


def _run(f: RunFacts, now: float) -> Iterator[Sample]:
    rec, i = f.rec, (f.id,)
    for st in RunState:
        yield "clusterctl_run_state", (f.id, st.value), float(rec.state is st)
    yield "clusterctl_run_attempt", i, rec.attempt
    yield "clusterctl_run_restarts", i, f.restarts
    yield "clusterctl_run_lost_nodes", i, len(f.lost_nodes)
    yield "clusterctl_run_hangs", i, f.hangs
    yield "clusterctl_run_stragglers", i, len(f.slow)
    yield "clusterctl_run_nodes", i, len(rec.nodes)
    if rec.world_size is not None:
        yield "clusterctl_run_world_size", i, rec.world_size
    if rec.created:
        yield "clusterctl_run_start_time_seconds", i, rec.created
    if rec.state.terminal and rec.ended is not None:
        yield "clusterctl_run_end_time_seconds", i, rec.ended
    if rec.state.terminal and rec.exit_code is not None:
        yield "clusterctl_run_exit_code", i, rec.exit_code
    lead = f.lead
    if lead is not None:
        yield "clusterctl_run_step", i, lead.step
        if lead.step_s is not None:
            yield "clusterctl_run_step_seconds", i, lead.step_s
    tokens = next((r.tokens_s for r in f.ranks if r.tokens_s is not None), None)
    if tokens is not None:
        yield "clusterctl_run_tokens_per_second", i, tokens
    if f.checkpoint is not None:
        yield "clusterctl_run_last_checkpoint_time_seconds", i, f.checkpoint.at
        yield "clusterctl_run_checkpoint_age_seconds", i, max(0.0, now - f.checkpoint.at)
        if f.checkpoint.step is not None:
            yield "clusterctl_run_last_checkpoint_step", i, f.checkpoint.step


def _nodes(f: RunFacts, now: float) -> Iterator[Sample]:
    for nd in f.rec.nodes:
        for st in NodeState:
            yield "clusterctl_node_state", (f.id, nd.name, st.value), float(nd.state is st)
        yield "clusterctl_node_info", (f.id, nd.name, nd.host, nd.ranks), 1.0
    for name in f.rec.left_out:
        yield "clusterctl_node_left_out", (f.id, name), 1.0


def _ranks(f: RunFacts, now: float) -> Iterator[Sample]:
    for r in f.ranks:
        lv = (f.id, r.node, str(r.rank))
        for name, value in (("clusterctl_rank_step", r.step), ("clusterctl_rank_step_seconds", r.step_s),
                            ("clusterctl_rank_tokens_per_second", r.tokens_s),
                            ("clusterctl_rank_last_log_time_seconds", r.heard)):
            if value is not None:
                yield name, lv, value
        yield "clusterctl_rank_hang", lv, float(r.rank in f.hang)
        if r.rank in f.slow:
            yield "clusterctl_rank_straggler_ratio", lv, f.slow[r.rank]


def _goodput(f: RunFacts, now: float) -> Iterator[Sample]:
    lg, i = f.goodput, (f.id,)
    if lg is None or lg.goodput is None:
        return
    yield "clusterctl_run_goodput_ratio", i, lg.goodput
    yield "clusterctl_run_wall_seconds", i, lg.wall_s
    yield "clusterctl_run_productive_seconds", i, lg.productive_s
    for cause, seconds in lg.badput.items():
        yield "clusterctl_run_badput_seconds", (f.id, cause), seconds
    if lg.eta_s is not None:
        yield "clusterctl_run_eta_seconds", i, lg.eta_s


# Each run's samples, source by source (see the module's docstring).
SOURCES: tuple[Callable[[RunFacts, float], Iterable[Sample]], ...] = (_run, _nodes, _ranks, _goodput)


def node_samples(root: Path, faults: nodefaults.Reader | None = None) -> Iterator[Sample]:
    """Each node's record across runs, from the control home `root`: its attributed faults by kind
    (older ones folded into tallies count each fault they stand for) and whether it is quarantined
    now (not a run's figure: no run_id). `faults`: a reader that parses the record again only when
    it changed (the collector's, asked on every scrape)."""
    counts: dict[tuple[str, str, str], int] = {}
    for f in (faults or nodefaults.Reader(root)).load():
        if f.kind != nodefaults.RELEASED:
            counts[(f.node, f.host, f.kind)] = counts.get((f.node, f.host, f.kind), 0) + f.weight
    for labels, n in sorted(counts.items()):
        yield "clusterctl_node_faults", labels, n
    for e in quarantine.load(root).values():
        yield "clusterctl_node_quarantined", (e.node, e.host), 1


def families(facts: list[RunFacts], now: float, read_bytes: int = 0, nodes: Iterable[Sample] = ()) -> list[Metric]:
    """Every family, its samples from every run's facts and the nodes' record (families with no
    sample are left out)."""
    made: dict[str, Metric] = {}

    def family(name: str) -> Metric:
        if name not in made:
            d = FAMILIES[name]
            cls = CounterMetricFamily if d.kind == "counter" else GaugeMetricFamily
            made[name] = cls(d.name, d.help, labels=list(d.labels))
        return made[name]

    for f in facts:
        for source in SOURCES:
            for name, labels, value in source(f, now):
                family(name).add_metric(list(labels), float(value))
    for name, labels, value in nodes:
        family(name).add_metric(list(labels), float(value))
    family("clusterctl_exporter_runs").add_metric([], float(len(facts)))
    family("clusterctl_exporter_read_bytes").add_metric([], float(read_bytes))
    return [made[n] for n in FAMILIES if n in made]


class RunsCollector(Collector):
    """The collector a registry asks on each scrape: the home's runs as they are now."""

    def __init__(self, runs_dir: Path, clock: Callable[[], float] = time.time):
        self.home = Home(runs_dir)
        self.runs_dir = runs_dir
        self.clock = clock
        self.faults = nodefaults.Reader(runs_dir.parent)

    def collect(self) -> Iterator[Metric]:
        now = self.clock()
        facts = self.home.look(now)
        yield from families(facts, now, self.home.bytes_read, node_samples(self.runs_dir.parent, self.faults))


def registry(runs_dir: Path) -> CollectorRegistry:
    """A registry with the runs' collector alone (no process metrics: the figures are the runs')."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(RunsCollector(runs_dir))
    return reg

