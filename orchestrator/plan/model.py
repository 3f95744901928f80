"""GPT-2 as the planner sees it: named presets, parameter shapes and counts, FLOPs per token."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class ModelSpec:
    n_layer: int
    n_embd: int
    n_head: int
    n_positions: int
    vocab_size: int
    n_inner: int | None = None  # MLP width; None = 4 * n_embd (GPT2Config's default)
    tied: bool = True  # LM head shares the token embedding (GPT-2)
    pad_vocab_to: int = 1  # round vocab up to a multiple of this (e.g. 64 -> 50304)

    @property
    def vocab(self) -> int:
        m = max(1, self.pad_vocab_to)
        return -(-self.vocab_size // m) * m

    @property
    def inner(self) -> int:
        return self.n_inner or 4 * self.n_embd

    def validate(self) -> "ModelSpec":
        for f in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.n_inner is not None and self.n_inner < 1:
            raise ValueError(f"n_inner must be >= 1, got {self.n_inner}")
        return self


def _presets() -> dict[str, ModelSpec]:
    out = {
        "nano": ModelSpec(2, 64, 2, 64, 256),
        "tiny": ModelSpec(6, 384, 6, 512, 50257),
        "small": ModelSpec(12, 768, 12, 1024, 50257),
        "medium": ModelSpec(24, 1024, 16, 1024, 50257),
    }
    try:  # the trainer's presets win (trainer/config.py: name -> Preset(n_layer, n_embd, ...));
        # config.py is torch-free, so this keeps `clusterctl plan` fast
        from trainer.config import PRESETS as _trainer_presets  # type: ignore

        for name, p in _trainer_presets.items():
            out[name] = ModelSpec(p.n_layer, p.n_embd, p.n_head, p.block_size, p.vocab_size)
    except Exception:  # noqa: BLE001 - no trainer in this checkout, or another shape: use ours
        pass
    return out


PRESETS = _presets()
OVERRIDE_FIELDS = ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size", "n_inner", "pad_vocab_to")


def model_spec(preset: str = "tiny", **overrides) -> ModelSpec:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (one of {', '.join(PRESETS)})")
    return override(PRESETS[preset], **overrides)


def override(m: ModelSpec, **overrides) -> ModelSpec:
    """`m` with the given fields replaced (None = keep), validated."""
    over = {k: v for k, v in overrides.items() if v is not None}
    bad = set(over) - {f.name for f in fields(ModelSpec)}
    if bad:
        raise ValueError(f"unknown model field(s): {', '.join(sorted(bad))}")
    return replace(m, **over).validate()


# config.json / trainer-config spellings of each ModelSpec field (GPT2Config, generic HF, trainer.config)
_CONFIG_KEYS = {
    "n_layer": ("n_layer", "num_hidden_layers"),
    "n_embd": ("n_embd", "hidden_size", "d_model"),
    "n_head": ("n_head", "num_attention_heads"),
    "n_positions": ("n_positions", "max_position_embeddings", "block_size", "n_ctx"),
    "vocab_size": ("vocab_size",),
    "n_inner": ("n_inner", "intermediate_size"),
}


def spec_from_config(doc: dict, base: str = "tiny") -> ModelSpec:
    """A GPT-2 config.json (GPT2Config.to_dict), or the trainer's saved config, -> ModelSpec.
    Fields it lacks come from preset `base`; a non-GPT-2 model_type is refused (the count would lie)."""
    if not isinstance(doc, dict):
        raise ValueError("a model config must be a JSON object")
    kind = doc.get("model_type")
    if kind not in (None, "gpt2"):
        raise ValueError(f"model_type {kind!r} is not GPT-2; plan counts GPT-2 parameters only")
    over: dict = {}
    for field, keys in _CONFIG_KEYS.items():
        for k in keys:
            if doc.get(k) is not None:
                try:
                    over[field] = int(doc[k])
                except (TypeError, ValueError):
                    raise ValueError(f"config field {k} = {doc[k]!r} is not an integer") from None
                break
    if "tie_word_embeddings" in doc:
        over["tied"] = bool(doc["tie_word_embeddings"])
    if doc.get("pad_vocab") is True:  # trainer: vocab rounded up to a multiple of 64
        over["pad_vocab_to"] = 64
    if not {"n_layer", "n_embd"} <= set(over):
        raise ValueError("the config names neither n_layer/num_hidden_layers nor n_embd/hidden_size")
    return model_spec(base, **over)


def param_shapes(m: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of GPT2LMHeadModel, in module order (Conv1D weights are (in, out))."""
    d, h = m.n_embd, m.inner
    shapes = [("wte", (m.vocab, d)), ("wpe", (m.n_positions, d))]
    for i in range(m.n_layer):
        p = f"h.{i}."
        shapes += [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
                   (p + "attn.c_attn.weight", (d, 3 * d)), (p + "attn.c_attn.bias", (3 * d,)),
                   (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
                   (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
                   (p + "mlp.c_fc.weight", (d, h)), (p + "mlp.c_fc.bias", (h,)),
                   (p + "mlp.c_proj.weight", (h, d)), (p + "mlp.c_proj.bias", (d,))]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    if not m.tied:
        shapes.append(("lm_head", (m.vocab, d)))
    return shapes


def param_count(m: ModelSpec) -> int:
    """Closed form: V*d + T*d + L*(4*d*h + 2*h... ) -- i.e. L*(12 d^2 + 13 d) when h = 4d."""
    d, h, L = m.n_embd, m.inner, m.n_layer
    per_layer = (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d) + 4 * d
    n = m.vocab * d + m.n_positions * d + L * per_layer + 2 * d
    return n + (m.vocab * d if not m.tied else 0)


def flops_per_token(m: ModelSpec, seq: int | None = None) -> float:
    """Training FLOPs per token: 6N + 12*L*H*Q*T (Q = head dim, H*Q = n_embd, T = sequence)."""
    return 6 * param_count(m) + 12 * m.n_layer * m.n_embd * (seq or m.n_positions)


