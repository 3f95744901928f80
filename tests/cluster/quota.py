"""A CPU quota on some processes, for the straggler tests and bench/bench_goodput.py: a fresh
cgroup (v2 cpu.max, else v1 cpu.cfs_quota_us). A harness module, so a bench imports it, not a test."""

import uuid
from pathlib import Path


class Quota:
    """A CPU quota on some processes: a fresh cgroup (v2 cpu.max, else v1 cpu.cfs_quota_us) with
    `share` of a core every `period_us` (bench/bench_goodput.py uses a shorter period than the
    kernel's default 100 ms). Without a writable cpu controller, `missing(why)` (a test skips,
    a bench stops: never faked)."""

    def __init__(self, share: float, period_us: int, missing):
        v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
        name = f"cct-straggler-{uuid.uuid4().hex[:8]}"
        quota = int(share * period_us)
        if "cpu" in (v2 / "cgroup.controllers").read_text().split() if (v2 / "cgroup.controllers").exists() else False:
            self.dir = v2 / name
            self.dir.mkdir()
            (self.dir / "cpu.max").write_text(f"{quota} {period_us}")
        elif (v1 / "cpu.cfs_quota_us").exists():
            self.dir = v1 / name
            self.dir.mkdir()
            (self.dir / "cpu.cfs_period_us").write_text(str(period_us))
            (self.dir / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            missing("no writable cgroup cpu controller")

    def add(self, pid: int) -> None:
        (self.dir / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        root = self.dir.parent
        for pid in (self.dir / "cgroup.procs").read_text().split():
            try:
                (root / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # it exited meanwhile
        self.dir.rmdir()
