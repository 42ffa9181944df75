"""Everything a run trains, in order: the corpus, the small target, then each draft."""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from loraserve.runtime.dev.devmodels import write_tokenizer
from loraserve.runtime.tools.distill.dflash_draft import DFlashDraft
from loraserve.runtime.tools.distill.dflash_recipe import Recipe
from loraserve.runtime.tools.distill.dflash_train import (
    DFlashTraining,
    HeldOut,
    dflash_heldout,
    dflash_layer_ids,
    heldout_data,
    train_dflash,
)
from loraserve.runtime.tools.distill.eagle_head import EagleHead
from loraserve.runtime.tools.distill.eagle_train import EagleTraining, eagle_heldout_top1, train_eagle_head
from loraserve.runtime.tools.distill.standalone import save_hf, train_lm

from ..harness import log
from .corpus import corpus_files, tokenize
from .distillation import TeacherData, teacher_continuations, train_standalone
from .settings import Settings
from .shapes import llama_config


@dataclass
class TrainedModels:
    """What training leaves for serving: files under ``work`` and what the report says of them."""

    work: Path  # the run's scratch directory
    tokenizer_dir: Path
    held_ids: torch.Tensor  # the held-out files' tokens: the benchmark's prompts
    small_dir: Path  # the trained small target (bfloat16, Hugging Face layout)
    small_state: dict[str, torch.Tensor]  # its weights, for the function-preserving expansion
    target_info: dict
    infos: dict[str, dict]  # per draft: its training record (and, later, its serving check)
    draft_dir: Path | None = None  # the STANDALONE draft
    head: EagleHead | None = None  # the EAGLE head as trained (bfloat16 values)
    dflash: DFlashDraft | None = None  # the DFLASH draft as trained (bfloat16 values)


def train_models(s: Settings) -> TrainedModels:
    """Tokenize the corpus, train the small target, then the drafts ``s.drafts`` asks for."""
    work = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    tok_dir = write_tokenizer(work / "tokenizer", s.vocab)
    data, held_ids = load_corpus(s, tok_dir)
    target, target_info = train_target(s, data)
    teacher = None
    if s.args.draft_training == "distill" or "eagle" in s.drafts or "dflash" in s.drafts:
        teacher = teacher_continuations(s.args, target, data, tok_dir, s.device, smoke=s.smoke,
                                        reach=s.serving_reach, prompt_len=s.prompt_len)  # fmt: skip
    infos: dict[str, dict] = {}
    draft_dir = head = None
    if "standalone" in s.drafts:
        draft, infos["standalone"] = train_standalone(
            s.args, target, s.draft_shape, s.vocab, data, teacher, s.train_draft_s, s.device,
            seq=s.seq, batch=s.batch, smoke=s.smoke, max_steps=s.max_steps[1],
        )  # fmt: skip
        draft_dir = save_hf(draft, work / "draft", tok_dir)
        del draft
    if "eagle" in s.drafts:
        assert teacher is not None
        head, infos["eagle"] = _train_eagle(s, target, data, held_ids, teacher)
    dflash = None
    if "dflash" in s.drafts:
        assert teacher is not None
        dflash, infos["dflash"] = _train_dflash(s, target, data, held_ids, teacher)
    # save_hf casts the target to bfloat16 in place: the drafts above trained on its float32 self
    small_dir = save_hf(target, work / "target-small", tok_dir)
    small_state = {n: t.detach() for n, t in target.state_dict().items()}
    del target
    if s.device.type == "cuda":
        torch.cuda.empty_cache()
    return TrainedModels(
        work, tok_dir, held_ids, small_dir, small_state, target_info, infos, draft_dir, head, dflash
    )


def load_corpus(s: Settings, tok_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The training corpus's tokens and the held-out prompt files' tokens."""
    train_files, held = corpus_files(2_000_000 if s.smoke else 40_000_000)
    data = tokenize(tok_dir, train_files)
    held_ids = tokenize(tok_dir, held)
    log(
        f"corpus: {len(train_files)} files, {data.numel():,} tokens; held-out prompt files: {[p.name for p in held]}"
    )
    return data, held_ids


def train_target(s: Settings, data: torch.Tensor):
    """The small target, trained on the corpus for ``--train-target-s``."""
    target, info = train_lm(
        llama_config(s.small_shape, s.vocab), data, s.train_target_s, s.device, seq=s.seq, batch=s.batch,
        lr=1.5e-3 if s.smoke else 6e-4, seed=1, max_steps=s.max_steps[0],
    )  # fmt: skip
    log(f"target-small trained: {info}")
    return target, info


def _train_eagle(s: Settings, target, data: torch.Tensor, held_ids: torch.Tensor, teacher: TeacherData):
    """The EAGLE head over ``target``, rounded to what is served, with its held-out top-1."""
    args = s.args
    opts = EagleTraining(
        seconds=s.train_draft_s, seq=teacher.seq, batch=s.batch, lr=args.eagle_lr or (2e-3 if s.smoke else 1e-3),
        teacher_fraction=teacher.fraction, noise=args.eagle_noise, unroll=args.eagle_unroll,
        feature_weight=args.eagle_feature_weight, max_steps=s.max_steps[2],
        cache_gib=args.eagle_cache_gib if args.eagle_cache_gib is not None else (0.02 if s.smoke else 32.0),
    )  # fmt: skip
    head, info = train_eagle_head(target, data, teacher.data, s.device, opts)
    head.round_to_bf16()  # what is served
    info["heldout_top1"] = eagle_heldout_top1(
        head, target, held_ids, s.device, seq=teacher.seq, steps=max(2, opts.unroll)
    )
    log(f"EAGLE head trained: {info}")
    return head, info


# Held-out continuations the served run's DFLASH draft is walked on (base model only). With 16,
# H100 run 10's walk read 1.94 where serving accepted 2.29 (run 9: 1.98 and 1.97): a handful of
# continuations is a noisy predictor, and 64 cost the GPU about a second a probe.
HELDOUT, HELDOUT_SMOKE = 64, 16


def _train_dflash(s: Settings, target, data: torch.Tensor, held_ids: torch.Tensor, teacher: TeacherData):
    """The DFLASH draft of the ``--dflash-*`` flags over ``target``, trained for ``--dflash-train-s``."""
    draft, info = train_dflash_draft(
        s,
        s.dflash_recipe,
        target,
        data,
        held_ids,
        teacher,
        seconds=s.dflash_train_s,
        max_steps=s.max_steps[2],
        probe_every=s.args.dflash_probe_steps,
        compile=s.args.dflash_compile,
        heldout_count=HELDOUT_SMOKE if s.smoke else HELDOUT,
    )
    log(f"DFLASH draft trained: {info}")
    return draft, info


def train_dflash_draft(
    s: Settings,
    recipe: Recipe,
    target,
    data: torch.Tensor,
    held_ids: torch.Tensor,
    teacher: TeacherData,
    *,
    seconds: float,
    max_steps: int | None,
    heldout_count: int,  # the served run's HELDOUT, the recipe study's --heldout-count
    probe_every: int = 0,
    held_windows: torch.Tensor | None = None,
    compile: bool = False,
) -> tuple[DFlashDraft, dict]:
    """``recipe``'s DFLASH draft over ``target`` (``recipe.layers`` layers reading as many of
    its layers' outputs; ``s``'s block, batch, shape and device), trained for ``seconds`` or
    ``max_steps`` steps, rounded to what is served, with its held-out agreement and walk over
    ``heldout_count`` continuations; every ``probe_every`` training steps (> 0), the served
    draft so far walks them too (the learning curve). ``held_windows``: those continuations
    (:func:`heldout_windows`) when the caller shares them between drafts; else generated here.
    ``compile``: the training step's draft forward under torch.compile (the same draft, sooner)."""
    layer_ids = dflash_layer_ids(target.config.num_hidden_layers, recipe.layers, recipe.ids)
    if recipe.seq is not None and not teacher.prompt < recipe.seq <= teacher.seq:
        raise ValueError(
            f"a DFLASH recipe's seq ({recipe.seq}) must be above the teacher's prompt ({teacher.prompt}) and at most"
            f" its windows ({teacher.seq}, --distill-seq): lower seq or raise --distill-seq"
        )
    opts = DFlashTraining(
        seconds=seconds, seq=recipe.seq or teacher.seq, batch=s.batch, lr=recipe.lr, block=s.dflash_block, layer_ids=layer_ids,
        num_layers=recipe.layers, blocks=recipe.blocks, decay=recipe.decay, weight_decay=recipe.wd,
        init=recipe.init, teacher_fraction=teacher.fraction if recipe.share is None else recipe.share,
        teacher_prompt=teacher.prompt, anchor_from=recipe.anchor_from, teacher_outputs=recipe.outputs,
        max_steps=max_steps, probe_every=probe_every, compile=compile,
    )  # fmt: skip
    held = heldout_data(
        target,
        held_ids,
        s.device,
        seq=teacher.seq,
        count=heldout_count,
        block=s.dflash_block,
        layer_ids=layer_ids,
        windows=held_windows,
    )  # built once: every probe and the final walk judge on the same continuations, as long as serving reads
    draft, info = train_dflash(
        target, data, recipe.teacher_windows(teacher.data), s.device, opts,
        probe=lambda d: _walk_probe(d, held),
    )  # fmt: skip
    draft.round_to_bf16()  # what is served
    info.update(dflash_heldout(draft, held), heldout_count=heldout_count)
    return draft, info


def _walk_probe(draft: DFlashDraft, held: HeldOut) -> dict:
    """The held-out serving walk of ``draft`` as it would be served (a bf16-rounded copy)."""
    served = copy.deepcopy(draft)
    served.round_to_bf16()
    got = dflash_heldout(served, held)
    return {"heldout_walk_mean": got["heldout_walk_mean"], "heldout_top1": got["heldout_top1"]}
