"""Model shapes the planner builds: a small table of GPT-2 and Llama configurations, the paper's GPT-like models by
size ("7.5B"), and any Hugging Face configuration whose architecture is one of the two."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

GPT2, LLAMA = "gpt2", "llama"


@dataclass(frozen=True)
class ModelShape:
    name: str
    style: str  # GPT2: LayerNorm, GELU MLP, learned positions, biases; LLAMA: RMSNorm, SwiGLU, rotary, no biases
    n_layer: int
    d_model: int
    n_head: int
    d_ff: int
    vocab_size: int
    max_seq: int
    n_kv_head: int | None = None  # grouped-query attention; None: as many as n_head
    tied_embeddings: bool = True

    def __post_init__(self):
        if self.style not in (GPT2, LLAMA):
            raise ValueError(f"style must be {GPT2!r} or {LLAMA!r}, got {self.style!r}")
        for name in ("n_layer", "d_model", "n_head", "d_ff", "vocab_size", "max_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_head={self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    def with_depth(self, n_layer: int) -> "ModelShape":
        return dataclasses.replace(self, n_layer=n_layer, name=f"{self.name} ({n_layer} layers)")


def _gpt2(name, n_layer, d_model, n_head):
    return ModelShape(name, GPT2, n_layer, d_model, n_head, 4 * d_model, 50257, 1024)


def _llama(name, n_layer, d_model, n_head, d_ff, vocab=32000, max_seq=4096, n_kv_head=None):
    return ModelShape(name, LLAMA, n_layer, d_model, n_head, d_ff, vocab, max_seq, n_kv_head, tied_embeddings=False)


KNOWN = {shape.name: shape for shape in [
    _gpt2("gpt2", 12, 768, 12), _gpt2("gpt2-medium", 24, 1024, 16), _gpt2("gpt2-large", 36, 1280, 20),
    _gpt2("gpt2-xl", 48, 1600, 25),
    _llama("llama-7b", 32, 4096, 32, 11008), _llama("llama-13b", 40, 5120, 40, 13824),
    _llama("llama-70b", 80, 8192, 64, 28672, n_kv_head=8),
    _llama("llama3-8b", 32, 4096, 32, 14336, vocab=128256, max_seq=8192, n_kv_head=8),
]}

# The paper's GPT-like models (Megatron-LM's shape: 4x MLP, 50257 tokens, 1024 positions) widen with size; depth
# then sets the size: (largest size, d_model, head_dim).
_WIDTHS = [(3e9, 1600, 64), (30e9, 4096, 128), (300e9, 8192, 128), (float("inf"), 25600, 160)]
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([MBT])\s*$", re.IGNORECASE)
_UNITS = {"M": 1e6, "B": 1e9, "T": 1e12}


def gpt_params(n_layer: int, d_model: int, vocab_size: int = 50257, max_seq: int = 1024) -> int:
    """Ψ of a GPT-2-style model with tied embeddings: 12h² + 13h per block, embeddings and the final LayerNorm."""
    return n_layer * (12 * d_model**2 + 13 * d_model) + (vocab_size + max_seq + 2) * d_model


def gpt_of_size(size: str) -> ModelShape:
    """The paper's GPT-like model nearest ``size`` ("7.5B", "100B", "1T"): its width from the size, then the depth
    whose Ψ is nearest."""
    match = _SIZE.match(size)
    if match is None:
        raise ValueError(f"model size must look like 1.5B, 100B or 1T, got {size!r}")
    psi = float(match.group(1)) * _UNITS[match.group(2).upper()]
    _, d_model, head_dim = next(w for w in _WIDTHS if psi <= w[0])
    per_block = gpt_params(1, d_model) - gpt_params(0, d_model)
    n_layer = max(1, round((psi - gpt_params(0, d_model)) / per_block))
    return ModelShape(size.strip().upper(), GPT2, n_layer, d_model, d_model // head_dim, 4 * d_model, 50257, 1024)


def from_hf_config(config) -> ModelShape:
    """The shape of a Hugging Face ``PretrainedConfig`` of a GPT-2 or Llama-like (Llama, Mistral, Qwen2) model."""
    kind = getattr(config, "model_type", None)
    name = getattr(config, "name_or_path", None) or kind
    if kind == "gpt2":
        return ModelShape(name, GPT2, config.n_layer, config.n_embd, config.n_head,
                          config.n_inner or 4 * config.n_embd, config.vocab_size, config.n_positions,
                          tied_embeddings=config.tie_word_embeddings)
    if kind in ("llama", "mistral", "qwen2"):
        return ModelShape(name, LLAMA, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                          config.intermediate_size, config.vocab_size, config.max_position_embeddings,
                          config.num_key_value_heads, tied_embeddings=config.tie_word_embeddings)
    raise ValueError(f"model: a Hugging Face config of type {kind!r} is neither GPT-2 nor Llama-like")


def model_shape(model: str) -> ModelShape:
    """``model`` as the command line takes it: a name from `KNOWN`, a size ("7.5B"), or a Hugging Face model id
    or directory (with transformers installed)."""
    if model in KNOWN:
        return KNOWN[model]
    if _SIZE.match(model):
        return gpt_of_size(model)
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError(f"model: {model!r} is not one of {', '.join(KNOWN)} nor a size such as 7.5B, and "
                         "transformers is not installed to read it as a Hugging Face config") from None
    try:
        return from_hf_config(AutoConfig.from_pretrained(model))
    except (OSError, ValueError) as e:  # no such model or directory; a name that cannot be a Hugging Face id
        raise ValueError(f"model: {model!r} is not one of {', '.join(KNOWN)}, a size such as 7.5B, nor a Hugging "
                         f"Face config that could be read ({e})") from None
