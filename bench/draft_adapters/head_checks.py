"""The EAGLE head's draft adapters as served against the distilled ones (``--draft eagle``).

Served: the 8B-shaped target with the task adapter (its expansion) gives the features, and
the head expanded to that shape drafts from its own pool with the expanded head adapter
(``lora_expansion``), through the runtime's head runner of the draft-adapter decoder, paged
KV cache and LoRA kernels included. Distilled: the head as trained (``bench/speculative``'s
:class:`EagleHead`, an implementation of the head's equations apart from the runtime's) with
the distilled LoRA merged into its weights (``W + alpha / r * B A``), over the small target
with the task adapter (peft), at the trained shape: what ``distill`` trained.

After each prompt the distilled head proposes ``steps`` tokens; the served head steps on
those tokens (teacher forcing, as ``bench/speculative``'s ``eagle_check`` does, so a near-tie
flipped by bf16 costs one proposal instead of derailing the rest). Reported per adapter: the
share of proposals that agree, the smallest top-2 logit margin among those that do not, the
relative difference of the output features (the served head's first ``Hs`` dimensions), the
largest relative norm of its padded dimensions (which must stay zero), and how far the
adapter moves the served head's logits (relative to the same steps without it, over every
prompt): a check that it ran.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.tools.distill.eagle_head import EagleHead
from loraserve.runtime.tools.distill.eagle_train import target_features


def merged_head(head: EagleHead, adapter_dir: Path, device: torch.device) -> EagleHead:
    """A float32 copy of ``head`` on ``device`` with the PEFT head adapter of ``adapter_dir``
    merged into its weights (the fc and the layer's projections; the shared embeddings and
    LM head are never adapted)."""
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scaling = float(config["lora_alpha"]) / int(config["r"])
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    out = copy.deepcopy(head).to(device=device, dtype=torch.float32)
    suffix = ".lora_A.weight"
    with torch.no_grad():
        for name in (n for n in tensors if n.endswith(suffix)):
            prefix = name.removesuffix(suffix)  # base_model.model.fc, ...layers.0.mlp.up_proj
            a = tensors[name].float().to(device)
            b = tensors[f"{prefix}.lora_B.weight"].float().to(device)
            getattr(out, prefix.rsplit(".", 1)[-1]).weight.add_(scaling * (b @ a))
    return out.eval()


def _target_pass(runner: ModelRunner, prompt: list[int], lora: str) -> tuple[int, torch.Tensor]:
    """The served target with adapter ``lora`` on ``prompt``: its next token and features."""
    from loraserve.kernels import ForwardMode
    from loraserve.runtime.runner.forward_batch import ForwardBatch

    ids = torch.tensor(prompt, device=runner.device)
    batch = ForwardBatch(
        ForwardMode.EXTEND, ["head-check"], ids, extend_lens=[len(prompt)], lora_names=[lora], return_hidden=True
    )  # fmt: skip
    out = runner.forward(batch)
    runner.kv.free("head-check")
    return int(out.logits[-1].argmax()), out.hidden_states


def _served_steps(
    head_runner, prompt: list[int], first: int, hidden: torch.Tensor, tokens: list[int], lora: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The served head after ``prompt`` (target features ``hidden``, next token ``first``),
    stepping on ``tokens`` (teacher forcing) with draft adapter ``lora`` (None: the base
    head): its logits and output features of each step, ``[steps, V]`` and ``[steps, H]``."""
    rid = "head-check"
    pair_ids = torch.tensor([*prompt[1:], first])
    try:
        tail = head_runner.forward([rid], pair_ids, hidden, [len(prompt)], lora_names=[lora])[-1:]
        logits, outs = [], []
        for j in range(len(tokens)):
            if j:
                tail = head_runner.forward(
                    [rid], torch.tensor([tokens[j - 1]]), tail, [1], from_target=False, lora_names=[lora]
                )
            logits.append(head_runner.compute_logits(tail)[0].float())
            outs.append(tail[0].float())
    finally:
        head_runner.kv.free(rid)
    return torch.stack(logits), torch.stack(outs)


@torch.no_grad()
def served_head_adapter_checks(
    runner: ModelRunner, head_runner, head: EagleHead, small_dir: Path, task_adapters: dict[str, Path],
    draft_adapters: dict[str, Path], prompts: dict[str, list[list[int]]], steps: int,
) -> dict[str, dict]:  # fmt: skip
    """Per draft adapter (by its task adapter's name): the served head with it, in
    ``head_runner``'s pool, on the served target's adapted features (``runner``), against the
    trained ``head`` with the distilled adapter of ``draft_adapters`` merged, on the small
    target's (``small_dir`` with ``task_adapters``), after each of ``prompts[name]``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    names = [n for n in draft_adapters if n in task_adapters]
    if not names:
        return {}
    device = runner.device
    base = AutoModelForCausalLM.from_pretrained(str(small_dir), dtype=runner.dtype).to(device).eval()
    ref = PeftModel.from_pretrained(base, str(task_adapters[names[0]]), adapter_name=names[0]).eval()
    hs = head.fc.weight.shape[0]
    out = {}
    for name in names:
        if name != names[0]:
            ref.load_adapter(str(task_adapters[name]), adapter_name=name)
        ref.set_adapter(name)
        target = ref.get_base_model()  # the adapter's LoRA layers stay in it, active
        distilled = merged_head(head, draft_adapters[name], device)
        same = total = 0
        rel = padded = moved = size = 0.0
        margins: list[float] = []
        for prompt in prompts[name]:
            first, hidden = _target_pass(runner, prompt, name)
            ids = torch.tensor(prompt, device=device)
            want, want_out = distilled.propose(prompt, target_features(target, ids[None])[0], first, steps)
            logits, got_out = _served_steps(head_runner, prompt, first, hidden, want, name)
            unadapted, _ = _served_steps(head_runner, prompt, first, hidden, want, None)
            got = logits.argmax(-1).tolist()
            for j, (a, b) in enumerate(zip(got, want, strict=True)):
                same += a == b
                if a != b:
                    top2 = logits[j].topk(2).values
                    margins.append(float(top2[0] - top2[1]))
            total += steps
            rel = max(rel, float((got_out[:, :hs] - want_out).norm() / want_out.norm()))
            padded = max(padded, float(got_out[:, hs:].norm() / got_out.norm()))
            moved += float((logits - unadapted).norm() ** 2)
            size += float(unadapted.norm() ** 2)
        out[name] = {
            "proposal_agreement": round(same / total, 3),
            "disagreeing_margin": round(min(margins), 4) if margins else None,
            "rel_feature_diff": round(rel, 5),
            "padded_norm": round(padded, 6),
            "adapter_shift": round((moved / size) ** 0.5, 4),
        }
        del distilled
    del ref, base
    return out
