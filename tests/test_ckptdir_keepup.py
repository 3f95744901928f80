"""Checkpoints that keep up with the job (train --checkpoint-dir): an entry is complete when its
writer closed it, not after seconds of quiet, so a file the job rewrites every fraction of a second
is snapshotted whole; a rewrite that lands while a version is copied voids that copy, never tears
it; nothing is taken from a node whose ranks began to end. remote/ckptdir.py `look` as shipped (or
loaded here from the same bytes, where a test must land a write inside a copy), and
runs/ckpt/jobdir_home.py's DirCopier over `connection: local` nodes."""

import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from orchestrator import probe
from orchestrator.runs.ckpt import jobdir_home as ckptdir
from orchestrator.runs.ckpt.jobdir_home import DirCopier, DirStore
from tests.test_ckptdir import attach, local_cluster

WRITER = """
import hashlib, os, sys, time, torch
path, period = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
step = 0
while True:
    step += 1
    data = torch.randn(256, 1024) + step  # 1 MiB, a new value every save
    digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    torch.save({"step": step, "data": data, "digest": digest}, path)  # in place, as nanoGPT does
    print(step, flush=True)
    time.sleep(period)
"""


def loads_whole(path) -> int:
    """The step of a saved checkpoint whose tensor matches the digest saved with it."""
    doc = torch.load(path, map_location="cpu")
    assert hashlib.sha256(doc["data"].numpy().tobytes()).hexdigest() == doc["digest"], path
    return doc["step"]


# ------------------------------------------------------------------ a rewrite inside a copy


@pytest.fixture
def node_side(monkeypatch):
    """remote/ckpt_capture.py (ckptdir.py's look) as a module here (the same module the nodes run), 4 KiB
    copy pieces."""
    mod = probe.load("ckpt_capture")  # where look, its copy pieces (CHUNK, _copy_chunk) and Watch are
    monkeypatch.setattr(mod, "CHUNK", 4096)
    return mod


def run_look(mod, d, pending):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        mod.look(str(d), str(pending), "2", "0", "-")
    return json.loads(out.getvalue())


@pytest.mark.parametrize("watch", ["inotify", "identities only"])
def test_a_rewrite_that_lands_while_a_version_is_copied_voids_the_copy(node_side, tmp_path, monkeypatch, watch):
    """The job rewrites ckpt.pt in place (same size, even its mtime put back as it was) after the
    first 4 KiB of the copy: the capture is voided and the previous one stays, never a mix. With
    inotify the write is seen; without it, the file's ctime gives it away."""
    d, pending = tmp_path / "out", tmp_path / "art" / ckptdir.PENDING
    d.mkdir()
    first = os.urandom(64 * 1024)
    (d / "ckpt.pt").write_bytes(first)
    assert run_look(node_side, d, pending)["entries"]["ckpt.pt"]["complete"]
    assert (pending / "ckpt.pt").read_bytes() == first
    if watch == "identities only":
        monkeypatch.setattr(node_side.Watch, "ok", property(lambda self: False))
    second, third = os.urandom(64 * 1024), os.urandom(64 * 1024)
    (d / "ckpt.pt").write_bytes(second)
    real, calls = node_side._copy_chunk, []

    def rewrite_mid_copy(src, dst, off):
        n = real(src, dst, off)
        calls.append(off)
        if len(calls) == 1:  # a save lands in the middle of the copy
            st = os.stat(d / "ckpt.pt")
            with open(d / "ckpt.pt", "r+b") as f:
                f.write(third)
            os.utime(d / "ckpt.pt", ns=(st.st_atime_ns, st.st_mtime_ns))
        return n

    monkeypatch.setattr(node_side, "_copy_chunk", rewrite_mid_copy)
    got = run_look(node_side, d, pending)
    assert len(calls) > 1, "the copy was not in pieces: the rewrite did not land inside it"
    assert got["torn"] == ["ckpt.pt"] and not got["entries"]["ckpt.pt"]["complete"], got
    assert (pending / "ckpt.pt").read_bytes() == first  # the previous capture, whole
    assert not (pending / ".incoming").exists()
    # the next look takes the version the job left, whole
    monkeypatch.setattr(node_side, "_copy_chunk", real)
    assert run_look(node_side, d, pending)["entries"]["ckpt.pt"]["complete"]
    assert (pending / "ckpt.pt").read_bytes() == third


@pytest.mark.parametrize("watch", ["inotify", "identities only"])
def test_a_save_truncated_before_its_writer_holds_it_is_never_taken_empty(node_side, tmp_path, monkeypatch, watch):
    """torch.save opens ckpt.pt with O_TRUNC: the file is empty inside open(), before /proc shows
    the descriptor, and a busy machine can hold the writer there across a whole sample (seen once
    on CI: a 0-byte snapshot restored). An empty file no one holds, changed a moment ago, is taken
    only once inotify saw it closed, or once it aged unchanged: the save that lands meanwhile is
    taken whole (inotify) and the previous capture stays until then."""
    d, pending = tmp_path / "out", tmp_path / "art" / ckptdir.PENDING
    d.mkdir()
    one, two = os.urandom(64 * 1024), os.urandom(64 * 1024)
    (d / "ckpt.pt").write_bytes(one)
    assert run_look(node_side, d, pending)["entries"]["ckpt.pt"]["complete"]
    if watch == "identities only":
        monkeypatch.setattr(node_side.Watch, "ok", property(lambda self: False))
    os.truncate(d / "ckpt.pt", 0)  # the open's truncate; its writer not yet seen holding it
    real, samples = node_side.sample_dir, []

    def save_after_the_first_sample(*a, **kw):
        if samples:
            (d / "ckpt.pt").write_bytes(two)  # the writer runs again: the save, closed
        samples.append(real(*a, **kw))
        return samples[-1]

    monkeypatch.setattr(node_side, "sample_dir", save_after_the_first_sample)
    got = run_look(node_side, d, pending)
    assert samples[0]["ckpt.pt"]["why"] == "fresh", samples[0]
    kept = (pending / "ckpt.pt").read_bytes()
    assert kept in (one, two), f"{len(kept)} bytes captured"
    assert got["entries"]["ckpt.pt"]["complete"] == (kept == two), got
    if watch == "inotify":  # its close was seen: taken at once, whole
        assert kept == two and len(samples) == 2, (len(kept), len(samples))


def test_an_empty_file_is_not_taken_on_the_strength_of_the_previous_saves_close(tmp_path, monkeypatch):
    """The save's O_TRUNC empties ckpt.pt inside open(); inotify hears of it after that, on a loaded
    machine tens of ms after (scratch stress, 8 busy loops on 2 cores: 17 of 335 looks captured
    an empty ckpt.pt "complete", each 30-90 ms after its truncate, the previous save's close the
    newest event read). An empty file changed within EMPTY_S is not complete whatever was seen
    closed; one with bytes, closed just now, still is; an empty one left alone is, after EMPTY_S."""
    entries = probe.load("ckpt_entries")
    d = tmp_path / "out"
    d.mkdir()
    watch = entries.Watch(str(d))
    try:
        (d / "ckpt.pt").write_bytes(os.urandom(4096))  # the previous save: written and closed
        (d / "other.pt").write_bytes(os.urandom(4096))
        watch.changed()
        assert watch.closed == {"ckpt.pt": True, "other.pt": True}
        os.truncate(d / "ckpt.pt", 0)  # the next save's open: its event not read yet
        monkeypatch.setattr(watch, "changed", lambda: {})  # (inotify's lag, which no test can time)
        got = entries.sample_dir(str(d), watch, 0, {}, int(0.5e9))
        assert got["ckpt.pt"]["why"] == "fresh", got["ckpt.pt"]
        assert got["other.pt"]["why"] == "", got["other.pt"]  # bytes and a close seen: taken at once
        monkeypatch.setattr(entries, "EMPTY_S", 0.2)
        time.sleep(0.3)
        assert entries.sample_dir(str(d), watch, 0, {}, int(0.5e9))["ckpt.pt"]["why"] == ""
    finally:
        watch.close()


def test_a_final_look_waits_for_an_empty_marker_written_in_the_jobs_last_second(node_side, tmp_path, monkeypatch):
    """The job's last act is an empty `done` marker beside its checkpoint. The run's final look
    (wait 0) waits for that empty file to age past EMPTY_S, not only YOUNG_S, and takes both:
    without that the snapshot kept the checkpoint and left the marker out."""
    monkeypatch.setattr(probe.load("ckpt_entries"), "EMPTY_S", 1.0)  # the one rule: sample_dir and fresh_wait
    monkeypatch.setattr(node_side, "YOUNG_S", 0.2)
    d, pending = tmp_path / "out", tmp_path / "art" / ckptdir.PENDING
    d.mkdir()
    (d / "ckpt.pt").write_bytes(os.urandom(4096))
    (d / "done").touch()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        node_side.look(str(d), str(pending), "0", "0", "-")
    got = json.loads(out.getvalue())
    assert got["entries"]["ckpt.pt"]["complete"] and got["entries"]["done"]["complete"], got
    assert (pending / "done").exists() and (pending / "done").stat().st_size == 0


def test_an_atomic_save_over_the_name_during_the_copy_leaves_the_copy_whole(node_side, tmp_path, monkeypatch):
    """torch.save to a temporary name then os.replace (the careful scripts' way): a replace that
    lands during the copy does not touch the bytes being read, so the copy stands; the new version
    is complete at the rename."""
    d, pending = tmp_path / "out", tmp_path / "art" / ckptdir.PENDING
    d.mkdir()
    one, two = os.urandom(64 * 1024), os.urandom(64 * 1024)
    (d / "ckpt.pt").write_bytes(one)
    real, calls = node_side._copy_chunk, []

    def replace_mid_copy(src, dst, off):
        calls.append(off)
        if len(calls) == 1:
            (d / "ckpt.pt.tmp").write_bytes(two)
            os.replace(d / "ckpt.pt.tmp", d / "ckpt.pt")
        return real(src, dst, off)

    monkeypatch.setattr(node_side, "_copy_chunk", replace_mid_copy)
    got = run_look(node_side, d, pending)
    assert got["entries"]["ckpt.pt"]["complete"] and got["torn"] == [], got
    assert (pending / "ckpt.pt").read_bytes() == one
    monkeypatch.setattr(node_side, "_copy_chunk", real)
    assert run_look(node_side, d, pending)["entries"]["ckpt.pt"]["complete"]
    assert (pending / "ckpt.pt").read_bytes() == two


# ------------------------------------------------------------------ a job that saves every 0.1 s


@pytest.fixture
def copier(tmp_path):
    with local_cluster(tmp_path) as c:
        dc = DirCopier(c, DirStore(tmp_path / "run"), say=lambda _s: None, interval=0.5)
        attach(dc, ckptdir.prepare(c, list(c.nodes), "out"), tmp_path)
        yield dc


@pytest.fixture
def writer(tmp_path):
    """A job on n0 rewriting out/ckpt.pt in place every 0.1 s."""
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "w0" / "out" / "ckpt.pt"), "0.1"],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "1"
    yield p
    p.kill()
    p.wait()


@pytest.mark.slow
def test_a_checkpoint_rewritten_every_tenth_of_a_second_is_snapshotted_whole_while_the_job_runs(
        copier, writer, tmp_path):
    """Under the quiet rule (5 s unchanged) this file is never complete. Now every look takes the
    newest version its writer closed: snapshots keep coming while the job saves, each newer than
    the last, every one loads and its tensor matches the digest saved with it, and each file
    matches the sha256 of its manifest."""
    steps, deadline = [], time.monotonic() + 120
    while len(steps) < 5 and time.monotonic() < deadline and writer.poll() is None:
        name = copier.tick(["n0", "n1"])
        if name is not None:
            steps.append(loads_whole(copier.store.dir / name / "ckpt.pt"))
            assert copier.store.intact(name) is None
        time.sleep(0.05)
    assert len(steps) == 5, f"snapshots of steps {steps} in 120 s of looks ({copier.looks})"
    assert steps == sorted(set(steps)), steps


def test_a_look_is_made_at_most_once_per_interval(copier, writer):
    """A file rewritten every 0.1 s is not copied every 0.1 s: after a look, the next tick within
    the interval neither looks nor copies."""
    copier.interval = 3600.0
    assert copier.tick(["n0", "n1"]) == "snap-000001" and copier.looks == 1
    assert copier.tick(["n0", "n1"]) is None and copier.looks == 1
    assert copier.due_in() > 3000


# ------------------------------------------------------------------ nothing from a job that is ending


def node_look(d, key, home):
    r = subprocess.run(probe.local_argv("ckptdir", "look", str(d), str(d.parent / ckptdir.PENDING), "2", "0", key),
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=60, env={**os.environ, "HOME": str(home)})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_nothing_is_taken_from_a_node_whose_ranks_began_to_end(tmp_path):
    """A worker killed mid-save leaves a torn file that looks closed: the look takes nothing once a
    rank of the attempt noted its failure (rank_lines.py) or the attempt's processes (found by
    their CLUSTERCTL_RUN_KEY) are gone."""
    d, key = tmp_path / "out", "run-1@n0"
    d.mkdir()
    (d / "ckpt.pt").write_bytes(b"half of a save")
    assert node_look(d, key, tmp_path)["guard"] == "the job's processes ended"  # none of it runs here
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "CLUSTERCTL_RUN_KEY": key})
    try:
        got = node_look(d, key, tmp_path)
        assert got["guard"] == "" and got["entries"]["ckpt.pt"]["complete"], got
        notes = tmp_path / ".clusterctl" / "node-runs" / key
        notes.mkdir(parents=True)
        (notes / "failed.1").write_text(f"{time.time():.6f} 137\n")
        got = node_look(d, key, tmp_path)
        assert got["guard"] == "a rank of the job failed" and not got["entries"]["ckpt.pt"]["complete"], got
    finally:
        rank.kill()
        rank.wait()
