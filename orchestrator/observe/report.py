"""`clusterctl report RUN -o run.html`: one self-contained HTML page of a run, from its directory alone.

The page needs no server and fetches nothing: its style is inline, its pictures are inline SVG
(svg.py), and it carries no script. It holds the run's summary, a timeline of its attempts (on
which nodes, how each ended) with every story line (runs/RUN/story.jsonl) as a tick, the loss and
step-rate curves from its TensorBoard files (runs/curves.py: one directory for every attempt;
without them, the loss rank 0's log prints), and tables of its attempts, nodes and ranks.
"""

from __future__ import annotations

import json
import re
import time
from html import escape
from pathlib import Path

from orchestrator import __version__
from orchestrator.observe.runview import RunFacts, RunView
from orchestrator.observe.svg import line_chart, timeline
from orchestrator.probe import common
from orchestrator.runs.logs.rankfiles import rank_file
from orchestrator.runs.runrecord import RunRecord
from orchestrator.runs.store import Run

LOSS = re.compile(r"\bstep (\d+)\b.*?\bloss[ :=]+([-+\d.eE]+)")
STYLE = """body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;
vertical-align:top}th{background:#f4f4f4}.state-finished{color:#2ca02c}.state-failed{color:#d62728}
svg text{font:11px system-ui,sans-serif;fill:#333}pre{background:#f7f7f7;padding:8px;white-space:pre-wrap}
.muted{color:#777}"""


def when(t: float | None) -> str:
    return "-" if not t else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} s"


def story_lines(run_dir: Path) -> list[dict]:
    out = []
    try:
        raw = (run_dir / "story.jsonl").read_bytes()
    except OSError:
        return out
    for line in raw.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and "at" in doc:
            out.append(doc)
    return out


def tensorboard_curves(run_dir: Path) -> dict[str, list[tuple[float, float, float]]]:
    """tag -> [(step, value, wall time)] of every scalar in runs/RUN/tensorboard, as TensorBoard
    itself would read them (its purge_step honoured: a resumed attempt's steps replace the old)."""
    d = run_dir / "tensorboard"
    if not d.is_dir() or not any(p.is_file() for p in d.rglob("*")):
        return {}
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    m = EventMultiplexer(size_guidance={"scalars": 0}).AddRunsFromDirectory(str(d))
    m.Reload()
    out: dict[str, list[tuple[float, float, float]]] = {}
    for run in m.Runs():
        for tag in m.GetAccumulator(run).Tags().get("scalars", []):
            out.setdefault(tag, []).extend((e.step, e.value, e.wall_time) for e in m.Scalars(run, tag))
    return out


def log_loss(run_dir: Path) -> list[tuple[float, float, float]]:
    """(step, loss, 0) from rank 0's log lines, for a script that writes no TensorBoard files."""
    try:
        text = rank_file(run_dir, 0).read_text(errors="replace")
    except OSError:
        return []
    found = {}
    for m in LOSS.finditer(text):
        try:
            found[int(m.group(1))] = float(m.group(2))
        except ValueError:
            continue
    return [(s, v, 0.0) for s, v in sorted(found.items())]


def step_rate(points: list[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """Steps per second between consecutive logged steps (by their wall times), by step."""
    pts = sorted(points, key=lambda p: p[2])
    out = []
    for (s0, _, t0), (s1, _, t1) in zip(pts, pts[1:]):
        if s1 > s0 and t1 > t0:
            out.append((s1, (s1 - s0) / (t1 - t0)))
    return out


def resume_marks(rec: RunRecord) -> list[tuple[float, str]]:
    marks = []
    for a in rec.attempts[1:]:
        step = common().checkpoint_step(a.checkpoint) if a.checkpoint else None
        marks.append((float(step or 0), f"attempt {a.attempt} resumed from {a.checkpoint or 'scratch'}"))
    return marks


def curves_html(run_dir: Path, rec: RunRecord) -> str:
    tags = tensorboard_curves(run_dir)
    loss_tag = next((t for t in sorted(tags) if t.endswith("loss") and "val" not in t), None)
    loss = tags.get(loss_tag, []) if loss_tag else log_loss(run_dir)
    source = f"TensorBoard scalar {loss_tag}" if loss_tag else "rank 0's log"
    marks = resume_marks(rec)
    parts = [line_chart(f"loss ({source})", {loss_tag or "loss": [(s, v) for s, v, _ in loss]}, "step", "loss", marks)]
    rate = step_rate(loss) if loss_tag else []
    if rate:
        parts.append(line_chart("step rate", {"steps/s": rate}, "step", "steps per second", marks))
    tokens = tags.get("perf/tokens_per_s")
    if tokens:
        parts.append(line_chart("tokens/s", {"tokens/s": [(s, v) for s, v, _ in tokens]}, "step", "tokens per second",
                                marks))
    return "".join(parts)


def table(head: list[str], rows: list[list[object]], cls: str = "") -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><tr>{th}</tr>{body}</table>'


def attempts_html(rec: RunRecord) -> str:
    rows = [[a.attempt, ", ".join(a.nodes), ", ".join(a.prepared) or "-", a.checkpoint or "-", when(a.started),
             when(a.ended), a.verdict or "running", a.detail or "", secs(a.preflight_s), secs(a.launch_s)]
            for a in rec.attempts]
    return table(["attempt", "nodes", "spares brought in", "from checkpoint", "started", "ended", "verdict", "detail",
                  "preflight", "launch"], rows, "attempts")


def nodes_html(rec: RunRecord) -> str:
    rows = [[n.name, n.host, n.ranks, n.state.value, "-" if n.exit_code is None else n.exit_code, n.error or ""]
            for n in rec.nodes]
    out = table(["node", "host", "ranks", "state", "exit code", "error"], rows, "nodes")
    if rec.left_out:
        out += "<p>Left out of later attempts:</p>" + table(
            ["node", "why"], [[n, rec.left_out_why.get(n, "")] for n in rec.left_out], "left-out")
    return out


def ranks_html(f: RunFacts, now: float) -> str:
    rows = [[r.rank, r.node, "-" if r.step is None else r.step, "-" if r.step_s is None else f"{r.step_s:.3f}",
             "-" if r.tokens_s is None else f"{r.tokens_s:,.0f}", when(r.heard),
             f.hang.get(r.rank, "") or (f"{f.slow[r.rank]:.1f}x the median" if r.rank in f.slow else "")]
            for r in f.ranks]
    return table(["rank", "node", "newest step", "s/step", "tokens/s", "last line", "verdict"], rows, "ranks")


def render(run: Run, now: float | None = None) -> str:
    now = time.time() if now is None else now
    f = RunView(run.dir).refresh(now)
    if f is None:
        f = RunFacts(run.id, RunRecord(id=run.id))
    rec = f.rec
    end = rec.ended or now
    story = story_lines(run.dir)
    attempts = [{"attempt": a.attempt, "nodes": a.nodes, "started": a.started, "ended": a.ended,
                 "verdict": a.verdict} for a in rec.attempts]
    head = table(["state", "exit code", "created", "ended", "duration", "attempts", "restarts", "lost nodes",
                  "world size"],
                 [[rec.state.value, "-" if rec.exit_code is None else rec.exit_code, when(rec.created), when(rec.ended),
                   secs(end - rec.created if rec.created else None), len(rec.attempts), f.restarts,
                   ", ".join(f.lost_nodes) or "none", rec.world_size or "-"]], "summary")
    told = table(["time", "what"], [[time.strftime("%H:%M:%S", time.localtime(s["at"])), s.get("text", "")]
                                     for s in story], "story")
    summary = f"<pre>{escape(rec.summary or rec.error or 'the run has not ended')}</pre>"
    body = (f'<h1>Run <span class="run-id">{escape(run.id)}</span> '
            f'<span class="state-{escape(rec.state.value)}">{escape(rec.state.value)}</span></h1>{head}'
            f"<h2>Timeline</h2>{timeline(rec.created or now, end, attempts, [(s['at'], str(s.get('text', '')), s.get('event')) for s in story])}"
            f"<h2>Training curves</h2>{curves_html(run.dir, rec)}"
            f"<h2>Attempts</h2>{attempts_html(rec)}<h2>Nodes</h2>{nodes_html(rec)}"
            f"<h2>Ranks</h2>{ranks_html(f, now)}<h2>How it ended</h2>{summary}"
            f"<h2>Story</h2>{told}"
            f'<p class="muted">clusterctl {escape(__version__)} report, made {escape(when(now))} from {escape(str(run.dir))}</p>')
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>clusterctl run {escape(run.id)}</title>'
            f'<meta name="viewport" content="width=device-width"><style>{STYLE}</style></head><body>{body}</body></html>\n')
