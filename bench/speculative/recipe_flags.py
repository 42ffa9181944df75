"""The ``--dflash-*`` flags of ``bench/speculative``: the DFLASH recipe's fields as flags."""

from __future__ import annotations

import argparse

from loraserve.runtime.tools.distill.dflash_recipe import (
    ANCHOR_FROM,
    INITS,
    SPREADS,
    TEACHER_OUTPUTS,
    Recipe,
    check_recipe,
)

# The flag of each field; ``teacher`` has none (this benchmark's draft trains on every teacher
# window its --distill-count makes).
FLAGS = {
    "layers": "--dflash-layers",
    "ids": "--dflash-target-layers",
    "lr": "--dflash-lr",
    "wd": "--dflash-weight-decay",
    "blocks": "--dflash-anchors",
    "decay": "--dflash-decay",
    "init": "--dflash-init",
    "share": "--dflash-teacher-share",
    "anchor_from": "--dflash-anchor-from",
    "outputs": "--dflash-teacher-outputs",
    "seq": "--dflash-seq",
}
# 5, as the reference's drafts of 8B targets: on a CPU toy target, five layers accepted 4.58
# drafts a block in the held-out serving walk against three's 4.35 at equal steps (a step of
# five costs ~1.5x on a GPU; with the output cache it makes more steps than run 2's three
# layers did). Recipe.layers stays 3: the recipe study's labels are written against it.
FLAG_LAYERS = 5
SMOKE_LR = 2e-3  # --smoke's few CPU steps: without --dflash-lr, twice Recipe.lr


def add_flags(ap: argparse.ArgumentParser) -> None:
    """The ``--dflash-*`` training flags, one per recipe field but ``teacher``."""
    ap.add_argument(
        FLAGS["layers"],
        type=int,
        default=FLAG_LAYERS,
        help=f"DFLASH: draft layers, each reading one target layer's output spread as the reference spreads"
        f" them (default {FLAG_LAYERS}, smoke too; one layer cannot both read its block's token and query"
        " the context)",
    )
    ap.add_argument(
        FLAGS["ids"],
        choices=SPREADS,
        default=Recipe.ids,
        help="DFLASH: the target layers the draft reads, spread over 1..L-3 as the reference spreads them"
        " (reference, the default) or over 1..L-2 (top: down to the deepest output a forward captures)",
    )
    ap.add_argument(
        FLAGS["lr"],
        type=float,
        default=None,
        help=f"DFLASH training: peak learning rate (default {Recipe.lr:g}, smoke {SMOKE_LR:g})",
    )
    ap.add_argument(
        FLAGS["blocks"],
        type=int,
        default=Recipe.blocks,
        help="DFLASH training: blocks (distinct anchors) per window",
    )
    ap.add_argument(
        FLAGS["decay"],
        type=float,
        default=Recipe.decay,
        help="DFLASH training: block position j's loss weight is exp(-(j - 1) / decay)",
    )
    ap.add_argument(
        FLAGS["init"],
        choices=INITS,
        default=Recipe.init,
        help="DFLASH training: the draft's layers start random, or as the target's top layers (target)",
    )
    ap.add_argument(
        FLAGS["wd"],
        type=float,
        default=Recipe.wd,
        help="DFLASH training: AdamW weight decay on its matrices",
    )
    ap.add_argument(
        FLAGS["share"],
        type=float,
        default=Recipe.share,
        help="DFLASH training: the teacher windows' share of each batch (default: --teacher-fraction's)",
    )
    ap.add_argument(
        FLAGS["anchor_from"],
        choices=ANCHOR_FROM,
        default=Recipe.anchor_from,
        help="DFLASH training: a teacher window's blocks anywhere in it (window), or only where the block's"
        " first draft follows its prompt (continuation: positions 2.. are labelled only there)",
    )
    ap.add_argument(
        FLAGS["outputs"],
        choices=TEACHER_OUTPUTS,
        default=Recipe.outputs,
        help="DFLASH training: the teacher windows' target outputs in the output cache (cache: what the corpus"
        " leaves of it), or computed at each step (stream: every teacher window --distill-count makes is trained on)",
    )
    ap.add_argument(
        FLAGS["seq"],
        type=int,
        default=Recipe.seq,
        help="DFLASH training: windows of this many tokens, at most --distill-seq's (default: all of them, as"
        " long as a served request reads; the held-out walk reads that long whatever this is)",
    )


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    """The recipe :func:`add_flags`' flags give (``--dflash-lr`` defaulting by ``--smoke``);
    a ValueError naming the flag when one is outside its rule."""
    knobs = {field: getattr(args, _dest(flag)) for field, flag in FLAGS.items()}
    if knobs["lr"] is None:
        knobs["lr"] = SMOKE_LR if args.smoke else Recipe.lr
    recipe = Recipe(**knobs)
    check_recipe(recipe, lambda field: FLAGS.get(field, field))
    return recipe
