"""The built-in tiny models' architecture configs and their exact parameter counts.

Shared because both sides need them: the worker builds the models from these configs
(:mod:`vqpool.worker.models.tiny_models`), and the front door knows what a ``builtin:NAME`` model's
weights cost before any worker loads it (:mod:`vqpool.shared.model_weights`), without importing
MLX. The configs differ in their KV layout (KV heads, head dim) on purpose, so a cache that gets
the layout wrong fails on one of them.
"""

from __future__ import annotations

from typing import Any

BUILTIN_PREFIX = "builtin:"
"""What a ``--model`` starts with to name a built-in tiny model (``builtin:llama``)."""

BYTE_VOCAB: int = 256
"""Vocabulary of every built-in: 256 byte values, so a byte-level tokenizer fits the tiny models."""

BUILTIN_PARAMETER_BYTES = 4
"""Bytes per parameter of a built-in model as the worker serves it: fp32 (``build_tiny_model``'s
default dtype, which ``load_model`` keeps)."""

_TINY_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "rms_norm_eps": 1e-5,
    "vocab_size": BYTE_VOCAB,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # Grouped-query attention: 4 query heads share 2 KV heads of dim 16.
    "llama": {**_TINY_COMMON, "model_type": "llama", "num_key_value_heads": 2},
    # Full multi-head attention (4 KV heads of dim 16), with qwen2's q/k/v biases.
    "qwen2": {**_TINY_COMMON, "model_type": "qwen2", "num_key_value_heads": 4},
    # One KV head of dim 32 (head_dim set apart from hidden / heads), with qwen3's q/k norms.
    "qwen3": {
        **_TINY_COMMON,
        "model_type": "qwen3",
        "num_key_value_heads": 1,
        "head_dim": 32,
        "rope_theta": 1000000.0,
    },
    # The benchmark's larger model: 1024 hidden, 8 layers, 8 KV heads of dim 64.
    "llama-1024x8": {
        **_TINY_COMMON,
        "model_type": "llama",
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "intermediate_size": 2816,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "vocab_size": 4096,
    },
}


def builtin_names() -> list[str]:
    """Tiny models served as ``builtin:NAME``: those a byte-level tokenizer fits (vocabulary of
    256)."""
    return [name for name, cfg in TINY_CONFIGS.items() if cfg["vocab_size"] == BYTE_VOCAB]


def parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The parameters of the mlx-lm model ``config`` describes, by their mlx-lm names, with their
    shapes: as mlx-lm's ``llama``, ``qwen2`` and ``qwen3`` modules build them (the architectures
    of :data:`TINY_CONFIGS`).

    Raises:
        ValueError: Another architecture.
    """
    arch = config["model_type"]
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"no parameter shapes for architecture {arch!r}")
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    intermediate = config["intermediate_size"]
    widths = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        for proj, width in widths.items():
            shapes[f"{layer}.self_attn.{proj}_proj.weight"] = (width, hidden)
            if arch == "qwen2":  # q, k and v projections have biases
                shapes[f"{layer}.self_attn.{proj}_proj.bias"] = (width,)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (hidden, widths["q"])
        if arch == "qwen3":  # RMS norms over each head's queries and keys
            shapes[f"{layer}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{layer}.self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{layer}.mlp.gate_proj.weight"] = (intermediate, hidden)
        shapes[f"{layer}.mlp.up_proj.weight"] = (intermediate, hidden)
        shapes[f"{layer}.mlp.down_proj.weight"] = (hidden, intermediate)
        shapes[f"{layer}.input_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes
