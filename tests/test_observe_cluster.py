"""A run seen from outside, on the real test cluster (gloo on CPU): one run with a node cut for good
and a spare taking its place, watched at once by a real Prometheus scraping `clusterctl metrics
serve`, a signed webhook (and a dead one), --notify-on, W&B (offline) and MLflow (a local file
store) in the job itself; afterwards `clusterctl report` rendered by headless Chromium with the
network off. One run serves every test here (module fixture): a cluster run costs minutes."""

import hashlib
import hmac
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.cluster import TestCluster, require_root
from tests.conftest import kill_supervisors, wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "scripts" / "observed_job.py"
SECRET = "s3cret-for-the-test"
STEPS = 80


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Receiver(http.server.ThreadingHTTPServer):
    """A webhook endpoint: every POST kept as (headers, body), answered 204."""

    def __init__(self):
        self.got: list[tuple[dict, bytes]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *a):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"

    def events(self) -> list[dict]:
        return [json.loads(b) for _, b in self.got]


class Blackhole:
    """A dead endpoint: connections are accepted and never answered."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"


def query(prom: str, q: str) -> list:
    with urllib.request.urlopen(f"{prom}/api/v1/query?{urllib.parse.urlencode({'query': q})}", timeout=10) as r:
        doc = json.loads(r.read())
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


def value(prom: str, q: str) -> float | None:
    res = query(prom, q)
    return float(res[0]["value"][1]) if res else None


def start_prometheus(tmp: Path, exporter_port: int, targets: Path) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    cfg = tmp / "prometheus.yml"
    cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": "clusterctl", "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}]},
            {"job_name": "nodes", "scrape_interval": "15s", "file_sd_configs": [{"files": [str(targets)],
                                                                                 "refresh_interval": "1s"}]}]}))
    targets.write_text("[]")
    proc = subprocess.Popen(["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "prometheus.log", "wb"))
    url = f"http://127.0.0.1:{port}"

    def ready():
        try:
            return urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    wait_for(ready, 60, "prometheus to be ready")
    return proc, url, cfg


def inventory(cluster: TestCluster, tmp: Path, shared: Path) -> str:
    for n in cluster.nodes:
        n.run("mkdir -p ~/gpt_train && echo 'the run code' > ~/gpt_train/README.md")
    nodes = cluster.inventory()["nodes"]
    nodes[-1]["spare"] = True
    return str(cluster.write_inventory(tmp / "nodes.yaml", nodes=nodes, env={
        "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline", "WANDB_DIR": str(shared), "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": f"file://{shared}/mlruns", "MLFLOW_ALLOW_FILE_STORE": "true"},
        train={"max_restarts": 2, "hang_timeout": 0, "straggler_factor": 0}))


def rank0_log(run_dir: Path) -> str:
    p = run_dir / "ranks" / "rank0.log"
    return p.read_text(errors="replace") if p.exists() else ""


def newest_step(run_dir: Path) -> int:
    steps = [int(ln.split()[1]) for ln in rank0_log(run_dir).splitlines() if ln.startswith("step ")]
    return max(steps, default=0)


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    require_root()
    tmp = tmp_path_factory.mktemp("observe")
    shared = Path(tempfile.mkdtemp(prefix="cc-observe-", dir="/tmp"))  # every node's namespace sees /tmp
    shared.chmod(0o777)
    home = tmp / "cchome"
    env = {**os.environ, "CLUSTERCTL_HOME": str(home), "CLUSTERCTL_WEBHOOK_SECRET": SECRET}
    procs: list[subprocess.Popen] = []
    cluster = TestCluster(n=3, gpus=0, name_prefix="ccobs").start()
    receiver, dead = Receiver(), Blackhole()
    try:
        inv = inventory(cluster, tmp, shared)
        exporter_port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "metrics", "serve", "--port",
                                       str(exporter_port)], env=env, stderr=subprocess.DEVNULL))
        targets = tmp / "targets.json"
        prom, prom_url, cfg = start_prometheus(tmp, exporter_port, targets)
        procs.append(prom)
        notified = tmp / "notified.jsonl"
        train = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "train", "-i", inv, "--lost-timeout", "5",
             "--webhook", receiver.url, "--webhook", dead.url, "--heartbeat", "3",
             "--notify", f"printf '%s ' \"$CLUSTERCTL_EVENT\" >> {tmp / 'kinds.txt'}; cat >> {notified}",
             "--notify-on", "node_lost,restarting,finished",
             "--", str(JOB), "--steps", str(STEPS), "--trackers"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(train)
        run_dir = wait_for(lambda: next(iter((home / "runs").glob("*/run.json")), None) if (home / "runs").exists()
                           else None, 60, "the run directory").parent

        def ready():
            if train.poll() is not None:
                pytest.fail(f"the run ended before the cut:\n{train.stderr.read()[-3000:]}")
            return "trackers:" in rank0_log(run_dir) and newest_step(run_dir) >= 12 and \
                list((run_dir / "checkpoints").glob("ckpt_*.pt.sha256"))

        wait_for(ready, 240, "attempt 1 at step 12 with a checkpoint copied home")
        tg = subprocess.run([sys.executable, "-m", "orchestrator.cli", "metrics", "targets", "-i", inv, "-o",
                             str(targets)], env=env, capture_output=True, text=True, timeout=60)
        cut_at = newest_step(run_dir)
        cluster.nodes[1].link_down()  # n2 never answers again; the spare takes its place
        out, err = train.communicate(timeout=300)
        run_id = run_dir.name
        # one scrape after the end at least, then read what Prometheus holds
        wait_for(lambda: value(prom_url, f'clusterctl_run_state{{run_id="{run_id}",state="finished"}}') == 1, 30,
                 "Prometheus to scrape the finished run")
        ns = SimpleNamespace(
            tmp=tmp, home=home, env=env, run_dir=run_dir, run_id=run_id, code=train.returncode, out=out, err=err,
            rec=json.loads((run_dir / "run.json").read_text()), cluster=cluster, shared=shared, cut_at=cut_at,
            receiver=receiver, dead=dead, notified=notified, prom=prom_url, cfg=cfg, targets=targets, tg=tg,
            exporter=f"http://127.0.0.1:{exporter_port}/metrics", inv=inv)
        yield ns
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        kill_supervisors(home)
        receiver.shutdown()
        dead.sock.close()
        cluster.close()
        shutil.rmtree(shared, ignore_errors=True)


def test_the_run_restarts_onto_the_spare(observed):
    o = observed
    assert o.code == 0, o.err[-3000:]
    names = [n.name for n in o.cluster.nodes]
    verdicts = [(a["attempt"], a["nodes"], a["verdict"]) for a in o.rec["attempts"]]
    assert verdicts == [(1, names[:2], "node lost"), (2, [names[0], names[2]], "finished")], verdicts


def test_prometheus_scrapes_the_restart_step_and_no_error(observed):
    o = observed
    rid = o.run_id
    assert value(o.prom, f'clusterctl_run_restarts_total{{run_id="{rid}"}}') == 1
    assert value(o.prom, f'clusterctl_run_step{{run_id="{rid}"}}') >= STEPS
    assert value(o.prom, f'clusterctl_run_lost_nodes_total{{run_id="{rid}"}}') == 1
    # scraped while it ran: attempt 1, the lost node before the restart, and attempt 2, as they happened
    assert value(o.prom, f'max_over_time(clusterctl_run_state{{run_id="{rid}",state="running"}}[1h])') == 1
    assert value(o.prom, f'max_over_time(clusterctl_run_attempt{{run_id="{rid}"}}[1h])') == 2
    assert value(o.prom, f'min_over_time((clusterctl_run_attempt{{run_id="{rid}"}} > 0)[1h:1s])') == 1
    assert value(o.prom, f'max_over_time(clusterctl_run_tokens_per_second{{run_id="{rid}"}}[1h])') > 0
    with urllib.request.urlopen(f"{o.prom}/api/v1/targets", timeout=10) as r:
        active = json.loads(r.read())["data"]["activeTargets"]
    ours = [t for t in active if t["labels"]["job"] == "clusterctl"]
    assert ours and ours[0]["health"] == "up" and ours[0]["lastError"] == "", ours
    assert value(o.prom, 'sum(scrape_samples_post_metric_relabeling{job="clusterctl"})') > 0


def test_the_exposition_passes_promtool(observed):
    with urllib.request.urlopen(observed.exporter, timeout=10) as r:
        text = r.read()
    assert b"clusterctl_run_restarts_total" in text
    p = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_targets_file_is_accepted_by_prometheus(observed):
    o = observed
    assert o.tg.returncode == 0, o.tg.stderr
    groups = json.loads(o.targets.read_text())
    names = [n.name for n in o.cluster.nodes]
    labelled = {(g["labels"]["node"], g["labels"]["exporter"]): g["labels"] for g in groups}
    assert labelled[(names[0], "dcgm_exporter")]["run_id"] == o.run_id
    assert labelled[(names[0], "node_exporter")]["ranks"] == "0"
    assert labelled[(names[1], "node_exporter")]["ranks"] == "1"
    assert "run_id" not in labelled[(names[2], "node_exporter")]  # the spare, not yet in the run
    p = subprocess.run(["promtool", "check", "config", str(o.cfg)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    with urllib.request.urlopen(f"{o.prom}/api/v1/targets", timeout=10) as r:
        active = json.loads(r.read())["data"]["activeTargets"]
    nodes = {(t["labels"]["node"], t["labels"]["exporter"]) for t in active if t["labels"]["job"] == "nodes"}
    assert nodes == set(labelled), nodes  # Prometheus itself loaded every target group
    # promtool does read the file: the same config with a broken label in it fails
    bad = o.tmp / "bad-targets.json"
    bad.write_text(json.dumps([{"targets": ["x:9100"], "labels": {"bad-label": "x"}}]))
    cfg = yaml.safe_load(o.cfg.read_text())
    cfg["scrape_configs"][1]["file_sd_configs"][0]["files"] = [str(bad)]
    (o.tmp / "bad.yml").write_text(yaml.safe_dump(cfg))
    assert subprocess.run(["promtool", "check", "config", str(o.tmp / "bad.yml")], capture_output=True,
                          timeout=60).returncode != 0


def _signature_ok(headers: dict, body: bytes, secret: str) -> bool:
    want = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(headers.get("x-clusterctl-signature", ""), want)


def test_signed_events_arrive_in_order_and_a_dead_webhook_costs_the_run_nothing(observed):
    o = observed
    events = o.receiver.events()
    kinds = [e["event"] for e in events]
    story = [k for k in kinds if k in ("node_lost", "restarting", "spare_prepared", "finished")]
    assert story == ["node_lost", "restarting", "spare_prepared", "finished"], kinds
    lost = next(e for e in events if e["event"] == "node_lost")
    assert lost["data"]["node"] == o.cluster.nodes[1].name and lost["run_id"] == o.run_id
    restart = next(e for e in events if e["event"] == "restarting")
    assert restart["attempt"] == 2 and restart["data"]["spares"] == [o.cluster.nodes[2].name], restart
    assert "heartbeat" in kinds and "checkpoint_copied" in kinds and kinds.count("running") == 2, kinds
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    assert all(_signature_ok(h, b, SECRET) for h, b in o.receiver.got)
    assert not any(_signature_ok(h, b, "not-the-secret") for h, b in o.receiver.got)
    # the dead endpoint held its connection unanswered all along; the live one got everything, and
    # the run went through the same phases as any run with a lost node (test_the_run_restarts_onto_the_spare)
    assert o.dead.held, "the dead webhook was never tried"
    log = o.run_dir / "supervisor.log"
    wait_for(lambda: "not delivered" in log.read_text(), 60, "the supervisor to say what the dead webhook missed")


def test_notify_on_runs_the_command_for_the_chosen_events(observed):
    o = observed
    docs = [json.loads(ln) for ln in o.notified.read_text().splitlines()]
    assert [d["event"] for d in docs] == ["node_lost", "restarting", "finished"], docs
    assert (o.tmp / "kinds.txt").read_text().split() == ["node_lost", "restarting", "finished"]


def test_wandb_writes_every_attempt_to_one_run(observed):
    from orchestrator.observe.trackers import wandb_id

    o = observed
    said = [ln.split() for ln in rank0_log(o.run_dir).splitlines() if ln.startswith("trackers:")]
    assert [s[2] for s in said] == ["1", "2"], said
    assert {s[4] for s in said} == {wandb_id(o.run_id)}
    offline = sorted(p.name for p in (o.shared / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(p.endswith("-" + wandb_id(o.run_id)) for p in offline), offline


def test_mlflow_continues_one_run_and_ends_it_finished(observed):
    from mlflow.tracking import MlflowClient

    o = observed
    said = [ln.split() for ln in rank0_log(o.run_dir).splitlines() if ln.startswith("trackers:")]
    assert len({s[6] for s in said}) == 1 and len(said) == 2, said
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(f"file://{o.shared}/mlruns")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"tags.`clusterctl.run_id` = '{o.run_id}'")
    assert len(runs) == 1 and runs[0].info.run_id == said[0][6], runs
    assert runs[0].info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")]
    assert min(steps) == 1 and max(steps) == STEPS and any(s <= o.cut_at for s in steps)
    assert len(steps) > len(set(steps)) or len(steps) >= STEPS  # attempt 2 logged from its checkpoint on


def test_the_report_renders_offline_in_chromium(observed):
    o = observed
    page = o.tmp / "r.html"
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "report", o.run_id, "-o", str(page)], env=o.env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    chromium = shutil.which("chromium") or pytest.fail("chromium is not installed (scripts/test installs it)")
    shot = o.tmp / "r.png"
    base = ["unshare", "-n", chromium, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1100,1800",
            "--hide-scrollbars", f"--user-data-dir={o.tmp / 'chromium'}"]
    s = subprocess.run([*base, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120)
    assert shot.exists(), s.stderr[-2000:]
    dom = subprocess.run([*base, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert o.run_id in dom
    assert dom.count('<g class="attempt">') == 2, dom[:2000]
    assert '<svg class="chart"' in dom and '<polyline class="series"' in dom
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    colours = img.getcolors(maxcolors=1 << 20) or []
    ink = sum(n for n, c in colours if c != (255, 255, 255))
    assert len(colours) > 20 and ink > 0.02 * img.width * img.height, (len(colours), ink)
