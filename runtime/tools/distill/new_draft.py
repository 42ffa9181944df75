"""Train a new draft for a target from scratch: an EAGLE head or a DFLASH draft, over the
frozen target, on a text corpus; written as the runtime reads one (``--new eagle|dflash``
of ``loraserve-distill-draft``). The same trainers make the benchmarks' drafts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .corpus import load_corpus
from .dflash_draft import dflash_config, save_dflash
from .dflash_train import DFlashTraining, dflash_heldout, dflash_layer_ids, heldout_data, train_dflash
from .eagle_head import eagle_config, save_eagle_head
from .eagle_train import EagleTraining, eagle_heldout_top1, train_eagle_head
from .models import DistillError, load_tokenizer

KINDS = ("eagle", "dflash")
DFLASH_BLOCK = 8  # the reference's block: 7 drafts a step
HELDOUT_WINDOWS = 16  # held-out continuations the DFLASH draft is walked on


@dataclass(frozen=True)
class NewDraftOptions:
    """A new draft's training: its kind, its time budget and step cap, its batch."""

    kind: str
    seconds: float = 600.0
    max_steps: int | None = None
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 1e-3
    dflash_layers: int = 1
    seed: int = 0

    def check(self) -> None:
        if self.kind not in KINDS:
            raise DistillError(f"--new must be one of {list(KINDS)}, got {self.kind!r}")
        if self.seconds <= 0 and not self.max_steps:
            raise DistillError("--seconds must be positive (or give --steps): the training's budget")
        if self.seq_len < DFLASH_BLOCK + 2:
            raise DistillError(f"--seq-len must be at least {DFLASH_BLOCK + 2} for a new draft, got {self.seq_len}")
        if self.dflash_layers < 1:
            raise DistillError(f"--dflash-layers must be positive, got {self.dflash_layers}")


def _load_target(target_dir: Path, device: str):
    """The target in float32, frozen: the trainers read its features and logits."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    model.to(device).eval().requires_grad_(False)
    return model


def train_new_draft(
    options: NewDraftOptions, target_dir: Path, corpus: list[Path], out: Path, *, device: str,
    log: Callable[[str], None] = lambda _line: None,
) -> dict:  # fmt: skip
    """Train ``options.kind`` over the target of ``target_dir``, write it to ``out`` and
    return what it measured (steps, loss, held-out agreement with the target)."""
    options.check()
    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None:
        raise DistillError(f"--target {str(target_dir)!r} has no tokenizer files: the corpus is tokenized with it")
    text = load_corpus(corpus, tokenizer, options.seq_len + 1, seed=options.seed)
    data, held = text.train.flatten(), text.held_out.flatten()
    if held.numel() < 2 * (options.seq_len + 1):
        raise DistillError(
            f"the corpus' held-out share ({held.numel()} tokens) is shorter than two windows of --seq-len "
            f"{options.seq_len}: give more text or a shorter --seq-len"
        )
    raw = json.loads((target_dir / "config.json").read_text())
    dev = torch.device(device)
    target = _load_target(target_dir, device)
    start = time.perf_counter()
    if options.kind == "eagle":
        info = _train_eagle(options, target, data, held, raw, out, dev)
    else:
        info = _train_dflash(options, target, data, held, raw, out, dev)
    info["seconds"] = round(time.perf_counter() - start, 1)
    log(f"{options.kind} draft written to {out}: {info}")
    return info


def _train_eagle(options: NewDraftOptions, target, data, held, raw: dict, out: Path, device: torch.device) -> dict:
    opts = EagleTraining(
        seconds=options.seconds, seq=options.seq_len, batch=options.batch_size, lr=options.lr,
        max_steps=options.max_steps, seed=options.seed,
    )  # fmt: skip
    head, info = train_eagle_head(target, data, None, device, opts)
    head.round_to_bf16()  # what is served
    info["heldout_top1"] = eagle_heldout_top1(head, target, held, device, seq=options.seq_len)
    save_eagle_head(head.checkpoint(), eagle_config(raw, raw["intermediate_size"]), out)
    return info


def _train_dflash(options: NewDraftOptions, target, data, held, raw: dict, out: Path, device: torch.device) -> dict:
    layer_ids = dflash_layer_ids(raw["num_hidden_layers"], options.dflash_layers)
    opts = DFlashTraining(
        seconds=options.seconds, seq=options.seq_len, batch=options.batch_size, lr=options.lr,
        block=DFLASH_BLOCK, layer_ids=layer_ids, num_layers=options.dflash_layers,
        mask_id=int(raw.get("pad_token_id") or 0), max_steps=options.max_steps, seed=options.seed,
    )  # fmt: skip
    draft, info = train_dflash(target, data, None, device, opts)
    draft.round_to_bf16()
    walk = heldout_data(target, held, device, seq=options.seq_len, count=HELDOUT_WINDOWS, block=DFLASH_BLOCK,
                        layer_ids=layer_ids)  # fmt: skip
    info.update(dflash_heldout(draft, walk))
    config = dflash_config(
        raw, intermediate=raw["intermediate_size"], num_layers=options.dflash_layers, layer_ids=layer_ids,
        block=DFLASH_BLOCK, mask_id=opts.mask_id,
    )  # fmt: skip
    save_dflash(draft.checkpoint(), config, out)
    return info
