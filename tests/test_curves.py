"""One TensorBoard curve per run (runs/curves.py): a restart's new master, two local nodes that
share one artifacts directory, and `train --resume-from` all land in one TensorBoard run, each
step once. The event files are the trainer's own writer's (SummaryWriter with purge_step), the
frames go through ArtifactCopier as the nodes' streams hand them over, and TensorBoard's own
reader says what it would draw."""

from pathlib import Path

import pytest

from orchestrator.runs.ckpt.given_home import ArtifactCopier
from orchestrator.runs.curves import carry_over


SummaryWriter = pytest.importorskip("torch.utils.tensorboard").SummaryWriter
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer  # noqa: E402


def write_steps(logdir: Path, first: int, last: int, value: float, purge: int | None = None) -> None:
    """What the trainer's master writes: train/loss per step; a resumed one purges past its checkpoint."""
    w = SummaryWriter(str(logdir), purge_step=purge)
    for step in range(first, last + 1):
        w.add_scalar("train/loss", value + step, step)
    w.close()


def stream(copier: ArtifactCopier, node: str, node_tb: Path, chunk: int = 37) -> None:
    """The node's stream: every file under its TensorBoard directory past what the copier has, in frames."""
    have = copier.tb_have(node)
    for p in sorted(q for q in node_tb.rglob("*") if q.is_file()):
        rel, data = str(p.relative_to(node_tb)), p.read_bytes()
        for off in range(have.get(rel, 0), len(data), chunk):
            copier.on_tb(node, {"rel": rel, "offset": off, "size": len(data[off:off + chunk])}, data[off:off + chunk])


def curves(run_dir: Path) -> dict[str, dict[int, float]]:
    """TensorBoard's view of `tensorboard --logdir run_dir/tensorboard`: run -> {step: loss}."""
    m = EventMultiplexer().AddRunsFromDirectory(str(run_dir / "tensorboard"))
    m.Reload()
    return {run: {e.step: e.value for e in m.Scalars(run, "train/loss")} for run in m.Runs()}


def copier(run_dir: Path, nodes) -> ArtifactCopier:
    run_dir.mkdir(parents=True, exist_ok=True)
    return ArtifactCopier(None, run_dir, {n: {"checkpoints": "/c", "tensorboard": "/t"} for n in nodes},
                          say=print)


def test_a_restart_on_another_master_continues_the_same_curve(tmp_path):
    run_dir = tmp_path / "run"
    c = copier(run_dir, ["node1", "node5"])
    write_steps(tmp_path / "node1-tb", 1, 30, 100.0)  # attempt 1's master; its checkpoint is step 20
    stream(c, "node1", tmp_path / "node1-tb")
    write_steps(tmp_path / "node5-tb", 21, 40, 200.0, purge=21)  # attempt 2 on the spare, resumed at 20
    stream(c, "node5", tmp_path / "node5-tb")
    got = curves(run_dir)
    assert list(got) == ["."], got  # one TensorBoard run, not one per node
    (loss,) = got.values()
    assert sorted(loss) == list(range(1, 41))
    assert loss[20] == 120.0 and loss[21] == 221.0 and loss[30] == 230.0  # attempt 1's 21-30 purged


def test_two_local_nodes_sharing_one_directory_write_one_curve_once(tmp_path):
    run_dir = tmp_path / "run"
    c = copier(run_dir, ["node1", "node2"])
    shared = tmp_path / "artifacts-tb"  # both local nodes' CLUSTERCTL_TENSORBOARD_DIR
    write_steps(shared, 1, 10, 0.0)
    stream(c, "node1", shared, chunk=50)
    stream(c, "node2", shared, chunk=23)  # the same file at other cuts: every frame lands at its offset or not at all
    write_steps(shared, 11, 20, 0.0, purge=11)
    stream(c, "node2", shared)
    stream(c, "node1", shared)
    files = sorted(p.relative_to(run_dir / "tensorboard") for p in (run_dir / "tensorboard").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(shared) for p in shared.rglob("*") if p.is_file())
    for f in files:
        assert (run_dir / "tensorboard" / f).read_bytes() == (shared / f).read_bytes()
    assert {run: sorted(v) for run, v in curves(run_dir).items()} == {".": list(range(1, 21))}


def test_a_run_resumed_from_another_continues_its_curve(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    c = copier(old, ["node1"])
    write_steps(tmp_path / "old-tb", 1, 12, 0.0)  # stopped at 12, its newest checkpoint step 10
    stream(c, "node1", tmp_path / "old-tb")
    assert carry_over(old, new) == 1
    c2 = copier(new, ["node1"])
    write_steps(tmp_path / "new-tb", 11, 25, 1000.0, purge=11)
    stream(c2, "node1", tmp_path / "new-tb")
    (loss,) = curves(new).values()
    assert sorted(loss) == list(range(1, 26)) and loss[10] == 10.0 and loss[11] == 1011.0
    assert sorted(curves(old)) == ["."] and sorted(curves(old)["."]) == list(range(1, 13))  # the old run untouched
