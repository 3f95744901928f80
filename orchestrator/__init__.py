"""clusterctl: preflight, launch, stream and tear down torchrun jobs on bare-metal GPU nodes."""

__version__ = "0.1.0"
