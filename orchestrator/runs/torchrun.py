"""The launch contract under the name the run modules import it by; it is defined in
orchestrator/torchrun.py, below the checks and platforms that share it."""

from orchestrator.torchrun import (  # noqa: F401
    dist_timeout_s,
    iface_env,
    nccl_buffsize,
    node_env,
    nproc_for,
    nprocs_for,
    rank_map,
    rank_map_text,
    scaled_env,
    target_argv,
    too_many_procs,
    torchrun_argv,
)
