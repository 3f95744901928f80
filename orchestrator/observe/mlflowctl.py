"""The control machine's calls to the nodes' MLflow store, run in their own process by trackers.py
(mlflow's import, logging and HTTP retries stay out of the supervisor):

    python -m orchestrator.observe.mlflowctl find RUN_ID         the oldest MLflow run tagged with the run
    python -m orchestrator.observe.mlflowctl end RUN_ID STATUS   end its tagged runs with STATUS

The store is the one MLFLOW_TRACKING_URI names (with its MLFLOW_* credentials) in this process's
environment. Exit 0 with the answer on stdout, else 1 with why on stderr.
"""

from __future__ import annotations

import sys

TAG = "clusterctl.run_id"  # trackers.py TAG (this file imports nothing of the package)


def tagged(client, run_id: str) -> list:
    """Every run in every active experiment tagged with `run_id`, the oldest first."""
    from mlflow.entities import ViewType

    exps = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
    if not exps:
        return []
    if not run_id.replace("-", "").replace("_", "").replace(".", "").isalnum():
        return []  # a run id is letters, digits, '-', '_' and '.' (runs/store.py new_run_id): nothing to quote
    return list(client.search_runs(exps, filter_string=f"tags.`{TAG}` = '{run_id}'",
                                   order_by=["attributes.start_time ASC"], max_results=100))


def main(argv: list[str]) -> int:
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        print("mlflow is not installed on this machine (pip install mlflow)", file=sys.stderr)
        return 1
    verb, run_id = argv[0], argv[1]
    try:
        client = MlflowClient()
        runs = tagged(client, run_id)
        if verb == "find":
            print(runs[0].info.run_id if runs else "")
            return 0
        status, ended = argv[2], []
        for r in runs:
            # a finished run's tracker runs the script ended are left as they are; a failed or
            # stopped run's are marked so, whatever the script's exit handler wrote
            if status == "FINISHED" and r.info.status != "RUNNING" or r.info.status == status:
                continue
            client.set_terminated(r.info.run_id, status)
            ended.append(r.info.run_id)
        print(f"MLflow run{'s' if len(ended) != 1 else ''} {', '.join(ended)} ended {status}" if ended
              else f"the run's MLflow runs ({len(runs)}) were already ended")
        return 0
    except Exception as e:  # noqa: BLE001 - one line for the supervisor's log
        print(f"{type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
