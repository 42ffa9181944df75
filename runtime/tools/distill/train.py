"""The optimisation loop: teacher logits computed on the fly per batch (nothing on disk),
AdamW on the LoRA matrices only, linear warm-up then cosine decay, gradient clipping."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .objective import chain_distillation_loss, draft_step_logits, next_token_logits

WARMUP_FRACTION = 0.05
FINAL_LR_FRACTION = 0.1  # the cosine ends at this share of --lr rather than at zero
CLIP_NORM = 1.0
DEFAULT_HEAD_UNROLL = 2  # serving chains the head; its second step reads its own output


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 500
    batch_size: int = 8
    lr: float = 5e-4
    temperature: float = 1.0
    top_k: int | None = None
    seed: int = 0
    log_every: int = 0  # 0: about ten progress lines per run
    # Chained draft steps an EAGLE head student trains (None: DEFAULT_HEAD_UNROLL for a head;
    # a STANDALONE draft trains its one step).
    unroll: int | None = None


@dataclass(frozen=True)
class TrainStats:
    steps: int
    seconds: float
    tokens: int  # tokens the student trained on (teacher forward passes cover the same)
    first_loss: float
    last_loss: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def lr_factor(step: int, steps: int) -> float:
    """Multiplier of the base learning rate at ``step`` (0-based) of ``steps``."""
    warmup = max(1, round(steps * WARMUP_FRACTION))
    if step < warmup:
        return (step + 1) / warmup
    return cosine_decay((step - warmup) / max(1, steps - warmup))


def cosine_decay(frac: float) -> float:
    """The cosine from 1 to ``FINAL_LR_FRACTION`` over ``frac`` in [0, 1]: every trainer's decay."""
    return FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * frac))


def progress(elapsed: float, seconds: float, step: int, max_steps: int | None) -> float:
    """Share of a time-budgeted run spent: time, or steps when ``max_steps`` caps them."""
    frac = elapsed / seconds if seconds > 0 else 1.0
    return max(frac, step / max_steps) if max_steps else frac


def lr_scale(step: int, frac: float, warmup: int = 50) -> float:
    """A time-budgeted run's multiplier: linear warm-up over ``warmup`` steps, then the same
    cosine as :func:`lr_factor` over the share ``frac`` of the budget spent."""
    return min(1.0, (step + 1) / warmup) * cosine_decay(frac)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every parameter group of ``optimizer`` at learning rate ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def apply_update(optimizer: torch.optim.Optimizer, loss: torch.Tensor, params) -> None:
    """One step on ``loss``: gradients of ``params`` clipped to ``CLIP_NORM`` (every trainer's update)."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)
    optimizer.step()


def log(msg: str) -> None:
    """Print ``msg`` with the time of day, flushed (the trainers' progress lines)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def check_unroll(unroll: int) -> None:
    """``--unroll``: how many chained draft steps a head student trains (1: the first only)."""
    from .models import DistillError

    if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
        raise DistillError(
            f"--unroll must be a positive integer, got {unroll!r}: give 1 to train the head's first "
            "draft step only, or the number of chained draft steps to train (e.g. 2)"
        )


def check_settings(settings: TrainSettings) -> None:
    from .models import DistillError

    if settings.steps < 1 or settings.batch_size < 1:
        raise DistillError(
            f"--steps and --batch-size must be positive, got {settings.steps} and {settings.batch_size}"
        )
    if not settings.lr > 0:
        raise DistillError(f"--lr must be positive, got {settings.lr}")
    if not settings.temperature > 0:
        raise DistillError(f"--temperature must be positive, got {settings.temperature}")
    if settings.unroll is not None:
        check_unroll(settings.unroll)
    if settings.top_k is not None and settings.top_k < 1:
        raise DistillError(
            f"--top-k must be positive (or left out for the full distribution), got {settings.top_k}"
        )


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def train(
    teacher,
    student,
    sequences: torch.Tensor,
    width: int,
    settings: TrainSettings,
    *,
    device: str,
    log: Callable[[str], None] = lambda _line: None,
) -> TrainStats:
    """Train ``student``'s trainable (LoRA) parameters to match ``teacher`` on ``sequences``."""
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, settings.steps))
    # Batches drawn with replacement from a seeded generator: a small corpus is simply
    # revisited, and the same --seed gives the same batches.
    generator = torch.Generator().manual_seed(settings.seed)
    log_every = settings.log_every or max(1, settings.steps // 10)
    student.train()
    first = last = float("nan")
    _sync(device)
    start = time.perf_counter()
    for step in range(settings.steps):
        rows = torch.randint(0, sequences.shape[0], (settings.batch_size,), generator=generator)
        ids = sequences[rows].to(device, non_blocking=True)
        with torch.no_grad():
            teacher_logits = next_token_logits(teacher, ids)
        loss = chain_distillation_loss(
            draft_step_logits(student, ids),
            teacher_logits,
            width,
            temperature=settings.temperature,
            top_k=settings.top_k,
        )
        apply_update(optimizer, loss, params)
        scheduler.step()
        if step == 0 or (step + 1) % log_every == 0 or step + 1 == settings.steps:
            last = float(loss.detach())  # a host sync: only on logged steps
            first = last if step == 0 else first
            log(f"step {step + 1}/{settings.steps}: loss {last:.4f} ({time.perf_counter() - start:.1f} s)")
    _sync(device)
    seconds = time.perf_counter() - start
    tokens = settings.steps * settings.batch_size * sequences.shape[1]
    return TrainStats(settings.steps, seconds, tokens, first, last)
