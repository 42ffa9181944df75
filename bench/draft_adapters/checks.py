"""Checks that what is served computes what was trained: each served task adapter on the
8B-shaped target against the small target with that adapter (peft), and each draft adapter
in the draft's own pool against the draft with that adapter (peft)."""

from __future__ import annotations

from pathlib import Path

import torch

from loraserve.runtime.runner.model_runner import ModelRunner


def _served_logits(runner: ModelRunner, prompt: list[int], lora: str | None) -> torch.Tensor:
    """Every position's logits of ``runner`` on ``prompt`` with adapter ``lora`` (None: base)."""
    from loraserve.kernels import ForwardMode
    from loraserve.runtime.runner.forward_batch import ForwardBatch

    ids = torch.tensor(prompt, device=runner.device)
    batch = ForwardBatch(
        ForwardMode.EXTEND, ["adapter-check"], ids, extend_lens=[len(prompt)], lora_names=[lora],
        return_all_logits=True,
    )  # fmt: skip
    out = runner.forward(batch).logits.float()
    runner.kv.free("adapter-check")
    return out


def _compare(got: torch.Tensor, want: torch.Tensor, unadapted: torch.Tensor) -> dict:
    """Relative logit difference and argmax agreement of ``got`` with ``want``, and how far
    the adapter moved the served logits from ``unadapted`` (a check that it ran at all)."""
    return {
        "rel_logit_diff": round(float((got - want).norm() / want.norm()), 4),
        "argmax_agreement": round(float((got.argmax(-1) == want.argmax(-1)).float().mean()), 3),
        "adapter_shift": round(float((got - unadapted).norm() / unadapted.norm()), 4),
    }


@torch.no_grad()
def served_adapter_checks(
    runner: ModelRunner, model_dir: Path, adapters: dict[str, Path], prompts: dict[str, list[int]]
) -> dict[str, dict]:
    """Per adapter: ``runner`` (serving it under its name) against the model of ``model_dir``
    with the adapter's PEFT folder, on ``prompts[name]``, every position; the model is read
    once, in the runner's dtype, and each adapter loaded into it in turn."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not adapters:
        return {}
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=runner.dtype).to(runner.device).eval()
    names = list(adapters)
    ref = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0]).eval()
    out = {}
    for name in names:
        if name != names[0]:
            ref.load_adapter(str(adapters[name]), adapter_name=name)
        ref.set_adapter(name)
        ids = torch.tensor(prompts[name], device=runner.device)
        want = ref(input_ids=ids[None]).logits[0].float()
        got, unadapted = (
            _served_logits(runner, prompts[name], name),
            _served_logits(runner, prompts[name], None),
        )
        out[name] = _compare(got[:, : want.shape[-1]], want, unadapted[:, : want.shape[-1]])
    del ref, base
    return out
