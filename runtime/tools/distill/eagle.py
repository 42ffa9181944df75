"""An EAGLE / EAGLE3 head as the student of a distillation.

The head is the runtime's own (:class:`~...speculative.eagle.model.EagleDraftModel`, loaded
by the runtime's loader), its base frozen; a LoRA hooks into its linears exactly where the
serving pool's does (:mod:`...speculative.eagle.lora`): the decoder layer's projections
and the fc that fuses the target's features. Training runs the head over whole sequences
(causal attention, positions from 0) instead of through its paged KV cache.

The head reads the ADAPTED target's features, which is what it sees serving an adapted
request (the target verifies with the request's adapter): the teacher runs once per batch
with its hidden states recorded (EAGLE: the final normed stream; EAGLE3: the streams
entering the aux layers), and the student reads them for the same ids. Position ``t`` of
the student is the head on the pair (feature of ``t``, token ``t + 1``), predicting token
``t + 2``: the teacher's logits at ``t + 1``. So both sides give ``seq - 1`` positions,
scored over the head's vocabulary (all of the target's, or the rows of its own LM head).

Serving chains the head: from its second draft step on, it reads its OWN previous output
(the layer's output, before EAGLE3's final norm; EAGLE3 then skips the fc that fuses the
target's features) instead of the target's feature. With ``unroll`` N > 1 the student runs
N such steps over whole sequences (:func:`head_chain`): step ``s`` at position ``t`` reads
step ``s - 1``'s output at ``t - 1`` with token ``t + 1``, attends as the serving chain's
``s``-th step does, and predicts the same token ``t + 2``; its first ``s - 1`` positions,
which have no chain behind them, are dropped. Each step is scored against the teacher's
logits, and the loss is the mean over steps.

The written adapter is in peft's layout with the head's checkpoint names
(``base_model.model.layers.0.self_attn.q_proj.lora_A.weight``, ``base_model.model.fc...``)
and is read back through the serving pool's loader before the command reports success.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ...model.arch import load_arch_config
from ...speculative.eagle.format import EAGLE_ARCHITECTURES
from ...speculative.eagle.lora import HEAD_LORA_MODULES, LAYER_MODULES
from .models import DistillError, LoraSettings
from .train import check_unroll

HEAD_MODULES = HEAD_LORA_MODULES
"""What a head's draft LoRA may adapt (``fc`` and the layer's projections)."""


def is_eagle_head(draft_dir: Path) -> bool:
    """Whether ``draft_dir`` holds an EAGLE / EAGLE3 head (by its config.json architecture)."""
    try:
        raw = json.loads((Path(draft_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return any(a in EAGLE_ARCHITECTURES for a in raw.get("architectures") or [])


def check_head_settings(lora: LoraSettings) -> None:
    """A head LoRA adapts the head's modules only (never the embed_tokens / lm_head it shares)."""
    if lora.rank < 1:
        raise DistillError(f"--rank must be a positive integer, got {lora.rank}")
    if not lora.target_modules:
        raise DistillError("--target-modules is empty: name at least one of " + ",".join(HEAD_MODULES))
    unknown = sorted(set(lora.target_modules) - set(HEAD_MODULES))
    if unknown:
        raise DistillError(
            f"--target-modules has {unknown}: an EAGLE head's draft adapter adapts {','.join(HEAD_MODULES)} "
            "(the head shares the target's embed_tokens and lm_head, which stay unadapted)"
        )


class HeadTeacher:
    """The adapted target, returning logits from position 1 on and recording its features.

    ``__call__`` matches a causal LM's (``teacher(input_ids=...).logits``), so the shared
    training loop and scores drive it unchanged.
    """

    def __init__(self, model, version: int, aux_layer_ids: Sequence[int], vocab_ids: torch.Tensor | None):
        self.model = model
        self.version = version
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.vocab_ids = vocab_ids  # the head's vocabulary rows as target ids (None: all of them)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, features) of the last call
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._decoder = base.model
        self.training = False

    def eval(self) -> HeadTeacher:
        return self

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The adapted target's features at every position, ``[B, T, F]`` (cached for the last ids)."""
        if self._last is not None and self._last[0] is input_ids:
            return self._last[1]
        self(input_ids=input_ids)
        assert self._last is not None
        return self._last[1]

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, use_cache: bool = False) -> SimpleNamespace:
        streams: dict[int, torch.Tensor] = {}
        handles = self._record(streams)
        try:
            logits = self.model(input_ids=input_ids, use_cache=False).logits
        finally:
            for handle in handles:
                handle.remove()
        if self.version == 3:
            feats = torch.cat([streams[i] for i in self.aux_layer_ids], dim=-1)
        else:
            feats = streams[-1]
        self._last = (input_ids, feats)
        logits = logits[:, 1:]
        return SimpleNamespace(
            logits=logits if self.vocab_ids is None else logits.index_select(-1, self.vocab_ids)
        )

    def _record(self, streams: dict[int, torch.Tensor]) -> list:
        """Hooks storing the residual stream entering each aux layer (the final stream, un-normed,
        for ``num_layers``) and the final normed stream (key -1)."""
        layers, norm = self._decoder.layers, self._decoder.norm
        handles = []

        def entering(i: int) -> Callable:
            def hook(_module, args, kwargs):
                streams[i] = args[0] if args else kwargs["hidden_states"]

            return hook

        for i in self.aux_layer_ids:
            if i < len(layers):
                handles.append(layers[i].register_forward_pre_hook(entering(i), with_kwargs=True))

        def final(_module, args, output):
            streams[len(layers)] = args[0]
            streams[-1] = output

        handles.append(norm.register_forward_hook(final))
        return handles


class _TrainableLoRA:
    """A LoRA delta on one (possibly fused) runtime linear: ``base() + s · B A x`` per part.

    Holds references to the student's parameters; the runtime's layer calls :meth:`linear`
    (its LoRA hook protocol), so the head computes exactly what the serving pool adds.
    """

    def __init__(
        self, parts: dict[int, tuple[nn.Parameter, nn.Parameter]], out_sizes: Sequence[int], scaling: float
    ):
        self.parts = parts
        self.out_sizes = tuple(out_sizes)
        self.scaling = scaling

    def linear(self, x: torch.Tensor, base: Callable[[], torch.Tensor]) -> torch.Tensor:
        out = base()
        xf = x.float()
        deltas = []
        for i, size in enumerate(self.out_sizes):
            pair = self.parts.get(i)
            if pair is None:
                deltas.append(xf.new_zeros(*xf.shape[:-1], size))
            else:
                a, b = pair
                deltas.append(F.linear(F.linear(xf, a), b) * self.scaling)
        return out + torch.cat(deltas, dim=-1).to(out.dtype)

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> None:  # the hook protocol's in-place form
        out.add_(self.linear(x, lambda: torch.zeros_like(out)))


_PART = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}  # fmt: skip


def _peft_name(module: str) -> str:
    if module == "fc":
        return "fc"
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"layers.0.{block}.{module}"


class HeadStudent(nn.Module):
    """The head with a fresh LoRA on ``lora.target_modules``; only the LoRA trains.

    ``lora_B`` starts at zero (as peft's), so before training it is the shared, unadapted head.
    ``unroll``: the chained draft steps it trains (:meth:`chain_logits`; 1: the first only).
    """

    def __init__(self, runner, teacher: HeadTeacher, lora: LoraSettings, *, seed: int, unroll: int = 1):
        super().__init__()
        check_unroll(unroll)
        self.unroll = unroll
        self.head = runner.model  # the runtime's head, weights loaded by the runtime's loader
        self.head.requires_grad_(False)
        self.teacher = teacher
        self.lora_settings = lora
        self.scaling = lora.alpha / lora.rank
        generator = torch.Generator().manual_seed(seed)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        device = self.head.fc.weight.device
        hooked: dict[int, tuple[object, dict[int, tuple[nn.Parameter, nn.Parameter]]]] = {}
        for module in lora.target_modules:
            linear, part = self._linear(module)
            in_dim, out_dim = linear.in_features, linear.out_sizes[part]
            a = torch.empty(lora.rank, in_dim)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # peft's lora_A init
            key = module
            self.lora_A[key] = nn.Parameter(a.to(device))
            self.lora_B[key] = nn.Parameter(torch.zeros(out_dim, lora.rank, device=device))
            hooked.setdefault(id(linear), (linear, {}))[1][part] = (self.lora_A[key], self.lora_B[key])
        for linear, parts in hooked.values():
            linear.lora = _TrainableLoRA(parts, linear.out_sizes, self.scaling)  # type: ignore[attr-defined]

    def _linear(self, module: str):
        if module == "fc":
            return self.head.fc, 0
        group, part = _PART[module]
        layer = self.head.layers[0]
        owner = layer.self_attn if group in ("qkv_proj", "o_proj") else layer.mlp
        return getattr(owner, group), part

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> SimpleNamespace:
        """Logits ``[B, T - 1, V]``: position ``t`` from the pair (feature ``t``, token ``t + 1``)."""
        feats = self.teacher.features(input_ids)
        hidden = head_sequence(self.head, input_ids[:, 1:], feats[:, :-1])
        vocab = self.head.vocab
        return SimpleNamespace(logits=vocab.logits(self.head._final(hidden)))

    def chain_logits(self, input_ids: torch.Tensor, steps: int | None = None) -> list[torch.Tensor]:
        """Logits of each of ``steps`` (default ``unroll``) chained draft steps; step ``s``
        (1-based) gives ``[B, T - s, V]``, aligned with the teacher's logits from ``s - 1`` on.

        One step is exactly :meth:`forward` (the same operations, so the same bits)."""
        steps = self.unroll if steps is None else steps
        if steps == 1:
            return [self(input_ids).logits]
        feats = self.teacher.features(input_ids)
        hiddens = head_chain(self.head, input_ids[:, 1:], feats[:, :-1], steps)
        vocab = self.head.vocab
        return [vocab.logits(self.head._final(h[:, s:])) for s, h in enumerate(hiddens)]

    def save(self, out_dir: Path) -> list[str]:
        """Write the LoRA in peft's layout, with the head's checkpoint names; returns the files."""
        from safetensors.torch import save_file

        tensors = {}
        for module in self.lora_settings.target_modules:
            prefix = f"base_model.model.{_peft_name(module)}"
            tensors[f"{prefix}.lora_A.weight"] = self.lora_A[module].detach().float().cpu().contiguous()
            tensors[f"{prefix}.lora_B.weight"] = self.lora_B[module].detach().float().cpu().contiguous()
        out_dir.mkdir(parents=True, exist_ok=True)
        config = {
            "peft_type": "LORA",
            "r": self.lora_settings.rank,
            "lora_alpha": self.lora_settings.alpha,
            "target_modules": list(self.lora_settings.target_modules),
            "lora_dropout": 0.0,
            "bias": "none",
            "use_rslora": False,
        }
        (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
        return sorted(p.name for p in out_dir.iterdir() if p.is_file())


def head_sequence(head, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The head over whole sequences ``[B, S]``: the equations of its serving forward
    (:meth:`EagleDraftModel.forward`), with causal attention at positions ``0..S-1``."""
    residual, x = _layer_inputs(head, input_ids, features, from_target=True)
    layer = head.layers[0]
    return layer.mlp_block(residual + _causal_attention(layer.self_attn, x))


def head_chain(head, input_ids: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The output features ``[B, S, H]`` of ``steps`` chained draft steps over whole sequences.

    Step 1 is :func:`head_sequence`. Step ``s`` at position ``t`` is the serving chain's
    ``s``-th step from the target's pair at ``t - s + 1``: the pair (step ``s - 1``'s output
    at ``t - 1``, token ``input_ids[t]``), read as the runtime reads the head's own output
    (``from_target=False``), attending to the target-fed entries ``0..t - s + 1``, to the
    step-``r`` entry at ``t - s + r`` for ``1 < r < s``, and to itself. Rows ``t < s - 1``
    have no such chain: their values are computed but mean nothing.
    """
    layer = head.layers[0]
    attn = layer.self_attn
    residual, x = _layer_inputs(head, input_ids, features, from_target=True)
    q, k, v = _rotated_qkv(attn, x)
    outs = [layer.mlp_block(residual + _attention_out(attn, _sdpa(attn, q, k, v)))]
    keys, values = [k], [v]
    for _ in range(2, steps + 1):
        own = _shift_right(outs[-1], 1)  # step s at t reads step s - 1's output at t - 1
        residual, x = _layer_inputs(head, input_ids, own, from_target=False)
        q, k, v = _rotated_qkv(attn, x)
        keys.append(k)
        values.append(v)
        out = _chain_attention(attn, q, keys, values)
        outs.append(layer.mlp_block(residual + _attention_out(attn, out)))
    return outs


def _layer_inputs(
    head, input_ids: torch.Tensor, features: torch.Tensor, *, from_target: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's residual and attention input for pairs ``(input_ids, features)``, as
    :meth:`EagleDraftModel.forward` builds them (EAGLE3 skips its fc on the head's own output)."""
    emb = head.embed(input_ids)
    layer = head.layers[0]
    if head.version == 3:
        feature = head.fc(features.to(emb.dtype)) if from_target else features.to(emb.dtype)
        return layer.eagle3_inputs(emb, feature)
    residual = head.fc(torch.cat([emb, features.to(emb.dtype)], dim=-1))
    return residual, layer.input_layernorm(residual)


def _shift_right(x: torch.Tensor, shift: int) -> torch.Tensor:
    """``x`` ``[..., S, D]`` moved ``shift`` positions later along ``S`` (the first row repeated
    in front: the rows it fills are ones the caller drops)."""
    return torch.cat([x[..., :1, :].expand(*x.shape[:-2], shift, x.shape[-1]), x[..., :-shift, :]], dim=-2)


def _causal_attention(attn, x: torch.Tensor) -> torch.Tensor:
    """The layer's attention over ``[B, S, in]`` rows, causal, as its paged path computes it."""
    return _attention_out(attn, _sdpa(attn, *_rotated_qkv(attn, x)))


def _rotated_qkv(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``[B, heads, S, D]`` of rows ``[B, S, in]`` at positions ``0..S-1`` (k and v
    repeated to the query heads)."""
    b, s, _ = x.shape
    qkv = attn.qkv_proj(x.reshape(b * s, -1))
    q, k, v = qkv.split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
    positions = torch.arange(s, device=x.device).repeat(b)
    q, k = attn.rotary(
        positions,
        q.reshape(b * s, attn.num_heads, attn.head_dim),
        k.reshape(b * s, attn.num_kv_heads, attn.head_dim),
    )
    groups = attn.num_heads // attn.num_kv_heads
    q = q.view(b, s, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = k.view(b, s, attn.num_kv_heads, attn.head_dim).transpose(1, 2).repeat_interleave(groups, dim=1)
    v = v.reshape(b, s, attn.num_kv_heads, attn.head_dim).transpose(1, 2).repeat_interleave(groups, dim=1)
    return q, k, v


def _sdpa(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.head_dim**-0.5)


def _attention_out(attn, out: torch.Tensor) -> torch.Tensor:
    """o_proj over the heads' outputs ``[B, heads, S, D]``; returns ``[B, S, H]``."""
    b, _, s, _ = out.shape
    return attn.o_proj(out.transpose(1, 2).reshape(b * s, -1)).view(b, s, -1)


def _chain_attention(
    attn, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
) -> torch.Tensor:
    """Attention of chain step ``s = len(keys)`` at every position ``t``: over the target-fed
    (step 1) entries ``0..t - s + 1``, the step-``r`` entry at ``t - s + r`` for ``1 < r < s``
    (the serving chain's earlier steps), and its own entry."""
    step, seq = len(keys), q.shape[-2]
    scale = attn.head_dim**-0.5
    visible = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril(-(step - 1))
    scores = [((q @ keys[0].transpose(-1, -2)) * scale).masked_fill(~visible, float("-inf"))]
    chain_values = []
    for r in range(2, step + 1):  # the chain's own entries: step r's output at t - (step - r)
        k_r, v_r = keys[r - 1], values[r - 1]
        if r < step:
            k_r, v_r = _shift_right(k_r, step - r), _shift_right(v_r, step - r)
        scores.append((q * k_r).sum(-1, keepdim=True) * scale)
        chain_values.append(v_r)
    p = torch.cat(scores, dim=-1).float().softmax(-1).to(q.dtype)
    out = p[..., :seq] @ values[0]
    for i, v_r in enumerate(chain_values):
        out = out + p[..., seq + i : seq + i + 1] * v_r
    return out


def load_head_pair(
    target_dir: Path, draft_dir: Path, teacher_model, lora: LoraSettings, *, seq_len: int, dtype: torch.dtype,
    device: str, seed: int, unroll: int = 1,
) -> tuple[HeadTeacher, HeadStudent, int]:  # fmt: skip
    """The teacher over ``teacher_model`` (the adapted target), the head student (training
    ``unroll`` chained draft steps), and the logit width both give (the head's vocabulary)."""
    from ...model.arch import ModelConfigError
    from ...speculative.draft.settings import DraftSettings, base_weight
    from ...speculative.eagle.runner import EagleDraftRunner

    check_head_settings(lora)
    base = teacher_model.get_base_model() if hasattr(teacher_model, "get_base_model") else teacher_model
    try:
        settings = DraftSettings(
            str(draft_dir),
            target_arch=load_arch_config(target_dir),
            embed_weight=base_weight(base.get_input_embeddings()).detach(),
            lm_head_weight=base_weight(base.get_output_embeddings()).detach(),
            dtype=dtype,
            device=device,
            max_total_tokens=8,
            max_requests=1,
            max_context_len=seq_len,
        )
        runner = EagleDraftRunner(settings)
    except ModelConfigError as exc:
        raise DistillError(f"--draft {str(draft_dir)!r} is not an EAGLE head of this target: {exc}") from exc
    vocab = runner.model.vocab
    ids = None if vocab.to_target is None else vocab.to_target.to(device)
    teacher = HeadTeacher(teacher_model, runner.version, runner.aux_layer_ids, ids)
    student = HeadStudent(runner, teacher, lora, seed=seed, unroll=unroll)
    return teacher, student, vocab.size


def check_written_head_adapter(out_dir: Path, draft_dir: Path, lora: LoraSettings) -> None:
    """Read the written adapter back through the serving pool's own loader, against the head."""
    from ...lora.errors import AdapterError
    from ...speculative.eagle.format import load_eagle_config
    from ...speculative.eagle.lora import load_head_adapter

    try:
        load_head_adapter(out_dir, load_eagle_config(draft_dir), max_rank=lora.rank, dtype=torch.float32)
    except AdapterError as exc:  # a bug here, not the user's: say so plainly
        raise DistillError(
            f"the written adapter at {out_dir} is refused by the runtime's loader: {exc}"
        ) from exc


__all__ = [
    "HEAD_MODULES",
    "LAYER_MODULES",
    "HeadStudent",
    "HeadTeacher",
    "check_head_settings",
    "check_written_head_adapter",
    "head_chain",
    "head_sequence",
    "is_eagle_head",
    "load_head_pair",
]
