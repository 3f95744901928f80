"""A fake ``nvidia-smi`` for the test cluster, replaying a recorded ``--query-gpu`` answer.

Installed as ``<node bin_dir>/nvidia-smi`` with its state in ``nvidia-smi.state`` (marshal) next to it
(written by ``TestNode.set_gpus`` from tests/cluster/fakes.gpu_state). ``--query-gpu`` answers any
field the recorded driver printed, with the recorded texts and units (dropped for ``nounits``);
``--query-compute-apps``, ``-L`` and the plain table follow the real tool's layout; ``-q`` and
``nvlink --status`` replay recorded answers (tests/fixtures/gpus/health) for every GPU, with the
per-GPU overrides of the state (a pending row remap, an inactive link).
Runs with the system python and only the stdlib.
"""

import marshal
import os
import sys
import time

# Names --query-gpu also accepts for a field (the header repeats the name asked for).
GPU_ALIASES = {"gpu_name": "name", "gpu_uuid": "uuid", "gpu_bus_id": "pci.bus_id", "gpu_serial": "serial"}
# compute-apps field -> (key in the process record, unit, header name)
APP_FIELDS = {
    "pid": ("pid", None, "pid"),
    "process_name": ("name", None, "process_name"),
    "name": ("name", None, "process_name"),
    "used_memory": ("used_memory", "MiB", "used_gpu_memory"),
    "used_gpu_memory": ("used_memory", "MiB", "used_gpu_memory"),
    "gpu_uuid": ("gpu_uuid", None, "gpu_uuid"),
    "gpu_name": ("gpu_name", None, "gpu_name"),
    "gpu_bus_id": ("gpu_bus_id", None, "gpu_bus_id"),
}


def load_state():
    path = os.path.join(os.path.dirname(os.path.realpath(sys.argv[0])), "nvidia-smi.state")
    with open(path, "rb") as f:
        return marshal.load(f)


def strip_unit(text, unit):
    return text[:-len(unit) - 1] if unit and text.endswith(" " + unit) else text


def bad_field(field):
    sys.stdout.write(f'Field "{field}" is not a valid field to query.\n\n')
    sys.exit(2)


def format_opts(fmt):
    opts = set(fmt.split(","))
    if "csv" not in opts:
        sys.stderr.write('"--format" option must contain "csv".\n')
        sys.exit(2)
    return "noheader" in opts, "nounits" in opts


def gpu_lines(state, gpus, fields, fmt):
    noheader, nounits = format_opts(fmt)
    units = dict(state["fields"])
    keys = []
    for field in fields:
        key = GPU_ALIASES.get(field, field)
        if key not in units:
            bad_field(field)
        keys.append((field, key, units[key]))
    out = [] if noheader else [", ".join(f if u is None or nounits else f"{f} [{u}]" for f, _, u in keys)]
    for rec in gpus:
        out.append(", ".join(strip_unit(rec[k], u) if nounits else rec[k] for _, k, u in keys))
    return out


def app_lines(apps, fields, fmt):
    noheader, nounits = format_opts(fmt)
    specs = []
    for field in fields:
        if field not in APP_FIELDS:
            bad_field(field)
        specs.append(APP_FIELDS[field])
    out = [] if noheader else [", ".join(h if u is None or nounits else f"{h} [{u}]" for _, u, h in specs)]
    for rec in apps:
        out.append(", ".join(str(rec[k]) if u is None or nounits else f"{rec[k]} {u}" for k, u, _ in specs))
    return out


def selected_gpus(state, ids):
    return [g for g in state["gpus"] if ids is None or g["index"] in ids or g["uuid"] in ids]


def app_records(state, ids):
    by_uuid = {g["uuid"]: g for g in state["gpus"]}
    recs = []
    for proc in state["processes"]:
        gpu = by_uuid.get(proc["gpu_uuid"], {})
        if ids is not None and gpu.get("index") not in ids and proc["gpu_uuid"] not in ids:
            continue
        rec = dict(proc)
        rec["gpu_name"] = gpu.get("name", "")
        rec["gpu_bus_id"] = gpu.get("pci.bus_id", "")
        recs.append(rec)
    return recs


def list_gpus(state):
    return [f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})" for g in state["gpus"]]


def number(text):
    head = text.split()[0] if text.split() else ""
    try:
        return float(head)
    except ValueError:
        return None


def table(state):
    """The plain `nvidia-smi` table (the 590 driver's layout, 91 columns)."""
    inner = 89
    rule = "+" + "-" * inner + "+"
    cells = "+-----------------------------------------+------------------------+----------------------+"
    driver = state["gpus"][0].get("driver_version", "") if state["gpus"] else ""
    out = [time.strftime("%a %b %d %H:%M:%S %Y") + "       ", rule]
    out.append(f"|{' NVIDIA-SMI ' + f'{driver:<22}Driver Version: {driver:<15}':<{inner}}|")
    out.append("|" + cells[1:-1] + "|")
    out.append("| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |")
    out.append("| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |")
    out.append("|                                         |                        |               MIG M. |")
    out.append("|=========================================+========================+======================|")
    for g in state["gpus"]:
        left = f"{g['index']:>4}  {g['name'][:29]}"
        out.append(f"|{left:<37}On  |{g.get('pci.bus_id', ''):>19} Off |{'0':>21} |")
        power = f"{int(number(g.get('power.draw', '')) or 0)}W / {int(number(g.get('power.limit', '')) or 0):>4}W"
        mem = f"{int(number(g['memory.used']) or 0)}MiB / {int(number(g['memory.total']) or 0):>6}MiB"
        util = f"{int(number(g.get('utilization.gpu', '')) or 0)}%"
        out.append(f"| N/A  {int(number(g.get('temperature.gpu', '')) or 0):>3}C    {g.get('pstate', ''):<3}"
                   f"{power:>23} |{mem:>23} |{util:>8}      Default |")
        out.append(f"|{'':41}|{'':24}|{'Disabled':>21} |")
        out.append(cells)
    out.append(" " * (inner + 2))
    out.append(rule)
    out.append(f"|{' Processes:':<{inner}}|")
    out.append(f"|{'  GPU   GI   CI              PID   Type   Process name':<{inner - 11}}GPU Memory |")
    out.append(f"|{'        ID   ID':<{inner - 11}}Usage      |")
    out.append("|" + "=" * inner + "|")
    apps = app_records(state, None)
    if not apps:
        out.append(f"|{'  No running processes found':<{inner}}|")
    index_of = {g["uuid"]: g["index"] for g in state["gpus"]}
    for app in apps:
        left = f"  {index_of.get(app['gpu_uuid'], '0'):>3}   N/A  N/A  {app['pid']:>15}      C   {app['name'][:35]}"
        right = f"{app['used_memory']}MiB "
        out.append(f"|{left:<{inner - len(right)}}{right}|")
    out.append(rule)
    return out


def overridden(block, values):
    """The recorded `-q` lines of one GPU with the values at some paths replaced
    ({"Remapped Rows/Pending": "Yes"}): a line's path is its section titles and its key."""
    stack, out = [], []
    for line in block:
        key, sep, value = line.partition(" : ")
        name = (key if sep else line).strip()
        if not name:
            out.append(line)
            continue
        indent = len(line) - len(line.lstrip(" "))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([k for _, k in stack] + [name])
        if sep and path in values:
            line = key + sep + values[path]
        if not sep or not value.strip():
            stack.append((indent, name))
        out.append(line)
    return out


def query(state):
    """`nvidia-smi -q`: the recording's header, then its one GPU's block for every GPU, with this
    GPU's bus id, uuid and minor number and the state's overrides for it."""
    lines = state["query"].split("\n")
    first = next(i for i, line in enumerate(lines) if line.startswith("GPU "))
    out = []
    for line in lines[:first]:
        key, sep, _ = line.partition(" : ")
        out.append(key + sep + str(len(state["gpus"])) if key.strip() == "Attached GPUs" else line)
    for g in state["gpus"]:
        values = {"PCI/Bus Id": g["pci.bus_id"], "GPU UUID": g["uuid"], "Minor Number": g["index"]}
        values.update(state["health"].get(int(g["index"]), {}))
        out.append("GPU " + g["pci.bus_id"])
        out.extend(overridden(lines[first + 1:], values))
    return out[:-1] if out and out[-1] == "" else out


def nvlink(state):
    """`nvidia-smi nvlink --status`: the recorded links under every GPU, `<inactive>` where the state
    takes a link down."""
    links = [line for line in state["nvlink"].splitlines() if line.strip().startswith("Link ")]
    out = []
    for g in state["gpus"]:
        out.append(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})")
        down = state["nvlink_down"].get(int(g["index"]), ())
        for line in links:
            number = int(line.split(":")[0].split()[-1])
            out.append(line.split(":")[0] + ": <inactive>" if number in down else line)
    return out


def main(argv):
    state = load_state()
    if state.get("broken"):
        sys.stdout.write(state["broken"].rstrip("\n") + "\n")
        return 9
    opts = {}
    flags = set()
    ids = None
    it = iter(argv)
    for arg in it:
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            opts[key] = value
        elif arg in ("--format", "--query-gpu", "--query-compute-apps"):
            opts[arg] = next(it, "")
        elif arg in ("-i", "--id"):
            ids = set(next(it, "").split(","))
        else:
            flags.add(arg)
    if "--id" in opts:
        ids = set(opts.pop("--id").split(","))
    if "--query-gpu" in opts:
        fields = [f.strip() for f in opts["--query-gpu"].split(",")]
        lines = gpu_lines(state, selected_gpus(state, ids), fields, opts.get("--format", ""))
    elif "--query-compute-apps" in opts:
        fields = [f.strip() for f in opts["--query-compute-apps"].split(",")]
        lines = app_lines(app_records(state, ids), fields, opts.get("--format", ""))
    elif "-q" in flags or "--query" in flags:
        lines = query(state)
    elif argv[:1] == ["nvlink"] and ("--status" in flags or "-s" in flags):
        lines = nvlink(state)
    elif "-L" in flags or "--list-gpus" in flags:
        lines = list_gpus(state)
    elif not flags and not opts:
        lines = table(state)
    else:
        sys.stderr.write(f"fake nvidia-smi: unsupported arguments {argv}\n")
        return 2
    sys.stdout.write("".join(line + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
