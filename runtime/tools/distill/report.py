"""What ``loraserve-distill-draft`` reports: the printed summary, and ``distill_report.json``
written beside the adapter (what it was distilled from, with which settings, and how well)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ...contract.config import SpeculativeConfig
from .models import LoraSettings, Vocabulary
from .objective import HeldOutScore
from .train import TrainSettings, TrainStats

REPORT_FILE = "distill_report.json"


@dataclass
class DistillReport:
    """What the command prints (and writes beside the adapter as distill_report.json)."""

    out: Path
    files: list[str]
    lora: LoraSettings
    vocabulary: Vocabulary
    train_sequences: int
    held_out_sequences: int  # scored (at most --eval-sequences of the held-out slice)
    seq_len: int
    stats: TrainStats
    before: HeldOutScore
    after: HeldOutScore
    load_seconds: float
    training: TrainSettings
    inputs: dict[str, object] = field(default_factory=dict)  # the paths distilled from


def write_report_file(report: DistillReport) -> None:
    """``distill_report.json`` beside the adapter: what it was distilled from, and how well."""
    record = {
        **report.inputs,
        "seq_len": report.seq_len,
        "train_sequences": report.train_sequences,
        "held_out_sequences": report.held_out_sequences,
        "lora": dataclasses.asdict(report.lora),
        "training": dataclasses.asdict(report.training),
        "stats": {**dataclasses.asdict(report.stats), "tokens_per_second": report.stats.tokens_per_second},
        "before": dataclasses.asdict(report.before),
        "after": dataclasses.asdict(report.after),
    }
    (report.out / REPORT_FILE).write_text(json.dumps(record, indent=2) + "\n")


def format_report(report: DistillReport) -> str:
    """The short report the command prints."""
    s, b, a = report.stats, report.before, report.after
    lora = report.lora
    lines = [
        f"draft LoRA r={lora.rank} alpha={lora.alpha:g} on {','.join(lora.target_modules)}: {s.steps} steps in "
        f"{s.seconds:.1f} s ({s.tokens:,} tokens, {s.tokens_per_second:,.0f} tokens/s; loading {report.load_seconds:.1f} s)",
        f"held-out: {report.held_out_sequences} sequences x {report.seq_len} tokens ({a.positions:,} positions)",
        f"  KL(adapted target || draft), nats/token: {b.kl:.4f} -> {a.kl:.4f}",
        f"  top-1 agreement with the adapted target: {b.agreement:.2%} -> {a.agreement:.2%}"
        "  (what a greedy draft's accept rate follows)",
        f"wrote {report.out}: {', '.join(report.files)} (read back by the runtime's adapter loader)",
    ]
    if a.step_agreement:
        steps = ", ".join(
            f"step {i + 1} {x:.2%} -> {y:.2%}"
            for i, (x, y) in enumerate(zip(b.step_agreement, a.step_agreement, strict=True))
        )
        lines.insert(4, f"  per chained draft step (--unroll {len(a.step_agreement)}): {steps}")
    pool_rank = SpeculativeConfig().draft_max_lora_rank
    if lora.rank > pool_rank:
        lines.append(
            f"note: rank {lora.rank} is above the draft pool's default largest rank {pool_rank}: serve it with "
            f"speculative.draftLora.maxRank (--draft-max-lora-rank) of at least {lora.rank}"
        )
    if report.vocabulary.target_size != report.vocabulary.draft_size:
        lines.append(
            f"note: vocab_size {report.vocabulary.target_size} (target) vs {report.vocabulary.draft_size} (draft): "
            f"compared over the first {report.vocabulary.width} logits, as the runtime does"
        )
    return "\n".join(lines)
