"""A DFLASH draft written as the runtime reads one, expanded to the serving target's shape."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .eagle_checkpoint import EAGLE_COPIED_KEYS
from .shapes import SHAPES


def dflash_config(target_raw: dict, *, intermediate: int, num_layers: int, layer_ids: list[int], block: int,
                  mask_id: int) -> dict:  # fmt: skip
    """config.json of a DFLASH draft (z-lab's ``DFlashDraftModel`` fields) for the target
    whose config.json is ``target_raw``: its heads, rope and eps, its hidden size."""
    raw = {key: target_raw[key] for key in EAGLE_COPIED_KEYS if key in target_raw}
    raw.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        num_hidden_layers=num_layers,
        num_target_layers=target_raw["num_hidden_layers"],
        intermediate_size=intermediate,
        attention_bias=False,
        layer_types=["full_attention"] * num_layers,
        block_size=block,
        dflash_config={"block_size": block, "target_layer_ids": list(layer_ids), "mask_token_id": mask_id},
        tie_word_embeddings=False,
        torch_dtype="float32",  # rescaled norm weights are not bfloat16 values (as the EAGLE head's)
    )
    return raw


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


def save_dflash(tensors: dict[str, torch.Tensor], raw: dict, dest: Path) -> Path:
    """Write a DFLASH draft directory, checked against the runtime's reading of ``raw``."""
    from loraserve.runtime.dev.dflash_builder import write_dflash_draft
    from loraserve.runtime.speculative.dflash_format import dflash_config_from_dict

    config = dflash_config_from_dict(raw, target_num_layers=int(raw["num_target_layers"]))
    shapes = config.tensor_shapes()
    wrong = {n: tuple(t.shape) for n, t in tensors.items() if shapes.get(n) != tuple(t.shape)}
    if wrong or set(shapes) != set(tensors):
        raise ValueError(
            f"DFLASH draft tensors do not fit their config: {wrong or sorted(set(shapes) ^ set(tensors))}"
        )
    return write_dflash_draft(dest, raw, {n: t.float() for n, t in tensors.items()})
