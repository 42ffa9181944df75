"""The study from start to end: corpus, target and teacher once, then one draft per recipe."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from loraserve.runtime.dev.devmodels import write_tokenizer

from ..speculative.dflash_training import DFlashTraining, dflash_heldout, train_dflash
from ..speculative.distillation import TeacherData, teacher_continuations
from ..speculative.log import log
from ..speculative.models import dflash_layer_ids, load_corpus, train_target
from . import cli
from .recipes import Recipe
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
    teacher = teacher_continuations(spec.args, target, data, tok_dir, spec.device, smoke=spec.smoke, k=spec.k,
                                    prompt_len=spec.prompt_len, gen_tokens=spec.gen_tokens)  # fmt: skip
    record = {"setup": {"target": target_info, "teacher": teacher.info, "recipe_s": s.recipe_s,
                        "max_steps": s.max_steps, "heldout_count": s.heldout_count, "block": spec.dflash_block},
              "recipes": []}  # fmt: skip
    for recipe in s.recipes:
        info = train_recipe(s, recipe, target, data, held_ids, teacher)
        record["recipes"].append({"recipe": recipe.label(), **info})
        _write(s, record)  # each recipe's result survives a run cut short
    record["setup"]["seconds"] = round(time.monotonic() - started, 1)
    return _write(s, record)


def train_recipe(
    s: cli.Settings, recipe: Recipe, target, data: torch.Tensor, held_ids: torch.Tensor, teacher: TeacherData
) -> dict:
    """``recipe``'s draft trained over ``target`` for ``s.recipe_s`` (rounded to what is
    served), with its held-out agreement and walk."""
    spec = s.spec
    opts = DFlashTraining(
        seconds=s.recipe_s, seq=teacher.seq, batch=spec.batch, lr=recipe.lr, block=spec.dflash_block,
        layer_ids=dflash_layer_ids(target.config.num_hidden_layers, recipe.layers, recipe.ids),
        num_layers=recipe.layers, blocks=recipe.blocks, decay=recipe.decay, weight_decay=recipe.wd, init=recipe.init,
        teacher_fraction=teacher.fraction, max_steps=s.max_steps,
    )  # fmt: skip
    teacher_data = teacher.data[: recipe.teacher] if recipe.teacher is not None else teacher.data
    draft, info = train_dflash(target, spec.small_shape, data, teacher_data, spec.device, opts)
    draft.round_to_bf16()
    info["teacher_windows"] = teacher_data.shape[0]
    info.update(dflash_heldout(draft, target, held_ids, spec.device, seq=teacher.seq, count=s.heldout_count))
    log(f"recipe {recipe.label()}: {info}")
    del draft
    if spec.device.type == "cuda":
        torch.cuda.empty_cache()
    return info


def _write(s: cli.Settings, record: dict) -> str:
    """The report of ``record`` so far, written to ``--out`` (and its JSON) when given."""
    text = report(record, s.spec)
    if s.out:
        Path(s.out).write_text(text)
    json_path = s.json or (str(Path(s.out).with_suffix(".json")) if s.out else None)
    if json_path:
        Path(json_path).write_text(json.dumps(record, indent=1))
    return text
