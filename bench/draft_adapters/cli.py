"""The command line: this benchmark's options, and ``bench/speculative``'s settings built
from them (the target, the draft (``--draft``: the STANDALONE draft or the EAGLE head), the
serving shapes and workload sizes are that benchmark's, trained and served by its code).

Defaults size a GPU run for one 10-minute call on an H100 (about 8 minutes: the phases'
seconds are printed and reported, to tune them); ``--smoke`` runs the whole flow on a CPU
with tiny shapes in well under a minute.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..speculative import cli as spec_cli
from ..speculative.settings import Settings as SpecSettings
from .answers import AnswerSettings
from .corpora import SOURCES
from .draft_distillation import DraftAdapterTraining
from .task_adapters import AdapterTraining

DESCRIPTION = (
    "Draft adapters: accept length and speedup of adapted requests with the shared draft (a STANDALONE draft or"
    " an EAGLE head) and with each task adapter's distilled draft adapter, beside base requests."
)

DRAFTS = ("standalone", "eagle")
DRAFT_LABELS = {"standalone": "STANDALONE draft", "eagle": "EAGLE head"}


@dataclass
class Settings:
    """The run: ``bench/speculative``'s settings and this benchmark's own."""

    spec: SpecSettings
    args: argparse.Namespace
    argv: list[str] | None
    draft: str  # "standalone" or "eagle": the shared draft, and what the draft adapters adapt
    adapters: list[str]
    adapter_training: AdapterTraining
    draft_training: DraftAdapterTraining
    train_bytes: int  # text per task corpus trained on
    distill_bytes: int  # of which the draft adapter's distillation reads this much, beside the answers
    held_bytes: int  # held-out text per task corpus (prompts, the adapter's measure)
    deadline_s: float


def build_parser() -> argparse.ArgumentParser:
    """Every option, with the GPU default (``--smoke``'s in brackets)."""
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    add = ap.add_argument
    add("--smoke", action="store_true", help="CPU, tiny shapes, short training")
    add(
        "--draft",
        choices=DRAFTS,
        default="standalone",
        help="the shared draft: standalone (a small distilled Llama) or eagle (an EAGLE head over the target's"
        " features, served as an EAGLE chain of k); the draft adapters adapt it (default standalone)",
    )
    add("--out", default=None, help="markdown report (JSON beside it unless --json)")
    add("--json", default=None, help="JSON record of the run")
    add(
        "--adapters",
        default=None,
        help=f"comma list of task corpora from {list(SOURCES)} (cpp,transformers,sympy [cpp,sympy])",
    )
    add("--target-shape", default=None, help="8b (default on GPU) or trained")
    add("--k", type=int, default=None, help="num_draft_tokens (6 [4])")
    add("--gen-tokens", type=int, default=None, help="new tokens per request (128 [12])")
    add("--prompt-len", type=int, default=None, help="prompt tokens (128 [32])")
    add("--concurrency", default=None, help="comma list (1,8,32 [1,4])")
    add("--c1-requests", type=int, default=None, help="requests per kind at concurrency 1 (3 [1])")
    add("--waves", type=int, default=None, help="requests per kind at concurrency c = waves x c (2 [1])")
    add("--train-target-s", type=float, default=None, help="seconds of small target training (60 [60, capped at 150 steps])")
    add(
        "--train-draft-s",
        type=float,
        default=None,
        help="seconds of STANDALONE draft distillation (80) or EAGLE head training (70) ([30, capped at 100 / 20 steps])",
    )
    add(
        "--eagle-cache-gib",
        type=float,
        default=None,
        help="--draft eagle: GiB of the target's features of the head's training windows computed once"
        " (bench/speculative's flag; 8 [0.002])",
    )
    add("--distill-count", type=int, default=None, help="target continuations for the draft (4096 [16])")
    add("--max-steps", default=None, help="TARGET,STANDALONE,EAGLE step caps (bench/speculative's flag; none [150,100,20])")
    add(
        "--train-adapter-s",
        type=float,
        default=None,
        help="seconds per task adapter (15 [10, capped at 20 steps])",
    )
    add("--adapter-max-steps", type=int, default=None, help="step cap per task adapter (none [20])")
    add("--adapter-rank", type=int, default=16, help="rank of the task adapters")
    add("--adapter-lr", type=float, default=None, help="task adapters' peak learning rate (1e-3 [1e-2])")
    add("--draft-adapter-rank", type=int, default=16, help="rank of the draft adapters")
    add(
        "--draft-adapter-steps",
        type=int,
        default=None,
        help="distillation steps per draft adapter (600 [12])",
    )
    add("--draft-adapter-batch", type=int, default=None, help="distillation sequences per step (8 [4])")
    add("--draft-adapter-seq", type=int, default=None, help="distillation sequence length (512 [64])")
    add("--draft-adapter-lr", type=float, default=None, help="distillation peak learning rate (1e-3 [3e-3])")
    add(
        "--answers",
        type=int,
        default=None,
        help="adapted target's answers per draft adapter's corpus (1024 [8])",
    )
    add("--answer-tokens", type=int, default=None, help="new tokens per answer (128 [16])")
    add(
        "--distill-corpus-mb",
        type=float,
        default=None,
        help="corpus text per draft adapter's distillation (1 [0.1])",
    )
    add("--corpus-mb", type=float, default=None, help="text per task corpus trained on (6 [0.25])")
    add(
        "--deadline-s",
        type=float,
        default=None,
        help="seconds from the start after which no further concurrency level starts (520 [none])",
    )
    add("--no-loss-tolerance", type=float, default=0.02, help="the no-loss target's allowance for noise")
    add(
        "--mixed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time one workload of every kind in the same batches at each level (default on)",
    )
    add("--attention-backend", default="auto", choices=("auto", "sdpa", "triton"))
    return ap


SMOKE_MAX_STEPS = "150,100,20"  # TARGET,STANDALONE,EAGLE: about 4, 2 and 2 s on an idle 2-core CPU


def parse(argv: list[str] | None = None) -> Settings:
    """The command line ``argv`` (``sys.argv[1:]`` when None) with the defaults filled in."""
    args = build_parser().parse_args(argv)
    smoke = args.smoke
    chosen = args.adapters or ("cpp,sympy" if smoke else "cpp,transformers,sympy")
    adapters = [a.strip() for a in chosen.split(",") if a.strip()]
    if (
        not adapters
        or len(adapters) > 4
        or set(adapters) - set(SOURCES)
        or len(set(adapters)) != len(adapters)
    ):
        raise SystemExit(f"--adapters {chosen!r}: one to four distinct corpora of {list(SOURCES)}")

    def pick(value, gpu, cpu):
        return value if value is not None else (cpu if smoke else gpu)

    # The EAGLE head trains 70 s (bench/speculative's H100 runs: 90-100 s): its feature cache
    # and its serving (an 8B-wide head, a check runner) take the rest of a ~8-minute run.
    # --smoke trains to step caps inside generous time budgets: what it trains, and so whether
    # each task adapter measurably moves the target, is the same on an idle and a busy machine.
    spec_argv = [
        "--draft", args.draft, "--attention-backend", args.attention_backend,
        "--train-target-s", str(pick(args.train_target_s, 60, 60)),
        "--train-draft-s", str(pick(args.train_draft_s, 70 if args.draft == "eagle" else 80, 30)),
        "--distill-count", str(pick(args.distill_count, 4096, 16)),
        "--k", str(pick(args.k, 6, 4)),
        "--gen-tokens", str(pick(args.gen_tokens, 128, 12)),
        "--prompt-len", str(pick(args.prompt_len, 128, 32)),
        "--concurrency", pick(args.concurrency, "1,8,32", "1,4"),
        "--c1-requests", str(pick(args.c1_requests, 3, 1)),
        "--waves", str(pick(args.waves, 2, 1)),
    ]  # fmt: skip
    spec_argv += ["--smoke"] if smoke else []
    if args.draft == "eagle":  # 8 GiB of features took 4 s on an H100; a smoke run's head trains ~20 steps
        spec_argv += ["--eagle-cache-gib", str(pick(args.eagle_cache_gib, 8.0, 0.002))]
    spec_argv += ["--target-shape", args.target_shape] if args.target_shape else []
    max_steps = pick(args.max_steps, None, SMOKE_MAX_STEPS)
    spec_argv += ["--max-steps", max_steps] if max_steps else []
    spec = spec_cli.parse(spec_argv)
    adapter_training = AdapterTraining(
        seconds=pick(args.train_adapter_s, 15.0, 10.0), rank=args.adapter_rank, lr=pick(args.adapter_lr, 1e-3, 1e-2),
        seq=spec.seq, batch=8 if smoke else 16, max_steps=pick(args.adapter_max_steps, None, 20), eval_windows=8 if smoke else 32,
        answers=AnswerSettings(pick(args.answers, 1024, 8), 16 if smoke else 64, pick(args.answer_tokens, 128, 16)),
    )  # fmt: skip
    draft_training = DraftAdapterTraining(
        rank=args.draft_adapter_rank, steps=pick(args.draft_adapter_steps, 600, 12),
        batch=pick(args.draft_adapter_batch, 8, 4), seq=pick(args.draft_adapter_seq, 512, 64),
        lr=pick(args.draft_adapter_lr, 1e-3, 3e-3), eval_sequences=8 if smoke else 64,
    )  # fmt: skip
    corpus_mb = pick(args.corpus_mb, 6.0, 0.25)
    return Settings(
        spec=spec, args=args, argv=argv, draft=args.draft, adapters=adapters, adapter_training=adapter_training,
        draft_training=draft_training, train_bytes=int(corpus_mb * 1e6), held_bytes=int(corpus_mb * 1e6 / 15),
        distill_bytes=int(pick(args.distill_corpus_mb, 1.0, 0.1) * 1e6),
        deadline_s=pick(args.deadline_s, 520.0, float("inf")),
    )  # fmt: skip
