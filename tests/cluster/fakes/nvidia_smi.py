"""A fake ``nvidia-smi`` for the test cluster.

Installed as ``<node bin_dir>/nvidia-smi`` with its state in ``nvidia-smi.state`` (marshal) next to it
(written by ``TestNode.set_gpus``). Output formats follow real nvidia-smi (driver 550):
``--query-gpu`` / ``--query-compute-apps`` in csv with or without ``noheader``/``nounits``,
``--list-gpus`` / ``-L`` and the plain table. Runs with the system python and only the stdlib.
"""

import marshal
import os
import sys
import time

# field -> (key in the gpu record, unit or None). Aliases map to the same record key.
GPU_FIELDS = {
    "index": ("index", None),
    "name": ("name", None),
    "gpu_name": ("name", None),
    "uuid": ("uuid", None),
    "gpu_uuid": ("uuid", None),
    "serial": ("serial", None),
    "pci.bus_id": ("bus_id", None),
    "gpu_bus_id": ("bus_id", None),
    "driver_version": ("driver", None),
    "count": ("count", None),
    "compute_cap": ("compute_cap", None),
    "persistence_mode": ("persistence_mode", None),
    "memory.total": ("memory_total", "MiB"),
    "memory.used": ("memory_used", "MiB"),
    "memory.free": ("memory_free", "MiB"),
    "utilization.gpu": ("utilization", "%"),
    "utilization.memory": ("utilization_memory", "%"),
    "temperature.gpu": ("temperature", None),
    "power.draw": ("power_draw", "W"),
    "power.limit": ("power_limit", "W"),
    "pstate": ("pstate", None),
}
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


def fmt_value(value, unit, nounits):
    if isinstance(value, float):
        value = f"{value:.2f}"
    if unit is None or nounits:
        return str(value)
    return f"{value} {unit}"


def csv_lines(records, fields, table, fmt):
    opts = set(fmt.split(","))
    if "csv" not in opts:
        sys.stderr.write('"--format" option must contain "csv".\n')
        sys.exit(2)
    noheader, nounits = "noheader" in opts, "nounits" in opts
    specs = []
    for field in fields:
        if field not in table:
            sys.stdout.write(f'Field "{field}" is not a valid field to query.\n\n')
            sys.exit(2)
        specs.append((field, table[field]))
    out = []
    if not noheader:
        heads = []
        for field, spec in specs:
            head = spec[2] if len(spec) > 2 else field
            heads.append(head if spec[1] is None or nounits else f"{head} [{spec[1]}]")
        out.append(", ".join(heads))
    for rec in records:
        out.append(", ".join(fmt_value(rec[spec[0]], spec[1], nounits) for _, spec in specs))
    return out


def gpu_records(state, ids):
    gpus = state["gpus"]
    used = {}
    for proc in state["processes"]:
        used[proc["gpu_uuid"]] = used.get(proc["gpu_uuid"], 0) + proc["used_memory"]
    recs = []
    for gpu in gpus:
        if ids is not None and str(gpu["index"]) not in ids and gpu["uuid"] not in ids:
            continue
        rec = dict(gpu)
        rec["driver"] = state["driver"]
        rec["count"] = len(gpus)
        if rec.get("memory_used") is None:
            rec["memory_used"] = used.get(gpu["uuid"], 0)
        rec["memory_free"] = rec["memory_total"] - rec["memory_used"]
        recs.append(rec)
    return recs


def app_records(state, ids):
    by_uuid = {g["uuid"]: g for g in state["gpus"]}
    recs = []
    for proc in state["processes"]:
        gpu = by_uuid.get(proc["gpu_uuid"], {})
        if ids is not None and str(gpu.get("index")) not in ids and proc["gpu_uuid"] not in ids:
            continue
        rec = dict(proc)
        rec["gpu_name"] = gpu.get("name", "")
        rec["gpu_bus_id"] = gpu.get("bus_id", "")
        recs.append(rec)
    return recs


def list_gpus(state):
    return [f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})" for g in state["gpus"]]


def table(state):
    """The plain `nvidia-smi` table (driver 550 layout, 91 columns)."""
    inner = 89
    rule = "+" + "-" * inner + "+"
    cells = "+-----------------------------------------+------------------------+----------------------+"
    out = [time.strftime("%a %b %d %H:%M:%S %Y") + "       ", rule]
    head = (f" NVIDIA-SMI {state['driver']:<23}Driver Version: {state['driver']:<15}"
            f"CUDA Version: {state['cuda']}")
    out.append(f"|{head:<{inner}}|")
    out.append("|" + cells[1:-1] + "|")
    out.append("| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |")
    out.append("| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |")
    out.append("|                                         |                        |               MIG M. |")
    out.append("|=========================================+========================+======================|")
    for rec in gpu_records(state, None):
        left = f"{rec['index']:>4}  {rec['name'][:29]}"
        out.append(f"|{left:<37}On  |{rec['bus_id']:>19} Off |{'0':>21} |")
        power = f"{int(rec['power_draw'])}W / {int(rec['power_limit']):>4}W"
        mem = f"{rec['memory_used']}MiB / {rec['memory_total']:>6}MiB"
        util = f"{rec['utilization']}%"
        out.append(f"| N/A  {rec['temperature']:>3}C    {rec['pstate']:<3}{power:>23} |{mem:>23} |"
                   f"{util:>8}      Default |")
        out.append(f"|{'':41}|{'':24}|{'Disabled':>21} |")
        out.append(cells)
    out.append(" " * (inner + 2))
    out.append(rule)
    out.append(f"|{' Processes:':<{inner}}|")
    out.append(f"|{'  GPU   GI   CI        PID   Type   Process name':<{inner - 11}}GPU Memory |")
    out.append(f"|{'        ID   ID':<{inner - 11}}Usage      |")
    out.append("|" + "=" * inner + "|")
    apps = app_records(state, None)
    if not apps:
        out.append(f"|{'  No running processes found':<{inner}}|")
    index_of = {g["uuid"]: g["index"] for g in state["gpus"]}
    for app in apps:
        left = f"  {index_of.get(app['gpu_uuid'], 0):>3}   N/A  N/A  {app['pid']:>9}      C   {app['name'][:40]}"
        right = f"{app['used_memory']}MiB "
        out.append(f"|{left:<{inner - len(right)}}{right}|")
    out.append(rule)
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
        elif arg.startswith("--id="):
            ids = set(arg.split("=", 1)[1].split(","))
        else:
            flags.add(arg)
    if "--id" in opts:
        ids = set(opts.pop("--id").split(","))
    if "--query-gpu" in opts:
        fields = [f.strip() for f in opts["--query-gpu"].split(",")]
        lines = csv_lines(gpu_records(state, ids), fields, GPU_FIELDS, opts.get("--format", ""))
    elif "--query-compute-apps" in opts:
        fields = [f.strip() for f in opts["--query-compute-apps"].split(",")]
        lines = csv_lines(app_records(state, ids), fields, APP_FIELDS, opts.get("--format", ""))
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
