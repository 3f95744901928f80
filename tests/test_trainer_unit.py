"""Fast trainer checks: no training, no processes beyond the CLI ones."""
import os
import re
import subprocess
import sys

import pytest

from trainer.config import PRESETS, TrainConfig, UsageError, check_precision, make_config, parse_args
from trainer.model import build_model, count_params, flops_per_token
from trainer.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_tiny_param_count_counts_tied_head_once():
    cfg = parse_args(["--preset", "tiny"])
    model = build_model(cfg, "meta")
    assert count_params(model) == 30_142_848
    assert count_params(cfg) == 30_142_848  # closed form, what planners import
    assert flops_per_token(cfg) == 6 * 30_142_848 + 12 * 6 * 6 * 64 * 512
    assert model.lm_head.weight is model.transformer.wte.weight
    n = count_params(model)
    assert flops_per_token(cfg, n) == 6 * n + 12 * 6 * 6 * 64 * 512


def test_gpt2_bpe_offline():
    tok = load_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.decode([15496, 995]) == "Hello world"
    assert tok.vocab_size == 50257


def test_presets_and_pad_vocab():
    assert parse_args([]).tokenizer == "byte"
    cfg = parse_args(["--preset", "small", "--pad-vocab", "--n-layer", "3"])
    assert (cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.tokenizer) == (3, 768, 50304, "gpt2")
    with pytest.raises(UsageError):
        parse_args(["--n-embd", "65", "--n-head", "2"])
    with pytest.raises(UsageError):
        parse_args(["--strategy", "fsdp", "--comm-hook", "fp16"])


def test_help_lists_every_flag():
    """Every TrainConfig field is a documented flag (except `preset`'s own derived fields)."""
    from dataclasses import fields

    from trainer.config import TrainConfig
    out = cli("--help").stdout
    flags = ["--" + f.name.replace("_", "-") for f in fields(TrainConfig)]
    missing = [f for f in flags if f not in out]
    assert not missing
    helped = re.findall(r"^  (--[a-z0-9-]+)", out, re.M)
    assert len(helped) >= len(flags)  # each on its own line, with its help text
    assert "pydoc_data.topics" in out  # the demo corpus is named


def test_each_default_is_the_dataclass_default():
    """No flags = TrainConfig(): the parser states no default of its own; the nano preset's shape
    is the dataclass's, and another preset's shape comes from its named fields."""
    assert parse_args([]) == TrainConfig() == make_config({})
    tiny = PRESETS["tiny"]
    cfg = parse_args(["--preset", "tiny", "--n-head", "3"])
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, cfg.vocab_size, cfg.tokenizer) == \
        (tiny.n_layer, tiny.n_embd, 3, tiny.block_size, tiny.vocab_size, tiny.tokenizer)
    out = cli("--help").stdout
    assert "(default: 0.001)" in out and "(default: from --preset)" in out


def test_unknown_or_mistyped_config_keys_are_errors_naming_them():
    with pytest.raises(UsageError, match=r"unknown config keys: foo, n_layers"):
        make_config({"lr": 1e-3, "n_layers": 3, "foo": 1})
    with pytest.raises(UsageError, match=r"config key n_layer must be int, got True"):
        make_config({"n_layer": True})
    with pytest.raises(UsageError, match=r"config key lr must be float, got '1e-3'"):
        make_config({"lr": "1e-3"})
    with pytest.raises(UsageError, match=r"unknown preset 'huge'"):
        make_config({"preset": "huge"})
    assert make_config({"lr": 1, "min_lr": None}).lr == 1.0 and isinstance(make_config({"lr": 1}).lr, float)
    with pytest.raises(UsageError, match="--batch-size must be positive, got 0"):
        parse_args(["--batch-size", "0"])
    with pytest.raises(UsageError, match="--grad-clip must not be negative"):
        parse_args(["--grad-clip", "-1"])


@pytest.mark.parametrize("preset, n", [("small", 124_439_808), ("medium", 354_823_168), ("nano", 120_576)])
def test_closed_form_matches_the_real_model(preset, n):
    cfg = parse_args(["--preset", preset])
    assert count_params(cfg) == count_params(build_model(cfg, "meta")) == n
    padded = parse_args(["--preset", preset, "--pad-vocab"])
    assert padded.vocab_size % 64 == 0 and count_params(build_model(padded, "meta")) == count_params(padded)


@pytest.mark.parametrize("args, words", [
    (["--no-such-flag"], "unrecognized arguments"),
    (["--data", "/nonexistent/corpus"], "does not exist"),
    (["--precision", "fp8"], "invalid choice"),
    (["--data", "/etc/hostname"], "neither .txt nor .jsonl"),
    (["--data", "hf:some/dataset", "--max-steps", "1"], "hugging face"),
    (["--lr", "-1"], "--lr must be positive"),
    (["--tokenizer", "/nonexistent/tok"], "neither 'byte', 'gpt2' nor a local directory"),
    (["--resume", "/nonexistent/ckpt.pt"], "does not exist"),
])
@pytest.mark.slow
def test_user_errors_exit_2_without_traceback(args, words):
    r = cli(*args)
    assert r.returncode == 2
    assert words in r.stderr.lower() and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_empty_data_dir_is_a_usage_error(tmp_path):
    r = cli("--data", str(tmp_path))
    assert r.returncode == 2 and "no .txt or .jsonl" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_local_hf_tokenizer_directory(tmp_path):
    """--tokenizer PATH: any tokenizer saved with save_pretrained, loaded offline."""
    from transformers import PreTrainedTokenizerFast
    PreTrainedTokenizerFast(tokenizer_object=load_tokenizer("gpt2")._tok, eos_token="<|endoftext|>") \
        .save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.eot == 50256 and tok.vocab_size == 50257
    assert parse_args(["--tokenizer", str(tmp_path)]).tokenizer == str(tmp_path)


def test_fp16_on_cpu_is_refused_unless_asked_for():
    check_precision(parse_args(["--precision", "fp16"]), "cuda")
    check_precision(parse_args(["--precision", "bf16"]), "cpu")
    check_precision(parse_args(["--precision", "fp16", "--allow-slow-fp16"]), "cpu")
    with pytest.raises(UsageError, match=r"measured \d+-\d+x slower than fp32"):
        check_precision(parse_args(["--precision", "fp16"]), "cpu")


@pytest.mark.slow
def test_fp16_on_a_cpu_only_run_exits_2_naming_the_way_out(tmp_path):
    r = subprocess.run([sys.executable, "-m", "trainer", "--precision", "fp16", "--output-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # CPU-only even on a GPU host
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert re.search(r"measured \d+-\d+x slower than fp32", r.stderr), r.stderr
    for words in ("--precision bf16", "or fp32", "--allow-slow-fp16"):
        assert words in r.stderr
    assert not os.listdir(tmp_path)  # refused before any data, model or checkpoint work


@pytest.mark.parametrize("args", [["--zero", "2"], ["--cpu-offload"]])
def test_fsdp_only_flags_are_refused_with_ddp(args):
    with pytest.raises(UsageError, match="apply to --strategy fsdp only"):
        parse_args(args)
    assert parse_args(["--strategy", "fsdp", *args]).strategy == "fsdp"
