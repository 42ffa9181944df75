"""The DFLASH training recipe (one model of the draft's training knobs, written as text or
as flags, one check for both), the target layers a recipe reads, the held-out walk that
judges a draft, and AdamW's weight decay on the draft's matrices only."""

from __future__ import annotations

import itertools
from dataclasses import fields

import pytest
import torch

from loraserve.runtime.speculative.dflash.format import check_target_layer_ids
from loraserve.runtime.tools.distill.dflash_draft import DFlashDraft
from loraserve.runtime.tools.distill.dflash_recipe import RULES, Recipe, check_recipe, parse_recipe
from loraserve.runtime.tools.distill.dflash_train import (
    DFlashTraining,
    dflash_heldout,
    dflash_layer_ids,
    heldout_data,
    train_dflash,
    walk_by_context,
)
from loraserve.runtime.tools.distill.eagle_head import LayerDims, RopeFrequencies
from loraserve.runtime.tools.distill.train import lr_scale


def test_a_recipe_parses_every_field():
    """Each ``key=value`` lands in its field with its type; unnamed fields keep their defaults."""
    r = parse_recipe(" layers=5, ids=top ,teacher=24576,lr=3e-4,wd=0.1,blocks=12,decay=2.5,init=target ")
    assert r == Recipe(
        layers=5, ids="top", teacher=24576, lr=3e-4, wd=0.1, blocks=12, decay=2.5, init="target"
    )
    assert isinstance(r.layers, int) and isinstance(r.teacher, int) and isinstance(r.lr, float)
    assert parse_recipe("layers=2") == Recipe(layers=2)
    assert parse_recipe("") == Recipe()


def test_knobs_default_to_trainer_defaults():
    """The knobs ``DFlashTraining`` has defaults for take them (one place for each)."""
    r = Recipe()
    assert (r.wd, r.blocks, r.decay, r.init) == (
        DFlashTraining.weight_decay,
        DFlashTraining.blocks,
        DFlashTraining.decay,
        DFlashTraining.init,
    )


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("layers=3,depth=2", "'depth=2' is not KEY=VALUE"),  # an unknown key
        ("layers=3,top", "'top' is not KEY=VALUE"),  # no '='
        ("ids=top,layers", "'layers' is not KEY=VALUE"),  # a known key without '='
        ("layers=three", "layers must be an integer"),
        ("teacher=1.5", "teacher must be an integer"),
        ("lr=fast", "lr must be a number"),
        ("ids=middle", "ids must be one of ['reference', 'top']"),
        ("init=copied", "init must be one of ['random', 'target']"),
        ("layers=0", "layers must be at least 1"),
        ("blocks=0", "blocks must be at least 1"),
        ("teacher=0", "teacher must be at least 1"),
        ("lr=0", "lr must be positive"),
        ("lr=-1e-3", "lr must be positive"),
        ("wd=-0.1", "wd must be 0 or more"),
        ("decay=0", "decay must be positive"),
        ("seq=4", "seq must be at least 8"),
    ],
)
def test_wrong_recipe_refused(text, named):
    """Every kind of bad recipe raises ValueError whose message quotes the recipe and names
    the offending key and what it takes (so the command line's error says what to fix)."""
    with pytest.raises(ValueError) as err:
        parse_recipe(text)
    assert named in str(err.value) and repr(text) in str(err.value)


def test_label_lists_only_differences():
    """The label (the report's row name) names the non-default fields in field order, and
    parses back to the same recipe; all defaults read ``defaults``."""
    assert Recipe().label() == "defaults"
    assert parse_recipe("ids=reference,lr=0.001,wd=0").label() == "defaults"
    r = parse_recipe("wd=0.1,teacher=24576,ids=top,layers=3")
    assert r.label() == "ids=top,teacher=24576,wd=0.1"
    assert parse_recipe(r.label()) == r
    assert Recipe(layers=2, lr=0.003).label() == "layers=2,lr=0.003"


def test_teacher_takes_first_windows():
    """A recipes teacher takes the first windows."""
    windows = torch.arange(20).view(10, 2)
    assert torch.equal(Recipe(teacher=3).teacher_windows(windows), windows[:3])
    assert Recipe().teacher_windows(windows) is windows


def test_every_field_has_one_rule():
    assert list(RULES) == [f.name for f in fields(Recipe)]


def test_check_names_caller_field():
    """``check_recipe`` passes a good recipe and names a bad field by the caller's spelling."""
    check_recipe(Recipe(wd=0.0, teacher=1))
    with pytest.raises(ValueError, match=r"^--dflash-lr must be positive .*got 0\.0$"):
        check_recipe(Recipe(lr=0.0), {"lr": "--dflash-lr"}.get)
    with pytest.raises(ValueError, match=r"^wd must be 0 or more .*got -1\.0$"):
        check_recipe(Recipe(wd=-1.0))


def test_heldout_refuses_mismatched_draft(target):
    """Held-out data is built for one draft's target layers and block; judging another draft
    on it would compare it with features it does not read, so it is refused by name."""

    held_ids = torch.randint(3, 64, (600,), generator=torch.Generator().manual_seed(1))
    held = heldout_data(target, held_ids, torch.device("cpu"), seq=16, count=2, block=4, layer_ids=[0])
    again = heldout_data(target, held_ids, torch.device("cpu"), seq=16, count=2, block=4, layer_ids=[0])
    assert torch.equal(held.window, again.window) and torch.equal(
        held.anchors, again.anchors
    )  # deterministic
    shared = heldout_data(target, held_ids, torch.device("cpu"), seq=16, count=2, block=4, layer_ids=[0],
                          windows=held.window)  # fmt: skip
    assert torch.equal(shared.feats, held.feats) and torch.equal(shared.anchors, held.anchors)
    with pytest.raises(ValueError, match=r"held-out windows must be \[2, 17\]"):
        heldout_data(target, held_ids, torch.device("cpu"), seq=16, count=2, block=4, layer_ids=[0],
                     windows=held.window[:, :10])  # fmt: skip
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight

    def draft(ids: list[int], block: int) -> DFlashDraft:
        return DFlashDraft(LayerDims.of(target.config), embed, head, layer_ids=ids, num_layers=1, block=block, mask_id=0,
                           eps=1e-5, rope=RopeFrequencies.of(target.config))  # fmt: skip

    ok = draft([0], 4)
    assert 0 <= dflash_heldout(ok, held)["heldout_walk_mean"] <= 3
    for bad in (draft([1], 4), draft([0], 5)):
        with pytest.raises(
            ValueError, match=r"heldout_data\(\.\.\., block=draft.block, layer_ids=draft.layer_ids\)"
        ):
            dflash_heldout(bad, held)


def test_walk_counts_steps_per_bucket():
    """Each walk step's accepted drafts land in the runtime bucket of the tokens before its block."""

    walk = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.float)
    contexts = torch.tensor([100, 127, 128, 300])
    assert walk_by_context(walk, contexts) == {"0-127": [1.5, 2], "128-255": [0.0, 1], "256-511": [3.0, 1]}


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
def test_layer_ids_distinct_sorted(num_target):
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


def _draft_params(target, seconds: float, weight_decay: float, lr: float) -> dict[str, torch.Tensor]:
    data = torch.randint(0, 64, (3000,), generator=torch.Generator().manual_seed(4))
    teacher = torch.randint(0, 64, (12, 17), generator=torch.Generator().manual_seed(5))
    opts = DFlashTraining(seconds=seconds, seq=16, batch=4, lr=lr, block=4, layer_ids=[0], num_layers=2,
                          blocks=6, weight_decay=weight_decay, max_steps=1, cache_gib=0.0)  # fmt: skip
    draft, info = train_dflash(target, data, teacher, torch.device("cpu"), opts)
    assert info["steps"] == (1 if seconds else 0) and info["weight_decay"] == weight_decay
    return {name: p.detach().clone() for name, p in draft.named_parameters()}


def test_weight_decay_skips_norms(target):
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
