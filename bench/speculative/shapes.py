"""The Llama shapes the benchmark trains and serves, and their ``config.json``."""

SHAPES = {
    # name: (hidden, layers, heads, kv_heads, head_dim, intermediate)
    "smoke-small": (64, 2, 4, 2, 16, 128),
    "smoke-draft": (32, 1, 2, 1, 16, 64),
    "smoke-big": (128, 4, 8, 4, 16, 256),
    "cpu-deep": (128, 8, 4, 2, 32, 384),  # a CPU target as deep as "small", for DFLASH recipe studies
    "small": (1024, 8, 8, 2, 128, 2816),
    "draft": (384, 2, 6, 3, 64, 1024),
    "8b": (4096, 32, 32, 8, 128, 14336),
}


def llama_config(shape: str, vocab: int, *, eps: float = 1e-5, max_pos: int = 4096) -> dict:
    """The ``config.json`` of a Llama of ``shape`` over the local tokenizer's ``vocab``."""
    hidden, layers, heads, kv, head_dim, inter = SHAPES[shape]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "rms_norm_eps": eps,
        "max_position_embeddings": max_pos,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }
