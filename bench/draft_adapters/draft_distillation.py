"""One draft adapter per task adapter, distilled by the product's own command.

``loraserve-distill-draft``'s :func:`distill` runs as a user would run it: the small target's
folder, the task adapter's PEFT folder, the STANDALONE draft's folder and text files like the
adapter's traffic (a slice of its corpus, and the adapted target's answers: ``answers``). It pulls the draft's next-token distribution (through a fresh LoRA,
the draft frozen) towards the ADAPTED target's, writes a PEFT adapter for the draft, reads
it back through the runtime's loader, and scores the draft against the adapted target on a
held-out slice of the corpus before and after (KL and top-1 agreement).

The served STANDALONE draft is the trained one (``bench/speculative`` serves it at its
trained shape beside the 8B-shaped target), so the draft adapter is served as written: its
expansion to the served draft's shape is the identity.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from loraserve.runtime.tools.distill.models import LoraSettings
from loraserve.runtime.tools.distill.train import TrainSettings
from loraserve.runtime.tools.distill_draft import DistillOptions, distill

from ..speculative.log import log
from .task_adapters import TaskAdapter


@dataclass(frozen=True)
class DraftAdapterTraining:
    """The distillation's settings (the command's ``--rank``, ``--steps``, ...)."""

    rank: int
    steps: int
    batch: int
    seq: int
    lr: float
    eval_sequences: int


def distill_draft_adapter(
    adapter: TaskAdapter, target_dir: Path, draft_dir: Path, dest: Path, device: torch.device,
    opts: DraftAdapterTraining,
) -> tuple[Path, dict]:  # fmt: skip
    """The draft adapter of ``adapter`` written to ``dest``, and the distillation's record."""
    options = DistillOptions(
        target=target_dir, adapter=adapter.small_dir, draft=draft_dir, corpus=adapter.distill_files,
        out=dest, lora=LoraSettings(rank=opts.rank, alpha=2.0 * opts.rank),
        training=TrainSettings(steps=opts.steps, batch_size=opts.batch, lr=opts.lr, seed=0),
        seq_len=opts.seq, eval_sequences=opts.eval_sequences, device=str(device),
    )  # fmt: skip
    report = distill(options, log=lambda line: log(f"distill {adapter.name}: {line}"))
    before, after = report.before, report.after
    info = {
        "rank": opts.rank,
        "steps": report.stats.steps,
        "seconds": round(report.stats.seconds, 1),
        "load_seconds": round(report.load_seconds, 1),
        "tokens": report.stats.tokens,
        "train_sequences": report.train_sequences,
        "held_out_sequences": report.held_out_sequences,
        "seq": report.seq_len,
        "kl_before": round(before.kl, 4),
        "kl_after": round(after.kl, 4),
        "agreement_before": round(before.agreement, 4),
        "agreement_after": round(after.agreement, 4),
        "training": dataclasses.asdict(report.training),
    }
    log(f"draft adapter {adapter.name} distilled: {info}")
    return dest, info
