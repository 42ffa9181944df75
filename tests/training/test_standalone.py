"""A STANDALONE draft distilled from its target: it moves towards the target's distribution."""

from __future__ import annotations

import torch

from loraserve.runtime.tools.distill.objective import kl_per_position
from loraserve.runtime.tools.distill.standalone import new_llama, train_lm

from .conftest import llama_config


def _kl(draft, target, windows: torch.Tensor) -> float:
    with torch.no_grad():
        return float(kl_per_position(draft(windows).logits, target(windows).logits, 64).mean())


def test_distillation_moves_draft(target):
    """Distillation moves the draft to the target."""
    draft_config = llama_config(32, 1, 2, 1, 16, 64, vocab=64)
    data = torch.randint(0, 64, (4000,), generator=torch.Generator().manual_seed(1))
    held = torch.randint(0, 64, (8, 24), generator=torch.Generator().manual_seed(2))
    before = _kl(new_llama(draft_config, 2, torch.device("cpu")).eval(), target, held)
    draft, info = train_lm(draft_config, data, 600, torch.device("cpu"), seq=16, batch=8, lr=3e-3, seed=2,
                           teacher=target, max_steps=60)  # fmt: skip
    after = _kl(draft, target, held)
    assert info["steps"] == 60 and info["params"] == sum(p.numel() for p in draft.parameters())
    assert after < 0.5 * before, (before, after)
