"""The small frozen target the draft trainers' tests train over."""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.tools.distill.standalone import new_llama


def llama_config(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, *,
                 vocab: int) -> dict:  # fmt: skip
    """A Llama ``config.json`` of these dimensions."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": intermediate, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }  # fmt: skip


def tiny_llama(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, *, vocab: int,
               seed: int):  # fmt: skip
    """A randomly initialised (``seed``) Llama in eval mode, on the CPU."""
    config = llama_config(hidden, layers, heads, kv_heads, head_dim, intermediate, vocab=vocab)
    return new_llama(config, seed, torch.device("cpu")).eval()


@pytest.fixture(scope="module")
def target():
    """A 2-layer Llama (hidden 64, vocabulary 64, seed 0)."""
    return tiny_llama(64, 2, 4, 2, 16, 128, vocab=64, seed=0)
