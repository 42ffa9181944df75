"""The adapted target's own answers, written as text for its draft adapter's distillation.

``loraserve-distill-draft`` asks for "text like the adapter's traffic (its prompts and the
adapted target's answers)": what the draft must predict at serving time is what the adapted
target generates, not only what its corpus says. So each task adapter, once trained,
continues windows of its training corpus greedily (the way the benchmark's requests are
decoded), and those prompts-and-answers go beside a slice of the corpus into the
distillation, as ``bench/speculative`` gives its STANDALONE draft the target's own
continuations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from loraserve.runtime.tools.distill.corpus import teacher_sequences

from .corpora import TaskCorpus


@dataclass(frozen=True)
class AnswerSettings:
    """How many answers, to prompts of how many corpus tokens, of how many new tokens."""

    count: int
    prompt_len: int
    new_tokens: int


def write_answers(
    model, corpus: TaskCorpus, tokenizer_dir: Path, dest: Path, device: torch.device, opts: AnswerSettings
) -> tuple[Path, dict]:
    """The adapted ``model``'s greedy continuations of ``opts.count`` windows of the corpus's
    training tokens, decoded to text, one per paragraph, in ``dest``; and what was written."""
    from tokenizers import Tokenizer

    t0 = time.monotonic()
    sequences = teacher_sequences(
        model, corpus.train_ids, device, count=opts.count, prompt_len=opts.prompt_len,
        new_tokens=opts.new_tokens, seed=11,
    )  # fmt: skip
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    texts = tok.decode_batch(sequences.tolist(), skip_special_tokens=True)
    dest.write_text("\n\n".join(texts), encoding="utf-8")
    return dest, {
        "answers": len(texts),
        "answer_tokens": sequences.numel(),
        "answer_seconds": round(time.monotonic() - t0, 1),
    }
