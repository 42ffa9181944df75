"""The command line: the recipes, their training time, and ``bench/speculative``'s settings
(corpus, target, teacher continuations, block) built from it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from loraserve.runtime.tools.distill.dflash_recipe import Recipe, parse_recipe

from ..speculative import cli as spec_cli
from ..speculative.settings import TARGET_STEPS
from ..speculative.settings import Settings as SpecSettings
from ..speculative.shapes import SHAPES

DESCRIPTION = (
    "DFLASH draft recipes: one draft per recipe over one trained target, judged by the held-out serving walk."
)

# Each question of the H100 runs 3-4 on one target: the target layers read, the teacher windows,
# the depth, the learning rate (bench/results/2026-12-06-dflash-recipes-cpu.md answered the
# anchors per window, the position decay and the init on the CPU's deep toy target: none
# helped). Five recipes of 55 s fit one 10-minute call on an H100 (about 8 minutes).
DEFAULT_RECIPES = (
    "layers=3,ids=reference,teacher=12288;layers=3,ids=top,teacher=12288;layers=3,ids=top,teacher=24576;"
    "layers=5,ids=top,teacher=24576;layers=3,ids=top,teacher=24576,lr=0.002"
)
SMOKE_RECIPES = "layers=2,ids=reference;layers=2,ids=top,lr=0.003"
TEACHER, SMOKE_TEACHER = 12288, 32  # teacher continuations without --distill-count
SMOKE_STEPS = 12  # per recipe: the smoke's training is step-capped, so its result does not depend on load
SMOKE_TARGET_STEPS = 150  # the smoke target's cap: ~4 s on an idle 2-core CPU


@dataclass
class Settings:
    """The study: ``bench/speculative``'s settings and the recipes."""

    spec: SpecSettings
    recipes: list[Recipe]
    recipe_s: float
    max_steps: int | None
    heldout_count: int
    out: str | None
    json: str | None


def parse_recipes(text: str) -> list[Recipe]:
    """``--recipes``: recipes separated by semicolons, at least one, no two the same."""
    recipes = [parse_recipe(part) for part in text.split(";") if part.strip()]
    if not recipes:
        raise ValueError("--recipes names no recipe: give e.g. 'layers=3,ids=reference;layers=3,ids=top'")
    labels = [r.label() for r in recipes]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--recipes repeats a recipe: {labels}")
    return recipes


def build_parser() -> argparse.ArgumentParser:
    """Every option, with the GPU default (``--smoke``'s in brackets)."""
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    add = ap.add_argument
    add("--smoke", action="store_true", help="CPU, tiny shapes, step-capped training")
    add("--out", default=None, help="markdown report (JSON beside it unless --json)")
    add("--json", default=None, help="JSON record of the run")
    add("--recipes", default=None, help=f"semicolon list of recipes ({DEFAULT_RECIPES} [{SMOKE_RECIPES}])")
    add("--recipe-s", type=float, default=None, help="seconds of training per recipe (55 [30, capped])")
    add("--max-steps", type=int, default=None, help=f"step cap per recipe (none [{SMOKE_STEPS}])")
    add("--train-target-s", type=float, default=None, help="seconds of small target training (60 [8])")
    add(
        "--distill-count",
        type=int,
        default=None,
        help="teacher continuations (12288 [32], or a recipe's larger teacher)",
    )
    add("--dflash-block", type=int, default=None, help="the block trained and walked (8 [4])")
    add(
        "--shape", choices=sorted(SHAPES), default=None, help="the small target's shape (small [smoke-small])"
    )
    add(
        "--target-steps", type=int, default=None, help=f"step cap of the target ({TARGET_STEPS} [{SMOKE_TARGET_STEPS}])"
    )
    add("--heldout-count", type=int, default=None, help="held-out continuations walked (32 [8])")
    add(
        "--distill-seq",
        type=int,
        default=None,
        help="teacher and held-out windows (a served request's reach rounded up to 64: 384 [64]); a recipe's"
        " seq= trains on shorter ones, walked this long",
    )
    add("--target-seq", type=int, default=None, help="the small target's training sequence length (512 [64])")
    add("--compile", action="store_true", help="each draft's training forward under torch.compile")
    return ap


def parse(argv: list[str] | None = None) -> Settings:
    """The command line ``argv``, checked, with defaults filled in."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        recipes = parse_recipes(args.recipes or (SMOKE_RECIPES if args.smoke else DEFAULT_RECIPES))
    except ValueError as err:
        ap.error(str(err))
    wanted = [r.teacher for r in recipes if r.teacher is not None]
    for flag in ("distill_count", "heldout_count", "max_steps", "target_steps", "distill_seq", "target_seq"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    # a recipe that names fewer teacher windows takes the first ones; the others take them all
    count = (
        args.distill_count
        if args.distill_count is not None
        else max([*wanted, SMOKE_TEACHER if args.smoke else TEACHER])
    )
    if wanted and max(wanted) > count:
        ap.error(f"a recipe trains on {max(wanted)} teacher windows, but --distill-count makes {count}")
    spec_argv = ["--draft", "dflash", "--distill-count", str(count)]
    target_steps = (
        args.target_steps if args.target_steps is not None else (SMOKE_TARGET_STEPS if args.smoke else TARGET_STEPS)
    )
    spec_argv += ["--max-steps", f"{target_steps},0,0"] + (["--smoke"] if args.smoke else [])
    spec_argv += ["--dflash-compile"] if args.compile else []
    for flag in ("train_target_s", "dflash_block", "distill_seq"):
        if getattr(args, flag) is not None:
            spec_argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    spec = spec_cli.parse(spec_argv)
    if args.shape:
        spec.small_shape = args.shape
    if args.target_seq:
        spec.seq = args.target_seq
    return Settings(
        spec=spec,
        recipes=recipes,
        recipe_s=args.recipe_s if args.recipe_s is not None else (30.0 if args.smoke else 55.0),
        max_steps=args.max_steps if args.max_steps is not None else (SMOKE_STEPS if args.smoke else None),
        heldout_count=args.heldout_count if args.heldout_count is not None else (8 if args.smoke else 32),
        out=args.out,
        json=args.json,
    )
