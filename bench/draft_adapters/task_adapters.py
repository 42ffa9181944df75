"""Task adapters: PEFT LoRAs trained on the small target, each on its own corpus.

Each adapter is a plain language-model fine-tune (next-token cross-entropy on its corpus,
the target frozen, LoRA on every linear module), trained on the small target as it is
served: its bfloat16 weights, read back from the saved directory. How far it moved the
target is measured on the corpus's held-out files: the target's loss there without and
with the adapter, and the share of positions where the adapted target's top-1 differs from
the base target's (what a draft that predicts the base target gets wrong).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from loraserve.runtime.contract.config import DEFAULT_LORA_MODULES
from loraserve.runtime.tools.distill.train import lr_scale, progress

from ..harness import log
from .answers import AnswerSettings, write_answers
from .corpora import TaskCorpus


@dataclass(frozen=True)
class AdapterTraining:
    """How each task adapter trains."""

    seconds: float
    rank: int
    lr: float
    seq: int
    batch: int
    max_steps: int | None = None
    eval_windows: int = 32
    answers: AnswerSettings | None = None  # the adapted target's answers for the draft's distillation


@dataclass
class TaskAdapter:
    """A trained task adapter: its PEFT folder (for the small target) and its record."""

    name: str
    corpus: TaskCorpus
    small_dir: Path
    info: dict
    distill_files: list[Path]  # the draft adapter's corpus: a slice of the task corpus, and the answers


def windows(data: torch.Tensor, gen: torch.Generator, count: int, seq: int) -> torch.Tensor:
    """``[count, seq + 1]`` windows of ``data`` at random offsets (``gen``)."""
    starts = torch.randint(0, data.numel() - seq - 1, (count,), generator=gen)
    return data[starts[:, None] + torch.arange(seq + 1)[None, :]]


def load_small_target(small_dir: Path, device: torch.device):
    """The small target as served (its saved bfloat16 weights), in float32 for training."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(small_dir), dtype=torch.float32).to(device)


def train_task_adapter(
    small_dir: Path, corpus: TaskCorpus, dest: Path, device: torch.device, opts: AdapterTraining, *, seed: int,
    tokenizer_dir: Path,
) -> TaskAdapter:  # fmt: skip
    """Train one LoRA on ``corpus`` for ``opts.seconds``, save it (PEFT layout) under ``dest``,
    and write the adapted target's answers beside it (``opts.answers``)."""
    from peft import LoraConfig, get_peft_model

    base = load_small_target(small_dir, device)
    base.requires_grad_(False)
    config = LoraConfig(
        r=opts.rank, lora_alpha=2 * opts.rank, target_modules=list(DEFAULT_LORA_MODULES), lora_dropout=0.0,
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    data = corpus.train_ids
    autocast = {"device_type": device.type, "dtype": torch.bfloat16, "enabled": device.type == "cuda"}
    model.train()
    start, step, loss = time.monotonic(), 0, torch.zeros(())
    while (frac := progress(time.monotonic() - start, opts.seconds, step, opts.max_steps)) < 1.0:
        for group in opt.param_groups:
            group["lr"] = opts.lr * lr_scale(step, frac, warmup=20)
        window = windows(data, gen, opts.batch, opts.seq).to(device)
        with torch.autocast(**autocast):
            logits = model(input_ids=window[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
    seconds = time.monotonic() - start
    model.eval()
    info = {"steps": step, "seconds": round(seconds, 1), "final_loss": round(loss.item(), 3),
            "rank": opts.rank, "tokens": step * opts.batch * opts.seq, **corpus.info()}  # fmt: skip
    info.update(adapter_moves(model, corpus.held_ids, device, seq=opts.seq, count=opts.eval_windows))
    model.save_pretrained(str(dest), safe_serialization=True, save_embedding_layers=False)
    files = [corpus.text_file]
    if opts.answers is not None and opts.answers.count > 0:
        answers, answer_info = write_answers(
            model, corpus, tokenizer_dir, dest.parent / f"answers-{corpus.name}.txt", device, opts.answers
        )
        files.append(answers)
        info.update(answer_info)
    log(f"task adapter {corpus.name} trained: {info}")
    del model, base
    return TaskAdapter(corpus.name, corpus, dest, info, files)


@torch.no_grad()
def adapter_moves(model, held_ids: torch.Tensor, device: torch.device, *, seq: int, count: int) -> dict:
    """How far the adapter moved the target on held-out text of its corpus: the loss without
    and with it, and the share of positions whose top-1 token it changes."""
    gen = torch.Generator().manual_seed(7)
    seq = min(seq, held_ids.numel() - 2)
    window = windows(held_ids, gen, count, seq).to(device)
    autocast = {"device_type": device.type, "dtype": torch.bfloat16, "enabled": device.type == "cuda"}
    with torch.autocast(**autocast):
        adapted = model(input_ids=window[:, :-1]).logits.float()
        with model.disable_adapter():
            base = model(input_ids=window[:, :-1]).logits.float()
    target = window[:, 1:].flatten()
    return {
        "heldout_loss_base": round(float(torch.nn.functional.cross_entropy(base.flatten(0, 1), target)), 4),
        "heldout_loss_adapted": round(
            float(torch.nn.functional.cross_entropy(adapted.flatten(0, 1), target)), 3
        ),
        "top1_changed": round(float((adapted.argmax(-1) != base.argmax(-1)).float().mean()), 3),
    }
