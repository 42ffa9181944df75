"""A DFLASH training recipe as the command line writes it: ``layers=3,ids=top,teacher=24576``."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..speculative.dflash_training import DFlashTraining

SPREADS = ("reference", "top")
INITS = ("random", "target")


@dataclass(frozen=True)
class Recipe:
    """What differs between the drafts of one study; the rest is ``bench/speculative``'s."""

    layers: int = 3  # draft layers (as many target layers feed it, as far as the target has them)
    ids: str = "reference"  # the target layers it reads: models.dflash_layer_ids' spread
    teacher: int | None = None  # teacher windows trained on (the first ones; None: all generated)
    lr: float = 1e-3
    # the trainer's defaults (DFlashTraining's, as bench/speculative's flags)
    wd: float = DFlashTraining.weight_decay  # AdamW weight decay on the matrices
    blocks: int = DFlashTraining.blocks  # anchors per training window
    decay: float = DFlashTraining.decay  # block position weights exp(-(j - 1) / decay)
    init: str = DFlashTraining.init  # or "target": the draft's layers start as the target's top layers

    def label(self) -> str:
        """The recipe as given (only what differs from the defaults), e.g. ``layers=3,ids=top``."""
        default = Recipe()
        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)]
        return ",".join(parts) or "defaults"


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a word"}
_TYPES = {"layers": int, "teacher": int, "blocks": int, "lr": float, "wd": float, "decay": float, "ids": str, "init": str}


def parse_recipe(text: str) -> Recipe:
    """One recipe from ``key=value`` pairs separated by commas; a clear error for a wrong one."""
    recipe = Recipe()
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in _TYPES:
            raise ValueError(f"recipe {text!r}: {part!r} is not KEY=VALUE with KEY one of {sorted(_TYPES)}")
        try:
            parsed = _TYPES[key](value)
        except ValueError:
            raise ValueError(f"recipe {text!r}: {key} must be {_TYPE_NAMES[_TYPES[key]]}, got {value!r}") from None
        recipe = replace(recipe, **{key: parsed})
    _check(text, recipe)
    return recipe


def _check(text: str, r: Recipe) -> None:
    if r.init not in INITS:
        raise ValueError(f"recipe {text!r}: init must be one of {list(INITS)}, got {r.init!r}")
    if r.ids not in SPREADS:
        raise ValueError(f"recipe {text!r}: ids must be one of {list(SPREADS)}, got {r.ids!r}")
    for name in ("layers", "blocks"):
        if getattr(r, name) < 1:
            raise ValueError(f"recipe {text!r}: {name} must be at least 1, got {getattr(r, name)}")
    if r.teacher is not None and r.teacher < 1:
        raise ValueError(f"recipe {text!r}: teacher must be at least 1 window, got {r.teacher}")
    if r.lr <= 0 or r.wd < 0 or r.decay <= 0:
        raise ValueError(f"recipe {text!r}: lr and decay must be positive and wd not negative")


def parse_recipes(text: str) -> list[Recipe]:
    """``--recipes``: recipes separated by semicolons, at least one, no two the same."""
    recipes = [parse_recipe(part) for part in text.split(";") if part.strip()]
    if not recipes:
        raise ValueError("--recipes names no recipe: give e.g. 'layers=3,ids=reference;layers=3,ids=top'")
    labels = [r.label() for r in recipes]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--recipes repeats a recipe: {labels}")
    return recipes
