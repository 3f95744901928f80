"""The checkpoint plane: a run's checkpoints carried off any single node, and back.

Two kinds of checkpoint directory, each kept in two ways; a module per cell:

                        copied home (the control machine)   node to node (never through it)
  the given directory   given_home.py                       given_replicas.py
  the job's own dir     jobdir_home.py                      jobdir_replicas.py

- The given directory: CLUSTERCTL_CHECKPOINT_DIR (and CLUSTERCTL_TENSORBOARD_DIR), which clusterctl
  makes on each node and hands the job; the trainer's own marks (a sha256 sidecar, a manifest)
  say when a checkpoint is complete.
- The job's own directory: `train --checkpoint-dir DIR` (nanoGPT's out/, a Trainer's output_dir),
  any names, complete once its writer closed it. jobdir_setaside.py keeps what DIR held before
  the run out of the run.

The lifecycle (runs/restart.py, runs/readying.py, the controller) decides when; these modules say how.
"""
