"""Function-preserving expansion: the small trained models' weights in 8B-shaped ones.

The serving target (and the EAGLE head served over it) runs every GEMM at the full shape
and computes exactly what the small trained model computes.
"""

from __future__ import annotations

import math

import torch

from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.tools.distill.eagle_head import EAGLE_NAMES

from .shapes import SHAPES


@torch.no_grad()
def expand_into(runner: ModelRunner, small: dict[str, torch.Tensor], small_shape: str) -> None:
    """Make ``runner``'s (bigger, randomly initialised) model compute the small model's function.

    Padded hidden dimensions stay exactly zero in the residual stream: the embedding,
    every o_proj / down_proj outside the small block, and whole extra layers write zeros
    there. RMSNorm over the padded width sees ``Hs/Hb`` of the mean square, so norm
    weights scale by ``sqrt(Hs/Hb)`` (and eps by ``Hs/Hb`` in config.json).
    """
    hs, ls, ns, kvs, d, is_ = SHAPES[small_shape]
    m = runner.model
    arch = runner.arch
    hb, ib = arch.hidden_size, arch.intermediate_size
    assert arch.head_dim == d and arch.num_heads // arch.num_kv_heads == ns // kvs, "GQA groups must match"
    scale = math.sqrt(hs / hb)

    def w(name: str) -> torch.Tensor:
        return small[name].to(device=runner.device, dtype=runner.dtype)

    emb = m.model.embed_tokens.weight
    emb.zero_()
    emb[:, :hs] = w("model.embed_tokens.weight")
    q_b, kv_b = arch.q_size, arch.kv_size
    for i, layer in enumerate(m.model.layers):
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        if i >= ls:
            continue  # an identity layer: attention and MLP add zero to the stream
        p = f"model.layers.{i}."
        qkv = layer.self_attn.qkv_proj.weight
        qkv[: ns * d, :hs] = w(p + "self_attn.q_proj.weight")
        qkv[q_b : q_b + kvs * d, :hs] = w(p + "self_attn.k_proj.weight")
        qkv[q_b + kv_b : q_b + kv_b + kvs * d, :hs] = w(p + "self_attn.v_proj.weight")
        layer.self_attn.o_proj.weight[:hs, : ns * d] = w(p + "self_attn.o_proj.weight")
        gate_up = layer.mlp.gate_up_proj.weight
        gate_up[:is_, :hs] = w(p + "mlp.gate_proj.weight")
        gate_up[ib : ib + is_, :hs] = w(p + "mlp.up_proj.weight")
        layer.mlp.down_proj.weight[:hs, :is_] = w(p + "mlp.down_proj.weight")
        layer.input_layernorm.weight[:hs] = w(p + "input_layernorm.weight") * scale
        layer.post_attention_layernorm.weight[:hs] = w(p + "post_attention_layernorm.weight") * scale
    m.model.norm.weight[:hs] = w("model.norm.weight") * scale
    m.lm_head.weight[:, :hs] = w("lm_head.weight")


@torch.no_grad()
def expand_eagle_head(
    small: dict[str, torch.Tensor], small_shape: str, big_shape: str
) -> dict[str, torch.Tensor]:
    """The small head's weights placed in a head of ``big_shape`` that computes the same function
    on the expanded target's features (``expand_into``): the embedding and feature inputs are
    zero-padded, so fc reads only their first ``Hs`` dimensions and writes only its first
    ``Hs`` outputs; extra heads and MLP units have zero weights and add nothing; RMSNorm
    weights scale by ``sqrt(Hs/Hb)`` (the config's eps is the big target's, ``eps * Hs/Hb``).
    """
    hs, _, ns, kvs, d, _ = SHAPES[small_shape]
    hb, _, nb, kvb, db, ib = SHAPES[big_shape]
    if db != d or nb // kvb != ns // kvs:
        raise ValueError(f"{big_shape} must keep {small_shape}'s head_dim {d} and GQA group size {ns // kvs}")
    scale = math.sqrt(hs / hb)
    big = {
        "fc.weight": torch.zeros(hb, 2 * hb),
        EAGLE_NAMES["q_proj"]: torch.zeros(nb * d, hb),
        EAGLE_NAMES["k_proj"]: torch.zeros(kvb * d, hb),
        EAGLE_NAMES["v_proj"]: torch.zeros(kvb * d, hb),
        EAGLE_NAMES["o_proj"]: torch.zeros(hb, nb * d),
        EAGLE_NAMES["gate_proj"]: torch.zeros(ib, hb),
        EAGLE_NAMES["up_proj"]: torch.zeros(ib, hb),
        EAGLE_NAMES["down_proj"]: torch.zeros(hb, ib),
        EAGLE_NAMES["input_norm"]: torch.zeros(hb),
        EAGLE_NAMES["post_norm"]: torch.zeros(hb),
    }
    fc = small["fc.weight"]
    big["fc.weight"][:hs, :hs] = fc[:, :hs]  # the embedding half
    big["fc.weight"][:hs, hb : hb + hs] = fc[:, hs:]  # the feature half
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        w = small[EAGLE_NAMES[name]]
        big[EAGLE_NAMES[name]][: w.shape[0], :hs] = w
    for name in ("o_proj", "down_proj"):
        w = small[EAGLE_NAMES[name]]
        big[EAGLE_NAMES[name]][:hs, : w.shape[1]] = w
    for name in ("input_norm", "post_norm"):
        big[EAGLE_NAMES[name]][:hs] = small[EAGLE_NAMES[name]] * scale
    return big


@torch.no_grad()
def expand_dflash(small: dict[str, torch.Tensor], small_shape: str, big_shape: str, *, num_layers: int,
                  num_features: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """The small draft's weights in a draft of ``big_shape`` that computes the same function
    over the expanded target (``expansion.expand_into``: the padded dimensions of its
    residual stream, hence of every captured layer output and of the embeddings, are zero).

    fc reads the first ``Hs`` dimensions of each captured output and writes the first ``Hs``;
    the small heads are the first heads (same head_dim and GQA group), extra heads and MLP
    units have zero weights and add nothing; the per-head q/k norms are unchanged; RMSNorms
    over the hidden width scale by ``sqrt(Hs/Hb)`` (the config's eps is the big target's,
    ``eps * Hs/Hb``)."""
    hs, _, ns, kvs, d, _ = SHAPES[small_shape]
    hb, _, nb, kvb, db, ib = SHAPES[big_shape]
    if db != d or nb // kvb != ns // kvs:
        raise ValueError(f"{big_shape} must keep {small_shape}'s head_dim {d} and GQA group size {ns // kvs}")
    scale = math.sqrt(hs / hb)
    fc = torch.zeros(hb, num_features * hb)
    for k in range(num_features):
        fc[:hs, k * hb : k * hb + hs] = small["fc.weight"][:, k * hs : (k + 1) * hs]
    big = {"fc.weight": fc}
    for name in ("hidden_norm.weight", "norm.weight"):
        big[name] = torch.zeros(hb)
        big[name][:hs] = small[name] * scale
    shapes = {"q_proj": (nb * d, hb), "k_proj": (kvb * d, hb), "v_proj": (kvb * d, hb), "o_proj": (hb, nb * d),
              "gate_proj": (ib, hb), "up_proj": (ib, hb), "down_proj": (hb, ib)}  # fmt: skip
    for j in range(num_layers):
        p = f"layers.{j}."
        for part, shape in shapes.items():
            name = (
                p
                + ("mlp." if part.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn.")
                + part
                + ".weight"
            )
            w = small[name]
            big[name] = torch.zeros(shape)
            big[name][: w.shape[0], : w.shape[1]] = w  # the small block: first rows, first columns
        for norm in ("input_layernorm", "post_attention_layernorm"):
            big[p + norm + ".weight"] = torch.zeros(hb)
            big[p + norm + ".weight"][:hs] = small[p + norm + ".weight"] * scale
        for norm in ("q_norm", "k_norm"):  # over head_dim: untouched by the padding
            big[p + f"self_attn.{norm}.weight"] = small[p + f"self_attn.{norm}.weight"].clone()
    return big
