"""Training of the DFLASH draft over the frozen small target: masked block prediction.

Each training window (the target's own greedy continuations and corpus windows, as the
other drafts train on) gets ``blocks`` random anchors; the draft predicts every masked
position of each anchor's block from the target's layer outputs before the anchor, and
learns the target's next-token distribution there (KL), earlier block positions weighted
more (a block is accepted from its start: the DFlash paper's position decay).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .dflash_draft import DFlashDraft
from .training import lr_scale, progress


@dataclass
class DFlashTraining:
    """How the DFLASH draft trains."""

    seconds: float
    seq: int
    batch: int
    lr: float
    block: int
    layer_ids: list[int]
    num_layers: int = 1
    mask_id: int = 0  # the local tokenizer's <pad>: a token no text contains
    blocks: int = 8  # anchors per window
    teacher_fraction: float = 0.5
    decay: float = 4.0  # weight of block position j: exp(-(j - 1) / decay)
    seed: int = 5
    max_steps: int | None = None


def target_outputs(target, window: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's outputs of ``layer_ids`` concatenated ``[B, L, K * H]`` (Hugging Face's
    ``hidden_states[i + 1]``: what the runtime captures) and its logits ``[B, L, V]``."""
    autocast = window.device.type == "cuda"
    with (
        torch.no_grad(),
        torch.autocast(device_type=window.device.type, dtype=torch.bfloat16, enabled=autocast),
    ):
        out = target.model(input_ids=window, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1).float()
        return feats, target.lm_head(out.last_hidden_state).float()


def dflash_loss(draft: DFlashDraft, target, window: torch.Tensor, opts: DFlashTraining, gen: torch.Generator):
    """Position-weighted KL from the target's next-token distribution at every masked block
    position; returns (loss, per-position top-1 agreement with the target's greedy token)."""
    b, length = window.shape
    blk = opts.block
    feats, logits = target_outputs(target, window, opts.layer_ids)
    # anchor a: context 0..a-1, block a..a+blk-1, labels from the target's logits at a..a+blk-2
    anchors = torch.randint(1, length - blk + 2, (b, opts.blocks), generator=gen).to(window.device)
    autocast = window.device.type == "cuda"
    with torch.autocast(device_type=window.device.type, dtype=torch.bfloat16, enabled=autocast):
        draft_logits = draft.block_logits(window, feats, anchors)
    rows = (anchors[:, :, None] + torch.arange(blk - 1, device=window.device)).view(b, -1)
    vocab = logits.shape[-1]
    teacher = torch.log_softmax(logits.gather(1, rows[..., None].expand(-1, -1, vocab)), -1)
    teacher = teacher.view(b, opts.blocks, blk - 1, vocab)
    logp = torch.log_softmax(draft_logits, -1)
    kl = (teacher.exp() * (teacher - logp)).sum(-1)  # [B, n, blk - 1]
    weight = torch.exp(-torch.arange(blk - 1, device=window.device) / opts.decay)
    loss = (kl * weight).sum(-1).mean() / weight.sum()
    top1 = (logp.argmax(-1) == teacher.argmax(-1)).float().mean((0, 1))
    return loss, [round(float(a), 3) for a in top1]


def _batch(data, teacher_data, gen: torch.Generator, opts: DFlashTraining) -> torch.Tensor:
    """``opts.batch`` windows of ``opts.seq + 1`` tokens, ``teacher_fraction`` of them the
    target's own continuations."""
    n_teacher = 0 if teacher_data is None else max(1, round(opts.batch * opts.teacher_fraction))
    starts = torch.randint(0, data.numel() - opts.seq - 1, (opts.batch - n_teacher,), generator=gen)
    window = data[(starts[:, None] + torch.arange(opts.seq + 1)[None, :]).to(data.device)]
    if n_teacher:
        rows = torch.randint(0, teacher_data.shape[0], (n_teacher,), generator=gen)
        window = torch.cat(
            [window, teacher_data[rows.to(teacher_data.device)][:, : opts.seq + 1].to(data.device)]
        )
    return window


def train_dflash(
    target, shape: str, data: torch.Tensor, teacher_data: torch.Tensor | None, device: torch.device,
    opts: DFlashTraining,
) -> tuple[DFlashDraft, dict]:  # fmt: skip
    """Train a DFLASH draft over the frozen ``target`` for ``opts.seconds``."""
    cfg = target.config
    draft = DFlashDraft(
        shape, target.model.embed_tokens.weight, target.lm_head.weight, layer_ids=opts.layer_ids,
        num_layers=opts.num_layers, block=opts.block, mask_id=opts.mask_id, eps=cfg.rms_norm_eps,
        theta=float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]),
    ).to(device)  # fmt: skip
    torch.manual_seed(opts.seed)
    for p in draft.parameters():  # norms start at 1; the rest as a Llama initialises
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    params = list(draft.parameters())
    optim = torch.optim.AdamW(
        params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=device.type == "cuda"
    )
    gen = torch.Generator().manual_seed(opts.seed)
    data = data.to(device)
    start, step, loss, top1 = time.monotonic(), 0, torch.zeros(()), [0.0]
    while (frac := progress(time.monotonic() - start, opts.seconds, step, opts.max_steps)) < 1.0:
        for group in optim.param_groups:
            group["lr"] = opts.lr * lr_scale(step, frac)
        loss, top1 = dflash_loss(draft, target, _batch(data, teacher_data, gen, opts), opts, gen)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        step += 1
    draft.eval()
    return draft, {
        "steps": step,
        "windows": step * opts.batch,
        "final_loss": round(loss.item(), 3),
        "train_top1": top1,
        "params": sum(p.numel() for p in params),
        "block": opts.block,
        "layers": opts.num_layers,
        "target_layer_ids": opts.layer_ids,
        "blocks_per_window": opts.blocks,
        "decay": opts.decay,
        "teacher_fraction": opts.teacher_fraction if teacher_data is not None else 0.0,
        "seq": opts.seq,
    }


@torch.no_grad()
def dflash_heldout(
    draft: DFlashDraft, target, held_ids: torch.Tensor, device: torch.device, *, seq: int
) -> dict:
    """On held-out windows: per-position top-1 agreement with the target's greedy token, and
    the mean number of leading block positions that agree (an offline proxy of accepted
    drafts per step)."""
    n = min(16, (held_ids.numel() - 1) // (seq + 1))
    window = held_ids[: n * (seq + 1)].view(n, seq + 1).to(device)
    opts = DFlashTraining(
        seconds=0, seq=seq, batch=n, lr=0, block=draft.block, layer_ids=draft.layer_ids, blocks=8,
        mask_id=draft.mask_id,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    feats, logits = target_outputs(target, window, draft.layer_ids)
    blk = draft.block
    anchors = torch.randint(1, window.shape[1] - blk + 2, (n, opts.blocks), generator=gen).to(device)
    got = draft.block_logits(window, feats, anchors).argmax(-1)
    rows = (anchors[:, :, None] + torch.arange(blk - 1, device=device)).view(n, -1)
    want = logits.argmax(-1).gather(1, rows).view(n, opts.blocks, blk - 1)
    match = (got == want).float()
    return {
        "heldout_top1": [round(float(a), 3) for a in match.mean((0, 1))],
        "heldout_leading": round(float(match.cumprod(-1).sum(-1).mean()), 3),
        "max_leading": blk - 1,
    }
