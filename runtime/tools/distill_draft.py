"""Distil a draft LoRA for one adapter: ``loraserve-distill-draft``.

    loraserve-distill-draft --target TARGET_DIR --adapter ADAPTER_DIR --draft DRAFT_DIR \\
        --corpus FILE [FILE ...] --out OUT_DIR [--rank 16 --alpha 32 --steps 500 ...]

A shared STANDALONE draft runs without adapters, so on an adapted request it predicts the
base target, and the accept rate drops as far as the adapter moved the target. This trains
a LoRA for the draft (its base frozen) so the draft predicts the ADAPTED target instead: on
the given text, the draft's next-token distribution is pulled towards the adapted target's
(forward KL over every position, temperature T; the target's logits are computed on the
fly per batch, never stored). The result is a PEFT adapter folder (adapter_config.json +
adapter_model.safetensors) for the draft, which an Adapter names as its draft adapter
(``spec.draft.source``); it is read back through the runtime's adapter loader before the
command reports success.

It prints the steps, the seconds, and, on a held-out 5% of the corpus, the KL from the
adapted target to the draft and the draft's top-1 agreement with the adapted target's
argmax, before and after: agreement is what a greedy draft's accept rate follows. Use text
like the adapter's traffic (its prompts and the adapted target's answers) for the corpus.

``--draft`` may also be an EAGLE / EAGLE3 head (its config.json says so): the LoRA then
adapts the head's own layers (``--target-modules`` from q_proj..down_proj and fc; default all
of them), its base frozen, and the head reads the ADAPTED target's features, as it does
serving that adapter's requests; its next-token distribution is pulled towards the adapted
target's the same way (:mod:`.distill.eagle`). Serving chains the head, its later draft
steps reading its own output instead of the target's feature: ``--unroll N`` (default 2)
trains N such chained steps, each matched to the adapted target. The adapter is written with
the head's module names and read back through the head's draft adapter pool's loader.

``--new eagle`` or ``--new dflash`` trains a new draft for the target instead (no --adapter,
no --draft): an EAGLE head or a DFLASH draft over the frozen target's features, for
``--seconds`` (or ``--steps``), written to ``--out`` as the runtime reads one
(:mod:`.distill.new_draft`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .distill.corpus import CorpusError, load_corpus
from .distill.eagle import (
    HEAD_MODULES,
    check_head_settings,
    check_written_head_adapter,
    is_eagle_head,
    load_head_pair,
)
from .distill.models import (
    DistillError,
    LoraSettings,
    Vocabulary,
    check_adapter_dir,
    check_model_dir,
    check_vocabulary,
    check_written_adapter,
    load_student,
    load_teacher,
    load_tokenizer,
    require_peft,
    save_adapter,
)
from .distill.new_draft import KINDS, NewDraftOptions, train_new_draft
from .distill.objective import score
from .distill.report import DistillReport, format_report, write_report_file
from .distill.train import DEFAULT_HEAD_UNROLL, TrainSettings, check_settings, train

PROG = "loraserve-distill-draft"
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class DistillOptions:
    """Everything one distillation needs (the command's flags)."""

    target: Path
    adapter: Path
    draft: Path
    corpus: list[Path]
    out: Path
    lora: LoraSettings = field(default_factory=LoraSettings)
    training: TrainSettings = field(default_factory=TrainSettings)
    seq_len: int = 512
    eval_sequences: int = 128
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str | None = None  # None: bf16 on cuda, fp32 on cpu
    overwrite: bool = False


def resolve_device(device: str | None, dtype: str | None) -> tuple[str, torch.dtype]:
    """The device and dtype to run on; a CUDA request without CUDA is refused."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DistillError("--device cuda was asked for but torch sees no CUDA device: use --device cpu")
    if dtype is None:
        dtype = "bf16" if device.startswith("cuda") else "fp32"
    if dtype not in _DTYPES:
        raise DistillError(f"--dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return device, _DTYPES[dtype]


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Never mix a new adapter into an old one's folder by accident."""
    if out.exists() and not out.is_dir():
        raise DistillError(f"--out {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise DistillError(f"--out {str(out)!r} is not empty: choose a new folder, or pass --overwrite")


def resolve_unroll(training: TrainSettings, head: bool) -> TrainSettings:
    """``training`` with its chained draft steps settled: ``--unroll`` or, for an EAGLE head,
    :data:`DEFAULT_HEAD_UNROLL`; a STANDALONE draft trains its one step."""
    check_settings(training)
    if head:
        return dataclasses.replace(training, unroll=training.unroll or DEFAULT_HEAD_UNROLL)
    if training.unroll not in (None, 1):
        raise DistillError(
            f"--unroll {training.unroll} applies to EAGLE / EAGLE3 heads only (a head's later draft steps "
            "read its own output); a STANDALONE draft reads tokens alone: leave --unroll out"
        )
    return dataclasses.replace(training, unroll=1)


def distill(options: DistillOptions, log: Callable[[str], None] = lambda _line: None) -> DistillReport:
    """Check the inputs, train the draft LoRA, write and check it; returns the report."""
    require_peft()
    head = is_eagle_head(options.draft)
    if head:
        check_head_settings(options.lora)
    else:
        options.lora.check()
    training = resolve_unroll(options.training, head)
    if options.eval_sequences < 1:
        raise DistillError(f"--eval-sequences must be positive, got {options.eval_sequences}")
    target = check_model_dir(options.target, "--target", "target model")
    draft = check_model_dir(options.draft, "--draft", "EAGLE head" if head else "STANDALONE draft model")
    adapter = check_adapter_dir(options.adapter)
    check_out_dir(options.out, options.overwrite)
    device, dtype = resolve_device(options.device, options.dtype)
    tokenizer = load_tokenizer(target)
    if tokenizer is None:
        raise DistillError(
            f"--target {str(target)!r} has no tokenizer files: the corpus is tokenized with it"
        )
    # A head predicts the target's own token ids (its embeddings are the target's).
    vocabulary = None if head else check_vocabulary(target, draft, tokenizer, load_tokenizer(draft))
    corpus = load_corpus(options.corpus, tokenizer, options.seq_len, seed=training.seed)
    log(
        f"corpus: {corpus.files} file(s), {corpus.tokens:,} tokens -> {corpus.train.shape[0]} training and "
        f"{corpus.held_out.shape[0]} held-out sequences of {corpus.seq_len}"
    )

    torch.manual_seed(training.seed)
    start = time.perf_counter()
    teacher = load_teacher(target, adapter, dtype, device)
    if head:
        teacher, student, width = load_head_pair(
            target, draft, teacher, options.lora, seq_len=options.seq_len, dtype=dtype, device=device,
            seed=training.seed, unroll=training.unroll,
        )  # fmt: skip
        size = len(tokenizer)
        vocabulary = Vocabulary(width, target_size=size, draft_size=width, tokenizer_checked=True)
    else:
        student = load_student(draft, options.lora, dtype, device)
    assert vocabulary is not None
    load_seconds = time.perf_counter() - start

    held_out = corpus.held_out[: options.eval_sequences]
    batch, steps = training.batch_size, training.unroll or 1
    before = score(teacher, student, held_out, vocabulary.width, batch_size=batch, device=device, steps=steps)
    log(f"before: held-out KL {before.kl:.4f}, top-1 agreement {before.agreement:.2%}")
    stats = train(teacher, student, corpus.train, vocabulary.width, training, device=device, log=log)
    after = score(teacher, student, held_out, vocabulary.width, batch_size=batch, device=device, steps=steps)

    if head:
        files = student.save(options.out)
        check_written_head_adapter(options.out, draft, options.lora)
    else:
        files = save_adapter(student, options.out)
        check_written_adapter(options.out, draft, options.lora)
    report = DistillReport(
        out=options.out,
        files=files,
        lora=options.lora,
        vocabulary=vocabulary,
        train_sequences=int(corpus.train.shape[0]),
        held_out_sequences=int(held_out.shape[0]),
        seq_len=corpus.seq_len,
        stats=stats,
        before=before,
        after=after,
        load_seconds=load_seconds,
        training=training,
        inputs={
            "target": str(options.target),
            "adapter": str(options.adapter),
            "draft": str(options.draft),
            "corpus": [str(p) for p in options.corpus],
        },
    )
    write_report_file(report)
    return report


def _modules(text: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in text.split(",") if m.strip())


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(
        prog=PROG,
        description=doc.split("\n\n")[0] + "\n\n" + "\n\n".join(doc.split("\n\n")[2:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults, lora = TrainSettings(), LoraSettings()
    ap.add_argument(
        "--target", required=True, type=Path, help="the target model's folder (Hugging Face layout)"
    )
    ap.add_argument("--adapter", type=Path, help="the target's PEFT adapter folder (the teacher)")
    ap.add_argument(
        "--draft",
        type=Path,
        help="the STANDALONE draft model's folder (the target's tokenizer), or an EAGLE / EAGLE3 head's",
    )
    ap.add_argument("--corpus", required=True, nargs="+", type=Path, help="plain UTF-8 text files")
    ap.add_argument("--out", required=True, type=Path, help="folder to write the draft's PEFT adapter into")
    ap.add_argument("--rank", type=int, default=lora.rank, help=f"LoRA rank (default {lora.rank})")
    ap.add_argument("--alpha", type=float, default=lora.alpha, help=f"LoRA alpha (default {lora.alpha:g})")
    ap.add_argument(
        "--target-modules",
        type=_modules,
        default=None,
        help=f"comma-separated modules of the draft to adapt (default {','.join(lora.target_modules)}; "
        f"for an EAGLE head {','.join(HEAD_MODULES)})",
    )
    ap.add_argument(
        "--steps", type=int, default=None,
        help=f"optimizer steps (default {defaults.steps}; with --new, a cap beside --seconds)",
    )
    ap.add_argument(
        "--batch-size", type=int, default=defaults.batch_size, help="sequences per step (default 8)"
    )
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per packed sequence (default 512)")
    ap.add_argument(
        "--lr", type=float, default=defaults.lr, help=f"peak learning rate (default {defaults.lr:g})"
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=defaults.temperature,
        help="distillation temperature T (default 1)",
    )
    ap.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="truncate the teacher to its top k tokens (saves memory on large vocabularies; default: the full distribution)",
    )
    ap.add_argument(
        "--unroll",
        type=int,
        default=None,
        help=f"EAGLE / EAGLE3 heads: chained draft steps trained, each later one reading the head's own "
        f"output as serving does (default {DEFAULT_HEAD_UNROLL}; 1: the first step only)",
    )
    ap.add_argument(
        "--eval-sequences", type=int, default=128, help="held-out sequences scored before/after (default 128)"
    )
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu"
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="seeds the held-out split, the batches and the LoRA init"
    )
    ap.add_argument("--new", choices=KINDS, default=None, help="train a new draft of this kind for --target")
    ap.add_argument("--seconds", type=float, default=600.0, help="--new: the training's time budget (default 600)")
    ap.add_argument("--dflash-layers", type=int, default=1, help="--new dflash: the draft's layers (default 1)")
    ap.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return ap


def _target_modules(args: argparse.Namespace) -> tuple[str, ...]:
    """``--target-modules``, or the default of the draft's kind (a head adapts its fc too)."""
    if args.target_modules is not None:
        return tuple(args.target_modules)
    return HEAD_MODULES if is_eagle_head(args.draft) else LoraSettings().target_modules


def options_from_args(args: argparse.Namespace) -> DistillOptions:
    return DistillOptions(
        target=args.target,
        adapter=args.adapter,
        draft=args.draft,
        corpus=list(args.corpus),
        out=args.out,
        lora=LoraSettings(rank=args.rank, alpha=args.alpha, target_modules=_target_modules(args)),
        training=TrainSettings(
            steps=TrainSettings().steps if args.steps is None else args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            unroll=args.unroll,
        ),
        seq_len=args.seq_len,
        eval_sequences=args.eval_sequences,
        device=args.device,
        dtype=args.dtype,
        overwrite=args.overwrite,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; 0 on success, 2 (with the reason on stderr) when an input is refused."""
    args = build_parser().parse_args(argv)

    def log(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    if args.new:
        return _new_draft(args, log)
    try:
        missing = [flag for flag, value in (("--adapter", args.adapter), ("--draft", args.draft)) if value is None]
        if missing:
            raise DistillError(f"{' and '.join(missing)} required: the adapter to follow and the draft to adapt "
                               "(or --new eagle|dflash to train a new draft)")  # fmt: skip
        report = distill(options_from_args(args), log)
    except (DistillError, CorpusError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    return 0


def _new_draft(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    """``--new``: train a new EAGLE head or DFLASH draft for ``--target``."""
    try:
        if args.adapter is not None or args.draft is not None:
            raise DistillError("--new trains a draft from the target alone: leave --adapter and --draft out")
        target = check_model_dir(args.target, "--target", "target model")
        check_out_dir(args.out, args.overwrite)
        device, _ = resolve_device(args.device, args.dtype)
        options = NewDraftOptions(
            kind=args.new, seconds=args.seconds, max_steps=args.steps,
            seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, dflash_layers=args.dflash_layers,
            seed=args.seed,
        )  # fmt: skip
        info = train_new_draft(options, target, list(args.corpus), args.out, device=device, log=log)
    except (DistillError, CorpusError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(args.out), "kind": args.new, **info}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
