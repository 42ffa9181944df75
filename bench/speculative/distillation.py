"""The target's own continuations, and the STANDALONE draft distilled on them."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from loraserve.runtime.tools.distill.corpus import teacher_sequences
from loraserve.runtime.tools.distill.standalone import train_lm

from ..harness import log
from .corpus import tokenize, unseen_code_files
from .shapes import llama_config


@dataclass
class TeacherData:
    """The target's own greedy continuations (plus how they were made) for draft training."""

    data: torch.Tensor  # [n, seq + 1]
    seq: int
    fraction: float  # share of each draft batch taken from ``data``
    info: dict
    prompt: int = 0  # tokens of each row before the target's continuation


def serving_window(reach: int) -> int:
    """The drafts' training window for served requests that read ``reach`` tokens: ``reach``
    rounded up to 64. A draft never trained on contexts as long as it serves accepts less past
    them: on the CPU's deep toy target a DFLASH draft trained on 96-token windows walked 1.93
    drafts a block at contexts below 128 and 1.31 past them, one trained on 192-token windows
    1.97 and 3.37 (bench/results/2026-12-07-dflash-context-length-cpu.md). H100 run 11's draft,
    trained on 192 and serving contexts up to 328, walked 2.30 and served 1.81."""
    return 64 * math.ceil(reach / 64)


def teacher_continuations(
    args, target, data, tok_dir, device, *, smoke, reach, prompt_len
) -> TeacherData:
    """Greedy continuations of the target for the drafts' distillation (``--distill-prompts``),
    ``--distill-seq`` tokens long or as long as a served request reads (``reach``:
    ``Settings.serving_reach``)."""
    t0 = time.monotonic()
    gen_len = args.distill_seq or serving_window(reach)
    if args.distill_prompts == "unseen":
        # The serving regime: prompts of the benchmark's length from code the target never saw.
        unseen_files = unseen_code_files(1_000_000 if smoke else 8_000_000)
        prompt_data = tokenize(tok_dir, unseen_files)
        teacher_prompt = prompt_len
        source = f"{len(unseen_files)} unseen torch modules ({prompt_data.numel():,} tokens)"
    else:  # run 2's recipe: prompts from the training corpus, a third of each window
        prompt_data = data
        teacher_prompt = gen_len // 3
        source = "the training corpus"
    out = teacher_sequences(
        # 24576 on a GPU: with 1024 the EAGLE head memorised them (training top-1 0.78, held
        # out 0.44), 8192 and 70 s of training held out 0.47-0.49, 16384 and 170 s 0.52-0.53,
        # 24576 and 240 s 0.52-0.53 with 2.22 of 5 drafts accepted against 2.03-2.12
        # (bench/results/2026-12-03-spec-h200.md, runs 5, 7, 10-12)
        target, prompt_data, device, count=args.distill_count or (32 if smoke else 24576),
        prompt_len=teacher_prompt, new_tokens=gen_len - teacher_prompt + 1, seed=3,
    )  # fmt: skip
    seconds = time.monotonic() - t0
    log(f"teacher continuations: {tuple(out.shape)} of {source} in {seconds:.1f} s")
    fraction = args.teacher_fraction if args.teacher_fraction is not None else (
        0.75 if args.distill_prompts == "unseen" else 0.5
    )  # fmt: skip
    info = {"teacher_prompts": source, "teacher_sequences": list(out.shape), "teacher_seconds": round(seconds, 1),
            "teacher_fraction": fraction, "seq": gen_len}  # fmt: skip
    return TeacherData(out, gen_len, fraction, info, prompt=teacher_prompt)


def train_standalone(
    args, target, draft_shape, vocab, data, teacher, seconds, device, *, seq, batch, smoke, max_steps
):
    """The STANDALONE draft: distilled from ``target`` on ``teacher`` data, or trained on the corpus."""
    lr = 2e-3 if smoke else 1e-3
    if args.draft_training == "distill":
        draft, info = train_lm(
            llama_config(draft_shape, vocab), data, seconds, device, seq=teacher.seq, batch=batch, lr=lr, seed=2,
            teacher=target, teacher_data=teacher.data, teacher_fraction=teacher.fraction, max_steps=max_steps,
        )  # fmt: skip
        info.update(teacher.info)
    else:
        draft, info = train_lm(
            llama_config(draft_shape, vocab),
            data,
            seconds,
            device,
            seq=seq,
            batch=batch,
            lr=lr,
            seed=2,
            max_steps=max_steps,
        )
    info["training"] = args.draft_training
    log(f"STANDALONE draft trained: {info}")
    return draft, info
