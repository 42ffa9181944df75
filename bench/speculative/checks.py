"""Checks that the served models compute what the trained ones do."""

from __future__ import annotations

from pathlib import Path

import torch

from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.tools.distill.eagle_head import EagleHead
from loraserve.runtime.tools.distill.eagle_train import target_features

from ..harness import log
from .dflash_check import dflash_check
from .models import TrainedModels
from .serving import Serving
from .settings import Settings


@torch.no_grad()
def expansion_check(runner: ModelRunner, small_dir: Path, prompt: list[int], device: torch.device) -> dict:
    """Relative difference of last-position logits and greedy agreement: serving target vs trained model."""
    from transformers import AutoModelForCausalLM

    from loraserve.kernels import ForwardMode
    from loraserve.runtime.runner.forward_batch import ForwardBatch

    ref = AutoModelForCausalLM.from_pretrained(str(small_dir), dtype=runner.dtype).to(device).eval()
    ids = torch.tensor(prompt, device=device)
    ref_logits = ref(input_ids=ids[None]).logits[0].float()
    out = runner.forward(
        ForwardBatch(ForwardMode.EXTEND, ["check"], ids, extend_lens=[len(prompt)], return_all_logits=True)
    )
    runner.kv.free("check")
    ours = out.logits.float()
    rel = float((ours - ref_logits).norm() / ref_logits.norm())
    agree = float((ours.argmax(-1) == ref_logits.argmax(-1)).float().mean())
    del ref
    return {"rel_logit_diff": round(rel, 4), "argmax_agreement": round(agree, 3)}


@torch.no_grad()
def eagle_check(
    runner: ModelRunner,
    head_dir: Path,
    head: EagleHead,
    small_dir: Path,
    prompts: list[list[int]],
    steps: int,
) -> dict:
    """The served head (``head_dir``, loaded by the runtime, on the serving target's features)
    against the trained head on the trained target's features, after each held-out prompt.
    The served head steps on the trained head's own proposals (teacher forcing), so one
    near-tied argmax that bf16 flips costs one proposal instead of derailing the rest: the
    share of proposals that agree, the smallest top-2 logit margin among those that do not
    (a flip of a near-tie has a margin near bf16's rounding of the logits), the relative
    difference of the output features (the served head's first ``Hs`` dimensions) and the
    largest relative norm of its padded dimensions, which must stay zero."""
    from transformers import AutoModelForCausalLM

    device = runner.device
    ref = AutoModelForCausalLM.from_pretrained(str(small_dir), dtype=runner.dtype).to(device).eval()
    served = _served_head(runner, head_dir, max(len(p) for p in prompts) + steps + 1)
    ref_head = head.to(device=device, dtype=torch.float32)
    hs = head.fc.weight.shape[0]
    same = total = 0
    rel = padded = 0.0
    margins: list[float] = []
    pairs = []
    for prompt in prompts:
        want, want_out, got, got_out = _proposals(runner, served, ref, ref_head, prompt, steps, margins)
        rel = max(rel, float((got_out[:, :hs] - want_out).norm() / want_out.norm()))
        padded = max(padded, float(got_out[:, hs:].norm() / got_out.norm()))
        same += sum(a == b for a, b in zip(got, want, strict=True))
        total += steps
        pairs.append((want, got))
    del ref, served
    return {
        "proposal_agreement": round(same / total, 3),
        "disagreeing_margin": round(min(margins), 4) if margins else None,
        "rel_feature_diff": round(rel, 5),
        "padded_norm": round(padded, 6),
        "first_prompt": {"trained": pairs[0][0], "served": pairs[0][1]},
    }


def _served_head(runner: ModelRunner, head_dir: Path, longest: int):
    """The runtime's EAGLE draft runner for ``head_dir`` over ``runner``'s target."""
    from loraserve.runtime.speculative.draft.settings import DraftSettings, base_weight
    from loraserve.runtime.speculative.eagle.runner import EagleDraftRunner

    return EagleDraftRunner(DraftSettings(
        str(head_dir), target_arch=runner.arch, embed_weight=base_weight(runner.embed_tokens),
        lm_head_weight=base_weight(runner.lm_head), dtype=runner.dtype, device=runner.device,
        max_total_tokens=2 * longest, max_requests=2, max_context_len=longest,
    ))  # fmt: skip


def _proposals(runner: ModelRunner, served, ref, ref_head: EagleHead, prompt: list[int], steps: int,
               margins: list[float]):  # fmt: skip
    """After ``prompt``: the trained head's ``steps`` proposals and output features, then the
    served head's, teacher-forced on the trained head's tokens; the top-2 logit margin of
    every served proposal that differs goes to ``margins``."""
    from loraserve.kernels import ForwardMode
    from loraserve.runtime.runner.forward_batch import ForwardBatch

    ids = torch.tensor(prompt, device=runner.device)
    batch = ForwardBatch(
        ForwardMode.EXTEND, ["eagle-check"], ids, extend_lens=[len(prompt)], return_hidden=True
    )
    out = runner.forward(batch)
    runner.kv.free("eagle-check")
    first = int(out.logits[-1].argmax())
    want, want_out = ref_head.propose(prompt, target_features(ref, ids[None])[0], first, steps)
    pair_ids = torch.tensor([*prompt[1:], first])
    tail = served.forward(["c"], pair_ids, out.hidden_states, [len(prompt)])[-1:]
    got, tails = [], []
    for j in range(steps):
        if j:  # the trained head's token, whatever the served head proposed
            tail = served.forward(["c"], torch.tensor([want[j - 1]]), tail, [1], from_target=False)
        logits = served.compute_logits(tail)[0]
        got.append(int(logits.argmax()))
        if got[-1] != want[j]:
            top2 = logits.topk(2).values
            margins.append(float(top2[0] - top2[1]))
        tails.append(tail[0].float())
    served.kv.free("c")
    return want, want_out, got, torch.stack(tails)


def check_serving(s: Settings, trained: TrainedModels, serving: Serving, pool: list[list[int]]) -> dict:
    """The serving target computes the trained model's function (the returned check, for the
    report); the served EAGLE head proposes what the trained head proposes (into its info)."""
    check = expansion_check(serving.runner, trained.small_dir, pool[0], s.device)
    log(f"serving target vs trained model on a held-out prompt: {check}")
    if trained.head is not None and serving.head_dir is not None:
        eagle = trained.infos["eagle"]
        eagle["check"] = eagle_check(
            serving.runner, serving.head_dir, trained.head, trained.small_dir, pool[:4], s.k - 1
        )
        log(f"served EAGLE head vs trained head on held-out prompts: {eagle['check']}")
    if trained.dflash is not None and serving.dflash_dir is not None:
        info = trained.infos["dflash"]
        info["check"] = dflash_check(
            serving.runner, serving.dflash_dir, trained.dflash, trained.small_dir, pool[:4]
        )
        log(f"served DFLASH draft vs trained draft on held-out prompts: {info['check']}")
    return check


# The served drafts' checks against the trained ones. On the CPU (float32) the served draft is
# the trained one to rounding. On a GPU (bfloat16, an 8B-shaped expansion) near-ties flip, but a
# flip whose top-2 margin is over half a logit, or logits that move by 5% of their range, are
# not rounding: run 6's served DFLASH draft read another feature than it trained on, with
# margins up to 1.31 and 14%.
SMOKE_TOLERANCE = {"eagle_feature": 1e-4, "dflash_logit": 1e-3}
GPU_TOLERANCE = {"eagle_feature": 0.05, "dflash_logit": 0.05, "dflash_margin": 0.5}


def check_notes(infos: dict, *, smoke: bool) -> list[str]:
    """What the served drafts' checks (``infos[draft]["check"]``) say beyond rounding: exact
    agreement on the CPU (``smoke``); no flip of more than a near-tie, nor a large logit
    move, on a GPU. Each note names the draft and the check's numbers."""
    notes = []
    eagle = infos.get("eagle", {}).get("check")
    if eagle and (
        (smoke and eagle["proposal_agreement"] != 1.0) or eagle["rel_feature_diff"] > _tol(smoke, "eagle_feature")
    ):
        notes.append(f"the served EAGLE head proposes other tokens than the trained head: {eagle}")
    dflash = infos.get("dflash", {}).get("check")
    if dflash and (
        (smoke and dflash["proposal_agreement"] != 1.0)
        or dflash["rel_logit_diff"] > _tol(smoke, "dflash_logit")
        or (not smoke and (dflash["largest_disagreeing_margin"] or 0.0) > GPU_TOLERANCE["dflash_margin"])
    ):
        notes.append(f"the served DFLASH draft proposes other tokens than the trained draft: {dflash}")
    return notes


def _tol(smoke: bool, name: str) -> float:
    return (SMOKE_TOLERANCE if smoke else GPU_TOLERANCE)[name]
