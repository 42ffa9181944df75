"""A plain Llama trained from scratch: a STANDALONE draft distilled from its target (or,
without a teacher, a small language model on a corpus, as the benchmarks' targets are)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .corpus import sample_windows
from .objective import distillation_loss
from .train import apply_update, lr_scale, progress, set_lr


def train_lm(
    config: dict,
    data: torch.Tensor,
    seconds: float,
    device: torch.device,
    *,
    seq: int,
    batch: int,
    lr: float,
    seed: int,
    teacher=None,
    teacher_data: torch.Tensor | None = None,
    teacher_fraction: float = 0.5,
    max_steps: int | None = None,
):
    """Train a Llama of ``config`` (a ``config.json``) for ``seconds`` on random windows of ``data``.

    With a ``teacher``, the loss is the KL divergence from the teacher's next-token
    distribution (distillation), and ``teacher_fraction`` of every batch comes from
    ``teacher_data`` (sequences the teacher generated itself, ``[n, seq + 1]``): the draft
    learns to predict what the target says, which is what speculation accepts.
    ``max_steps`` also ends training (whichever comes first; the schedule follows the
    larger of the time and step fractions).
    """
    model = new_llama(config, seed, device)
    vocab = config["vocab_size"]
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    gen = torch.Generator().manual_seed(seed)
    data = data.to(device)
    start, step, losses = time.monotonic(), 0, []
    loss = torch.zeros(())
    while (frac := progress(time.monotonic() - start, seconds, step, max_steps)) < 1.0:
        set_lr(opt, lr * lr_scale(step, frac))
        n_teacher = 0 if teacher_data is None else max(1, round(batch * teacher_fraction))
        window = sample_windows(data, teacher_data, gen, count=batch, n_teacher=n_teacher, seq=seq)
        loss = _loss(model, teacher, window, vocab)
        apply_update(opt, loss, model.parameters())
        step += 1
        if step % 50 == 0:
            losses.append(loss.item())
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    final = losses[-1] if losses else loss.item()
    return model, {
        "steps": step,
        "tokens": step * batch * seq,
        "final_loss": round(final, 3),
        "params": n_params,
    }


def new_llama(config: dict, seed: int, device: torch.device):
    """A randomly initialised (``seed``) Hugging Face Llama of ``config``, in training mode."""
    import transformers

    cfg = transformers.LlamaConfig(
        **{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    model.train()
    return model


def _loss(model, teacher, window: torch.Tensor, vocab: int) -> torch.Tensor:
    """Next-token cross-entropy on ``window``, or with a ``teacher`` the KL divergence from
    the teacher's next-token distribution (bf16 autocast on CUDA)."""
    device = window.device
    autocast = {"device_type": device.type, "dtype": torch.bfloat16, "enabled": device.type == "cuda"}
    with torch.autocast(**autocast):
        logits = model(input_ids=window[:, :-1]).logits
    if teacher is None:
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), window[:, 1:].reshape(-1))
    with torch.no_grad(), torch.autocast(**autocast):
        teacher_logits = teacher(input_ids=window[:, :-1]).logits
    return distillation_loss(logits, teacher_logits, vocab, temperature=1.0, top_k=None)


def save_hf(model, dest: Path, tokenizer_dir: Path) -> Path:
    """Save ``model`` in bfloat16 (in place) with the tokenizer: a directory the runtime loads."""
    from ...dev.devmodels import copy_tokenizer

    model.to(torch.bfloat16).save_pretrained(str(dest), safe_serialization=True)
    copy_tokenizer(tokenizer_dir, dest)
    return dest
