"""What a run does: the command line checked, and the defaults ``--smoke`` picks."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from loraserve.runtime.tools.distill.dflash_recipe import Recipe

DRAFTS = ("standalone", "eagle", "dflash")


def parse_drafts(value: str) -> list[str]:
    """``--draft``: a comma list of ``standalone``, ``eagle`` and ``dflash``, each at most once."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in DRAFTS]
    if not names or bad or len(set(names)) != len(names):
        raise SystemExit(
            f"--draft {value!r}: give a comma list of distinct drafts from {list(DRAFTS)}, e.g. --draft standalone,eagle"
        )
    return names


def parse_k_sweep(value: str) -> list[int]:
    """``--k-sweep 4,8``: the other verify widths to time at concurrency 1 (each >= 2)."""
    try:
        ks = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--k-sweep {value!r}: give a comma list of integers, e.g. 4,8,10") from None
    if any(k < 2 for k in ks):
        raise SystemExit(f"--k-sweep {value!r}: every width must be >= 2 (one draft token at least)")
    return ks


TARGET_STEPS = 690
"""The target's step cap when ``--max-steps`` is not given (not in a smoke): what an H100
makes in the 60 s budget. Trained for time alone, a faster GPU memorises the corpus (an
H200 made 820 steps to a loss of 0.80, `bench/results/2026-12-06-spec-dflash-h200-run7.md`),
and every draft then accepts less on held-out prompts; a step cap trains one target on any GPU."""


def parse_max_steps(value: str | None) -> tuple[int | None, int | None, int | None]:
    """``--max-steps TARGET,STANDALONE,EAGLE``: step caps (0 or empty: none); the third caps
    the DFLASH draft too."""
    if not value:
        return None, None, None
    parts = [p.strip() for p in value.split(",")]
    if len(parts) != 3 or not all(p.isdigit() for p in parts if p):
        raise SystemExit(
            f"--max-steps {value!r}: give three step counts TARGET,STANDALONE,EAGLE, e.g. 2000,1500,800"
        )
    caps = [int(p) if p else 0 for p in parts]
    return caps[0] or None, caps[1] or None, caps[2] or None


def parse_trees(value: str) -> list[tuple[int, int]]:
    """``--tree 2:10,4:16``: (top_k, num_draft_tokens) tree shapes, top_k >= 2."""
    shapes = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        try:
            top, tokens = (int(x) for x in part.split(":"))
        except ValueError:
            raise SystemExit(f"--tree {value!r}: give TOPK:TOKENS pairs, e.g. --tree 2:10") from None
        if top < 2 or tokens < 2:
            raise SystemExit(f"--tree {part!r}: TOPK must be >= 2 (1 is a chain) and TOKENS >= 2")
        shapes.append((top, tokens))
    return shapes


@dataclass
class Settings:
    """The command line's values, with the defaults of ``--smoke`` (CPU) or a GPU run filled in."""

    args: argparse.Namespace
    argv: list[str] | None  # as given to main (None: sys.argv[1:])
    smoke: bool
    device: torch.device
    drafts: list[str]
    k_sweep: list[int]
    trees: list[tuple[int, int]]
    max_steps: tuple[int | None, int | None, int | None]  # TARGET, STANDALONE, EAGLE
    k: int
    dflash_block: int  # the DFLASH draft's block: trained on and verified (num_draft_tokens)
    dflash_recipe: Recipe  # how the DFLASH draft trains (the --dflash-* flags)
    gen_tokens: int
    prompt_len: int
    concurrency: list[int]
    small_shape: str
    draft_shape: str
    target_shape: str
    train_target_s: float
    train_draft_s: float
    dflash_train_s: float  # the DFLASH draft's (--train-draft-s unless --dflash-train-s)
    vocab: int
    waves: int
    seq: int  # training sequence length of the target (and of a corpus-trained draft)
    batch: int

    @property
    def serving_reach(self) -> int:
        """The most tokens a served draft reads: a request's prompt, its generated tokens and
        the widest verify (k, the k sweep's, the DFLASH block). Drafts train on windows this long."""
        return self.prompt_len + self.gen_tokens + max(self.k, *self.k_sweep, self.dflash_block)


def settings_from(args: argparse.Namespace, argv: list[str] | None, dflash_recipe: Recipe) -> Settings:
    """Check the options that parse by hand (exiting with a message) and fill in the defaults;
    ``dflash_recipe`` is the ``--dflash-*`` flags' (``cli.parse`` checks it)."""
    if args.c1_requests < 1:
        raise SystemExit(f"--c1-requests {args.c1_requests}: give at least 1")
    drafts = parse_drafts(args.draft)
    sweep = parse_k_sweep(args.k_sweep)
    trees = parse_trees(args.tree)
    if trees and "eagle" not in drafts:
        raise SystemExit("--tree needs --draft eagle: trees are grown by the EAGLE head")
    smoke = args.smoke
    caps = parse_max_steps(args.max_steps)
    if args.max_steps is None and not smoke:
        caps = (TARGET_STEPS, *caps[1:])
    seq, batch = (64, 16) if smoke else (512, 48)
    draft_s = args.train_draft_s if args.train_draft_s is not None else (4 if smoke else 240)
    return Settings(
        args=args,
        argv=argv,
        smoke=smoke,
        device=torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda"),
        drafts=drafts,
        k_sweep=sweep,
        trees=trees,
        max_steps=caps,
        k=args.k or (4 if smoke else 6),
        dflash_block=args.dflash_block or (4 if smoke else 8),
        dflash_recipe=dflash_recipe,
        gen_tokens=args.gen_tokens or (24 if smoke else 192),
        prompt_len=args.prompt_len or (32 if smoke else 128),
        concurrency=[int(c) for c in (args.concurrency or ("1,2,4" if smoke else "1,8,32")).split(",")],
        small_shape="smoke-small" if smoke else "small",
        draft_shape="smoke-draft" if smoke else "draft",
        target_shape=args.target_shape or ("smoke-big" if smoke else "8b"),
        train_target_s=args.train_target_s if args.train_target_s is not None else (8 if smoke else 60),
        train_draft_s=draft_s,
        dflash_train_s=args.dflash_train_s if args.dflash_train_s is not None else draft_s,
        vocab=512 if smoke else 8192,
        waves=args.waves or (1 if smoke else 3),
        seq=seq,
        batch=batch,
    )
