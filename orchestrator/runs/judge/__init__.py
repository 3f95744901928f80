"""The watch plane: what judges an attempt while it runs, from its ranks' progress and snapshots.

- hangwatch.py: the hang watch over one attempt (asks, decides, takes the snapshot, ends or
  restarts by --on-hang); hangrule.py its rule (who waits for whom, from the ranks' progress);
  hangsnap.py one rank at one moment as its node saw it; hang.py the verdict from every rank's
  snapshot (`clusterctl stack` prints the same snapshots).
- straggler.py: each rank's compute per step judged against the median, and its watch;
  stragglersnap.py what it asks of the nodes (progress without log streams, clock offsets);
  warmhold.py its hold while the run's warm interpreters import torch.

They read the ranks' progress (runs/progress.py, runs/progresslog.py) and report through the
record; the lifecycle (runs/attempt.py) starts and stops them.
"""
