"""Training of an EAGLE head over the frozen target's features."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .corpus import sample_windows
from .eagle_head import EagleHead, LayerDims, RopeFrequencies
from .objective import distillation_loss
from .train import apply_update, log, lr_scale, progress, set_lr


@dataclass
class EagleTraining:
    """How an EAGLE head trains."""

    seconds: float
    seq: int
    batch: int
    lr: float
    teacher_fraction: float = 0.5
    noise: float = 0.0  # EAGLE's uniform feature noise U(-noise, noise) on the step-1 input
    unroll: int = (
        2  # draft steps trained per position: 1 teacher forcing only; s > 1 also steps 2..s on own features
    )
    feature_weight: float = 0.1  # smooth-L1 on the feature, next to KL to the target on the token
    seed: int = 4
    max_steps: int | None = None  # also ends training (a shared CPU trains as far as an idle one)
    cache_gib: float = (
        0.0  # > 0: the target's features of every training window computed once, up to this size
    )


def target_features(target, window: torch.Tensor) -> torch.Tensor:
    """The target's final normed hidden states ``[B, L, H]``: the feature the runtime feeds."""
    autocast = window.device.type == "cuda"
    with (
        torch.no_grad(),
        torch.autocast(device_type=window.device.type, dtype=torch.bfloat16, enabled=autocast),
    ):
        return target.model(input_ids=window).last_hidden_state.float()


def eagle_loss(
    head: EagleHead, target, window: torch.Tensor, opts: EagleTraining, feats: torch.Tensor | None = None
):
    """EAGLE's loss on token windows ``[B, L]``: per draft step, KL from the target's
    next-token distribution plus ``feature_weight`` x smooth-L1 to the target's feature.
    ``feats``: the target's features of ``window`` when already computed (:class:`FeatureCache`).

    Returns (loss, per-step top-1 agreement with the target's greedy token).
    """
    feats = target_features(target, window) if feats is None else feats.float()
    ids, inputs, want = window[:, 1:], feats[:, :-1], feats[:, 1:]
    if opts.noise:
        inputs = inputs + (2 * torch.rand_like(inputs) - 1) * opts.noise
    with torch.no_grad():
        teacher = head.logits(want)  # the target's own next-token logits: its LM head over its feature
    autocast = window.device.type == "cuda"
    with torch.autocast(device_type=window.device.type, dtype=torch.bfloat16, enabled=autocast):
        outs = head.unrolled(ids, inputs, opts.unroll) if opts.unroll > 1 else [head(ids, inputs)]
    loss, top1 = torch.zeros((), device=window.device), []
    for step, out in enumerate(outs):
        out, t_logits, w = out[:, step:], teacher[:, step:], want[:, step:]  # step s skips rows < s - 1
        logits = head.logits(out)
        kl = distillation_loss(logits, t_logits, logits.shape[-1], temperature=1.0, top_k=None)
        loss = loss + kl + opts.feature_weight * torch.nn.functional.smooth_l1_loss(out.float(), w)
        top1.append(float((logits.argmax(-1) == t_logits.argmax(-1)).float().mean()))
    return loss, top1


@dataclass
class FeatureCache:
    """Training windows with the target's features, computed once (``--eagle-cache-gib``).

    The target is frozen, so its features of a window never change: computing them once
    leaves every training step the head's own work (the target's forward would otherwise
    be a large share of each step). Corpus windows are then fixed, non-overlapping slices
    of the corpus instead of windows at random offsets."""

    windows: torch.Tensor  # int64 [n, seq + 1], on the device
    features: torch.Tensor  # bfloat16 [n, seq + 1, H], on the device

    @classmethod
    def build(cls, target, windows: torch.Tensor, device: torch.device, chunk: int = 256) -> FeatureCache:
        """The cache of ``windows`` (``[n, seq + 1]``), features computed ``chunk`` windows at a time."""
        windows = windows.to(device)
        parts = [target_features(target, part).to(torch.bfloat16) for part in windows.split(chunk)]
        return cls(windows, torch.cat(parts))

    def sample(self, count: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` random cached windows with their features."""
        rows = torch.randint(0, self.windows.shape[0], (count,), generator=gen).to(self.windows.device)
        return self.windows[rows], self.features[rows]


def cache_windows(
    data: torch.Tensor,
    teacher_data: torch.Tensor | None,
    width: int,
    row_bytes: int,
    gib: float,
    build: Callable[[torch.Tensor], FeatureCache],
    label: str,
) -> tuple[FeatureCache, FeatureCache | None, dict] | None:
    """The corpus and teacher caches of ``width``-token windows that ``build`` makes, within
    ``gib`` GiB at ``row_bytes`` a window (the corpus keeps up to half, the teacher rows take
    the rest: a corpus smaller than half leaves them more; corpus windows fixed non-overlapping
    slices), with their sizes and build time (logged under ``label``); None when the corpus,
    or teacher data given, would get no window."""
    t0 = time.monotonic()
    budget = int(gib * 2**30) // row_bytes
    corpus_windows = data.numel() // width
    kept = min(corpus_windows, budget // 2)  # what the corpus keeps whatever the teacher data
    n_teacher = 0 if teacher_data is None else min(teacher_data.shape[0], budget - kept)
    n_corpus = min(corpus_windows, budget - n_teacher)
    if n_corpus < 1 or (teacher_data is not None and n_teacher < 1):
        return None
    corpus = build(data[: n_corpus * width].view(n_corpus, width))
    teacher = build(teacher_data[:n_teacher, :width]) if teacher_data is not None and n_teacher else None
    info = {
        "cached_corpus_windows": n_corpus,
        "cached_teacher_windows": n_teacher,
        "cache_gib": round((n_corpus + n_teacher) * row_bytes / 2**30, 2),
        "cache_seconds": round(time.monotonic() - t0, 1),
    }
    log(f"{label}: {info}")
    return corpus, teacher, info


def sample_cached(
    caches: tuple[FeatureCache, FeatureCache | None, dict], batch: int, n_teacher: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` windows from :func:`cache_windows`' caches, ``n_teacher`` of them the target's
    own continuations (when cached), with their cached rows."""
    corpus, teacher, _ = caches
    window, rows = corpus.sample(batch - n_teacher, gen)
    if teacher is not None and n_teacher:
        t_window, t_rows = teacher.sample(n_teacher, gen)
        window, rows = torch.cat([window, t_window]), torch.cat([rows, t_rows])
    return window, rows


def _feature_caches(
    target, data: torch.Tensor, teacher_data: torch.Tensor | None, device: torch.device, opts: EagleTraining
) -> tuple[FeatureCache, FeatureCache | None, dict] | None:
    """The corpus and teacher caches within ``opts.cache_gib`` (:func:`cache_windows`), or None."""
    if opts.cache_gib <= 0:
        return None
    width = opts.seq + 1
    row_bytes = width * target.config.hidden_size * 2  # bfloat16

    def build(windows: torch.Tensor) -> FeatureCache:
        return FeatureCache.build(target, windows, device)

    return cache_windows(data, teacher_data, width, row_bytes, opts.cache_gib, build, "EAGLE feature cache")


def train_eagle_head(
    target, data: torch.Tensor, teacher_data: torch.Tensor | None, device: torch.device,
    opts: EagleTraining,
) -> tuple[EagleHead, dict]:  # fmt: skip
    """Train an EAGLE head over the frozen ``target`` for ``opts.seconds``.

    Batches mix corpus windows and the target's own greedy continuations (``teacher_data``,
    ``[n, seq + 1]``; the STANDALONE draft's distillation data) in ``teacher_fraction``.
    With ``opts.cache_gib`` the target's features of the windows are computed once, before
    the clock starts (:class:`FeatureCache`); the time it takes is reported.
    """
    head = _new_head(target, device, opts.seed)
    params = list(head.parameters())
    optim = torch.optim.AdamW(
        params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=device.type == "cuda"
    )
    gen = torch.Generator().manual_seed(opts.seed)
    data = data.to(device)
    caches = _feature_caches(target, data, teacher_data, device, opts)
    start, step, loss, top1 = time.monotonic(), 0, torch.zeros(()), [0.0]
    while (frac := progress(time.monotonic() - start, opts.seconds, step, opts.max_steps)) < 1.0:
        set_lr(optim, opts.lr * lr_scale(step, frac))
        n_teacher = 0 if teacher_data is None else max(1, round(opts.batch * opts.teacher_fraction))
        window, feats = _batch(data, teacher_data, caches, gen, opts, n_teacher)
        loss, top1 = eagle_loss(head, target, window, opts, feats)
        apply_update(optim, loss, params)
        step += 1
    head.eval()
    return head, {
        "steps": step,
        "tokens": step * opts.batch * opts.seq,
        "final_loss": round(loss.item(), 3),
        "train_top1": [round(a, 3) for a in top1],
        "params": sum(p.numel() for p in params),
        "noise": opts.noise,
        "unroll": opts.unroll,
        "feature_weight": opts.feature_weight,
        "teacher_fraction": opts.teacher_fraction if teacher_data is not None else 0.0,
        "seq": opts.seq,
        **(caches[2] if caches is not None else {"feature_cache": "off"}),
    }


def _new_head(target, device: torch.device, seed: int) -> EagleHead:
    """A head over ``target``'s embeddings and LM head, initialised as a Llama layer (``seed``)."""
    cfg = target.config
    head = EagleHead(
        LayerDims.of(cfg), target.model.embed_tokens.weight, target.lm_head.weight, eps=cfg.rms_norm_eps,
        rope=RopeFrequencies.of(cfg),
    ).to(device)  # fmt: skip
    torch.manual_seed(seed)
    for p in head.parameters():  # norms start at 1; the rest as a Llama initialises
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    return head


def _batch(data, teacher_data, caches, gen: torch.Generator, opts: EagleTraining, n_teacher: int):
    """A training batch of ``opts.batch`` windows, ``n_teacher`` of them the target's own
    continuations, with their cached features (None without caches: computed by the loss)."""
    if caches is not None:
        return sample_cached(caches, opts.batch, n_teacher, gen)
    return sample_windows(data, teacher_data, gen, count=opts.batch, n_teacher=n_teacher, seq=opts.seq), None


@torch.no_grad()
def eagle_heldout_top1(
    head: EagleHead, target, held_ids: torch.Tensor, device: torch.device, *, seq: int, steps: int = 2
) -> list[float]:
    """Per-step top-1 agreement with the target's greedy token on held-out windows
    (steps 2.. on the head's own previous feature): an offline proxy of multi-step acceptance."""
    n = min(16, (held_ids.numel() - 1) // (seq + 1))
    window = held_ids[: n * (seq + 1)].view(n, seq + 1).to(device)
    opts = EagleTraining(seconds=0, seq=seq, batch=n, lr=0, unroll=steps)
    _, top1 = eagle_loss(head, target, window, opts)
    return [round(a, 3) for a in top1]
