"""The shipped trainer (`python -m trainer ARGS`) for a test whose relaunch need only resume and
finish: --resumed-max-steps M (taken off the arguments) lowers --max-steps to M on an attempt after
the first (CLUSTERCTL_ATTEMPT > 1), where the first attempt's --max-steps is long enough to be
interrupted. Every rank gets the same M (a bound read from each node's own checkpoints would differ
between ranks and mismatch their collectives). Everything else is the trainer as `python -m
trainer` runs it."""

import os
import runpy
import sys

args = sys.argv[1:]
if "--resumed-max-steps" in args:
    i = args.index("--resumed-max-steps")
    bound = int(args[i + 1])
    del args[i:i + 2]
    if int(os.environ.get("CLUSTERCTL_ATTEMPT", "1")) > 1:
        j = args.index("--max-steps")
        args[j + 1] = str(min(int(args[j + 1]), bound))
sys.argv = ["trainer", *args]
runpy.run_module("trainer", run_name="__main__", alter_sys=True)
