"""One draft adapter per task adapter, distilled by the product's own command.

``loraserve-distill-draft``'s :func:`distill` runs as a user would run it: the small target's
folder, the task adapter's PEFT folder, the draft's folder and text files like the adapter's
traffic (a slice of its corpus, and the adapted target's answers: ``answers``). It pulls the
draft's next-token distribution (through a fresh LoRA, the draft frozen) towards the ADAPTED
target's, writes a PEFT adapter for the draft, reads it back through the runtime's loader,
and scores the draft against the adapted target on a held-out slice of the corpus before and
after (KL and top-1 agreement).

The STANDALONE draft is served as trained (``bench/speculative`` serves it at its trained
shape beside the 8B-shaped target), so its draft adapter is served as written.

The EAGLE head works on the target's features, so its draft adapter is distilled over the
SMALL trained target (with the task adapter), the head written at the small target's shape
(:func:`small_head_dir`; ``distill`` reads the ADAPTED target's features, as the head sees
them serving an adapted request). The served 8B-shaped target computes the small one's
function, its features being the small target's zero-padded, and the served head is the
small head expanded the same function-preserving way (``bench/speculative``), so the head
adapter is expanded that way too (``lora_expansion.expand_head_lora_tensors``) and the served head
with it computes what the distilled one does (checked: ``head_checks``). Distilling over
the 8B shape directly would need the 8B target in Hugging Face form (16 GB written once, read
per adapter, an 8B forward per step) for the same function.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from loraserve.runtime.tools.distill.eagle import HEAD_MODULES
from loraserve.runtime.tools.distill.eagle_head import EagleHead, eagle_config, save_eagle_head
from loraserve.runtime.tools.distill.models import LoraSettings
from loraserve.runtime.tools.distill.train import TrainSettings
from loraserve.runtime.tools.distill_draft import DistillOptions, distill

from ..harness import log
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


def small_head_dir(head: EagleHead, small_dir: Path, dest: Path) -> Path:
    """The trained EAGLE head (its bfloat16-rounded values, as served) written as the runtime
    reads a head, for the small target of ``small_dir``: what the head adapters distil over."""
    raw = json.loads((small_dir / "config.json").read_text())
    intermediate = head.gate_proj.weight.shape[0]
    return save_eagle_head(head.checkpoint(), eagle_config(raw, intermediate), dest)


def distill_draft_adapter(
    adapter: TaskAdapter, target_dir: Path, draft_dir: Path, dest: Path, device: torch.device,
    opts: DraftAdapterTraining, *, head: bool = False,
) -> tuple[Path, dict]:  # fmt: skip
    """The draft adapter of ``adapter`` written to ``dest``, and the distillation's record;
    ``head``: ``draft_dir`` is an EAGLE head, adapted on every module the command adapts by
    default for one (the layer's projections and the feature fc)."""
    modules = HEAD_MODULES if head else LoraSettings().target_modules
    options = DistillOptions(
        target=target_dir, adapter=adapter.small_dir, draft=draft_dir, corpus=adapter.distill_files,
        out=dest, lora=LoraSettings(rank=opts.rank, alpha=2.0 * opts.rank, target_modules=tuple(modules)),
        training=TrainSettings(steps=opts.steps, batch_size=opts.batch, lr=opts.lr, seed=0),
        seq_len=opts.seq, eval_sequences=opts.eval_sequences, device=str(device),
    )  # fmt: skip
    report = distill(options, log=lambda line: log(f"distill {adapter.name}: {line}"))
    before, after = report.before, report.after
    info = {
        "rank": opts.rank,
        "modules": list(modules),
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
