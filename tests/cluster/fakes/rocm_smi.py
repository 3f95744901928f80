"""A fake ``rocm-smi`` for the test cluster, replaying a recorded ``rocm-smi --json`` answer.

Installed as ``<node bin_dir>/rocm-smi`` with its state in ``rocm-smi.state`` (marshal) next to it
(written by ``TestNode.set_gpus(..., vendor="amd")`` from tests/cluster/fakes.rocm_state). Each
``--show*`` flag prints the recorded keys that flag prints on the real tool; a flag whose keys the
recording lacks adds nothing, as on a card without that sensor. Only ``--json`` output.
Runs with the system python and only the stdlib.
"""

import marshal
import os
import sys

# flag -> which recorded keys it prints
SHOWS = {
    "--showuse": lambda k: k.startswith("GPU use"),
    "--showproductname": lambda k: k.startswith("Card ") or k in ("Subsystem ID", "Device Rev", "Node ID",
                                                                  "GUID", "GFX Version"),
    "--showid": lambda k: k in ("GPU ID", "Device Name", "Device ID"),
    "--showtemp": lambda k: k.startswith("Temperature"),
    "--showpower": lambda k: "Package Power" in k,
    "--showuniqueid": lambda k: k == "Unique ID",
}


def load_state():
    path = os.path.join(os.path.dirname(os.path.realpath(sys.argv[0])), "rocm-smi.state")
    with open(path, "rb") as f:
        return marshal.load(f)


def dumps(value, indent=0):
    """JSON for nested dicts of strings (the stdlib json import costs more than this fake's run)."""
    if isinstance(value, dict):
        pad = "    " * (indent + 1)
        items = [f'{pad}"{k}": {dumps(v, indent + 1)}' for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "    " * indent + "}" if items else "{}"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def main(argv):
    state = load_state()
    args = list(argv)
    if "--json" not in args:
        sys.stderr.write("fake rocm-smi: only --json output is recorded\n")
        return 2
    if "--showpids" in args:
        out = {"system": {f"PID{pid}": f"{name}, 1, {mib * 1024 * 1024}, 0, 0"
                          for pid, name, mib in state["processes"]}}
    else:
        wanted = [SHOWS[a] for a in args if a in SHOWS]
        if "--showmeminfo" in args:
            i = args.index("--showmeminfo")
            kind = args[i + 1] if i + 1 < len(args) else "vram"
            wanted.append(lambda k, kind=kind.upper(): k.startswith(kind + " Total"))
        out = {}
        for card, keys in state["cards"].items():
            out[card] = {k: v for k, v in keys.items() if any(w(k) for w in wanted)}
    sys.stdout.write(dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
