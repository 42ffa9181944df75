"""``bench/dflash_recipes``: the ``--recipes`` list (one recipe's text is tested with the
recipe, in ``test_spec_dflash_recipe``), the target layers a recipe's ``ids`` picks, the
study's command line, AdamW's weight decay on the draft's matrices only, and the ``--smoke``
study end to end (one draft per recipe, each judged by the held-out serving walk, over one
trained target and one set of teacher continuations)."""

from __future__ import annotations

import itertools
import json
import runpy
import tempfile
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
runpy.run_path(str(BENCH / "bootstrap.py"))["import_package"](BENCH / "dflash_recipes")

from bench.dflash_recipes import cli, study  # noqa: E402
from bench.dflash_recipes.cli import parse_recipes  # noqa: E402
from bench.speculative.dflash_recipe import Recipe  # noqa: E402
from bench.speculative.dflash_training import DFlashTraining, train_dflash  # noqa: E402
from bench.speculative.models import dflash_layer_ids  # noqa: E402
from bench.speculative.settings import TARGET_STEPS  # noqa: E402
from bench.speculative.training import lr_scale  # noqa: E402
from loraserve.runtime.speculative.dflash_format import check_target_layer_ids  # noqa: E402

# --- --recipes -----------------------------------------------------------------------------


def test_recipes_are_a_semicolon_list_of_distinct_recipes():
    """``--recipes``: recipes separated by ``;`` (empty parts skipped); none at all, or the
    same recipe twice (even written differently), is an error."""
    assert parse_recipes("layers=3;layers=3,ids=top; ;layers=5,ids=top,teacher=8") == [
        Recipe(layers=3),
        Recipe(layers=3, ids="top"),
        Recipe(layers=5, ids="top", teacher=8),
    ]
    for empty in ("", " ; ;"):
        with pytest.raises(ValueError, match="names no recipe"):
            parse_recipes(empty)
    with pytest.raises(ValueError, match="repeats a recipe"):
        parse_recipes("layers=3,ids=top;ids=top,layers=3")
    with pytest.raises(ValueError, match="repeats a recipe"):
        parse_recipes("layers=3;layers=3,ids=reference")  # ids=reference is the default


# --- the target layers a draft reads --------------------------------------------------------


def test_layer_ids_of_an_eight_layer_target():
    """The small target's 8 layers: the reference spreads over ``1 .. L-3``, ``top`` over
    ``1 .. L-2`` (one draft layer: the deepest captured one); a target under 4 layers gives
    layer 0 alone; an unknown spread is refused by name."""
    assert dflash_layer_ids(8, 3, "reference") == [1, 3, 5]
    assert dflash_layer_ids(8, 3) == [1, 3, 5]  # reference by default
    assert dflash_layer_ids(8, 3, "top") == [1, 4, 6]  # 1 .. L-2: the deepest output a forward captures
    assert dflash_layer_ids(8, 5, "top") == [1, 2, 4, 5, 6]
    assert dflash_layer_ids(8, 1, "top") == [6]
    for spread in ("reference", "top"):
        assert dflash_layer_ids(3, 2, spread) == [0]
        assert dflash_layer_ids(2, 1, spread) == [0]
    with pytest.raises(ValueError, match="'middle'"):
        dflash_layer_ids(8, 3, "middle")


@pytest.mark.parametrize("num_target", [4, 5, 8, 12, 36])
def test_layer_ids_are_as_many_distinct_sorted_layers_as_the_draft_has(num_target):
    """Where the range holds enough layers, each draft layer reads its own target layer, in
    order, inside the target; ``top`` always reads layer ``L-2`` (and layer 1 with more than
    one draft layer), the reference never reads past ``L-3``; neither names a layer whose
    output a forward does not capture."""
    for n in range(1, num_target - 1):
        ids = dflash_layer_ids(num_target, n, "top")
        assert ids == sorted(set(ids)) and len(ids) == n, (num_target, n, ids)
        assert ids[-1] == num_target - 2 and (n == 1 or ids[0] == 1)
    for n, spread in itertools.product(range(1, num_target + 2), ("reference", "top")):
        # every spread names only layers whose outputs a forward captures (the runtime's rule)
        check_target_layer_ids(dflash_layer_ids(num_target, n, spread), num_target)
    for n in range(2, num_target - 2):
        ids = dflash_layer_ids(num_target, n, "reference")
        assert ids == sorted(set(ids)) and len(ids) == n, (num_target, n, ids)
        assert ids[0] == 1 and ids[-1] == num_target - 3


# --- the command line --------------------------------------------------------------------------


def test_smoke_gives_the_smoke_recipes_and_step_caps():
    """``--smoke``: the smoke recipes, each draft capped at SMOKE_STEPS, and
    ``bench/speculative``'s smoke settings with the target capped at SMOKE_TARGET_STEPS."""
    s = cli.parse(["--smoke"])
    assert s.recipes == parse_recipes(cli.SMOKE_RECIPES)
    assert s.max_steps == cli.SMOKE_STEPS
    assert s.spec.smoke and s.spec.device.type == "cpu" and s.spec.drafts == ["dflash"]
    assert s.spec.max_steps[0] == cli.SMOKE_TARGET_STEPS
    assert s.spec.args.distill_count == 32  # no recipe names its teacher windows
    assert s.heldout_count == 8 and s.out is None
    full = cli.parse([])
    assert full.recipes == parse_recipes(cli.DEFAULT_RECIPES) and full.max_steps is None
    # the default recipes name 24,576 teacher windows at most: that many are made
    assert full.spec.max_steps[0] == TARGET_STEPS and full.spec.args.distill_count == 24576
    assert cli.parse(["--target-steps", "1000"]).spec.max_steps[0] == 1000
    assert full.spec.small_shape == "small" and full.recipe_s == 55.0
    long = cli.parse(["--smoke", "--distill-seq", "192", "--target-seq", "192"])
    assert (long.spec.args.distill_seq, long.spec.seq, s.spec.args.distill_seq, s.spec.seq) == (192, 192, None, 64)
    for bad in (["--target-seq", "0"], ["--distill-seq", "0"], ["--distill-seq", "4"]):
        with pytest.raises(SystemExit):
            cli.parse(["--smoke", *bad])
    deep = cli.parse(["--smoke", "--shape", "cpu-deep", "--target-steps", "40"])
    assert deep.spec.small_shape == "cpu-deep" and deep.spec.max_steps[0] == 40
    # --compile is bench/speculative's --dflash-compile, which the study hands each draft's training
    assert cli.parse(["--smoke", "--compile"]).spec.args.dflash_compile and not s.spec.args.dflash_compile


def test_distill_count_covers_every_recipes_teacher_windows(capsys):
    """Without ``--distill-count`` the teacher continuations are the default count, or a
    recipe's larger ``teacher`` (a smaller one takes the first windows and leaves the other
    recipes all of them); a ``--distill-count`` below a recipe's ``teacher`` is an argparse error that
    names the option."""
    s = cli.parse(["--smoke", "--recipes", "layers=2,teacher=20;layers=3,teacher=48;layers=4"])
    assert s.spec.args.distill_count == 48
    small = cli.parse(["--smoke", "--recipes", "layers=2;layers=2,teacher=8"])
    assert small.spec.args.distill_count == cli.SMOKE_TEACHER
    with pytest.raises(SystemExit):
        cli.parse(["--smoke", "--heldout-count", "0"])
    given = cli.parse(["--smoke", "--recipes", "layers=2,teacher=20", "--distill-count", "64"])
    assert given.spec.args.distill_count == 64
    with pytest.raises(SystemExit) as exit_:
        cli.parse(["--smoke", "--recipes", "layers=2;layers=2,teacher=64", "--distill-count", "32"])
    assert exit_.value.code == 2
    assert "--distill-count" in capsys.readouterr().err


def test_a_wrong_recipe_on_the_command_line_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.parse(["--smoke", "--recipes", "layers=2,ids=middle"])
    assert exit_.value.code == 2
    assert "ids must be one of" in capsys.readouterr().err


# --- weight decay --------------------------------------------------------------------------


def _draft_params(target, seconds: float, weight_decay: float, lr: float) -> dict[str, torch.Tensor]:
    data = torch.randint(0, 64, (3000,), generator=torch.Generator().manual_seed(4))
    teacher = torch.randint(0, 64, (12, 17), generator=torch.Generator().manual_seed(5))
    opts = DFlashTraining(seconds=seconds, seq=16, batch=4, lr=lr, block=4, layer_ids=[0], num_layers=2,
                          blocks=6, weight_decay=weight_decay, max_steps=1, cache_gib=0.0)  # fmt: skip
    draft, info = train_dflash(target, "smoke-small", data, teacher, torch.device("cpu"), opts)
    assert info["steps"] == (1 if seconds else 0) and info["weight_decay"] == weight_decay
    return {name: p.detach().clone() for name, p in draft.named_parameters()}


def test_weight_decay_shrinks_the_matrices_and_not_the_norm_weights(target):
    """One AdamW step from the same (seeded) initial draft, so the same gradient, with and
    without weight decay: every matrix differs by exactly the decoupled decay ``lr * wd *
    initial weight``; every norm weight (1-D) is identical, though the step moved it."""
    lr, wd = 1e-2, 10.0
    initial = _draft_params(target, 0, 0.0, lr)  # no step: the seeded initialisation
    plain = _draft_params(target, 600, 0.0, lr)
    decayed = _draft_params(target, 600, wd, lr)
    step_lr = lr * lr_scale(0, 0.0)  # the first step's warm-up learning rate
    norms = [name for name, p in initial.items() if p.dim() == 1]
    matrices = [name for name, p in initial.items() if p.dim() == 2]
    assert {"norm", "hidden_norm", "layers.0.input_layernorm", "layers.1.k_norm"} <= set(norms)
    assert "fc.weight" in matrices and "layers.1.down_proj.weight" in matrices
    assert len(norms) + len(matrices) == len(initial)
    for name in norms:
        assert not torch.equal(plain[name], initial[name]), name  # trained ...
        assert torch.equal(decayed[name], plain[name]), name  # ... and not decayed
    for name in matrices:
        assert not torch.equal(decayed[name], plain[name]), name
        torch.testing.assert_close(
            decayed[name] - plain[name], -step_lr * wd * initial[name], rtol=1e-3, atol=1e-7
        )


# --- the study end to end ---------------------------------------------------------------------


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


def test_a_recipes_teacher_takes_the_first_teacher_windows(tmp_path, monkeypatch):
    """``teacher=8`` trains that draft on 8 of the continuations; a recipe without ``teacher``
    trains on every one generated (``--distill-count``). The run's scratch files go with it.
    The held-out continuations are generated once for the whole study, not once per recipe."""
    from bench.speculative import training

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    made = []
    real = training.teacher_sequences
    monkeypatch.setattr(training, "teacher_sequences", lambda *a, **k: made.append(k["count"]) or real(*a, **k))
    record, text = _run(
        tmp_path, "--recipes", "layers=2;layers=2,teacher=8", "--distill-count", "16", "--heldout-count", "5"
    )
    assert made.count(5) == 1 and all(r["heldout_walk_mean"] >= 0 for r in record["recipes"])
    assert not list(scratch.glob("dflash-recipes-*"))
    assert record["setup"]["teacher"]["teacher_sequences"][0] == 16
    assert [(r["recipe"], r["teacher_windows"]) for r in record["recipes"]] == [
        ("layers=2", 16),
        ("layers=2,teacher=8", 8),
    ]
    assert [row[3] for row in _rows(text)] == ["16 (uncached)", "8 (uncached)"]
