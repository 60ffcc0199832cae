"""Built-in model presets: a family name plus the HuggingFace config fields that define the model."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelPreset:
    family: str
    config: dict = field(default_factory=dict)


def _llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int = 128256) -> dict:
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
    }


def _gpt2(hidden: int, layers: int, heads: int, vocab: int = 50257, positions: int = 1024) -> dict:
    return {"vocab_size": vocab, "n_embd": hidden, "n_layer": layers, "n_head": heads, "n_positions": positions}


def _mixtral(hidden: int, intermediate: int, layers: int, heads: int, experts: int, top_k: int,
             vocab: int) -> dict:
    return {**_llama(hidden, intermediate, layers, heads, heads, vocab=vocab),
            "num_local_experts": experts, "num_experts_per_tok": top_k, "rope_theta": 1e6}


PRESETS: dict[str, ModelPreset] = {
    "llama-3.1-8b": ModelPreset("llama", _llama(4096, 14336, 32, 32, 8)),
    "llama-3.1-70b": ModelPreset("llama", _llama(8192, 28672, 80, 64, 8)),
    "llama-3.1-405b": ModelPreset("llama", _llama(16384, 53248, 126, 128, 8)),
    "llama-tiny": ModelPreset("llama", _llama(64, 128, 2, 8, 8, vocab=256)),
    "llama-tiny-gqa": ModelPreset("llama", _llama(64, 128, 2, 8, 2, vocab=256)),
    "mixtral-tiny": ModelPreset("mixtral", _mixtral(64, 128, 2, 8, 4, 2, vocab=256)),
    "gpt2": ModelPreset("gpt2", _gpt2(768, 12, 12)),
    "gpt2-tiny": ModelPreset("gpt2", _gpt2(64, 2, 8, vocab=256, positions=64)),
}
