"""``bench/dflash_recipes --smoke`` end to end: one draft per recipe, each judged by the
held-out serving walk, over one trained target and one set of teacher continuations."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
runpy.run_path(str(BENCH / "bootstrap.py"))["import_package"](BENCH / "dflash_recipes")

from bench.dflash_recipes import cli, study  # noqa: E402
from bench.dflash_recipes.cli import parse_recipes  # noqa: E402


def _run(tmp_path: Path, *argv: str) -> tuple[dict, str]:
    out = tmp_path / "r.md"
    assert study.main(["--smoke", "--out", str(out), *argv]) == 0
    return json.loads(out.with_suffix(".json").read_text()), out.read_text()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, str]:
    """``--smoke`` with its own recipes: the JSON record and the markdown."""
    return _run(tmp_path_factory.mktemp("smoke"))


def _rows(text: str) -> list[list[str]]:
    """The markdown table's rows (below its header), split into cells, each row as wide as
    the header."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|---")) + 1
    header, *rows = (
        [c.strip() for c in line.strip("|").split("|")] for line in lines[start - 2 :] if line.startswith("|")
    )
    assert header[0] == "recipe" and all(len(row) == len(header) for row in rows), text
    return rows[1:]  # below the |---| line


def test_the_smoke_study_trains_and_walks_one_draft_per_recipe(smoke):
    """One draft per smoke recipe, in order, each trained SMOKE_STEPS steps with its own
    learning rate on every teacher continuation generated, and judged by the held-out walk
    (accepted drafts per block, between 0 and the block's drafts); the markdown has one row
    per recipe, named by its label."""
    record, text = smoke
    labels = [r.label() for r in parse_recipes(cli.SMOKE_RECIPES)]
    generated = record["setup"]["teacher"]["teacher_sequences"][0]
    assert generated == 32
    assert [r["recipe"] for r in record["recipes"]] == labels
    assert record["setup"]["max_steps"] == cli.SMOKE_STEPS and "seconds" in record["setup"]
    for r, recipe in zip(record["recipes"], parse_recipes(cli.SMOKE_RECIPES), strict=True):
        assert r["steps"] == cli.SMOKE_STEPS
        assert r["lr"] == recipe.lr and r["layers"] == recipe.layers and r["weight_decay"] == recipe.wd
        assert r["teacher_windows"] == generated
        assert r["max_leading"] == record["setup"]["block"] - 1 == 3
        assert isinstance(r["heldout_walk_mean"], float) and 0 <= r["heldout_walk_mean"] <= r["max_leading"]
        assert len(r["heldout_walk_accept"]) == len(r["heldout_top1"]) == r["max_leading"]
    rows = _rows(text)
    assert [row[0] for row in rows] == labels
    for row, r in zip(rows, record["recipes"], strict=True):
        assert row[4] == str(cli.SMOKE_STEPS)
        assert row[-1] == f"**{r['heldout_walk_mean']}** of {r['max_leading']}"
        by_context = r["heldout_walk_by_context"]
        assert row[-2] == ", ".join(f"{b} {m} ({n})" for b, (m, n) in by_context.items()) and by_context
