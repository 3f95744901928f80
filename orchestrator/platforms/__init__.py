"""Schedulers and platforms: SLURM and Kubernetes renders, and the in-pod launcher (`launch --from-env`)."""
