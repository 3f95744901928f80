"""Fake GPU tooling installed in each test node's private bin dir."""

import marshal
import os
import sys
import uuid
from pathlib import Path

FAKE_NVIDIA_SMI = Path(__file__).with_name("nvidia_smi.py")
# The test user cannot read pyenv shims under /root: use the real interpreter file.
_INTERPRETER = os.path.realpath(getattr(sys, "_base_executable", sys.executable))

H100 = "NVIDIA H100 80GB HBM3"
MEMORY_MIB = {H100: 81559, "NVIDIA A100-SXM4-80GB": 81920, "NVIDIA A100-SXM4-40GB": 40960}


def gpu_state(node_name, n, processes=(), model=H100, memory_total=None, memory_used=None,
              utilization=0, temperature=32, power_draw=69.88, power_limit=700.0,
              driver="550.54.15", cuda="12.4", broken=None):
    """The JSON state the fake nvidia-smi answers from.

    processes: (pid, name, used_mib) or (pid, name, used_mib, gpu_index); gpu_index defaults to 0.
    memory_used: None = the sum of the processes on that gpu. broken: text printed instead of
    any answer, with exit code 9 (like a driver/library mismatch).
    """
    gpus = []
    for i in range(n):
        gpus.append({
            "index": i,
            "name": model,
            "uuid": "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{node_name}.gpu{i}")),
            "serial": str(1650000000000 + i),
            "bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0",
            "compute_cap": "9.0",
            "persistence_mode": "Enabled",
            "memory_total": memory_total or MEMORY_MIB.get(model, 81559),
            "memory_used": memory_used,
            "utilization": utilization,
            "utilization_memory": 0,
            "temperature": temperature,
            "power_draw": float(power_draw),
            "power_limit": float(power_limit),
            "pstate": "P0",
        })
    procs = []
    for proc in processes:
        pid, name, mib, *rest = proc
        index = rest[0] if rest else 0
        procs.append({"pid": int(pid), "name": name, "used_memory": int(mib),
                      "gpu_uuid": gpus[index]["uuid"]})
    return {"driver": driver, "cuda": cuda, "gpus": gpus, "processes": procs, "broken": broken}


def install_nvidia_smi(bin_dir: Path, state) -> None:
    """Write (or, with state None, remove) the fake nvidia-smi and its state.

    The state is marshalled, not JSON: `import json` (re, enum) would be half of the fake's
    start-up, and 64 test nodes run it on the same two cores a preflight is timed on. The fake
    runs with this interpreter, so the marshal format always matches."""
    script, data = bin_dir / "nvidia-smi", bin_dir / "nvidia-smi.state"
    if state is None:
        for path in (script, data):
            path.unlink(missing_ok=True)
        return
    tmp = data.with_suffix(".tmp")
    tmp.write_bytes(marshal.dumps(state))
    tmp.chmod(0o644)
    os.replace(tmp, data)
    if not script.exists():
        body = FAKE_NVIDIA_SMI.read_text()
        script.write_text(f"#!{_INTERPRETER} -S\n" + body)
        script.chmod(0o755)
