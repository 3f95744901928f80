"""Checkpoints written in the background (trainer/saver.py): the snapshot is taken when save()
returns, whatever training does after; one write in flight at a time; a write that fails fails
the run with one sentence; a write in flight at SIGTERM (or cut by SIGKILL) never leaves a
checkpoint that clusterctl's completeness rule would take half-written; and a run resumed from
a background-written checkpoint continues bit for bit like one written on the training thread.

Writes are held mid-file by a patched `_HashingWriter.write` (the real file is half on disk,
under its temp name), so "in flight" is a state the test controls, not a race it hopes to win."""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import asdict

import pytest
import torch

from orchestrator.probe import common
from trainer import checkpoint
from trainer.config import CheckpointError, parse_args
from trainer.saver import HostCopy, Saver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""}
RULE = common()  # the completeness rule clusterctl applies on the nodes (remote/common.py)


def _state(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    return model, opt


def _train_more(model, opt):
    model(torch.randn(2, 32)).sum().backward()
    opt.step()


def _loaded(path):
    checkpoint.verify(path)
    return torch.load(path, weights_only=False)


def _gate(monkeypatch):
    """Hold every checkpoint write after its first bytes until `open` is set; `entered` says one is held."""
    entered, release, active, peak = threading.Event(), threading.Event(), [0], [0]
    real = checkpoint.write_file

    def held_write(*a, **kw):
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        entered.set()
        try:
            assert release.wait(60)
            return real(*a, **kw)
        finally:
            active[0] -= 1
    monkeypatch.setattr(checkpoint, "write_file", held_write)
    return entered, release, peak


def test_the_snapshot_is_the_state_at_save_time(tmp_path, monkeypatch):
    entered, release, _ = _gate(monkeypatch)
    model, opt = _state(1)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_avg = opt.state[model.weight]["exp_avg"].clone()
    saver = Saver(str(tmp_path), rank=0, fsdp=False, keep=3)
    path = saver.save(5, model, opt, None, {"seed": 1})
    assert entered.wait(30) and not os.path.exists(path)  # in flight: training goes on meanwhile
    for _ in range(3):
        _train_more(model, opt)
    assert not torch.equal(model.weight, want["weight"])
    release.set()
    done = saver.wait()
    assert done.step == 5 and done.total_s >= done.stall_s
    state = _loaded(path)
    assert all(torch.equal(state["model"][k], want[k]) for k in want)
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], want_avg)
    assert state["step"] == 5
    saver.close()


def test_the_host_copy_keeps_shared_tensors_shared_and_reuses_its_buffers():
    w = torch.arange(6.0).view(2, 3)
    state = {"wte": w, "lm_head": w, "opt": [{"exp_avg": torch.ones(3), "lr": 0.1, "betas": (0.9, 0.95)}], "step": 5}
    copy = HostCopy()
    first = copy.take(state)
    assert first["wte"] is first["lm_head"] and first["wte"] is not w and torch.equal(first["wte"], w)
    assert first["opt"][0]["betas"] == (0.9, 0.95) and first["step"] == 5 and first["opt"] is not state["opt"]
    w.add_(1)
    assert not torch.equal(first["wte"], w)  # a copy, not a view of the live tensor
    second = copy.take(state)
    assert second["wte"] is first["wte"] and torch.equal(second["wte"], w)  # the same buffer, refilled
    state["opt"][0]["exp_avg"] = torch.ones(4)
    assert copy.take(state)["opt"][0]["exp_avg"].shape == (4,)  # a new shape gets a new buffer


def test_one_write_in_flight_a_save_waits_for_the_previous(tmp_path, monkeypatch):
    entered, release, peak = _gate(monkeypatch)
    model, opt = _state(2)
    saver = Saver(str(tmp_path), rank=0, fsdp=False, keep=5)
    saver.save(1, model, opt, None, {})
    assert entered.wait(30)
    second = threading.Thread(target=saver.save, args=(2, model, opt, None, {}))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # the second save waits while the first write is held
    release.set()
    second.join(30)
    saver.close()
    assert peak[0] == 1
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == \
        ["ckpt_00000002.pt", "ckpt_00000001.pt"]


def test_a_failed_write_raises_a_clear_error_and_leaves_nothing_half_written(tmp_path):
    model, opt = _state(3)
    saver = Saver(str(tmp_path), rank=0, fsdp=False, keep=3)
    saver.save(2, model, opt, None, {})
    saver.wait()
    os.mkdir(tmp_path / "ckpt_00000004.pt")  # the name is taken by a directory: the rename fails
    saver.save(4, model, opt, None, {})
    deadline = time.monotonic() + 30
    while not saver.failed() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert saver.failed()
    assert saver.poll() is None and saver.failed()  # never raised by the per-step poll: by every rank at once
    with pytest.raises(CheckpointError, match=r"could not write checkpoint \S+ckpt_00000004\.pt \(step 4\): "
                                              r"IsADirectoryError.*checkpoints before it are intact"):
        saver.save(6, model, opt, None, {})  # the next save says why, and writes nothing
    assert sorted(os.listdir(tmp_path)) == ["ckpt_00000002.pt", "ckpt_00000002.pt.sha256", "ckpt_00000004.pt"]
    saver.close()


@pytest.mark.slow
def test_a_failed_write_fails_the_run_with_one_sentence(tmp_path):
    os.mkdir(tmp_path / "ckpt_00000004.pt")
    r = subprocess.run([sys.executable, "-m", "trainer", "--output-dir", str(tmp_path), "--max-steps", "40",
                        "--ckpt-every", "4", "--batch-size", "2", "--log-every", "1", "--sample-tokens", "0"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("trainer: error:")]
    assert len(errors) == 1 and "could not write checkpoint" in errors[0] and "ckpt_00000004.pt" in errors[0]
    steps = [int(ln.split()[1]) for ln in r.stdout.splitlines() if ln.startswith("step ") and "| loss" in ln]
    assert 4 <= max(steps) < 40  # it stopped soon after the failed write, not at the end


# A trainer whose checkpoint writes stop half-way through the file while the gate file exists:
# the first bytes are in the temp file, the rest wait. `held` appears when a write is held.
DRIVER = textwrap.dedent("""
    import os, sys, time
    from trainer import checkpoint
    gate, held = sys.argv[1], sys.argv[2]
    real = checkpoint._HashingWriter.write
    def write(self, b):
        n = real(self, b)
        self.fh.flush()
        while os.path.exists(gate):
            open(held, "w").close()
            time.sleep(0.05)
        return n
    checkpoint._HashingWriter.write = write
    from trainer.__main__ import main
    sys.exit(main(sys.argv[3:]))
""")


def _complete(d):
    """What clusterctl's rule takes as a finished checkpoint in directory d, and whether its bytes
    match its marks (a torn file the rule took would be listed with False)."""
    return {n: RULE.checkpoint_verified(os.path.join(d, n))
            for n in os.listdir(d) if RULE.checkpoint_kind(d, n) is not None}


class Trainer:
    """A driven trainer: its stdout lines collected by a thread, so every wait has a timeout."""

    def __init__(self, tmp_path, *args):
        self.gate, self.held, self.out = tmp_path / "gate", tmp_path / "held", tmp_path / "out"
        self.gate.touch()
        cmd = [sys.executable, "-c", DRIVER, str(self.gate), str(self.held), "--output-dir", str(self.out),
               "--max-steps", "100000", "--log-every", "1", "--batch-size", "2", "--sample-tokens", "0", *args]
        self.p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.p.stdout), daemon=True)
        self.reader.start()

    def wait_for(self, what, timeout=180.0):
        """Until a stdout line starts with `what` (a str), or `what()` holds (a callable)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if callable(what) and what() or not callable(what) and any(ln.startswith(what) for ln in self.lines):
                return
            if self.p.poll() is not None and not callable(what):
                break
            time.sleep(0.05)
        raise AssertionError(f"gave up waiting for {what!r}; stdout: {''.join(self.lines)[-2000:]}")

    def end(self, timeout=180.0):
        try:
            self.p.wait(timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait(30)
        self.reader.join(30)
        return self.p.returncode, "".join(self.lines), self.p.stderr.read()

    def temp_files(self):
        return [n for n in os.listdir(self.out) if ".tmp" in n]


@pytest.mark.slow
def test_sigterm_with_a_write_in_flight_finishes_it_then_saves_and_exits_0(tmp_path):
    t = Trainer(tmp_path, "--ckpt-every", "3")
    try:
        t.wait_for(t.held.exists)  # step 3's checkpoint is half-way into its temp file ...
        t.wait_for("step 5 |")  # ... while training goes on
        assert [n.split(".tmp.")[0] for n in t.temp_files()] == ["ckpt_00000003.pt"]
        assert _complete(t.out) == {}  # nothing the rule takes
        t.p.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert t.p.poll() is None  # it waits for the write in flight
        assert _complete(t.out) == {}
        t.gate.unlink()
    finally:
        rc, out, err = t.end()
    assert rc == 0, err[-2000:]
    done = _complete(t.out)
    assert "ckpt_00000003.pt" in done and all(done.values()), done
    last = max(done, key=RULE.checkpoint_step)
    assert RULE.checkpoint_step(last) >= 5 and f"saved checkpoint {t.out / last} at step" in out
    assert not t.temp_files()


@pytest.mark.slow
def test_sigkill_with_a_write_in_flight_leaves_the_previous_checkpoint_newest(tmp_path):
    """The stop's grace ran out mid-write: the held checkpoint stays a temp file, those written
    before it are complete and intact, and a restart resumes from the newest of them."""
    t = Trainer(tmp_path, "--ckpt-every", "3")
    try:
        t.wait_for(t.held.exists)
        t.gate.unlink()  # step 3's checkpoint is written whole ...
        t.wait_for(lambda: "ckpt_00000003.pt" in _complete(t.out))
        t.held.unlink()
        t.gate.touch()  # ... a later one is held half-way
        t.wait_for(t.held.exists)
        t.p.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        t.p.kill()
    finally:
        t.end()
    (torn,) = t.temp_files()
    done = _complete(t.out)
    assert "ckpt_00000003.pt" in done and all(done.values()), done
    newest = max(RULE.checkpoint_step(n) for n in done)
    assert RULE.checkpoint_step(torn.split(".tmp.")[0]) > newest
    r = subprocess.run([sys.executable, "-m", "trainer", "--output-dir", str(t.out), "--max-steps", str(newest + 1),
                        "--batch-size", "2", "--sample-tokens", "0"], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and f"start step {newest}" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def _train(out, *args):
    from trainer.train import train
    handler = signal.getsignal(signal.SIGTERM)  # train() sets its own
    try:
        _run_train(train, out, *args)
    finally:
        signal.signal(signal.SIGTERM, handler)


def _run_train(train, out, *args):
    assert train(parse_args(["--output-dir", str(out), "--max-steps", "12", "--batch-size", "2", "--log-every", "1",
                             "--sample-tokens", "0", "--ckpt-every", "4", "--keep-ckpts", "5", "--eval-steps", "1",
                             "--dropout", "0.1", *args])) == 0


def _comparable(state):
    """A checkpoint without what legitimately differs between two runs: their output directories
    and the flag under test, and Python's own generator (seeded by each process, unused)."""
    for k in ("sync_ckpt", "output_dir"):
        state["config"].pop(k)
    for rng in state["rng"]:
        rng.pop("python")
    return state


def _same(a, b):
    """Two checkpoint dicts hold equal tensors and values everywhere."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.slow
def test_resume_from_a_background_written_checkpoint_is_bit_identical(tmp_path):
    """The same run with background writes and with --sync-ckpt: every checkpoint holds the same
    tensors (model, optimizer, RNG states: dropout is on); resumed from the background-written
    step-4 checkpoint, the run ends on exactly the weights of the run that never stopped."""
    _train(tmp_path / "async")
    _train(tmp_path / "sync", "--sync-ckpt")
    for step in (4, 8, 12):
        a, s = (_comparable(_loaded(str(tmp_path / d / f"ckpt_{step:08d}.pt"))) for d in ("async", "sync"))
        assert _same(a, s), step
    os.makedirs(tmp_path / "resumed")
    for name in ("ckpt_00000004.pt", "ckpt_00000004.pt.sha256"):
        shutil.copy(tmp_path / "async" / name, tmp_path / "resumed" / name)
    _train(tmp_path / "resumed")
    end, resumed = (_comparable(_loaded(str(tmp_path / d / "ckpt_00000012.pt"))) for d in ("async", "resumed"))
    assert _same(end["model"], resumed["model"]) and _same(end["optimizer"], resumed["optimizer"])
    assert _same(end["rng"], resumed["rng"])


def test_a_stop_right_after_a_save_does_not_write_the_same_step_again(tmp_path):
    model, opt = _state(4)
    saver = Saver(str(tmp_path), rank=0, fsdp=False, keep=3)
    first = saver.save(3, model, opt, None, {})
    saver.wait()
    stamp = os.stat(first).st_mtime_ns
    assert saver.save(3, model, opt, None, {}, final=True) == first
    assert os.stat(first).st_mtime_ns == stamp and len(saver.saved) == 1
    saver.close()


def test_sync_ckpt_is_a_documented_flag():
    cfg = parse_args(["--sync-ckpt"])
    assert cfg.sync_ckpt and not parse_args([]).sync_ckpt
    assert "sync_ckpt" in asdict(cfg)
