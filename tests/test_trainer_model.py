"""trainer/gpt2.py against transformers' GPT2LMHeadModel (SDPA attention, tied embeddings), which
it replaced so that a launch does not import transformers: the same parameter names, shapes and
order; the same initial weights from the same seed; with the same weights the same logits, loss
and gradients (bit for bit in fp32, and under bf16 autocast, dropout and gradient checkpointing);
checkpoints load both ways. And the trainer's start-up imports no transformers at all."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from trainer.config import parse_args
from trainer.model import build_model

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--n-layer", "3", "--n-embd", "48", "--n-head", "4", "--block-size", "32", "--vocab-size", "300"]


def reference(cfg, **drop):
    """transformers' model as the trainer built it before (trainer/model.py's old gpt2_config)."""
    p = drop.get("p", cfg.dropout)
    conf = transformers.GPT2Config(
        n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, n_positions=cfg.block_size,
        vocab_size=cfg.vocab_size, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, tie_word_embeddings=True,
        use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(conf)


def pair(args, seed=0):
    cfg = parse_args(args)
    torch.manual_seed(seed)
    ref = reference(cfg)
    torch.manual_seed(seed)
    return cfg, ref, build_model(cfg)


def batch(cfg, seed=1, b=3):
    return torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("args", [SMALL, ["--preset", "nano"]])
def test_same_seed_same_parameters_in_the_same_order(args):
    cfg, ref, ours = pair(args)
    assert [(n, p.shape) for n, p in ref.named_parameters()] == [(n, p.shape) for n, p in ours.named_parameters()]
    a, b = ref.state_dict(), ours.state_dict()
    assert list(a) == list(b)  # lm_head.weight included, as checkpoints hold it
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    torch.manual_seed(0)
    reference(cfg)
    after_ref = torch.rand(8)
    torch.manual_seed(0)
    build_model(cfg)
    assert torch.equal(torch.rand(8), after_ref)  # the generator moved on by the same draws: what follows is the same
    assert ours.lm_head.weight is ours.transformer.wte.weight


def test_same_weights_same_logits_loss_and_gradients():
    cfg, ref, ours = pair(SMALL)
    x = batch(cfg)
    lr, lo = ref(input_ids=x).logits, ours(input_ids=x)
    assert torch.equal(lr, lo)
    loss_r = F.cross_entropy(lr.view(-1, cfg.vocab_size), x.view(-1))
    loss_o = F.cross_entropy(lo.view(-1, cfg.vocab_size), x.view(-1))
    assert torch.equal(loss_r, loss_o)
    loss_r.backward()
    loss_o.backward()
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p.grad, q.grad), n
    # the loss transformers computes itself from labels agrees too (it shifts; the trainer does not)
    shifted = F.cross_entropy(lo[:, :-1].reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
    assert torch.allclose(ref(input_ids=x, labels=x).loss, shifted, rtol=1e-6, atol=1e-6)


def test_bf16_autocast_matches():
    cfg, ref, ours = pair(SMALL)
    x = batch(cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lr, lo = ref(input_ids=x).logits, ours(input_ids=x)
    assert lo.dtype == lr.dtype == torch.bfloat16
    assert torch.equal(lr, lo)


def test_dropout_and_gradient_checkpointing_match():
    """Training mode, dropout 0.2, activations recomputed in backward: the same masks from the
    same generator state (same modules, same order), the same gradients."""
    cfg, ref, ours = pair([*SMALL, "--dropout", "0.2", "--grad-checkpointing"])
    ref.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    x = batch(cfg)
    losses = []
    for model in (ref, ours):
        model.train()
        torch.manual_seed(7)
        out = model(input_ids=x)
        logits = out.logits if hasattr(out, "logits") else out
        loss = F.cross_entropy(logits.view(-1, cfg.vocab_size), x.view(-1))
        loss.backward()
        losses.append(loss)
    assert torch.equal(*losses)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), ours.parameters()))
    ours.eval()
    torch.manual_seed(7)
    assert not torch.equal(ours(x), ours.train()(x))  # dropout really was on


def test_checkpoints_load_both_ways():
    cfg, ref, ours = pair(SMALL, seed=3)
    torch.manual_seed(4)
    other = build_model(cfg)
    other.load_state_dict(ref.state_dict())  # strict: every name and shape
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), ref.state_dict().values()))
    torch.manual_seed(5)
    back = reference(cfg)
    back.load_state_dict(ours.state_dict())
    x = batch(cfg)
    assert torch.equal(back(input_ids=x).logits, ours(x))


@pytest.mark.slow
def test_starting_the_trainer_imports_no_transformers(tmp_path):
    """Importing transformers was most of every launch's start-up (15 s of 19 s on the test
    cluster): the model, the tokenizers and the loop must not pull it in."""
    code = ("import sys; from trainer.__main__ import main; rc = main(sys.argv[1:]); "
            "assert 'transformers' not in sys.modules, 'transformers was imported'; sys.exit(rc)")
    for args in (["--preset", "nano"], ["--preset", "tiny", "--n-layer", "1", "--block-size", "32",
                                        "--batch-size", "1"]):
        r = subprocess.run([sys.executable, "-c", code, *args, "--max-steps", "1", "--sample-tokens", "2",
                            "--eval-steps", "1", "--output-dir", str(tmp_path / args[1])],
                           cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert r.returncode == 0, r.stderr[-2000:]
        assert "step 1 | val loss" in r.stdout


def _trained_reference(cfg):
    """transformers' model and the trainer's optimizer after one step: what the trainer saved before."""
    from trainer.train import configure_optimizer
    torch.manual_seed(8)
    ref = reference(cfg)
    opt = configure_optimizer(ref, cfg, torch.device("cpu"))
    x = batch(cfg)
    F.cross_entropy(ref(input_ids=x).logits.view(-1, cfg.vocab_size), x.view(-1)).backward()
    opt.step()
    return ref, opt


@pytest.mark.slow
@pytest.mark.parametrize("legacy_buffers", [False, True])
def test_a_checkpoint_of_transformers_model_resumes(tmp_path, legacy_buffers):
    """A checkpoint the trainer wrote around GPT2LMHeadModel resumes into its own GPT-2: the same
    weights, optimizer state and logits. Older transformers also kept the causal-mask buffers
    (`attn.bias`, `attn.masked_bias`) among the weights; those are dropped, not refused."""
    from dataclasses import asdict

    from trainer import checkpoint
    from trainer.train import configure_optimizer
    cfg = parse_args(SMALL)
    ref, opt = _trained_reference(cfg)
    state = {"model": ref.state_dict(), "optimizer": opt.state_dict(),
             **checkpoint.extra_state(5, None, asdict(cfg))}
    if legacy_buffers:
        for i in range(cfg.n_layer):
            state["model"][f"transformer.h.{i}.attn.bias"] = torch.tril(
                torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool)).view(1, 1, cfg.block_size, cfg.block_size)
            state["model"][f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    checkpoint.write_file(str(tmp_path), checkpoint.file_path(str(tmp_path), 5), state, keep=3)
    torch.manual_seed(9)
    ours = build_model(cfg)
    ours_opt = configure_optimizer(ours, cfg, torch.device("cpu"))
    assert checkpoint.load("auto", str(tmp_path), ours, ours_opt, None, rank=0, fsdp=False, distributed=False) == 5
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))
    got, want = ours_opt.state_dict(), opt.state_dict()
    assert got["param_groups"] == want["param_groups"] and got["state"].keys() == want["state"].keys()
    assert all(torch.equal(got["state"][i][k], want["state"][i][k]) for i in want["state"] for k in want["state"][i])
    x = batch(cfg, seed=2)
    assert torch.equal(ours(x), ref(input_ids=x).logits)


@pytest.mark.slow
def test_a_checkpoint_of_another_model_stops_the_trainer_with_one_sentence(tmp_path):
    """Resuming a checkpoint of other sizes fails on its first line, naming the checkpoint, what
    does not fit and the flags it was written with; not a traceback of load_state_dict."""
    from dataclasses import asdict

    from trainer import checkpoint
    from trainer.train import configure_optimizer
    written = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32"]
    cfg = parse_args(written)
    model = build_model(cfg)
    checkpoint.save(str(tmp_path), 4, model, configure_optimizer(model, cfg, torch.device("cpu")), None,
                    asdict(cfg), rank=0, fsdp=False)
    now = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "32"]
    r = subprocess.run([sys.executable, "-m", "trainer", *now, "--output-dir", str(tmp_path), "--max-steps", "6",
                        "--batch-size", "1", "--sample-tokens", "0"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "step 5" not in r.stdout
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("trainer: error:")]
    assert f"checkpoint {tmp_path / 'ckpt_00000004.pt'} holds another model's weights" in line, line
    assert "transformer.wte.weight is [256, 32] there, [256, 64] here" in line and "n_embd=32" in line, line
    assert "--resume none" in line
