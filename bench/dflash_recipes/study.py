"""The study from start to end: corpus, target and teacher once, then one draft per recipe."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from loraserve.runtime.dev.devmodels import write_tokenizer
from loraserve.runtime.tools.distill.dflash_recipe import Recipe
from loraserve.runtime.tools.distill.dflash_train import heldout_windows

from ..harness import log, write_report
from ..speculative.distillation import TeacherData, teacher_continuations
from ..speculative.models import load_corpus, train_dflash_draft, train_target
from . import cli
from .report import report


def main(argv: list[str] | None = None) -> int:
    """Run the study on ``argv``: every recipe's draft trained and walked, the report printed."""
    s = cli.parse(argv)
    with tempfile.TemporaryDirectory(prefix="dflash-recipes-") as work:
        print(_study(s, Path(work)))
    return 0


def _study(s: cli.Settings, work: Path) -> str:
    """Every recipe's draft over one target; returns the report (written as it grows)."""
    spec = s.spec
    started = time.monotonic()
    tok_dir = write_tokenizer(work / "tokenizer", spec.vocab)
    data, held_ids = load_corpus(spec, tok_dir)
    target, target_info = train_target(spec, data)
    teacher = teacher_continuations(spec.args, target, data, tok_dir, spec.device, smoke=spec.smoke,
                                    reach=spec.serving_reach, prompt_len=spec.prompt_len)  # fmt: skip
    record = {"setup": {"target": target_info, "teacher": teacher.info, "recipe_s": s.recipe_s,
                        "max_steps": s.max_steps, "heldout_count": s.heldout_count, "block": spec.dflash_block},
              "recipes": []}  # fmt: skip
    # one set of held-out continuations for every recipe: they depend on the target alone
    held = heldout_windows(target, held_ids, spec.device, seq=teacher.seq, count=s.heldout_count)
    for recipe in s.recipes:
        info = train_recipe(s, recipe, target, data, held_ids, teacher, held)
        record["recipes"].append({"recipe": recipe.label(), **info})
        _write(s, record)  # each recipe's result survives a run cut short
    record["setup"]["seconds"] = round(time.monotonic() - started, 1)
    return _write(s, record)


def train_recipe(
    s: cli.Settings, recipe: Recipe, target, data: torch.Tensor, held_ids: torch.Tensor, teacher: TeacherData,
    held: torch.Tensor | None = None,
) -> dict:
    """``recipe``'s draft trained over ``target`` for ``s.recipe_s`` (rounded to what is
    served), with its held-out agreement and walk (over ``held``, the study's shared
    continuations, when given)."""
    spec = s.spec
    draft, info = train_dflash_draft(
        spec, recipe, target, data, held_ids, teacher,
        seconds=s.recipe_s, max_steps=s.max_steps, heldout_count=s.heldout_count, held_windows=held,
        compile=spec.args.dflash_compile,
    )  # fmt: skip
    info["teacher_windows"] = recipe.teacher_windows(teacher.data).shape[0]
    log(f"recipe {recipe.label()}: {info}")
    del draft
    if spec.device.type == "cuda":
        torch.cuda.empty_cache()
    return info


def _write(s: cli.Settings, record: dict) -> str:
    """The report of ``record`` so far, written to ``--out`` (and its JSON) when given."""
    text = report(record, s.spec)
    write_report(text, record, out=s.out, json_to=s.json, name="dflash_recipes")
    return text
