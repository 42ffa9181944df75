"""The served DFLASH draft (loaded by the runtime, over the serving target) against the
trained one (over the trained small target): the same block proposals after held-out prompts."""

from __future__ import annotations

from pathlib import Path

import torch

from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.tools.distill.dflash_draft import DFlashDraft
from loraserve.runtime.tools.distill.dflash_train import target_outputs


@torch.no_grad()
def dflash_check(
    runner: ModelRunner, draft_dir: Path, draft: DFlashDraft, small_dir: Path, prompts: list[list[int]]
) -> dict:
    """After each prompt, the block drafted from the target's next token: the share of block
    positions where the served draft's argmax equals the trained draft's (overall and per
    block position), the smallest and largest top-2 margin among those that differ (a bf16
    flip of a near-tie has a tiny one; a wrong served draft, large ones) and the largest
    logit difference relative to the trained logits' range."""
    from transformers import AutoModelForCausalLM

    from loraserve.kernels import ForwardMode
    from loraserve.runtime.runner.forward_batch import ForwardBatch
    from loraserve.runtime.speculative.dflash.runner import DFlashDraftRunner
    from loraserve.runtime.speculative.draft.settings import DraftSettings, base_weight

    device = runner.device
    longest = max(len(p) for p in prompts) + draft.block + 1
    served = DFlashDraftRunner(DraftSettings(
        draft_dir, target_arch=runner.arch, target_dir=runner.model_path,
        embed_weight=base_weight(runner.embed_tokens), lm_head_weight=base_weight(runner.lm_head),
        dtype=runner.dtype, device=device, max_total_tokens=2 * longest, max_requests=2, max_context_len=longest,
    ))  # fmt: skip
    ref = AutoModelForCausalLM.from_pretrained(str(small_dir), dtype=runner.dtype).to(device).eval()
    trained = draft.to(device=device, dtype=torch.float32)
    agree = torch.zeros(draft.block - 1)
    margins: list[float] = []
    rel_diff = 0.0
    first_pair = None
    for prompt in prompts:
        ids = torch.tensor(prompt, device=device)
        out = runner.forward(
            ForwardBatch(ForwardMode.EXTEND, ["dflash-check"], ids, extend_lens=[len(prompt)],
                         hidden_layers=served.capture_layers)
        )  # fmt: skip
        runner.kv.free("dflash-check")
        first = int(out.logits[-1].argmax())
        served.append_context(["c"], out.aux_hidden_states, [len(prompt)])
        logits = served.draft_block(["c"], torch.tensor([first]), draft.block)[0]
        served.release("c")
        got = logits.argmax(-1).tolist()
        window = torch.tensor([[*prompt, first]], device=device)
        feats, _ = target_outputs(ref, window, draft.layer_ids)
        want_logits = trained.block_logits(window, feats, torch.tensor([[len(prompt)]], device=device))[0, 0]
        want = want_logits.argmax(-1).tolist()
        for j, (a, b) in enumerate(zip(got, want, strict=True)):
            agree[j] += a == b
            if a != b:
                top2 = logits[j].topk(2).values
                margins.append(float(top2[0] - top2[1]))
        span = (want_logits.amax(-1) - want_logits.amin(-1)).clamp_min(1e-6)
        rel = ((logits.float() - want_logits).abs().amax(-1) / span).max()
        rel_diff = max(rel_diff, float(rel))
        first_pair = first_pair or {"trained": want, "served": got}
    del ref, served
    per_position = agree / len(prompts)
    return {
        "proposal_agreement": round(float(per_position.mean()), 3),
        "agreement_per_position": [round(float(a), 3) for a in per_position],
        "disagreeing_margin": round(min(margins), 4) if margins else None,
        "largest_disagreeing_margin": round(max(margins), 4) if margins else None,
        "rel_logit_diff": round(rel_diff, 4),
        "first_prompt": first_pair,
    }
