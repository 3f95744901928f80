"""What a scrape of `clusterctl metrics serve` costs with many runs recorded: N ended runs (each with a
rank log of LOG_MB) and one live run; the first scrape, then the next ones. Prints bytes read and
the time of each, and the ratio of a later scrape to the first (flat: an ended run is not read again).

    .venv/bin/python bench/bench_metrics_scrape.py [N] [LOG_MB]
"""
import json
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client import generate_latest

from orchestrator.observe.metrics import RunsCollector
from prometheus_client.registry import CollectorRegistry


def make(runs: Path, rid: str, state: str, log: bytes) -> None:
    d = runs / rid
    (d / "ranks").mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({
        "id": rid, "state": state, "created": time.time(), "attempt": 1,
        "attempts": [{"attempt": 1, "key": rid, "nodes": ["n1"]}],
        "nodes": [{"name": "n1", "rank": 0, "host": "h", "state": "finished", "first_rank": 0, "last_rank": 0}]}))
    (d / "ranks" / "rank0.log").write_bytes(log)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    mb = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    line = b"step 100 | loss 3.2 | tok/s 1,234 | step 20 ms\n"
    log = line * int(mb * (1 << 20) / len(line))
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp)
        for i in range(n):
            make(runs, f"old{i:05d}", "finished", log)
        make(runs, "live", "running", log)
        collector = RunsCollector(runs)
        reg = CollectorRegistry(auto_describe=False)
        reg.register(collector)
        times, reads = [], []
        for _ in range(4):
            before = collector.home.bytes_read
            t0 = time.perf_counter()
            generate_latest(reg)
            times.append(time.perf_counter() - t0)
            reads.append(collector.home.bytes_read - before)
        for k, (t, b) in enumerate(zip(times, reads), 1):
            print(f"scrape {k}: {t * 1e3:7.1f} ms, {b / 1e6:8.3f} MB read")
        print(f"{n} ended runs with {mb:g} MB logs: a later scrape costs {times[-1] / times[0]:.2f}x the first's time "
              f"and reads {reads[-1] / max(1, reads[0]):.4f}x its bytes")


if __name__ == "__main__":
    main()
