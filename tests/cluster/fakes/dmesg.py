"""A fake ``dmesg`` for the test cluster: the kernel log of a node with the fake NVIDIA driver.

Installed as ``<node bin_dir>/dmesg`` next to the fake nvidia-smi and reading the same state
(``nvidia-smi.state``): ``kernel_log`` is a list of (epoch seconds, message), printed as
``dmesg --time-format iso`` prints them (UTC); ``dmesg_denied`` answers as dmesg does for a user
when kernel.dmesg_restrict is set. Runs with the system python and only the stdlib.
"""

import marshal
import os
import sys
import time

DENIED = "dmesg: read kernel buffer failed: Operation not permitted"


def main(argv):
    path = os.path.join(os.path.dirname(os.path.realpath(sys.argv[0])), "nvidia-smi.state")
    with open(path, "rb") as f:
        state = marshal.load(f)
    if state.get("dmesg_denied"):
        sys.stderr.write(DENIED + "\n")
        return 1
    iso = "iso" in argv or "--time-format=iso" in argv
    for when, message in state.get("kernel_log", ()):
        if iso:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)) + f",{int(when % 1 * 1e6):06d}+00:00"
        else:
            stamp = f"[{max(0.0, when - state.get('boot', when)):12.6f}]"
        sys.stdout.write(f"{stamp} {message}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
