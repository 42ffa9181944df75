"""Token-for-token agreement of two runs of the same requests, by request kind."""

from __future__ import annotations

from collections.abc import Callable

import torch

from loraserve.runtime.runner.model_runner import ModelRunner

from .workloads import Workload


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts), or
    None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def identity_by_kind(
    adapters: list[str | None],
    outs_a: list[list[int]],
    outs_b: list[list[int]],
    gap: Callable[[int, int], float | None] | None = None,
) -> dict:
    """Token-for-token agreement of two runs of the same requests, split into base-model and
    adapter requests: ``{kind: {"identical", "count", "mean_first_divergence", "max_gap"}}``.
    ``gap(i, at)``: how far apart the target's logits put the two runs' tokens where request
    ``i`` first differs (see :func:`first_difference_gap`); ``max_gap`` is the largest.

    On a GPU in bf16 two batch shapes can round near-tied argmaxes differently (a verify of
    k rows against a decode of one), so speculation's agreement is read against the same
    split for two plain runs that differ only in batch shape: a LoRA bug shows as adapter
    requests diverging more, or earlier, than base requests and than that floor.
    """
    kinds: dict[str, dict] = {}
    for i, (adapter, a, b) in enumerate(zip(adapters, outs_a, outs_b, strict=True)):
        kind = "base" if adapter is None else "adapter"
        k = kinds.setdefault(kind, {"identical": 0, "count": 0, "first": [], "gaps": []})
        k["count"] += 1
        at = first_divergence(a, b)
        if at is None:
            k["identical"] += 1
            continue
        k["first"].append(at)
        if gap is not None and (g := gap(i, at)) is not None:
            k["gaps"].append(g)
    return {
        kind: {
            "identical": k["identical"],
            "count": k["count"],
            "mean_first_divergence": round(sum(k["first"]) / len(k["first"]), 1) if k["first"] else None,
            "max_gap": round(max(k["gaps"]), 3) if k["gaps"] else None,
        }
        for kind, k in sorted(kinds.items())
    }


def first_difference_gap(
    runner: ModelRunner, prompt: list[int], adapter: str | None, a: list[int], b: list[int], at: int
) -> float | None:
    """|logit(a[at]) - logit(b[at])| of the target (with ``adapter``) after ``prompt`` and the
    tokens both outputs share: near zero where the two runs differ by rounding a near-tie
    (batch shape, verify width), large where one of them chose a token the target does not
    prefer. None where one output ended first."""
    from loraserve.kernels import ForwardMode
    from loraserve.runtime.runner.forward_batch import ForwardBatch

    if at >= min(len(a), len(b)):
        return None
    ids = torch.tensor([*prompt, *a[:at]])
    out = runner.forward(
        ForwardBatch(ForwardMode.EXTEND, ["gap-check"], ids, extend_lens=[len(ids)], lora_names=[adapter])
    )
    runner.kv.free("gap-check")
    logits = out.logits[-1].float()
    return abs(float(logits[a[at]] - logits[b[at]]))


def gap_of(runner: ModelRunner, work: Workload, outs_a: list[list[int]], outs_b: list[list[int]]):
    """The ``gap`` argument of :func:`identity_by_kind` for two runs of ``work``."""
    return lambda i, at: first_difference_gap(
        runner, work.prompts[i], work.adapters[i], outs_a[i], outs_b[i], at
    )
