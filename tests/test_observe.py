"""The pure parts of a run seen from outside (orchestrator/observe/): the metrics from run records
and their cost, the targets file, the dashboard's queries, events from the record's changes, the
webhook's signature, retries and bounded queue, the trackers' environment, and the report page.
The whole of it on a real run: tests/test_observe_cluster.py."""

import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.inventory import parse_inventory
from orchestrator.observe import delivery, trackers
from orchestrator.observe.delivery import Outbox, Webhook, sign, verify
from orchestrator.observe.events import KINDS, parse_kinds
from orchestrator.observe.metrics import FAMILIES, registry
from orchestrator.observe.report import render
from orchestrator.observe.runview import TAIL_BYTES, Home
from orchestrator.observe.targets import target_groups
from orchestrator.runs.record import Book
from orchestrator.runs.runrecord import AttemptRecord, RunRecord
from orchestrator.runs.spec import NodeState, NodeStatus, RunResult, RunState
from orchestrator.runs.store import Run

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "contrib" / "grafana" / "clusterctl-runs.json"
DOC = ROOT / "docs" / "observability.md"


def write_run(runs: Path, rid: str, state: str = "running", created: float = 1.7e9, log: str = "") -> Path:
    d = runs / rid
    (d / "ranks").mkdir(parents=True)
    (d / "checkpoints").mkdir()
    (d / "run.json").write_text(json.dumps({
        "id": rid, "state": state, "created": created, "attempt": 2, "world_size": 2,
        **({"ended": created + 100, "exit_code": 0} if state == "finished" else {}),
        "attempts": [{"attempt": 1, "key": rid, "nodes": ["n1", "n2"], "verdict": "node lost", "bad_nodes": ["n2"]},
                     {"attempt": 2, "key": f"{rid}.a2", "nodes": ["n1", "n3"], "prepared": ["n3"],
                      "checkpoint": "ckpt_00000010.pt"}],
        "nodes": [{"name": "n1", "rank": 0, "host": "h1", "state": "running", "first_rank": 0, "last_rank": 0},
                  {"name": "n3", "rank": 1, "host": "h3", "state": "running", "first_rank": 1, "last_rank": 1}],
        "left_out": ["n2"], "left_out_why": {"n2": "attempt 1: node lost"}}))
    (d / "ranks" / "rank0.log").write_text(log or "step 11 | loss 3.2 | tok/s 1,234 | step 20 ms\n"
                                                  "step 12 | loss 3.1 | tok/s 1,300 | step 19 ms\n")
    (d / "checkpoints" / "ckpt_00000010.pt").write_bytes(b"x")
    return d


def scrape(runs: Path, reg=None) -> dict[tuple, float]:
    reg = reg or registry(runs)
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def one(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


# ---------------------------------------------------------------- metrics


def test_a_runs_figures_are_exported_with_its_labels(tmp_path):
    write_run(tmp_path, "r1")
    got = scrape(tmp_path)
    assert one(got, "clusterctl_run_state", run_id="r1", state="running") == 1
    assert one(got, "clusterctl_run_state", run_id="r1", state="finished") == 0
    assert one(got, "clusterctl_run_restarts_total", run_id="r1") == 1
    assert one(got, "clusterctl_run_lost_nodes_total", run_id="r1") == 1
    assert one(got, "clusterctl_run_attempt", run_id="r1") == 2
    assert one(got, "clusterctl_run_step", run_id="r1") == 12
    assert one(got, "clusterctl_run_step_seconds", run_id="r1") == pytest.approx(0.019)
    assert one(got, "clusterctl_run_tokens_per_second", run_id="r1") == 1300
    assert one(got, "clusterctl_run_last_checkpoint_step", run_id="r1") == 10
    assert one(got, "clusterctl_node_state", run_id="r1", node="n3", state="running") == 1
    assert one(got, "clusterctl_node_info", run_id="r1", node="n3", host="h3", ranks="1") == 1
    assert one(got, "clusterctl_node_left_out", run_id="r1", node="n2") == 1
    assert one(got, "clusterctl_rank_step", run_id="r1", node="n1", rank="0") == 12


def test_the_goodput_ledgers_figures_are_exported(tmp_path):
    """The ledger of a real run (tests/fixtures/goodput/restart) as the exporter serves it: the same
    figures `clusterctl goodput --json` prints, badput one series per cause."""
    from orchestrator.runs.goodput import CATEGORIES, of_dir

    src = ROOT / "tests" / "fixtures" / "goodput" / "restart"
    rid = json.loads((src / "run.json").read_text())["id"]
    shutil.copytree(src, tmp_path / rid)
    got = scrape(tmp_path)
    doc = of_dir(tmp_path / rid).to_json()
    assert one(got, "clusterctl_run_goodput_ratio", run_id=rid) == pytest.approx(doc["goodput"], abs=1e-4)
    assert one(got, "clusterctl_run_wall_seconds", run_id=rid) == pytest.approx(doc["wall_s"], abs=0.01)
    assert one(got, "clusterctl_run_productive_seconds", run_id=rid) == pytest.approx(doc["productive_s"], abs=0.01)
    for c in CATEGORIES:
        assert one(got, "clusterctl_run_badput_seconds", run_id=rid, cause=c) == pytest.approx(doc["badput"][f"{c}_s"],
                                                                                             abs=0.01)
    assert one(got, "clusterctl_run_badput_seconds", run_id=rid, cause="restore") > 0
    assert ("clusterctl_run_eta_seconds", (("run_id", rid),)) not in got  # it has ended


def test_the_exposition_passes_promtool(tmp_path):
    write_run(tmp_path, "r1")
    write_run(tmp_path, "r2", state="finished")
    promtool = shutil.which("promtool") or pytest.fail("promtool missing: scripts/test installs Debian's prometheus")
    p = subprocess.run([promtool, "check", "metrics"], input=generate_latest(registry(tmp_path)),
                       capture_output=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_an_ended_run_is_not_read_again_and_a_long_log_costs_one_short_read(tmp_path):
    big = "".join(f"step {i} | loss 1.0 | step 5 ms\n" for i in range(200_000))  # ~6 MB
    for i in range(50):
        write_run(tmp_path, f"old{i:02d}", state="finished", log=big if i == 0 else "")
    home = Home(tmp_path)
    first = home.look(1e10)
    assert len(first) == 50 and first[0].lead.step == 199_999
    assert home.bytes_read < 50 * 4096 + 2 * TAIL_BYTES  # the big log's tail, not its 6 MB
    read = home.bytes_read
    for _ in range(3):
        home.look(1e10)
    assert home.bytes_read == read  # nothing of an ended run is read again
    live = write_run(tmp_path, "live")
    home.look(1e10)
    grown = home.bytes_read
    with open(live / "ranks" / "rank0.log", "a") as f:
        f.write("step 13 | loss 3.0\n")
    (live / "run.json").write_text((live / "run.json").read_text())  # a live run's record is rewritten often
    facts = {f.id: f for f in home.look(1e10)}
    assert facts["live"].lead.step == 13 and home.bytes_read > grown


def test_textfile_once_writes_the_same_figures(tmp_path):
    write_run(tmp_path / "home" / "runs", "r1")
    out = tmp_path / "collector"
    out.mkdir()
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "metrics", "serve", "--textfile", str(out), "--once"],
                       env={"CLUSTERCTL_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [p.name for p in out.iterdir()] == ["clusterctl.prom"]  # the temporary file was renamed into place
    text = (out / "clusterctl.prom").read_text()
    assert 'clusterctl_run_restarts_total{run_id="r1"} 1.0' in text


def test_a_busy_port_is_one_clear_line(tmp_path):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "metrics", "serve", "--port",
                        str(s.getsockname()[1])], env={"CLUSTERCTL_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=60)
    s.close()
    assert r.returncode == 2 and "cannot serve metrics on 127.0.0.1:" in r.stderr and "Traceback" not in r.stderr


def exported(name: str) -> bool:
    return any(name == f.name or (f.kind == "counter" and name == f.name + "_total") for f in FAMILIES.values())


DCGM = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"}  # dcgm-exporter's default counters
METRIC = re.compile(r"\b(clusterctl_[a-z_]+|DCGM_[A-Z_]+)\b")


def unknown_metrics(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"]]
    assert exprs
    return [m for e in exprs for m in METRIC.findall(e) if not (exported(m) or m in DCGM)]


def test_the_dashboard_parses_and_queries_only_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["panels"] and dash["__inputs"][0]["pluginId"] == "prometheus"
    assert not unknown_metrics(dash)
    broken = json.loads(DASHBOARD.read_text())
    broken["panels"][1]["targets"][0]["expr"] = "clusterctl_run_no_such_ratio"
    assert unknown_metrics(broken) == ["clusterctl_run_no_such_ratio"]  # the check can fail


def test_every_metric_is_named_in_the_docs():
    text = DOC.read_text()
    missing = [f.name + ("_total" if f.kind == "counter" else "") for f in FAMILIES.values()
               if f.name + ("_total" if f.kind == "counter" else "") not in text]
    assert not missing, missing


# ---------------------------------------------------------------- targets


def test_targets_label_each_exporter_with_the_run_and_its_ranks():
    inv = parse_inventory(yaml.safe_dump({"nodes": [{"name": "g1", "host": "10.0.0.1"}, {"name": "g2", "host": "2001:db8::2"},
                                                    {"name": "g3", "host": "10.0.0.3", "spare": True}]}), "<t>")
    rec = RunRecord("r1", RunState.RUNNING, created=1.0,
                    nodes=[NodeStatus("g1", 0, "10.0.0.1", first_rank=0, last_rank=7),
                           NodeStatus("g2", 1, "2001:db8::2", first_rank=8, last_rank=15)])
    old = RunRecord("r0", RunState.FINISHED, created=0.5, nodes=[NodeStatus("g3", 0, "10.0.0.3", first_rank=0)])
    groups = target_groups(inv, {"node_exporter": 9100, "dcgm_exporter": 9400}, [old, rec])
    by = {(g["labels"]["node"], g["labels"]["exporter"]): g for g in groups}
    assert by[("g1", "dcgm_exporter")] == {"targets": ["10.0.0.1:9400"], "labels": {
        "node": "g1", "exporter": "dcgm_exporter", "run_id": "r1", "ranks": "0-7"}}
    assert by[("g2", "node_exporter")]["targets"] == ["[2001:db8::2]:9100"]
    assert by[("g3", "node_exporter")]["labels"] == {"node": "g3", "exporter": "node_exporter", "spare": "true"}


# ---------------------------------------------------------------- events


@pytest.fixture
def book(tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    (tmp_path / "runs" / "e1").mkdir(parents=True)
    (tmp_path / "runs" / "e1" / "run.json").write_text(json.dumps({"id": "e1", "state": "starting", "created": 1.0}))
    b = Book(Run("e1"))
    seen = []
    from orchestrator.observe.events import Watcher

    w = Watcher(b.rec)
    b.sink = lambda rec, line: seen.extend(w.sink(rec, line))
    return b, seen


def test_a_lost_node_and_a_restart_are_events_in_the_order_they_happened(book):
    b, seen = book
    b.connecting()
    st = [NodeStatus("n1", 0, "h1"), NodeStatus("n2", 1, "h2")]
    b.attempt_started(AttemptRecord(1, "e1", ["n1", "n2"]), st)
    b.launching("n1:0 n2:1", 2)
    b.running()
    b.tell("n2: silent for 3.0s (lost); reconnecting", event="node_silent", node="n2", silent_s=3.0)
    st[1].state, st[1].error = NodeState.LOST, "no answer for 5.0s"
    b.nodes_changed()
    b.attempt_changed(verdict="node lost", detail="n2 lost", retry=True, bad_nodes=["n2"])
    b.recovering("attempt 1: node lost")
    b.attempt_started(AttemptRecord(2, "e1.a2", ["n1", "n3"], prepared=["n3"]),
                      [NodeStatus("n1", 0, "h1"), NodeStatus("n3", 1, "h3")])
    b.attempt_changed(prepare_s=2.5)
    b.launching("n1:0 n3:1", 2)
    b.running()
    b.attempt_changed(verdict="finished")
    b.ended(RunResult(RunState.FINISHED, 0, "finished after 2 attempts"))
    assert [e["event"] for e in seen] == ["running", "node_silent", "node_lost", "attempt_failed", "restarting",
                                          "spare_prepared", "running", "finished"]
    by = {e["event"]: e for e in seen}
    assert by["node_lost"]["data"] == {"node": "n2", "reason": "no answer for 5.0s"}
    assert by["restarting"]["data"] == {"nodes": ["n1", "n3"], "spares": ["n3"], "replaced": ["n2"]}
    assert by["restarting"]["attempt"] == 2 and by["finished"]["data"]["exit_code"] == 0
    assert by["node_silent"]["data"] == {"node": "n2", "silent_s": 3.0}
    import jsonschema

    schema = json.loads((ROOT / "orchestrator" / "schemas" / "event.json").read_text())
    for i, e in enumerate(seen):
        jsonschema.validate({**e, "seq": i + 1}, schema)
    with pytest.raises(jsonschema.ValidationError):  # the schema holds each kind's data to its shape
        jsonschema.validate({**by["node_lost"], "seq": 1, "data": {"reason": "x"}}, schema)


def test_notify_on_names_events_and_aliases():
    assert parse_kinds("node_lost, end") == {"node_lost", "finished", "failed", "stopped"}
    assert parse_kinds("all") == set(KINDS)
    with pytest.raises(ValueError, match="'lost' is not an event"):
        parse_kinds("lost")


class Hook(http.server.ThreadingHTTPServer):
    """Answers each POST with the next code of `codes` (then 204), keeping what it got."""

    def __init__(self, codes=()):
        self.codes, self.got = list(codes), []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.got.append((dict(self.headers), body))
                self.send_response(outer.codes.pop(0) if outer.codes else 204)
                self.end_headers()

            def log_message(self, *a):
                pass

        super().__init__(("127.0.0.1", 0), H)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}/"


DOC_EVENT = {"event": "node_lost", "seq": 1, "run_id": "r", "data": {"node": "n2"}}


def test_the_webhook_signs_the_body_and_retries_what_is_worth_it(monkeypatch):
    monkeypatch.setattr(delivery.time, "sleep", lambda s: None)
    said = []
    h = Hook([503, 503])
    Webhook(h.url, "k", said.append)(DOC_EVENT)
    assert len(h.got) == 3 and not said  # two 503s, then taken
    headers, body = h.got[-1]
    assert json.loads(body) == DOC_EVENT and headers["X-Clusterctl-Event"] == "node_lost"
    assert verify(body, headers["X-Clusterctl-Signature"], "k")
    assert not verify(body, headers["X-Clusterctl-Signature"], "wrong") and not verify(body + b" ", sign(body, "k"), "k")
    h2 = Hook([400])
    Webhook(h2.url, None, said.append)(DOC_EVENT)
    assert len(h2.got) == 1 and "X-Clusterctl-Signature" not in h2.got[0][0]  # final, and unsigned without a secret
    assert said == [f"webhook {h2.url}: event node_lost #1 not delivered (HTTP 400)"]
    h.shutdown()
    h2.shutdown()


def test_an_outbox_never_blocks_its_caller(monkeypatch):
    """The endpoint never answers: every put returns at once; past the queue's bound events are
    dropped and counted, and closing says how many were not delivered."""
    stuck = threading.Event()
    ob = Outbox("dead", lambda doc: stuck.wait(), lambda k: True)
    for i in range(delivery.QUEUE_MAX * 2):
        ob.put({"event": "heartbeat", "seq": i})
    assert ob.dropped >= delivery.QUEUE_MAX - 1
    left = ob.close(0.0)
    assert left >= delivery.QUEUE_MAX * 2 - 1
    stuck.set()


# ---------------------------------------------------------------- trackers


def test_every_attempt_gets_the_same_tracker_identity_and_the_users_own_win(tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    (tmp_path / "runs" / "t-20250101-000000-abcd").mkdir(parents=True)
    run = Run("t-20250101-000000-abcd")
    inv = parse_inventory(yaml.safe_dump({"nodes": [{"name": "a", "host": "h1"},
                                                    {"name": "b", "host": "h2", "env": {"WANDB_RUN_GROUP": "mine"}}]}),
                          "<t>")
    env = trackers.attempt_env(run, 1, inv, print)
    assert env["a"] == {"WANDB_RUN_ID": "t-20250101-000000-abcd", "WANDB_RESUME": "allow",
                        "WANDB_RUN_GROUP": run.id, "MLFLOW_RUN_CONTEXT": json.dumps({"clusterctl.run_id": run.id})}
    assert "WANDB_RUN_GROUP" not in env["b"]  # the user's value is left to win
    (run.dir / trackers.FILE).write_text(json.dumps({"mlflow_run": "abc123"}))
    assert trackers.attempt_env(run, 2, inv, print)["a"]["MLFLOW_RUN_ID"] == "abc123"
    assert "MLFLOW_RUN_ID" not in trackers.attempt_env(run, 1, inv, print)["a"]
    long = trackers.wandb_id("x" * 80 + ".y")
    assert len(long) == 64 and re.fullmatch(r"[A-Za-z0-9_-]+", long) and long != trackers.wandb_id("x" * 81)


# ---------------------------------------------------------------- report


def test_the_report_is_one_self_contained_page(tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    d = write_run(tmp_path / "runs", "rep1", state="finished")
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(d / "tensorboard"))
    for step in range(1, 30):
        w.add_scalar("train/loss", 5.0 / step, step)
    w.close()
    (d / "story.jsonl").write_text(json.dumps({"at": 1.7e9 + 5, "text": "n2 lost", "event": "node_lost"}) + "\n")
    page = render(Run("rep1"), now=1.7e9 + 200)
    assert "rep1" in page and page.count('<g class="attempt">') == 2
    assert '<svg class="chart"' in page and "TensorBoard scalar train/loss" in page
    assert not re.search(r"<script|<link|src=|https?://(?!www\.w3\.org/2000/svg)", page)  # nothing fetched
    assert "n2 lost" in page and "attempt 2 resumed from ckpt_00000010.pt" in page
