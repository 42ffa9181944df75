"""``bench/speculative``'s DFLASH training recipe: the one model of the draft's training knobs,
as ``bench/dflash_recipes`` writes it (``layers=3,ids=top``) and as this benchmark's
``--dflash-*`` flags write it, one check for both, and the one function that trains and
walks a recipe's draft."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch

from bench.speculative import cli, models
from bench.speculative.dflash_recipe import (
    FLAGS,
    RULES,
    SMOKE_LR,
    Recipe,
    check_recipe,
    parse_recipe,
)
from bench.speculative.dflash_training import DFlashTraining

# --- the recipe as text --------------------------------------------------------------------


def test_a_recipe_parses_every_field():
    """Each ``key=value`` lands in its field with its type; unnamed fields keep their defaults."""
    r = parse_recipe(" layers=5, ids=top ,teacher=24576,lr=3e-4,wd=0.1,blocks=12,decay=2.5,init=target ")
    assert r == Recipe(
        layers=5, ids="top", teacher=24576, lr=3e-4, wd=0.1, blocks=12, decay=2.5, init="target"
    )
    assert isinstance(r.layers, int) and isinstance(r.teacher, int) and isinstance(r.lr, float)
    assert parse_recipe("layers=2") == Recipe(layers=2)
    assert parse_recipe("") == Recipe()


def test_the_trainers_knobs_default_to_the_trainers_own_defaults():
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
def test_a_wrong_recipe_is_refused_naming_what_is_wrong(text, named):
    """Every kind of bad recipe raises ValueError whose message quotes the recipe and names
    the offending key and what it takes (so the command line's error says what to fix)."""
    with pytest.raises(ValueError) as err:
        parse_recipe(text)
    assert named in str(err.value) and repr(text) in str(err.value)


def test_a_recipes_label_lists_only_what_differs_from_the_defaults():
    """The label (the report's row name) names the non-default fields in field order, and
    parses back to the same recipe; all defaults read ``defaults``."""
    assert Recipe().label() == "defaults"
    assert parse_recipe("ids=reference,lr=0.001,wd=0").label() == "defaults"
    r = parse_recipe("wd=0.1,teacher=24576,ids=top,layers=3")
    assert r.label() == "ids=top,teacher=24576,wd=0.1"
    assert parse_recipe(r.label()) == r
    assert Recipe(layers=2, lr=0.003).label() == "layers=2,lr=0.003"


def test_a_recipes_teacher_takes_the_first_windows():
    windows = torch.arange(20).view(10, 2)
    assert torch.equal(Recipe(teacher=3).teacher_windows(windows), windows[:3])
    assert Recipe().teacher_windows(windows) is windows


# --- one check ----------------------------------------------------------------------------------


def test_every_field_has_one_rule_and_every_field_but_teacher_a_flag():
    """The check covers every field; the command line spells every field but ``teacher``
    (``bench/speculative`` trains on every teacher window it makes)."""
    names = [f.name for f in fields(Recipe)]
    assert list(RULES) == names
    assert set(FLAGS) == set(names) - {"teacher"}


def test_the_check_names_the_field_as_the_caller_spells_it():
    """``check_recipe`` passes a good recipe and names a bad field by the caller's spelling."""
    check_recipe(Recipe(wd=0.0, teacher=1))
    with pytest.raises(ValueError, match=r"^--dflash-lr must be positive .*got 0\.0$"):
        check_recipe(Recipe(lr=0.0), FLAGS.get)
    with pytest.raises(ValueError, match=r"^wd must be 0 or more .*got -1\.0$"):
        check_recipe(Recipe(wd=-1.0))


# --- bench/speculative's --dflash-* flags -------------------------------------------------------


def test_the_flags_build_the_recipe_the_same_knobs_parse_to():
    """Every ``--dflash-*`` training flag reaches its field: the recipe equals the one
    ``bench/dflash_recipes`` parses from the same knobs."""
    s = cli.parse(
        ["--smoke", "--draft", "dflash", "--dflash-layers", "2", "--dflash-target-layers", "top",
         "--dflash-lr", "0.003", "--dflash-weight-decay", "0.01", "--dflash-anchors", "12",
         "--dflash-decay", "2", "--dflash-init", "target", "--dflash-teacher-share", "0.75",
         "--dflash-anchor-from", "continuation", "--dflash-teacher-outputs", "stream", "--dflash-seq", "48"]
    )  # fmt: skip
    assert s.dflash_recipe == parse_recipe(
        "layers=2,ids=top,lr=0.003,wd=0.01,blocks=12,decay=2,init=target,share=0.75,anchor_from=continuation,"
        "outputs=stream,seq=48"
    )


def test_the_flags_defaults():
    """Without flags: five layers (the reference's depth), the recipe's learning rate on a GPU
    run and SMOKE_LR under ``--smoke``, the trainer's defaults otherwise."""
    assert cli.parse([]).dflash_recipe == Recipe(layers=5)
    assert cli.parse(["--smoke"]).dflash_recipe == Recipe(layers=5, lr=SMOKE_LR)
    assert cli.parse(["--smoke", "--dflash-lr", "5e-4"]).dflash_recipe.lr == 5e-4


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--dflash-lr", "0"], "--dflash-lr must be positive"),
        (["--dflash-lr", "-0.001"], "--dflash-lr must be positive"),
        (["--dflash-weight-decay", "-1"], "--dflash-weight-decay must be 0 or more"),
        (["--dflash-layers", "0"], "--dflash-layers must be at least 1"),
        (["--dflash-anchors", "0"], "--dflash-anchors must be at least 1"),
        (["--dflash-decay", "0"], "--dflash-decay must be positive"),
        (["--dflash-teacher-share", "0"], "--dflash-teacher-share must be above 0 and at most 1"),
        (["--dflash-teacher-share", "1.5"], "--dflash-teacher-share must be above 0 and at most 1"),
        (["--dflash-seq", "4"], "--dflash-seq must be at least 8"),
        (["--distill-seq", "0"], "--distill-seq must be at least 8"),
        (["--distill-seq", "-64"], "--distill-seq must be at least 8"),
        (["--dflash-train-s", "0"], "--dflash-train-s must be positive"),
        (["--dflash-probe-steps", "-1"], "--dflash-probe-steps not negative"),
        (["--eagle-lr", "0"], "--eagle-lr must be positive"),
    ],
)
def test_a_wrong_flag_is_an_argparse_error_naming_it(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.parse(["--smoke", *argv])
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


# --- one function trains and walks a recipe's draft ----------------------------------------------


def test_a_recipes_draft_trains_with_its_knobs_and_is_walked_as_served(target):
    """``train_dflash_draft`` (the real trainer over the tiny target) hands every knob of the
    recipe to the training, rounds the draft to what is served, walks the held-out
    continuations, and with ``probe_every`` walks the draft while it trains."""
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(3, 64, (4000,), generator=gen)
    teacher = SimpleNamespace(data=torch.randint(3, 64, (10, 17), generator=gen), seq=16, fraction=0.25, prompt=5)
    s = SimpleNamespace(batch=4, dflash_block=4, small_shape="smoke-small", device=torch.device("cpu"))
    recipe = Recipe(layers=2, ids="top", teacher=4, lr=3e-3, wd=0.01, blocks=5, decay=2.0, init="target")
    draft, info = models.train_dflash_draft(
        s, recipe, target, data, data[:600], teacher, seconds=600.0, max_steps=3, heldout_count=2, probe_every=1
    )
    assert info["steps"] == 3 and (info["layers"], info["blocks_per_window"], info["decay"]) == (2, 5, 2.0)
    assert (info["lr"], info["weight_decay"], info["init"]) == (3e-3, 0.01, "target")
    assert info["target_layer_ids"] == models.dflash_layer_ids(2, 2, "top") and info["teacher_fraction"] == 0.25
    assert all(torch.equal(p, p.to(torch.bfloat16).float()) for p in draft.parameters())  # rounded as served
    assert len(info["heldout_walk_accept"]) == 3 and 0 <= info["heldout_walk_mean"] <= 3
    assert [p["steps"] for p in info["probes"]] == [1, 2]  # walked after each step but the last


def test_a_recipes_teacher_knobs_reach_the_training(target):
    """``share`` overrides the run's teacher fraction; ``anchor_from``, ``outputs`` and
    ``compile`` reach the trainer, which places the teacher blocks after the teacher's prompt (``prompt``)."""
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(3, 64, (4000,), generator=gen)
    teacher = SimpleNamespace(data=torch.randint(3, 64, (10, 17), generator=gen), seq=16, fraction=0.25, prompt=5)
    s = SimpleNamespace(batch=4, dflash_block=4, small_shape="smoke-small", device=torch.device("cpu"))
    recipe = Recipe(layers=1, blocks=3, share=0.5, anchor_from="continuation", outputs="stream")
    _, info = models.train_dflash_draft(
        s, recipe, target, data, data[:600], teacher, seconds=600.0, max_steps=2, heldout_count=2, compile=True
    )
    assert (info["teacher_fraction"], info["anchor_from"], info["teacher_outputs"]) == (0.5, "continuation", "stream")
    assert info["compile_seconds"] > 0  # compile reaches the training too
    assert recipe.label() == "layers=1,blocks=3,share=0.5,anchor_from=continuation,outputs=stream"


def test_probes_and_the_final_walk_judge_one_set_of_heldout_continuations(target, monkeypatch):
    """The held-out continuations are generated once per draft, not once per probe: the
    probes and the final walk share them (``HeldOut``), so a probe costs only the draft's
    own walk."""
    from bench.speculative import training

    made = []
    real = training.teacher_sequences
    monkeypatch.setattr(training, "teacher_sequences", lambda *a, **k: made.append(k["count"]) or real(*a, **k))
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(3, 64, (4000,), generator=gen)
    teacher = SimpleNamespace(data=torch.randint(3, 64, (10, 17), generator=gen), seq=16, fraction=0.25, prompt=5)
    s = SimpleNamespace(batch=4, dflash_block=4, small_shape="smoke-small", device=torch.device("cpu"))
    _, info = models.train_dflash_draft(
        s, Recipe(layers=1, blocks=5), target, data, data[:600], teacher, seconds=600.0, max_steps=4, heldout_count=2,
        probe_every=1,
    )  # fmt: skip
    assert len(info["probes"]) == 3 and made == [2]


def test_a_heldout_judgement_refuses_a_draft_of_other_layers_or_block(target):
    """Held-out data is built for one draft's target layers and block; judging another draft
    on it would compare it with features it does not read, so it is refused by name."""
    from bench.speculative.dflash_draft import DFlashDraft
    from bench.speculative.dflash_training import dflash_heldout, heldout_data

    held_ids = torch.randint(3, 64, (600,), generator=torch.Generator().manual_seed(1))
    held = heldout_data(target, held_ids, torch.device("cpu"), seq=16, count=2, block=4, layer_ids=[0])
    again = heldout_data(target, held_ids, torch.device("cpu"), seq=16, count=2, block=4, layer_ids=[0])
    assert torch.equal(held.window, again.window) and torch.equal(held.anchors, again.anchors)  # deterministic
    shared = heldout_data(target, held_ids, torch.device("cpu"), seq=16, count=2, block=4, layer_ids=[0],
                          windows=held.window)  # fmt: skip
    assert torch.equal(shared.feats, held.feats) and torch.equal(shared.anchors, held.anchors)
    with pytest.raises(ValueError, match=r"held-out windows must be \[2, 17\]"):
        heldout_data(target, held_ids, torch.device("cpu"), seq=16, count=2, block=4, layer_ids=[0],
                     windows=held.window[:, :10])  # fmt: skip
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    def draft(ids: list[int], block: int) -> DFlashDraft:
        return DFlashDraft("smoke-small", embed, head, layer_ids=ids, num_layers=1, block=block, mask_id=0,
                           eps=1e-5, theta=1e4)  # fmt: skip

    ok = draft([0], 4)
    assert 0 <= dflash_heldout(ok, held)["heldout_walk_mean"] <= 3
    for bad in (draft([1], 4), draft([0], 5)):
        with pytest.raises(ValueError, match=r"heldout_data\(\.\.\., block=draft.block, layer_ids=draft.layer_ids\)"):
            dflash_heldout(bad, held)


# --- the report says how the teacher continuations were used --------------------------------------


def test_the_report_names_teacher_use_only_where_it_left_the_defaults():
    """The DFLASH line names blocks after the prompt and streamed outputs when chosen, and
    nothing for the defaults or for records written before either knob existed."""
    from bench.speculative.report import _teacher_use

    assert _teacher_use({}) == ""
    assert _teacher_use({"anchor_from": "window", "teacher_outputs": "cache"}) == ""
    both = _teacher_use({"anchor_from": "continuation", "teacher_outputs": "stream"})
    assert both == " (their blocks only after the prompt; their target outputs computed each step, so every one is trained on)"
    assert "prompt" not in _teacher_use({"teacher_outputs": "stream"})


def test_the_report_says_how_many_continuations_the_walk_took():
    """The walk's clause names its held-out count where the record has one (older records:
    the clause as it was, without a count)."""
    from bench.speculative.report import _walk

    walked = {"heldout_walk_mean": 1.9, "heldout_walk_accept": [0.7, 0.5]}
    assert _walk({}) == ""
    assert _walk(walked).startswith("; walking the target's held-out continuations as greedy serving does, 1.9")
    assert _walk({**walked, "heldout_count": 64}).startswith("; walking 64 of the target's held-out continuations")


# --- training windows as long as serving reads ----------------------------------------------------


def test_drafts_train_on_windows_as_long_as_a_served_request_reads(target):
    """Without ``--distill-seq`` the teacher windows cover a served request: prompt, new tokens
    and the widest verify, rounded up to 64 (the GPU defaults: 128 + 192 + 8 -> 384, not the
    192 that runs 1-11 trained on); the corpus recipe's prompt is a third of the window."""
    from bench.speculative.distillation import serving_window, teacher_continuations

    assert cli.parse([]).serving_reach == 128 + 192 + 8 and serving_window(328) == 384
    assert cli.parse(["--k-sweep", "4,12"]).serving_reach == 128 + 192 + 12
    assert serving_window(64) == 64 and serving_window(65) == 128
    args = SimpleNamespace(distill_prompts="corpus", distill_seq=None, distill_count=3, teacher_fraction=None)
    data = torch.randint(3, 64, (2000,), generator=torch.Generator().manual_seed(2))
    got = teacher_continuations(args, target, data, None, torch.device("cpu"), smoke=True, reach=70, prompt_len=10)
    assert (got.seq, got.prompt, tuple(got.data.shape)) == (128, 42, (3, 129))
    args.distill_seq = 48  # given: as given
    assert teacher_continuations(args, target, data, None, torch.device("cpu"), smoke=True, reach=70,
                                 prompt_len=10).seq == 48  # fmt: skip


def test_a_recipes_seq_trains_on_shorter_windows_and_is_walked_as_long_as_serving(target):
    """``seq=`` cuts the training windows (the record's ``seq``); the held-out walk still reads
    the teacher's full windows, and says how it went by context length in the runtime's
    buckets. A ``seq`` longer than the teacher's windows, or not past its prompt, is refused
    naming ``--distill-seq``."""
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(3, 64, (4000,), generator=gen)
    teacher = SimpleNamespace(data=torch.randint(3, 64, (10, 161), generator=gen), seq=160, fraction=0.25, prompt=50)
    s = SimpleNamespace(batch=4, dflash_block=4, small_shape="smoke-small", device=torch.device("cpu"))
    _, info = models.train_dflash_draft(
        s, Recipe(layers=1, seq=64), target, data, data[:1200], teacher, seconds=600.0, max_steps=2, heldout_count=2
    )
    assert info["seq"] == 64
    by_context = info["heldout_walk_by_context"]
    assert list(by_context) == ["0-127", "128-255"]  # walked from a third of the window (53) to its end (160)
    assert sum(n for _, n in by_context.values()) > 2
    for bad in (200, 40):
        with pytest.raises(ValueError, match=r"must be above the teacher's prompt \(50\) and at most its windows"
                                             r" \(160, --distill-seq\)"):  # fmt: skip
            models.train_dflash_draft(
                s, Recipe(layers=1, seq=bad), target, data, data[:1200], teacher, seconds=1.0, max_steps=1,
                heldout_count=2,
            )  # fmt: skip


def test_the_walk_by_context_counts_each_step_in_its_bucket():
    """Each walk step's accepted drafts land in the runtime bucket of the tokens before its block."""
    from bench.speculative.dflash_training import walk_by_context

    walk = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.float)
    contexts = torch.tensor([100, 127, 128, 300])
    assert walk_by_context(walk, contexts) == {"0-127": [1.5, 2], "128-255": [0.0, 1], "256-511": [3.0, 1]}


def test_the_report_warns_of_windows_shorter_than_serving_and_gives_the_walk_by_context():
    from bench.speculative.report import _by_context, _short_windows

    s = cli.parse([])
    assert _short_windows(s, 384) == ""
    assert "SHORTER than the 328 tokens a served request reads: it accepts less past 192" in _short_windows(s, 192)
    assert _by_context(None) == ""
    assert _by_context({"128-255": [2.3, 540], "256-511": [1.8, 300]}) == "; by context 128-255 2.3 (540), 256-511 1.8 (300)"
