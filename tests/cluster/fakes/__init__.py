"""Fake GPU tooling installed in each test node's private bin dir, replaying recorded outputs.

The fake nvidia-smi answers from a `--query-gpu` csv recorded on a real machine
(tests/fixtures/gpus, with the header and units nvidia-smi printed); the fake rocm-smi from a
recorded `rocm-smi --json` answer. A node with n GPUs takes the recording's first n rows,
repeating the last one when the recording has fewer. What a recording cannot give per GPU is
derived: the index, a uuid per node and GPU (recordings mask theirs), the PCI bus id and count.
"""

import csv
import json
import marshal
import os
import sys
import uuid
from pathlib import Path

FAKE_NVIDIA_SMI = Path(__file__).with_name("nvidia_smi.py")
FAKE_DMESG = Path(__file__).with_name("dmesg.py")
FAKE_ROCM_SMI = Path(__file__).with_name("rocm_smi.py")
RECORDINGS = Path(__file__).resolve().parents[2] / "fixtures" / "gpus"
# The test user cannot read pyenv shims under /root: use the real interpreter file.
_INTERPRETER = os.path.realpath(getattr(sys, "_base_executable", sys.executable))

# An idle H100 80GB HBM3, driver 590.48.01 (every field the driver knows).
NVIDIA_RECORDING = "nvidia_query_gpu_h100_590_idle.csv"
# The same H100's `nvidia-smi -q` and `nvidia-smi nvlink --status` (18 links up).
NVIDIA_QUERY_RECORDING = "health/nvidia_q_h100_590_idle.txt"
NVLINK_RECORDING = "health/nvlink_h100_590.txt"
# An Xid from a real kernel log (dmesg --time-format iso): 48, a double-bit ECC error.
XID_RECORDING = "health/dmesg_iso_gpud.log"
# A Radeon RX 7900 XT, rocm-smi --showproductname --showuse --showmeminfo vram --json.
ROCM_RECORDING = "rocm_json_rx7900xt_marimo9237.json"


def read_query_gpu(name):
    """A recorded `--query-gpu ... --format=csv` answer: ([(field, unit or None)], [row texts])."""
    with open(RECORDINGS / name, newline="") as f:
        rows = [r for r in csv.reader(f, skipinitialspace=True) if r]
    fields = []
    for head in rows[0]:
        field, _, unit = head.partition(" [")
        fields.append((field.strip(), unit.rstrip("]") or None))
    return fields, [[c.strip() for c in r] for r in rows[1:]]


def _with_unit(value, unit):
    return str(value) if unit is None else f"{value} {unit}"


def fake_bus_id(i):
    """The PCI bus id the fake gives GPU i (recordings have one GPU's)."""
    return f"00000000:{0x18 + 0x10 * i:02X}:00.0"


def xid_message(gpu_index, code=48, recording=XID_RECORDING):
    """The message of the recording's first Xid line with that code (its time stamp cut off),
    naming fake GPU gpu_index's PCI address instead of the recorded one."""
    for line in (RECORDINGS / recording).read_text().splitlines():
        head, sep, rest = line.partition("NVRM: Xid (PCI:")
        if sep and rest.split("): ", 1)[1].startswith(f"{code},"):
            bus = fake_bus_id(gpu_index)
            return "NVRM: Xid (PCI:" + bus[4:].rsplit(".", 1)[0].lower() + "): " + rest.split("): ", 1)[1]
    raise ValueError(f"no Xid {code} in {recording}")


def gpu_state(node_name, n, processes=(), recording=NVIDIA_RECORDING, memory_used=None,
              utilization=None, temperature=None, broken=None, health=None, nvlink_down=None,
              kernel_log=(), dmesg_denied=False):
    """The state the fake nvidia-smi answers from: the recording's rows for n GPUs.

    processes: (pid, name, used_mib) or (pid, name, used_mib, gpu_index); gpu_index defaults
    to 0. Their memory is added to the recorded memory.used of their GPU unless memory_used
    (MiB, every GPU) is given. utilization (%) and temperature (C) replace the recorded
    reading on every GPU. broken: text printed instead of any answer, with exit code 9 (like a
    driver/library mismatch). health: {gpu_index: {"Remapped Rows/Pending": "Yes", ...}}, values
    `nvidia-smi -q` shows instead of the recorded ones (paths of section titles and key);
    nvlink_down: {gpu_index: [link, ...]} shown `<inactive>`. kernel_log: [(epoch seconds,
    message)], what the fake dmesg prints (see xid_message); dmesg_denied: dmesg refuses to read.
    """
    fields, rows = read_query_gpu(recording)
    units = dict(fields)
    gpus = []
    for i in range(n):
        rec = dict(zip((f for f, _ in fields), rows[min(i, len(rows) - 1)]))
        rec["index"] = str(i)
        rec["uuid"] = "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{node_name}.gpu{i}"))
        if "pci.bus_id" in rec:
            rec["pci.bus_id"] = fake_bus_id(i)
        if "count" in rec:
            rec["count"] = str(n)
        gpus.append(rec)
    procs = []
    for proc in processes:
        pid, name, mib, *rest = proc
        index = rest[0] if rest else 0
        procs.append({"pid": int(pid), "name": name, "used_memory": int(mib), "gpu_index": index,
                      "gpu_uuid": gpus[index]["uuid"]})
    for i, rec in enumerate(gpus):
        def mib(field):
            return int(float(rec[field].split()[0]))
        recorded = mib("memory.used")
        used = memory_used if memory_used is not None else \
            recorded + sum(p["used_memory"] for p in procs if p["gpu_index"] == i)
        rec["memory.used"] = _with_unit(used, units["memory.used"])
        if "memory.free" in rec:
            rec["memory.free"] = _with_unit(mib("memory.free") - (used - recorded), units["memory.free"])
        if utilization is not None:
            rec["utilization.gpu"] = _with_unit(utilization, units["utilization.gpu"])
        if temperature is not None:
            rec["temperature.gpu"] = _with_unit(temperature, units["temperature.gpu"])
    return {"fields": fields, "gpus": gpus, "processes": procs, "broken": broken,
            "query": (RECORDINGS / NVIDIA_QUERY_RECORDING).read_text(), "health": dict(health or {}),
            "nvlink": (RECORDINGS / NVLINK_RECORDING).read_text(), "nvlink_down": dict(nvlink_down or {}),
            "kernel_log": [(float(t), str(m)) for t, m in kernel_log], "dmesg_denied": bool(dmesg_denied)}


def rocm_state(n, processes=(), recording=ROCM_RECORDING):
    """The state the fake rocm-smi answers from: the recorded card0 as card0..card<n-1>.
    processes: (pid, name, used_mib[, gpu_index]), listed by `--showpids` (which does not say
    which GPU, so gpu_index is dropped)."""
    cards = json.loads((RECORDINGS / recording).read_text())
    first = [v for k, v in sorted(cards.items()) if k.startswith("card")]
    return {"cards": {f"card{i}": dict(first[min(i, len(first) - 1)]) for i in range(n)},
            "processes": [(int(p[0]), p[1], int(p[2])) for p in processes]}


def _install(bin_dir: Path, name: str, fake: Path, state) -> None:
    """Write (or, with state None, remove) a fake tool and its state.

    The state is marshalled, not JSON: `import json` (re, enum) would be half of the fake's
    start-up, and 64 test nodes run it on the same two cores a preflight is timed on. The fake
    runs with this interpreter, so the marshal format always matches."""
    script, data = bin_dir / name, bin_dir / f"{name}.state"
    if state is None:
        for path in (script, data):
            path.unlink(missing_ok=True)
        return
    tmp = data.with_suffix(".tmp")
    tmp.write_bytes(marshal.dumps(state))
    tmp.chmod(0o644)
    os.replace(tmp, data)
    if not script.exists():
        script.write_text(f"#!{_INTERPRETER} -S\n" + fake.read_text())
        script.chmod(0o755)


def install_nvidia_smi(bin_dir: Path, state) -> None:
    """The fake nvidia-smi and the fake dmesg beside it (the fake driver's kernel log, same state)."""
    _install(bin_dir, "nvidia-smi", FAKE_NVIDIA_SMI, state)
    script = bin_dir / "dmesg"
    if state is None:
        script.unlink(missing_ok=True)
    elif not script.exists():
        script.write_text(f"#!{_INTERPRETER} -S\n" + FAKE_DMESG.read_text())
        script.chmod(0o755)


def install_rocm_smi(bin_dir: Path, state) -> None:
    _install(bin_dir, "rocm-smi", FAKE_ROCM_SMI, state)


FAKE_TORCHRUN = Path(__file__).with_name("torchrun.py")


def install_torchrun_standin(where: Path, python: str) -> Path:
    """An interpreter for the inventory's `python:` that runs the light torchrun stand-in
    (fakes/torchrun.py) for `-m torch.distributed.run` and is `python` itself for anything else
    (the node agent, probes): the launch path the controller takes stays the product's own.
    -> the wrapper's path (world-readable, under `where`)."""
    where.mkdir(parents=True, exist_ok=True, mode=0o755)
    standin = where / "torchrun_standin.py"
    standin.write_text(FAKE_TORCHRUN.read_text())
    wrapper = where / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -m ] && [ "$2" = torch.distributed.run ]; then\n'
        f'  shift 2; exec "{python}" -S "{standin}" "$@"\n'
        "fi\n"
        f'exec "{python}" "$@"\n')
    for p in (where, standin, wrapper):
        p.chmod(0o755)
    return wrapper
