"""The DFLASH draft as a trainable module, with the runtime's checkpoint names.

The equations of ``loraserve.runtime.speculative.dflash.format``: context rows
``hidden_norm(fc(concat of the target's layer outputs))``; a block ``[x_a, mask × (B-1)]``
at positions ``a .. a+B-1`` goes through decoder layers (Qwen3's per-head q/k norms) whose
keys and values are the context rows' (positions ``< a``) and the block's own, every block
row seeing the whole block; ``lm_head(norm(out))`` at block rows ``1..B-1`` predicts
``x_{a+1} .. x_{a+B-1}``. Training puts several blocks of a window in one forward, each
seeing only its own block and the context before its anchor. The target's embeddings and
LM head are frozen buffers.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from .eagle_head import EAGLE_COPIED_KEYS, LayerDims, RopeFrequencies


def dflash_names(num_layers: int) -> list[str]:
    """Checkpoint names (``speculative.dflash.format``) of every trained tensor."""
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for j in range(num_layers):
        p = f"layers.{j}."
        names += [
            p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
            *(p + f"self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")),
            *(p + f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")),
        ]  # fmt: skip
    return names


class _Layer(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, kv: int, head_dim: int, inter: int):
        super().__init__()

        def lin(fan_in: int, fan_out: int) -> torch.nn.Linear:
            return torch.nn.Linear(fan_in, fan_out, bias=False)

        self.input_layernorm = torch.nn.Parameter(torch.ones(hidden))
        self.post_attention_layernorm = torch.nn.Parameter(torch.ones(hidden))
        self.q_proj, self.k_proj = lin(hidden, heads * head_dim), lin(hidden, kv * head_dim)
        self.v_proj, self.o_proj = lin(hidden, kv * head_dim), lin(heads * head_dim, hidden)
        self.q_norm, self.k_norm = (
            torch.nn.Parameter(torch.ones(head_dim)),
            torch.nn.Parameter(torch.ones(head_dim)),
        )
        self.gate_proj, self.up_proj, self.down_proj = (
            lin(hidden, inter),
            lin(hidden, inter),
            lin(inter, hidden),
        )


class DFlashDraft(torch.nn.Module):
    """``num_layers`` DFLASH layers of ``dims`` over the target's ``layer_ids`` outputs."""

    def __init__(
        self, dims: LayerDims, embed: torch.Tensor, lm_head: torch.Tensor, *, layer_ids: list[int], num_layers: int,
        block: int, mask_id: int, eps: float, rope: RopeFrequencies,
    ):  # fmt: skip
        super().__init__()
        hidden, heads, kv, head_dim, inter = (
            dims.hidden,
            dims.heads,
            dims.kv_heads,
            dims.head_dim,
            dims.intermediate,
        )
        self.dims, self.eps, self.block, self.mask_id = dims, eps, block, mask_id
        self.layer_ids = list(layer_ids)
        self.heads, self.kv_heads, self.head_dim = heads, kv, head_dim
        self.fc = torch.nn.Linear(len(layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = torch.nn.Parameter(torch.ones(hidden))
        self.norm = torch.nn.Parameter(torch.ones(hidden))
        self.layers = torch.nn.ModuleList(
            [_Layer(hidden, heads, kv, head_dim, inter) for _ in range(num_layers)]
        )
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().float().clone(), persistent=False)
        self.rope = rope

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The draft's weights under their ``speculative.dflash.format`` names (float32, CPU)."""
        out = {}
        for name, param in self.named_parameters():
            key = name if name.endswith(".weight") else f"{name}.weight"  # norms are bare Parameters
            for part in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                key = key.replace(f".{part}.", f".self_attn.{part}.")
            for part in ("gate_proj", "up_proj", "down_proj"):
                key = key.replace(f".{part}.", f".mlp.{part}.")
            out[key] = param.detach().float().cpu().contiguous()
        return out

    @torch.no_grad()
    def round_to_bf16(self) -> None:
        """Round weights and the shared embeddings / LM head to bfloat16 values (what is served)."""
        for t in [*self.parameters(), self.embed, self.lm_head]:
            t.copy_(t.to(torch.bfloat16).float())

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, heads, d]`` rotated to ``positions`` ``[B, T]``."""
        return self.rope.rotate(x, positions[:, :, None])

    def block_logits(self, ids: torch.Tensor, feats: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, n, block - 1, V]`` of ``n`` blocks per window: block ``j`` of window
        ``b`` starts at ``anchors[b, j]`` (its token ``ids[b, anchor]``, then masks) after the
        context ``feats[b, :anchor]`` (the target's layer outputs ``[B, L, K * H]``)."""
        b, length = ids.shape
        n, blk = anchors.shape[1], self.block
        dev = ids.device
        ctx = self._norm(self.fc(feats), self.hidden_norm)
        block_ids = torch.full((b, n, blk), self.mask_id, dtype=torch.long, device=dev)
        block_ids[:, :, 0] = ids.gather(1, anchors)
        x = F.embedding(block_ids.view(b, n * blk), self.embed).to(ctx.dtype)
        q_pos = (anchors[:, :, None] + torch.arange(blk, device=dev)).view(b, n * blk)
        k_pos = torch.cat([torch.arange(length, device=dev).expand(b, length), q_pos], 1)
        which = torch.arange(n, device=dev).repeat_interleave(blk)
        sees_ctx = (
            torch.arange(length, device=dev)[None, None, :] < anchors.repeat_interleave(blk, 1)[:, :, None]
        )
        sees_block = (which[:, None] == which[None, :]).expand(b, -1, -1)
        mask = torch.cat([sees_ctx, sees_block], -1)[:, None]  # [B, 1, Q, L + Q]
        groups = self.heads // self.kv_heads
        for layer in self.layers:
            h = self._norm(x, layer.input_layernorm)
            q = self._norm(layer.q_proj(h).view(b, n * blk, self.heads, self.head_dim), layer.q_norm)
            kin = torch.cat([ctx, h], 1)
            k = self._norm(layer.k_proj(kin).view(b, -1, self.kv_heads, self.head_dim), layer.k_norm)
            v = layer.v_proj(kin).view(b, -1, self.kv_heads, self.head_dim)
            q, k = self._rope(q, q_pos), self._rope(k, k_pos)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.repeat_interleave(groups, 2).transpose(1, 2),
                v.repeat_interleave(groups, 2).transpose(1, 2),
                attn_mask=mask,
            )
            x = x + layer.o_proj(out.transpose(1, 2).reshape(b, n * blk, -1))
            m = self._norm(x, layer.post_attention_layernorm)
            x = x + layer.down_proj(F.silu(layer.gate_proj(m)) * layer.up_proj(m))
        out = self._norm(x, self.norm).view(b, n, blk, -1)[:, :, 1:]
        return out.float() @ self.lm_head.T


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


def save_dflash(tensors: dict[str, torch.Tensor], raw: dict, dest: Path) -> Path:
    """Write a DFLASH draft directory, checked against the runtime's reading of ``raw``."""
    from ...dev.dflash_builder import write_dflash_draft
    from ...speculative.dflash.format import dflash_config_from_dict

    config = dflash_config_from_dict(raw, target_num_layers=int(raw["num_target_layers"]))
    shapes = config.tensor_shapes()
    wrong = {n: tuple(t.shape) for n, t in tensors.items() if shapes.get(n) != tuple(t.shape)}
    if wrong or set(shapes) != set(tensors):
        raise ValueError(
            f"DFLASH draft tensors do not fit their config: {wrong or sorted(set(shapes) ^ set(tensors))}"
        )
    return write_dflash_draft(dest, raw, {n: t.float() for n, t in tensors.items()})
