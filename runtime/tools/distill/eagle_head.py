"""The EAGLE draft head as a trainable module, with the runtime's checkpoint names, and
its directory written as the runtime reads one (``config.json`` + ``model.safetensors``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from loraserve.kernels.model_ops import reference as model_ops_reference


@dataclass(frozen=True)
class LayerDims:
    """The dimensions of one of the target's decoder layers: a draft layer has the same."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @classmethod
    def of(cls, config) -> LayerDims:
        """The layer dimensions of a Hugging Face Llama-style ``config``."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
            config.intermediate_size,
        )  # fmt: skip


@dataclass(frozen=True)
class RopeFrequencies:
    """The rotation a draft's layer applies, as the runtime serves it: ``inv_freq``
    ``[rotary_dim / 2]`` (narrower than the head under a partial rotary factor: the leading
    ``rotary_dim`` dims rotate, half-split, the rest pass through) and cos/sin ``scaling``."""

    inv_freq: torch.Tensor
    scaling: float = 1.0

    @classmethod
    def of(cls, config, context_length: int | None = None) -> RopeFrequencies:
        """The rotation of the target whose Hugging Face ``config`` is given (its rope type and
        scaling, partial rotary factor), from the runtime's own rope code, so a draft trains
        with the rotation its served copy applies. ``context_length``: the context it will be
        served at (default: the model's ``max_position_embeddings``, the runtime's default),
        which picks LongRoPE's factor set as serving picks it."""
        from ...model.arch import arch_from_dict
        from ...model.layers.rotary import inverse_frequencies

        arch = arch_from_dict(config.to_dict())
        served = context_length or arch.max_position_embeddings
        inv_freq, scaling = inverse_frequencies(
            arch.rope, arch.head_dim, arch.max_position_embeddings, max_positions=served
        )
        return cls(inv_freq, scaling)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., d]`` rotated to ``positions`` (broadcast against ``x[..., 0]``)."""
        ang = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat([ang, ang], -1)
        return model_ops_reference.rotate(
            x, (emb.cos() * self.scaling).to(x.dtype), (emb.sin() * self.scaling).to(x.dtype)
        )


# Checkpoint names (``loraserve.runtime.speculative.eagle.format``) of the head's parameters.
EAGLE_NAMES = {
    "fc": "fc.weight",
    "q_proj": "layers.0.self_attn.q_proj.weight",
    "k_proj": "layers.0.self_attn.k_proj.weight",
    "v_proj": "layers.0.self_attn.v_proj.weight",
    "o_proj": "layers.0.self_attn.o_proj.weight",
    "gate_proj": "layers.0.mlp.gate_proj.weight",
    "up_proj": "layers.0.mlp.up_proj.weight",
    "down_proj": "layers.0.mlp.down_proj.weight",
    "input_norm": "layers.0.input_layernorm.weight",
    "post_norm": "layers.0.post_attention_layernorm.weight",
}


class EagleHead(torch.nn.Module):
    """The runtime's EAGLE draft layer (version 1, with input norm) as a trainable module.

    The equations of ``speculative.eagle.format`` / ``EagleDraftModel``: the input at position ``i`` is
    ``fc([embed(x[i+1]), feature[i]])`` (feature = the target's final normed hidden state),
    then one Llama decoder layer with causal attention at positions ``0..T-1``; the output
    is the predicted ``feature[i+1]`` and ``lm_head(output)`` (no norm) the distribution of
    ``x[i+2]``. The target's embeddings and LM head are frozen buffers, never trained.
    """

    def __init__(
        self, dims: LayerDims, embed: torch.Tensor, lm_head: torch.Tensor, *, eps: float, rope: RopeFrequencies
    ):
        super().__init__()
        hidden, heads, kv, head_dim, inter = (
            dims.hidden,
            dims.heads,
            dims.kv_heads,
            dims.head_dim,
            dims.intermediate,
        )
        self.dims, self.eps = dims, eps
        self.heads, self.kv_heads, self.head_dim = heads, kv, head_dim

        def lin(fan_in: int, fan_out: int) -> torch.nn.Linear:
            return torch.nn.Linear(fan_in, fan_out, bias=False)

        self.fc = lin(2 * hidden, hidden)
        self.q_proj, self.k_proj = lin(hidden, heads * head_dim), lin(hidden, kv * head_dim)
        self.v_proj, self.o_proj = lin(hidden, kv * head_dim), lin(heads * head_dim, hidden)
        self.gate_proj, self.up_proj, self.down_proj = (
            lin(hidden, inter),
            lin(hidden, inter),
            lin(inter, hidden),
        )
        self.input_norm = torch.nn.Parameter(torch.ones(hidden))
        self.post_norm = torch.nn.Parameter(torch.ones(hidden))
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().float().clone(), persistent=False)
        self.rope = rope

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The head's weights under their ``speculative.eagle.format`` names (float32, CPU)."""
        out = {}
        for attr, name in EAGLE_NAMES.items():
            p = getattr(self, attr)
            weight = p if isinstance(p, torch.nn.Parameter) else p.weight
            out[name] = weight.detach().float().cpu().contiguous()
        return out

    @torch.no_grad()
    def round_to_bf16(self) -> None:
        """Round the weights and the shared embeddings / LM head to bfloat16 values: what is
        saved and served (``save_hf`` stores the target in bfloat16 too)."""
        for t in [*self.parameters(), self.embed, self.lm_head]:
            t.copy_(t.to(torch.bfloat16).float())

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The LM head over output features (float32)."""
        return out.float() @ self.lm_head.T

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm in float32 (as Llama and the runtime do), back in ``x``'s dtype under autocast."""
        xf = x.float()
        return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, heads, T, d]`` rotated to ``positions`` ``[T]``."""
        return self.rope.rotate(x, positions)

    def _qkv(self, ids: torch.Tensor, feats: torch.Tensor):
        """Residual, rotated q / k and v of input pairs ``(ids, feats)`` ``[B, T]`` at positions 0..T-1."""
        b, t = ids.shape
        residual = self.fc(torch.cat([torch.nn.functional.embedding(ids, self.embed), feats.float()], -1))
        x = self._norm(residual, self.input_norm)
        pos = torch.arange(t, device=ids.device)

        def split(y: torch.Tensor, n: int) -> torch.Tensor:
            return y.view(b, t, n, self.head_dim).transpose(1, 2)

        q = self._rope(split(self.q_proj(x), self.heads), pos)
        k = self._rope(split(self.k_proj(x), self.kv_heads), pos)
        groups = self.heads // self.kv_heads
        v = split(self.v_proj(x), self.kv_heads).repeat_interleave(groups, 1)
        return residual, q, k.repeat_interleave(groups, 1), v

    def _finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        h = residual + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        m = self._norm(h, self.post_norm)
        return h + self.down_proj(torch.nn.functional.silu(self.gate_proj(m)) * self.up_proj(m))

    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """Output features ``[B, T, H]`` of the input pairs ``(ids[:, i], feats[:, i])``."""
        residual, q, k, v = self._qkv(ids, feats)
        return self._finish(
            residual, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        )

    def unrolled(self, ids: torch.Tensor, feats: torch.Tensor, steps: int = 2) -> list[torch.Tensor]:
        """``steps`` draft steps at once (EAGLE-3's training-time test), one output per step.

        Step 1 is :meth:`forward`. Step ``s`` at position ``j`` takes the head's own step
        ``s - 1`` output of ``j - 1`` as its feature and attends as serving's ``s``-th chain
        step does: to the step-1 (target-feature) entries up to ``j - s + 1``, to the step
        ``r`` entry at ``j - s + r`` for ``1 < r < s``, and to itself. Rows ``j < s - 1`` have
        too few predecessors; their values are computed but mean nothing (the loss skips them).
        """
        residual, q, k, v = self._qkv(ids, feats)
        outs = [
            self._finish(residual, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        ]
        t = ids.shape[1]
        scale = self.head_dim**-0.5
        keys, values = [k], [v]  # per step: K / V of its entry at every position
        for step in range(2, steps + 1):
            prev = outs[-1]
            own = torch.cat([feats[:, :1].to(prev.dtype), prev[:, :-1]], 1)
            residual_s, q_s, k_s, v_s = self._qkv(ids, own)
            # target-feature entries i <= j - step + 1
            past = (q_s @ k.transpose(-1, -2)) * scale
            allowed = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril(-(step - 1))
            scores = [past.masked_fill(~allowed, float("-inf"))]
            shifted_v = []
            for r in range(2, step):  # the step-r chain entry at j - step + r
                shift = step - r
                k_r = torch.cat(
                    [keys[r - 1][:, :, :1].expand(-1, -1, shift, -1), keys[r - 1][:, :, :-shift]], 2
                )
                v_r = torch.cat(
                    [values[r - 1][:, :, :1].expand(-1, -1, shift, -1), values[r - 1][:, :, :-shift]], 2
                )
                scores.append((q_s * k_r).sum(-1, keepdim=True) * scale)
                shifted_v.append(v_r)
            scores.append((q_s * k_s).sum(-1, keepdim=True) * scale)
            p = torch.cat(scores, -1).float().softmax(-1).to(v.dtype)
            attn = p[..., :t] @ v
            for i, v_r in enumerate([*shifted_v, v_s]):
                attn = attn + p[..., t + i : t + i + 1] * v_r
            outs.append(self._finish(residual_s, attn))
            keys.append(k_s)
            values.append(v_s)
        return outs

    @torch.no_grad()
    def propose(
        self, ids: list[int], feats: torch.Tensor, first: int, steps: int
    ) -> tuple[list[int], torch.Tensor]:
        """Greedy proposals after a prompt ``ids`` with target features ``feats`` ``[P, H]``
        and the target's next token ``first``, recomputing the whole sequence each step;
        returns the tokens and the head's output feature of each step ``[steps, H]``.

        One layer: an entry's K/V depend only on its own input pair, so recomputing the
        pairs (target features, then the head's own outputs) equals serving's cached run.
        """
        pair_ids = [*ids[1:], first]
        pair_feats = feats.float()
        tokens: list[int] = []
        outs = []
        for _ in range(steps):
            o = self(torch.tensor([pair_ids], device=feats.device), pair_feats[None])[0, -1]
            tokens.append(int(self.logits(o).argmax()))
            outs.append(o)
            pair_ids.append(tokens[-1])
            pair_feats = torch.cat([pair_feats, o[None]])
        return tokens, torch.stack(outs)


# Keys an EAGLE config.json takes over from its target's (eagle_builder does the same).
EAGLE_COPIED_KEYS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "rope_theta", "rope_parameters", "rope_scaling", "hidden_act", "bos_token_id",
    "eos_token_id", "pad_token_id",
)  # fmt: skip


def eagle_config(target_raw: dict, intermediate: int) -> dict:
    """config.json of an EAGLE head for the target whose config.json is ``target_raw``."""
    raw = {key: target_raw[key] for key in EAGLE_COPIED_KEYS if key in target_raw}
    raw.update(
        architectures=["LlamaForCausalLMEagle"],
        model_type="llama",
        num_hidden_layers=1,
        intermediate_size=intermediate,
        target_hidden_size=target_raw["hidden_size"],
        bias=False,
        tie_word_embeddings=False,
        # float32 on disk: the expansion's rescaled norm weights are not bfloat16 values;
        # the runtime casts to the serving dtype, as it does for the expanded target
        torch_dtype="float32",
    )
    return raw


def save_eagle_head(tensors: dict[str, torch.Tensor], raw: dict, dest: Path) -> Path:
    """Write an EAGLE draft directory (``speculative.eagle.format``): config.json + model.safetensors (float32)."""
    from safetensors.torch import save_file

    from ...speculative.eagle.format import eagle_config_from_dict

    config = eagle_config_from_dict(raw)
    shapes = config.tensor_shapes()
    wrong = {n: tuple(t.shape) for n, t in tensors.items() if shapes.get(n) != tuple(t.shape)}
    if wrong or set(shapes) != set(tensors):
        raise ValueError(
            f"EAGLE head tensors do not fit their config: {wrong or sorted(set(shapes) ^ set(tensors))}"
        )
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(raw, indent=1))
    save_file({n: t.float().contiguous() for n, t in tensors.items()}, str(dest / "model.safetensors"))
    return dest
