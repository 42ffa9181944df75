"""The joint law of a request's three sampled tokens: the engine's counts and the target's
exact law, shared by the sampling oracles (plain and with logit processing)."""

from __future__ import annotations

import itertools

import torch

from loraserve.kernels import ForwardMode
from loraserve.runtime.runner.forward_batch import ForwardBatch
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.sampling import SamplingParams, processed_probs
from loraserve.runtime.sampling.processors import RowState, process_logits


def sampled_counts(run, requests) -> torch.Tensor:
    """``[V, V, V]`` counts of each request's three tokens (every request finished cleanly)."""
    vocab = run.engine.runner.vocab_size
    counts = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    for rid, *_ in requests:
        out = run.outputs[rid]
        assert out.error is None and len(out.tokens) == 3
        counts[tuple(out.tokens)] += 1
    return counts


def reference_law(
    runner: ModelRunner, adapter: str | None, prompt: list[int], params: SamplingParams
) -> torch.Tensor:
    """The target's joint law of three tokens sampled with ``params`` (its logit processing,
    temperature and filters), ``[V, V, V]``, from plain forwards with the request's adapter."""
    counter = itertools.count()

    def dist(outputs: list[int]) -> torch.Tensor:
        prefix = [*prompt, *outputs]
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            request_ids=[f"ref{next(counter)}"],
            input_ids=torch.tensor(prefix, dtype=torch.int64),
            extend_lens=[len(prefix)],
            lora_names=[adapter],
        )
        logits = runner.forward(batch).logits
        runner.kv.free(batch.request_ids[0])
        logits = process_logits(logits, [RowState(params, prompt, outputs)])
        return processed_probs(logits, [params])[0].double()

    vocab = runner.vocab_size
    joint = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    p1 = dist([])
    for a in p1.nonzero().flatten().tolist():
        p2 = dist([a])
        for b in p2.nonzero().flatten().tolist():
            joint[a, b] = p1[a] * p2[b] * dist([a, b])
    return joint
