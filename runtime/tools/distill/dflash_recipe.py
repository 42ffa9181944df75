"""The DFLASH draft's training recipe: one model of its knobs, written two ways.

A recipe is written as text (``layers=3,ids=top,teacher=24576``, :func:`parse_recipe`) or as
a command line's flags; both become a :class:`Recipe` checked by :func:`check_recipe`, which
names a bad field as its caller spells it.
"""

from __future__ import annotations

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
