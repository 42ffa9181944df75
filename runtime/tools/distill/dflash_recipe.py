"""The DFLASH draft's training recipe: one model of its knobs, written two ways.

``bench/dflash_recipes`` writes a recipe as text (``layers=3,ids=top,teacher=24576``); this
benchmark's command line writes the same knobs as ``--dflash-*`` flags (:data:`FLAGS`).
Both become a :class:`Recipe` checked by :func:`check_recipe`, and
``models.train_dflash_draft`` turns a recipe into a trained, walked draft.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from .dflash_train import DFlashTraining

SPREADS = ("reference", "top")  # models.dflash_layer_ids' spreads of the target layers read
INITS = ("random", "target")
ANCHOR_FROM = ("window", "continuation")
TEACHER_OUTPUTS = ("cache", "stream")


MIN_WINDOW = 8  # the shortest training window a draft is given (--distill-seq, a recipe's seq=)


@dataclass(frozen=True)
class Recipe:
    """How one DFLASH draft trains; the block, batch and time are the run's."""

    layers: int = 3  # draft layers (as many target layers feed it, as far as the target has them)
    ids: str = "reference"  # the target layers it reads: models.dflash_layer_ids' spread
    teacher: int | None = None  # teacher windows trained on (the first ones; None: all generated)
    lr: float = 1e-3
    # the trainer's defaults (DFlashTraining's)
    wd: float = DFlashTraining.weight_decay  # AdamW weight decay on the matrices
    blocks: int = DFlashTraining.blocks  # anchors per training window
    decay: float = DFlashTraining.decay  # block position weights exp(-(j - 1) / decay)
    init: str = DFlashTraining.init  # or "target": the draft's layers start as the target's top layers
    share: float | None = None  # teacher windows' share of each batch (None: the run's teacher fraction)
    anchor_from: str = DFlashTraining.anchor_from  # or "continuation": teacher blocks after the prompt only
    outputs: str = DFlashTraining.teacher_outputs  # or "stream": teacher windows' target outputs per step
    seq: int | None = (
        None  # training windows of this many tokens, at most the teacher's (None: the teacher's)
    )

    def label(self) -> str:
        """The recipe as given (only what differs from the defaults), e.g. ``layers=3,ids=top``."""
        default = Recipe()
        parts = [
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        ]
        return ",".join(parts) or "defaults"

    def teacher_windows(self, windows: torch.Tensor) -> torch.Tensor:
        """The teacher windows this recipe trains on: the first ``teacher`` of ``windows``, or all."""
        return windows[: self.teacher] if self.teacher is not None else windows


@dataclass(frozen=True)
class _Rule:
    """One field's type as a recipe's text parses it, and the values it takes."""

    kind: type
    ok: Callable[[Any], bool]
    wants: str  # what the error says the value must be


# Every field's rule, in one place: the recipe text and the command line both check by it.
RULES: dict[str, _Rule] = {
    "layers": _Rule(int, lambda v: v >= 1, "at least 1"),
    "ids": _Rule(str, lambda v: v in SPREADS, f"one of {list(SPREADS)}"),
    "teacher": _Rule(int, lambda v: v is None or v >= 1, "at least 1 window"),
    "lr": _Rule(float, lambda v: v > 0, "positive (a learning rate of 0 trains nothing)"),
    "wd": _Rule(float, lambda v: v >= 0, "0 or more (a negative weight decay grows the weights)"),
    "blocks": _Rule(int, lambda v: v >= 1, "at least 1 anchor per window"),
    "decay": _Rule(float, lambda v: v > 0, "positive (block position j weighs exp(-(j - 1) / decay))"),
    "init": _Rule(str, lambda v: v in INITS, f"one of {list(INITS)}"),
    "share": _Rule(float, lambda v: v is None or 0 < v <= 1, "above 0 and at most 1 (a share of each batch)"),
    "anchor_from": _Rule(str, lambda v: v in ANCHOR_FROM, f"one of {list(ANCHOR_FROM)}"),
    "outputs": _Rule(str, lambda v: v in TEACHER_OUTPUTS, f"one of {list(TEACHER_OUTPUTS)}"),
    "seq": _Rule(
        int, lambda v: v is None or v >= MIN_WINDOW, f"at least {MIN_WINDOW} tokens (a training window)"
    ),
}
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a word"}


def check_recipe(recipe: Recipe, name: Callable[[str], str] = str) -> None:
    """Raise ValueError for the first field outside its rule, naming it as ``name(field)``
    spells it (the recipe's key, or a flag) and saying what it takes."""
    for field, rule in RULES.items():
        value = getattr(recipe, field)
        if not rule.ok(value):
            raise ValueError(f"{name(field)} must be {rule.wants}, got {value!r}")


def parse_recipe(text: str) -> Recipe:
    """One recipe from ``key=value`` pairs separated by commas; a ValueError quoting ``text``
    and naming the key for a wrong one."""
    recipe = Recipe()
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in RULES:
            raise ValueError(f"recipe {text!r}: {part!r} is not KEY=VALUE with KEY one of {sorted(RULES)}")
        kind = RULES[key].kind
        try:
            parsed = kind(value)
        except ValueError:
            raise ValueError(f"recipe {text!r}: {key} must be {_TYPE_NAMES[kind]}, got {value!r}") from None
        recipe = replace(recipe, **{key: parsed})
    try:
        check_recipe(recipe)
    except ValueError as err:
        raise ValueError(f"recipe {text!r}: {err}") from None
    return recipe


# --- bench/speculative's command line -------------------------------------------------------

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
