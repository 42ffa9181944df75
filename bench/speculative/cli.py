"""The command line of the speculative decoding benchmark."""

from __future__ import annotations

import argparse

from loraserve.runtime.tools.distill import dflash_recipe

from ..harness import add_output_args
from . import recipe_flags
from .settings import Settings, settings_from

DESCRIPTION = "Speculative decoding throughput: tokens/s with and without a draft, 4 adapters in the mix."


def build_parser() -> argparse.ArgumentParser:
    """Every option of the benchmark (``--help`` lists them in this order)."""
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    _add_run_args(ap)
    _add_distillation_args(ap)
    _add_scheduling_args(ap)
    _add_measurement_args(ap)
    _add_draft_args(ap)
    _add_serving_args(ap)
    return ap


def parse(argv: list[str] | None = None) -> Settings:
    """The command line ``argv`` (``sys.argv[1:]`` when None), checked, with defaults filled in."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.eagle_unroll < 1:
        ap.error(
            f"--eagle-unroll must be at least 1 (draft steps trained per position), got {args.eagle_unroll}"
        )
    if args.eagle_lr is not None and args.eagle_lr <= 0:
        ap.error(f"--eagle-lr must be positive (a learning rate of 0 trains nothing), got {args.eagle_lr}")
    if (args.dflash_train_s is not None and args.dflash_train_s <= 0) or args.dflash_probe_steps < 0:
        ap.error(
            f"--dflash-train-s must be positive and --dflash-probe-steps not negative, got {args.dflash_train_s} and"
            f" {args.dflash_probe_steps}"
        )
    if args.distill_seq is not None and args.distill_seq < dflash_recipe.MIN_WINDOW:
        ap.error(
            f"--distill-seq must be at least {dflash_recipe.MIN_WINDOW} tokens (a training window), got {args.distill_seq}"
        )
    if args.dflash_block is not None and args.dflash_block < 2:
        ap.error(f"--dflash-block must be at least 2 (the last token and one draft), got {args.dflash_block}")
    try:
        recipe = recipe_flags.recipe_from_args(args)
    except ValueError as err:
        ap.error(str(err))
    return settings_from(args, argv, recipe)


def _add_run_args(ap: argparse.ArgumentParser) -> None:
    """The run itself: where results go, the models' shapes and training times, the workload."""
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, short training")
    add_output_args(ap)
    ap.add_argument("--target-shape", default=None, help="8b (default on GPU) or trained")
    ap.add_argument("--k", type=int, default=None, help="num_draft_tokens (default 6; smoke 4)")
    ap.add_argument("--train-target-s", type=float, default=None)
    ap.add_argument("--train-draft-s", type=float, default=None)
    ap.add_argument("--gen-tokens", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--concurrency", default=None, help="comma list, default 1,8,32 (smoke 1,2,4)")
    ap.add_argument("--adapter-b-std", type=float, default=0.004)


def _add_distillation_args(ap: argparse.ArgumentParser) -> None:
    """How the STANDALONE draft learns from the target."""
    ap.add_argument(
        "--draft-training",
        choices=("distill", "corpus"),
        default="distill",
        help="distill: KL to the target on its own continuations + corpus; corpus: plain LM training",
    )
    ap.add_argument(
        "--distill-prompts",
        choices=("unseen", "corpus"),
        default="corpus",
        help="teacher prompts: corpus: training-corpus windows (a third of each sequence); unseen: code no model"
        " trains on (torch's modules) at the benchmark's prompt length; either continued past the longest request",
    )
    ap.add_argument(
        "--distill-seq",
        type=int,
        default=None,
        help="the drafts' training window (default: the longest served request plus a verify, rounded up to 64)",
    )
    ap.add_argument(
        "--distill-count", type=int, default=None, help="teacher continuations (default 24576; smoke 32)"
    )
    ap.add_argument(
        "--teacher-fraction",
        type=float,
        default=None,
        help="share of each draft batch from teacher continuations (default 0.75 unseen, 0.5 corpus)",
    )


def _add_scheduling_args(ap: argparse.ArgumentParser) -> None:
    """Requests per level, admission batching and when speculation switches off."""
    ap.add_argument(
        "--waves",
        type=int,
        default=None,
        help="requests per concurrency level = waves x concurrency (keeps the batch full; default 3, smoke 1)",
    )
    ap.add_argument(
        "--defer-steps",
        type=int,
        default=None,
        help="decode steps admission may wait to batch prefills (default: the engine's; 0: admit at once)",
    )
    ap.add_argument(
        "--ab-defer",
        default="",
        help="comma list of concurrencies at which speculation is also timed with admission batching off",
    )
    ap.add_argument(
        "--disable-batch-size",
        type=int,
        default=0,
        help="speculative.disable_batch_size for every draft: steps of at least this many requests skip"
        " drafting (0: always draft)",
    )
    ap.add_argument(
        "--auto-disable",
        action="store_true",
        help="speculative.auto_disable for every draft: draft per batch-size bucket only while it measures faster",
    )
    ap.add_argument(
        "--auto-disable-ab",
        action="store_true",
        help="also time each draft with speculative.auto_disable on, as its own run (DRAFT+auto) against the"
        " same baseline, so one call measures the switch beside plain speculation",
    )


def _add_measurement_args(ap: argparse.ArgumentParser) -> None:
    """Extra measurements at concurrency 1, and the time budget."""
    ap.add_argument(
        "--profile",
        default=None,
        help="directory: after each draft's timed run at concurrency 1, profile one more request with"
        " torch.profiler and write the operator table there (where a step's time goes)",
    )
    ap.add_argument(
        "--phases",
        default=None,
        help="directory: after each draft's timed run at concurrency 1, run one more request through the"
        " speculative and the plain decoder with their methods timed on the host and (CUDA events) on the"
        " GPU, and write phases-DRAFT.md there (where a step's time goes, without a profiler's distortion)",
    )
    ap.add_argument(
        "--k-sweep",
        default="",
        help="comma list of other num_draft_tokens values to time at concurrency 1 with the first draft"
        " (the same trained draft and workload; rows DRAFT-kN), e.g. 4,8,10",
    )
    ap.add_argument(
        "--c1-requests",
        type=int,
        default=10,
        help="requests concurrency 1 runs, one after another (base and each adapter in turn; default 10)",
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="seconds from the start after which optional runs (--ab-defer, a second draft) are skipped",
    )
    ap.add_argument(
        "--draft",
        default="standalone",
        help="comma list of drafts, each its own speculative run against the same no-spec baseline:"
        " standalone (a small distilled Llama), eagle (an EAGLE head over the target's features) and/or"
        " dflash (a DFLASH block drafter over the target's layer outputs)",
    )


def _add_draft_args(ap: argparse.ArgumentParser) -> None:
    """Which drafts run, the EAGLE head's training and the training step caps."""
    ap.add_argument(
        "--eagle-noise", type=float, default=0.0, help="EAGLE training: U(-a, a) noise on features"
    )
    ap.add_argument(
        "--eagle-unroll",
        type=int,
        default=2,
        help="EAGLE training: draft steps trained per position (training-time test); 1 teacher forcing"
        " only, s > 1 also steps 2..s, each on the head's own previous feature (default 2)",
    )
    ap.add_argument(
        "--eagle-feature-weight", type=float, default=0.1, help="EAGLE training: weight of the feature loss"
    )
    ap.add_argument("--eagle-lr", type=float, default=None, help="EAGLE training: peak learning rate")
    recipe_flags.add_flags(ap)
    ap.add_argument(
        "--dflash-train-s", type=float, default=None, help="DFLASH training: seconds (default --train-draft-s)"
    )
    ap.add_argument(
        "--dflash-probe-steps",
        type=int,
        default=0,
        help="DFLASH training: every this many steps, walk the held-out continuations with the served draft so far"
        " (the learning curve; not counted in the training time; default 0, none)",
    )
    ap.add_argument(
        "--dflash-compile",
        action="store_true",
        help="DFLASH training: the draft's training forward under torch.compile (compiled before the clock"
        " starts; the same draft, more steps in the time)",
    )
    ap.add_argument(
        "--dflash-block",
        type=int,
        default=None,
        help="DFLASH: the block the draft trains on and the target verifies (num_draft_tokens; default 8,"
        " smoke 4)",
    )
    ap.add_argument(
        "--eagle-cache-gib",
        type=float,
        default=None,
        help="EAGLE training: compute the target's features of the training windows once, up to this many"
        " GiB (teacher windows first, then fixed corpus slices), so each step is the head's work alone;"
        " 0 computes them every step at random corpus offsets (runs up to 12). Default 32 (smoke 0.02)",
    )
    ap.add_argument(
        "--max-steps",
        default=None,
        help="TARGET,STANDALONE,EAGLE: optimizer-step caps next to the time budgets (0: no cap), so a"
        " comparison on a shared CPU trains each model as far as an idle machine would (default: the"
        " target capped at 690 steps, as far as an H100 trains it in 60 s, the drafts uncapped; smoke: none);"
        " the third caps the DFLASH draft as well as the EAGLE head",
    )
    ap.add_argument(
        "--attention-backend",
        default="auto",
        choices=("auto", "sdpa", "triton"),
        help="the served target's (and EAGLE head's) decode/verify attention: sdpa, triton's paged kernel, or auto"
        " (the runtime's default: triton on CUDA)",
    )


def _add_serving_args(ap: argparse.ArgumentParser) -> None:
    """The served target's attention and the EAGLE tree runs."""
    ap.add_argument(
        "--tree",
        default="",
        help="comma list of TOPK:TOKENS tree shapes, each also timed as its own EAGLE run (rows eagle-tTOPK-nTOKENS):"
        " the same head grows trees of top-k TOPK over num_steps k - 1 and the target verifies TOKENS nodes, e.g. 2:10",
    )
    ap.add_argument(
        "--tree-max-batch-size",
        type=int,
        default=0,
        help="speculative.tree_max_batch_size of the --tree runs: steps of more requests verify chains (0: trees always)",
    )
