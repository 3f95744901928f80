"""In-process trainer checks (no subprocesses): checkpoint validity, data windows and cache,
accumulation arithmetic, and that non-final micro-steps do not all-reduce."""
import os
import socket

import pytest
import torch
import torch.distributed as dist

from trainer import checkpoint
from trainer.config import UsageError, parse_args
from trainer.data import TokenData
from trainer.model import build_model
from trainer.parallel import register_comm_hook
from trainer.tokenizer import ByteTokenizer
from trainer.train import Trainer


def _tiny_state(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return model, opt


def _save(out, step, seed):
    model, opt = _tiny_state(seed)
    checkpoint.save(str(out), step, model, opt, None, {"seed": 1}, rank=0, fsdp=False, keep=5)
    return model


def _load(out, spec="auto"):
    model, opt = _tiny_state(99)
    step = checkpoint.load(spec, str(out), model, opt, None, rank=0, fsdp=False, distributed=False)
    return step, model


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_checksum"])
def test_damaged_newest_checkpoint_is_skipped(tmp_path, capsys, damage):
    good = _save(tmp_path, 2, seed=2)
    _save(tmp_path, 4, seed=4)
    newest = tmp_path / "ckpt_00000004.pt"
    data = bytearray(newest.read_bytes())
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "flip":  # same size, still a valid zip: torch.load alone would load it
        data[len(data) // 2] ^= 0xFF
        newest.write_bytes(bytes(data))
        torch.load(newest, weights_only=False)
    else:
        os.remove(str(newest) + ".sha256")
    step, model = _load(tmp_path)
    assert step == 2
    assert torch.equal(model.weight, good.weight)
    assert "skipping checkpoint" in capsys.readouterr().err


def test_newest_valid_checkpoint_wins_and_old_ones_are_pruned(tmp_path):
    for s in (1, 2, 3, 4):
        checkpoint.save(str(tmp_path), s, *_tiny_state(s), None, {}, rank=0, fsdp=False, keep=2)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == \
        ["ckpt_00000004.pt", "ckpt_00000003.pt"]
    assert not [n for n in os.listdir(tmp_path) if "tmp" in n or n.startswith("ckpt_00000001")]
    assert _load(tmp_path)[0] == 4
    assert _load(tmp_path, "none")[0] is None


def _data(tmp_path, block=32):
    return TokenData(None, ByteTokenizer(), str(tmp_path / "cache"), block)


def test_windows_reproducible_per_seed_and_distinct_across_ranks(tmp_path):
    d = _data(tmp_path)
    a0, _ = d.batch("train", 8, seed=1, rank=0, step=5)
    assert torch.equal(a0, d.batch("train", 8, seed=1, rank=0, step=5)[0])
    assert not torch.equal(a0, d.batch("train", 8, seed=1, rank=1, step=5)[0])
    assert not torch.equal(a0, d.batch("train", 8, seed=2, rank=0, step=5)[0])
    assert not torch.equal(a0, d.batch("train", 8, seed=1, rank=0, step=6)[0])
    x, y = d.batch("val", 3, 1, 0, 0)
    assert x.shape == y.shape == (3, 32) and torch.equal(x[:, 1:], y[:, :-1])


def test_cache_is_keyed_by_data_and_tokenizer_and_reused(tmp_path):
    d1 = _data(tmp_path)
    mtime = os.path.getmtime(os.path.join(d1.dir, "done"))
    assert _data(tmp_path).dir == d1.dir and os.path.getmtime(os.path.join(d1.dir, "done")) == mtime
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("hello world " * 500)
    d2 = TokenData(str(tmp_path / "txt"), ByteTokenizer(), str(tmp_path / "cache"), 32)
    assert d2.dir != d1.dir and d2.n_tokens == 6001  # 6000 bytes + end-of-text


def test_waiting_rank_times_out_instead_of_hanging(tmp_path):
    with pytest.raises(TimeoutError, match="did not finish tokenizing"):
        TokenData(None, ByteTokenizer(), str(tmp_path), 32, local_rank=1, timeout_s=0.5)


def test_bad_jsonl_is_a_usage_error(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(UsageError, match=r"a.jsonl:2 is not valid JSON"):
        TokenData(str(tmp_path), ByteTokenizer(), str(tmp_path / "cache"), 8)


def _trainer(cfg, model, sync_module=None):
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    from contextlib import nullcontext
    return Trainer(model, sync_module, opt, scaler, nullcontext(), cfg, torch.device("cpu"))


def test_accumulated_step_equals_one_big_batch(tmp_path):
    """Loss divided by the micro-steps: 2 x 4 sequences update exactly like 1 x 8."""
    cfg = parse_args(["--grad-clip", "0", "--block-size", "16"])
    d = _data(tmp_path, 16)
    x, y = d.batch("train", 8, 0, 0, 0)
    deltas, losses = [], []
    for batches in ([(x, y)], [(x[:4], y[:4]), (x[4:], y[4:])]):
        torch.manual_seed(0)
        model = build_model(cfg)
        before = [p.detach().clone() for p in model.parameters()]
        losses.append(_trainer(cfg, model).step(batches, lr=1.0).item())
        deltas.append(torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert torch.allclose(deltas[0], deltas[1], atol=1e-6)


# Process groups of finished tests, kept alive until the interpreter exits. A core dump showed
# why: once destroy_process_group drops the group, the last reference can be the comm hook's
# Python callback that a gloo worker thread is still disposing (Future.then); the group's
# destructor then runs on that worker and joins itself -> std::system_error -> abort of pytest.
# Holding the group here means the main thread frees it, when the workers are long idle.
_FINISHED_GROUPS = []


@pytest.fixture
def one_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    _FINISHED_GROUPS.append(dist.group.WORLD)
    dist.destroy_process_group()


@pytest.mark.parametrize("hook, dtype", [("none", "fp32"), ("fp16", "fp32"), ("bf16", "fp32"), ("powersgd", "fp32"),
                                         ("powersgd", "bf16"), ("powersgd", "fp16")])
def test_only_the_last_micro_step_all_reduces(tmp_path, one_rank_group, hook, dtype):
    from torch.nn.parallel import DistributedDataParallel as DDP
    cfg = parse_args(["--block-size", "16", "--comm-hook", hook, "--powersgd-start-iter", "2",
                      "--powersgd-dtype", dtype])
    ddp = DDP(build_model(cfg), bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=True)
    calls = []

    def counting(h):
        def wrapped(state, bucket):
            calls.append(bucket.index())
            return h(state, bucket)
        return wrapped

    register_comm_hook(ddp, cfg, wrap=counting)
    t = _trainer(cfg, ddp, ddp)
    d = _data(tmp_path, 16)
    for step in range(3):
        calls.clear()
        t.step([d.batch("train", 2, 0, 0, step, m) for m in range(4)], lr=1e-3)
        n_buckets = len(set(calls))
        assert n_buckets >= 1 and len(calls) == n_buckets  # one reduction per bucket per *step*


def test_bf16_hook_on_gloo_averages_bf16_rounded_gradients(tmp_path, one_rank_group):
    """The bf16 hook DDP accepts off NCCL: one rank's synced gradients are its own, rounded to bf16."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    cfg = parse_args(["--block-size", "16", "--comm-hook", "bf16"])
    torch.manual_seed(0)
    plain = build_model(cfg)
    ddp = DDP(build_model(cfg), gradient_as_bucket_view=True)
    ddp.module.load_state_dict(plain.state_dict())
    register_comm_hook(ddp, cfg)
    x, y = _data(tmp_path, 16).batch("train", 2, 0, 0, 0)
    for model in (plain, ddp):
        _trainer(cfg, model).loss(x, y).backward()
    pairs = list(zip(plain.parameters(), ddp.module.parameters()))
    assert all(torch.equal(p.grad.to(torch.bfloat16).float(), q.grad) for p, q in pairs)
    assert any(not torch.equal(p.grad, q.grad) for p, q in pairs)  # the rounding did happen


@pytest.mark.parametrize("zero, gathered_after_forward", [(3, False), (2, True)])
def test_zero2_keeps_parameters_gathered_between_forward_and_backward(tmp_path, one_rank_group, zero,
                                                                      gathered_after_forward):
    """--zero 2 is FSDP2 without resharding after forward: after the forward pass a block holds its
    unsharded parameters (plain tensors) until backward; --zero 3 is back to sharded DTensors."""
    from torch.distributed.tensor import DTensor

    from trainer.parallel import shard_model
    cfg = parse_args(["--block-size", "16", "--strategy", "fsdp", "--zero", str(zero)])
    model = build_model(cfg)
    shard_model(model, cfg, torch.device("cpu"))
    block = model.transformer.h[0]
    assert all(isinstance(p, DTensor) for p in block.parameters())  # sharded before forward
    x, y = _data(tmp_path, 16).batch("train", 2, 0, 0, 0)
    loss = _trainer(cfg, model).loss(x, y)
    assert all(not isinstance(p, DTensor) for p in block.parameters()) == gathered_after_forward
    loss.backward()
    assert all(isinstance(p, DTensor) for p in block.parameters())  # and sharded again after backward
