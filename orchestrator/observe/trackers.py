"""Experiment trackers that continue the run: every attempt of a run writes to the same tracker run.

Each attempt's processes get, on every node (a value the user set in the inventory's env, a node's
env or train.env wins, and is left alone):

  W&B     WANDB_RUN_ID (from the run id: `wandb_id`), WANDB_RESUME=allow, WANDB_RUN_GROUP (the run id):
          a script's plain `wandb.init(project=...)` creates the run in attempt 1 and resumes it in
          every later attempt.
  MLflow  MLFLOW_RUN_CONTEXT={"clusterctl.run_id": RUN}: the run a script's plain
          `mlflow.start_run()` creates is tagged with the clusterctl run. Before attempt k>1 the
          control machine looks that run up (mlflowctl.py `find`, in its own process, with a
          timeout) and hands it on as MLFLOW_RUN_ID, which `mlflow.start_run()` resumes. That needs
          MLFLOW_TRACKING_URI in the nodes' env, pointing where this machine can reach too (a
          tracking server, or a shared path), and mlflow installed here; without either, each
          attempt's run carries the tag, and the supervisor's log says why they are not one run.

When the run ends, the MLflow runs tagged with it that are still RUNNING are ended as the run ended
(FINISHED, FAILED, KILLED for a stopped run), and a failed or stopped run's are marked so even when
the script's exit handler marked them FINISHED. W&B ends its own runs (a run whose process was
killed is marked crashed by W&B).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from typing import Callable

from orchestrator.inventory import Inventory, Node
from orchestrator.runs.store import Run, read_json, write_json

TAG = "clusterctl.run_id"
WANDB_ID_MAX = 64
FILE = "trackers.json"  # runs/RUN/trackers.json: the MLflow run once found
MLFLOW_TIMEOUT = 60.0  # one look-up or end, mlflow's import included
END_STATUS = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}


def wandb_id(run_id: str) -> str:
    """A W&B run id from the run id: letters, digits, '-' and '_', at most WANDB_ID_MAX characters
    (a longer one keeps its start and a hash of the whole)."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "-", run_id)
    if len(safe) <= WANDB_ID_MAX:
        return safe
    return f"{safe[:WANDB_ID_MAX - 13]}-{hashlib.sha256(run_id.encode()).hexdigest()[:12]}"


def users(inv: Inventory, node: Node) -> dict[str, str]:
    """What the user set for a node's processes (torchrun.node_env's own layers)."""
    return {**inv.env, **node.env, **inv.train.env}


def tracker_env(run_id: str, mlflow_run: str | None = None) -> dict[str, str]:
    env = {"WANDB_RUN_ID": wandb_id(run_id), "WANDB_RESUME": "allow", "WANDB_RUN_GROUP": run_id,
           "MLFLOW_RUN_CONTEXT": json.dumps({TAG: run_id})}
    if mlflow_run:
        env["MLFLOW_RUN_ID"] = mlflow_run
    return env


def attempt_env(run: Run, attempt: int, inv: Inventory, say: Callable[[str], None]) -> dict[str, dict[str, str]]:
    """node -> the tracker variables of this attempt, the user's own left out. Never raises."""
    mlflow_run = None
    if attempt > 1:
        try:
            mlflow_run = continued_mlflow_run(run, inv, say)
        except Exception as e:  # noqa: BLE001 - a tracker is never worth the attempt
            say(f"mlflow: {type(e).__name__}: {e}")
    base = tracker_env(run.id, mlflow_run)
    return {n.name: {k: v for k, v in base.items() if k not in users(inv, n)} for n in inv.nodes}


def mlflow_settings(inv: Inventory) -> dict[str, str]:
    """The MLFLOW_* variables the master's processes get from the user (the tracking URI, its token)."""
    return {k: v for k, v in users(inv, inv.master).items() if k.startswith("MLFLOW_")}


def mlflowctl(args: list[str], settings: dict[str, str]) -> tuple[int, str]:
    """Run mlflowctl.py in its own process (mlflow's import and its HTTP retries stay out of the
    supervisor) -> (exit code, its output)."""
    env = {**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10", **settings}
    env.pop("MLFLOW_RUN_ID", None)
    try:
        p = subprocess.run([sys.executable, "-m", "orchestrator.observe.mlflowctl", *args], env=env,
                           capture_output=True, text=True, timeout=MLFLOW_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return 124, f"no answer within {MLFLOW_TIMEOUT:g}s"
    return p.returncode, (p.stdout.strip() or p.stderr.strip()[-500:])


def _usable(settings: dict[str, str]) -> str | None:
    """Why this machine cannot reach the nodes' MLflow store (None: it can try)."""
    uri = settings.get("MLFLOW_TRACKING_URI", "")
    if not uri:
        return "MLFLOW_TRACKING_URI is not in the nodes' env (the default ./mlruns is each node's own)"
    if uri.startswith(("file:///", "/", "databricks")) or ("://" in uri and not uri.startswith("file:")):
        return None
    return f"MLFLOW_TRACKING_URI {uri} is a relative path, on each node its own"


def continued_mlflow_run(run: Run, inv: Inventory, say: Callable[[str], None]) -> str | None:
    """The MLflow run an earlier attempt created (tagged with the run), looked up once and kept."""
    doc = read_json(run.dir / FILE) or {}
    if doc.get("mlflow_run"):
        return doc["mlflow_run"]
    settings = mlflow_settings(inv)
    if "MLFLOW_TRACKING_URI" not in settings:
        return None  # no MLflow store this machine could look in (none, or each node's own ./mlruns)
    why = _usable(settings)
    code, out = (1, why) if why else mlflowctl(["find", run.id], settings)
    if code == 0 and out:
        write_json(run.dir / FILE, {"mlflow_run": out, "tracking_uri": settings.get("MLFLOW_TRACKING_URI")})
        say(f"mlflow: attempts go on in MLflow run {out}")
        return out
    if code == 0:
        say("mlflow: no MLflow run is tagged with this run yet; the next attempt's run will be")
    else:
        say(f"mlflow: this attempt starts its own MLflow run (tagged {TAG}={run.id}): {out}")
    return None


def end(run: Run, say: Callable[[str], None]) -> None:
    """The run ended: its MLflow runs end the same way (END_STATUS). Never raises."""
    try:
        rec = run.record
        status = END_STATUS.get(rec.state.value)
        settings = mlflow_settings(run.spec.load_inventory())
        if status is None or "MLFLOW_TRACKING_URI" not in settings or _usable(settings):
            return
        code, out = mlflowctl(["end", run.id, status], settings)
        say(f"mlflow: {out}" if code == 0 else f"mlflow: could not end the run's MLflow runs: {out}")
    except Exception as e:  # noqa: BLE001 - a tracker never changes how the run ended
        say(f"mlflow: {type(e).__name__}: {e}")
