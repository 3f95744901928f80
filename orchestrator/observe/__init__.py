"""A run seen where people already look: Prometheus metrics (metrics.py, runview.py, targets.py),
events as they happen (events.py, webhook.py), experiment trackers that continue the run across
restarts (trackers.py, mlflowctl.py) and a self-contained HTML report (report.py, svg.py).

Everything here reads the control machine's run records (runs/store.py `Run.record`, a RunRecord of
runs/runrecord.py; runview.py reads run.json through the same type, only when it changed); only
events.py and trackers.py are called by the supervisor, and neither can change how a run goes.
"""
